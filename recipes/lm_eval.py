"""Score a model on EleutherAI's lm-evaluation-harness tasks (``pip install -e '.[eval]'``).

    python -m recipes.lm_eval path/to/hf_checkpoint --tasks hellaswag,arc_easy --output-path results
    python -m recipes.lm_eval runs/llama-tiny-20261202-120000 --tasks lambada_openai --limit 100
    python -m recipes.lm_eval llama:tiny --tasks my_task --include-path my_tasks/ --log-samples \
        --output-path results
    python -m recipes.lm_eval path/to/hf_checkpoint --tasks piqa --offload params --cache-memory-kind pinned_host

``MODEL`` is a Hugging Face checkpoint directory (its ``tokenizer.json`` encodes the text), a
``train_lm`` run directory (its last intact checkpoint, or ``--step``), or a ``FAMILY:PRESET`` name
(random weights and the byte tokenizer: a smoke test of the wiring). :class:`ZooLM` is the model
class ``lm_eval`` calls: ``loglikelihood`` and ``loglikelihood_rolling`` run the model over padded
batches (one compiled program per batch width), ``generate_until`` runs :func:`zoo.generate`.
The results are lm-eval's own JSON (``--output-path``), with its per-sample files under
``--log-samples``.
"""

from __future__ import annotations

import argparse
import functools
import pathlib

import jax

import transforms
import zoo
from recipes._lm import cli, files, oom
from recipes._lm.flags import MAX_SEED
from recipes._lm.loading import is_run_dir, load_for_inference, source_config
from recipes._lm.memory import check_generation_memory
from recipes._lm.run_setup import is_hf_dir, one_line_warnings

#: The names this module lends from :mod:`recipes._lm.zoo_lm` (which imports ``lm_eval``).
_LM_NAMES = ("ZooLM", "Tokens", "BYTE_PREFIX")


