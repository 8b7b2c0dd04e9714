"""The training loop of ``train_lm`` and ``finetune_hf``: open (or resume) the run directory under
its lock, train, log, validate, checkpoint, plot and sample.

Nothing is lost: the run directory is locked while a run uses it (a second run is refused in one
line naming the holder), ``metrics.jsonl``, ``args.json`` and the plots are replaced whole
(:mod:`recipes._lm.files`), and a non-finite loss stops the run without saving over the last good
checkpoint, as does an out-of-memory (one line with the planner's way out: :mod:`recipes._lm.oom`;
the state a failed step was given is donated, so nothing is saved from it). SIGTERM (a preempted
machine, a scheduler's time limit) or Ctrl-C ends the step in progress, saves a checkpoint of it and
exits with 128 + the signal's number, saying how to resume; a second signal stops at once.
"""

from __future__ import annotations

import hashlib
import math
import pathlib
import signal
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import checkpointing
import transforms
from recipes._lm import cli, files, oom, trackers
from recipes._lm.flags import build_parser, parse_run
from recipes._lm.monitor import MetricsLog, Progress, peak_flops, placement, plot_losses, plot_placement, read_jsonl
from recipes._lm.offload import OffloadSpec
from recipes._lm.run import Run, all_finite, default_out
from recipes._lm.run_setup import sample


def params_digest(model) -> str:
    """SHA-256 of every parameter, gathered from all processes."""
    from jax.experimental import multihost_utils

    arrays = multihost_utils.process_allgather(eqx.filter(model, eqx.is_array), tiled=True)
    digest = hashlib.sha256()
    for x in jax.tree.leaves(arrays):
        digest.update(np.ascontiguousarray(x).tobytes())
    return digest.hexdigest()


def open_run(args, offload: OffloadSpec | None = None, logs: cli.LibraryLogs | None = None):
    """``(run, run directory, checkpointer, start step, lock)``: the run built from ``args``, its
    directory locked (by the lead process; ``lock.release()`` when done), and the step it starts
    after (0, or that of the checkpoint it resumes from). A directory that already exists is
    locked before the run is built, so a live run's directory is refused before anything loads.
    ``logs``: sent to the run directory's ``orbax.log``."""
    out = pathlib.Path(args.out or default_out(args.model))
    if args.out is None and jax.process_count() > 1:
        raise SystemExit("a multi-process run needs --out (a directory all processes share)")
    lead = jax.process_index() == 0
    lock = files.RunLock(out, what=f"--resume {args.resume}" if args.resume else f"--out {out}")
    if lead and out.is_dir():
        lock.acquire()
    try:
        run = Run(args, offload)
        if lead:
            out.mkdir(parents=True, exist_ok=True)
            if not lock.held:
                lock.acquire()
            if logs is not None:
                logs.to(out / "orbax.log")
        args.out = str(out)
        ckpt = checkpointing.Checkpointer(out / "checkpoints", keep=args.keep)
        if not args.resume:
            return run, out, ckpt, 0, lock
        try:
            warn = None if lead else (lambda line: None)
            start, state, meta = cli.restore(ckpt, run.state(), step=None, what=f"--resume {args.resume}", warn=warn)
        except BaseException:
            ckpt.close()
            raise
    except BaseException:
        lock.release()
        raise
    run.set_state(state, meta)
    return run, out, ckpt, start, lock


def announce(run: Run, out: pathlib.Path, start: int, say) -> float:
    """Print what is about to run; returns the unigram baseline (bits per byte)."""
    args, cfg = run.args, run.config
    say(
        f"{args.model}: {cfg.n_params():,} params | train {len(run.corpus.train):,} tokens, "
        f"val {len(run.corpus.val):,} | {jax.device_count()} x {jax.devices()[0].device_kind} | "
        f"{jax.process_count()} process(es) | run dir {out}"
    )
    for note in run.corpus.notes:
        say(note)
    if run.lora:
        trained = sum(x.size for x in jax.tree.leaves(eqx.filter(run.model, transforms.trainable_mask(run.model))))
        say(
            f"LoRA rank {args.lora_rank} on {args.lora_targets}: {trained:,} trained parameters, "
            f"{cfg.n_params():,} frozen"
        )
    if start:
        say(f"resumed at step {start} from {out}")
    if run.plan is not None:
        say(run.plan)
    if run.offload.any or run.lora:
        # The host line adds the runtime's share (measured at start) and the host bytes the step
        # adds (gradients of host weights, offloaded activations), so its expected peak is the
        # process's, not the state's alone.
        prediction = run.prediction() or None
        report = transforms.memory_report(
            params=run.model, opt_state=run.opt_state, host_baseline=run.host_baseline, plan=prediction
        )
        say(report)
    baseline = run.corpus.unigram_bits_per_byte()
    say(f"unigram baseline: {baseline:.3f} bits/byte")
    return baseline


