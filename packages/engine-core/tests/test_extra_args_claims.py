"""``extra_args`` keys that no plugin takes are refused, naming them.

A plugin takes the keys in its ``extra_args_keys``; a logits processor also takes the keys
its ``validate_params`` reads (``get``, ``[]``, ``in``), or every key when it enumerates
``extra_args`` or neither overrides ``validate_params`` nor sets ``extra_args_keys``
(:mod:`engine.core.frontend.extra_args`).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from engine.core.frontend.extra_args import ExtraArgsChecker, declares_keys
from engine.core.logits_processors import BUILTIN_LOGITS_PROCESSORS
from engine.sdk import SamplingParams, ValidationError
from engine.sdk.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    PerRequestLogitsProcessor,
    RequestLogitsProcessor,
)
from engine.sdk.plugin import Plugin


class _NoOp(LogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class Strength(_NoOp):
    """Reads ``strength`` with ``get`` (the usual way) and refuses negative values."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        value = (params.extra_args or {}).get("strength")
        if value is not None and value < 0:
            raise ValidationError(f"strength must be >= 0, got {value}",
                                  param="extra_args.strength")


class Lookups(_NoOp):
    """Reads ``mode`` with ``in`` and ``[]``, and needs ``extra_args`` to be a dict."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        extra = params.extra_args
        if isinstance(extra, dict) and "mode" in extra:
            assert extra["mode"] in ("a", "b")


class Enumerates(_NoOp):
    """Looks at every key (``items``): claims them all."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        for key, _ in (params.extra_args or {}).items():
            assert isinstance(key, str)


class Undeclared(PerRequestLogitsProcessor):
    """Keeps the default ``validate_params``: it reads ``tag`` only in the worker."""

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        return None


class DeclaresTag(PerRequestLogitsProcessor):
    """Keeps the default ``validate_params`` but declares its key."""

    extra_args_keys = frozenset({"tag"})

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        return None


class Policy(Plugin):
    """Not a logits processor: takes ``tier`` and ``boost`` by declaring them."""

    extra_args_keys = frozenset({"tier", "boost"})


def _check(*processors: type[Plugin], **extra: Any) -> None:
    checker = ExtraArgsChecker({cls.__name__: cls for cls in processors})
    checker.check(SamplingParams(extra_args=extra or None))


def test_a_key_a_processor_reads_is_claimed() -> None:
    _check(Strength, *BUILTIN_LOGITS_PROCESSORS, strength=2)
    _check(Strength, Lookups, strength=1, mode="a")
    _check(Strength)  # no extra_args: nothing to claim


def test_an_unclaimed_key_is_refused_naming_it_and_the_keys_taken() -> None:
    with pytest.raises(ValidationError) as info:
        _check(Strength, Lookups, *BUILTIN_LOGITS_PROCESSORS, strenght=2)
    assert info.value.param == "extra_args.strenght"
    message = str(info.value)
    assert "'strenght'" in message and "'strength'" in message and "'mode'" in message
    with pytest.raises(ValidationError, match="keys 'x', 'y' are not") as info:
        _check(Strength, strength=1, x=1, y=2)
    assert info.value.param == "extra_args.x"


def test_the_builtin_processors_take_no_keys() -> None:
    assert all(declares_keys(cls) for cls in BUILTIN_LOGITS_PROCESSORS)
    with pytest.raises(ValidationError, match=r"the keys they take: none\)") as info:
        _check(*BUILTIN_LOGITS_PROCESSORS, my_processor_strength=0.5)
    assert info.value.param == "extra_args.my_processor_strength"


def test_a_processors_own_error_comes_first() -> None:
    with pytest.raises(ValidationError, match="strength must be >= 0") as info:
        _check(Strength, strength=-1, unknown=1)
    assert info.value.param == "extra_args.strength"


def test_a_processor_that_enumerates_extra_args_claims_every_key() -> None:
    _check(Strength, Enumerates, anything=1, strength=1)


def test_a_processor_without_validate_params_turns_the_check_off(
        caplog: pytest.LogCaptureFixture) -> None:
    assert not declares_keys(Undeclared)
    with caplog.at_level(logging.WARNING, logger="engine.core"):
        checker = ExtraArgsChecker({"test_undeclared": Undeclared, "strength": Strength})
    assert checker.undeclared == ("test_undeclared",)
    assert "test_undeclared" in caplog.text and "default validate_params" in caplog.text
    checker.check(SamplingParams(extra_args={"tag": 3}))


def test_processors_see_the_values_unchanged() -> None:
    seen: list[Any] = []

    class Records(_NoOp):
        @classmethod
        def validate_params(cls, params: SamplingParams) -> None:
            seen.append(dict(params.extra_args or {}))

    _check(Records, a=[1, 2], b={"c": None})
    assert seen == [{"a": [1, 2], "b": {"c": None}}]


def test_keys_another_plugin_declares_are_taken() -> None:
    _check(Policy, Strength, *BUILTIN_LOGITS_PROCESSORS, tier=1, boost=True, strength=2)
    with pytest.raises(ValidationError) as info:
        _check(Policy, Strength, tierr=1)
    assert info.value.param == "extra_args.tierr"
    assert ("(the keys they take: 'boost' by Policy; 'strength' by Strength; 'tier' by "
            "Policy)") in str(info.value)


def test_a_processor_that_declares_its_keys_keeps_the_check_on() -> None:
    assert declares_keys(DeclaresTag)
    checker = ExtraArgsChecker({"declares_tag": DeclaresTag})
    assert checker.undeclared == ()
    checker.check(SamplingParams(extra_args={"tag": 3}))
    with pytest.raises(ValidationError, match=r"'other' is not taken .* 'tag' by declares_tag"):
        checker.check(SamplingParams(extra_args={"tag": 3, "other": 1}))


def test_a_key_read_and_declared_lists_each_plugin_once() -> None:
    class ReadsTier(Strength):
        extra_args_keys = frozenset({"tier"})

        @classmethod
        def validate_params(cls, params: SamplingParams) -> None:
            (params.extra_args or {}).get("tier")

    with pytest.raises(ValidationError, match=r"'tier' by ReadsTier, Policy\)"):
        _check(ReadsTier, Policy, x=1)
