"""Reading and writing the safetensors format with numpy, memory-mapped.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length
``N``, ``N`` bytes of JSON mapping each tensor name to ``{"dtype", "shape", "data_offsets"}``
(offsets relative to the end of the header; an optional ``"__metadata__"`` entry of strings),
then the raw little-endian bytes of the tensors.

The header is parsed here rather than through ``safetensors.safe_open(framework="numpy")``
because that API cannot slice bfloat16 tensors; a `numpy.memmap` of the file views any
tensor, or any slice of it, without reading the rest of the file.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

#: safetensors dtype name -> numpy dtype.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# Refuse absurd header sizes instead of reading gigabytes of "JSON" from a corrupt file.
_MAX_HEADER = 100 * 1024 * 1024


def dtype_name(dtype) -> str:
    """The safetensors name (``"F32"``, ``"BF16"``, ...) of a numpy dtype."""
    dtype = np.dtype(dtype)
    if dtype not in _NAMES:
        raise ValueError(f"safetensors cannot store dtype {dtype}")
    return _NAMES[dtype]


class TensorInfo:
    """Where one tensor lives: its file, dtype name, shape and byte range."""

    __slots__ = ("dtype", "end", "file", "shape", "start")

    def __init__(self, file: pathlib.Path, dtype: str, shape: tuple[int, ...], start: int, end: int):
        self.file = file
        self.dtype = dtype
        self.shape = shape
        self.start = start
        self.end = end


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors of one safetensors file (name -> :class:`TensorInfo`, absolute byte
    offsets) and its ``__metadata__``. Reads only the header."""
    path = pathlib.Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path}: not a safetensors file (header length {n} for a file of {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + n
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: malformed header entry for {name!r}: {entry!r}") from None
        if dtype in DTYPES:
            expected = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
            if end - start != expected or base + end > size or start < 0:
                raise ValueError(
                    f"{path}: tensor {name!r} ({dtype}, shape {shape}) has byte range [{start}, {end}), "
                    f"which does not fit its size {expected} or the file"
                )
        tensors[name] = TensorInfo(path, dtype, shape, base + start, base + end)
    return tensors, metadata


class Reader:
    """Memory-mapped, read-only views of tensors spread over one or more files.

    **Arguments:** `tensors`: name -> :class:`TensorInfo` (from :func:`read_header`).
    """

    def __init__(self, tensors: Mapping[str, TensorInfo]):
        self.tensors = dict(tensors)
        self._maps: dict[pathlib.Path, np.memmap] = {}

    def view(self, name: str) -> np.ndarray:
        """A read-only array backed by the file: slicing it reads only the bytes of the slice."""
        info = self.tensors[name]
        if info.dtype not in DTYPES:
            raise ValueError(f"{info.file}: tensor {name!r} has dtype {info.dtype}, which cannot be read")
        dtype = DTYPES[info.dtype]
        if info.end == info.start:
            return np.zeros(info.shape, dtype)
        if info.file not in self._maps:
            self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        raw = self._maps[info.file][info.start : info.end]
        return raw.view(dtype).reshape(info.shape)  # the file is little-endian, as is every host jax runs on

    def close(self) -> None:
        """Drop the file mappings (views already handed out keep theirs alive)."""
        self._maps.clear()


def write_file(
    path: str | os.PathLike,
    specs: Iterable[tuple[str, tuple[int, ...], Any]],
    produce: Callable[[str], np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write one safetensors file, producing one tensor at a time.

    ``specs`` gives ``(name, shape, dtype)`` of every tensor in file order; ``produce(name)`` is
    called once per tensor, in that order, and must return an array of exactly that shape and
    dtype. The header is written first from the specs, so at most one tensor is held at once.
    """
    specs = list(specs)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, shape, dtype in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # pad so that the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, dtype in specs:
            array = produce(name)
            if tuple(array.shape) != tuple(shape) or array.dtype != np.dtype(dtype):
                raise AssertionError(f"{name}: produced {array.dtype}{array.shape}, planned {np.dtype(dtype)}{shape}")
            if array.size:
                f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
