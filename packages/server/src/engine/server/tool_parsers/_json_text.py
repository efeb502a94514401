"""JSON objects inside model text: decode one where it starts, serialise arguments.

Models put JSON in the middle of other text (tags, separators, prose), so the parsers
decode with ``json.JSONDecoder().raw_decode``, which reads one value at a position and says
where it ended, instead of cutting the text first and calling ``json.loads``. Nothing here
raises on model output.
"""

from __future__ import annotations

import json
from typing import Any

from engine.sdk.tool_parser import ToolCall

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\r\n"


def skip(text: str, pos: int, chars: str = _WHITESPACE) -> int:
    """The first index at or after ``pos`` whose character is not in ``chars``."""
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def decode_object(text: str, pos: int) -> tuple[dict[str, Any], int] | None:
    """The JSON object starting at ``pos`` (after whitespace) and the index after it.

    Returns ``None`` when no complete object starts there: other text, a value that is not
    an object, invalid JSON, or an object cut off by the end of ``text``.
    """
    pos = skip(text, pos)
    if not text.startswith("{", pos):
        return None
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):  # invalid or cut off; absurdly deep nesting
        return None
    return (value, end) if isinstance(value, dict) else None


def arguments_json(arguments: Any) -> str:
    """``arguments`` as JSON text, non-ASCII kept as is (vLLM: ``ensure_ascii=False``)."""
    return json.dumps(arguments, ensure_ascii=False)


def call_from_object(obj: dict[str, Any], argument_keys: tuple[str, ...],
                     require_arguments: bool) -> ToolCall | None:
    """The call ``obj`` describes, or ``None`` when it does not describe one.

    Args:
        obj: A decoded object, e.g. ``{"name": "f", "arguments": {...}}``.
        argument_keys: Where the arguments may be, in order of preference.
        require_arguments: Whether an object without any of ``argument_keys`` is not a call
            (otherwise its arguments are ``{}``).

    A call needs a non-empty string ``name``.
    """
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    for key in argument_keys:
        if key in obj:
            return ToolCall(name=name, arguments=arguments_json(obj[key]))
    return None if require_arguments else ToolCall(name=name, arguments="{}")
