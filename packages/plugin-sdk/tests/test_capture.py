"""``engine.sdk.capture``: every component's ``capture_support`` says no unless it declares.

The one exception is an attention implementation asked about CUDA graphs: its backend's
``cudagraph_support`` (SDK 1.0) is its declaration there, so the default defers to it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from engine.sdk import (
    AttentionImpl,
    AttentionImplParams,
    AttentionSpec,
    Capturable,
    CaptureContext,
    GraphKind,
    LinearKernel,
    LinearKernelConfig,
    ModelInterface,
    QuantizeMethod,
    Support,
)
from engine.sdk.capture import not_declared
from engine.sdk.ops import RMSNormOp

CPU = CaptureContext(kind=GraphKind.CPU_STEP_GRAPH, max_tokens=512)
CUDA = CaptureContext(kind=GraphKind.CUDA_GRAPHS, max_tokens=256, decode_only=True)


class Model(ModelInterface):
    def forward(self, input_ids: Any, positions: Any, attn_metadata: Any) -> Any: ...

    def compute_logits(self, hidden_states: Any) -> Any: ...

    def load_weights(self, weights: Any) -> set[str]:
        return set()


class Kernel(LinearKernel):
    name = "my_kernel"

    @classmethod
    def is_supported(cls, platform: Any) -> Support:
        return Support.yes()

    @classmethod
    def can_implement(cls, config: Any) -> Support:
        return Support.yes()

    def apply(self, layer: Any, x: Any, bias: Any = None) -> Any: ...


class Method(QuantizeMethod):
    def create_weights(self, layer: Any, info: Any) -> None: ...

    def apply(self, layer: Any, x: Any, bias: Any = None) -> Any: ...


class Impl(AttentionImpl[None]):
    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: Any,
                output: Any) -> Any: ...


def components() -> list[tuple[object, str]]:
    spec = AttentionSpec(num_heads=4, num_kv_heads=4, head_size=16, dtype="float32",
                         kv_cache_dtype="float32", block_size=16)
    return [
        (Model(), "the model Model"),
        (Kernel(LinearKernelConfig("unquantized", "float32", "float32", 8, 8)),
         "linear kernel 'my_kernel'"),
        (Method(), "quantization method Method"),
        (Impl(AttentionImplParams(spec=spec, layer_name="l", scale=0.25)),
         "attention implementation Impl"),
        (RMSNormOp(8, dispatch_key="cpu"), "custom op 'rms_norm' (RMSNormOp)"),
    ]


@pytest.mark.parametrize(("component", "what"), components())
def test_each_component_says_no_unless_it_declares(component: object, what: str) -> None:
    assert isinstance(component, Capturable)
    answer = component.capture_support(CPU)
    assert answer == Support.no(f"{what} does not declare that the CPU step graph can record "
                                f"it (its capture_support answers no unless overridden)")
    assert answer == not_declared(what, CPU)
    cuda = component.capture_support(CUDA)
    assert cuda.ok == isinstance(component, AttentionImpl), cuda  # cudagraph_support decides
    if not cuda.ok:
        assert "does not declare that CUDA graphs can record it" in cuda.reason


def test_a_declaration_is_per_instance_and_inherited() -> None:
    class Packed(Kernel):
        panels: torch.Tensor | None = None

        def capture_support(self, ctx: CaptureContext) -> Support:
            if self.panels is None:
                return Support.no("its weight is not packed")
            return Support.yes()

    class Subclass(Packed):
        pass

    config = LinearKernelConfig("unquantized", "float32", "float32", 8, 8)
    kernel = Subclass(config)
    assert not kernel.capture_support(CPU)
    kernel.panels = torch.zeros(1)
    assert kernel.capture_support(CPU)


def test_the_context_is_frozen_and_grows_only_with_defaults() -> None:
    ctx = CaptureContext(kind=GraphKind.CUDA_GRAPHS)
    assert (ctx.platform, ctx.max_tokens, ctx.decode_only) == (None, 0, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.max_tokens = 3  # type: ignore[misc]
    assert all(f.default is not dataclasses.MISSING for f in dataclasses.fields(ctx)
               if f.name != "kind")
    assert [kind.value for kind in GraphKind] == ["cpu_step_graph", "cuda_graphs"]
