"""``python -m transforms.plan``: print a memory plan, optionally write it as PNG and JSON.

The planning functions themselves are ``transforms.plan(...)`` (:func:`transforms.plan._search.plan`,
training) and :func:`transforms.plan.plan_generate` (generation, ``--generate``).

**Example:**

```bash
python -m transforms.plan --model llama:8b --batch 1 --seq 8192 --device h200 --png plan.png --json plan.json
python -m transforms.plan --model gpt2:124m --batch 8 --seq 1024 \\
    --device custom --memory-gb 24 --link-gb-s 25 --tflops 165
python -m transforms.plan llama:8b --generate --batch 8 --context 8192 --prompt 512 --device h100
python -m transforms.plan llama:1b --batch 8 --seq 2048 --device auto   # on the accelerator itself
```

With ``--device auto`` a training plan counts the host memory this process holds once the device
is open (the runtime's own share, measured) against the machine's RAM, instead of the profile's figure.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from zoo import config_from_name, model_names

from ._checks import OPTIMIZERS
from ._devices import DEVICES, custom_device
from ._generate import plan_generate
from ._search import plan as make_plan


def _loss_chunk(text: str) -> int | str:
    """``--loss-chunk``: a number of tokens (0: whole logits) or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'auto', got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    """Errors in one line (``error: ...``, exit status 2), as the planner's own, not the usage and a line."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m transforms.plan",
        description="What to offload for a model, batch and device: bytes per component, the cheapest set of "
        "transforms that fits, bytes moved per step and predicted step-time overhead.",
    )
    names = ", ".join(model_names())
    p.add_argument("name", nargs="?", default=None, metavar="MODEL", help="FAMILY:PRESET (or --model)")
    p.add_argument("--model", default=None, help="FAMILY:PRESET, one of: " + names)
    p.add_argument("--batch", type=int, required=True, help="global batch (examples per step; sequences generated)")
    p.add_argument("--seq", type=int, default=None, help="tokens per example (with --generate: the context)")
    p.add_argument(
        "--generate",
        action="store_true",
        help="plan generation with a KV cache instead of training: what stays on the device, what streams "
        "from host, and the decode tokens/s bound",
    )
    p.add_argument("--context", type=int, default=None, help="with --generate: prompt + new tokens")
    p.add_argument("--prompt", type=int, default=None, help="with --generate: prompt length (default: the context)")
    p.add_argument("--cache-dtype", default=None, help="with --generate: KV cache dtype (default: compute dtype)")
    p.add_argument("--memory-bw-gb-s", type=float, default=None, help="custom device: memory bandwidth GB/s")
    p.add_argument(
        "--compute-capability", type=float, default=None, help="custom device: GPU compute capability (e.g. 8.6)"
    )
    devices = f"one of {sorted(DEVICES)}, 'auto' (the running device) or 'custom'"
    p.add_argument("--device", default="h100", help=devices)
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    p.add_argument("--fsdp", type=int, default=1, help="devices along the fsdp mesh axis")
    p.add_argument("--accum-steps", type=int, default=1)
    p.add_argument("--margin", type=float, default=0.10, help="fraction of memory kept free")
    p.add_argument(
        "--clip-norm",
        type=float,
        default=None,
        help="gradients clipped to this global norm (the streamed update's extra pass is counted)",
    )
    p.add_argument("--attention", default=None, help="override the config's attention implementation")
    p.add_argument(
        "--loss-chunk", type=_loss_chunk, default=None, help="override the config's loss_chunk (tokens, 0 or 'auto')"
    )
    p.add_argument("--max-seq-len", type=int, default=None, help="override the config's max_seq_len")
    p.add_argument("--param-dtype", default=None, help="override the preset's param_dtype")
    p.add_argument("--compute-dtype", default=None, help="override the preset's compute_dtype")
    p.add_argument("--host-memory-gb", type=float, default=None, help="host memory per device (GiB)")
    p.add_argument("--memory-gb", type=float, default=None, help="custom device: memory (GiB)")
    p.add_argument("--link-gb-s", type=float, default=None, help="custom device: host link GB/s per direction")
    p.add_argument("--tflops", type=float, default=None, help="custom device: peak dense 16-bit TFLOP/s")
    p.add_argument("--unified", action="store_true", help="custom device: host and device share memory")
    p.add_argument(
        "--quantize",
        default=None,
        choices=["nf4", "int8"],
        help="plan for the model with its stacks' projections quantized (transforms.quantize): codes and "
        "scales on the device, on the host and over the link",
    )
    p.add_argument("--png", default=None, help="write a stacked-bar chart of device vs host bytes here")
    p.add_argument("--json", default=None, help="write the plan as JSON here")
    return p


#: Flags that describe a custom device (``--device custom``); beside a named device they do nothing.
CUSTOM_DEVICE_FLAGS = ("memory_gb", "link_gb_s", "tflops", "unified", "memory_bw_gb_s", "compute_capability")
#: Flags of a training plan only, and of a generation plan only.
TRAINING_ONLY = ("optimizer", "fsdp", "accum_steps", "clip_norm")
GENERATION_ONLY = ("context", "prompt", "cache_dtype")


def _given(argv) -> set[str]:
    """The destinations of the flags ``argv`` names explicitly."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
        action.required = False
    return set(vars(parser.parse_args(argv)))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwritable(flag: str, value: str) -> str | None:
    """Why ``value`` cannot be written as a file (``None`` if it can): checked before any work."""
    path = pathlib.Path(value)
    if not value or path.is_dir():
        return f"{flag} {value or repr(value)}: is a directory; give the path of a file to write"
    ancestor = path.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{flag} {value}: {ancestor} is a file, so nothing can go under it"
    if not os.access(ancestor, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return f"{flag} {value}: not writable"
    return None


def _no_effect(args, given: set[str]) -> list[str]:
    """A warning line for each flag given that changes nothing with the others."""
    out = []
    if args.device != "custom":
        out += [
            f"{_flag(n)} has no effect with --device {args.device} (it describes --device custom)"
            for n in CUSTOM_DEVICE_FLAGS
            if n in given
        ]
    if args.generate:
        out += [
            f"{_flag(n)} has no effect with --generate (it shapes a training step)" for n in TRAINING_ONLY if n in given
        ]
        if "seq" in given and "context" in given:
            out.append(
                f"--seq {args.seq} has no effect with --generate --context {args.context} (the context is the sequence)"
            )
    else:
        out += [f"{_flag(n)} has no effect without --generate" for n in GENERATION_ONLY if n in given]
    return out


def _auto_baseline() -> int | None:
    """The runtime's share of the host measured in this process (:func:`transforms.host_baseline`),
    where the running device has a profile (elsewhere ``device="auto"`` refuses in one line)."""
    from .._report import host_baseline
    from ._devices import detect_device

    try:
        detect_device()
    except ValueError:
        return None
    return host_baseline()


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.name is None) == (args.model is None):
        parser.error("give the model once: python -m transforms.plan MODEL ... or --model MODEL")
    args.model = args.model or args.name
    given = _given(argv)
    warnings = _no_effect(args, given)
    if args.generate:
        if args.context is None:
            args.context = args.seq
        if args.context is None:
            parser.error("--generate needs --context (prompt + new tokens)")
        if args.png:
            parser.error(f"--png {args.png}: a generation plan has no chart; drop --png (--json writes the plan)")
    elif args.seq is None:
        parser.error("--seq is required (or --generate with --context)")
    for flag, value in (("--png", args.png), ("--json", args.json)):
        if value is not None and (why := _unwritable(flag, value)):
            parser.error(why)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    try:
        config = config_from_name(args.model)
        overrides = ("param_dtype", "compute_dtype", "attention", "loss_chunk", "max_seq_len")
        changes = {k: getattr(args, k) for k in overrides if getattr(args, k) is not None}
        if changes:
            config = config.replace(**changes)
        if args.device == "custom":
            missing = [n for n in ("memory_gb", "link_gb_s", "tflops") if getattr(args, n) is None]
            if missing:
                parser.error("--device custom needs " + ", ".join("--" + m.replace("_", "-") for m in missing))
            device = custom_device(
                memory_gb=args.memory_gb,
                link_gb_s=args.link_gb_s,
                tflops=args.tflops,
                host_memory_gb=args.host_memory_gb,
                unified=args.unified,
                memory_bw_gb_s=args.memory_bw_gb_s,
                compute_capability=args.compute_capability,
            )
        else:
            device = args.device
        shared = dict(
            batch=args.batch,
            device=device,
            margin=args.margin,
            host_memory_gb=args.host_memory_gb,
            quantize=args.quantize,
        )
        if args.generate:
            result = plan_generate(
                config, context=args.context, prompt=args.prompt, cache_dtype=args.cache_dtype, **shared
            )
        else:
            # On the running device, this process's own resident memory once the device is open is
            # the runtime's share of the host (nothing else is built here).
            auto = isinstance(device, str) and device.strip().lower() == "auto"
            result = make_plan(
                config,
                seq=args.seq,
                optimizer=args.optimizer,
                fsdp=args.fsdp,
                accum_steps=args.accum_steps,
                clip_norm=args.clip_norm,
                host_baseline=_auto_baseline() if auto else None,
                **shared,
            )
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result.model = args.model + (f", {args.quantize}" if args.quantize else "")
    print(result)
    for path in (args.png, args.json):  # checked writable up front; their new parents are made here
        if path:
            pathlib.Path(path).absolute().parent.mkdir(parents=True, exist_ok=True)
    if args.png:
        result.save_png(args.png)
        print(f"\nwrote {args.png}")
    if args.json:
        result.save_json(args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
