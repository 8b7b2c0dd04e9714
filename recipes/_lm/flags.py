"""The training recipes' flags: the parser, the checks that need no file and no model, and what a
resumed run keeps from its checkpoint or may change.

``--resume DIR`` takes every flag from the run's checkpoint; flags given with it change what may
change mid-run (`CHANGEABLE`: the schedule, clipping, checkpoints, evaluation, logging), each change
printed (``--lr: 0.003 -> 0.001``); the others (`KEPT`: the model, the data, the batch, the mesh,
the offload set, the moments' dtype) are refused, saying why. :func:`parse_run` does all of it and
parses the offload flags once (:class:`recipes._lm.offload.OffloadSpec`).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

import jax

import checkpointing
import transforms
import zoo
from recipes._lm import cli, files, trackers
from recipes._lm.data import TOKEN_DTYPES, TRAIN_ON
from recipes._lm.offload import OFFLOADABLE, OffloadSpec
from recipes._lm.run_setup import MOMENTS, init_distributed, is_hf_dir, lr_schedule_warning

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
    "rewrite",
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
    "the checkpoint holds the optimizer's moments in that dtype (another is a state of other types or shapes)": (
        "moments",
    ),
    "where its state lives (the offload set) is part of the run": ("offload", "activations", "prefetch", "plan"),
    "it writes to its own directory": ("out",),
}
#: What a run saved before a flag existed did, where that is not the flag's default: runs from before
#: --pack trained on one stream.
BEFORE_FLAG = {"pack": False}
SCHEDULES = ("cosine", "linear", "constant")
#: Seeds go to numpy's and JAX's generators (the latter add small offsets to them).
MAX_SEED = 2**32 - 1
#: Flags that only shape LoRA adapters, without effect unless --lora-rank is above 0.
LORA_ONLY = ("lora_alpha", "lora_targets", "lora_dropout", "base_dtype")
DESCRIPTION = "Train a language model on local text, with checkpoints, resume, progress and plots."


def build_parser(
    defaults: dict | None = None, *, only=None, skip=(), parser: argparse.ArgumentParser | None = None
) -> argparse.ArgumentParser:
    """The training flags; for recipes built on this one, those named in ``only`` (default: all)
    but not in ``skip``, added to ``parser`` (a parser or an argument group)."""
    p = parser or cli.Parser(prog="python -m recipes.train_lm", description=DESCRIPTION)

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
    a(
        "--moments",
        default="float32",
        choices=MOMENTS,
        help="dtype AdamW's moments are stored in between steps (default float32; the others through "
        "transforms.compact_state, the update itself in float32): bfloat16 halves the optimizer state (and what "
        "crosses the host link when it is offloaded), float8 stores it as 8-bit blockwise codes (about a quarter); "
        "--plan and the memory checks count it so",
    )
    a(
        "--param-dtype",
        default="float32",
        help="dtype of the trained weights (a checkpoint's too, unless --lora-rank); bfloat16 ones are updated in "
        "float32 and rounded stochastically (transforms.stochastic_rounding)",
    )
    a("--base-dtype", default=None, help="with --lora-rank: dtype of the frozen base (default: the checkpoint's own)")
    a("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank on a frozen base (0: train all)")
    a("--lora-alpha", type=float, default=None, help="LoRA scale numerator (default: twice the rank)")
    a("--lora-targets", default="q_proj,v_proj", help="projections to adapt (q_proj,k_proj,v_proj,o_proj,gate,up,down)")
    a("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    a("--quantize", default=None, choices=["nf4", "int8"], help="with --lora-rank: the frozen base quantized (QLoRA)")
    a("--compute-dtype", default="float32", help="e.g. bfloat16 on a GPU")
    a("--seed", type=int, default=0, help=f"seed of the initial weights and of the batches (0 .. {MAX_SEED})")
    a("--mesh", default=None, help="device mesh sizes, e.g. data=2,fsdp=4,tensor=1 (default: no mesh)")
    a(
        "--offload",
        default="",
        help=f"comma-separated subset of {','.join(OFFLOADABLE)} for pinned_host (opt_state_stream: the optimizer "
        "state offloaded and its update streamed layer by layer; opt_state_defer: that update run in the next "
        "step's forward pass, beside each layer's matmuls; opt_state_defer_stacks: that with only the stacks' "
        "state offloaded)",
    )
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
        "--rewrite",
        default="in_place",
        choices=transforms.REWRITES,
        help="with --offload params,opt_state_defer: where the deferred update writes the new host weights "
        "(offload_opt_state(..., rewrite=...)): in_place; new_buffers (a second copy of the host weights and state "
        "during each step); backward (the new weights and host state wait on the device until the layer's backward "
        "pass, which writes them back)",
    )
    a(
        "--plan",
        metavar="DEVICE",
        default=None,
        help=f"apply the planner's choice for a device profile ({', '.join(transforms.DEVICE_PROFILES)}) or auto "
        "(the running device and this machine's RAM)",
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
        "change the schedule, clipping, checkpoints, evaluation or logging (not the model, data, batch, mesh, "
        "offload set or --moments)",
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


def flag_names() -> set[str]:
    """The destinations of every training flag."""
    return {a.dest for a in build_parser()._actions if a.dest != "help"}


@dataclasses.dataclass
class ParsedRun:
    """What :func:`parse_run` returns: the run's flags, the changes a resume made (one line
    each), warnings (one line each: a flag given without effect, a short run) and the offload set."""

    args: argparse.Namespace
    changes: list[str]
    warnings: list[str]
    offload: OffloadSpec


def check_multiprocess(coordinator, num_processes, process_id) -> None:
    """The multi-process flags, before the runtime starts (a bad address would wait forever)."""
    if num_processes is not None:
        cli.at_least("num_processes", num_processes, 1)
    if process_id is not None:
        high = (num_processes or 1) - 1
        cli.in_range("process_id", process_id, 0, high, f" (one of the {num_processes or 1} processes)")
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SystemExit(f"--coordinator {coordinator}: give HOST:PORT, e.g. --coordinator 10.0.0.1:1234")


def parse_run(argv, defaults=None, *, distributed: bool = False, build=build_parser) -> ParsedRun:
    """The run's flags: with ``--resume``, those saved in its checkpoint, changed by the flags of
    `CHANGEABLE` given with it and this invocation's `RUN_CONTROL` flags. Every value is checked
    (`SystemExit`: one line). ``distributed``: start the multi-process runtime first (it must
    precede any other JAX call, reading a checkpoint included). ``build(defaults)``: the parser
    of a recipe built on this one (``finetune_hf``): its flags besides these are not the run's,
    and are dropped."""
    parser = build(defaults)
    args = parser.parse_args(argv)
    ours = flag_names()
    args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k in ours})
    given = {k: v for k, v in cli.given_flags(build(None), argv).items() if k in ours}
    check_multiprocess(args.coordinator, args.num_processes, args.process_id)
    if distributed:
        init_distributed(args.coordinator, args.num_processes, args.process_id)
    changes = []
    if args.resume:
        args, changes = resumed(parser, args, given)
    offload, warnings = check(args, given=set(given))
    new_schedule = not args.resume or any(line.startswith(("--steps:", "--warmup:", "--lr:")) for line in changes)
    if new_schedule and jax.process_index() == 0 and (line := lr_schedule_warning(args.lr, args.warmup, args.steps)):
        warnings.append(line)
    return ParsedRun(args, changes, warnings, offload)


def parse(argv, defaults=None, *, distributed: bool = False) -> argparse.Namespace:
    """The run's flags (see :func:`parse_run`)."""
    return parse_run(argv, defaults, distributed=distributed).args


