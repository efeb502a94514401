"""rms_norm: matches the contract's reference, coexists with engine-kernels', and is chosen
on the CPU unless the operator picks another implementation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from acme_engine_plugins.ops import AcmeRMSNorm

from engine.sdk.ops import RMSNormOp

OURS = "acme_engine_plugins.ops:AcmeRMSNorm"
BUILT_IN = "engine.core.model_executor.layers.builtin_ops:RMSNorm"  # docs/plugins/custom-ops.md


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_the_reference(dtype: torch.dtype, with_residual: bool) -> None:
    torch.manual_seed(0)
    reference = RMSNormOp(256, eps=1e-5, dtype=dtype)
    candidate = AcmeRMSNorm(256, eps=1e-5, dtype=dtype, dispatch_key="cpu")
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        candidate.weight.copy_(reference.weight)
    x, residual = torch.randn(8, 256, dtype=dtype), torch.randn(8, 256, dtype=dtype)
    args = (x, residual) if with_residual else (x,)
    expected = reference(*(a.clone() for a in args))
    got = candidate(*(a.clone() for a in args))
    for e, g in zip(expected if with_residual else (expected,),
                    got if with_residual else (got,), strict=True):
        torch.testing.assert_close(g, e)


def ops_in_use(llm: Any) -> dict[str, list[str]]:
    """The classes each custom op of the model was built from (through acme_inspect)."""
    [answer] = llm.collective_rpc("acme_ops")
    ops: dict[str, list[str]] = answer["ops"]
    return ops


@pytest.mark.parametrize(("custom_ops", "expected"), [
    (None, OURS),  # the default rule: a third party's CPU path at equal priority
    (["+rms_norm=acme-engine-plugins"], OURS),
    (["-rms_norm"], BUILT_IN),
    (["+rms_norm=engine-core"], BUILT_IN),
    (["+rms_norm=engine-kernels"], "engine.kernels.ops:RMSNorm"),  # its C++ path
])
def test_the_operator_chooses_and_tokens_do_not_change(
    tiny_qwen3: Path, make_llm: Callable[..., Any], spy: Callable[..., Any],
    greedy: Callable[..., Any], prompts: list[list[int]], custom_ops: list[str] | None,
    expected: str, qwen3_tokens: list[list[int]],
) -> None:
    calls = spy(AcmeRMSNorm, "forward_cpu")
    kwargs: dict[str, Any] = {} if custom_ops is None else {"custom_ops": custom_ops}
    with make_llm(tiny_qwen3, worker_extensions=["acme_inspect"], **kwargs) as llm:
        [used] = ops_in_use(llm)["rms_norm"]
        # engine.kernels.ops re-exports its classes: compare module packages and names
        assert used.startswith(expected.partition(".")[0])
        assert used.rpartition(":")[2] == expected.rpartition(":")[2]
        assert greedy(llm, prompts) == qwen3_tokens
    assert (calls["forward_cpu"] > 0) == (expected == OURS)
