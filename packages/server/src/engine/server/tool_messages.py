"""The tool fields of a conversation's messages, checked and shaped for the chat template.

An ``assistant`` message may carry the ``tool_calls`` it made (OpenAI's shape); a ``tool``
message answers one of them and names it in ``tool_call_id``. Templates get each call's
``arguments`` as a mapping when it is a JSON object (Llama 3's and Hermes' templates
iterate over it, as vLLM passes them), else as the text given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine.sdk.errors import ValidationError


def _call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if (not isinstance(call, Mapping) or call.get("type", "function") != "function"
            or not isinstance(function, Mapping) or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments", ""), str)):
        raise ValidationError(f"{where} must be {{\"id\": ..., \"type\": \"function\", "
                              f"\"function\": {{\"name\": ..., \"arguments\": \"<JSON text>\"}}}}",
                              param=where)
    arguments: Any = function.get("arguments", "")
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError:
        parsed = None
    if isinstance(parsed, Mapping):
        arguments = parsed
    entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        entry["id"] = call["id"]
    return entry


def tool_fields(message: Any, where: str) -> dict[str, Any]:
    """The ``tool_calls`` / ``tool_call_id`` entries of one message for the template.

    Raises:
        ValidationError: a field on the wrong role, or of the wrong shape, naming it.
    """
    out: dict[str, Any] = {}
    if message.tool_calls is not None:
        if message.role != "assistant":
            raise ValidationError(f"{where}.tool_calls: only assistant messages carry tool "
                                  f"calls", param=f"{where}.tool_calls")
        if not isinstance(message.tool_calls, list):
            raise ValidationError(f"{where}.tool_calls must be a list",
                                  param=f"{where}.tool_calls")
        out["tool_calls"] = [_call(call, f"{where}.tool_calls.{i}")
                             for i, call in enumerate(message.tool_calls)]
    if message.role == "tool":
        if not isinstance(message.tool_call_id, str) or not message.tool_call_id:
            raise ValidationError(f"{where}.tool_call_id: a tool message must name the call "
                                  f"it answers", param=f"{where}.tool_call_id")
        out["tool_call_id"] = message.tool_call_id
    elif message.tool_call_id is not None:
        raise ValidationError(f"{where}.tool_call_id: only tool messages answer a call",
                              param=f"{where}.tool_call_id")
    return out
