"""Tool calling on ``POST /v1/chat/completions``: ``tools``, ``tool_choice``, the parser.

As in vLLM and OpenAI:

* ``tools`` (``[{"type": "function", "function": {"name", "description", "parameters"}}]``)
  are given to the chat template (``tools=...``), which renders them its own way.
* ``tool_choice``: ``"none"`` (plain text), ``"auto"`` (the default when ``tools`` are
  given: the model decides, and the ``--tool-call-parser`` finds calls in its text; needs
  ``--enable-auto-tool-choice``), ``"required"`` (at least one call: the output is
  constrained to a JSON array of ``{"name", "parameters"}`` objects, one of the tools
  each) or ``{"type": "function", "function": {"name": NAME}}`` (the output is constrained
  to that tool's ``parameters`` schema and becomes its arguments).
* ``parallel_tool_calls: false`` allows at most one call.

The response's ``message.tool_calls`` (and streamed ``delta.tool_calls``) have OpenAI's
shape; ``finish_reason`` is ``"tool_calls"`` when calls were made (``auto`` and
``required``), as vLLM reports it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from engine.core.plugin_construction import construct_plugin
from engine.core.startup import EngineSetup
from engine.sdk.errors import ValidationError
from engine.sdk.groups import TOOL_PARSERS
from engine.sdk.plugin import PluginOptions
from engine.sdk.structured_output import StructuredOutputsParams
from engine.sdk.tool_parser import ExtractedToolCalls, ToolCall, ToolParser, ToolParserContext
from engine.server.tool_parsers._json_text import call_from_object

ToolChoice = Literal["none", "auto", "required", "named"]

#: OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def new_call_id() -> str:
    """A fresh tool-call id (``call_`` and 24 hex digits, as vLLM makes them)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolParserSelection:
    """The ``--tool-call-parser`` of this server, loaded at start-up.

    Args:
        setup: The engine setup (catalog, options, tokenizer source).
        name: The parser's name (an ``engine.tool_parsers`` entry or ``module:Class``).
        tokenizer: The served model's ``transformers`` tokenizer.
    """

    setup: EngineSetup
    name: str
    cls: type[ToolParser]
    tokenizer: Any

    @classmethod
    def load(cls, setup: EngineSetup, name: str, tokenizer: Any) -> ToolParserSelection:
        """Load (import, check) the parser and validate its options.

        Raises:
            PluginError: unknown, broken, or its options are invalid.
        """
        parser_cls: type[ToolParser] = setup.catalog.load(TOOL_PARSERS, name)
        selection = cls(setup, name, parser_cls, tokenizer)
        construct_plugin(setup, TOOL_PARSERS, name, parser_cls, lambda options: options)
        return selection

    def new(self, tools: Sequence[Mapping[str, Any]]) -> ToolParser:
        """A parser for one request's output (one per choice).

        Raises:
            PluginError: the constructor raised, naming the parser.
        """
        def make(options: PluginOptions) -> ToolParser:
            return self.cls(ToolParserContext(
                plugin_name=self.name, options=options, process="frontend",
                model=self.setup.source.display_name, tokenizer=self.tokenizer), tools)

        return construct_plugin(self.setup, TOOL_PARSERS, self.name, self.cls, make)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tool fields ask for.

    Attributes:
        tools: The tool definitions for the chat template (None: the request has none).
        choice: ``none``, ``auto``, ``required`` or ``named``.
        name: The function of a ``named`` choice.
        constraint: The structured output enforcing ``required`` or ``named``.
        parallel: Several calls may be made (``parallel_tool_calls``).
    """

    tools: list[dict[str, Any]] | None = None
    choice: ToolChoice = "none"
    name: str | None = None
    constraint: StructuredOutputsParams | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """True when the output may hold tool calls to report."""
        return self.choice != "none"


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise ValidationError("tools must be a non-empty list of {\"type\": \"function\", "
                              "\"function\": {...}} objects", param="tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ValidationError(f"{where} must be {{\"type\": \"function\", \"function\": "
                                  f"{{\"name\": ..., \"parameters\": {{...}}}}}}; only "
                                  f"function tools are supported", param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ValidationError(f"{where}.function must be an object with a name",
                                  param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValidationError(f"{where}.function.name must be 1-64 letters, digits, _ or "
                                  f"-, got {name!r}", param=f"{where}.function.name")
        if name in seen:
            raise ValidationError(f"{where}.function.name {name!r} is given twice",
                                  param=f"{where}.function.name")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ValidationError(f"{where}.function.parameters must be a JSON schema object",
                                  param=f"{where}.function.parameters")
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ValidationError(f"{where}.function has unknown field(s) "
                                  f"{', '.join(unknown)}; allowed: name, description, "
                                  f"parameters, strict", param=f"{where}.function.{unknown[0]}")
    return [dict(tool) for tool in tools]


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    schema = tool["function"].get("parameters")
    return dict(schema) if schema else {"type": "object", "properties": {}}


def _required_schema(tools: Sequence[Mapping[str, Any]], parallel: bool) -> dict[str, Any]:
    """The schema of ``tool_choice: "required"`` (vLLM's): ``[{"name", "parameters"}, ...]``."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(body: Any, *, auto_enabled: bool) -> ToolPlan:
    """The tool plan of a chat request body.

    Args:
        body: The ``ChatCompletionRequest``.
        auto_enabled: The server runs with ``--enable-auto-tool-choice`` and a parser.

    Raises:
        ValidationError: malformed ``tools``/``tool_choice``, a named function that is not
            among the tools, ``auto`` without a parser, or a second output constraint.
    """
    choice_value = body.tool_choice
    parallel = body.parallel_tool_calls is not False
    if body.parallel_tool_calls not in (None, True, False):
        raise ValidationError("parallel_tool_calls must be true or false",
                              param="parallel_tool_calls")
    if body.tools is None:
        if choice_value not in (None, "none"):
            raise ValidationError("tool_choice needs tools: give the functions the model may "
                                  "call in tools", param="tool_choice")
        return ToolPlan()
    tools = _check_tools(body.tools)
    names = [t["function"]["name"] for t in tools]
    if choice_value is None or choice_value == "auto":
        if not auto_enabled:
            raise ValidationError(
                "tool_choice \"auto\" (the default when tools are given) needs the server to "
                "run with --enable-auto-tool-choice and --tool-call-parser NAME; this one "
                "does not. Use tool_choice \"required\", \"none\" or a named function",
                param="tool_choice")
        return ToolPlan(tools=tools, choice="auto", parallel=parallel)
    if choice_value == "none":
        return ToolPlan(tools=tools, choice="none", parallel=parallel)
    if choice_value == "required":
        return ToolPlan(tools=tools, choice="required", parallel=parallel,
                        constraint=StructuredOutputsParams(
                            json=_required_schema(tools, parallel), disable_any_whitespace=True))
    function = choice_value.get("function") if isinstance(choice_value, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if (not isinstance(choice_value, Mapping) or choice_value.get("type") != "function"
            or not isinstance(name, str)):
        raise ValidationError("tool_choice must be \"none\", \"auto\", \"required\" or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}, got "
                              f"{choice_value!r}", param="tool_choice")
    if name not in names:
        raise ValidationError(f"tool_choice names function {name!r}, which is not among the "
                              f"tools ({', '.join(names)})", param="tool_choice")
    tool = tools[names.index(name)]
    return ToolPlan(tools=tools, choice="named", name=name, parallel=parallel,
                    constraint=StructuredOutputsParams(json=_parameters(tool),
                                                       disable_any_whitespace=True))


def required_calls(text: str, parallel: bool) -> ExtractedToolCalls:
    """The calls of a ``required`` output (a JSON array); none if it is cut short."""
    try:
        items = json.loads(text)
    except ValueError:
        return ExtractedToolCalls(content=text or None)
    calls = [call for item in items if (call := required_call(item)) is not None
             ] if isinstance(items, list) else []
    if not calls:
        return ExtractedToolCalls(content=text or None)
    return ExtractedToolCalls(tool_calls=tuple(calls if parallel else calls[:1]))


def required_call(item: Any) -> ToolCall | None:
    """The call one element of a ``required`` array describes (``{"name", "parameters"}``)."""
    return (call_from_object(item, ("parameters", "arguments"), require_arguments=False)
            if isinstance(item, dict) else None)


def extract_calls(plan: ToolPlan, text: str, parser: ToolParser | None) -> ExtractedToolCalls:
    """The tool calls (and remaining content) of one finished choice's text."""
    if plan.choice == "named":
        assert plan.name is not None
        return ExtractedToolCalls(tool_calls=(ToolCall(name=plan.name, arguments=text),))
    if plan.choice == "required":
        return required_calls(text, plan.parallel)
    if plan.choice == "auto" and parser is not None:
        found = parser.extract_tool_calls(text)
        if found.tools_called and not plan.parallel:
            return ExtractedToolCalls(tool_calls=found.tool_calls[:1], content=found.content)
        return found
    return ExtractedToolCalls(content=text)
