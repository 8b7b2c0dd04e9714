"""Train a language model on local text, with checkpoints, resume, progress and plots.

By default a tiny byte-level Llama learns the Python standard library's own source (found
through `sysconfig`: no download), in about two minutes on 2 CPU cores:

    python -m recipes.train_lm
    python -m recipes.train_lm --model gpt2:tiny --steps 500 --data path/to/text_or_dir
    python -m recipes.train_lm --offload params,opt_state,activations     # state in host memory
    python -m recipes.train_lm --plan h100                                # the planner chooses
    python -m recipes.train_lm --mesh data=2,fsdp=4                       # 8 devices
    python -m recipes.train_lm --resume runs/llama-tiny-20261202-120000   # continue a run
    python -m recipes.train_lm --resume runs/llama-tiny-20261202-120000 --steps 600 --lr 1e-3
    python -m recipes.train_lm --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0

Each run writes to ``--out`` (default ``runs/<model>-<time>``): ``checkpoints/`` (orbax; the
last ``--keep``; model, optimizer state, step, RNG, data position and every flag, so
``--resume DIR`` needs nothing else), ``metrics.jsonl``, ``loss.png`` (training and validation
loss in bits per byte, with the unigram baseline), ``placement.png`` (device vs host bytes of
params, gradients, optimizer state, activations) and ``orbax.log`` (the checkpoint library's own
log messages, kept off the terminal); with ``--tracker tensorboard,wandb`` also ``tensorboard/``
event files and a ``wandb/`` run holding the metrics of ``metrics.jsonl``.

``--resume DIR`` takes every flag from the run's checkpoint; flags given with it change what may
change mid-run (`CHANGEABLE`: the schedule, clipping, checkpoints, evaluation, logging), each
change printed (``--lr: 0.003 -> 0.001``); the others (`KEPT`: the model, the data, the batch, the
mesh, the offload set) are refused, saying why. The learning rate of every step is the schedule
of the current flags at that step: a longer ``--steps`` re-stretches the decay over the new
length (from the resumed step on, the rate is what a run of that length has there).

A mistake on the command line is one line on stderr and a nonzero exit, before anything runs.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import checkpointing
import transforms
import zoo
from recipes._lm import cli, trackers
from recipes._lm.data import TOKEN_DTYPES, TRAIN_ON, ByteTokenizer, HFTokenizer, batch_at, open_corpus, segments_at
from recipes._lm.monitor import (
    MetricsLog,
    Progress,
    peak_flops,
    placement,
    plot_losses,
    plot_placement,
    read_jsonl,
)
from recipes._lm.run_setup import (
    apply_lora,
    apply_offload,
    build_model,
    check_seq,
    decay_mask,
    hf_config,
    init_distributed,
    is_hf_dir,
    lr_schedule,
    lr_schedule_warning,
    make_config,
    make_optimizer,
    one_line_warnings,
    parse_mesh,
    parse_offload,
    process_rows,
    put_batch,
    sample,
)

#: Flags that control one invocation, not the run: a resumed run takes them from the command line.
RUN_CONTROL = ("resume", "stop_after", "coordinator", "num_processes", "process_id", "quiet_samples")
#: Flags a resumed run may change (``--resume DIR --lr 1e-3``), each change printed.
CHANGEABLE = (
    "steps",
    "lr",
    "warmup",
    "schedule",
    "clip",
    "weight_decay",
    "accum",
    "save_every",
    "keep",
    "eval_every",
    "eval_batches",
    "log_every",
    "tracker",
    "prompt",
    "sample_before",
)
#: Flags a resumed run keeps from its checkpoint, and why (a different value is refused).
KEPT = {
    "the checkpoint holds this model's weights and optimizer state": (
        "model",
        "param_dtype",
        "compute_dtype",
        "base_dtype",
        "lora_rank",
        "lora_alpha",
        "lora_targets",
        "lora_dropout",
        "quantize",
    ),
    "the batch of each step is drawn from the data with the seed, batch and sequence length, "
    "so that a resumed run sees the batches an uninterrupted one would": (
        "data",
        "data_bytes",
        "data_dtype",
        "data_field",
        "train_on",
        "pack",
        "seed",
        "batch",
        "seq",
    ),
    "the run's arrays are laid out over its mesh": ("mesh",),
    "where its state lives (the offload set) is part of the run": ("offload", "activations", "prefetch", "plan"),
    "it writes to its own directory": ("out",),
}
#: What a run saved before a flag existed did, where that is not the flag's default: runs from before
#: --pack trained on one stream.
BEFORE_FLAG = {"pack": False}
SCHEDULES = ("cosine", "linear", "constant")
VAL_SEED = 12345


def build_parser(
    defaults: dict | None = None, *, only=None, skip=(), parser: argparse.ArgumentParser | None = None
) -> argparse.ArgumentParser:
    """The recipe's flags; for recipes built on this one, those named in ``only`` (default: all)
    but not in ``skip``, added to ``parser`` (a parser or an argument group)."""
    p = parser or cli.Parser(prog="python -m recipes.train_lm", description=__doc__.split("\n\n")[0])

    def a(*names, **kwargs):
        dest = names[0].lstrip("-").replace("-", "_")
        if (only is None or dest in only) and dest not in skip:
            p.add_argument(*names, **kwargs)

    a(
        "--model",
        default="llama:tiny",
        help="FAMILY:PRESET (llama:tiny, gpt2:124m, ...) or a Hugging Face checkpoint dir",
    )
    a(
        "--data",
        default=None,
        help="text file, directory of text files, .jsonl (a 'text' or chat 'messages' field per line), a "
        "datasets.save_to_disk directory, .parquet, or pre-tokenized .bin (default: the Python standard library)",
    )
    a(
        "--data-bytes",
        type=int,
        default=None,
        help="read at most this many bytes of text (default: all of --data; 2,000,000 of the standard library)",
    )
    a("--data-dtype", default=None, help="token dtype of a pre-tokenized .bin file: uint16 or uint32")
    a("--data-field", default=None, help="the JSON field or dataset column to read (default: text, else messages)")
    a(
        "--train-on",
        default="assistant",
        choices=TRAIN_ON,
        help="chat data: the loss covers the assistant's tokens only, or all tokens",
    )
    a(
        "--pack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="packed documents: attention stays within each document of a sequence and its positions start at 0 "
        "(--no-pack: each sequence is one stream across document boundaries)",
    )
    a("--steps", type=int, default=300, help="total optimizer steps (the learning-rate schedule's length)")
    a("--batch", type=int, default=16, help="global batch (sequences per step)")
    a("--seq", type=int, default=128, help="tokens per sequence")
    a("--accum", type=int, default=1, help="gradient accumulation: micro-batches per step")
    a("--lr", type=float, default=3e-3, help="peak learning rate (after --warmup; then --schedule)")
    a("--warmup", type=int, default=40, help="steps of linear warmup from 0 to --lr")
    a(
        "--schedule",
        default="cosine",
        choices=SCHEDULES,
        help="after the warmup: cosine or linear decay to lr/10 at --steps, or constant",
    )
    a("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    a("--clip", type=float, default=1.0, help="global gradient-norm clip")
    a("--param-dtype", default="float32", help="dtype of the trained weights (a checkpoint's too, unless --lora-rank)")
    a("--base-dtype", default=None, help="with --lora-rank: dtype of the frozen base (default: the checkpoint's own)")
    a("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank on a frozen base (0: train all)")
    a("--lora-alpha", type=float, default=None, help="LoRA scale numerator (default: twice the rank)")
    a("--lora-targets", default="q_proj,v_proj", help="projections to adapt (q_proj,k_proj,v_proj,o_proj,gate,up,down)")
    a("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    a("--quantize", default=None, choices=["nf4", "int8"], help="with --lora-rank: the frozen base quantized (QLoRA)")
    a("--compute-dtype", default="float32", help="e.g. bfloat16 on a GPU")
    a("--seed", type=int, default=0, help="seed of the initial weights and of the batches")
    a("--mesh", default=None, help="device mesh sizes, e.g. data=2,fsdp=4,tensor=1 (default: no mesh)")
    a("--offload", default="", help="comma-separated subset of params,opt_state,activations for pinned_host")
    a(
        "--activations",
        default="block_input",
        help=f"with --offload activations: a preset ({', '.join(transforms.ACTIVATION_PRESETS)}) "
        "or comma-separated activation names",
    )
    a(
        "--prefetch",
        action="store_true",
        help="with --offload params: copy layer i+1's weights while layer i computes (offload_params(prefetch=True))",
    )
    a(
        "--plan",
        metavar="DEVICE",
        default=None,
        help=f"apply the planner's choice ({', '.join(transforms.DEVICE_PROFILES)})",
    )
    a("--eval-every", type=int, default=50, help="validation loss every N steps (and at the end)")
    a("--eval-batches", type=int, default=8, help="batches of the validation split per evaluation")
    a("--log-every", type=int, default=20, help="a progress line every N steps")
    a(
        "--tracker",
        default="jsonl",
        help="where metrics go: some of jsonl,tensorboard,wandb (jsonl, metrics.jsonl, is always on)",
    )
    a("--save-every", type=int, default=100, help="checkpoint every N steps (and at the end); 0: only at the end")
    a("--keep", type=int, default=3, help="checkpoints to keep")
    a("--out", default=None, help="run directory (default runs/<model>-<time>)")
    a(
        "--resume",
        default=None,
        metavar="DIR",
        help="continue the run in DIR from its last intact checkpoint, with its flags; flags given with it "
        "change the schedule, clipping, checkpoints, evaluation or logging (not the model, data, batch, mesh "
        "or offload set)",
    )
    a("--stop-after", type=int, default=None, help="stop (with a checkpoint) after this many steps in this invocation")
    a("--prompt", default="def main(", help="prompt for the samples printed at the end")
    a("--quiet-samples", action="store_true", help="skip sampling at the end")
    a("--sample-before", action="store_true", help="also sample before the first step")
    a("--coordinator", default=None, help="HOST:PORT of process 0, for a multi-process run")
    a("--num-processes", type=int, default=None, help="processes of a multi-process run")
    a("--process-id", type=int, default=None, help="this process's index (0 .. N-1)")
    if defaults:
        p.set_defaults(**defaults)
    return p


def parse(argv, defaults=None, *, distributed: bool = False) -> argparse.Namespace:
    """The run's flags (see :func:`parse_run`)."""
    return parse_run(argv, defaults, distributed=distributed)[0]


