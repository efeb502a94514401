"""The frozen SDK 1.0 plugins that build and run the model, in the workers.

Models, attention backends, linear kernels, custom ops and quantization methods of
``engine-test-plugin-sdk1``: each is reached when selected (through the engine, then
through its SDK contract directly) and untouched otherwise. See
``test_sdk1_distribution.py`` for what these tests prove and why the plugin is never
edited.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.sdk import (
    LayerInfo,
    LinearKernelConfig,
    PlatformInfo,
    PluginError,
    ValidationError,
)
from engine.sdk import groups as sdk_groups
from engine.sdk.ops import RMSNormOp
from engine.sdk.quantization import check_quantization_support
from engine.testing.engine import assert_kv_pool_full
from engine.testing.sdk1 import (
    counting,
    greedy,
    sdk1_catalog,
    sdk1_llm,
)

pytestmark = pytest.mark.filterwarnings("default::engine.sdk.deprecation.SDKDeprecationWarning")


def test_model_plugin_serves_its_architecture(tiny_llama: Path, sdk1: Path, tmp_path: Path,
                                              reference: list[list[int]]) -> None:
    checkpoint = tmp_path / "sdk1-llama"
    shutil.copytree(tiny_llama, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["architectures"] = ["Sdk1LlamaForCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with counting() as calls, sdk1_llm(checkpoint) as llm:
        model = llm.llm_engine.core.worker.built.model
        assert type(model).__name__ == "Sdk1LlamaForCausalLM"
        assert len(model.loaded_names) == 21  # every tensor of the checkpoint
        assert greedy(llm) == reference  # the same weights: the same tokens as built-in Llama
        assert_kv_pool_full(llm)
    assert calls["Sdk1LlamaForCausalLM.load_weights"] == 1
    assert calls["Sdk1LlamaForCausalLM.forward"] > 0
    with counting() as calls, sdk1_llm(tiny_llama) as llm:  # a checkpoint naming LlamaForCausalLM
        assert type(llm.llm_engine.core.worker.built.model).__name__ == "LlamaForCausalLM"
    assert calls["Sdk1LlamaForCausalLM.forward"] == 0
    with pytest.raises(PluginError, match="Sdk1LlamaForCausalLM"):  # only the plugin has it
        sdk1_llm(checkpoint, plugins="none")


def test_attention_backend(tiny_llama: Path, sdk1: Path, reference: list[list[int]]) -> None:
    with counting() as calls, sdk1_llm(tiny_llama, attention_backend="sdk1_paged", plugin_options={
            "sdk1_paged": {"upcast": False}}) as llm:
        assert greedy(llm) == reference
        worker = llm.llm_engine.core.worker
        assert worker.built.backend.name == "sdk1_paged"
        impls = [layer.impl for layer in worker.built.factory.attention_layers.values()]
        assert impls and all(impl.upcast is False for impl in impls)  # the option arrived
        assert_kv_pool_full(llm)
    assert calls["sdk1_paged.supports"] >= 1 and calls["sdk1_paged.build"] > 0
    assert calls["sdk1_paged.forward"] == 2 * calls["sdk1_paged.build"]  # 2 layers per step
    with counting() as calls, sdk1_llm(tiny_llama) as llm:  # allowed, not selected
        assert greedy(llm) == reference
        assert llm.llm_engine.core.worker.built.backend.name == "cpu"  # the platform default
    assert calls["sdk1_paged.forward"] == 0 and calls["sdk1_paged.build"] == 0


def test_a_1_0_attention_backend_is_refused_the_spec_fields_it_predates(sdk1: Path) -> None:
    """Its supports() never looks at logits_soft_cap or has_sinks (SDK 1.1): the engine's
    gate refuses them for it, naming the field, and asks it the rest as before."""
    from dataclasses import replace

    from engine_test_plugin_sdk1.attention import Sdk1PagedAttentionBackend as Backend

    from engine.sdk.attention import AttentionSpec, backend_supports

    assert Backend.answered_spec_fields == frozenset()
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, dtype="float32",
                         kv_cache_dtype="float32", block_size=32)
    assert backend_supports(Backend, spec)
    for field, value in (("logits_soft_cap", 50.0), ("has_sinks", True)):
        with_field = replace(spec, **{field: value})
        assert Backend.supports(with_field)  # what it would say, unseen
        answer = backend_supports(Backend, with_field)
        assert not answer and f"{field}={value!r} not supported" in answer.reason
        assert "answered_spec_fields" in answer.reason


def test_linear_kernel_only_when_forced(tiny_llama: Path, sdk1: Path,
                                        reference: list[list[int]]) -> None:
    with counting() as calls, sdk1_llm(tiny_llama, linear_kernel="sdk1_matmul") as llm:
        assert greedy(llm) == reference
        assert_kv_pool_full(llm)
    layers = calls["sdk1_matmul.process_weights_after_loading"]
    assert layers == 9  # 2 x (qkv, o, gate_up, down) + lm_head
    assert calls["sdk1_matmul.apply"] > 0 and calls["sdk1_matmul.apply"] % layers == 0
    with counting() as calls, sdk1_llm(tiny_llama) as llm:  # priority -10: never chosen unforced
        assert greedy(llm) == reference
    assert calls["sdk1_matmul.apply"] == 0
    kernel_cls = sdk1_catalog().load(sdk_groups.LINEAR_KERNELS, "sdk1_matmul")
    config = LinearKernelConfig(scheme="unquantized", weight_dtype="float32",
                                act_dtype="float32", input_size=8, output_size=5, has_bias=True)
    assert kernel_cls.can_implement(config).ok
    assert not kernel_cls.can_implement(LinearKernelConfig(
        scheme="int8_w8a8", weight_dtype="int8", act_dtype="float32", input_size=8,
        output_size=5)).ok
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(5, 8), requires_grad=False)
    kernel = kernel_cls(config)
    kernel.process_weights_after_loading(layer)
    x, bias = torch.randn(3, 8), torch.randn(5)
    torch.testing.assert_close(kernel.apply(layer, x, bias), F.linear(x, layer.weight, bias))


def _built_in(op: object) -> bool:
    """The engine's own rms_norm (its contract's subclass in engine-core), no replacement."""
    return isinstance(op, RMSNormOp) and type(op).__module__.startswith("engine.core.")


def _engines_own(op: object) -> bool:
    """The engine's rms_norm: engine-core's reference or engine-kernels' kernels."""
    return isinstance(op, RMSNormOp) and type(op).__module__.startswith(
        ("engine.core.", "engine.kernels."))


