"""The lm-evaluation-harness model class behind ``recipes.lm_eval``: :class:`ZooLM` (an
``lm_eval.api.model.LM``) and :class:`Tokens`, the text-to-ids rule it shares with lm-eval's ``hf``
model. Importing this module imports ``lm_eval`` (``pip install -e '.[eval]'``); the command line
imports it only once its flags are checked, so ``--help`` works without it."""

from __future__ import annotations

import collections
import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

import zoo
from recipes._lm.data import _read_json, eos_token_id, load_tokenizer

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
        self._tok = load_tokenizer(directory)
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = eos_token_id(directory, self._tok)
        bos = _read_json(pathlib.Path(directory) / "tokenizer_config.json").get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        self.bos_id = self._tok.token_to_id(bos) if isinstance(bos, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text`` (the tokenizer's special tokens added unless told not to)."""
        if self._tok is None:
            return list(text.encode())
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        """The text of ``ids``."""
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
        """The end-of-text id lm-eval appends (the tokenizer's, else a newline byte)."""
        return BYTE_PREFIX if self.tokens.eos_id is None else self.tokens.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The id before an empty context: the beginning-of-sequence token, else the end-of-text one."""
        return self.tokens.bos_id if self.tokens.bos_id is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        """A name for lm-eval's cache keys."""
        return str(self.tokens.directory or "bytes").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The ids of ``string`` as lm-eval's ``hf`` model encodes them."""
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
            # at most the positions left after a one-token prompt (a task may ask for more than the model holds)
            new_tokens = min(int(kwargs.get("max_gen_toks", self.max_gen_toks)), self.max_length - 1)
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
