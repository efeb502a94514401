"""Attention sinks (``AttentionSpec.has_sinks``): torch backend, the layer's parameter."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.core.attention import TorchAttentionBackend
from engine.core.distributed import TensorParallelGroup
from engine.core.model_executor.layers import LayerFactory
from engine.sdk.attention import AttentionSpec, backend_supports
from engine.testing.attention_batches import EQUAL_DECODES, MIXED, check_step, run_step

HEADS, KV_HEADS, DIM = 4, 2, 16


def spec_of(dtype: str = "float32", **options: Any) -> AttentionSpec:
    return AttentionSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=DIM, dtype=dtype,
                         kv_cache_dtype=dtype, block_size=4, **options)


SINKS = torch.tensor([3.0, -1.0, 0.5, 6.0])  # per head; large ones take most of the mass


@pytest.mark.parametrize("reqs", [MIXED, EQUAL_DECODES], ids=["mixed", "equal_decodes"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_torch_backend_adds_the_sinks_to_the_softmax(reqs, window, cap, dtype, tol) -> None:
    scale = DIM ** -0.5
    spec = spec_of(dtype, sliding_window=window, logits_soft_cap=cap, has_sinks=True)
    result = run_step(TorchAttentionBackend, spec, scale, reqs=reqs,
                      params={"sinks": SINKS.clone()})
    check_step(result, scale, window=window, soft_cap=cap, sinks=SINKS, tol=tol)
    plain = run_step(TorchAttentionBackend, spec_of(dtype, sliding_window=window,
                                                    logits_soft_cap=cap), scale, reqs=reqs)
    assert (plain.output.float() - result.output.float()).abs().max() > 0.1


def test_spec_describes_and_validates_sinks() -> None:
    assert spec_of(has_sinks=True).describe().endswith(" sinks")
    with pytest.raises(ValueError, match="has_sinks must be a bool"):
        spec_of(has_sinks=1)


def test_the_gate_refuses_sinks_to_a_backend_that_does_not_answer_them() -> None:
    legacy: Any = type("Legacy", (TorchAttentionBackend,), {"answered_spec_fields": frozenset()})
    answer = backend_supports(legacy, spec_of(has_sinks=True))
    assert not answer and "has_sinks=True" in answer.reason
    assert backend_supports(TorchAttentionBackend, spec_of(has_sinks=True))


def test_the_layer_owns_the_sinks_the_impl_reads() -> None:
    factory = LayerFactory(dtype=torch.float32, block_size=4,
                           attention_backend=TorchAttentionBackend)
    layer = factory.attention("model.layers.0.self_attn.attn", num_heads=HEADS,
                              num_kv_heads=KV_HEADS, head_size=DIM, scale=0.25, sinks=True)
    assert layer.impl.params.spec.has_sinks
    names = dict(layer.named_parameters())
    assert set(names) == {"sinks"} and names["sinks"].dtype == torch.float32
    layer.load_weight("sinks", SINKS.to(torch.bfloat16))
    # The implementation reads the tensor the model loaded into.
    assert torch.equal(layer.impl.params.sinks, SINKS)
    with pytest.raises(ValueError, match=r"expected the checkpoint's \[4\]"):
        layer.load_weight("sinks", torch.zeros(3))
    with pytest.raises(ValueError, match="loads only 'sinks'"):
        layer.load_weight("weight", SINKS)
    plain = factory.attention("plain", num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=DIM,
                              scale=0.25)
    assert plain.impl.params.sinks is None and not list(plain.parameters())
    with pytest.raises(ValueError, match="built with sinks=True"):
        plain.load_weight("sinks", SINKS)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_keeps_its_heads_of_the_sinks(rank: int) -> None:
    factory = LayerFactory(dtype=torch.float32, block_size=4,
                           attention_backend=TorchAttentionBackend,
                           tp=TensorParallelGroup(rank=rank, size=2))
    layer = factory.attention("attn", num_heads=HEADS // 2, num_kv_heads=1, head_size=DIM,
                              scale=0.25, sinks=True)
    layer.load_weight("sinks", SINKS)
    assert torch.equal(layer.impl.params.sinks, SINKS[2 * rank:2 * rank + 2])
