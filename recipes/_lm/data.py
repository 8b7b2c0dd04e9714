"""Data for the language-model recipes: a corpus on disk, a tokenizer, deterministic batches.

Sources (``--data``):

- a text file, or a directory of them (every file under it, recursively; ``.jsonl`` files among
  them are read as below): each file is one document;
- a ``.jsonl`` file: one JSON object per line, its ``text`` field one document, or its
  ``messages`` (``[{"role", "content"}, ...]``) one conversation, rendered with the checkpoint's chat
  template (:mod:`recipes._lm.chat`); ``--data-field`` names another field;
- a directory written by ``datasets.Dataset.save_to_disk``, or ``.parquet`` files (a file, or a
  directory holding only them): read through ``datasets``, memory-mapped, in batches of rows, never
  whole; the column is ``text`` or ``messages`` (or ``--data-field``);
- a pre-tokenized ``.bin`` file (a flat array of uint16 or uint32 token ids, as nanoGPT writes):
  memory-mapped, never read whole; its dtype comes from ``--data-dtype`` or a sidecar JSON
  (``train.bin.json`` or ``meta.json`` beside it, ``{"dtype": "uint16"}``). A ``val.bin`` beside a
  ``train.bin`` is the validation split, else the last 5% of the tokens are;
- nothing: the Python standard library's own ``.py`` files (at most 2 MB of them, said aloud).

Text is tokenized once into one flat numpy array (never a Python object per token), each document
followed by the tokenizer's end-of-sequence token when it has one (the byte tokenizer has none); a
conversation is the template's tokens alone. With conversations (and ``--train-on assistant``, the
default) a parallel boolean array marks the tokens the loss covers: the assistant's.
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

import contextlib
import json
import logging
import pathlib
import sysconfig

import numpy as np

from recipes._lm import chat

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


def load_tokenizer(directory):
    """The ``tokenizers.Tokenizer`` of ``directory/tokenizer.json``; a missing ``tokenizers``
    package or a file it cannot read (truncated, not UTF-8, another format) is one line."""
    import zoo

    try:
        return zoo.hf.load_hf_tokenizer(directory)
    except ImportError:
        raise SystemExit(
            f"{directory} has a tokenizer.json: reading it needs the tokenizers package: pip install tokenizers "
            "(part of pip install -e '.[recipes]')"
        ) from None
    except FileNotFoundError as err:
        raise SystemExit(f"{err}") from None
    except Exception as err:  # the tokenizers library raises a bare Exception for a file it cannot parse
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SystemExit(
            f"{pathlib.Path(directory) / 'tokenizer.json'} does not load ({first}); it is damaged or not a Hugging "
            "Face tokenizers file: download it again"
        ) from None


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (through ``zoo.hf.load_hf_tokenizer``), with the
    directory's end-of-sequence token."""

    name = "tokenizer.json"

    def __init__(self, directory):
        self.directory = pathlib.Path(directory)
        self._tok = load_tokenizer(directory)
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


#: What a record's field may hold: a document's text or a conversation's messages.
DEFAULT_FIELDS = ("text", "messages")
TRAIN_ON = ("assistant", "all")


def _field_value(record, field: str | None, where: str):
    """The document of one record: ``record[field]``, or its ``text``, else its ``messages``."""
    if not isinstance(record, dict):
        raise SystemExit(f"{where} is not a JSON object")
    names = (field,) if field else DEFAULT_FIELDS
    for name in names:
        if name in record:
            value = record[name]
            if isinstance(value, str):
                return value.encode()
            if isinstance(value, list):
                return chat.check_messages(value, where)
            raise SystemExit(f"{where}: field {name!r} is neither text nor a list of messages")
    fields = ", ".join(map(repr, record)) or "none"
    raise SystemExit(f"{where} has no field {' or '.join(map(repr, names))} (its fields: {fields}; see --data-field)")


def _opened(path: pathlib.Path, mode: str):
    """``open(path, mode)``; a file that cannot be read is one line."""
    try:
        return open(path, mode)
    except OSError as err:
        raise SystemExit(f"--data: cannot read {path}: {err.strerror or err}") from None


def _read_bytes(path: pathlib.Path) -> bytes:
    with _opened(path, "rb") as f:
        try:
            return f.read()
        except OSError as err:
            raise SystemExit(f"--data: cannot read {path}: {err.strerror or err}") from None