def parse_run(
    argv, defaults=None, *, distributed: bool = False, build=build_parser
) -> tuple[argparse.Namespace, list[str], list[str]]:
    """``(flags, changes, warnings)``: the run's flags; with ``--resume``, those saved in its
    checkpoint, changed by the flags of `CHANGEABLE` given with it (``changes``: one line each)
    and this invocation's `RUN_CONTROL` flags. Every value is checked (`SystemExit`: one line).
    ``distributed``: start the multi-process runtime first (it must precede any other JAX call,
    reading a checkpoint included). ``build(defaults)``: the parser of a recipe built on this one
    (``finetune_hf``): its flags besides this recipe's are not the run's, and are dropped."""
    parser = build(defaults)
    args = parser.parse_args(argv)
    ours = {a.dest for a in build_parser()._actions if a.dest != "help"}
    args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k in ours})
    if distributed:
        init_distributed(args.coordinator, args.num_processes, args.process_id)
    changes = []
    if args.resume:
        given = {k: v for k, v in cli.given_flags(build(None), argv).items() if k in ours}
        args, changes = resumed(parser, args, given)
    check(args)
    warnings = []
    new_schedule = not args.resume or any(line.startswith(("--steps:", "--warmup:", "--lr:")) for line in changes)
    if new_schedule and jax.process_index() == 0 and (line := lr_schedule_warning(args.lr, args.warmup, args.steps)):
        warnings.append(line)
    return args, changes, warnings