def test_custom_op_replaces_rms_norm_exactly(tiny_llama: Path, sdk1: Path,
                                             reference: list[list[int]]) -> None:
    with counting() as calls, sdk1_llm(tiny_llama) as llm:  # every allowed custom op is used
        assert greedy(llm) == reference
        model = llm.llm_engine.core.worker.built.model
        assert type(model.norm).__name__ == "Sdk1RMSNorm"
    assert calls["rms_norm.call"] > 0
    # Beside engine-kernels' rms_norm (no allowlist: every installed plugin allowed), as
    # SDK 1.0's docs registered it: the engine starts and the CPU path is sdk1's.
    with counting() as calls, sdk1_llm(tiny_llama, plugins=None) as llm:
        assert type(llm.llm_engine.core.worker.built.model.norm).__name__ == "Sdk1RMSNorm"
        assert greedy(llm) == reference
    assert calls["rms_norm.call"] > 0
    with counting() as calls, sdk1_llm(tiny_llama, plugins="none") as llm:
        assert _engines_own(llm.llm_engine.core.worker.built.model.norm)
        assert greedy(llm) == reference
    assert calls["rms_norm.call"] == 0
    op_cls = sdk1_catalog().load(sdk_groups.CUSTOM_OPS, "rms_norm")
    for dtype in (torch.float32, torch.bfloat16):
        reference_op, op = RMSNormOp(64, 1e-5, dtype=dtype), op_cls(64, 1e-5, dtype=dtype,
                                                                     dispatch_key="cpu")
        with torch.no_grad():
            for o in (reference_op, op):
                o.weight.copy_(torch.linspace(0.5, 1.5, 64))
        x, residual = torch.randn(4, 64, dtype=dtype), torch.randn(4, 64, dtype=dtype)
        x_copy, residual_copy = x.clone(), residual.clone()
        with counting() as calls:
            got_y, got_residual = op(x, residual)
            got_plain = op(x)
        assert calls["rms_norm.call"] == 2
        want_y, want_residual = reference_op(x.clone(), residual.clone())
        assert torch.equal(got_y, want_y) and torch.equal(got_residual, want_residual)
        assert torch.equal(got_plain, reference_op(x.clone()))
        assert torch.equal(x, x_copy) and torch.equal(residual, residual_copy)
    with counting() as calls:
        op_cls(64, dispatch_key="native")(torch.randn(2, 64))  # the inherited reference
    assert calls["rms_norm.call"] == 0


def test_custom_ops_flag_turns_the_replacement_off(tiny_llama: Path, sdk1: Path,
                                                   reference: list[list[int]]) -> None:
    for items in (("-rms_norm",), ("none",)):
        with counting() as calls, sdk1_llm(tiny_llama, custom_ops=items) as llm:
            assert _built_in(llm.llm_engine.core.worker.built.model.norm)
            assert greedy(llm) == reference
        assert calls["rms_norm.call"] == 0
    with counting() as calls, sdk1_llm(tiny_llama, custom_ops=("none", "+rms_norm")) as llm:
        assert type(llm.llm_engine.core.worker.built.model.norm).__name__ == "Sdk1RMSNorm"
        assert greedy(llm) == reference
    assert calls["rms_norm.call"] > 0


