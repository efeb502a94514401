"""The ``triton`` backend through the SDK: the conformance suite, and what it supports."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from engine.kernels import _triton
from engine.kernels.attention import TritonAttentionBackend
from engine.sdk.attention import AttentionSpec, CudaGraphSupport
from engine.sdk.platform import PlatformInfo
from engine.testing.contracts import check_attention_backend

CUDA = PlatformInfo(name="cuda", device_type="cuda", device_name="NVIDIA H100",
                    device_capability=(9, 0), supported_dtypes=("bfloat16", "float32"))
SPEC = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16",
                     kv_cache_dtype="bfloat16", block_size=16, platform=CUDA)


def test_the_backend_passes_the_attention_conformance_suite(device: str) -> None:
    report = check_attention_backend(TritonAttentionBackend, device=device)
    assert not report.skipped, report.skipped
    assert len(report.cases) == 4 and report.max_abs_error < 1e-4


def test_it_declares_uniform_batch_graphs() -> None:
    assert TritonAttentionBackend.cudagraph_support is CudaGraphSupport.UNIFORM_BATCH


@pytest.mark.parametrize(("change", "reason"), [
    ({"dtype": "float64", "kv_cache_dtype": "float64"},
     "dtype float64 not supported; supported: bfloat16, float16, float32"),
    ({"kv_cache_dtype": "float8_e4m3fn"},
     "kv_cache_dtype must equal dtype (bfloat16), got float8_e4m3fn (no quantized KV cache"),
    ({"is_causal": False}, "only causal (decoder) attention is supported"),
    ({"head_size": 512}, "head size 512 not supported; supported: up to 256"),
    ({"block_size": 2048}, "block size 2048 not supported; supported: up to 1024"),
    ({"platform": dataclasses.replace(CUDA, device_capability=(7, 5))},
     "bfloat16 needs compute capability >= 8.0, found 7.5"),
])
def test_supports_names_what_it_cannot_do(change: dict[str, object], reason: str) -> None:
    answer = TritonAttentionBackend.supports(dataclasses.replace(SPEC, **change))
    assert not answer.ok and answer.reason.startswith(reason)


def test_supports_cuda_and_float16_on_turing() -> None:
    assert TritonAttentionBackend.supports(SPEC)
    turing = dataclasses.replace(CUDA, device_capability=(7, 5))
    assert TritonAttentionBackend.supports(dataclasses.replace(
        SPEC, dtype="float16", kv_cache_dtype="float16", platform=turing))


def test_the_cpu_only_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = dataclasses.replace(SPEC, platform=PlatformInfo(name="cpu", device_type="cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonAttentionBackend.supports(cpu)
    monkeypatch.delenv("TRITON_INTERPRET")
    answer = TritonAttentionBackend.supports(cpu)
    assert not answer.ok and answer.reason == (
        "its Triton kernels run on CUDA devices, not cpu (on the CPU only through Triton's "
        "interpreter, TRITON_INTERPRET=1, for tests)")


def test_without_triton_it_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(_triton.importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else find_spec(name, *a))
    answer = TritonAttentionBackend.supports(SPEC)
    assert not answer.ok and answer.reason == (
        "triton is not installed (pip install 'engine-server[cuda]', or pip install triton)")
