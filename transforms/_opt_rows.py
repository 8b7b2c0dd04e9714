"""The streamed update of large leaves outside the stacks, in row blocks, in place.

The embedding and the head of a large vocabulary are the largest leaves of a model (``llama:1b``'s
tied embedding: 0.98 GiB in float32). Updated whole, each brings itself, its gradient and its optimizer
state to the device at once and leaves a second copy of its state in host memory until the step
ends: that set ``llama:1b``'s peak on a TPU v5e. Here such a leaf is viewed as ``(blocks, rows,
...)`` (whole rows along its first dimension, a multiple of 8 rows a block, about 16 MiB each:
``_row_blocks``) and updated block by block with the stacks' in-place scan: one block of it and of
its state on the device at a time, written back over the old one. On one device
only: a leaf laid out over a mesh is updated whole.

Exact only for an optimizer whose update of a leaf is elementwise over its rows (Adam, SGD, Lion,
weight decay, schedules and path-based labels are): a probe on a tiny copy of each leaf compares
its whole update with the update of its two halves; a leaf that fails it (a per-leaf norm, such as
LAMB's trust ratio), or whose optimizer state cannot be matched to it leaf by leaf
(`optax.tree_utils.tree_map_params`), is updated whole, as before.

A :func:`transforms.compact_state` optimizer's copies are matched through the optimizer it wraps;
a float8 copy is a ``Float8Block`` whose pieces already are the leaf's row blocks (see
``_compact_state.segments``), so it is updated in those blocks, each decoded and encoded alone.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zoo.nn import on_host

from ._compact_state import CompactState, Float8Block, segments
from ._row_blocks import ROW_MULTIPLE, row_blocks


def _is_none(x) -> bool:
    return x is None


def _copy_leaf(x) -> bool:
    return x is None or isinstance(x, Float8Block)


def _mapped(inner):
    """The optimizer whose ``init`` shows where ``inner``'s state holds copies of the parameters,
    and what a copy is: ``compact_state``'s state mirrors the state of the optimizer it wraps,
    with a ``Float8Block`` (two arrays) where a float8 moment is."""
    return (inner.inner, _copy_leaf) if isinstance(inner, CompactState) else (inner, _is_none)


def copy_blocks(copy, k: int):
    """A copy of a leaf (its moment) as ``k`` row blocks: viewed so (:func:`blocks_view`), or, a
    float8 copy, as it is stored (its pieces are the blocks)."""
    return copy if isinstance(copy, Float8Block) else blocks_view(copy, k)


def copy_whole(blocks, shape: tuple):
    """The inverse of :func:`copy_blocks` for a leaf of ``shape``."""
    return blocks if isinstance(blocks, Float8Block) else blocks.reshape(shape)


def index_tree(tree):
    """``tree`` with its ``i``-th array leaf replaced by ``i`` (``None`` leaves kept)."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, list(range(len(leaves))))


def only(tree, j: int, value):
    """A tree shaped like ``tree`` with ``value`` at its ``j``-th leaf and ``None`` elsewhere."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [value if i == j else None for i in range(len(leaves))])


def copies_of(inner, state, idx, j: int) -> list:
    """The leaves of ``state`` (an ``inner`` state) that are leaf ``j``'s copies (its moments)."""
    found = []

    def pick(x, i):
        if i == j and x is not None:
            found.append(x)
        return x

    opt, leaf = _mapped(inner)
    optax.tree_utils.tree_map_params(opt, pick, state, idx, is_leaf=leaf)
    return found


def with_copies(inner, state, idx, values: dict):
    """``state`` with leaf ``j``'s copies replaced by ``values[j]`` (in :func:`copies_of`'s order)
    for each ``j`` of ``values``."""
    its = {j: iter(v) for j, v in values.items()}
    opt, leaf = _mapped(inner)
    return optax.tree_utils.tree_map_params(opt, lambda x, i: next(its[i]) if i in its else x, state, idx, is_leaf=leaf)


def without(inner, state, idx, drop: set):
    """``state`` with the copies of the leaves in ``drop`` replaced by ``None``."""
    opt, leaf = _mapped(inner)
    return optax.tree_utils.tree_map_params(opt, lambda x, i: None if i in drop else x, state, idx, is_leaf=leaf)


def rows_separable(inner, treedef, j: int, ndim: int) -> bool:
    """:func:`_rows_separable`, remembered per optimizer and leaf (each step traces it again)."""
    try:
        return _remembered(inner, treedef, j, ndim)
    except TypeError:  # an optimizer that cannot be hashed: probed every time
        return _rows_separable(inner, treedef, j, ndim)


