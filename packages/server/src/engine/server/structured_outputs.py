"""A request's structured-output fields -> ``StructuredOutputsParams``.

Three spellings, at most one per request (two are a 400 naming both):

* OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type":
  "json_object"}``, ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``;
* vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" |
  "json_object": ..., "disable_any_whitespace": bool}``;
* vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``
  (with ``guided_whitespace_pattern`` refused and ``guided_decoding_backend`` accepted only
  when it names the server's backend).

Whether the spec itself is valid (a schema xgrammar supports, a regex that compiles) is the
backend's to say, in the engine's front end: also a 400, whose ``param`` names the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.sdk.errors import ValidationError
from engine.sdk.sampling_params import SamplingParams
from engine.sdk.structured_output import StructuredOutputsParams

#: ``guided_*`` field -> the ``structured_outputs`` field it sets.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}

_FORMATS = ("text", "json_object", "json_schema")


def _from_response_format(value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, Mapping) or value.get("type") not in _FORMATS:
        kind = value.get("type") if isinstance(value, Mapping) else value
        raise ValidationError(f"response_format.type must be one of {', '.join(_FORMATS)}, "
                              f"got {kind!r}", param="response_format")
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra or (kind != "json_schema" and "json_schema" in value):
        raise ValidationError(f"response_format of type {kind!r} takes no field(s) "
                              f"{', '.join(extra or ['json_schema'])}",
                              param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
        raise ValidationError("response_format of type json_schema needs json_schema: "
                              "{\"name\": ..., \"schema\": {...a JSON schema...}}",
                              param="response_format.json_schema.schema")
    unknown = sorted(set(spec) - {"name", "description", "schema", "strict"})
    if unknown:
        raise ValidationError(f"response_format.json_schema has unknown field(s) "
                              f"{', '.join(unknown)}; allowed: name, description, schema, "
                              f"strict", param=f"response_format.json_schema.{unknown[0]}")
    return _renamed(lambda: StructuredOutputsParams(json=spec["schema"]),
                    "response_format.json_schema.schema")


def _renamed(build: Any, param: str) -> StructuredOutputsParams:
    """``build()``, with a ``ValidationError`` reported under the request's own field."""
    try:
        params: StructuredOutputsParams = build()
    except ValidationError as exc:
        message = exc.message.replace(exc.param or "structured_outputs", param, 1)
        raise ValidationError(message, param=param) from None
    return params


def structured_outputs_of(request: Any, backend: str) -> StructuredOutputsParams | None:
    """The request's constraint, or None.

    Args:
        request: A completions or chat request body.
        backend: The server's ``--structured-outputs-backend`` (what
            ``guided_decoding_backend`` may name).

    Raises:
        ValidationError: two spellings at once, or a malformed value, naming the field.
    """
    given = [name for name in ("response_format", "structured_outputs", *GUIDED)
             if getattr(request, name, None) is not None]
    if getattr(request, "guided_whitespace_pattern", None) is not None:
        raise ValidationError("guided_whitespace_pattern is not supported; use "
                              "structured_outputs.disable_any_whitespace: true for JSON "
                              "without whitespace", param="guided_whitespace_pattern")
    chosen = getattr(request, "guided_decoding_backend", None)
    if chosen is not None and chosen != backend:
        raise ValidationError(f"guided_decoding_backend {chosen!r} is not this server's; "
                              f"it serves structured outputs with {backend!r} (chosen with "
                              f"--structured-outputs-backend)", param="guided_decoding_backend")
    if (getattr(request, "response_format", None) or {}) == {"type": "text"}:
        given.remove("response_format")
    if len(given) > 1:
        raise ValidationError(f"{' and '.join(given)} both constrain the output; give one",
                              param=given[1])
    if not given:
        return None
    (name,) = given
    value = getattr(request, name)
    if name == "response_format":
        return _from_response_format(value)
    if name == "structured_outputs":
        return StructuredOutputsParams.from_dict(value)
    field = GUIDED[name]
    return _renamed(lambda: StructuredOutputsParams(**{field: value}), name)


def with_structured_outputs(params: SamplingParams, request: Any,
                            backend: str) -> SamplingParams:
    """``params`` with the request's constraint (see :func:`structured_outputs_of`)."""
    spec = structured_outputs_of(request, backend)
    return params if spec is None else params.replace(structured_outputs=spec)
