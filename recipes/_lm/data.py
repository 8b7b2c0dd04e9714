"""Data for the language-model recipes: a corpus on disk, a tokenizer, deterministic batches.

Sources (``--data``):

- a text file, or a directory of them (every file under it, recursively; ``.jsonl`` files among
  them are read as below): each file is one document;
- a ``.jsonl`` file: one JSON object per line, its ``text`` field one document;
- a pre-tokenized ``.bin`` file (a flat array of uint16 or uint32 token ids, as nanoGPT writes):
  memory-mapped, never read whole; its dtype comes from ``--data-dtype`` or a sidecar JSON
  (``train.bin.json`` or ``meta.json`` beside it, ``{"dtype": "uint16"}``). A ``val.bin`` beside a
  ``train.bin`` is the validation split, else the last 5% of the tokens are;
- nothing: the Python standard library's own ``.py`` files (at most 2 MB of them, said aloud).

Text is tokenized once into one flat numpy array (never a Python object per token), each document
followed by the tokenizer's end-of-sequence token when it has one (the byte tokenizer has none).
Documents are shuffled with the seed and split, whole, about 95/5 into train and validation (a
single document is split by position). A byte cap (``--data-bytes``) is applied only when asked
for, or for the standard-library default, and always printed. The batch for step ``i`` depends
only on ``(seed, i)``, so the data position of a run is just its step number: a resumed run sees
exactly the batches an uninterrupted one would.

Packing (``--pack``, the default): a window holds the ends and starts of several documents, and
:func:`segments_at` numbers them (from the documents a text corpus read, or after each
end-of-sequence token of a pre-tokenized file), so the model attends within each document and
numbers its positions from 0 (see :func:`zoo.lm_loss`'s ``segment_ids``). ``--no-pack``: the
windows are one stream, attention crosses document boundaries.
"""

from __future__ import annotations

import json
import pathlib
import sysconfig

import numpy as np

#: Bytes read from the standard library when no --data is given (a short demo run).
STDLIB_BYTES = 2_000_000
TOKEN_DTYPES = ("uint16", "uint32")
VAL_FRACTION = 0.05
_SAMPLE = 4_000_000  # tokens of a .bin file read for its checks and unigram baseline


class ByteTokenizer:
    """Bytes are tokens (vocabulary 256): no files, no training, works on any text."""

    vocab_size = 256
    name = "bytes"
    eos_id = None

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, np.uint8)

    def encode_many(self, docs: list[bytes]) -> list[np.ndarray]:
        return [self.encode(d) for d in docs]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", "replace")


