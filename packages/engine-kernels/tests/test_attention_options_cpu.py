"""The ``cpu`` backend's attention options: the logit soft cap and sinks in the C++ kernel."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.attention.backend import TritonAttentionBackend
from engine.kernels.cpu.attention import CpuAttentionBackend
from engine.sdk.attention import AttentionSpec, backend_supports
from engine.testing.attention_batches import EQUAL_DECODES, MIXED, check_step, run_step


def spec_of(dtype: str = "float32", head_size: int = 64, **options: object) -> AttentionSpec:
    return AttentionSpec(num_heads=4, num_kv_heads=2, head_size=head_size, dtype=dtype,
                         kv_cache_dtype=dtype, block_size=4, **options)  # type: ignore[arg-type]


# head size 64: the vector kernel; 8: the scalar one.
@pytest.mark.parametrize("head_size", [8, 64])
@pytest.mark.parametrize("reqs", [MIXED, EQUAL_DECODES], ids=["mixed", "equal_decodes"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_cpu_backend_caps_the_scores(head_size, reqs, window, dtype, tol) -> None:
    cap, scale = 2.0, 3 * head_size ** -0.5
    spec = spec_of(dtype, head_size, sliding_window=window, logits_soft_cap=cap)
    assert backend_supports(CpuAttentionBackend, spec)
    result = run_step(CpuAttentionBackend, spec, scale, reqs=reqs)
    check_step(result, scale, window=window, soft_cap=cap, tol=tol)


SINKS = torch.tensor([3.0, -1.0, 0.5, 6.0])


@pytest.mark.parametrize("head_size", [8, 64])
@pytest.mark.parametrize("reqs", [MIXED, EQUAL_DECODES], ids=["mixed", "equal_decodes"])
@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_cpu_backend_adds_the_sinks_to_the_softmax(head_size, reqs, cap, dtype, tol) -> None:
    scale = head_size ** -0.5
    spec = spec_of(dtype, head_size, sliding_window=5, logits_soft_cap=cap, has_sinks=True)
    assert backend_supports(CpuAttentionBackend, spec)
    result = run_step(CpuAttentionBackend, spec, scale, reqs=reqs,
                      params={"sinks": SINKS.clone()})
    check_step(result, scale, window=5, soft_cap=cap, sinks=SINKS, tol=tol)


def test_triton_backend_refuses_the_cap_and_sinks_with_a_reason() -> None:
    answer = TritonAttentionBackend.supports(spec_of(logits_soft_cap=50.0))
    assert not answer
    assert "logits_soft_cap=50.0 not supported" in answer.reason
    answer = TritonAttentionBackend.supports(spec_of(has_sinks=True))
    assert not answer
    assert "attention sinks not supported" in answer.reason
