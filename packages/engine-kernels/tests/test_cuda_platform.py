"""engine-core's CUDA platform: never chosen on a CPU host; ``triton`` as its default backend."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest
import torch

from engine.core.platforms import CpuPlatform, CudaPlatform, detect_cuda, select_platform
from engine.core.plugins import Allowlist, PluginCatalog, PluginEntry, set_catalog
from engine.core.plugins import _catalog as catalog_module
from engine.sdk.attention import AttentionSpec
from engine.sdk.groups import ATTENTION_BACKENDS

SPEC = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16",
                     kv_cache_dtype="bfloat16", block_size=16)
ENTRIES = {
    "torch": PluginEntry(ATTENTION_BACKENDS, "torch", "engine.core.attention:"
                         "TorchAttentionBackend", "engine-core", "0.1.0"),
    "triton": PluginEntry(ATTENTION_BACKENDS, "triton", "engine.kernels.attention:"
                          "TritonAttentionBackend", "engine-kernels", "0.1.0"),
}


@pytest.fixture
def catalog_of() -> Iterator[object]:
    """``catalog_of(names, plugins=None)``: make the process catalog hold these backends."""
    before = catalog_module._catalog

    def make(names: tuple[str, ...], plugins: str | None = None) -> None:
        set_catalog(PluginCatalog([ENTRIES[n] for n in names], Allowlist.parse(plugins)))

    yield make
    set_catalog(before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without a GPU")
def test_it_never_claims_a_cpu_host() -> None:
    assert detect_cuda() is None
    assert select_platform(PluginCatalog.discover(Allowlist.parse(None))) is CpuPlatform
    answer = CudaPlatform.is_available()
    assert not answer.ok and ("CPU build" in answer.reason or "no NVIDIA GPU" in answer.reason)
    assert CudaPlatform.device_count() == 0
    for query in (CudaPlatform.get_device_name, CudaPlatform.get_device_capability,
                  CudaPlatform.get_device_total_memory, CudaPlatform.get_device_free_memory):
        with pytest.raises(RuntimeError, match=re.escape(f"no CUDA device: {answer.reason}")):
            query(0)


def test_ranks_talk_over_nccl() -> None:
    assert CudaPlatform.dist_backend == "nccl" and CudaPlatform.device_type == "cuda"


def test_the_default_backend_is_triton_when_installed_and_able(catalog_of, caplog) -> None:
    catalog_of(("torch", "triton"))
    assert CudaPlatform.default_attention_backend(SPEC) == "triton"
    with caplog.at_level(logging.INFO, logger="engine.worker"):
        assert CudaPlatform.default_attention_backend(
            AttentionSpec(num_heads=4, num_kv_heads=4, head_size=512, dtype="float16",
                          kv_cache_dtype="float16", block_size=16)) == "torch"
    assert "'triton' cannot serve heads=4/4 head_size=512" in caplog.text
    assert "head size 512 not supported; supported: up to 256); using 'torch'" in caplog.text


def test_without_triton_installed_the_default_is_torch(catalog_of, caplog) -> None:
    catalog_of(("torch",), None)
    with caplog.at_level(logging.INFO, logger="engine.worker"):
        assert CudaPlatform.default_attention_backend(SPEC) == "torch"
    assert "'triton' is not installed or not allowed (engine-kernels provides it)" in caplog.text
    catalog_of(("torch", "triton"), "none")  # the allowlist governs third parties only
    assert CudaPlatform.default_attention_backend(SPEC) == "triton"
