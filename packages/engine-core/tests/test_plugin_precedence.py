"""A plugin that provides a name the engine provides too: it is a candidate, never a crash.

One rule (``engine.core.plugins._precedence``): a third party's entry takes precedence over
the engine's own of the same name, and the engine's stays reachable by its class path; two
third parties sharing a name are an error naming both, raised only when the name is used.
Models (``--model-impl``) and custom ops (``test_custom_op_candidates.py``) are targets
with their own selection; this file covers models, attention backends, linear kernels and
a scheduling policy.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core import LLM
from engine.core.model_executor.linear_kernels import TorchLinearKernel
from engine.core.model_executor.models.llama import LlamaForCausalLM
from engine.core.plugins import Allowlist, PluginCatalog, PluginManifest
from engine.core.scheduler import FCFSPolicy
from engine.kernels.cpu.attention import CpuAttentionBackend
from engine.kernels.cpu.linear import CpuLinearKernel
from engine.sdk import SamplingParams
from engine.sdk.errors import PluginError, ValidationError
from engine.sdk.groups import ATTENTION_BACKENDS, LINEAR_KERNELS, MODELS, SCHEDULING_POLICIES
from engine.testing.test_plugins import entry_installer

CALLS: Counter[str] = Counter()
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class AcmeFCFS(FCFSPolicy):
    """A policy named like the built-in ``fcfs``."""


class AcmeCpuBackend(CpuAttentionBackend):
    """The built-in ``cpu`` backend under a plugin's distribution, counting its use."""

    @classmethod
    def get_impl_cls(cls) -> Any:
        CALLS["backend"] += 1
        return super().get_impl_cls()


class AcmeCpuKernel(CpuLinearKernel):
    """The built-in ``cpu`` kernel under a plugin's distribution, counting its layers."""

    def __init__(self, config: Any) -> None:
        CALLS["kernel"] += 1
        super().__init__(config)


class RarelyKernel(TorchLinearKernel):
    """A kernel two plugins name ``rarely``; its low priority means it is never chosen."""

    name = "rarely"
    priority = -50


class OtherRarelyKernel(RarelyKernel):
    pass