def resumed(parser, args, given: dict) -> tuple[argparse.Namespace, list[str]]:
    """The flags of the run ``args.resume`` continues: its saved ones, with those of ``given``
    (the command line's) that may change applied, and ``args``' `RUN_CONTROL` flags."""
    run_dir = pathlib.Path(args.resume)
    metadata = cli.read_metadata(run_dir, f"--resume {args.resume}")
    saved = {**BEFORE_FLAG, **metadata["args"]}
    # (flags added since the run began take their defaults)
    flags = {**{k: parser.get_default(k) for k in vars(args)}, **saved}
    flags.update({k: getattr(args, k) for k in RUN_CONTROL})
    flags["out"] = args.resume
    why = {name: reason for reason, names in KEPT.items() for name in names}
    changes = []
    for name, value in given.items():
        if name in RUN_CONTROL or value == flags[name] or same_directory(value, flags[name]):
            continue
        if name not in CHANGEABLE:
            kept = "none" if flags[name] in (None, "") else cli.shown(flags[name])
            raise SystemExit(
                f"{cli.flag(name)} {cli.shown(value)}: a resumed run keeps its {cli.flag(name)} ({kept}): "
                f"{why[name]}; drop the flag, or start a new run without --resume"
            )
        changes.append(f"{cli.flag(name)}: {cli.shown(flags[name])} -> {cli.shown(value)}")
        flags[name] = value
    step = metadata.get("step", 0)
    if flags["steps"] < step:
        raise SystemExit(
            f"--steps {flags['steps']}: the run in {args.resume} is at step {step} already; give --steps above "
            f"{step} to train further"
        )
    return argparse.Namespace(**flags), changes


