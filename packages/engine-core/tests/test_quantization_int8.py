"""The built-in ``int8`` quantization: online W8A8 from a float checkpoint.

Kernels against each other and against float math; the method's weights and each
tensor-parallel rank's shard; the engine's teacher-forced prompt logprobs within
``LOGPROB_TOLERANCE`` of the unquantized engine's on the tiny checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.core import LLM
from engine.core.attention import TorchAttentionBackend
from engine.core.config import EngineConfig
from engine.core.distributed import TensorParallelGroup
from engine.core.model_executor.layers import LayerFactory
from engine.core.quantization.int8_kernels import (
    Int8IntMMKernel,
    Int8ReferenceKernel,
    quantize_tokens,
)
from engine.core.quantization.int8_method import Int8Config, quantize_per_channel
from engine.core.startup import prepare
from engine.sdk import SamplingParams, UnsupportedError, ValidationError
from engine.sdk.linear_kernel import LinearKernelConfig
from engine.sdk.platform import PlatformInfo

#: Teacher-forced log-probability of each prompt token, int8 W8A8 vs the float32 model, on
#: the tiny checkpoint (logprobs around -6.3): measured at most 0.043 (0.7%).
LOGPROB_TOLERANCE = 0.1


def int8_layer(rows: int, cols: int) -> tuple[torch.nn.Module, torch.Tensor]:
    weight = torch.randn(rows, cols)
    layer = torch.nn.Module()
    q, scale = quantize_per_channel(weight)
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    return layer, weight


def test_quantize_per_channel_and_per_token() -> None:
    weight = torch.randn(6, 40) * torch.arange(1, 7)[:, None]
    q, scale = quantize_per_channel(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert torch.equal(q.abs().amax(1), torch.full((6,), 127, dtype=torch.int8))
    torch.testing.assert_close(q.float() * scale[:, None], weight, atol=float(scale.max()) / 2,
                               rtol=0)
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    xq, x_scale = quantize_tokens(x)
    assert xq.dtype == torch.int8 and x_scale.shape == (3, 1)
    assert torch.equal(quantize_tokens(torch.zeros(2, 8))[0], torch.zeros(2, 8, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 33])
def test_int_mm_kernel_equals_reference_and_is_close_to_float(dtype: torch.dtype,
                                                              tokens: int) -> None:
    torch.manual_seed(0)
    layer, weight = int8_layer(48, 256)
    config = LinearKernelConfig(scheme="int8_w8a8", weight_dtype="int8",
                                act_dtype=str(dtype)[6:], input_size=256, output_size=48,
                                has_bias=True)
    assert Int8IntMMKernel.can_implement(config).ok and Int8ReferenceKernel.can_implement(config)
    x, bias = torch.randn(tokens, 256, dtype=dtype), torch.randn(48, dtype=dtype)
    x_before = x.clone()
    fast = Int8IntMMKernel(config).apply(layer, x, bias)
    reference = Int8ReferenceKernel(config).apply(layer, x, bias)
    assert torch.equal(x, x_before)  # the contract: apply does not modify its input
    assert fast.dtype == dtype and fast.shape == (tokens, 48)
    torch.testing.assert_close(fast, reference, rtol=0, atol=0)  # int32 sums, exact in fp32
    exact = F.linear(x.float(), weight, bias.float())
    assert float((fast.float() - exact).norm() / exact.norm()) < 0.02  # W8A8 error ~1%


def test_kernel_rejections() -> None:
    config = LinearKernelConfig(scheme="int8_w8a8", weight_dtype="int8", act_dtype="bfloat16",
                                input_size=8, output_size=8, group_size=128)
    assert "only per-channel" in Int8IntMMKernel.can_implement(config).reason
    assert "not int8_w8a8" in Int8IntMMKernel.can_implement(LinearKernelConfig(
        scheme="unquantized", weight_dtype="float32", act_dtype="float32", input_size=8,
        output_size=8)).reason
    assert "CPU only" in Int8IntMMKernel.is_supported(PlatformInfo("cuda", "cuda")).reason
    assert Int8ReferenceKernel.is_supported(PlatformInfo("cuda", "cuda")).ok


def test_config_settings_and_support() -> None:
    assert Int8Config.from_config({}).modules_to_not_convert == ()
    config = Int8Config.from_config({"quant_method": "int8",
                                     "modules_to_not_convert": ["down_proj"]})
    assert config.modules_to_not_convert == ("down_proj",)
    with pytest.raises(ValidationError, match="quantized with 'gptq'"):
        Int8Config.from_config({"quant_method": "gptq"})
    with pytest.raises(ValidationError, match="unknown int8 setting.s. bits"):
        Int8Config.from_config({"bits": 4})
    assert "found npu" in Int8Config.is_supported(PlatformInfo("npu", "npu")).reason


def test_column_and_row_shards_quantize_their_part() -> None:
    config = Int8Config.from_config({})
    weight = torch.randn(32, 64)
    outputs = []
    x = torch.randn(5, 64)
    for rank in range(2):
        factory = LayerFactory(dtype=torch.float32, block_size=4,
                               attention_backend=TorchAttentionBackend, quant_config=config,
                               tp=TensorParallelGroup(rank, 2))
        column = factory.linear("model.layers.0.mlp.up_proj", 64, (32,), parallel="column")
        column.load_weight("weight", weight, None)
        column.process_weights_after_loading()
        part = weight[rank * 16:(rank + 1) * 16]
        assert column.weight.dtype == torch.int8 and column.weight.shape == (16, 64)
        assert torch.equal(column.weight_scale.data, quantize_per_channel(part)[1])
        row = factory.linear("model.layers.0.mlp.down_proj", 64, (32,), parallel="row")
        row.load_weight("weight", weight, None)
        row.process_weights_after_loading()
        assert row.weight.shape == (32, 32)  # its half of the inputs, scaled by that half
        assert torch.equal(row.weight_scale.data,
                           quantize_per_channel(weight[:, rank * 32:(rank + 1) * 32])[1])
        outputs.append(row.quant_method.apply(row, x[:, rank * 32:(rank + 1) * 32]))
    exact = F.linear(x, weight)
    assert float((sum(outputs) - exact).norm() / exact.norm()) < 0.02  # the all-reduce's sum


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced log-probability of every prompt token after the first."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [torch.tensor([step[token].logprob for step, token in zip(
        o.prompt_logprobs[1:], prompt[1:], strict=True)]) for o, prompt in zip(
        outputs, prompts, strict=True)]


PROMPTS = [list(range(3, 40)), [7, 11, 13, 17, 19, 23, 29, 31] * 4]


def test_engine_logprobs_close_to_unquantized(tiny_llama: Path) -> None:
    kw: dict[str, Any] = {"dtype": "float32", "in_process": True, "num_kv_blocks": 64,
                          "plugins": "none"}
    with LLM(str(tiny_llama), **kw) as llm:
        want = prompt_logprobs(llm, PROMPTS)
    with LLM(str(tiny_llama), quantization="int8", **kw) as llm:
        got = prompt_logprobs(llm, PROMPTS)
        setup = llm.llm_engine.setup
        model = llm.llm_engine.core.worker.model
    assert setup.quantization is not None and setup.quantization.name == "int8"
    assert setup.quantization.origin == "--quantization"
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.dtype == torch.float32
    assert type(qkv.quant_method.kernel) is Int8IntMMKernel  # priority 100 on the CPU
    assert model.lm_head.weight.dtype == torch.float32  # the LM head stays unquantized
    for g, w in zip(got, want, strict=True):
        assert 1e-4 < float((g - w).abs().max()) < LOGPROB_TOLERANCE  # quantized, and close


def test_engine_checkpoint_settings_and_reference_kernel(tiny_llama: Path,
                                                         tmp_path: Path) -> None:
    import json
    import shutil

    checkpoint = shutil.copytree(tiny_llama, tmp_path / "int8")
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "int8",
                                     "modules_to_not_convert": ["mlp.down_proj"]}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with LLM(str(checkpoint), dtype="bfloat16", in_process=True, num_kv_blocks=64,
             plugins="none", disabled_kernels=["int8_int_mm"]) as llm:
        setup = llm.llm_engine.setup
        assert setup.quantization is not None
        assert setup.quantization.origin == "config.json quantization_config"
        layer = llm.llm_engine.core.worker.model.layers[1]
        assert layer.mlp.down_proj.weight.dtype == torch.bfloat16  # modules_to_not_convert
        assert type(layer.mlp.gate_up_proj.quant_method.kernel) is Int8ReferenceKernel
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                           SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_unsupported_dtype_is_refused_before_loading(tiny_llama: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Int8Config, "supported_act_dtypes", classmethod(lambda cls: ["bfloat16"]))
    with pytest.raises(UnsupportedError) as info:
        prepare(EngineConfig(model=str(tiny_llama), dtype="float32", quantization="int8",
                             plugins="none"))
    assert "quantization method 'int8' (from --quantization) cannot run on platform cpu" in str(
        info.value)
    assert info.value.reasons == (("int8", "activation dtype float32 is not supported; "
                                           "supported: bfloat16"),)
