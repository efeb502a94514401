"""SamplingParams validation: every bad value names the field and the allowed range."""

from __future__ import annotations

import pytest

from engine.sdk import SamplingParams, ValidationError


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("n", 0, ">= 1"),
        ("temperature", -0.1, ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_k", -2, ">= 0"),
        ("min_p", 1.1, "[0, 1]"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -3, "[-2, 2]"),
        ("repetition_penalty", 0, "> 0"),
        ("max_tokens", 0, ">= 1"),
        ("min_tokens", -1, ">= 0"),
        ("logprobs", -1, ">= 0"),
        ("prompt_logprobs", "5", ">= 0"),
        ("seed", 1.5, "integer"),
        ("stop", [""], "non-empty string"),
        ("stop_token_ids", [-1], "token ids"),
        ("logit_bias", {5: 101}, "[-100, 100]"),
        ("logit_bias", {-1: 1.0}, "token ids"),
        ("extra_args", [1], "mapping"),
        ("n", True, ">= 1"),
    ],
)
def test_bad_values_name_field_and_range(field: str, value: object, allowed: str) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert info.value.param == field
    assert str(info.value).startswith(field)
    assert allowed in str(info.value)
    assert repr(value) in str(info.value) or field in ("logit_bias",)


def test_min_tokens_cannot_exceed_max_tokens() -> None:
    with pytest.raises(ValidationError, match=r"min_tokens must be <= max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_defaults_and_normalisation() -> None:
    params = SamplingParams(stop="###", stop_token_ids=[3, 4], top_k=-1)
    assert params.stop == ("###",)
    assert params.stop_token_ids == (3, 4)
    assert params.top_k == 0
    assert not params.is_greedy
    assert SamplingParams(temperature=0).is_greedy


def test_frozen_and_replace_revalidates() -> None:
    params = SamplingParams(temperature=0.5)
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # type: ignore[misc]
    assert params.replace(temperature=0.7).temperature == 0.7
    with pytest.raises(ValidationError, match="temperature"):
        params.replace(temperature=-1)


def test_dict_roundtrip() -> None:
    params = SamplingParams(
        n=2, temperature=0.3, stop=["a", "b"], logit_bias={7: -3.5}, seed=11,
        extra_args={"ban_token": 5, "nested": {"x": [1, 2]}},
    )
    assert SamplingParams.from_dict(params.to_dict()) == params


def test_from_dict_rejects_unknown_keys_naming_them() -> None:
    with pytest.raises(ValidationError, match="unknown sampling parameter.*temprature") as info:
        SamplingParams.from_dict({"temprature": 0.5})
    assert info.value.param == "temprature"