def batch_loss(loss_fn):
    """``loss_fn(model, tokens, mask, segment_ids=...)`` as a loss of a batch (see :meth:`Run.batch`):
    token windows, or ``{"tokens", "segment_ids", "mask"}`` (a packed batch's segment ids; chat data's
    loss mask: only the positions it marks count, the others get no gradient)."""

    def loss(model, batch):
        if not isinstance(batch, dict):
            return loss_fn(model, batch)
        return loss_fn(model, batch["tokens"], batch.get("mask"), segment_ids=batch.get("segment_ids"))

    return loss


def same_directory(a, b) -> bool:
    """Whether ``a`` and ``b`` name one existing directory (a path spelled two ways)."""
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    a, b = pathlib.Path(a), pathlib.Path(b)
    return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()


def check(args: argparse.Namespace) -> None:
    """Every check of the flags that needs no file and no model (`SystemExit`: one line)."""
    for name in ("steps", "batch", "seq", "accum", "eval_every", "eval_batches", "log_every", "keep"):
        cli.at_least(name, getattr(args, name), 1)
    cli.at_least("save_every", args.save_every, 0, " (0: a checkpoint at the end only)")
    if args.stop_after is not None:
        cli.at_least("stop_after", args.stop_after, 1)
    cli.positive("lr", args.lr, "3e-3")
    trackers.check_available(args.tracker)
    cli.at_least("warmup", args.warmup, 0)
    cli.choice("schedule", args.schedule, SCHEDULES)
    cli.positive("clip", args.clip, "1.0")
    cli.at_least("weight_decay", args.weight_decay, 0.0)
    for name in ("param_dtype", "compute_dtype"):
        cli.choice(name, getattr(args, name), zoo.DTYPES)
    if args.base_dtype is not None:
        cli.choice("base_dtype", args.base_dtype, zoo.DTYPES)
    if args.data_dtype is not None:
        cli.choice("data_dtype", args.data_dtype, TOKEN_DTYPES)
    cli.at_least("lora_rank", args.lora_rank, 0, " (0: train every weight)")
    if not 0 <= args.lora_dropout < 1:
        raise SystemExit(f"--lora-dropout {args.lora_dropout}: must be in [0, 1), e.g. --lora-dropout 0.05")
    if args.lora_alpha is not None:
        cli.positive("lora_alpha", args.lora_alpha, str(2 * max(args.lora_rank, 1)))
    if getattr(args, "quantize", None) and not args.lora_rank:
        raise SystemExit(
            f"--quantize {args.quantize} needs --lora-rank: quantized weights are frozen, only adapters train"
        )
    if args.data_bytes is not None:
        cli.at_least("data_bytes", args.data_bytes, 1)
    if args.batch % args.accum:
        raise SystemExit(
            f"--batch {args.batch} does not split into --accum {args.accum} micro-batches: make --batch a multiple "
            "of --accum"
        )
    if args.plan and args.offload:
        raise SystemExit(f"--plan {args.plan} chooses the offload transforms itself: give either --plan or --offload")
    if args.prefetch and not args.plan and "params" not in parse_offload(args.offload):
        raise SystemExit("--prefetch needs --offload params (it schedules the copies of host-resident weights)")
    parse_offload(args.offload)
    if args.out is not None and not args.resume and (pathlib.Path(args.out) / "checkpoints").is_dir():
        with checkpointing.Checkpointer(pathlib.Path(args.out) / "checkpoints") as ckpt:
            if ckpt.steps():
                raise SystemExit(
                    f"--out {args.out} already holds checkpoints: continue it with --resume {args.out}, "
                    "or choose a new --out"
                )