def stop_on_bad_numbers(step: int, loss: float, ckpt, out, lr: float) -> None:
    """Stop without saving when the loss (or, at a save, a weight) is not finite."""
    ckpt.wait()
    good = ckpt.latest_step()
    what = f"the training loss is {loss}" if not math.isfinite(loss) else "the parameters are not finite"
    if good:
        todo = (
            f"the last good checkpoint is step {good} in {out}. Lower --lr or raise --warmup and continue from it: "
            f"--resume {out} --lr {lr / 10:g}"
        )
    else:
        todo = "no checkpoint was saved. Start again with a lower --lr or a longer --warmup"
    raise SystemExit(f"step {step}: {what}; stopping without saving. {todo}")


class _Stop:
    """SIGTERM and SIGINT, while the steps run (one process, the main thread): the first asks the
    loop to stop after the step in progress, with a checkpoint of it; a second one acts as it would
    have without this (the previous handler: Python's KeyboardInterrupt, or termination)."""

    def __init__(self):
        self.signum = None
        self._before = {}

    def _handle(self, signum, frame):
        if self.signum is not None:  # the second: stop now
            signal.signal(signum, self._before.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.signum = signum

    def __enter__(self):
        import threading

        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._before[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._before.items():
            signal.signal(sig, handler)


def train_loop(
    run: Run, ckpt, out, *, start: int, last: int, baseline: float, log, progress, summary, stop=None
) -> int:
    """Steps ``start + 1 .. last``: train, log, validate, checkpoint; returns the last step done
    (before ``last`` where ``stop`` saw a signal: that step is checkpointed)."""
    args = run.args
    for step in range(start + 1, last + 1):
        batch = run.batch("train", step, args.seed)
        model, opt_state, metrics = run.step_fn(run.model, run.opt_state, batch, key=run.step_key(step))
        loss = float(metrics["loss"])
        stopping = stop is not None and stop.signum is not None
        saving = (args.save_every and step % args.save_every == 0) or step == last or stopping
        if not math.isfinite(loss) or (saving and not bool(all_finite(model))):
            stop_on_bad_numbers(step, loss, ckpt, out, args.lr)
        run.model, run.opt_state = model, opt_state
        summary["losses"][step] = loss
        rates = progress.update(step, loss)
        if log:
            log.log(
                kind="train",
                step=step,
                loss=loss,
                train_bits_per_byte=run.bits_per_byte(float(metrics["cross_entropy"])),
                grad_norm=float(metrics["grad_norm"]),
                **{k: float(v) for k, v in metrics.items() if k not in ("loss", "grad_norm", "cross_entropy")},
                lr=float(run.schedule(step - 1)),  # the rate this step's update used (optax counts from 0)
                time=time.time(),
                **rates,
            )
        if step % args.eval_every == 0 or step == args.steps:
            run.flush()  # a deferred update's pending one: validate the weights this step produced
            val = run.val_bits_per_byte()
            summary["val"][step] = val
            progress.write(f"step {step:5d}  val {val:.3f} bits/byte (unigram {baseline:.3f})")
            if log:
                log.log(kind="val", step=step, val_bits_per_byte=val, time=time.time())
        if saving:
            ckpt.save(step, run.state(), metadata=run.metadata(step))
        if stopping:
            run.flush()
            return step
    run.flush()  # what comes after (plots, samples, exports) reads the up-to-date weights
    return last


def finish(run: Run, out: pathlib.Path, baseline: float, say) -> None:
    """After the last step: the plots (lead process) and the samples."""
    args = run.args
    if jax.process_count() > 1:  # every process shows what it ends with: they must agree
        print(f"process {jax.process_index()}: params sha256 {params_digest(run.model)}")
    if jax.process_index() == 0:
        records = read_jsonl(out / "metrics.jsonl")
        plot_losses(
            records, out / "loss.png", baseline=baseline, title=f"{args.model} on {args.data or 'Python stdlib'}"
        )
        plot_placement(
            placement(eqx.filter(run.model, eqx.is_array), run.opt_state, run.prediction()),
            out / "placement.png",
            title=f"where the training state lives ({run.offload.label})",
        )
        say(f"wrote {out / 'metrics.jsonl'}, {out / 'loss.png'}, {out / 'placement.png'}")
    show_samples(run, say, "sample:")


def show_samples(run: Run, say, label: str) -> None:
    """Continuations of ``--prompt`` (``zoo.generate``, with a KV cache), unless ``--quiet-samples``
    or several processes; before training (``--sample-before``) and after it, to compare."""
    args = run.args
    if args.quiet_samples or jax.process_count() > 1:
        return
    prompt = run.tokenizer.encode(args.prompt.encode())
    for row in sample(run.model, prompt, 100, jax.random.wrap_key_data(jnp.asarray(run.rng, jnp.uint32))):
        say(label, repr(args.prompt + run.tokenizer.decode(row)))


def main(
    argv=None,
    *,
    defaults: dict | None = None,
    build=build_parser,
    warnings: tuple[str, ...] = (),
    recipe: str = "train_lm",
) -> dict:
    """Run the recipe; returns a summary (final step, losses, paths, the model). ``defaults``,
    ``build``: the defaults and parser of a recipe built on this one (see
    :func:`recipes._lm.flags.parse_run`); ``warnings``: its own lines, shown with the run's;
    ``recipe``: its name, which begins the line of an out-of-memory (:mod:`recipes._lm.oom`)."""
    advice = oom.TrainAdvice()
    with oom.exits(recipe, advice), cli.LibraryLogs() as logs:
        return _main(argv, defaults, build, logs, list(warnings), advice)


def _main(argv, defaults: dict | None, build, logs: cli.LibraryLogs, warnings: list[str], advice) -> dict:
    parsed = parse_run(argv, defaults, distributed=True, build=build)
    parsed.warnings[:0] = warnings
    args = parsed.args
    advice.args, advice.offload = args, parsed.offload
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    run, out, ckpt, start, lock = open_run(args, parsed.offload, logs)
    try:
        return _train(run, out, ckpt, start, parsed, build(defaults).parse_args(argv), say)
    finally:
        lock.release()


def _train(run: Run, out: pathlib.Path, ckpt, start: int, parsed, recipe_args, say) -> dict:
    args = run.args
    lead = jax.process_index() == 0
    try:
        for line in parsed.changes:
            say(line)
        if lead:
            for line in [*parsed.warnings, *run.warnings]:
                print(f"warning: {line}", file=sys.stderr)
        baseline = announce(run, out, start, say)
        if start >= args.steps:
            say(f"the run in {out} has finished its {args.steps} steps; give --steps above {start} to train further")
        if args.sample_before and start == 0:
            show_samples(run, say, "sample before training:")
        log = None
        if lead:
            files.write_text(out / "args.json", _json(vars(args)))
            jsonl = MetricsLog(out / "metrics.jsonl", truncate_after=start)
            # every flag: the run's, and those of a recipe built on this one (finetune_hf's --export ...)
            config = {**vars(recipe_args), **vars(args)}
            log = trackers.Trackers(jsonl, args.tracker, out, config=config, start=start)
        progress = Progress(
            total=args.steps,
            initial=start,
            tokens_per_step=args.batch * args.seq,
            flops_per_token=run.config.flops_per_token(args.seq),
            peak=peak_flops(args.compute_dtype),
            log_every=args.log_every,
            enabled=lead,
        )
    except BaseException:
        ckpt.close()
        raise
    last = min(args.steps, start + args.stop_after) if args.stop_after else args.steps
    summary = {"out": str(out), "start_step": start, "losses": {}, "val": {}}
    stop = _Stop()
    try:
        with stop:
            done = train_loop(
                run,
                ckpt,
                out,
                start=start,
                last=last,
                baseline=baseline,
                log=log,
                progress=progress,
                summary=summary,
                stop=stop,
            )
    finally:
        progress.close()
        ckpt.close()  # waits for the background write of the last checkpoint
        if log:
            log.close()
    if stop.signum is not None:
        name = signal.Signals(stop.signum).name
        say(f"stopped by {name} after step {done} of {args.steps}, saved; continue with: --resume {out}")
        raise SystemExit(128 + stop.signum)
    summary["final_step"] = last
    summary["finished"] = last == args.steps
    summary["model"], summary["opt_state"] = run.model, run.opt_state
    if last < args.steps:
        say(f"stopped after step {last} of {args.steps}; continue with: --resume {out}")
        return summary
    finish(run, out, baseline, say)
    return summary


def _json(flags: dict) -> str:
    import json

    return json.dumps(flags, indent=2)