def _token_name(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def eos_token_id(directory, tokenizer) -> int | None:
    """The end-of-sequence id of a Hugging Face model directory: ``tokenizer_config.json``'s
    ``eos_token`` (looked up in the tokenizer), else ``generation_config.json``'s or
    ``config.json``'s ``eos_token_id`` (the first of a list)."""
    directory = pathlib.Path(directory)
    name = _token_name(_read_json(directory / "tokenizer_config.json").get("eos_token"))
    name = name or _token_name(_read_json(directory / "special_tokens_map.json").get("eos_token"))
    if name is not None and tokenizer.token_to_id(name) is not None:
        return int(tokenizer.token_to_id(name))
    for file in ("generation_config.json", "config.json"):
        value = _read_json(directory / file).get("eos_token_id")
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (through ``zoo.hf.load_hf_tokenizer``), with the
    directory's end-of-sequence token."""

    name = "tokenizer.json"

    def __init__(self, directory):
        import zoo

        self._tok = zoo.hf.load_hf_tokenizer(directory)
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = eos_token_id(directory, self._tok)

    def encode(self, data: bytes) -> np.ndarray:
        ids = self._tok.encode(data.decode("utf-8", "replace"), add_special_tokens=False).ids
        return np.asarray(ids, np.int32)

    def encode_many(self, docs: list[bytes]) -> list[np.ndarray]:
        texts = [d.decode("utf-8", "replace") for d in docs]
        return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

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
    files = sorted(
        p for p in root.rglob(pattern) if p.is_file() and "site-packages" not in p.parts and not p.name.startswith(".")
    )
    if not files:
        raise SystemExit(f"no files found under {root}")
    return files


def jsonl_documents(path: pathlib.Path) -> list[bytes]:
    """The ``text`` field of every line of a JSON-lines file, UTF-8 encoded."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"--data {path}: line {number} is not JSON ({e.msg})") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise SystemExit(f"--data {path}: line {number} has no string field 'text'")
            docs.append(text.encode())
    return docs


def _documents(files: list[pathlib.Path], order, limit: int | None):
    """``(document bytes, ...)`` in the seeded order of ``files``, until ``limit`` bytes."""
    total = 0
    for idx in order:
        path = files[idx]
        docs = jsonl_documents(path) if path.suffix == ".jsonl" else [path.read_bytes()]
        for doc in docs:
            if limit is not None:
                doc = doc[: limit - total]
            if doc:
                total += len(doc)
                yield doc
            if limit is not None and total >= limit:
                return


class Corpus:
    """Train and validation token arrays from text, and how many bytes each token stands for.

    Documents are taken in a seeded random order (files, then the lines of a ``.jsonl``) until
    ``limit`` bytes are read (``None``: all); whole documents from the end of that order make up
    about 5% for validation (a single document is split by position).
    """

    def __init__(self, source: str | None, tokenizer, *, limit: int | None, seed: int):
        if source is None and limit is None:
            limit = STDLIB_BYTES
        self.notes = [] if limit is None else [f"reading at most {limit:,} bytes of text (--data-bytes)"]
        files = corpus_files(source)
        order = np.random.default_rng(seed).permutation(len(files))
        docs = list(_documents(files, order, limit))
        if not docs:
            raise SystemExit(f"no text in {source or 'the standard library'}")
        eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
        chunks = []  # (token ids, bytes) per document, in the seeded order
        for doc, ids in zip(docs, tokenizer.encode_many(docs), strict=True):
            chunks.append((np.concatenate([ids, np.asarray(eos, ids.dtype)]) if eos else ids, len(doc)))
        if eos:
            self.notes.append(f"{len(chunks):,} documents, each followed by the end-of-sequence token {eos[0]}")
        total = sum(n for _, n in chunks)
        # Whole documents from the end of the order go to validation until it holds ~5% of the
        # bytes; if no document is small enough (one big one), the last 5% of the last is held out.
        target, val, val_bytes = VAL_FRACTION * total, [], 0
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
        self.train = np.concatenate([ids for ids, _ in chunks])
        self.val = np.concatenate([ids for ids, _ in val])
        #: where each document starts in ``train`` and ``val`` (for packing, see :func:`segments_at`)
        splits = (("train", chunks), ("val", val))
        self.doc_starts = {name: np.cumsum([0] + [len(ids) for ids, _ in split[:-1]]) for name, split in splits}
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
        return _unigram_bits(self.train, self.val, self.vocab_size) / self.val_bytes_per_token


def _unigram_bits(train, val, vocab_size: int) -> float:
    counts = np.bincount(np.asarray(train), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log2(counts / counts.sum())
    return float(-logp[np.asarray(val)].mean())


def _sample(tokens, n: int = _SAMPLE) -> np.ndarray:
    """Up to ``n`` tokens of a (memory-mapped) array, read in 16 evenly spaced pieces."""
    if len(tokens) <= n:
        return np.asarray(tokens)
    piece = n // 16
    starts = np.linspace(0, len(tokens) - piece, 16).astype(np.int64)
    return np.concatenate([np.asarray(tokens[s : s + piece]) for s in starts])


def token_dtype(path: pathlib.Path, flag: str | None) -> np.dtype:
    """The dtype of a pre-tokenized file: ``--data-dtype``, else a sidecar JSON's ``dtype``."""
    if flag is not None:
        if flag not in TOKEN_DTYPES:
            raise SystemExit(f"--data-dtype {flag!r}: choose one of {', '.join(TOKEN_DTYPES)}")
        return np.dtype(flag)
    for sidecar in (path.with_name(path.name + ".json"), path.with_name("meta.json")):
        value = _read_json(sidecar).get("dtype") if sidecar.is_file() else None
        if value is not None:
            if value not in TOKEN_DTYPES:
                raise SystemExit(f"{sidecar}: dtype {value!r} is not one of {', '.join(TOKEN_DTYPES)}")
            return np.dtype(value)
    raise SystemExit(
        f"--data {path}: say how its token ids are stored with --data-dtype ({' or '.join(TOKEN_DTYPES)}; "
        f'nanoGPT writes uint16) or a sidecar {path.name}.json / meta.json holding {{"dtype": "uint16"}}'
    )


def _memmap(path: pathlib.Path, dtype: np.dtype) -> np.ndarray:
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise SystemExit(f"--data {path}: {size} bytes is not a whole number of {dtype.name} token ids")
    if size == 0:
        raise SystemExit(f"--data {path} is empty")
    return np.memmap(path, dtype=dtype, mode="r")


class TokenCorpus:
    """Train and validation token ids memory-mapped from a pre-tokenized ``.bin`` file (and a
    ``val.bin`` beside a ``train.bin``). Nothing is read whole: batches read their windows, the
    checks and the unigram baseline read a sample of a few million tokens."""

    def __init__(self, path: pathlib.Path, tokenizer, *, dtype: str | None, limit: int | None):
        dt = token_dtype(path, dtype)
        tokens = _memmap(path, dt)
        self.notes = [f"pre-tokenized {path.name}: {len(tokens):,} {dt.name} tokens, memory-mapped"]
        if limit is not None:
            raise SystemExit("--data-bytes limits text; for a pre-tokenized .bin file, cut the file instead")
        val_path = path.with_name("val.bin")
        if path.name == "train.bin" and val_path.is_file():
            self.train, self.val = tokens, _memmap(val_path, dt)
            self.notes.append(f"validation: {val_path.name}, {len(self.val):,} tokens")
        else:
            cut = len(tokens) - max(int(len(tokens) * VAL_FRACTION), 1)
            self.train, self.val = tokens[:cut], tokens[cut:]
            self.notes.append(f"validation: the last {len(self.val):,} tokens")
        self.vocab_size = tokenizer.vocab_size
        self.doc_starts = None  # documents end at the tokenizer's end-of-sequence token, if any
        sample = _sample(self.train)
        top = int(sample.max()) if sample.size else 0
        if top >= tokenizer.vocab_size:
            raise SystemExit(
                f"--data {path}: token id {top} is outside the tokenizer's vocabulary of {tokenizer.vocab_size} "
                "(wrong --data-dtype, or tokenized for another model?)"
            )
        # Bytes per token, from decoding a piece of the validation split (exact for that piece).
        piece = np.asarray(self.val[:100_000])
        text_bytes = len(tokenizer.decode(piece).encode())
        self.val_bytes_per_token = max(text_bytes, 1) / max(len(piece), 1)

    def check(self, seq: int) -> None:
        Corpus.check(self, seq)

    def unigram_bits_per_byte(self) -> float:
        """As :meth:`Corpus.unigram_bits_per_byte`, on a sample of each split."""
        return (
            _unigram_bits(_sample(self.train), _sample(self.val, 100_000), self.vocab_size) / self.val_bytes_per_token
        )


def open_corpus(source: str | None, tokenizer, *, limit: int | None, seed: int, dtype: str | None = None):
    """A :class:`TokenCorpus` for a ``.bin`` file, else a :class:`Corpus` of text."""
    if source is not None and pathlib.Path(source).suffix == ".bin" and pathlib.Path(source).is_file():
        return TokenCorpus(pathlib.Path(source), tokenizer, dtype=dtype, limit=limit)
    if dtype is not None:
        raise SystemExit("--data-dtype applies to a pre-tokenized .bin file only")
    return Corpus(source, tokenizer, limit=limit, seed=seed)


def _window_starts(n_tokens: int, step: int, *, batch: int, seq: int, seed: int, rows: slice) -> np.ndarray:
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - seq - 1, size=batch)[rows]


