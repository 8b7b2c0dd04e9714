"""Chat conversations rendered with a checkpoint's own chat template, tokenized, with a mask of
the assistant's tokens.

A chat template comes with a downloaded checkpoint: it is data, never trusted code. It runs in
``jinja2``'s ``ImmutableSandboxedEnvironment``, which refuses attribute access to Python's
internals (``''.__class__``), calls of unsafe methods and in-place changes of the data it is
given; a template that tries is a one-line error naming the checkpoint. The environment is set
up as ``transformers`` sets up its own (``trim_blocks``, ``lstrip_blocks``, loop controls,
``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text), and the rendered
text is tokenized without added special tokens, so the token ids equal those of
``tokenizer.apply_chat_template(messages, tokenize=True)``.

Which tokens are the assistant's comes from rendering each prefix of the conversation: the text
between ``messages[:i]`` rendered with the generation prompt and ``messages[:i + 1]`` rendered
without it is message ``i``'s (its closing tokens, e.g. ``<|eot_id|>``, included, so the model
learns to stop).
"""

from __future__ import annotations

import datetime
import json
import pathlib

import numpy as np

#: Roles a message may have.
ROLES = ("system", "user", "assistant", "tool")
#: tokenizer_config.json fields passed to the template by name, as transformers passes them.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_config(directory) -> dict:
    """The checkpoint's ``tokenizer_config.json`` (``{}`` without one); a file that is not a JSON
    object is one line."""
    path = pathlib.Path(directory) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # JSON or UTF-8 errors
        raise SystemExit(f"{path} is not readable JSON ({err}); download it again") from None
    if not isinstance(config, dict):
        raise SystemExit(f"{path} holds a JSON {type(config).__name__}, not an object; download it again")
    return config


def read_chat_template(directory) -> str:
    """The chat template of a Hugging Face checkpoint directory: ``chat_template.jinja``, else the
    ``chat_template`` field of ``tokenizer_config.json`` (a string, or a list of named templates,
    of which the one named ``default``). None is one line (`SystemExit`)."""
    directory = pathlib.Path(directory)
    if (directory / "chat_template.jinja").is_file():
        try:
            return (directory / "chat_template.jinja").read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise SystemExit(
                f"{directory / 'chat_template.jinja'} is not UTF-8 text (byte {err.start}); download it again"
            ) from None
    template = tokenizer_config(directory).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template.strip():
        raise SystemExit(
            f"{directory} has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json): "
            "chat rows ({'messages': [...]}) are rendered with the checkpoint's own template; add one, or give "
            "plain text rows ({'text': ...})"
        )
    return template


def _sandbox():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def check_messages(messages, where: str) -> list[dict]:
    """``messages`` if it is a list of ``{"role", "content"}`` objects with known roles (keys whose
    value is ``None`` dropped, as ``transformers`` drops them: a dataset's column of messages holds
    ``None`` for a field only some messages have), else one line (`SystemExit`) saying what
    ``where`` (e.g. ``--data chat.jsonl: line 3``) holds instead."""
    if not isinstance(messages, list) or not messages:
        raise SystemExit(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise SystemExit(f"{where}: message {i} is not an object with a 'role' (and 'content')")
        if message["role"] not in ROLES:
            role = message["role"]
            raise SystemExit(f"{where}: message {i} has the unknown role {role!r}; roles: {', '.join(ROLES)}")
    return [{k: v for k, v in message.items() if v is not None} for message in messages]


class ChatTemplate:
    """The chat template of the checkpoint ``directory``, rendering and tokenizing conversations
    with ``tokenizer`` (a ``tokenizers.Tokenizer``)."""

    def __init__(self, directory, tokenizer):
        try:
            import jinja2
        except ImportError:
            raise SystemExit("chat rows are rendered with jinja2: pip install 'jinja2>=3.1.6'") from None
        self.directory = pathlib.Path(directory)
        self.tokenizer = tokenizer
        config = tokenizer_config(self.directory)
        self.special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
        try:
            self.template = _sandbox().from_string(read_chat_template(self.directory))
        except jinja2.TemplateSyntaxError as err:
            where = f"the chat template of {self.directory}"
            raise SystemExit(f"{where} does not parse: {err} (line {err.lineno})") from None

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (a security or template error is one line)."""
        import jinja2

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)
        except jinja2.exceptions.SecurityError as err:
            raise SystemExit(
                f"the chat template of {self.directory} was refused by the sandbox: {err} (a template may not reach "
                "Python internals; it is data from the checkpoint, not code)"
            ) from None
        except jinja2.TemplateError as err:
            raise SystemExit(f"the chat template of {self.directory} failed: {err}") from None

    def encode(self, messages: list[dict], *, assistant_only: bool = True) -> tuple[np.ndarray, np.ndarray | None, int]:
        """``(token ids, mask, bytes of text)`` of one conversation: the ids of the rendered text
        (no special tokens added: those the template writes are its own); ``mask`` (bool, one per
        token) marks the assistant's tokens, ``None`` unless ``assistant_only``."""
        text = self.render(messages)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, np.int32)
        if not assistant_only:
            return ids, None, len(text.encode())
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self.render(messages[: i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise SystemExit(
                    f"the chat template of {self.directory} renders assistant message {i} differently inside the "
                    "conversation than after its prefix, so its tokens cannot be told apart: use --train-on all"
                )
            spans.append((len(before), len(upto)))
        # a token is the assistant's if its characters overlap one of the assistant's spans
        offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
        starts, ends = np.asarray(spans, np.int64).reshape(-1, 2).T
        mask = ((offsets[:, :1] < ends) & (offsets[:, 1:] > starts)).any(axis=1)
        return ids, mask, len(text.encode())
