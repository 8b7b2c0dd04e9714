"""Model, mesh, processes and optimizer of the language-model recipes (the offload set is
:mod:`recipes._lm.offload`'s)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import transforms
import zoo
from zoo import sharding


def one_line_warnings() -> None:
    """Show each warning as one line (``warning: ...``), without the source line Python adds: a
    recipe's warnings (a corrupted checkpoint skipped, ...) are for its user, not its code."""
    warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"


def init_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Start JAX's multi-process runtime when asked (flags, or the variables JAX reads itself)."""
    if coordinator is None and "JAX_COORDINATOR_ADDRESS" not in os.environ:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise SystemExit("--num-processes/--process-id need --coordinator HOST:PORT")
        return
    if jax.config.jax_platforms in ("cpu",) or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    try:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    except (ValueError, RuntimeError) as err:  # missing counts, an unreachable coordinator (after its timeout)
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise SystemExit(
            f"--coordinator {coordinator}: the multi-process runtime did not start ({first}); give --num-processes N "
            "and --process-id I on every process, and a HOST:PORT that process 0 can listen on"
        ) from None


def parse_mesh(spec: str | None):
    """``"data=2,fsdp=4,tensor=1"`` -> a mesh over all devices of all processes (``None``: no mesh)."""
    if not spec:
        if jax.process_count() > 1:
            return sharding.make_mesh(fsdp=jax.device_count())
        return None
    sizes = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        if name not in sharding.MESH_AXES or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--mesh: bad entry {part!r}; use e.g. data=2,fsdp=4,tensor=1 (axes {sharding.MESH_AXES})")
        if name in sizes:
            raise SystemExit(f"--mesh {spec}: the axis {name} is given twice; give each axis once")
        sizes[name] = int(value)
    if math.prod(sizes.values()) != jax.device_count():
        raise SystemExit(f"--mesh {spec} has {math.prod(sizes.values())} devices but there are {jax.device_count()}")
    return sharding.make_mesh(**sizes)


def is_hf_dir(spec: str) -> bool:
    return pathlib.Path(spec).is_dir() and (pathlib.Path(spec) / "config.json").is_file()


def make_config(spec: str, *, vocab_size: int, seq: int, param_dtype: str, compute_dtype: str):
    """The config of ``--model FAMILY:PRESET`` sized for the tokenizer and the sequence length.

    Raises `SystemExit` for an unknown model and for a ``seq`` beyond the preset's positions."""
    try:
        preset = zoo.config_from_name(spec)
    except (TypeError, ValueError) as err:
        raise SystemExit(f"--model {spec}: {err} (or give a Hugging Face checkpoint directory)") from None
    check_seq(seq, preset.max_seq_len, spec)
    return zoo.config_from_name(
        spec,
        vocab_size=vocab_size,
        max_seq_len=max(seq, 128),
        param_dtype=param_dtype,
        compute_dtype=compute_dtype,
    )


def check_seq(seq: int, positions: int, model: str) -> None:
    if seq > positions:
        raise SystemExit(
            f"--seq {seq} is longer than the {positions} positions of {model}; use at most --seq {positions}"
        )


def hf_config(directory: str):
    """The zoo config of a Hugging Face directory, read from ``config.json`` alone (no weights):
    an unsupported ``model_type`` or setting is one line, before anything is loaded."""
    try:
        return zoo.hf.config_from_hf(zoo.hf.read_config(pathlib.Path(directory)))
    except json.JSONDecodeError as err:
        raise SystemExit(
            f"--model {directory}: its config.json is not readable JSON ({err}); download it again"
        ) from None
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"--model {directory}: {err}") from None