def resume_args(run_dir: str) -> dict:
    """The flags saved in the newest readable checkpoint of the run in ``run_dir``."""
    return {**BEFORE_FLAG, **cli.read_metadata(pathlib.Path(run_dir), f"--resume {run_dir}")["args"]}


def saved_flags(run_dir: str) -> argparse.Namespace:
    """The flags of the run in ``run_dir``, as :class:`Run` takes them (flags added since it began
    take their defaults)."""
    parser = build_parser()
    saved = resume_args(run_dir)
    return argparse.Namespace(**{**{a.dest: a.default for a in parser._actions if a.dest != "help"}, **saved})


def check_against_model(args: argparse.Namespace, config, *, lora: bool) -> None:
    """The flags that name parts of the model (activations, LoRA targets), checked against its
    abstract form: before anything is allocated or compiled."""
    if "activations" in parse_offload(args.offload) and args.activations not in transforms.ACTIVATION_PRESETS:
        valid = zoo.nn.checkpoint_names(zoo.abstract_model(config))
        unknown = [n for n in args.activations.split(",") if n not in valid]
        if unknown:
            raise SystemExit(
                f"--activations {args.activations}: {args.model} names no activation {', '.join(map(repr, unknown))}; "
                f"give a preset ({', '.join(transforms.ACTIVATION_PRESETS)}) or some of {', '.join(valid)}"
            )
    if lora:

        def adapted(key):
            return lora_from_flags(zoo.build_model(config, key=key), args)

        eqx.filter_eval_shape(adapted, jax.random.key(0))


def lora_from_flags(model, args: argparse.Namespace):
    """``model`` with the LoRA adapters the ``--lora-*`` flags describe (see ``apply_lora``)."""
    return apply_lora(
        model,
        rank=args.lora_rank,
        alpha=args.lora_alpha,
        targets=args.lora_targets,
        dropout=args.lora_dropout,
        dtype=args.param_dtype,
        seed=args.seed,
    )


