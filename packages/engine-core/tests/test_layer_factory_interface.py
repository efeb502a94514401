"""The engine's layer factory implements the SDK's ``engine.sdk.layers.LayerFactory``.

The SDK protocol is what a model plugin may call on ``ctx.layers``; these tests keep it
and engine-core's factory the same interface: the same methods with the same parameters
and defaults, results that satisfy the SDK's layer protocols, the documented errors, and
the factory a real engine hands its model. (mypy checks the same statically where
``worker.model_setup`` builds the ``ModelContext``.)
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import engine.sdk
from engine.core import LLM
from engine.core.attention import TorchAttentionBackend
from engine.core.distributed import TensorParallelGroup
from engine.core.model_executor.layers import LayerFactory as EngineLayerFactory
from engine.sdk.layers import (
    AttentionLayer,
    EmbeddingLayer,
    FusedMoELayer,
    LayerFactory,
    LinearLayer,
)
from engine.sdk.ops import (
    FusedMoEOp,
    GeluAndMulOp,
    RMSNormOp,
    RotaryEmbeddingOp,
    SiluAndMulOp,
)

#: Public members of the engine's factory that are not part of the SDK interface (the
#: engine's own wiring); a new public method must join the SDK protocol or this list.
ENGINE_ONLY = {"attention_backend", "attention_layers", "backend_options", "block_size",
               "dispatch_key", "dtype", "dtype_name", "fallback_backend",
               "linear_kernel_selector", "max_model_len", "op_classes", "quant_config", "tp"}


def members(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")} | {
        n for n in getattr(cls, "__dataclass_fields__", {}) if not n.startswith("_")}


def protocol_members() -> set[str]:
    return {n for n in LayerFactory.__dict__ if not n.startswith("_")}


@pytest.fixture
def factory() -> EngineLayerFactory:
    return EngineLayerFactory(dtype=torch.float32, block_size=4,
                              attention_backend=TorchAttentionBackend)


def test_it_is_exported_from_engine_sdk() -> None:
    assert engine.sdk.LayerFactory is LayerFactory
    assert {"LayerFactory", "LinearLayer", "EmbeddingLayer", "AttentionLayer",
            "FusedMoELayer"} <= set(engine.sdk.__all__)


def test_the_engines_factory_is_a_layer_factory(factory: EngineLayerFactory) -> None:
    assert isinstance(factory, LayerFactory)
    assert protocol_members() == {"linear", "embedding", "attention", "rms_norm",
                                  "rotary_embedding", "silu_and_mul", "gelu_and_mul", "fused_moe",
                                  "tp_rank", "tp_size"}
    assert members(EngineLayerFactory) - protocol_members() == ENGINE_ONLY


@pytest.mark.parametrize("name", ["linear", "embedding", "attention", "rms_norm",
                                  "rotary_embedding", "silu_and_mul", "gelu_and_mul",
                                  "fused_moe"])
def test_the_protocol_documents_the_real_parameter_lists(name: str) -> None:
    sdk = inspect.signature(getattr(LayerFactory, name)).parameters
    real = inspect.signature(getattr(EngineLayerFactory, name)).parameters
    assert [(p.name, p.kind, p.default) for p in sdk.values()] == [
        (p.name, p.kind, p.default) for p in real.values()]
    doc = inspect.getdoc(getattr(LayerFactory, name)) or ""
    assert ".. versionadded:: 1.1" in doc and "Returns:" in doc
    for parameter in list(sdk)[1:]:
        assert f"{parameter}:" in doc, f"{name}: {parameter} is not documented"


def test_what_it_builds_satisfies_the_sdk_protocols(factory: EngineLayerFactory) -> None:
    qkv = factory.linear("l.qkv_proj", 16, (16, 8, 8), bias=True, parallel="column",
                         head_size=4)
    assert isinstance(qkv, LinearLayer) and isinstance(qkv, torch.nn.Module)
    assert qkv.output_partition_sizes == (16, 8, 8)
    assert qkv(torch.ones(3, 16)).shape == (3, 32)
    embedding = factory.embedding("embed", 32, 16)
    assert isinstance(embedding, EmbeddingLayer) and embedding.weight.shape == (32, 16)
    assert embedding(torch.tensor([1, 2])).shape == (2, 16)
    attention = factory.attention("l.attn", num_heads=4, num_kv_heads=2, head_size=4,
                                  scale=0.5)
    assert isinstance(attention, AttentionLayer)
    assert isinstance(factory.rms_norm(16, 1e-6), RMSNormOp)
    assert isinstance(factory.silu_and_mul(), SiluAndMulOp)
    gelu = factory.gelu_and_mul("tanh")
    assert isinstance(gelu, GeluAndMulOp) and gelu.approximate == "tanh"
    assert gelu(torch.ones(3, 8)).shape == (3, 4)
    assert factory.gelu_and_mul().approximate == "none"
    with pytest.raises(ValueError, match="allowed: 'none', 'tanh'"):
        factory.gelu_and_mul("erf")  # type: ignore[arg-type]
    assert (factory.tp_rank, factory.tp_size) == (0, 1)
    moe = factory.fused_moe("l.experts", 4, 2, 16, 8)
    assert isinstance(moe, FusedMoELayer) and isinstance(moe.op, FusedMoEOp)
    assert moe(torch.ones(3, 16), torch.ones(3, 4)).shape == (3, 16)


def test_fused_moe_loads_each_ranks_share_of_every_expert() -> None:
    """Rank 1 of 2: rows 4..8 of w1 and w3 (gate and up), columns 4..8 of w2."""
    torch.manual_seed(0)
    w1, w3, w2 = torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 8)
    for names in (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")):
        factory = EngineLayerFactory(dtype=torch.float32, block_size=4,
                                     attention_backend=TorchAttentionBackend,
                                     tp=TensorParallelGroup(rank=1, size=2))
        moe = factory.fused_moe("l.experts", 4, 2, 16, 8, renormalize=False)
        assert moe.op.w13.shape == (4, 8, 16) and moe.op.w2.shape == (4, 16, 4)
        assert moe.op.renormalize is False
        for name, tensor in zip(names, (w1, w3, w2), strict=True):
            moe.load_weight(f"3.{name}.weight", tensor, None)
        assert torch.equal(moe.op.w13[3], torch.cat((w1[4:], w3[4:])))
        assert torch.equal(moe.op.w2[3], w2[:, 4:])
        assert not moe.op.w13[:3].any()
    with pytest.raises(ValueError, match=r"shape \(8, 15\), the model expects \(8, 16\)"):
        moe.load_weight("0.w1.weight", torch.zeros(8, 15), None)
    with pytest.raises(ValueError, match="expert 4 of 4"):
        moe.load_weight("4.w1.weight", w1, None)
    with pytest.raises(ValueError, match="a fused MoE layer takes"):
        moe.load_weight("0.w4.weight", w1, None)
    with pytest.raises(ValueError, match="cannot be split evenly"):
        factory.fused_moe("l.experts", 4, 2, 16, 7)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
     "long_factor": [2.0] * 4, "original_max_position_embeddings": 16},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
])
def test_rotary_embedding_takes_the_documented_rope_settings(
        factory: EngineLayerFactory, rope: dict[str, object]) -> None:
    op = factory.rotary_embedding(8, 8, 64, rope)
    assert isinstance(op, RotaryEmbeddingOp) and op.cos_sin_cache.shape == (64, 8)
    q, k = op(torch.arange(3), torch.ones(3, 2, 8), torch.ones(3, 1, 8))
    assert q.shape == (3, 2, 8) and k.shape == (3, 1, 8)


def test_rotary_embedding_raises_what_it_documents(factory: EngineLayerFactory) -> None:
    with pytest.raises(ValueError, match="rope_type 'mrope' is not supported; supported: "
                                         "default, linear, llama3, yarn, longrope, dynamic"):
        factory.rotary_embedding(8, 8, 64, {"rope_type": "mrope", "rope_theta": 1e4})
    with pytest.raises(KeyError, match="rope_type 'linear' needs 'factor'"):
        factory.rotary_embedding(8, 8, 64, {"rope_type": "linear", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        factory.rotary_embedding(8, 7, 64, {"rope_type": "default", "rope_theta": 1e4})


def test_linear_raises_what_it_documents(factory: EngineLayerFactory) -> None:
    with pytest.raises(ValueError, match="an lm_head has one output"):
        factory.linear("head", 16, (8, 8), kind="lm_head", parallel="column")
    with pytest.raises(ValueError, match="not whole heads of 4"):
        factory.linear("qkv", 16, (18,), parallel="column", head_size=4)


def test_a_real_engine_hands_its_model_a_layer_factory(tiny_llama: Path) -> None:
    with LLM(str(tiny_llama), dtype="float32", in_process=True, num_kv_blocks=16,
             plugins="none") as llm:
        built = llm.llm_engine.core.worker.built
        assert isinstance(built.factory, LayerFactory)
        assert isinstance(built.model.lm_head, LinearLayer)
        assert isinstance(built.model.embed_tokens, EmbeddingLayer)