def build_model(
    spec: str,
    cfg,
    mesh,
    *,
    seed: int,
    compute_dtype: str | None = None,
    dtype: str | None = None,
    quantize: str | None = None,
    on_host: bool = False,
):
    """A fresh model (preset), or the weights of a Hugging Face directory in ``dtype`` (default:
    the checkpoint's own); sharded over ``mesh``; with ``quantize`` (``nf4``/``int8``) the stack's
    projections quantized (a checkpoint's as they load). ``on_host``: an unquantized model is built
    (``transforms.init_offloaded``) or loaded (``zoo.load_hf(..., memory_kind=transforms.offload_params)``)
    straight into ``offload_params``' placement: the device never holds every weight, and
    ``offload_params`` has nothing left to move."""
    try:
        if is_hf_dir(spec):
            kind = transforms.offload_params if on_host and quantize is None else None
            return zoo.load_hf(
                spec, mesh=mesh, dtype=dtype, compute_dtype=compute_dtype, quantize=quantize, memory_kind=kind
            )
        key = jax.random.key(seed)
        if on_host and quantize is None:
            return transforms.init_offloaded(lambda k: zoo.build_model(cfg, key=k), key=key, mesh=mesh)
        if mesh is None:
            model = zoo.build_model(cfg, key=key)
        else:
            model = sharding.init_sharded(lambda k: zoo.build_model(cfg, key=k), mesh, key=key)
        return model if quantize is None else transforms.quantize(model, quantize)
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"--model {spec}: {err}") from None


def parse_targets(spec: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in spec.split(",") if t.strip())


def apply_lora(model, *, rank: int, alpha: float | None, targets: str, dropout: float, dtype: str, seed: int):
    """``transforms.lora`` with the recipe's flags (alpha defaults to twice the rank)."""
    try:
        return transforms.lora(
            model,
            rank=rank,
            alpha=2.0 * rank if alpha is None else alpha,
            targets=parse_targets(targets),
            dropout=dropout,
            dtype=jnp.dtype(dtype),
            key=jax.random.key(seed + 3),
        )
    except ValueError as err:
        raise SystemExit(f"--lora-targets {targets}: {err}") from None


def lr_schedule(*, lr: float, warmup: int, steps: int, kind: str = "cosine"):
    """Linear warmup to ``lr`` over ``warmup`` steps, then (``kind``) cosine or linear decay to
    ``lr / 10`` at ``steps``, or ``lr`` to the end: a function of the optimizer's step count alone,
    so a run resumed with other flags follows the schedule of those flags from its step on (a
    longer ``steps`` re-stretches the decay over the new length)."""
    warmup = min(warmup, steps - 1)  # a short run warms up for less than its length
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, lr / 10)
    after = optax.linear_schedule(lr, lr / 10, steps - warmup) if kind == "linear" else optax.constant_schedule(lr)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


def lr_schedule_warning(lr: float, warmup: int, steps: int) -> str | None:
    """What to tell a user whose run is shorter than its warmup (``None`` if it is not)."""
    if steps >= warmup:
        return None
    return (
        f"--steps {steps} is shorter than --warmup {warmup}: the warmup is cut to {max(steps - 1, 0)} steps, so the "
        f"learning rate rises for the whole run and reaches --lr {lr} only at its last step (lower --warmup to "
        "warm up faster)"
    )


def decay_mask(model):
    """Which weights get weight decay: the matrices, read from their logical axes
    (``zoo.nn.logical_axes``): two or more axes besides a stack's ``layers`` axis. Norm scales,
    biases and scalars are not decayed; embeddings, projections and LoRA adapters are (decaying
    an adapter pulls the model back toward its base, as Hugging Face's Trainer does).

    Returns a function of the parameter tree, matched by tree path, so it gives the same answer
    on the whole tree and on one layer of it (``offload_opt_state(stream=True)``)."""
    specs = zoo.nn.logical_axes(model)
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, P))[0]
    table = {
        jax.tree_util.keystr(path): sum(axis != "layers" for axis in spec) >= 2
        for path, spec in flat
        if isinstance(spec, P)
    }

    def mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: table[jax.tree_util.keystr(path)], params)

    return mask


#: ``--moments``: the dtype AdamW's moments are stored in between steps (float32: as optax keeps
#: them; the others through :func:`transforms.compact_state`).
MOMENTS = ("float32", *transforms.STATE_DTYPES)


