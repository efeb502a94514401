"""The built-in structured-output backend, on xgrammar (vLLM's and SGLang's default).

``json`` -> ``Grammar.from_json_schema``, ``json_object`` -> the schema ``{"type":
"object"}``, ``regex`` -> ``Grammar.from_regex``, ``choice`` -> an EBNF alternation of the
strings, ``grammar`` -> ``Grammar.from_ebnf`` (GBNF syntax). Turning a spec into a grammar
needs no tokenizer, so :meth:`XgrammarBackend.validate` (the front end's check) is cheap;
the tokenizer-dependent compiler is built on the first :meth:`~XgrammarBackend.compile`.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import Field

from engine.sdk.errors import ValidationError
from engine.sdk.plugin import PluginOptions
from engine.sdk.structured_output import (
    StructuredOutputBackend,
    StructuredOutputContext,
    StructuredOutputMatcher,
    StructuredOutputsParams,
)

if TYPE_CHECKING:
    import torch

#: xgrammar prefixes its messages with a time stamp and a C++ source location.
_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _clean(exc: BaseException) -> str:
    return _LOCATION.sub("", str(exc)).strip()


#: xgrammar (0.2.9) writes the characters of a length-bounded JSON string (``maxLength``,
#: ``minLength``) as this class, which lets raw control characters (U+0000-U+001F) into
#: the string: invalid JSON, refused by ``json.loads``. Unbounded strings exclude them.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _json_strings_fixed(grammar: Any) -> Any:
    """``grammar`` with its bounded strings' characters limited as JSON requires."""
    import xgrammar as xgr

    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


class XgrammarBackend(StructuredOutputBackend):
    """Structured outputs on xgrammar: JSON schemas, JSON objects, regexes, choices, EBNF."""

    class Options(PluginOptions):
        """``--plugin-option xgrammar.max_threads=N``, ``xgrammar.max_whitespace=N``."""

        max_threads: int = Field(
            1, ge=1, description="threads xgrammar compiles a grammar with")
        max_whitespace: int = Field(
            20, ge=1, description="longest run of whitespace allowed between JSON tokens "
            "(json, json_object): room for pretty-printing, none for a model that would "
            "otherwise fill max_tokens with blanks")

    def __init__(self, ctx: StructuredOutputContext) -> None:
        super().__init__(ctx)
        options = ctx.options
        self._options = (options if isinstance(options, self.Options)
                         else self.Options.model_validate({}))
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _grammar(self, params: StructuredOutputsParams) -> Any:
        import xgrammar as xgr

        kind = params.kind
        json_options: dict[str, Any] = {
            "any_whitespace": not params.disable_any_whitespace,
            "max_whitespace_cnt": self._options.max_whitespace}
        try:
            if kind in ("json", "json_object"):
                schema = params.spec if kind == "json" else '{"type": "object"}'
                return _json_strings_fixed(
                    xgr.Grammar.from_json_schema(schema, **json_options))
            if kind == "regex":
                return xgr.Grammar.from_regex(params.spec)
            if kind == "choice":
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(
                    json.dumps(choice, ensure_ascii=False) for choice in params.choice or ()))
            return xgr.Grammar.from_ebnf(params.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            what = {"json": "is not a JSON schema xgrammar supports",
                    "json_object": "cannot be served", "regex": "is not a valid regex",
                    "choice": "cannot be served", "grammar": "is not a valid EBNF grammar"}
            raise ValidationError(f"structured_outputs.{kind} {what[kind]}: {_clean(exc)}",
                                  param=f"structured_outputs.{kind}") from None

    def validate(self, params: StructuredOutputsParams) -> None:
        self._grammar(params)

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                ctx = self.ctx
                info = xgr.TokenizerInfo.from_huggingface(
                    ctx.tokenizer, vocab_size=ctx.vocab_size,
                    stop_token_ids=list(ctx.eos_token_ids) or None)
                self._compiler = xgr.GrammarCompiler(info,
                                                     max_threads=self._options.max_threads)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        grammar = self._grammar(params)
        return self._get_compiler().compile_grammar(grammar)

    def matcher(self, grammar: Any) -> StructuredOutputMatcher:
        import xgrammar as xgr

        return XgrammarMatcher(xgr.GrammarMatcher(grammar))


class XgrammarMatcher(StructuredOutputMatcher):
    """One request's ``xgrammar.GrammarMatcher``."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        for done, token in enumerate(token_ids):
            if not self._matcher.accept_token(int(token)):
                if done:
                    self._matcher.rollback(done)
                return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