def __getattr__(name: str):
    """``recipes.lm_eval.ZooLM`` and ``Tokens``, imported on first use (they need ``lm_eval``)."""
    if name in _LM_NAMES:
        from recipes._lm import zoo_lm

        return getattr(zoo_lm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load(
    source: str, *, step: int | None, dtype: str | None, quantize: str | None, seed: int = 0, offload: bool = False
):
    """``(model, tokens)`` of a Hugging Face directory, a ``train_lm`` run directory or a
    ``FAMILY:PRESET`` name (random weights, byte tokenizer); with ``offload``, the weights in
    ``transforms.offload_params``' placement (see :func:`recipes._lm.loading.load_for_inference`)."""
    from recipes._lm.flags import saved_flags
    from recipes._lm.zoo_lm import Tokens

    if is_hf_dir(source) or is_run_dir(source):
        model, _, _ = load_for_inference(source, step=step, dtype=dtype, quantize=quantize, offload=offload)
        directory = source if is_hf_dir(source) else saved_flags(source).model
        return model, Tokens(directory if is_hf_dir(directory) else None)
    config = source_config(source, what="MODEL")
    if dtype is not None:
        config = config.replace(param_dtype=dtype)
    model = zoo.build_model(config, key=jax.random.key(seed))
    if quantize is not None:
        model = transforms.quantize(model, quantize)
    if offload:
        model = transforms.offload_params(model)
    return model, Tokens(None)


def build_parser() -> argparse.ArgumentParser:
    """The command line's flags (no ``lm_eval`` import: ``--help`` works without the extra)."""
    p = cli.Parser(prog="python -m recipes.lm_eval", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("model", help="a Hugging Face checkpoint directory, a train_lm run directory, or FAMILY:PRESET")
    a("--tasks", required=True, help="comma-separated lm-eval task (or group) names")
    a("--include-path", default=None, help="a directory of your own task YAML files")
    a("--limit", type=float, default=None, help="at most this many samples per task (below 1: a fraction)")
    a("--num-fewshot", type=int, default=None, help="few-shot examples per prompt (default: the task's)")
    a("--output-path", default=None, help="write lm-eval's results JSON (and --log-samples files) under here")
    a("--log-samples", action="store_true", help="also write every sample's inputs, outputs and scores")
    a("--batch-size", type=int, default=8, help="sequences per forward pass and prompts per generation")
    a("--max-gen-toks", type=int, default=256, help="new tokens per generation unless a task says otherwise")
    a(
        "--max-length",
        type=int,
        default=None,
        help="longest sequence scored or generated, longer texts scored in windows (default: the model's positions)",
    )
    a("--step", type=int, default=None, help="checkpoint step of a run directory (default: the latest intact one)")
    a("--dtype", default=None, help="parameter dtype (a Hugging Face model: default the checkpoint's)")
    a("--offload", default="", choices=["", "params"], help="'params': layer weights stream from host memory")
    a("--quantize", default=None, choices=["nf4", "int8"], help="evaluate with the layers' weights quantized")
    a(
        "--cache-memory-kind",
        default=None,
        choices=["device", "pinned_host"],
        help="'pinned_host' keeps generation's KV cache in host memory",
    )
    a("--seed", type=int, default=0, help="seed of sampled generations (and of a FAMILY:PRESET's weights)")
    return p


def check(args: argparse.Namespace, given: set[str] = frozenset()) -> None:
    """Every check of the flags that needs no ``lm_eval`` and no weights (`SystemExit`: one line);
    ``given``: the flags the command line named."""
    cli.at_least("batch_size", args.batch_size, 1)
    cli.at_least("max_gen_toks", args.max_gen_toks, 1)
    if args.max_length is not None:
        cli.at_least("max_length", args.max_length, 2)
    if args.num_fewshot is not None:
        cli.at_least("num_fewshot", args.num_fewshot, 0)
    if args.limit is not None and not (0 < args.limit < 1 or (args.limit >= 1 and args.limit == int(args.limit))):
        raise SystemExit(
            f"--limit {args.limit}: give a whole number of samples per task (e.g. --limit 100) or a fraction "
            "below 1 (e.g. --limit 0.1)"
        )
    cli.in_range("seed", args.seed, 0, MAX_SEED)
    if args.dtype is not None:
        if is_run_dir(args.model):
            raise SystemExit(f"--dtype {args.dtype}: {args.model} is a train_lm run, which keeps its own dtype")
        cli.choice("dtype", args.dtype, zoo.DTYPES)
    if args.step is not None and not is_run_dir(args.model):
        raise SystemExit(f"--step {args.step}: {args.model} is not a train_lm run directory, which has no steps")
    if args.step is not None:
        cli.checkpoint_steps(pathlib.Path(args.model), args.step, args.model)
    if args.log_samples and args.output_path is None:
        raise SystemExit("--log-samples writes files: give --output-path DIR too")
    if args.output_path is not None:
        files.check_output_dir("--output-path", args.output_path)
    if args.include_path is not None and not pathlib.Path(args.include_path).is_dir():
        raise SystemExit(f"--include-path {args.include_path}: not a directory")
    config = source_config(args.model, what="MODEL")
    positions = config.max_seq_len
    if args.max_length is not None:
        cli.at_most("max_length", args.max_length, positions, " (the model's positions)")
    longest = args.max_length or positions
    if "max_gen_toks" in given:  # the default is lm-eval's; a longer one is cut to the positions (see ZooLM)
        why = f" (a generation holds {longest} positions, prompt included)"
        cli.at_most("max_gen_toks", args.max_gen_toks, longest - 1, why)
    check_generation_memory(config, batch=args.batch_size, context=longest, flags=f"--batch-size {args.batch_size}")


def import_lm_eval():
    """``lm_eval`` and the parts the command line uses; a missing package is one line."""
    try:
        import lm_eval
        from lm_eval import utils as lm_utils
        from lm_eval.loggers import EvaluationTracker
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise SystemExit(
            f"recipes.lm_eval runs EleutherAI's lm-evaluation-harness, which is not installed ({err}): "
            "pip install -e '.[eval]'"
        ) from None
    return lm_eval, lm_utils, EvaluationTracker, TaskManager


def task_manager(include_path: str | None):
    """lm-eval's index of its tasks (and those under ``include_path``). Building it reads every
    task's file, seconds each time, so a process keeps it while the files under ``include_path``
    stay as they were (their names and modification times)."""
    files = ()
    if include_path is not None:
        found = sorted(pathlib.Path(include_path).rglob("*"))
        files = tuple((str(f), f.stat().st_mtime_ns) for f in found if f.is_file())
    return _task_manager(include_path, files)


@functools.cache
def _task_manager(include_path: str | None, files: tuple):
    _, _, _, TaskManager = import_lm_eval()
    return TaskManager(include_path=include_path)


def main(argv=None) -> dict:
    """Score the model on the tasks; returns lm-eval's results. An out-of-memory is one line
    (:mod:`recipes._lm.oom`)."""
    args = build_parser().parse_args(argv)
    advice = oom.GenerateAdvice(
        source=args.model,
        batch=args.batch_size,
        context=args.max_length,
        weights="stream" if args.offload == "params" else "device",
        cache="host" if args.cache_memory_kind == "pinned_host" else "device",
        dtype=args.dtype,
        quantize=args.quantize,
        smaller="a smaller --batch-size or --max-length",
        what="the evaluation",
    )
    with oom.exits("lm_eval", advice):
        return _main(args, argv)


def _main(args: argparse.Namespace, argv) -> dict:
    check(args, set(cli.given_flags(build_parser(), argv)))
    lm_eval, lm_utils, EvaluationTracker, _ = import_lm_eval()
    from recipes._lm.zoo_lm import ZooLM

    tasks = [t for t in args.tasks.split(",") if t]
    manager = task_manager(None if args.include_path is None else str(args.include_path))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown or not tasks:
        raise SystemExit(
            f"--tasks {args.tasks}: unknown task {', '.join(unknown) or '(none given)'}; "
            "`lm-eval ls tasks` lists them (and --include-path adds your own)"
        )
    with cli.LibraryLogs():
        model, tokens = load(
            args.model,
            step=args.step,
            dtype=args.dtype,
            quantize=args.quantize,
            seed=args.seed,
            offload=args.offload == "params",
        )
    lm = ZooLM(
        model,
        tokens,
        batch_size=args.batch_size,
        max_gen_toks=args.max_gen_toks,
        max_length=None if args.max_length is None else min(args.max_length, model.config.max_seq_len),
        cache_memory_kind=args.cache_memory_kind,
        seed=args.seed,
    )
    tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=args.num_fewshot,
        limit=int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit,
        log_samples=args.log_samples,
        evaluation_tracker=tracker,
        task_manager=manager,
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
    )
    samples = results.pop("samples", None) if args.log_samples else None
    if tracker is not None:
        tracker.general_config_tracker.model_name = args.model
        tracker.general_config_tracker.model_name_sanitized = lm_utils.sanitize_model_name(args.model)
        tracker.save_results_aggregated(results=results, samples=samples)
        if samples is not None:
            for task in results["configs"]:
                tracker.save_results_samples(task_name=task, samples=samples[task])
    print(lm_utils.make_table(results))
    if samples is not None:
        results["samples"] = samples
    return results


if __name__ == "__main__":
    one_line_warnings()
    main()
