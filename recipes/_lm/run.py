"""A training run built from its flags: the model, tokenizer, corpus, optimizer and offload set,
every check that reads files or the model's abstract form done before anything is allocated.

:class:`Run` is what ``train_lm`` and ``finetune_hf`` train and what ``evaluate`` and
``generate`` restore a checkpoint into.
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import transforms
import zoo
from recipes._lm.data import ByteTokenizer, HFTokenizer, TokenCorpus, batch_at, open_corpus, segments_at
from recipes._lm.memory import check_memory
from recipes._lm.offload import OffloadSpec
from recipes._lm.run_setup import (
    apply_lora,
    build_model,
    check_seq,
    decay_mask,
    hf_config,
    is_hf_dir,
    lr_schedule,
    make_config,
    parse_mesh,
    planned_optimizer,
    process_rows,
    put_batch,
)

#: The seed of the validation batches (the same for every evaluation of every run).
VAL_SEED = 12345
#: Evaluation batches beyond this many passes over the validation split add nothing (its windows
#: are drawn at random) and only take time.
MAX_VAL_PASSES = 100


def batch_loss(loss_fn):
    """``loss_fn(model, tokens, mask, segment_ids=...)`` as a loss of a batch (see :meth:`Run.batch`):
    token windows, or ``{"tokens", "segment_ids", "mask"}`` (a packed batch's segment ids; chat data's
    loss mask: only the positions it marks count, the others get no gradient)."""

    def loss(model, batch):
        if not isinstance(batch, dict):
            return loss_fn(model, batch)
        return loss_fn(model, batch["tokens"], batch.get("mask"), segment_ids=batch.get("segment_ids"))

    return loss


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


def check_lora(args: argparse.Namespace, config) -> None:
    """The LoRA flags against the model's abstract form (nothing allocated): the targets exist and
    the rank is below every adapted projection's width."""

    def adapted(key):
        return lora_from_flags(zoo.build_model(config, key=key), args)

    shapes = eqx.filter_eval_shape(adapted, jax.random.key(0))
    layers = [n for n in jax.tree.leaves(shapes, is_leaf=lambda n: isinstance(n, zoo.nn.LoRALinear))]
    widths = [min(n.lora_a.shape[-2], n.lora_b.shape[-1]) for n in layers if isinstance(n, zoo.nn.LoRALinear)]
    if widths and args.lora_rank > min(widths):
        raise SystemExit(
            f"--lora-rank {args.lora_rank}: above the width of the narrowest adapted projection ({min(widths)}), "
            f"where a low-rank update is no longer low-rank; use at most --lora-rank {min(widths)} (or train every "
            "weight without --lora-rank)"
        )


