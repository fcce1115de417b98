"""Reading a JSON text that must hold one kind of value, with an error that names the text.

Config texts, ``meta_state`` entries and file metadata are all checked the same three ways (a
string, valid JSON, the kind asked for); each caller raises its own error type.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["parse_json_text"]

_KIND_NAMES = {dict: "a JSON object", list: "a JSON list"}


def parse_json_text(
    text: Any, kind: type, subject: str, error: type[Exception], expected: str | None = None
) -> Any:
    """``text`` read as JSON holding a ``kind``; otherwise ``error`` naming ``subject`` (which text,
    e.g. ``"metadata 'layers'"``) and ``expected`` (what it must hold; by default "a JSON object"
    for ``dict``, "a JSON list" for ``list``)."""
    expected = expected or _KIND_NAMES[kind]
    if not isinstance(text, str):
        raise error(f"{subject} must be a JSON text ({expected}); got {type(text).__name__}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{subject} is not valid JSON ({exc}); it must be {expected}") from None
    if not isinstance(value, kind):
        raise error(f"{subject} must be {expected}; got {type(value).__name__}")
    return value
