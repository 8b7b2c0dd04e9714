"""The tokenizer of a Hugging Face model directory, through the `tokenizers` package."""

from __future__ import annotations

import os
import pathlib
from typing import Any


def load_hf_tokenizer(directory: str | os.PathLike) -> Any:
    """The ``tokenizers.Tokenizer`` in ``directory/tokenizer.json``.

    Needs the optional `tokenizers` package (``pip install tokenizers``); raises `ImportError`
    without it and `FileNotFoundError` when the directory has no ``tokenizer.json``.

    **Example:**

    ```python
    import tempfile, pathlib, zoo
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    with tempfile.TemporaryDirectory() as d:
        tok.save(str(pathlib.Path(d) / "tokenizer.json"))
        zoo.hf.load_hf_tokenizer(d).encode("hello world").ids   # [1, 2]
    ```
    """
    path = pathlib.Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no tokenizer.json")
    try:
        import tokenizers
    except ImportError:
        raise ImportError("zoo.hf.load_hf_tokenizer needs the `tokenizers` package: pip install tokenizers") from None
    return tokenizers.Tokenizer.from_file(str(path))