def default_out(model: str) -> str:
    name = pathlib.Path(model).name if is_hf_dir(model) else model.replace(":", "-")
    return str(pathlib.Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


class Run:
    """Everything a run needs, built from its flags (also used by the evaluation recipe)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        hf = is_hf_dir(args.model)
        # Every check that reads only files comes first: a bad flag is one line, before any load or compile.
        if hf:
            self.config = hf_config(args.model)
            check_seq(args.seq, self.config.max_seq_len, args.model)
        if hf and (pathlib.Path(args.model) / "tokenizer.json").is_file():
            self.tokenizer = HFTokenizer(args.model)
        else:
            self.tokenizer = ByteTokenizer()
        if hf and self.config.vocab_size < self.tokenizer.vocab_size:
            raise SystemExit(
                f"the tokenizer of {args.model} has {self.tokenizer.vocab_size} tokens, more than the "
                f"{self.config.vocab_size} rows of the model's embedding"
            )
        if not hf:
            self.config = make_config(
                args.model,
                vocab_size=self.tokenizer.vocab_size,
                seq=args.seq,
                param_dtype=args.param_dtype,
                compute_dtype=args.compute_dtype,
            )
        self.mesh = parse_mesh(args.mesh)
        self.lora = getattr(args, "lora_rank", 0) > 0
        check_against_model(args, self.config, lora=self.lora)
        self.plan = None
        if args.plan:  # the plan clips itself (a streamed update needs clip_norm, not a chained clip)
            try:
                self.plan = transforms.plan(
                    self.config,
                    batch=args.batch,
                    seq=args.seq,
                    device=args.plan,
                    clip_norm=args.clip,
                    quantize=getattr(args, "quantize", None),
                )
            except (ValueError, TypeError) as err:
                raise SystemExit(f"--plan {args.plan}: {err}") from None
        self.corpus = open_corpus(
            args.data,
            self.tokenizer,
            limit=args.data_bytes,
            seed=args.seed,
            dtype=getattr(args, "data_dtype", None),
            field=getattr(args, "data_field", None),
            train_on=getattr(args, "train_on", "assistant"),
        )
        self.corpus.check(args.seq)
        self.pack = getattr(args, "pack", False)
        if self.pack and self.corpus.doc_starts is None and self.tokenizer.eos_id is None:
            raise SystemExit(
                f"--pack: {args.data} is pre-tokenized and the tokenizer has no end-of-sequence token, so its "
                "documents cannot be told apart; give --no-pack"
            )
        if hf:
            # Full fine-tuning trains --param-dtype master weights; a LoRA base stays frozen in --base-dtype.
            dtype = getattr(args, "base_dtype", None) if self.lora else args.param_dtype
            self.model = build_model(
                args.model,
                None,
                self.mesh,
                seed=args.seed,
                compute_dtype=args.compute_dtype,
                dtype=dtype,
                quantize=getattr(args, "quantize", None),
            )
            self.config = self.model.config
        else:
            quantize = getattr(args, "quantize", None)
            self.model = build_model(args.model, self.config, self.mesh, seed=args.seed, quantize=quantize)
        if self.config.vocab_size < self.tokenizer.vocab_size:
            raise SystemExit(
                f"{args.model} has {self.config.vocab_size} tokens, the tokenizer {self.tokenizer.vocab_size}"
            )
        if self.lora:
            self.model = lora_from_flags(self.model, args)
        schedule = {"lr": args.lr, "warmup": args.warmup, "steps": args.steps, "kind": args.schedule}
        hyper = {**schedule, "weight_decay": args.weight_decay}
        self.schedule = lr_schedule(**schedule)
        hyper["mask"] = decay_mask(self.model)  # no decay on norms, biases, scalars
        if self.plan is not None:
            optimizer = make_optimizer(**hyper, clip=None)
            self.model, optimizer = self.plan.apply(self.model, optimizer, clip_norm=args.clip)
            if args.prefetch and self.plan.candidate.params:
                self.model = zoo.nn.with_prefetch(self.model, True)
        else:
            optimizer = make_optimizer(**hyper, clip=args.clip)
            try:
                self.model, optimizer = apply_offload(
                    self.model, optimizer, parse_offload(args.offload), args.activations, prefetch=args.prefetch
                )
            except (ValueError, TypeError) as err:
                raise SystemExit(f"--offload {args.offload} --activations {args.activations}: {err}") from None
        # The loss and its parts (the cross-entropy; a mixture of experts' router losses), logged each step.
        self.step_fn = transforms.train_step(
            batch_loss(zoo.lm_loss_and_metrics), optimizer, accum_steps=args.accum, has_aux=True
        )
        self.opt_state = self.step_fn.init(self.model)
        #: the sampling key's data (kept in the checkpoint's metadata)
        self.rng = [int(x) for x in np.asarray(jax.random.key_data(jax.random.key(args.seed + 1)))]
        self.rows = process_rows(args.batch)
        self.eval_loss = eqx.filter_jit(batch_loss(zoo.lm_loss))
        self.dropout_key = jax.random.key(args.seed + 4) if getattr(args, "lora_dropout", 0) > 0 else None

    def step_key(self, step: int):
        """The dropout key of ``step`` (``None`` without dropout): a function of the seed and the step."""
        return None if self.dropout_key is None else jax.random.fold_in(self.dropout_key, step)

    def state(self) -> dict:
        """What a checkpoint holds: the model and optimizer state; with LoRA, the adapters only
        (the frozen base is the checkpoint directory's, loaded again on resume)."""
        if self.lora:
            adapters = eqx.filter(self.model, transforms.trainable_mask(self.model))
            return {"adapters": adapters, "opt_state": self.opt_state}
        return {"model": self.model, "opt_state": self.opt_state}

    def set_state(self, state: dict, metadata: dict) -> None:
        if self.lora:
            self.model = eqx.combine(state["adapters"], self.model)
        else:
            self.model = state["model"]
        self.opt_state = state["opt_state"]
        self.rng = metadata["rng"]

    def batch(self, split: str, step: int, seed: int):
        """The batch of ``step`` from ``split`` (``"train"`` or ``"val"``): the token windows; with
        ``--pack`` or a loss mask (chat data), ``{"tokens", "segment_ids", "mask"}`` (those that apply)."""
        a = self.args
        tokens, mask = getattr(self.corpus, split), getattr(self.corpus, f"{split}_mask")
        window = dict(batch=a.batch, seq=a.seq, seed=seed, rows=self.rows)
        local = batch_at(tokens, step, **window, mask=mask)
        if mask is not None:
            local, mask = local
        local = put_batch(local, self.mesh, (a.batch, a.seq + 1))
        if not self.pack and mask is None:
            return local
        out = {"tokens": local}
        if mask is not None:
            out["mask"] = put_batch(mask, self.mesh, (a.batch, a.seq))
        if self.pack:
            starts = None if self.corpus.doc_starts is None else self.corpus.doc_starts[split]
            segments = segments_at(tokens, step, **window, doc_starts=starts, eos_id=self.tokenizer.eos_id)
            out["segment_ids"] = put_batch(segments, self.mesh, (a.batch, a.seq + 1))
        return out

    def bits_per_byte(self, nats_per_token: float) -> float:
        return nats_per_token / math.log(2) / self.corpus.val_bytes_per_token

    def val_bits_per_byte(self) -> float:
        losses = [
            float(self.eval_loss(self.model, self.batch("val", k, VAL_SEED))) for k in range(self.args.eval_batches)
        ]
        return self.bits_per_byte(float(np.mean(losses)))

    def metadata(self, step: int) -> dict:
        return {
            "args": vars(self.args),
            "step": step,
            "rng": self.rng,
            "config": self.config.to_dict(),
            "tokenizer": self.tokenizer.name,
            "data_position": {"seed": self.args.seed, "next_step": step + 1},
            "tokens_seen": step * self.args.batch * self.args.seq,
        }

    def prediction(self) -> dict:
        """The planner's bytes for the transforms this run uses (gradients and activations)."""
        a = self.args
        quantize = getattr(a, "quantize", None)
        plan = self.plan or transforms.plan(
            self.config, batch=a.batch, seq=a.seq, device=a.plan or "h100", quantize=quantize
        )
        if self.plan is not None:
            c = self.plan.candidate
            return plan.predict(params=c.params, opt_state=c.opt_state, activations=c.policy) if c else {}
        chosen = parse_offload(a.offload)
        acts = None
        if "activations" in chosen:
            if a.activations in transforms.ACTIVATION_PRESETS:
                acts = a.activations
            else:
                acts = {n: "offload" for n in a.activations.split(",")}
        return plan.predict(params="params" in chosen, opt_state="opt_state" in chosen, activations=acts)


@eqx.filter_jit
def all_finite(model) -> jax.Array:
    """Whether every floating-point parameter is finite (each is read onto the device in turn)."""
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    checks = [jnp.isfinite(jax.device_put(x, jax.memory.Space.Device)).all() for x in leaves]
    return jnp.stack(checks).all()


def params_digest(model) -> str:
    """SHA-256 of every parameter, gathered from all processes."""
    import hashlib

    from jax.experimental import multihost_utils

    arrays = multihost_utils.process_allgather(eqx.filter(model, eqx.is_array), tiled=True)
    digest = hashlib.sha256()
    for x in jax.tree.leaves(arrays):
        digest.update(np.ascontiguousarray(x).tobytes())
    return digest.hexdigest()


def open_run(args, logs: cli.LibraryLogs | None = None) -> tuple[Run, pathlib.Path, checkpointing.Checkpointer, int]:
    """The run directory, the run, its checkpointer and the step it starts after (0, or the
    step of the checkpoint it resumes from). ``logs``: sent to the run directory's ``orbax.log``."""
    out = pathlib.Path(args.out or default_out(args.model))
    if args.out is None and jax.process_count() > 1:
        raise SystemExit("a multi-process run needs --out (a directory all processes share)")
    run = Run(args)
    lead = jax.process_index() == 0
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        if logs is not None:
            logs.to(out / "orbax.log")
    args.out = str(out)
    ckpt = checkpointing.Checkpointer(out / "checkpoints", keep=args.keep)
    if not args.resume:
        return run, out, ckpt, 0
    try:
        warn = None if lead else (lambda line: None)
        start, state, meta = cli.restore(ckpt, run.state(), step=None, what=f"--resume {args.resume}", warn=warn)
    except BaseException:
        ckpt.close()
        raise
    run.set_state(state, meta)
    return run, out, ckpt, start


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
    if args.offload or args.plan or run.lora:
        say(transforms.memory_report(params=run.model, opt_state=run.opt_state))
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


def train_loop(run: Run, ckpt, out, *, start: int, last: int, baseline: float, log, progress, summary) -> None:
    """Steps ``start + 1 .. last``: train, log, validate, checkpoint."""
    args = run.args
    for step in range(start + 1, last + 1):
        batch = run.batch("train", step, args.seed)
        model, opt_state, metrics = run.step_fn(run.model, run.opt_state, batch, key=run.step_key(step))
        loss = float(metrics["loss"])
        saving = (args.save_every and step % args.save_every == 0) or step == last
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
            val = run.val_bits_per_byte()
            summary["val"][step] = val
            progress.write(f"step {step:5d}  val {val:.3f} bits/byte (unigram {baseline:.3f})")
            if log:
                log.log(kind="val", step=step, val_bits_per_byte=val, time=time.time())
        if saving:
            ckpt.save(step, run.state(), metadata=run.metadata(step))


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
            title=f"where the training state lives ({args.offload or args.plan or 'no offload'})",
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


def main(argv=None, *, defaults: dict | None = None, build=build_parser) -> dict:
    """Run the recipe; returns a summary (final step, losses, paths). ``defaults``, ``build``: see
    :func:`parse_run`."""
    with cli.LibraryLogs() as logs:
        return _main(argv, defaults, build, logs)


def _main(argv, defaults: dict | None, build, logs: cli.LibraryLogs) -> dict:
    args, changes, warnings = parse_run(argv, defaults, distributed=True, build=build)
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    run, out, ckpt, start = open_run(args, logs)
    for line in changes:
        say(line)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    baseline = announce(run, out, start, say)
    if start >= args.steps:
        say(f"the run in {out} has finished its {args.steps} steps; give --steps above {start} to train further")
    if args.sample_before and start == 0:
        show_samples(run, say, "sample before training:")
    if lead:
        (out / "args.json").write_text(json.dumps(vars(args), indent=2))
    log = None
    if lead:
        jsonl = MetricsLog(out / "metrics.jsonl", truncate_after=start)
        # every flag: the run's, and those of a recipe built on this one (finetune_hf's --export ...)
        config = {**vars(build(defaults).parse_args(argv)), **vars(args)}
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
    last = min(args.steps, start + args.stop_after) if args.stop_after else args.steps
    summary = {"out": str(out), "start_step": start, "losses": {}, "val": {}}
    try:
        train_loop(
            run, ckpt, out, start=start, last=last, baseline=baseline, log=log, progress=progress, summary=summary
        )
    finally:
        progress.close()
        ckpt.close()  # waits for the background write of the last checkpoint
        if log:
            log.close()
    summary["final_step"] = last
    summary["finished"] = last == args.steps
    summary["model"] = run.model
    if last < args.steps:
        say(f"stopped after step {last} of {args.steps}; continue with: --resume {out}")
        return summary
    finish(run, out, baseline, say)
    return summary


if __name__ == "__main__":
    one_line_warnings()
    main()