def jsonl_documents(path: pathlib.Path, field: str | None = None) -> list:
    """The document of every line of a JSON-lines file (see :func:`_field_value`): UTF-8 text, or
    a conversation's list of messages. All rows hold the same kind."""
    docs = []
    with _opened(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SystemExit(
                    f"--data {path}: line {number} is not UTF-8 text (byte {e.start} of the line); re-encode the file "
                    "as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"--data {path}: line {number} is not JSON ({e.msg})") from None
            except RecursionError:
                raise SystemExit(f"--data {path}: line {number} nests its JSON too deeply to read") from None
            # the first row says which kind the file holds: every other row has the same field
            kind = field or (("messages" if isinstance(docs[0], list) else "text") if docs else None)
            docs.append(_field_value(record, kind, f"--data {path}: line {number}"))
    return docs


def is_dataset(source: str | None) -> bool:
    """Whether ``source`` is read through ``datasets``: a ``save_to_disk`` directory, a ``.parquet``
    file or a directory of them."""
    if source is None:
        return False
    path = pathlib.Path(source)
    if path.is_file():
        return path.suffix == ".parquet"
    if not path.is_dir():
        return False
    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        return True
    files = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return bool(files) and all(p.suffix == ".parquet" for p in files)


def _dataset_errors() -> tuple[type[BaseException], ...]:
    """What ``datasets`` (and ``pyarrow`` under it) raise for a file they cannot read."""
    import datasets

    errors: list[type[BaseException]] = [ValueError, OSError, datasets.exceptions.DatasetGenerationError]
    try:
        import pyarrow

        errors.append(pyarrow.ArrowException)
    except ImportError:  # pragma: no cover - datasets depends on pyarrow
        pass
    return tuple(errors)


@contextlib.contextmanager
def _quiet_datasets():
    """Keep ``datasets``' own log records (it logs a file it cannot read before raising) off the
    terminal: the one line the recipe prints says it."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _unreadable(source: str, err: BaseException) -> SystemExit:
    cause = err.__cause__ or err
    first = (str(cause).splitlines() or [type(cause).__name__])[0]
    return SystemExit(f"--data {source}: datasets cannot read it ({type(cause).__name__}: {first}); is it damaged?")


def open_dataset(source: str):
    """The ``datasets.Dataset`` of ``source`` (see :func:`is_dataset`), memory-mapped: a
    ``DatasetDict``'s ``train`` split; parquet files through the ``datasets`` cache. A file
    ``datasets`` cannot read is one line."""
    try:
        import datasets
    except ImportError:
        raise SystemExit(f"--data {source}: reading it needs the datasets package: pip install datasets") from None
    try:
        with _quiet_datasets():
            return _open_dataset(datasets, source)
    except _dataset_errors() as err:
        raise _unreadable(source, err) from None


def _open_dataset(datasets, source: str):
    path = pathlib.Path(source)
    saved = (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()
    if not saved:
        files = [path] if path.is_file() else sorted(path.rglob("*.parquet"))
        return datasets.Dataset.from_parquet([str(f) for f in files])
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            splits = ", ".join(dataset)
            raise SystemExit(f"--data {source}: a DatasetDict without a 'train' split (its splits: {splits})")
        dataset = dataset["train"]
    return dataset


def dataset_documents(source: str, field: str | None = None, batch_rows: int = 1000):
    """The documents of a dataset's column (``field``, else ``text``, else ``messages``), read in
    batches of ``batch_rows`` rows from the memory-mapped table."""
    dataset = open_dataset(source)
    columns = dataset.column_names
    names = (field,) if field else DEFAULT_FIELDS
    column = next((n for n in names if n in columns), None)
    if column is None:
        raise SystemExit(
            f"--data {source}: no column {' or '.join(map(repr, names))} (its columns: {', '.join(columns)}; "
            "see --data-field)"
        )
    row = 0
    batches = iter(dataset.select_columns([column]).iter(batch_size=batch_rows))
    while True:
        try:
            with _quiet_datasets():
                batch = next(batches, None)
        except _dataset_errors() as err:
            raise _unreadable(source, err) from None
        if batch is None:
            return
        for value in batch[column]:
            yield _field_value({column: value}, column, f"--data {source}: row {row}")
            row += 1


def _documents(files: list[pathlib.Path], order, limit: int | None, field: str | None = None):
    """``(document, ...)`` of ``files`` in the seeded ``order``, until ``limit`` bytes (see
    :func:`_take`)."""
    for idx in order:
        path = files[idx]
        yield from jsonl_documents(path, field) if path.suffix == ".jsonl" else [_read_bytes(path)]


def _size(doc) -> int:
    return len(doc) if isinstance(doc, bytes) else sum(len(str(m.get("content", "")).encode()) for m in doc)


def _take(docs, limit: int | None):
    """``docs`` until ``limit`` bytes (``None``: all): text as bytes (the last cut at the limit),
    conversations as lists of messages (whole, counted by their contents)."""
    total = 0
    for doc in docs:
        if isinstance(doc, bytes) and limit is not None:
            doc = doc[: limit - total]
        if doc:
            total += _size(doc)
            yield doc
        if limit is not None and total >= limit:
            return


def chat_template(tokenizer, source) -> chat.ChatTemplate:
    """The chat template of the checkpoint ``tokenizer`` was read from (chat rows need one)."""
    directory = getattr(tokenizer, "directory", None)
    if directory is None:
        raise SystemExit(
            f"--data {source} holds conversations ('messages'): they are rendered with a Hugging Face checkpoint's "
            "chat template and tokenizer; give a checkpoint directory with a tokenizer.json as the model"
        )
    return chat.ChatTemplate(directory, tokenizer._tok)


def _reorder(encoded):
    ids, mask, nbytes = encoded
    return ids, nbytes, mask


def _masks(chunks) -> np.ndarray:
    return np.concatenate([np.ones(len(c[0]), bool) if c[2] is None else c[2] for c in chunks])


class Corpus:
    """Train and validation token arrays from text, and how many bytes each token stands for.

    Documents are taken in a seeded random order (files, then the lines of a ``.jsonl``) until
    ``limit`` bytes are read (``None``: all); whole documents from the end of that order make up
    about 5% for validation (a single document is split by position).
    """

    def __init__(
        self,
        source: str | None,
        tokenizer,
        *,
        limit: int | None,
        seed: int,
        field: str | None = None,
        train_on: str = "assistant",
    ):
        if source is None and limit is None:
            limit = STDLIB_BYTES
        self.notes = [] if limit is None else [f"reading at most {limit:,} bytes of text (--data-bytes)"]
        #: lines for the user about data that trains less than it seems to (printed as warnings)
        self.warnings: list[str] = []
        if is_dataset(source):
            docs = list(_take(dataset_documents(source, field), limit))
            self.notes.append(f"--data {source}: read through datasets (memory-mapped)")
        else:
            files = corpus_files(source)
            if field is not None and not any(f.suffix == ".jsonl" for f in files):
                raise SystemExit(
                    f"--data-field {field}: --data {source} holds plain text files only; the field names a "
                    "field of .jsonl rows or a column of a dataset"
                )
            order = np.random.default_rng(seed).permutation(len(files))
            docs = list(_take(_documents(files, order, limit, field), limit))
        if not docs:
            raise SystemExit(f"no text in {source or 'the standard library'}")
        eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
        texts = [d for d in docs if isinstance(d, bytes)]
        encoded = iter(tokenizer.encode_many(texts))
        template = chat_template(tokenizer, source) if len(texts) < len(docs) else None
        chunks = []  # (token ids, bytes, loss mask or None) per document, in the seeded order
        for doc in docs:
            if isinstance(doc, bytes):
                ids = next(encoded)
                chunks.append((np.concatenate([ids, np.asarray(eos, ids.dtype)]) if eos else ids, len(doc), None))
            else:
                chunks.append(_reorder(template.encode(doc, assistant_only=train_on == "assistant")))
        if eos and texts:
            self.notes.append(f"{len(texts):,} documents, each followed by the end-of-sequence token {eos[0]}")
        conversations = len(docs) - len(texts)
        if template is not None and train_on == "assistant":
            silent = sum(1 for d in docs if not isinstance(d, bytes) and not any(m["role"] == "assistant" for m in d))
            if silent:
                self.warnings.append(
                    f"--data {source}: {silent:,} of {conversations:,} conversations have no assistant message, so "
                    "they add nothing to the loss (--train-on all trains on every token)"
                )
        elif train_on == "all" and not conversations:
            self.warnings.append(
                f"--train-on all has no effect: --data {source or '(the standard library)'} holds "
                "no conversations (every token of text is trained on)"
            )
        if template is not None:
            self.notes.append(
                f"{len(docs) - len(texts):,} conversations rendered with the chat template of {template.directory}; "
                f"the loss covers {'the assistant tokens' if train_on == 'assistant' else 'every token'} (--train-on)"
            )
        total = sum(c[1] for c in chunks)
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
            ids, nbytes, mask = chunks.pop()
            cut = len(ids) - max(len(ids) // 20, 1)
            chunks.append((ids[:cut], nbytes * cut / len(ids), None if mask is None else mask[:cut]))
            val = [(ids[cut:], nbytes * (len(ids) - cut) / len(ids), None if mask is None else mask[cut:])]
            val_bytes = val[0][1]
        self.train = np.concatenate([c[0] for c in chunks])
        self.val = np.concatenate([c[0] for c in val])
        masked = any(c[2] is not None for c in chunks + val)
        #: which tokens the loss covers (bool, parallel to train / val), or ``None``: every token
        self.train_mask = _masks(chunks) if masked else None
        self.val_mask = _masks(val) if masked else None
        for name, mask in (("training", self.train_mask), ("validation", self.val_mask)):
            if mask is not None and not mask.any():
                raise SystemExit(
                    f"--data {source}: the {name} split holds no assistant tokens, so its loss would cover nothing "
                    "(and read 0.000); give conversations with assistant replies, more of them, or --train-on all"
                )
        #: where each document starts in ``train`` and ``val`` (for packing, see :func:`segments_at`)
        splits = (("train", chunks), ("val", val))
        self.doc_starts = {name: np.cumsum([0] + [len(c[0]) for c in split[:-1]]) for name, split in splits}
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

    #: every token is in the loss (a pre-tokenized file has no conversations to mask)
    train_mask = val_mask = None

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
        self.path = path
        self.warnings: list[str] = []
        self.check_ids(_sample(self.train), "a sample of its tokens")
        # Bytes per token, from decoding a piece of the validation split (exact for that piece).
        piece = np.asarray(self.val[:100_000])
        text_bytes = len(tokenizer.decode(piece).encode())
        self.val_bytes_per_token = max(text_bytes, 1) / max(len(piece), 1)

    def check_ids(self, ids: np.ndarray, where: str) -> None:
        """Every id of ``ids`` (read from the file) is within the vocabulary, else one line: an
        id beyond it would index past the embedding (a NaN loss, or silent garbage). The whole file
        is never read: a sample up front, then each batch as it is drawn."""
        top = int(ids.max()) if ids.size else 0
        if top >= self.vocab_size:
            raise SystemExit(
                f"--data {self.path}: token id {top} is outside the tokenizer's vocabulary of {self.vocab_size} "
                f"(found in {where}; wrong --data-dtype, or tokenized for another model?)"
            )

    def check(self, seq: int) -> None:
        Corpus.check(self, seq)

    def unigram_bits_per_byte(self) -> float:
        """As :meth:`Corpus.unigram_bits_per_byte`, on a sample of each split."""
        return (
            _unigram_bits(_sample(self.train), _sample(self.val, 100_000), self.vocab_size) / self.val_bytes_per_token
        )


def open_corpus(
    source: str | None,
    tokenizer,
    *,
    limit: int | None,
    seed: int,
    dtype: str | None = None,
    field: str | None = None,
    train_on: str = "assistant",
):
    """A :class:`TokenCorpus` for a ``.bin`` file, else a :class:`Corpus` of text and conversations
    (``field``: the JSON field or dataset column to read; ``train_on``: ``assistant`` or ``all``
    tokens of a conversation in the loss)."""
    if source is not None and pathlib.Path(source).suffix == ".bin" and pathlib.Path(source).is_file():
        return TokenCorpus(pathlib.Path(source), tokenizer, dtype=dtype, limit=limit)
    if dtype is not None:
        raise SystemExit("--data-dtype applies to a pre-tokenized .bin file only")
    if field is not None and pathlib.Path(source or "").suffix == ".bin":
        raise SystemExit("--data-field names a JSON field or a dataset column; a .bin file has none")
    if train_on not in TRAIN_ON:
        raise SystemExit(f"--train-on {train_on}: choose one of {', '.join(TRAIN_ON)}")
    return Corpus(source, tokenizer, limit=limit, seed=seed, field=field, train_on=train_on)


def _window_starts(n_tokens: int, step: int, *, batch: int, seq: int, seed: int, rows: slice) -> np.ndarray:
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - seq - 1, size=batch)[rows]


def batch_at(tokens: np.ndarray, step: int, *, batch: int, seq: int, seed: int, rows: slice = slice(None), mask=None):
    """The ``(batch, seq + 1)`` windows for ``step`` (only ``rows`` of them: a process's share);
    with ``mask`` (parallel to ``tokens``), ``(windows, loss mask)``, the mask ``(batch, seq)`` over
    each window's predicted tokens (its last ``seq``).

    Depends only on ``(seed, step)``: the data position of a run is its step.
    """
    starts = _window_starts(len(tokens), step, batch=batch, seq=seq, seed=seed, rows=rows)
    windows = np.stack([tokens[s : s + seq + 1] for s in starts]).astype(np.int32)
    if mask is None:
        return windows
    return windows, np.stack([mask[s + 1 : s + seq + 1] for s in starts])


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
