"""A model plugin's own failure names it: construction, weight loading, options.

The engine builds the ``engine.models`` class the checkpoint's architecture names; what
the class's own code raises reaches the operator as a PluginError naming the plugin, its
group, distribution and version, with the exception's type and message (and the exception
as ``__cause__``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import Field

from engine.core import LLM
from engine.core.model_executor.models.llama import LlamaForCausalLM
from engine.core.plugins import PluginCatalog
from engine.core.worker.model_faults import naming_model, watched
from engine.sdk import ModelContext, PluginError, PluginOptions, UnsupportedError
from engine.sdk.groups import MODELS
from engine.testing.test_plugins import entry_installer

ARCH = "TestQwen3ForCausalLM"
IDENTITY = f"plugin '{ARCH}' (group engine.models, distribution engine-test-models 0.2)"


class RopeThetaModel(LlamaForCausalLM):
    """Reads ``config.rope_theta``, which transformers 5 configs no longer have."""

    def __init__(self, ctx: ModelContext, prefix: str = "") -> None:
        super().__init__(ctx, prefix)
        self.theta = float(ctx.hf_config.rope_theta)


class FailingLoadModel(LlamaForCausalLM):
    """Its ``load_weights`` raises on the first tensor."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _ in weights:
            raise KeyError("model.extra.weight")
        return set()


class DeepModel(LlamaForCausalLM):
    """Declares an option."""

    class Options(PluginOptions):
        depth: int = Field(2, ge=1)

    def __init__(self, ctx: ModelContext, prefix: str = "") -> None:
        super().__init__(ctx, prefix)
        self.depth = ctx.options.depth  # type: ignore[attr-defined]


@pytest.fixture
def checkpoint(tiny_llama: Path, tmp_path: Path) -> Path:
    """The tiny Llama checkpoint, its ``architectures`` naming :data:`ARCH`."""
    path = tmp_path / "model"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": [ARCH]}))
    return path


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``install(cls)``: ``cls`` is the installed ``engine.models`` entry for :data:`ARCH`."""
    monkeypatch.delenv("ENGINE_PLUGINS", raising=False)
    add = entry_installer(monkeypatch, "engine-test-models", "0.2")
    return lambda cls: add(MODELS, ARCH, cls)


def _llm(checkpoint: Path, **kwargs: Any) -> LLM:
    return LLM(str(checkpoint), dtype="float32", num_kv_blocks=32, in_process=True, **kwargs)


def test_an_exception_in_the_models_constructor_names_the_plugin(checkpoint: Path,
                                                                 install: Any) -> None:
    install(RopeThetaModel)
    with pytest.raises(PluginError) as info:
        _llm(checkpoint)
    assert str(info.value).startswith(
        f"{IDENTITY}: constructing it failed: AttributeError: 'LlamaConfig' object has no "
        "attribute 'rope_theta'; transformers 5 keeps rope settings in "
        "config.rope_parameters (4.x: rope_theta, rope_scaling): "
        "engine.sdk.layers.rope_settings(config) reads a config of either")
    assert isinstance(info.value.__cause__, AttributeError)
    assert (info.value.plugin, info.value.group) == (ARCH, MODELS)


def test_an_exception_in_load_weights_names_the_plugin(checkpoint: Path, install: Any) -> None:
    install(FailingLoadModel)
    with pytest.raises(PluginError) as info:
        _llm(checkpoint)
    assert str(info.value) == (
        f"{IDENTITY}: loading its weights (load_weights) failed: KeyError: "
        "'model.extra.weight'")
    assert isinstance(info.value.__cause__, KeyError)


def test_bad_model_options_name_the_key_and_what_it_accepts(checkpoint: Path,
                                                            install: Any) -> None:
    install(DeepModel)
    with pytest.raises(PluginError) as info:
        _llm(checkpoint, plugin_options={ARCH: {"depth": 0}})
    assert str(info.value) == (
        f"{IDENTITY}: invalid --plugin-option {ARCH}: depth: Input should be greater than or "
        "equal to 1 (got 0). Accepted options: depth (int >= 1, default 2)")
    with _llm(checkpoint, plugin_options={ARCH: {"depth": 3}}) as llm:
        model = llm.llm_engine.core.worker.built.model
        assert isinstance(model, DeepModel) and model.depth == 3


def test_what_already_names_its_cause_passes_unchanged() -> None:
    entry = PluginCatalog.discover().resolve(MODELS, "LlamaForCausalLM")
    kernel_error = PluginError("a kernel failed", plugin="k", group="engine.linear_kernels")
    with pytest.raises(PluginError) as info, naming_model(entry, "x"):
        raise kernel_error
    assert info.value is kernel_error
    no_kernel = UnsupportedError("no linear kernel can run scheme=x", [("cpu", "no")])
    with pytest.raises(UnsupportedError) as unsupported, naming_model(entry, "x"):
        raise no_kernel
    assert unsupported.value is no_kernel

    def reader() -> Iterator[tuple[str, torch.Tensor]]:
        yield "a", torch.zeros(1)
        raise OSError("checkpoint file truncated")  # the engine's reader, not the model

    with pytest.raises(OSError, match="truncated"), naming_model(
            entry, "loading its weights") as passing:
        for _ in watched(reader(), passing):
            pass