def make_optimizer(
    *,
    lr: float,
    warmup: int,
    steps: int,
    weight_decay: float,
    clip: float | None,
    mask=None,
    kind: str = "cosine",
    moments: str = "float32",
    param_dtype: str = "float32",
) -> optax.GradientTransformation:
    """AdamW with warmup and decay (:func:`lr_schedule` of ``kind``), after a global-norm clip
    (``clip=None``: no clip, for callers that clip elsewhere, e.g. a streamed update's
    ``clip_norm``); weight decay only where ``mask`` says (:func:`decay_mask`; ``None``: all).
    ``moments`` (one of `MOMENTS`): ``"bfloat16"`` or ``"float8"`` store AdamW's moments in that
    format between steps (``transforms.compact_state``: the update itself runs in float32; the clip
    holds no state, so it stays outside). ``param_dtype="bfloat16"``: the trained weights are stored
    in bfloat16, so AdamW runs through ``transforms.stochastic_rounding`` (float32 moments and
    math, each new weight rounded stochastically: rounded to nearest, updates below half the
    spacing would be lost)."""
    if moments not in MOMENTS:
        raise ValueError(f"make_optimizer: unknown moments {moments!r}; choose one of {', '.join(MOMENTS)}")
    schedule = lr_schedule(lr=lr, warmup=warmup, steps=steps, kind=kind)
    adamw = optax.adamw(schedule, weight_decay=weight_decay, mask=mask)
    if param_dtype == "bfloat16":
        adamw = transforms.stochastic_rounding(adamw)
    if moments != "float32":
        adamw = transforms.compact_state(adamw, moments)
    return adamw if clip is None else optax.chain(optax.clip_by_global_norm(clip), adamw)


def planned_optimizer(args):
    """The optimizer the planner sizes the state of for a run of ``args`` (``transforms.plan``'s
    ``optimizer=``): its name ``"adamw"`` with float32 moments (the planner's own AdamW, as before
    ``--moments``), else the run's AdamW with its moments stored as ``--moments`` (bfloat16 weights:
    through ``transforms.stochastic_rounding``, whose moments are float32 where optax's own would be
    bfloat16), unclipped (the planner counts ``--clip`` from its ``clip_norm``) and without the decay
    mask (which adds no state)."""
    moments = getattr(args, "moments", "float32")
    param_dtype = getattr(args, "param_dtype", "float32")
    if moments == "float32" and param_dtype != "bfloat16":
        return "adamw"
    return make_optimizer(
        lr=args.lr,
        warmup=args.warmup,
        steps=args.steps,
        weight_decay=args.weight_decay,
        clip=None,
        kind=getattr(args, "schedule", "cosine"),
        moments=moments,
        param_dtype=param_dtype,
    )


def put_batch(tokens: np.ndarray, mesh, global_shape):
    """A process's rows of the global batch as one global array (sharded over the mesh's batch axes)."""
    if mesh is None:
        return jnp.asarray(tokens)
    return jax.make_array_from_process_local_data(sharding.batch_sharding(mesh), tokens, global_shape)


def process_rows(batch: int) -> slice:
    """The rows of a global batch this process supplies."""
    n, i = jax.process_count(), jax.process_index()
    if batch % n:
        raise SystemExit(f"--batch {batch} must divide evenly over {n} processes")
    per = batch // n
    return slice(i * per, (i + 1) * per)


def sample(model, prompt_ids, n_new: int, key, *, n_samples: int = 3, temperature: float = 0.8):
    """``n_samples`` continuations of ``prompt_ids`` by :func:`zoo.generate` (a KV cache): the
    prompt's last tokens and as many new ones as the model's positions hold."""
    limit = model.config.max_seq_len
    prompt = np.asarray(prompt_ids, np.int32)[-(limit - 1) :]
    if prompt.size == 0:
        prompt = np.zeros((1,), np.int32)
    n_new = min(n_new, limit - prompt.size)
    prompts = [jnp.asarray(prompt)] * n_samples
    return zoo.generate(model, prompts, max_new_tokens=n_new, key=key, temperature=temperature)
