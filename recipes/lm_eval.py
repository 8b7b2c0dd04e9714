"""Score a model on EleutherAI's lm-evaluation-harness tasks (``pip install -e '.[eval]'``).

    python -m recipes.lm_eval path/to/hf_checkpoint --tasks hellaswag,arc_easy --output-path results
    python -m recipes.lm_eval runs/llama-tiny-20261202-120000 --tasks lambada_openai --limit 100
    python -m recipes.lm_eval llama:tiny --tasks my_task --include-path my_tasks/ --log-samples \
        --output-path results
    python -m recipes.lm_eval path/to/hf_checkpoint --tasks piqa --offload params --cache-memory-kind pinned_host

``MODEL`` is a Hugging Face checkpoint directory (its ``tokenizer.json`` encodes the text), a
``train_lm`` run directory (its last intact checkpoint, or ``--step``), or a ``FAMILY:PRESET`` name
(random weights and the byte tokenizer: a smoke test of the wiring). :class:`ZooLM` is the model
class ``lm_eval`` calls: ``loglikelihood`` and ``loglikelihood_rolling`` run the model over padded
batches (one compiled program per batch width), ``generate_until`` runs :func:`zoo.generate`.
The results are lm-eval's own JSON (``--output-path``), with its per-sample files under
``--log-samples``.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

import transforms
import zoo
from recipes._lm import cli
from recipes._lm.data import _read_json, eos_token_id
from recipes._lm.run_setup import is_hf_dir, one_line_warnings

#: The byte tokenizer has no end-of-sequence token: a newline stands before an empty context.
BYTE_PREFIX = ord("\n")


class Tokens:
    """Text to token ids as lm-eval's ``hf`` model encodes it: a Hugging Face ``tokenizer.json``
    (special tokens added by its own post-processor unless the text starts with the BOS token),
    or UTF-8 bytes (``directory=None``)."""

    def __init__(self, directory: str | None):
        self.directory = directory
        if directory is None:
            self._tok, self.bos_id, self.eos_id, self.vocab_size = None, None, None, 256
            return
        self._tok = zoo.hf.load_hf_tokenizer(directory)
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = eos_token_id(directory, self._tok)
        bos = _read_json(pathlib.Path(directory) / "tokenizer_config.json").get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        self.bos_id = self._tok.token_to_id(bos) if isinstance(bos, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._tok is None:
            return list(text.encode())
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self._tok is None:
            return bytes(ids).decode("utf-8", "replace")
        return self._tok.decode(ids)


def _bucket(n: int, low: int) -> int:
    """``n`` rounded up to a power of two, at least ``low`` (few widths, few compiled programs)."""
    return max(low, 1 << (max(n, 1) - 1).bit_length())


@eqx.filter_jit
def _token_logprobs(model, inputs, targets):
    """``(log p(targets), targets are the argmax)``, both ``(batch, width)``, of ``inputs``."""
    logits = jax.vmap(model)(inputs).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logits, axis=-1) == targets


class ZooLM(TemplateLM):
    """A zoo model as an lm-evaluation-harness model (``lm_eval.api.model.LM``).

    **Arguments:**

    - `model`: any zoo model (weights on the device, or in host memory after
      :func:`transforms.offload_params`).
    - `tokens`: a :class:`Tokens` (the checkpoint's tokenizer, or bytes).
    - `batch_size`: sequences per forward pass and prompts per :func:`zoo.generate` call.
    - `max_length`: the longest sequence scored or generated (default: the model's positions).
    - `max_gen_toks`: new tokens of ``generate_until`` unless a task says otherwise.
    - `cache_memory_kind`: where :func:`zoo.generate` keeps its KV cache (``"pinned_host"``).
    - `seed`: the sampling key of tasks that sample.

    **Example:**

    ```python
    import jax, lm_eval, zoo
    from recipes.lm_eval import Tokens, ZooLM
    model = zoo.build_model(zoo.config_from_name("llama:tiny"), key=jax.random.key(0))
    lm = ZooLM(model, Tokens(None), batch_size=4)
    lm.loglikelihood_rolling  # lm_eval.simple_evaluate(model=lm, tasks=[...]) calls these
    ```
    """

    def __init__(
        self,
        model,
        tokens: Tokens,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        cache_memory_kind: str | None = None,
        seed: int = 0,
    ):
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"ZooLM: batch_size must be a positive int, got {batch_size!r}")
        self.model, self.tokens = model, tokens
        self.batch_size = batch_size
        self.max_length = model.config.max_seq_len if max_length is None else max_length
        self.max_gen_toks = max_gen_toks
        self.cache_memory_kind = cache_memory_kind
        self.key = jax.random.key(seed)

    @property
    def eot_token_id(self) -> int:
        return BYTE_PREFIX if self.tokens.eos_id is None else self.tokens.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokens.bos_id if self.tokens.bos_id is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokens.directory or "bytes").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:  # as lm-eval's hf model: none twice when the text has the BOS
            bos = None if self.tokens.bos_id is None else self.tokens.decode([self.tokens.bos_id])
            add_special_tokens = not (bos and string.startswith(bos))
        return self.tokens.encode(string, add_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``(sum of the continuation's log-probabilities, whether it is the greedy one)`` of each
        ``(key, context ids, continuation ids)``, longest first in batches, in the given order."""
        rows = []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
            rows.append((whole, min(len(continuation), len(whole) - 1)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            width = min(_bucket(max(len(rows[i][0]) - 1 for i in chunk), 16), self.max_length)
            inputs = np.zeros((self.batch_size, width), np.int32)
            targets = np.zeros((self.batch_size, width), np.int32)
            for r, i in enumerate(chunk):
                whole = rows[i][0]
                inputs[r, : len(whole) - 1], targets[r, : len(whole) - 1] = whole[:-1], whole[1:]
            logp, greedy = jax.device_get(_token_logprobs(self.model, jnp.asarray(inputs), jnp.asarray(targets)))
            for r, i in enumerate(chunk):
                n, cont = len(rows[i][0]) - 1, rows[i][1]
                results[i] = (float(logp[r, n - cont : n].sum()), bool(greedy[r, n - cont : n].all()))
        for (key, _, _), result in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, in windows of the model's length (each window
        sees the tokens before it, as lm-eval's ``hf`` model scores them)."""
        windows, owner = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            rolling = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for window in map(lm_utils.make_disjoint_window, rolling):
                windows.append((None, *window))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[n] += logp
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued by :func:`zoo.generate` (greedy unless the task samples), cut
        before the first of its ``until`` strings; contexts sharing settings go as one batch."""
        groups = collections.defaultdict(list)
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            groups[json.dumps(gen_kwargs, sort_keys=True, default=str)].append((i, context))
        out: list[str | None] = [None] * len(requests)
        for settings, items in groups.items():
            kwargs = json.loads(settings)
            until = kwargs.get("until", [])
            until = [until] if isinstance(until, str) else list(until)
            if self.tokens.eos_id is not None:
                until.append(self.tokens.decode([self.tokens.eos_id]))
            new_tokens = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
            for start in range(0, len(items), self.batch_size):
                batch = items[start : start + self.batch_size]
                keep = max(self.max_length - new_tokens, 1)
                prompts = [self.tok_encode(context)[-keep:] or [self.prefix_token_id] for _, context in batch]
                self.key, key = jax.random.split(self.key)
                new = zoo.generate(
                    self.model,
                    [jnp.asarray(p, jnp.int32) for p in prompts],
                    max_new_tokens=new_tokens,
                    temperature=temperature,
                    key=key if temperature > 0 else None,
                    stop_tokens=() if self.tokens.eos_id is None else (self.tokens.eos_id,),
                    cache_memory_kind=self.cache_memory_kind,
                )
                for (i, context), ids in zip(batch, new, strict=True):
                    text = self.tokens.decode(ids)
                    for stop in until:
                        if stop:
                            text = text.split(stop)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", (context, requests[i].args[1]), text)
        return out


def load(source: str, *, step: int | None, dtype: str | None, quantize: str | None, seed: int = 0):
    """``(model, tokens)`` of a Hugging Face directory, a ``train_lm`` run directory or a
    ``FAMILY:PRESET`` name (random weights, byte tokenizer)."""
    path = pathlib.Path(source)
    if is_hf_dir(source) or (path / "checkpoints").is_dir():
        from recipes.generate import load as load_checkpoint
        from recipes.train_lm import saved_flags

        model, _, _ = load_checkpoint(source, step=step, dtype=dtype, quantize=quantize)
        directory = source if is_hf_dir(source) else saved_flags(source).model
        return model, Tokens(directory if is_hf_dir(directory) else None)
    try:
        config = zoo.config_from_name(source, vocab_size=256, **({} if dtype is None else {"param_dtype": dtype}))
    except (TypeError, ValueError) as err:
        raise SystemExit(
            f"MODEL {source}: neither a Hugging Face checkpoint (config.json), a train_lm run (checkpoints/) nor a "
            f"model name: {err}"
        ) from None
    model = zoo.build_model(config, key=jax.random.key(seed))
    if quantize is not None:
        model = transforms.quantize(model, quantize)
    return model, Tokens(None)


def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="python -m recipes.lm_eval", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("model", help="a Hugging Face checkpoint directory, a train_lm run directory, or FAMILY:PRESET")
    a("--tasks", required=True, help="comma-separated lm-eval task (or group) names")
    a("--include-path", default=None, help="a directory of your own task YAML files")
    a("--limit", type=float, default=None, help="at most this many samples per task (below 1: a fraction)")
    a("--num-fewshot", type=int, default=None, help="few-shot examples per prompt (default: the task's)")
    a("--output-path", default=None, help="write lm-eval's results JSON (and --log-samples files) under here")
    a("--log-samples", action="store_true", help="also write every sample's inputs, outputs and scores")
    a("--batch-size", type=int, default=8, help="sequences per forward pass and prompts per generation")
    a("--max-gen-toks", type=int, default=256, help="new tokens per generation unless a task says otherwise")
    a(
        "--max-length",
        type=int,
        default=None,
        help="longest sequence scored or generated, longer texts scored in windows (default: the model's positions)",
    )
    a("--step", type=int, default=None, help="checkpoint step of a run directory (default: the latest intact one)")
    a("--dtype", default=None, help="parameter dtype (a Hugging Face model: default the checkpoint's)")
    a("--offload", default="", choices=["", "params"], help="'params': layer weights stream from host memory")
    a("--quantize", default=None, choices=["nf4", "int8"], help="evaluate with the layers' weights quantized")
    a(
        "--cache-memory-kind",
        default=None,
        choices=["device", "pinned_host"],
        help="'pinned_host' keeps generation's KV cache in host memory",
    )
    a("--seed", type=int, default=0, help="seed of sampled generations (and of a FAMILY:PRESET's weights)")
    return p


def main(argv=None) -> dict:
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    args = build_parser().parse_args(argv)
    cli.at_least("batch_size", args.batch_size, 1)
    cli.at_least("max_gen_toks", args.max_gen_toks, 1)
    if args.max_length is not None:
        cli.at_least("max_length", args.max_length, 2)
    if args.limit is not None and not args.limit > 0:
        raise SystemExit(f"--limit {args.limit}: give a number of samples (or a fraction below 1) above 0")
    if args.dtype is not None:
        cli.choice("dtype", args.dtype, zoo.DTYPES)
    if args.log_samples and args.output_path is None:
        raise SystemExit("--log-samples writes files: give --output-path DIR too")
    if args.include_path is not None and not pathlib.Path(args.include_path).is_dir():
        raise SystemExit(f"--include-path {args.include_path}: not a directory")
    tasks = [t for t in args.tasks.split(",") if t]
    manager = TaskManager(include_path=args.include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown or not tasks:
        raise SystemExit(
            f"--tasks {args.tasks}: unknown task {', '.join(unknown) or '(none given)'}; "
            "`lm-eval ls tasks` lists them (and --include-path adds your own)"
        )
    with cli.LibraryLogs():
        model, tokens = load(args.model, step=args.step, dtype=args.dtype, quantize=args.quantize, seed=args.seed)
    if args.offload == "params":
        model = transforms.offload_params(model)
    lm = ZooLM(
        model,
        tokens,
        batch_size=args.batch_size,
        max_gen_toks=args.max_gen_toks,
        max_length=None if args.max_length is None else min(args.max_length, model.config.max_seq_len),
        cache_memory_kind=args.cache_memory_kind,
        seed=args.seed,
    )
    tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=args.num_fewshot,
        limit=int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit,
        log_samples=args.log_samples,
        evaluation_tracker=tracker,
        task_manager=manager,
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
    )
    samples = results.pop("samples", None) if args.log_samples else None
    if tracker is not None:
        tracker.general_config_tracker.model_name = args.model
        tracker.general_config_tracker.model_name_sanitized = lm_utils.sanitize_model_name(args.model)
        tracker.save_results_aggregated(results=results, samples=samples)
        if samples is not None:
            for task in results["configs"]:
                tracker.save_results_samples(task_name=task, samples=samples[task])
    print(lm_utils.make_table(results))
    if samples is not None:
        results["samples"] = samples
    return results


if __name__ == "__main__":
    one_line_warnings()
    main()
