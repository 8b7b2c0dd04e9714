"""``python -m transforms.plan``: print a memory plan, optionally write it as PNG and JSON.

The planning function itself is ``transforms.plan(...)`` (:func:`transforms.plan._search.plan`).

**Example:**

```bash
python -m transforms.plan --model llama:8b --batch 1 --seq 8192 --device h200 --png plan.png --json plan.json
python -m transforms.plan --model gpt2:124m --batch 8 --seq 1024 \\
    --device custom --memory-gb 24 --link-gb-s 25 --tflops 165
```
"""

from __future__ import annotations

import argparse
import sys

from zoo import config_from_name, model_names

from ._checks import OPTIMIZERS
from ._devices import DEVICES, custom_device
from ._search import plan as make_plan


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m transforms.plan",
        description="What to offload for a model, batch and device: bytes per component, the cheapest set of "
        "transforms that fits, bytes moved per step and predicted step-time overhead.",
    )
    p.add_argument("--model", required=True, help="FAMILY:PRESET, one of: " + ", ".join(model_names()))
    p.add_argument("--batch", type=int, required=True, help="global batch (examples per step)")
    p.add_argument("--seq", type=int, required=True, help="tokens per example")
    p.add_argument("--device", default="h100", help=f"one of {sorted(DEVICES)} or 'custom'")
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
    p.add_argument("--param-dtype", default=None, help="override the preset's param_dtype")
    p.add_argument("--compute-dtype", default=None, help="override the preset's compute_dtype")
    p.add_argument("--host-memory-gb", type=float, default=None, help="host memory per device (GiB)")
    p.add_argument("--memory-gb", type=float, default=None, help="custom device: memory (GiB)")
    p.add_argument("--link-gb-s", type=float, default=None, help="custom device: host link GB/s per direction")
    p.add_argument("--tflops", type=float, default=None, help="custom device: peak dense 16-bit TFLOP/s")
    p.add_argument("--unified", action="store_true", help="custom device: host and device share memory")
    p.add_argument("--png", default=None, help="write a stacked-bar chart of device vs host bytes here")
    p.add_argument("--json", default=None, help="write the plan as JSON here")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_name(args.model)
        changes = {k: v for k, v in (("param_dtype", args.param_dtype), ("compute_dtype", args.compute_dtype)) if v}
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
            )
        else:
            device = args.device
        result = make_plan(
            config,
            batch=args.batch,
            seq=args.seq,
            device=device,
            optimizer=args.optimizer,
            fsdp=args.fsdp,
            accum_steps=args.accum_steps,
            margin=args.margin,
            host_memory_gb=args.host_memory_gb,
            clip_norm=args.clip_norm,
        )
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result.model = args.model
    print(result)
    if args.png:
        result.save_png(args.png)
        print(f"\nwrote {args.png}")
    if args.json:
        result.save_json(args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