def same_directory(a, b) -> bool:
    """Whether ``a`` and ``b`` name one existing directory (a path spelled two ways)."""
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    a, b = pathlib.Path(a), pathlib.Path(b)
    return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()


def resumed(parser, args, given: dict) -> tuple[argparse.Namespace, list[str]]:
    """The flags of the run ``args.resume`` continues: its saved ones, with those of ``given``
    (the command line's) that may change applied, and ``args``' `RUN_CONTROL` flags."""
    run_dir = pathlib.Path(args.resume)
    metadata = cli.read_metadata(run_dir, f"--resume {args.resume}")
    saved = checked_saved(metadata, f"--resume {args.resume}")
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


def _kind(action: argparse.Action) -> tuple[type | tuple[type, ...], str]:
    """The Python types a saved value of ``action``'s flag may have, and their name."""
    if isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):
        return bool, "true or false"
    if action.type is int:
        return int, "an integer"
    if action.type is float:
        return (int, float), "a number"
    return str, "text"


def checked_saved(metadata: dict, what: str) -> dict:
    """The saved flags of a checkpoint's metadata, each of the type its flag takes (a file edited
    by hand, or damaged, is one line naming the flag); flags this version does not know are
    dropped (they would do nothing)."""
    saved = metadata.get("args")
    if not isinstance(saved, dict):
        raise SystemExit(
            f"{what}: the checkpoint's metadata holds no saved flags ('args'); it was not written by "
            "train_lm, or was damaged"
        )
    saved = {**BEFORE_FLAG, **saved}
    actions = {a.dest: a for a in build_parser()._actions if a.dest != "help"}
    out = {}
    for name, value in saved.items():
        action = actions.get(name)
        if action is None:
            continue
        types, wanted = _kind(action)
        ok = value is None and action.default is None
        ok = ok or (isinstance(value, types) and (types is bool or not isinstance(value, bool)))
        if ok and action.choices is not None and value is not None and value not in action.choices:
            ok, wanted = False, "one of " + ", ".join(map(str, action.choices))
        if not ok:
            step = metadata.get("step", "?")
            raise SystemExit(
                f"{what}: the flags saved with its checkpoint (step {step}) are damaged: {cli.flag(name)} holds "
                f"{value!r}, not {wanted}; restore the checkpoint from a copy, or start a new run"
            )
        out[name] = value
    return out