def _rows_separable(inner, treedef, j: int, ndim: int) -> bool:
    """Whether ``inner`` updates leaf ``j`` of a tree of ``treedef`` row by row: one step on a tiny
    copy of the leaf (16 rows; gradients of very different sizes in each half), whole and in two
    halves, gives the same update and the same new state."""
    rng = np.random.default_rng(0)
    shape = (2 * ROW_MULTIPLE, *(2,) * (ndim - 1))
    p = jnp.asarray(rng.standard_normal(shape) * 1e2, jnp.float32)
    g = np.asarray(rng.standard_normal(shape), np.float32)
    g[:ROW_MULTIPLE] *= 1e2
    g[ROW_MULTIPLE:] *= 1e-4
    g = jnp.asarray(g)
    n = treedef.num_leaves
    tree = lambda v: jax.tree.unflatten(treedef, [v if i == j else None for i in range(n)])
    idx = jax.tree.unflatten(treedef, list(range(n)))

    def step(p, g):
        u, s = inner.update(tree(g), inner.init(tree(p)), tree(p))
        return jax.tree.leaves(u), copies_of(inner, s, idx, j)

    def both(p, g):
        whole = step(p, g)
        halves = [step(p[a : a + ROW_MULTIPLE], g[a : a + ROW_MULTIPLE]) for a in (0, ROW_MULTIPLE)]
        joined = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *halves)
        return whole, joined

    try:
        # Called while the step is traced; JAX's tracing state is per thread, so a thread of its
        # own runs the probe now, on concrete arrays.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            whole, joined = pool.submit(jax.jit(both), p, g).result()
    except Exception:  # a state that cannot be matched to the leaf, or shapes that do not split
        return False
    flat_whole, flat_joined = jax.tree.leaves(whole), jax.tree.leaves(joined)
    if len(flat_whole) != len(flat_joined) or not flat_whole:
        return False
    return all(
        a.shape == b.shape and np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=0)
        for a, b in zip(flat_whole, flat_joined, strict=True)
    )


_remembered = functools.lru_cache(maxsize=256)(_rows_separable)


def _one_device(x) -> bool:
    """Whether ``x`` (traced) is on one device, not laid out over a mesh: a block view of a leaf
    split between devices would make XLA move it between them."""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    return mesh is None or mesh.empty or math.prod(mesh.shape.values()) == 1


def blocked_leaves(inner, params_rest, state_rest) -> dict[int, int]:
    """``{j: blocks}`` for the leaves of ``params_rest`` (the leaves outside the stacks, in tree
    order) updated in row blocks: large enough (:func:`row_blocks`), with every copy of them in
    the optimizer state in host memory (where the in-place write saves the second copy), and
    updated row by row by ``inner`` (:func:`rows_separable`)."""
    leaves, treedef = jax.tree.flatten(params_rest)
    sizes = {j: row_blocks(tuple(p.shape), p.dtype.itemsize) for j, p in enumerate(leaves)}
    sizes = {j: k for j, k in sizes.items() if k}
    if not sizes:
        return {}
    idx = index_tree(params_rest)
    out = {}
    for j, k in sizes.items():
        try:
            copies = copies_of(inner, state_rest, idx, j)
        except Exception:  # the state does not mirror the parameters in a way optax can map
            return {}
        if any(isinstance(c, Float8Block) for c in copies):  # stored in row blocks already
            k = segments(leaves[j].shape)
            block = (leaves[j].shape[0] // k, *leaves[j].shape[1:])
            arrays = jax.tree.leaves(copies)
            if k == 1 or segments(block) != 1 or not all(on_host(c) and c.shape[0] == k for c in arrays):
                continue
        else:
            arrays = copies
            if not copies or not all(on_host(c) and c.shape == leaves[j].shape for c in copies):
                continue
        if not all(_one_device(x) for x in (leaves[j], *arrays)):
            continue
        # compact_state's storage keeps rows apart (its scales run along the last axis): the
        # optimizer it wraps decides.
        if rows_separable(_mapped(inner)[0], treedef, j, leaves[j].ndim):
            out[j] = k
    return out


def blocks_view(x, k: int):
    """``x`` viewed as ``(k, rows / k, ...)``."""
    return x.reshape((k, x.shape[0] // k, *x.shape[1:]))
