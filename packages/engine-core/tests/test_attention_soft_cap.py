"""Logit soft-capping (``AttentionSpec.logits_soft_cap``): spec, selection gate, torch backend."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from engine.core.attention import TorchAttentionBackend
from engine.core.model_executor.layers import LayerFactory
from engine.sdk.attention import (
    AttentionBackend,
    AttentionSpec,
    backend_supports,
    select_backend,
)
from engine.sdk.errors import UnsupportedError
from engine.sdk.support import Support
from engine.testing.attention_batches import EQUAL_DECODES, MIXED, check_step, run_step


def spec_of(dtype: str = "float32", **options: Any) -> AttentionSpec:
    return AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, dtype=dtype,
                         kv_cache_dtype=dtype, block_size=4, **options)


@pytest.mark.parametrize("reqs", [MIXED, EQUAL_DECODES], ids=["mixed", "equal_decodes"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_torch_backend_caps_the_scores(reqs, window, dtype, tol) -> None:
    # A small cap against large scores (x3 scale): the cap changes the result a lot.
    cap, scale = 2.0, 3 * 16 ** -0.5
    spec = spec_of(dtype, sliding_window=window, logits_soft_cap=cap)
    result = run_step(TorchAttentionBackend, spec, scale, reqs=reqs)
    check_step(result, scale, window=window, soft_cap=cap, tol=tol)
    uncapped = run_step(TorchAttentionBackend, spec_of(dtype, sliding_window=window), scale,
                        reqs=reqs)
    assert (uncapped.output.float() - result.output.float()).abs().max() > 0.1


@pytest.mark.parametrize("cap", [0, -1.0, float("inf"), float("nan"), True, "50"])
def test_spec_refuses_a_bad_cap(cap) -> None:
    with pytest.raises(ValueError, match="logits_soft_cap must be a finite number > 0"):
        spec_of(logits_soft_cap=cap)


def test_describe_names_the_cap() -> None:
    assert "logits_soft_cap=50.0" in spec_of(logits_soft_cap=50.0).describe()
    assert "logits_soft_cap" not in spec_of().describe()


class LegacyBackend(TorchAttentionBackend):
    """A backend written against SDK 1.0: its supports() never looks at the new field."""

    name: ClassVar[str] = "legacy"
    answered_spec_fields: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def supports(cls, spec: AttentionSpec) -> Support:
        return Support.yes()


def test_a_backend_that_does_not_answer_the_field_is_refused_it() -> None:
    assert backend_supports(LegacyBackend, spec_of())
    answer = backend_supports(LegacyBackend, spec_of(logits_soft_cap=30.0))
    assert not answer
    assert "logits_soft_cap=30.0" in answer.reason
    assert "answered_spec_fields" in answer.reason
    with pytest.raises(UnsupportedError, match="legacy: logits_soft_cap=30.0"):
        select_backend([LegacyBackend], spec_of(logits_soft_cap=30.0))
    assert select_backend([LegacyBackend, TorchAttentionBackend],
                          spec_of(logits_soft_cap=30.0)) is TorchAttentionBackend


def test_answered_spec_fields_names_known_fields_only() -> None:
    with pytest.raises(TypeError, match="logit_soft_cap not among"):
        type("Typo", (LegacyBackend,), {"answered_spec_fields": {"logit_soft_cap"}})
    with pytest.raises(TypeError, match="must be a collection"):
        type("Text", (LegacyBackend,), {"answered_spec_fields": "logits_soft_cap"})
    cls: Any = type("Listed", (LegacyBackend,), {"answered_spec_fields": ["logits_soft_cap"]})
    assert cls.answered_spec_fields == frozenset({"logits_soft_cap"})
    assert backend_supports(cls, spec_of(logits_soft_cap=30.0))


def test_factory_refuses_a_layer_the_backend_cannot_serve() -> None:
    factory = LayerFactory(dtype=torch.float32, block_size=4, attention_backend=LegacyBackend)
    factory.attention("model.layers.0.self_attn.attn", num_heads=4, num_kv_heads=2,
                      head_size=16, scale=0.25)
    with pytest.raises(UnsupportedError) as err:
        factory.attention("model.layers.1.self_attn.attn", num_heads=4, num_kv_heads=2,
                          head_size=16, scale=0.25, logits_soft_cap=50.0)
    text = str(err.value)
    assert "'model.layers.1.self_attn.attn'" in text
    assert "'legacy'" in text and "answered_spec_fields" in text


def test_factory_passes_the_cap_to_the_spec() -> None:
    factory = LayerFactory(dtype=torch.float32, block_size=4,
                           attention_backend=TorchAttentionBackend)
    layer = factory.attention("attn", num_heads=4, num_kv_heads=2, head_size=16, scale=0.25,
                              logits_soft_cap=50.0)
    assert layer.impl.params.spec.logits_soft_cap == 50.0
    with pytest.raises(ValueError, match="logits_soft_cap"):
        factory.attention("attn2", num_heads=4, num_kv_heads=2, head_size=16, scale=0.25,
                          logits_soft_cap=-1.0)


def test_unlisted_abstract_base_is_not_asked() -> None:
    # select_backend still reports abstract candidates (the gate runs only for concrete ones)
    with pytest.raises(UnsupportedError, match="abstract methods"):
        select_backend([AttentionBackend], spec_of(logits_soft_cap=1.0))
