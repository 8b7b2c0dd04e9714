"""What XLA's out-of-memory errors say: whether an error is one, which memory ran out (the device's
or the host's), and the sizes its message names.

- :func:`out_of_memory` finds one behind an error (a `MemoryError`, or XLA's ``RESOURCE_EXHAUSTED``);
- :func:`which_memory` tells the device's memory from the host's;
- :func:`oom_sizes` reads what a program needed and what the device has ("Used 19.85G of 15.75G
  hbm"), :func:`allocation` the size of one allocation refused at run time.

The recipes' out-of-memory line (``recipes._lm.oom``) and the accelerator check's capacity run read
them. Standard library only: nothing here needs JAX.
"""

from __future__ import annotations

import re

_SIZE = r"([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|bytes|B)?"
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(number: str, unit: str | None) -> int:
    return int(float(number) * _UNITS.get((unit or "B")[0].upper(), 1))


def oom_sizes(message: str) -> dict | None:
    """``{"needed_bytes", "limit_bytes"}`` read from an XLA out-of-memory message, or None.

    XLA:TPU says "Used 19.85G of 15.75G hbm", XLA:GPU and the runtime "... required for HLO
    temporaries (19.85G) exceeds available HBM (15.75G)"."""
    used = re.search(rf"Used {_SIZE} of {_SIZE}", message)
    if used:
        return {"needed_bytes": _bytes(*used.group(1, 2)), "limit_bytes": _bytes(*used.group(3, 4))}
    needed = re.search(rf"\({_SIZE}\) exceeds available \w+ \({_SIZE}\)", message)
    if needed:
        return {"needed_bytes": _bytes(*needed.group(1, 2)), "limit_bytes": _bytes(*needed.group(3, 4))}
    return None


def allocation(message: str) -> dict:
    """``{"allocation_bytes", "free_bytes"}`` (those it gives) of one allocation the runtime refused:
    "Out of memory while trying to allocate 123 bytes", "Attempting to allocate 1.00G. That was not
    possible. There are 500.00M free", "Failed to allocate request for 1.00GiB"."""
    out = {}
    refused = re.search(rf"(?:allocate|allocating|request for)\s+{_SIZE}", message, re.IGNORECASE)
    if refused:
        out["allocation_bytes"] = _bytes(*refused.group(1, 2))
    free = re.search(rf"There are {_SIZE} free", message)
    if free:
        out["free_bytes"] = _bytes(*free.group(1, 2))
    return out


def _chain(err: BaseException | None):
    """``err`` and the errors it was raised from or while handling, newest first."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def out_of_memory(err: BaseException) -> BaseException | None:
    """The out-of-memory error behind ``err`` (itself, or one it was raised from or during), or
    None: a `MemoryError`, or an error whose message carries XLA's ``RESOURCE_EXHAUSTED``."""
    return next((e for e in _chain(err) if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e)), None)


def which_memory(err: BaseException, platform: str) -> str:
    """``"device"`` or ``"host"``: the memory ``err`` ran out of. A `MemoryError` is the host's; a
    message naming HBM or a device buffer is the device's, one naming host memory the host's;
    otherwise the device's, except on a CPU, whose device memory is the host's."""
    if isinstance(err, MemoryError):
        return "host"
    text = str(err).lower()
    if re.search(r"\bhbm\b|device memory|device buffer|on device", text):
        return "device"
    if "host" in text:
        return "host"
    return "host" if platform == "cpu" else "device"
