"""Built-in linear kernels: results equal F.linear; selection honours priority and flags."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.core import LLM, SamplingParams
from engine.core.model_executor.layers.linear import UnquantizedLinearMethod
from engine.core.model_executor.linear_kernels import OneDNNLinearKernel, TorchLinearKernel
from engine.sdk import ValidationError
from engine.sdk.linear_kernel import LinearKernelConfig


def config(dtype: str = "float32", bias: bool = True) -> LinearKernelConfig:
    return LinearKernelConfig(scheme="unquantized", weight_dtype=dtype, act_dtype=dtype,
                              input_size=48, output_size=80, has_bias=bias)


@pytest.mark.parametrize("rows", [1, 7, 64])  # one decode token, a few, a batch
@pytest.mark.parametrize("kernel_cls", [TorchLinearKernel, OneDNNLinearKernel])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_f_linear(kernel_cls, rows: int, dtype: torch.dtype) -> None:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(80, 48, dtype=dtype), requires_grad=False)
    kernel = kernel_cls(config(str(dtype).removeprefix("torch.")))
    kernel.process_weights_after_loading(layer)
    x, bias = torch.randn(rows, 48, dtype=dtype), torch.randn(80, dtype=dtype)
    # 3-D input (batch, tokens, features) and a non-contiguous one give the same rows.
    for given in (x, x.view(1, rows, 48), torch.randn(48, rows, dtype=dtype).t()):
        torch.testing.assert_close(kernel.apply(layer, given, bias),
                                   torch.nn.functional.linear(given, layer.weight, bias))


def test_onednn_claims_float32_and_bfloat16_only() -> None:
    assert OneDNNLinearKernel.can_implement(config()).ok
    assert OneDNNLinearKernel.can_implement(config("bfloat16")).ok
    assert "float16" in OneDNNLinearKernel.can_implement(config("float16")).reason


def kernels_of(llm: LLM) -> set[str]:
    model = llm.llm_engine.core.worker.built.model
    return {type(m.quant_method.kernel).__name__ for m in model.modules()
            if isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod)}


def test_selection_priority_forced_and_disabled(tiny_llama: Path) -> None:
    common = {"dtype": "float32", "num_kv_blocks": 128, "in_process": True}
    assert kernels_of(LLM(str(tiny_llama), **common)) == {"OneDNNLinearKernel"}
    forced = LLM(str(tiny_llama), linear_kernel="torch", **common)
    assert kernels_of(forced) == {"TorchLinearKernel"}
    disabled = LLM(str(tiny_llama), disabled_kernels=("onednn",), **common)
    assert kernels_of(disabled) == {"TorchLinearKernel"}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [4, 8, 15, 16, 23, 42]}
    assert (forced.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            == disabled.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
    with pytest.raises(ValidationError, match="nope"):
        LLM(str(tiny_llama), linear_kernel="nope", **common)
