"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a grammar.

A request asks for it with :attr:`SamplingParams.structured_outputs
<engine.sdk.sampling_params.SamplingParams.structured_outputs>` (HTTP: OpenAI's
``response_format``, vLLM's ``structured_outputs`` or the older ``guided_*`` fields). The
selected backend (``engine.structured_output_backends``, ``--structured-outputs-backend
NAME``; built in: ``xgrammar``) turns the spec into a grammar and tracks each request's
position in it::

    front end   backend.validate(params)            # a bad spec is a 400, nothing queued
    EngineCore  grammar = backend.compile(params)   # on a worker thread; cached per spec
                matcher = backend.matcher(grammar)  # one per request
      each step backend.fill_bitmask(matchers, bitmask)   # one row per request that samples
                -> the workers set the logits of disallowed tokens to -inf, then sample
                matcher.accept_tokens(new_token_ids)
                matcher.is_terminated() -> the request stops

The bitmask is xgrammar's layout, which every backend fills: an ``int32`` tensor of shape
``[rows, ceil(vocab_size / 32)]`` where bit ``j`` of word ``i`` (``word >> j & 1``) says
whether token ``32 * i + j`` is allowed. The engine allocates it, zeroed.

A backend that raises at run time fails the requests it serves (their error names it);
requests without structured outputs never reach it.

.. versionadded:: 1.1
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from engine.sdk.context import PluginContext
from engine.sdk.errors import ValidationError
from engine.sdk.plugin import Plugin

if TYPE_CHECKING:
    import torch

StructuredOutputKind = Literal["json", "json_object", "regex", "choice", "grammar"]
"""The kinds of constraint, one per request.

.. versionadded:: 1.1
"""

_KINDS: tuple[StructuredOutputKind, ...] = ("json", "json_object", "regex", "choice", "grammar")


def _fail(param: str, message: str) -> ValidationError:
    return ValidationError(f"structured_outputs.{param} {message}",
                           param=f"structured_outputs.{param}")


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """The constraint of one request: exactly one of the fields below (vLLM's names).

    Attributes:
        json: A JSON schema the output must validate against: a mapping, or its JSON text
            (stored as compact JSON text either way, key order kept).
        json_object: Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
        regex: A regular expression the whole output must match.
        choice: The output is exactly one of these strings: any sequence of them (a list,
            as JSON gives it), kept as a tuple.
        grammar: A context-free grammar in EBNF (GBNF: ``root ::= ...``).
        disable_any_whitespace: JSON without whitespace between tokens (``json`` and
            ``json_object`` only).

    Raises:
        ValidationError: none or several constraints, or a value of the wrong type; the
            ``param`` is ``structured_outputs.<field>``.

    .. versionadded:: 1.1
    """

    json: str | Mapping[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    if TYPE_CHECKING:  # what the constructor accepts; __post_init__ normalises it
        def __init__(self, *, json: str | Mapping[str, Any] | None = None,
                     json_object: bool = False, regex: str | None = None,
                     choice: Sequence[str] | None = None, grammar: str | None = None,
                     disable_any_whitespace: bool = False) -> None:
            """Validate the fields and normalise them (see the class docstring).

            For type checkers only: at run time the dataclass's own ``__init__`` runs,
            with these parameters and defaults.
            """

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if (getattr(self, k) not in (None, False))]
        if len(given) != 1:
            raise ValidationError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) if given else 'none'}",
                param="structured_outputs")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence):
                raise _fail("choice", f"must be a list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise _fail("choice", "must be a non-empty list of non-empty strings, got "
                            f"{list(self.choice)!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise _fail(name, f"must be a non-empty string, got {value!r}")
        if not isinstance(self.json_object, bool):
            raise _fail("json_object", f"must be true or false, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise _fail("disable_any_whitespace",
                        f"must be true or false, got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> StructuredOutputKind:
        """Which constraint this is."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text.

        The schema's JSON, the regex, the grammar, the choices as a JSON list, or ``""``
        for ``json_object``.
        """
        kind = self.kind
        if kind == "choice":
            return json.dumps(list(self.choice or ()), ensure_ascii=False)
        if kind == "json_object":
            return ""
        value: str = getattr(self, kind)
        return value

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar (the engine caches compiles by it)."""
        return (self.kind, self.spec, self.disable_any_whitespace)

    def to_dict(self) -> dict[str, Any]:
        """The set fields as JSON-ready data; :meth:`from_dict` is the inverse."""
        out: dict[str, Any] = {self.kind: True if self.kind == "json_object" else (
            list(self.choice or ()) if self.kind == "choice" else self.spec)}
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StructuredOutputsParams:
        """Build from a mapping of field names (unknown keys are a ``ValidationError``)."""
        if not isinstance(data, Mapping):
            raise ValidationError(f"structured_outputs must be an object, got {data!r}",
                                  param="structured_outputs")
        allowed = (*_KINDS, "disable_any_whitespace")
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ValidationError(
                f"structured_outputs has unknown field(s) {', '.join(unknown)}; allowed: "
                f"{', '.join(allowed)}", param=f"structured_outputs.{unknown[0]}")
        values = {k: v for k, v in data.items() if v is not None}
        return cls(**values)


def _schema_text(schema: object) -> str:
    if isinstance(schema, Mapping):
        try:
            return json.dumps(schema, ensure_ascii=False, separators=(",", ":"),
                              allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise _fail("json", f"is not JSON-serialisable: {exc}") from None
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as exc:
            raise _fail("json", f"is not valid JSON: {exc}") from None
        if not isinstance(parsed, (Mapping, bool)):
            raise _fail("json", f"must be a JSON schema object, got {schema[:80]!r}")
        return json.dumps(parsed, ensure_ascii=False, separators=(",", ":"))
    raise _fail("json", f"must be a JSON schema (an object or its JSON text), got {schema!r}")


@dataclass(frozen=True)
class GrammarBitmask:
    """The allowed tokens of this step's constrained rows, sent with the ``SchedulerOutput``.

    Attributes:
        req_ids: The requests with a row, in row order (only those that sample this step).
        bitmask: ``int32`` tensor ``[len(req_ids), ceil(vocab_size / 32)]`` (module layout).

    .. versionadded:: 1.1
    """

    req_ids: tuple[str, ...]
    bitmask: Any


@dataclass(frozen=True, kw_only=True)
class StructuredOutputContext(PluginContext):
    """What a structured-output backend is told.

    Attributes:
        tokenizer: The served model's ``transformers`` tokenizer.
        vocab_size: Width of the model's logits (may exceed the tokenizer's vocabulary; the
            bitmask has ``ceil(vocab_size / 32)`` words per row).
        eos_token_ids: The ids that end generation; a finished grammar allows only these.

    .. versionadded:: 1.1
    """

    tokenizer: Any = None
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()


class StructuredOutputMatcher(ABC):
    """One request's position in its grammar. Used only on the EngineCore loop thread.

    .. versionadded:: 1.1
    """

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance past the request's new tokens; ``False`` if one is not allowed.

        After ``False`` the matcher is as before the call; the engine fails the request.

        Called: once per step in which the request got tokens.
        """

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of ``bitmask`` (module layout).

        Called: by the default :meth:`StructuredOutputBackend.fill_bitmask`.
        """

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when the grammar is complete (it accepted an end-of-sequence token)."""


class StructuredOutputBackend(Plugin, ABC):
    """Turns structured-output specs into grammars and fills the batch bitmask.

    Constructed once per process that uses it: in the front end (only :meth:`validate` is
    called there) and, on the first constrained request, in EngineCore. Hold expensive
    tokenizer-dependent state lazily: the front end never compiles.

    .. versionadded:: 1.1
    """

    def __init__(self, ctx: StructuredOutputContext) -> None:
        self.ctx = ctx

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ``ValidationError`` if ``params`` cannot be served.

        An invalid schema, regex or grammar, or a feature the backend lacks: the server
        answers HTTP 400 with the message, so it must name the problem.

        Called: in the front end, once per request, before it is queued. Default: compiles.
        """
        self.compile(params)

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params``.

        Opaque to the engine, shared by every request with the same
        :attr:`~StructuredOutputsParams.key`.

        Called: in EngineCore, on a worker thread, once per distinct spec (cached).

        Raises:
            ValidationError: the spec is invalid (the request fails with this message).
        """

    @abstractmethod
    def matcher(self, grammar: Any) -> StructuredOutputMatcher:
        """A fresh matcher at the start of ``grammar``, for one request."""

    def fill_bitmask(self, matchers: Sequence[StructuredOutputMatcher],
                     bitmask: torch.Tensor) -> None:
        """Fill row ``i`` of ``bitmask`` for ``matchers[i]``: the whole batch at once.

        Called: once per step with constrained requests, on the EngineCore loop thread.
        Default: each matcher's :meth:`~StructuredOutputMatcher.fill_bitmask` in turn;
        override to fill rows in parallel.
        """
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)

    def shutdown(self) -> None:
        """Release resources (thread pools, caches). Called once when EngineCore stops."""


__all__ = [
    "GrammarBitmask",
    "StructuredOutputBackend",
    "StructuredOutputContext",
    "StructuredOutputKind",
    "StructuredOutputMatcher",
    "StructuredOutputsParams",
]