class AcmeLlama(LlamaForCausalLM):
    """A plugin's ``LlamaForCausalLM`` (the engine's, counting its forward passes)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        CALLS["model"] += 1
        return super().forward(*args, **kwargs)


class OtherLlama(AcmeLlama):
    pass


@pytest.fixture
def acme(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str, type], None]:
    CALLS.clear()
    return entry_installer(monkeypatch, "acme-plugins", "0.1.0")


def _run(checkpoint: Path, **kwargs: Any) -> tuple[list[int], Any]:
    with LLM(str(checkpoint), dtype="float32", in_process=True, num_kv_blocks=32,
             **kwargs) as llm:
        [out] = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, GREEDY, use_tqdm=False)
        return list(out.outputs[0].token_ids), llm.llm_engine.core.worker.built


def test_a_plugin_named_like_a_built_in_takes_precedence_and_the_built_in_stays_reachable(
        acme: Callable[[str, str, type], None], caplog: pytest.LogCaptureFixture) -> None:
    acme(SCHEDULING_POLICIES, "fcfs", AcmeFCFS)
    catalog = PluginCatalog.discover(Allowlist.parse(None))
    PluginManifest.from_catalog(catalog)  # no conflict at start-up
    with caplog.at_level(logging.INFO, "engine.plugins"):
        assert catalog.load(SCHEDULING_POLICIES, "fcfs") is AcmeFCFS
    assert ("plugin 'fcfs' (group engine.scheduling_policies, distribution acme-plugins "
            "0.1.0) takes precedence over the engine's own engine.core.scheduler:FCFSPolicy "
            "(engine-core") in caplog.text
    assert catalog.load(SCHEDULING_POLICIES, "engine.core.scheduler:FCFSPolicy") is FCFSPolicy
    rows = {(r.entry.name, r.entry.distribution): r for r in catalog.rows()
            if r.entry.group == SCHEDULING_POLICIES}
    assert [e.distribution for e in rows[("fcfs", "acme-plugins")].shadows] == ["engine-core"]
    assert [e.distribution for e in rows[("fcfs", "engine-core")].shadowed_by] == [
        "acme-plugins"]
    assert not rows[("fcfs", "acme-plugins")].conflicts_with


def test_attention_backend_and_linear_kernel_named_like_built_ins(
        acme: Callable[[str, str, type], None], tiny_llama: Path) -> None:
    reference, _ = _run(tiny_llama, plugins="none")
    acme(ATTENTION_BACKENDS, "cpu", AcmeCpuBackend)
    acme(LINEAR_KERNELS, "cpu", AcmeCpuKernel)
    tokens, built = _run(tiny_llama)
    assert built.backend is AcmeCpuBackend and CALLS["backend"] > 0 and CALLS["kernel"] > 0
    assert tokens == reference
    CALLS.clear()
    tokens, built = _run(
        tiny_llama, attention_backend="engine.kernels.cpu.attention:CpuAttentionBackend",
        linear_kernel="engine.kernels.cpu.linear:CpuLinearKernel")
    assert built.backend is CpuAttentionBackend and CALLS["kernel"] == 0
    assert tokens == reference


def test_two_plugins_sharing_a_kernel_name_stop_only_an_engine_that_uses_it(
        monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> None:
    entry_installer(monkeypatch, "acme-plugins", "0.1.0")(LINEAR_KERNELS, "rarely", RarelyKernel)
    entry_installer(monkeypatch, "other-plugins", "0.2.0")(LINEAR_KERNELS, "rarely",
                                                           OtherRarelyKernel)
    reference, _ = _run(tiny_llama)  # never selected: the engine starts
    with pytest.raises(PluginError, match=r"plugin 'rarely' \(group engine.linear_kernels, "
                       r"distributions acme-plugins 0.1.0 and other-plugins 0.2.0\)"):
        _run(tiny_llama, linear_kernel="rarely")
    path = f"{OtherRarelyKernel.__module__}:{OtherRarelyKernel.__qualname__}"
    tokens, built = _run(tiny_llama, linear_kernel=path)
    assert tokens == reference
    assert type(built.model.layers[0].mlp.down_proj.quant_method.kernel) is OtherRarelyKernel


def test_a_model_plugin_for_an_architecture_the_engine_serves(
        acme: Callable[[str, str, type], None], monkeypatch: pytest.MonkeyPatch,
        tiny_llama: Path) -> None:
    reference, _ = _run(tiny_llama, plugins="none")
    acme(MODELS, "LlamaForCausalLM", AcmeLlama)
    tokens, built = _run(tiny_llama)  # auto: the plugin's
    assert type(built.model) is AcmeLlama and CALLS["model"] > 0 and tokens == reference
    for impl in ("engine", "vllm"):
        _, built = _run(tiny_llama, model_impl=impl)
        assert type(built.model) is LlamaForCausalLM
    entry_installer(monkeypatch, "other-plugins", "0.2.0")(MODELS, "LlamaForCausalLM",
                                                           OtherLlama)
    with pytest.raises(PluginError) as info:
        LLM(str(tiny_llama), in_process=True)
    assert ("2 model plugins serve architecture 'LlamaForCausalLM'" in str(info.value)
            and "--model-impl acme-plugins or --model-impl other-plugins" in str(info.value))
    _, built = _run(tiny_llama, model_impl="other_plugins")  # normalised like pip does
    assert type(built.model) is OtherLlama
    with pytest.raises(ValidationError, match=r"--model-impl nobody: no allowed model of "
                       r"that distribution.*LlamaForCausalLM: engine-core"):
        LLM(str(tiny_llama), in_process=True, model_impl="nobody")
    with torch.no_grad():
        _, built = _run(tiny_llama, model_impl=f"{AcmeLlama.__module__}:AcmeLlama")
    assert type(built.model) is AcmeLlama
