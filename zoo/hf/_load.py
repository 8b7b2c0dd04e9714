"""`load_hf`: a local Hugging Face model directory -> a zoo model, placed where asked."""

from __future__ import annotations

import functools
import json
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, Sharding, SingleDeviceSharding

from .. import sharding as _sharding
from .._build import abstract_model
from .._config import DTYPES
from .._decoder import RotaryDecoder
from .._gpt2 import GPT2
from ..nn import QuantizedWeight, memory_typed, quantize_linears, quantize_weight
from ..nn._placement import is_arraylike
from . import _table, _weights
from ._safetensors import DTYPES as ST_DTYPES
from ._safetensors import Reader, TensorInfo, read_header
from ._table import config_from_hf, model_type_of

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def param_dtype_name(dtype: Any) -> str:
    """``"float32"``, ``"bfloat16"`` or ``"float16"`` for any spelling of those dtypes."""
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} (or the numpy/jax dtype), got {dtype!r}")
    return name


def read_config(directory: str | pathlib.Path) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face model directory, as a dict (no weights are read).

    **Raises:** `FileNotFoundError` if there is none, `ValueError` if it is not a JSON object.

    **Example:**

    ```python
    import tempfile, jax, zoo
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    with tempfile.TemporaryDirectory() as d:
        zoo.hf.save_hf(model, d)
        assert zoo.hf.config_from_hf(zoo.hf.read_config(d)) == model.config
    ```
    """
    directory = pathlib.Path(directory)
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json: not a Hugging Face model directory")
    with open(path) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return config


def read_tensors(directory: str | pathlib.Path) -> dict[str, TensorInfo]:
    """Name -> location of every tensor of the checkpoint (headers only; no tensor is read): each a
    ``TensorInfo`` with its ``file``, safetensors ``dtype`` name (``"F32"``, ``"BF16"``, ...) and ``shape``.

    **Example:**

    ```python
    import tempfile, jax, zoo
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    with tempfile.TemporaryDirectory() as d:
        zoo.hf.save_hf(model, d)
        {info.dtype for info in zoo.hf.read_tensors(d).values()}   # {'F32'}
    ```
    """
    directory = pathlib.Path(directory)
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.is_file():  # the file transformers prefers when both exist
        return read_header(single)[0]
    if not index.is_file():
        found = sorted(
            p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors", ".h5")
        )
        hint = f"; found {found} (only safetensors checkpoints are read)" if found else ""
        raise FileNotFoundError(f"{directory} has no weights: neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
    with open(index) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no weight_map")
    files = sorted(set(weight_map.values()))
    absent = [name for name in files if not (directory / name).is_file()]
    if absent:
        raise FileNotFoundError(f"{index} names shard files that are not in {directory}: {absent}")
    tensors: dict[str, TensorInfo] = {}
    problems = []
    for name in files:
        for tensor, info in read_header(directory / name)[0].items():
            if tensor in tensors:
                problems.append(f"{tensor} is stored twice ({tensors[tensor].file.name} and {name})")
            tensors[tensor] = info
    for tensor, name in weight_map.items():
        if tensor not in tensors or tensors[tensor].file.name != name:
            problems.append(f"{tensor}: the index says {name}, but it is not there")
    if problems:
        raise ValueError(f"{index} disagrees with its shard files:\n  " + "\n  ".join(problems))
    return tensors


def _infer_dtype(tensors: Mapping[str, TensorInfo], names: list[str], hf: Mapping[str, Any]) -> str:
    stored = {tensors[n].dtype for n in names}
    if len(stored) == 1:
        (only,) = stored
        name = ST_DTYPES[only].name
        if name in DTYPES:
            return name
        raise ValueError(f"the checkpoint stores {only} tensors; pass dtype= (one of {DTYPES}) to convert them")
    declared = hf.get("dtype", hf.get("torch_dtype"))
    if declared in DTYPES:
        return declared
    raise ValueError(f"the checkpoint mixes dtypes {sorted(stored)}; pass dtype= (one of {DTYPES})")


def _check_tied_copy(reader: Reader, head: str, embedding: str) -> None:
    a, b = reader.view(head), reader.view(embedding)
    rows = max(1, (1 << 24) // max(1, a[0].nbytes))  # compare ~16 MB at a time
    for start in range(0, a.shape[0], rows):
        if not np.array_equal(
            np.asarray(a[start : start + rows], np.float32), np.asarray(b[start : start + rows], np.float32)
        ):
            raise ValueError(
                f"the checkpoint has a {head} that differs from {embedding}, but config.json ties them "
                "(tie_word_embeddings); the zoo model cannot hold both"
            )


def load_hf(
    directory: str | os.PathLike,
    *,
    dtype: Any = None,
    compute_dtype: Any = None,
    scan_layers: bool = True,
    mesh: Mesh | None = None,
    rules: Mapping | None = None,
    sharding: Sharding | None = None,
    memory_kind: str | Callable | None = None,
    quantize: str | None = None,
    block_size: int = 64,
) -> GPT2 | RotaryDecoder:
    """Load a local Hugging Face checkpoint (GPT-2, Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral,
    Gemma 2 or Gemma 3 text) as a zoo model.

    Reads ``config.json`` (written by older or current ``transformers`` releases) and
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``. The architecture must be
    one the zoo represents exactly; anything else raises `ValueError` naming the config field.
    Tensors are matched to the model by an explicit name table (see ``zoo.hf._weights``); all
    missing, unexpected and mis-shaped tensors are reported together in one `ValueError`.

    Loading is lazy: each weight is read from the memory-mapped files shard by shard, converted,
    and put straight into its target sharding and memory kind, one weight at a time. A checkpoint
    larger than device memory can so be loaded into ``memory_kind="pinned_host"`` (for
    :func:`transforms.offload_params`-style training), holding about one weight in host memory
    beyond the result.

    **Arguments:**

    - `directory`: the model directory (as written by ``save_pretrained`` or :func:`zoo.save_hf`).
    - `dtype`: parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``); default: the
      checkpoint's own dtype.
    - `compute_dtype`: activation dtype; default: the parameter dtype.
    - `scan_layers`: the zoo config's ``scan_layers``.
    - `mesh`, `rules`: shard every weight over ``mesh`` by the rules of :mod:`zoo.sharding`.
    - `sharding`: instead of a mesh, one `jax.sharding.Sharding` for every weight.
    - `memory_kind`: e.g. ``"pinned_host"``, ``"device"``; default: the sharding's default. Or a
      function that places the abstract model, such as :func:`transforms.offload_params`: each
      weight loads straight into the memory kind of its sharding there (the default where it has
      none), so ``memory_kind=transforms.offload_params`` gives that transform's placement without
      the model ever being whole on the device.
    - `quantize`: ``"nf4"`` or ``"int8"``: the projections inside the stack are quantized as they
      load (see :func:`transforms.quantize`, with `block_size`): each weight is read to the device,
      quantized there and only its codes and scales go to their target memory, so a dense copy of
      the model never exists; the other weights load as usual.

    Without `mesh` or `sharding` the weights go to the first device.

    **Example:**

    ```python
    import tempfile, jax, zoo
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    with tempfile.TemporaryDirectory() as d:
        zoo.save_hf(model, d)                       # or any HF gpt2/llama/mistral/qwen2 directory
        same = zoo.load_hf(d)
        on_host = zoo.load_hf(d, dtype="bfloat16", memory_kind="pinned_host")
    on_host.embed.weight.sharding.memory_kind       # 'pinned_host'
    ```
    """
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory")
    if mesh is not None and sharding is not None:
        raise ValueError("pass either mesh= (with rules=) or sharding=, not both")
    hf = read_config(directory)
    model_type_of(hf)
    tensors = read_tensors(directory)
    settings = dict(scan_layers=scan_layers)
    config = config_from_hf(hf, **settings)
    prefix = "transformer." if any(n.startswith("transformer.") for n in tensors) else ""
    entries = _table.table(config, prefix)
    derived = _table.derived(config)  # leaves rebuilt from the config (per-layer attention kinds)
    leaves = _weights.leaf_paths(abstract_model(config))
    _weights.check_table(entries, {p: x for p, x in leaves.items() if p not in derived}, config.n_layers)
    tied = _table.tied_head_name(config, prefix)
    _weights.validate(
        tensors,
        entries,
        leaves,
        config.n_layers,
        ignore=_table.ignored(hf["model_type"]),
        tied=tied,
        where=str(directory),
    )
    names = [n for e in entries for n in e.names(config.n_layers)]
    param_dtype = _infer_dtype(tensors, names, hf) if dtype is None else param_dtype_name(dtype)
    config = config.replace(
        param_dtype=param_dtype,
        compute_dtype=param_dtype if compute_dtype is None else param_dtype_name(compute_dtype),
    )
    abstract = abstract_model(config)
    arrays, static = eqx.partition(abstract, is_arraylike)
    leaves = _weights.leaf_paths(arrays)
    quantized = _quantized_paths(abstract, quantize, block_size)

    kinds = _memory_kinds(memory_kind, abstract, leaves)
    if mesh is not None:
        on_device = _weights.leaf_paths(_sharding.shardings(arrays, mesh, rules, memory_kind="device"))
        targets = {p: on_device[p] if kinds[p] is None else on_device[p].with_memory_kind(kinds[p]) for p in leaves}
    else:
        one = SingleDeviceSharding(jax.devices()[0]) if sharding is None else sharding
        on_device = dict.fromkeys(leaves, one.with_memory_kind("device"))
        targets = {p: one if kinds[p] is None else one.with_memory_kind(kinds[p]) for p in leaves}

    reader = Reader(tensors)
    try:
        if tied is not None and tied[0] in tensors:
            _check_tied_copy(reader, *tied)
        loader = _weights.LeafLoader(reader, entries, leaves)
        loaded = []
        for path, leaf in leaves.items():
            if path in derived:
                loaded.append(jax.device_put(derived[path].astype(leaf.dtype), targets[path]))
                continue
            if path in quantized:  # read to the device, quantized there; only codes and scales stay
                dense = loader.load(path, leaf.dtype, on_device[path])
                loaded.append(_quantize_to(dense, quantize, block_size, kinds[path]))
                del dense
            else:
                loaded.append(memory_typed(loader.load(path, leaf.dtype, targets[path])))
            reader.close()  # unmap after each weight: the pages read stay in the page cache, not in this process
    finally:
        reader.close()
    treedef = jax.tree_util.tree_structure(arrays)
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, loaded), static, is_leaf=_is_quantized)


def _memory_kinds(memory_kind, abstract, leaves: dict) -> dict:
    """Each leaf path's memory kind (``None``: the sharding's default): ``memory_kind`` itself, or
    the kinds of the shardings a placing function gives the abstract model."""
    if not callable(memory_kind):
        return dict.fromkeys(leaves, memory_kind)
    placed = _weights.leaf_paths(eqx.filter(memory_kind(abstract), is_arraylike))
    if set(placed) != set(leaves):
        raise ValueError("load_hf: memory_kind(model) must return the model it was given, placed (the same leaves)")
    return {p: getattr(getattr(placed[p], "sharding", None), "memory_kind", None) for p in leaves}


def _is_quantized(node) -> bool:
    return isinstance(node, QuantizedWeight)


def _quantized_paths(abstract, scheme: str | None, block_size: int) -> set[str]:
    """The leaf paths of the weights ``load_hf(..., quantize=scheme)`` quantizes (none without one)."""
    if scheme is None:
        return set()
    arrays, static = eqx.partition(abstract, is_arraylike)
    quantized = jax.eval_shape(
        lambda a: quantize_linears(eqx.combine(a, static), scheme, block_size=block_size), arrays
    )
    flat = jax.tree_util.tree_flatten_with_path(quantized, is_leaf=_is_quantized)[0]
    return {jax.tree_util.keystr(p, simple=True, separator=".") for p, n in flat if _is_quantized(n)}


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_on_device(dense, scheme: str, block_size: int) -> QuantizedWeight:
    return quantize_weight(dense, scheme, block_size=block_size)


def _quantize_to(dense, scheme: str, block_size: int, memory_kind: str | None) -> QuantizedWeight:
    q = _quantize_on_device(dense, scheme, block_size)
    if memory_kind in (None, "device"):
        return q
    return jax.tree.map(lambda a: jax.device_put(a, a.sharding.with_memory_kind(memory_kind)), q)