def batch_at(tokens: np.ndarray, step: int, *, batch: int, seq: int, seed: int, rows: slice = slice(None)):
    """The ``(batch, seq + 1)`` windows for ``step`` (only ``rows`` of them: a process's share).

    Depends only on ``(seed, step)``: the data position of a run is its step.
    """
    starts = _window_starts(len(tokens), step, batch=batch, seq=seq, seed=seed, rows=rows)
    return np.stack([tokens[s : s + seq + 1] for s in starts]).astype(np.int32)


def segments_at(
    tokens: np.ndarray,
    step: int,
    *,
    batch: int,
    seq: int,
    seed: int,
    rows: slice = slice(None),
    doc_starts: np.ndarray | None = None,
    eos_id: int | None = None,
) -> np.ndarray:
    """The segment ids ``(batch, seq + 1)`` of :func:`batch_at`'s windows: 1 for the document a
    window starts in, one more at each document that begins in it: at each offset of
    ``doc_starts`` (sorted offsets into ``tokens``), else after each ``eos_id`` token.

    **Example:**

    ```python
    import numpy as np
    tokens = np.array([5, 6, 0, 7, 8, 9, 0, 4, 4, 4])        # documents ended by token 0
    segments_at(tokens, 0, batch=1, seq=8, seed=0, eos_id=0)  # e.g. [[1, 2, 2, 2, 2, 3, 3, 3, 3]]
    ```
    """
    if doc_starts is None and eos_id is None:
        raise ValueError("segments_at needs the documents' starts (doc_starts) or their end token (eos_id)")
    starts = _window_starts(len(tokens), step, batch=batch, seq=seq, seed=seed, rows=rows)
    rows_out = []
    for s in starts:
        if doc_starts is not None:
            seg = np.searchsorted(doc_starts, np.arange(s, s + seq + 1), side="right")
        else:
            seg = np.concatenate([[0], np.cumsum(np.asarray(tokens[s : s + seq]) == eos_id)])
        rows_out.append(seg - seg[0] + 1)
    return np.stack(rows_out).astype(np.int32)
