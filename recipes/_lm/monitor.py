"""Progress bar, JSONL metrics log and PNG plots for the language-model recipes."""

from __future__ import annotations

import json
import pathlib
import sys
import time

import jax

import transforms
from recipes._lm import files


def peak_flops(compute_dtype: str) -> float | None:
    """Dense peak FLOP/s of one local device from its planner profile (``transforms.profile_for_kind``
    of its ``device_kind``); ``None`` on the CPU or a device with no profile."""
    profile = transforms.profile_for_kind(jax.local_devices()[0].device_kind)
    return None if profile is None else float(profile.flops(compute_dtype))


def memory_in_use() -> dict[str, int]:
    """``{"dev": bytes, "host": bytes}``: device memory in use where the backend reports it (a TPU's
    reserved program scratch included), and this process's resident host memory
    (:func:`transforms.host_rss`), which offloaded state, host gradients and the accelerator runtime
    itself fill (13.5 GiB on a TPU v5e host)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    out = {}
    if "bytes_in_use" in stats:
        out["dev"] = int(stats["bytes_in_use"]) + int(stats.get("bytes_reserved") or 0)
    out["host"] = transforms.host_rss()
    return out


class Progress:
    """A tqdm bar (on a terminal) plus a plain line every ``log_every`` steps (always)."""

    def __init__(
        self, *, total: int, initial: int, tokens_per_step: int, flops_per_token: float, peak, log_every, enabled=True
    ):
        from tqdm import tqdm

        self.enabled = enabled  # one process of several shows nothing
        disable = None if enabled else True  # None: only on a terminal
        self.bar = tqdm(total=total, initial=initial, unit="step", file=sys.stderr, dynamic_ncols=True, disable=disable)
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.log_every = log_every
        self.start_step = initial
        self.last = time.perf_counter()
        self.tok_s = None

    def rates(self, step: int) -> dict:
        now = time.perf_counter()
        current = self.tokens_per_step / max(now - self.last, 1e-9)
        self.last = now
        # Smoothed over recent steps; the first (compiling) step does not count.
        if step > self.start_step + 1:
            self.tok_s = current if self.tok_s is None else 0.9 * self.tok_s + 0.1 * current
        tok_s = self.tok_s if self.tok_s is not None else current
        out = {"tokens_per_s": tok_s}
        if self.peak:
            out["mfu"] = tok_s * self.flops_per_token / (self.peak * jax.device_count())
        for label, used in memory_in_use().items():
            out[f"{label}_mem_bytes"] = used
        return out

    def update(self, step: int, loss: float) -> dict:
        rates = self.rates(step)
        post = {"loss": f"{loss:.3f}", "tok/s": f"{rates['tokens_per_s']:,.0f}"}
        if "mfu" in rates:
            post["mfu"] = f"{100 * rates['mfu']:.1f}%"
        for key, value in rates.items():
            if key.endswith("_mem_bytes"):
                post[key.split("_")[0]] = transforms.format_bytes(value)
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)
        if step % self.log_every == 0 or step == self.start_step + 1:
            self.write(
                f"step {step:5d}  loss {loss:.3f}  " + "  ".join(f"{k} {v}" for k, v in post.items() if k != "loss")
            )
        return rates

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        self.bar.write(line, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        self.bar.close()


class MetricsLog:
    """Append-only JSONL: one object per line, flushed, so a killed run keeps what it logged.

    A resumed run rewinds to its checkpoint (``truncate_after``: its step): the records of later
    steps are dropped by writing the kept ones to a new file that replaces the old in one step
    (:func:`recipes._lm.files.write_text`), so a kill at any moment leaves the old log or the new
    one, never an empty or half-written file."""

    def __init__(self, path: pathlib.Path, *, truncate_after: int | None = None):
        self.path = path
        if truncate_after is not None and path.exists():
            keep = [r for r in read_jsonl(path) if r.get("step", 0) <= truncate_after]
            files.write_text(path, "".join(json.dumps(r) + "\n" for r in keep))
        self.fh = path.open("a", encoding="utf-8")

    def log(self, **record) -> None:
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def read_jsonl(path) -> list[dict]:
    """The JSON objects of a JSONL file, one per line; a line that is not one (cut short by a kill,
    or damaged) is skipped."""
    records = []
    for line in pathlib.Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):  # a line cut short by a kill
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def plot_losses(records: list[dict], path: pathlib.Path, *, baseline: float, title: str) -> None:
    """Training loss and validation loss (bits per byte) against step, with the unigram baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["train_bits_per_byte"]) for r in records if r.get("kind") == "train"]
    val = [(r["step"], r["val_bits_per_byte"]) for r in records if r.get("kind") == "val"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train, strict=True), lw=1, alpha=0.8, label="train")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", lw=2, label="validation")
    ax.axhline(baseline, color="gray", ls="--", lw=1, label=f"unigram baseline ({baseline:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with files.replacing(path) as tmp:  # a reader never sees half a picture
        fig.savefig(tmp)
    plt.close(fig)


def placement(params, opt_state, prediction: dict) -> dict[str, dict[str, int]]:
    """Bytes per component on device and in host memory.

    Parameters and optimizer state are measured on the live arrays; gradients and saved
    activations exist only inside the step, so they come from the planner's prediction for the
    same transforms (at its device-memory peak).
    """
    report = transforms.memory_report(params=params, opt_state=opt_state)
    out = {}
    for name in ("params", "opt_state"):
        host = report.bytes("pinned_host", name) if "pinned_host" in report.kinds else 0
        out[name] = {"device": report.bytes("device", name) if "device" in report.kinds else 0, "host": host}
    peak = prediction["phases"][prediction["peak_phase"]]
    backward = prediction["phases"].get("backward", peak)
    out["gradients"] = {
        "device": max(p.get("gradients", 0) for p in prediction["phases"].values()),
        "host": prediction["host"].get("gradients", 0),
    }
    out["activations"] = {
        "device": backward.get("saved activations", 0) + backward.get("other residuals", 0),
        "host": prediction["host"].get("saved activations", 0),
    }
    return out


def plot_placement(where: dict[str, dict[str, int]], path: pathlib.Path, *, title: str) -> None:
    """Stacked bars: device vs host bytes for params, gradients, optimizer state, activations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(where)
    device = [where[n]["device"] / 2**20 for n in names]
    host = [where[n]["host"] / 2**20 for n in names]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.bar(names, device, label="device", color="#4c72b0")
    ax.bar(names, host, bottom=device, label="host (pinned_host)", color="#dd8452")
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.text(0.01, 0.01, "params, optimizer state: measured; gradients, activations: planner estimate", fontsize=7)
    fig.tight_layout()
    with files.replacing(path) as tmp:  # a reader never sees half a picture
        fig.savefig(tmp)
    plt.close(fig)