def test_quantization_through_the_engine(tiny_llama: Path, sdk1: Path, tmp_path: Path,
                                         reference: list[list[int]]) -> None:
    with counting() as calls, sdk1_llm(tiny_llama, quantization="sdk1_int8") as llm:
        got = greedy(llm)
        setup = llm.llm_engine.setup
        model = llm.llm_engine.core.worker.model
        assert setup.quantization is not None and setup.quantization.name == "sdk1_int8"
        qkv = model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.shape == (128,)
        assert model.lm_head.weight.dtype == torch.float32  # kind lm_head: left unquantized
        assert_kv_pool_full(llm)
    assert [t[:6] for t in got] == [t[:6] for t in reference]  # int8 rows: close, not equal
    layers = 8  # 2 x (qkv, o, gate_up, down)
    assert calls["sdk1_int8.from_config"] >= 1
    assert calls["sdk1_int8.create_weights"] == calls[
        "sdk1_int8.process_weights_after_loading"] == layers
    assert calls["sdk1_int8.apply"] > 0 and calls["sdk1_int8.apply"] % layers == 0
    # Selected by the checkpoint: config.json's quantization_config, then its own file.
    checkpoint = shutil.copytree(tiny_llama, tmp_path / "quantized")
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "sdk1_int8",
                                     "modules_to_not_convert": ["o_proj"]}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with counting() as calls, sdk1_llm(checkpoint) as llm:
        layer = llm.llm_engine.core.worker.model.layers[1]
        assert layer.self_attn.o_proj.weight.dtype == torch.float32  # its setting arrived
        assert layer.mlp.down_proj.weight.dtype == torch.int8
    assert calls["sdk1_int8.create_weights"] == layers - 2
    del config["quantization_config"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    (checkpoint / "sdk1_quant.json").write_text(json.dumps({"quant_method": "sdk1_int8"}))
    with counting() as calls, sdk1_llm(checkpoint) as llm:
        assert llm.llm_engine.setup.quantization.origin == "sdk1_quant.json"  # type: ignore[union-attr]
    assert calls["sdk1_int8.create_weights"] == layers
    with counting() as calls, sdk1_llm(tiny_llama) as llm:  # allowed, not selected
        assert llm.llm_engine.setup.quantization is None
        assert greedy(llm) == reference
    assert not any(key.startswith("sdk1_int8.") for key in calls)


def test_quantization_stores_int8_and_applies(sdk1: Path) -> None:
    from engine.core.attention import TorchAttentionBackend
    from engine.core.model_executor.layers import LayerFactory

    cls = sdk1_catalog().load(sdk_groups.QUANTIZATION, "sdk1_int8")
    assert check_quantization_support(cls, PlatformInfo("cpu", "cpu"), "float32").ok
    no_dtype = check_quantization_support(cls, PlatformInfo("cpu", "cpu"), "float16")
    assert not no_dtype.ok and "float32, bfloat16" in no_dtype.reason
    assert "found npu" in check_quantization_support(cls, PlatformInfo("npu", "npu"),
                                                     "float32").reason
    with pytest.raises(ValidationError) as info:
        cls.from_config({"modules_to_not_convert": "o_proj"})
    assert info.value.param == "modules_to_not_convert"
    config = cls.from_config({"quant_method": "sdk1_int8", "modules_to_not_convert": ["o_proj"]})
    embedding = LayerInfo(prefix="model.embed_tokens", kind="embedding", input_size=512,
                          output_size=64, input_size_per_partition=512,
                          output_partition_sizes=(64,), params_dtype="float32")
    assert config.get_quant_method(embedding, embedding.prefix) is None
    factory = LayerFactory(dtype=torch.float32, block_size=16,
                           attention_backend=TorchAttentionBackend, quant_config=config)
    skipped = factory.linear("model.layers.0.self_attn.o_proj", 64, (64,))
    assert skipped.weight.dtype == torch.float32  # modules_to_not_convert
    layer = factory.linear("model.layers.0.self_attn.qkv_proj", 64, (64, 32, 32), bias=True)
    torch.manual_seed(0)
    shards = [torch.randn(n, 64) for n in (64, 32, 32)]
    for shard, tensor in enumerate(shards):
        layer.load_weight("weight", tensor, shard)
    bias = torch.randn(128)
    layer.load_weight("bias", bias, None)
    layer.process_weights_after_loading()
    assert layer.weight.dtype == torch.int8 and tuple(layer.weight.shape) == (128, 64)
    assert layer.weight_scale.dtype == torch.float32 and tuple(layer.weight_scale.shape) == (128,)
    weight = torch.cat(shards)
    scale = weight.abs().amax(1) / 127
    dequantized = torch.round(weight / scale[:, None]).clamp(-127, 127) * scale[:, None]
    x = torch.randn(5, 64)
    out = layer(x)
    torch.testing.assert_close(out, F.linear(x, dequantized, bias))
    exact = F.linear(x, weight, bias)  # int8 with per-row scales: within ~1% of it
    assert float((out - exact).norm() / exact.norm()) < 0.02