def resume_args(run_dir: str) -> dict:
    """The flags saved in the newest readable checkpoint of the run in ``run_dir`` (checked)."""
    what = f"--resume {run_dir}"
    return checked_saved(cli.read_metadata(pathlib.Path(run_dir), what), what)


def saved_flags(run_dir: str) -> argparse.Namespace:
    """The flags of the run in ``run_dir``, as :class:`recipes._lm.run.Run` takes them (flags
    added since it began take their defaults)."""
    parser = build_parser()
    saved = resume_args(run_dir)
    return argparse.Namespace(**{**{a.dest: a.default for a in parser._actions if a.dest != "help"}, **saved})


def check(args: argparse.Namespace, *, given: set[str] = frozenset()) -> tuple[OffloadSpec, list[str]]:
    """Every check of the flags that needs no model (`SystemExit`: one line); returns the offload
    set (parsed here, once) and a warning line for each flag in ``given`` that has no effect."""
    for name in ("steps", "batch", "seq", "accum", "eval_every", "eval_batches", "log_every", "keep"):
        cli.at_least(name, getattr(args, name), 1)
    cli.at_least("save_every", args.save_every, 0, " (0: a checkpoint at the end only)")
    if args.stop_after is not None:
        cli.at_least("stop_after", args.stop_after, 1)
    cli.in_range("seed", args.seed, 0, MAX_SEED)
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
    offload, warnings = OffloadSpec.parse(
        args.offload,
        args.activations,
        args.prefetch,
        args.plan,
        given=given,
        rewrite=getattr(args, "rewrite", "in_place"),
    )
    if args.plan == "auto":  # the running accelerator's profile; on a CPU, one line saying there is none
        try:
            transforms.detect_device()
        except ValueError as err:
            raise SystemExit(f"--plan auto: {err}") from None
    elif args.plan and args.plan not in transforms.DEVICE_PROFILES:
        raise SystemExit(
            f"--plan {args.plan}: unknown device profile {args.plan!r}; choose one of "
            f"{', '.join(transforms.DEVICE_PROFILES)}, or auto (the running device)"
        )
    check_out(args)
    warnings += no_effect(args, given)
    return offload, warnings


#: What a run writes into its directory (a new run there would replace them).
RUN_FILES = ("metrics.jsonl", "args.json", "loss.png", "placement.png", "tensorboard", "wandb")


def check_out(args: argparse.Namespace) -> None:
    """The run directory: writable, and (for a new run) not another run's: neither its checkpoints
    nor the files it wrote (checked by the lead process, before any is written)."""
    if args.out is None:
        return
    files.check_output_dir("--resume" if args.resume else "--out", args.out)
    out = pathlib.Path(args.out)
    if args.resume or jax.process_index() != 0:
        return
    if (out / "checkpoints").is_dir():
        with checkpointing.Checkpointer(out / "checkpoints") as ckpt:
            if ckpt.steps():
                raise SystemExit(
                    f"--out {args.out} already holds checkpoints: continue it with --resume {args.out}, "
                    "or choose a new --out"
                )
    reads = {"--data": args.data, "the checkpoint (--model)": args.model if is_hf_dir(args.model) else None}
    for what, read in reads.items():
        if (
            read
            and pathlib.Path(read).is_dir()
            and (out.resolve() == pathlib.Path(read).resolve() or pathlib.Path(read).resolve() in out.resolve().parents)
        ):
            raise SystemExit(
                f"--out {args.out}: it lies in {what} ({read}), which the run reads: its files would be read as "
                "data or mixed with the model's; choose a directory outside it"
            )
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found:
        raise SystemExit(
            f"--out {args.out} already holds another run's {', '.join(found)} (and no checkpoint to continue from): "
            "a new run would replace them; choose a new --out, or move them away first"
        )


def no_effect(args: argparse.Namespace, given) -> list[str]:
    """A warning for each flag in ``given`` whose value changes nothing with the other flags."""
    out = []
    if not args.lora_rank:
        for name in LORA_ONLY:
            if name in given:
                out.append(f"{cli.flag(name)} has no effect without --lora-rank (no adapters are trained)")
    elif "base_dtype" in given and not is_hf_dir(args.model):
        out.append(
            f"--base-dtype has no effect with --model {args.model}: it sets the dtype a Hugging Face checkpoint's "
            "frozen base is loaded in (a preset's base is built in --param-dtype)"
        )
    if args.quiet_samples:
        for name in ("prompt", "sample_before"):
            if name in given:
                out.append(f"{cli.flag(name)} has no effect with --quiet-samples (no samples are drawn)")
    if "stop_after" in given and not args.resume and args.stop_after is not None and args.stop_after >= args.steps:
        out.append(f"--stop-after {args.stop_after} has no effect: the run ends at --steps {args.steps} first")
    return out