def check_eval_batches(eval_batches: int, batch: int, seq: int, val_tokens: int) -> None:
    """At most `MAX_VAL_PASSES` passes over the validation split per evaluation."""
    cap = max(1, MAX_VAL_PASSES * val_tokens // (batch * (seq + 1)))
    if eval_batches > cap:
        raise SystemExit(
            f"--eval-batches {eval_batches}: {eval_batches:,} batches of {batch} x {seq} tokens would read the "
            f"{val_tokens:,}-token validation split more than {MAX_VAL_PASSES} times over (its windows are drawn at "
            f"random: more batches add nothing but time); use at most --eval-batches {cap:,}"
        )


def check_batch_split(args: argparse.Namespace, mesh) -> None:
    """Each micro-batch's rows split evenly over the mesh's batch axes (``data`` and ``fsdp``)."""
    if mesh is None:
        return
    shards = dict(mesh.shape).get("data", 1) * dict(mesh.shape).get("fsdp", 1)
    micro = args.batch // args.accum
    if micro % shards:
        if args.accum > 1:
            rows, what = (
                f"each micro-batch's {micro} rows (--batch {args.batch} / --accum {args.accum})",
                "--batch / --accum",
            )
        else:
            rows, what = f"a batch's {micro} rows", "--batch"
        raise SystemExit(
            f"--mesh {args.mesh}: {rows} do not split evenly over its {shards} data x fsdp devices; make {what} a "
            f"multiple of {shards}"
        )


def default_out(model: str) -> str:
    """``runs/<model>-<time>``."""
    name = pathlib.Path(model).name if is_hf_dir(model) else model.replace(":", "-")
    return str(pathlib.Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


class Run:
    """Everything a run needs, built from its flags (``args``) and its offload set (``offload``,
    default: parsed from ``args``). Every check that reads only files, configs or abstract shapes
    comes first: a mistake is one line before anything is loaded, allocated or compiled.
    ``warnings``: lines for the user (a flag that turned out to have no effect, ...)."""

    def __init__(self, args: argparse.Namespace, offload: OffloadSpec | None = None):
        self.args = args
        self.offload = OffloadSpec.of(args) if offload is None else offload
        #: the runtime's share of the host: this process's resident memory before anything is built
        #: (the first measurement's, see transforms.host_baseline), counted against the host's RAM
        self.host_baseline = transforms.host_baseline()
        self.warnings: list[str] = []
        hf = is_hf_dir(args.model)
        if hf:
            self.config = hf_config(args.model)
            check_seq(args.seq, self.config.max_seq_len, args.model)
        if hf and (pathlib.Path(args.model) / "tokenizer.json").is_file():
            self.tokenizer = HFTokenizer(args.model)
        else:
            self.tokenizer = ByteTokenizer()
        if hf:
            self._check_vocabulary()
        else:
            self.config = make_config(
                args.model,
                vocab_size=self.tokenizer.vocab_size,
                seq=args.seq,
                param_dtype=args.param_dtype,
                compute_dtype=args.compute_dtype,
            )
        self.mesh = parse_mesh(args.mesh)
        check_batch_split(args, self.mesh)
        self.lora = getattr(args, "lora_rank", 0) > 0
        self.offload.check_model(self.config, args.model)
        if self.lora:
            check_lora(args, self.config)
        self.plan = None
        quantize = getattr(args, "quantize", None)
        if self.offload.plan:  # the plan clips itself (a streamed update needs clip_norm, not a chained clip)
            shape = dict(self.mesh.shape) if self.mesh is not None else {}
            try:
                self.plan = transforms.plan(  # per device: its share of the batch, in --accum micro-batches
                    self.config,
                    batch=args.batch // shape.get("data", 1),
                    seq=args.seq,
                    fsdp=shape.get("fsdp", 1),
                    accum_steps=args.accum,
                    device=self.offload.plan,
                    optimizer=planned_optimizer(args),  # --moments: the state's bytes as the run stores them
                    clip_norm=args.clip,
                    quantize=quantize,
                    # this machine's runtime, as measured; a named profile is another machine's
                    host_baseline=self.host_baseline if self.offload.plan == "auto" else None,
                )
            except (ValueError, TypeError) as err:
                raise SystemExit(f"--plan {self.offload.plan}: {err}") from None
        self.warnings += check_memory(
            args, self.config, self.offload, self.mesh, lora=self.lora, plan=self.plan, host_baseline=self.host_baseline
        )
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
        self.warnings += self.corpus.warnings
        check_eval_batches(args.eval_batches, args.batch, args.seq, len(self.corpus.val))
        self.pack = getattr(args, "pack", False)
        if self.pack and self.corpus.doc_starts is None and self.tokenizer.eos_id is None:
            raise SystemExit(
                f"--pack: {args.data} is pre-tokenized and the tokenizer has no end-of-sequence token, so its "
                "documents cannot be told apart; give --no-pack"
            )
        self.built_on_host = False
        self.model = self._build_model(hf, quantize)
        if self.config.vocab_size < self.tokenizer.vocab_size:
            raise SystemExit(
                f"{args.model} has {self.config.vocab_size} tokens, the tokenizer {self.tokenizer.vocab_size}"
            )
        if self.lora:
            self.model = lora_from_flags(self.model, args)
        schedule = {"lr": args.lr, "warmup": args.warmup, "steps": args.steps, "kind": args.schedule}
        self.schedule = lr_schedule(**schedule)
        hyper = {**schedule, "weight_decay": args.weight_decay, "mask": decay_mask(self.model)}  # matrices only
        hyper["moments"] = getattr(args, "moments", "float32")
        hyper["param_dtype"] = getattr(args, "param_dtype", "float32")  # bfloat16: stochastic rounding
        # The deferred update's pending gradients in the dtype the planner counts them in (16 bits
        # where the weights stay on the device in float32 and compute in 16 bits).
        defer = self.plan is None and self.offload.opt_state in ("defer", "defer:stacks")
        self.model, optimizer, notes = self.offload.apply(
            self.model,
            hyper,
            clip=args.clip,
            plan=self.plan,
            built_on_host=self.built_on_host,
            pending_dtype=self.prediction().get("pending_dtype") if defer else None,
        )
        self.warnings += notes
        # The loss and its parts (the cross-entropy; a mixture of experts' router losses), logged each step.
        try:
            self.step_fn = transforms.train_step(
                batch_loss(zoo.lm_loss_and_metrics), optimizer, accum_steps=args.accum, has_aux=True
            )
        except ValueError as err:  # e.g. a deferred update with --accum > 1
            raise SystemExit(f"offload ({self.offload.label}): {err}") from None
        try:
            self.opt_state = self.step_fn.init(self.model)
        except ValueError as err:  # e.g. the streamed update refusing an optimizer that spans layers
            raise SystemExit(f"offload ({self.offload.label}): {err}") from None
        #: the sampling key's data (kept in the checkpoint's metadata)
        self.rng = [int(x) for x in np.asarray(jax.random.key_data(jax.random.key(args.seed + 1)))]
        self.rows = process_rows(args.batch)
        self.eval_loss = eqx.filter_jit(batch_loss(zoo.lm_loss))
        self.dropout_key = jax.random.key(args.seed + 4) if getattr(args, "lora_dropout", 0) > 0 else None

    def _check_vocabulary(self) -> None:
        """A Hugging Face checkpoint's tokenizer and end-of-sequence id fit its embedding."""
        model, vocab = self.args.model, self.config.vocab_size
        if vocab < self.tokenizer.vocab_size:
            raise SystemExit(
                f"the tokenizer of {model} has {self.tokenizer.vocab_size} tokens, more than the "
                f"{vocab} rows of the model's embedding"
            )
        eos = self.tokenizer.eos_id
        if eos is not None and not 0 <= eos < vocab:
            raise SystemExit(
                f"{model}: its end-of-sequence token id {eos} (eos_token_id) is outside the model's vocabulary of "
                f"{vocab}; every document would end in it. Fix eos_token_id in its config.json or "
                "generation_config.json"
            )

    def _build_model(self, hf: bool, quantize):
        args = self.args
        plan = self.plan.candidate if self.plan is not None else None
        # Offloaded weights are built or loaded straight into host memory: a model larger than the
        # device starts (quantized ones are made on the device, a weight at a time, and stay there).
        self.built_on_host = quantize is None and (self.offload.params if plan is None else bool(plan.params))
        if not hf:
            return build_model(
                args.model, self.config, self.mesh, seed=args.seed, quantize=quantize, on_host=self.built_on_host
            )
        # Full fine-tuning trains --param-dtype master weights; a LoRA base stays frozen in --base-dtype.
        dtype = getattr(args, "base_dtype", None) if self.lora else args.param_dtype
        model = build_model(
            args.model,
            None,
            self.mesh,
            seed=args.seed,
            compute_dtype=args.compute_dtype,
            dtype=dtype,
            quantize=quantize,
            on_host=self.built_on_host,
        )
        self.config = model.config
        return model

    def flush(self) -> None:
        """Apply a deferred optimizer's pending update to the run's model and state
        (``TrainStep.flush``; nothing for any other optimizer)."""
        self.model, self.opt_state = self.step_fn.flush(self.model, self.opt_state)

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
        """Take a restored checkpoint's ``state`` and ``metadata`` (its sampling key)."""
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
        if isinstance(self.corpus, TokenCorpus):
            self.corpus.check_ids(local, f"the {split} batch of step {step}")
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
        """A loss in nats per token as bits per byte of text."""
        return nats_per_token / math.log(2) / self.corpus.val_bytes_per_token

    def val_bits_per_byte(self) -> float:
        """The validation loss (``--eval-batches`` batches of the held-out split), bits per byte."""
        losses = [
            float(self.eval_loss(self.model, self.batch("val", k, VAL_SEED))) for k in range(self.args.eval_batches)
        ]
        return self.bits_per_byte(float(np.mean(losses)))

    def metadata(self, step: int) -> dict:
        """What a checkpoint's metadata holds besides the arrays: every flag, the step, the key."""
        return {
            "args": vars(self.args),
            "step": step,
            "rng": self.rng,
            "config": self.config.to_dict(),
            "tokenizer": self.tokenizer.name,
            "data_position": {"seed": self.args.seed, "next_step": step + 1},
            "tokens_seen": step * self.args.batch * self.args.seq,
        }

    @functools.cached_property
    def _prediction(self) -> dict:
        a = self.args
        plan = self.plan or transforms.plan(
            self.config,
            batch=a.batch,
            seq=a.seq,
            device="h100",
            optimizer=planned_optimizer(a),
            quantize=getattr(a, "quantize", None),
        )
        return self.offload.predict(plan)

    def prediction(self) -> dict:
        """The planner's bytes for the transforms this run uses (gradients and activations): made
        once a run (its sizes and transforms do not change)."""
        return self._prediction


@eqx.filter_jit
def all_finite(model) -> jax.Array:
    """Whether every floating-point parameter is finite (each is read onto the device in turn)."""
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    checks = [jnp.isfinite(jax.device_put(x, jax.memory.Space.Device)).all() for x in leaves]
    return jnp.stack(checks).all()
