"""The measured attention-backend choice (``engine.core.kernel_choice.attention_selection``).

A third party's backend that is faster than the platform's default serves the model with
no priority or flag; one that raises or computes something else is left out, named with
its distribution; the decision is kept on disk and read back without timing; what is not
measured (small layers, another device) keeps the default; and the worker builds the
model with the measured backend.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import pytest
import torch

from engine.core.attention import TorchAttentionBackend
from engine.core.attention.torch_backend import TorchAttentionImpl
from engine.core.kernel_choice import attention_selection, store
from engine.core.kernel_choice.attention_selection import measured_attention_backend
from engine.core.platforms._builtin import CpuPlatform, CudaPlatform
from engine.core.plugins import PluginCatalog, PluginEntry
from engine.core.plugins._allowlist import Allowlist
from engine.core.plugins._local import plugin_reference
from engine.kernels.cpu.attention import CpuAttentionBackend
from engine.kernels.cpu.native import native_kernels
from engine.sdk.attention import AttentionSpec
from engine.sdk.groups import ATTENTION_BACKENDS

NATIVE = native_kernels()  # built before a test points ENGINE_CACHE_DIR elsewhere
pytestmark = pytest.mark.skipif(NATIVE is None, reason="the cpu backend needs the native "
                                "kernels (a C++ compiler)")
DIST = "acme-attention"
#: 8 x 64 query elements per token: the least that is measured.
SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype="float32",
                     kv_cache_dtype="float32", block_size=16)


class FastPaged(CpuAttentionBackend):
    """A third party's paged backend (the engine's C++ kernels under another name)."""

    name: ClassVar[str] = "fast_paged"


class _ZeroImpl(TorchAttentionImpl):
    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: Any,
                output: Any) -> Any:
        super().forward(query, key, value, kv_cache, metadata, output)
        output.zero_()
        return output


class WrongOutput(TorchAttentionBackend):
    """Fast to fail: it writes zeros where the attention goes."""

    name: ClassVar[str] = "wrong_output"

    @classmethod
    def get_impl_cls(cls) -> Any:
        return _ZeroImpl


class _RaisingImpl(TorchAttentionImpl):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("boom")


class Raises(TorchAttentionBackend):
    name: ClassVar[str] = "raises"

    @classmethod
    def get_impl_cls(cls) -> Any:
        return _RaisingImpl


def catalog(*backends: type) -> PluginCatalog:
    """The engine's ``torch`` backend and ``backends`` from a third party."""
    entries = [PluginEntry(ATTENTION_BACKENDS, "torch",
                           "engine.core.attention:TorchAttentionBackend", "engine-core", "1")]
    entries += [PluginEntry(ATTENTION_BACKENDS, b.name, plugin_reference(b), DIST, "1.0")
                for b in backends]
    return PluginCatalog(entries, Allowlist.from_env(None))


def choose(plugins: PluginCatalog, spec: AttentionSpec = SPEC, platform: Any = CpuPlatform,
           ) -> str:
    return measured_attention_backend(plugins, platform, spec, torch.float32, default="torch",
                                      step_tokens=128)


@pytest.mark.usefixtures("choice_cache")
def test_a_faster_third_party_backend_serves_and_the_choice_is_kept(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    plugins = catalog(FastPaged, WrongOutput, Raises)
    with caplog.at_level(logging.INFO):
        assert choose(plugins) == "fast_paged"
    left_out = {r.getMessage().split(" ")[2]: r.getMessage() for r in caplog.records
                if "left out" in r.getMessage()}
    assert set(left_out) == {"wrong_output", "raises"}
    assert f"({DIST} 1.0)" in left_out["raises"] and "ZeroDivisionError: boom" in (
        left_out["raises"])
    assert "differs from the first candidate's" in left_out["wrong_output"]
    (record,) = store.stored()
    assert record.key["what"] == "attention" and record.plan.names[0] == "fast_paged"
    assert [t.name for t in record.plan.timings] == ["torch", "fast_paged"]

    def no_timing(*args: Any) -> Any:
        raise AssertionError("measured again")

    monkeypatch.setattr(attention_selection, "time_backends", no_timing)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert choose(plugins) == "fast_paged"
    assert "kept in" in caplog.text


@pytest.mark.usefixtures("choice_cache")
def test_what_is_not_measured_keeps_the_platforms_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_timing(*args: Any) -> Any:
        raise AssertionError("measured")

    monkeypatch.setattr(attention_selection, "time_backends", no_timing)
    small = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype="float32",
                          kv_cache_dtype="float32", block_size=16)
    assert choose(catalog(FastPaged), small) == "torch"  # 256 < MIN_MEASURED_WIDTH
    assert choose(catalog(FastPaged), platform=CudaPlatform) == "torch"
    assert choose(catalog()) == "torch"  # nothing to choose between
    assert store.stored() == []


def test_the_worker_builds_the_model_with_the_measured_backend(
        tiny_llama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.core import LLM
    from engine.core.worker import model_setup

    asked: list[str] = []

    def measured(catalog: Any, platform: Any, spec: Any, dtype: Any, *, default: str,
                 **kwargs: Any) -> str:
        asked.append(default)
        return "torch"

    monkeypatch.setattr(model_setup, "measured_attention_backend", measured)
    with LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32, in_process=True,
             plugins="none") as llm:
        built = llm.llm_engine.core.worker.built
    assert asked == ["cpu"] and built.backend is TorchAttentionBackend
    asked.clear()
    with LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32, in_process=True,
             plugins="none", kernel_selection="priority") as llm:
        assert llm.llm_engine.core.worker.built.backend is CpuAttentionBackend
    assert asked == []
