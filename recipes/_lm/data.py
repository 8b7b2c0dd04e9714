"""Data for the language-model recipes: a corpus on disk, a tokenizer, deterministic batches.

The corpus is read once into one flat numpy array of token ids (never a Python object per
token). Files are shuffled with the seed and split by file, about 95/5, into train and
validation. The batch for step ``i`` depends only on ``(seed, i)``, so the data position of a
run is just its step number: a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import pathlib
import sysconfig

import numpy as np


class ByteTokenizer:
    """Bytes are tokens (vocabulary 256): no files, no training, works on any text."""

    vocab_size = 256
    name = "bytes"

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", "replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (through ``zoo.hf.load_hf_tokenizer``)."""

    name = "tokenizer.json"

    def __init__(self, directory):
        import zoo

        self._tok = zoo.hf.load_hf_tokenizer(directory)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, data: bytes) -> np.ndarray:
        ids = self._tok.encode(data.decode("utf-8", "replace"), add_special_tokens=False).ids
        return np.asarray(ids, np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def corpus_files(source: str | None) -> list[pathlib.Path]:
    """Text files to train on: the given file or directory, or the standard library's ``.py`` files."""
    root = pathlib.Path(source) if source else pathlib.Path(sysconfig.get_paths()["stdlib"])
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise SystemExit(f"--data {source!r} is neither a file nor a directory")
    pattern = "*.py" if source is None else "*"
    files = sorted(p for p in root.rglob(pattern) if p.is_file() and "site-packages" not in p.parts)
    if not files:
        raise SystemExit(f"no files found under {root}")
    return files


class Corpus:
    """Train and validation token arrays, and how many bytes each token stands for.

    Files are taken in a seeded random order until ``limit`` bytes are read; whole files from
    the end of that order make up about 5% for validation (a single file is split by position).
    """

    def __init__(self, source: str | None, tokenizer, *, limit: int, seed: int):
        files = corpus_files(source)
        order = np.random.default_rng(seed).permutation(len(files))
        chunks, total = [], 0  # (token ids, bytes) per file, in the seeded order
        for idx in order:
            data = files[idx].read_bytes()[: limit - total]
            if data:
                chunks.append((tokenizer.encode(data), len(data)))
                total += len(data)
            if total >= limit:
                break
        if not chunks:
            raise SystemExit(f"no text in {source or 'the standard library'}")
        # Whole files from the end of the order go to validation until it holds ~5% of the bytes;
        # if no file is small enough (one big file), the last 5% of the last file is held out.
        target, val, val_bytes = 0.05 * total, [], 0
        for i in range(len(chunks) - 1, 0, -1):
            if val_bytes >= target:
                break
            if val_bytes + chunks[i][1] <= 2 * target:
                val.append(chunks.pop(i))
                val_bytes += val[-1][1]
        if not val:
            ids, nbytes = chunks.pop()
            cut = len(ids) - max(len(ids) // 20, 1)
            chunks.append((ids[:cut], nbytes * cut / len(ids)))
            val = [(ids[cut:], nbytes * (len(ids) - cut) / len(ids))]
            val_bytes = val[0][1]
        train = [ids for ids, _ in chunks]
        val = [ids for ids, _ in val]
        self.train = np.concatenate(train)
        self.val = np.concatenate(val)
        self.vocab_size = tokenizer.vocab_size
        #: bytes of text per token (1 for the byte tokenizer): converts nats/token to bits/byte
        self.val_bytes_per_token = val_bytes / max(len(self.val), 1)

    def check(self, seq: int) -> None:
        for name, ids in (("training", self.train), ("validation", self.val)):
            if len(ids) < seq + 2:
                raise SystemExit(
                    f"the {name} split has {len(ids)} tokens, fewer than --seq + 2 = {seq + 2}: "
                    "use more data (--data, --data-bytes) or a shorter --seq"
                )

    def unigram_bits_per_byte(self) -> float:
        """What a model that ignores context scores on validation (add-one smoothed)."""
        counts = np.bincount(self.train, minlength=self.vocab_size).astype(np.float64) + 1.0
        logp = np.log2(counts / counts.sum())
        return float(-logp[self.val].mean()) / self.val_bytes_per_token


def batch_at(tokens: np.ndarray, step: int, *, batch: int, seq: int, seed: int, rows: slice = slice(None)):
    """The ``(batch, seq + 1)`` windows for ``step`` (only ``rows`` of them: a process's share).

    Depends only on ``(seed, step)``: the data position of a run is its step.
    """
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq - 1, size=batch)[rows]
    return np.stack([tokens[s : s + seq + 1] for s in starts]).astype(np.int32)
