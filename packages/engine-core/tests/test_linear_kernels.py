"""Built-in linear kernels: results equal F.linear; selection honours priority and flags."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.core import LLM, SamplingParams
from engine.core.model_executor.layers.linear import UnquantizedLinearMethod
from engine.core.model_executor.linear_kernels import TorchLinearKernel
from engine.kernels.cpu import linear as linear_kernels
from engine.kernels.cpu.linear import CpuLinearKernel, OneDNNLinearKernel, onednn_has_bfloat16
from engine.kernels.cpu.native import native_kernels
from engine.kernels.cpu.native.library import SMALL_MATMUL_ROWS, NativeKernels
from engine.sdk import ValidationError
from engine.sdk.linear_kernel import LinearKernelConfig
from engine.sdk.platform import PlatformInfo


def config(dtype: str = "float32", bias: bool = True) -> LinearKernelConfig:
    return LinearKernelConfig(scheme="unquantized", weight_dtype=dtype, act_dtype=dtype,
                              input_size=48, output_size=80, has_bias=bias)


NATIVE = native_kernels()
BUILT = frozenset() if NATIVE is None else NATIVE.small_matmul_dtypes
needs_small_matmul = pytest.mark.skipif(
    not BUILT, reason="the small-batch kernel is built for float32 with AVX-512 or AVX2 and FMA")
DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(
    dtype not in BUILT, reason=f"no small-batch {dtype} kernel on this CPU (bfloat16 needs "
    "avx512_bf16)")) for dtype in (torch.float32, torch.bfloat16)]
#: The dtype the tests of the kernel's behaviour (not its sums) use: bfloat16 where built.
DTYPE = torch.bfloat16 if torch.bfloat16 in BUILT else torch.float32


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 64])  # decode rows (small-batch path), a batch
@pytest.mark.parametrize("kernel_cls", [TorchLinearKernel, OneDNNLinearKernel, CpuLinearKernel])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_f_linear(kernel_cls, rows: int, dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    if not kernel_cls.can_implement(config(name)).ok or not kernel_cls.is_supported(
            PlatformInfo("cpu", "cpu")).ok:
        pytest.skip(f"{kernel_cls.name} has no {name} product on this CPU")
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(80, 48, dtype=dtype), requires_grad=False)
    kernel = kernel_cls(config(str(dtype).removeprefix("torch.")))
    kernel.process_weights_after_loading(layer)
    x, bias = torch.randn(rows, 48, dtype=dtype), torch.randn(80, dtype=dtype)
    # 3-D input (batch, tokens, features) and a non-contiguous one give the same rows.
    for given in (x, x.view(1, rows, 48), torch.randn(48, rows, dtype=dtype).t()):
        torch.testing.assert_close(kernel.apply(layer, given, bias),
                                   torch.nn.functional.linear(given, layer.weight, bias))


@needs_small_matmul
def test_cpu_kernel_runs_its_own_code_for_up_to_three_rows(monkeypatch) -> None:
    calls: list[int] = []
    original = NativeKernels.matmul

    def counted(self, x, *args):
        calls.append(x.shape[0])
        original(self, x, *args)

    monkeypatch.setattr(NativeKernels, "matmul", counted)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(80, 48, dtype=DTYPE), requires_grad=False)
    kernel = CpuLinearKernel(config(str(DTYPE).removeprefix("torch.")))
    kernel.process_weights_after_loading(layer)
    # More rows: the packed product where it is built (AVX-512), else oneDNN's copy.
    assert NATIVE is not None
    packs = DTYPE in NATIVE.packed_matmul_dtypes
    assert (kernel.panels is not None, kernel.packed is not None) == (packs, not packs)
    for rows in (1, SMALL_MATMUL_ROWS, SMALL_MATMUL_ROWS + 1, 64):
        kernel.apply(layer, torch.randn(rows, 48, dtype=DTYPE))
    # Which C loop runs is test_packed_matmul's; without panels 4+ rows go to oneDNN.
    assert calls == [1, SMALL_MATMUL_ROWS, *((SMALL_MATMUL_ROWS + 1, 64) if packs else ())]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [768, 100, 33])  # whole two-register steps, then the masked tail
def test_small_matmul_against_float64(dtype: torch.dtype, k: int) -> None:
    assert NATIVE is not None
    gen = torch.Generator().manual_seed(k)
    weight = torch.randn(100, k, generator=gen).to(dtype)
    bias = torch.randn(100, generator=gen).to(dtype)
    for rows in range(1, SMALL_MATMUL_ROWS + 1):
        x = torch.randn(rows, k + 5, generator=gen).to(dtype)[:, :k]  # rows k + 5 apart
        whole = torch.full((rows, 120), 7.0, dtype=dtype)
        out = whole[:, :100]
        for b in (bias, None):
            NATIVE.small_matmul(x, weight, b, out)
            want = x.double() @ weight.double().T + (0 if b is None else b.double())
            # float32 sums in another order; bfloat16 rounds the result (2 ** -8 relative).
            tol = 1e-5 if dtype == torch.float32 else 2 ** -8
            assert ((out.double() - want).abs() <= tol * want.abs().max()).all()
        assert (whole[:, 100:] == 7).all()  # nothing written past the row's end


@needs_small_matmul
def test_small_matmul_refuses_what_it_would_misread() -> None:
    assert NATIVE is not None
    weight = torch.randn(16, 32, dtype=DTYPE)
    with pytest.raises(ValueError, match="supported: 1..3"):
        NATIVE.small_matmul(torch.randn(4, 32, dtype=DTYPE), weight, None,
                            torch.empty(4, 16, dtype=DTYPE))
    with pytest.raises(ValueError, match="float16 not supported"):
        NATIVE.small_matmul(torch.randn(1, 32).half(), weight.half(), None,
                            torch.empty(1, 16).half())
    with pytest.raises(ValueError, match="contiguous"):
        NATIVE.small_matmul(torch.randn(1, 16, dtype=DTYPE), weight.t(), None,
                            torch.empty(1, 32, dtype=DTYPE))


def test_cpu_kernel_steps_aside_where_it_has_no_code(monkeypatch) -> None:
    if NATIVE is not None:
        monkeypatch.setattr(NATIVE, "small_matmul_dtypes", frozenset({torch.float32}))
        answer = CpuLinearKernel.can_implement(config("bfloat16"))
        assert not answer.ok and "avx512_bf16" in answer.reason
        assert CpuLinearKernel.can_implement(config("float32")).ok
    monkeypatch.setattr(linear_kernels, "native_kernels", lambda: None)  # no compiler
    answer = CpuLinearKernel.is_supported(PlatformInfo("cpu", "cpu"))
    assert not answer.ok and "onednn serves instead" in answer.reason
    assert "the CPU only" in CpuLinearKernel.is_supported(PlatformInfo("cuda", "cuda")).reason


def test_onednn_claims_float32_and_bfloat16_only(monkeypatch) -> None:
    assert OneDNNLinearKernel.can_implement(config()).ok
    assert OneDNNLinearKernel.can_implement(config("bfloat16")).ok == onednn_has_bfloat16()
    assert "float16" in OneDNNLinearKernel.can_implement(config("float16")).reason
    # A CPU where oneDNN has no bfloat16 matmul (AVX2 only): refused with the reason, where
    # taking it would fail at load in torch's reorder.
    monkeypatch.setattr(linear_kernels, "onednn_has_bfloat16", lambda: False)
    answer = OneDNNLinearKernel.can_implement(config("bfloat16"))
    assert not answer.ok and "avx512bw" in answer.reason and "float32" in answer.reason
    assert OneDNNLinearKernel.can_implement(config()).ok


def kernels_of(llm: LLM) -> set[str]:
    model = llm.llm_engine.core.worker.built.model
    return {type(m.quant_method.kernel).__name__ for m in model.modules()
            if isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod)}


def test_selection_priority_forced_and_disabled(tiny_llama: Path) -> None:
    common = {"dtype": "float32", "num_kv_blocks": 128, "in_process": True}
    default = "CpuLinearKernel" if NATIVE is not None else "OneDNNLinearKernel"
    assert kernels_of(LLM(str(tiny_llama), **common)) == {default}
    forced = LLM(str(tiny_llama), linear_kernel="torch", **common)
    assert kernels_of(forced) == {"TorchLinearKernel"}
    assert kernels_of(LLM(str(tiny_llama), linear_kernel="onednn", **common)) == {
        "OneDNNLinearKernel"}
    disabled = LLM(str(tiny_llama), disabled_kernels=("cpu", "onednn"), **common)
    assert kernels_of(disabled) == {"TorchLinearKernel"}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [4, 8, 15, 16, 23, 42]}
    assert (forced.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            == disabled.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
    with pytest.raises(ValidationError, match="nope"):
        LLM(str(tiny_llama), linear_kernel="nope", **common)
