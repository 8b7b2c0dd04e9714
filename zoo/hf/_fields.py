"""Reading ``config.json`` fields: required fields, positive integers, and the error that refuses a
value the zoo cannot represent (naming the field, the value and why)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def refuse(model_type: str, field: str, value: Any, why: str) -> ValueError:
    """The `ValueError` for a field whose value the zoo does not implement."""
    return ValueError(f"config.json field {field!r} = {value!r} (model_type {model_type!r}) is not supported: {why}")


def field(hf: Mapping[str, Any], model_type: str, name: str, default: Any = ...) -> Any:
    """``hf[name]``, or ``default``; without a default a missing field is a `ValueError`."""
    value = hf.get(name, default)
    if value is ...:
        raise ValueError(f"config.json (model_type {model_type!r}) lacks the required field {name!r}")
    return value


def positive_int(hf: Mapping[str, Any], model_type: str, name: str, default: Any = ...) -> int:
    """:func:`field`, which must be a positive integer."""
    value = field(hf, model_type, name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config.json field {name!r} must be a positive integer, got {value!r}")
    return value
