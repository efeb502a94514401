"""``--custom-ops`` and the platform's ``custom_ops``: which ops are built from a replacement.

A replacement is made installed for these tests by adding a catalog entry for a class of
this module (no distribution needed); the end-to-end tests add it to what the engine
discovers and let the CPU platform set ``custom_ops`` / ``enforce_eager``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from engine.core import LLM
from engine.core.custom_op_selection import (
    CustomOpSettings,
    parse_custom_op_items,
    plan_custom_ops,
    select_custom_ops,
)
from engine.core.platforms._builtin import CpuPlatform
from engine.core.plugins import Allowlist, PluginCatalog, PluginEntry, _catalog
from engine.core.plugins._local import plugin_reference
from engine.sdk import PlatformConfig, SamplingParams
from engine.sdk.errors import PluginError, ValidationError
from engine.sdk.groups import CUSTOM_OPS
from engine.sdk.ops import RMSNormOp, SiluAndMulOp

CALLS: Counter[str] = Counter()
DIST = "acme-ops"


class CountingRMSNorm(RMSNormOp):
    """The reference RMSNorm, counting its calls on the CPU path."""

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        CALLS["rms_norm"] += 1
        return self.forward_native(x, residual)


class CudaOnlyRMSNorm(RMSNormOp):
    """A replacement with a CUDA path only (as engine-kernels' are): the reference elsewhere."""

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        return self.forward_native(x, residual)


class NotAnRMSNorm(SiluAndMulOp):
    name: ClassVar[str] = "rms_norm"


def _entry(name: str, cls: type) -> PluginEntry:
    return PluginEntry(CUSTOM_OPS, name, plugin_reference(cls), DIST, "1.0")


def _catalog_with(*entries: PluginEntry) -> PluginCatalog:
    return PluginCatalog(entries, Allowlist.from_env(None))


RMS = _entry("rms_norm", CountingRMSNorm)
RMS_CUDA = _entry("rms_norm", CudaOnlyRMSNorm)


def _select(catalog: PluginCatalog, settings: CustomOpSettings | None = None,
            dispatch_key: str = "native") -> dict[str, type]:
    """Op -> the replacement class the worker would build it from."""
    return {name: cls for name, (_, cls) in select_custom_ops(catalog, settings,
                                                               dispatch_key).items()}


def _uses(settings: CustomOpSettings, catalog: PluginCatalog | None = None) -> dict[str, bool]:
    return {c.name: c.use_replacement for c in plan_custom_ops(catalog or _catalog_with(RMS),
                                                               settings)}


# -- parsing and validation -----------------------------------------------------------------


@pytest.mark.parametrize("item", ["+nope", "-nope", "nope", "", "+"])
def test_unknown_op_names_are_refused_listing_the_ops(item: str) -> None:
    with pytest.raises(ValidationError) as info:
        parse_custom_op_items([item])
    assert info.value.param == "custom_ops"
    assert "rms_norm, rotary_embedding, silu_and_mul" in str(info.value)


def test_a_bad_platform_item_names_the_platform() -> None:
    settings = CustomOpSettings(platform=("+gelu_tanh_mul_fused",), platform_name="acme_npu")
    with pytest.raises(ValidationError,
                       match="as platform acme_npu set it.*'gelu_tanh_mul_fused'"):
        settings.validate(_catalog_with(RMS))


def test_enabling_an_op_without_a_replacement_is_refused_for_the_operator_only() -> None:
    with pytest.raises(ValidationError) as info:
        CustomOpSettings(operator=("+silu_and_mul",)).validate(_catalog_with(RMS))
    assert "no allowed engine.custom_ops entry replaces 'silu_and_mul'" in str(info.value)
    assert "ops with an allowed replacement: rms_norm" in str(info.value)
    CustomOpSettings(platform=("+silu_and_mul",), platform_name="cpu").validate(
        _catalog_with(RMS))  # a platform may enable ops generically


# -- what each op uses --------------------------------------------------------------------


@pytest.mark.parametrize(("operator", "platform", "uses_replacement"), [
    ((), (), True),                              # default: an allowed replacement is used
    (("-rms_norm",), (), False),
    (("none",), (), False),
    (("none", "+rms_norm"), (), True),           # later items win
    (("+rms_norm", "none"), (), False),
    (("all",), (), True),
    ((), ("-rms_norm",), False),                 # the platform's setting is applied
    (("+rms_norm",), ("-rms_norm",), True),      # the operator's flag wins
    (("all",), ("none",), True),
    (("-rms_norm",), ("+rms_norm",), False),
    (("-rms_norm",), ("-rms_norm", "+rms_norm"), False),  # platform appended to ours
])
def test_precedence(operator: tuple[str, ...], platform: tuple[str, ...],
                    uses_replacement: bool) -> None:
    settings = CustomOpSettings(operator, platform, "acme")
    uses = _uses(settings)
    assert uses == {"rms_norm": uses_replacement, "rotary_embedding": False,
                    "silu_and_mul": False, "gelu_and_mul": False, "fused_moe": False}


def test_the_plan_says_why() -> None:
    catalog = _catalog_with(RMS)
    plan = {c.name: c for c in plan_custom_ops(catalog, CustomOpSettings(
        ("-rms_norm",), ("+rms_norm",), "acme"))}
    assert plan["rms_norm"].reason == "--custom-ops: -rms_norm"
    assert plan["rms_norm"].implementation == (
        "built-in engine.core.model_executor.layers.builtin_ops:RMSNorm")
    assert plan["silu_and_mul"].reason == "no replacement is installed"
    plan = {c.name: c for c in plan_custom_ops(catalog, CustomOpSettings(
        (), ("-rms_norm",), "acme"))}
    assert plan["rms_norm"].reason == "the platform acme: -rms_norm"
    [default] = [c for c in plan_custom_ops(catalog, CustomOpSettings()) if c.use_replacement]
    assert default.implementation.endswith(f"({DIST} 1.0)")


def test_select_imports_only_what_is_used(caplog: pytest.LogCaptureFixture) -> None:
    catalog = _catalog_with(RMS)
    with caplog.at_level(logging.INFO, "engine.worker"):
        assert _select(catalog, CustomOpSettings()) == {"rms_norm": CountingRMSNorm}
    assert "rms_norm = " in caplog.text and (
        "[default: ranks first (priority 0, a third party's over the engine's)]") in caplog.text
    assert _select(catalog, CustomOpSettings(("-rms_norm",))) == {}


def test_by_default_a_replacement_without_a_path_for_the_device_leaves_the_built_in(
        caplog: pytest.LogCaptureFixture) -> None:
    catalog = _catalog_with(RMS_CUDA)
    with caplog.at_level(logging.INFO, "engine.worker"):
        assert _select(catalog, CustomOpSettings(), "cpu") == {}
    assert "rms_norm = built-in engine.core.model_executor.layers.builtin_ops:RMSNorm" in (
        caplog.text)
    assert ("passed over: engine.core.model_executor.layers.builtin_ops:RMSNorm (engine-core "
            "0.1.0): it has no cpu path of its own" in caplog.text)  # the reference
    assert f"; {RMS_CUDA.value} ({DIST} 1.0): it has no cpu path of its own" in caplog.text
    assert "; --custom-ops +rms_norm=DISTRIBUTION forces one]" in caplog.text
    # Its own device, the reference key, or an item naming it: the replacement is used.
    assert _select(catalog, CustomOpSettings(), "cuda") == {
        "rms_norm": CudaOnlyRMSNorm}
    assert _select(catalog, CustomOpSettings()) == {"rms_norm": CudaOnlyRMSNorm}
    for items in (("+rms_norm",), ("all",)):
        assert _select(catalog, CustomOpSettings(items), "cpu") == {
            "rms_norm": CudaOnlyRMSNorm}
    assert _select(catalog, CustomOpSettings((), ("+rms_norm",), "acme"), "cpu") == {
        "rms_norm": CudaOnlyRMSNorm}
    # One with a CPU path of its own is used on the CPU by default.
    assert _select(_catalog_with(RMS), CustomOpSettings(), "cpu") == {
        "rms_norm": CountingRMSNorm}


def test_a_replacement_that_breaks_the_contract_names_its_distribution() -> None:
    catalog = _catalog_with(_entry("rms_norm", NotAnRMSNorm))
    with pytest.raises(PluginError, match=rf"distribution {DIST} 1.0\): .*does not subclass "
                       r"engine.sdk.ops.RMSNormOp"):
        _select(catalog)
    assert _select(catalog, CustomOpSettings(("-rms_norm",))) == {}  # not used


def test_an_entry_for_no_built_in_op_fails_unless_replacements_are_off() -> None:
    catalog = _catalog_with(_entry("gelu_tanh_mul_fused", CountingRMSNorm))
    with pytest.raises(PluginError,
                       match="no built-in op named 'gelu_tanh_mul_fused'.*ops: fused_moe, "
                             "gelu_and_mul, rms_norm"):
        _select(catalog)
    assert _select(catalog, CustomOpSettings(("none",))) == {}


# -- through the engine -------------------------------------------------------------------


@pytest.fixture
def installed_replacement(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The engine discovers ``CountingRMSNorm`` as an installed ``rms_norm`` replacement."""
    discover = _catalog.discover_entries
    monkeypatch.setattr(_catalog, "discover_entries", lambda: [*discover(), RMS])
    yield


@pytest.fixture
def platform_disables_rms_norm(monkeypatch: pytest.MonkeyPatch) -> list[PlatformConfig]:
    """The CPU platform turns the rms_norm replacement off and disables graphs."""
    seen: list[PlatformConfig] = []

    def check_and_update_config(cls: type, config: PlatformConfig) -> None:
        seen.append(PlatformConfig(**{**vars(config), "custom_ops": list(config.custom_ops)}))
        config.custom_ops.append("-rms_norm")
        config.enforce_eager = True

    monkeypatch.setattr(CpuPlatform, "check_and_update_config",
                        classmethod(check_and_update_config))
    return seen


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _run(checkpoint: Path, **kwargs: Any) -> tuple[list[int], str, Any]:
    with LLM(str(checkpoint), dtype="float32", in_process=True, num_kv_blocks=32,
             **kwargs) as llm:
        [out] = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, GREEDY, use_tqdm=False)
        norm = type(llm.llm_engine.core.worker.built.model.norm).__name__
        return list(out.outputs[0].token_ids), norm, llm.llm_engine.setup


def test_the_operator_and_the_platform_choose_in_the_engine(
        tiny_llama: Path, installed_replacement: None,
        platform_disables_rms_norm: list[PlatformConfig]) -> None:
    CALLS.clear()
    # plugins=DIST: only ours (engine-kernels' rms_norm would be a second replacement).
    reference, norm, setup = _run(tiny_llama, plugins=DIST)  # the platform's -rms_norm applies
    assert norm == "RMSNorm" and CALLS["rms_norm"] == 0
    assert setup.enforce_eager is True and setup.custom_ops.platform == ("-rms_norm",)
    assert platform_disables_rms_norm[-1].custom_ops == []  # the engine filled in ours
    tokens, norm, setup = _run(tiny_llama, plugins=DIST, custom_ops=("+rms_norm",))  # ours wins
    assert norm == "CountingRMSNorm" and CALLS["rms_norm"] > 0
    assert tokens == reference  # the replacement computes the reference
    assert platform_disables_rms_norm[-1].custom_ops == ["+rms_norm"]  # filled in for it
    assert platform_disables_rms_norm[-1].enforce_eager is False


def test_enforce_eager_from_the_operator_is_kept(tiny_llama: Path) -> None:
    config = PlatformConfig()
    CpuPlatform.check_and_update_config(config)  # the built-in CPU leaves graphs alone
    assert config.enforce_eager is False
    _, norm, setup = _run(tiny_llama, plugins="none", enforce_eager=True)
    assert setup.enforce_eager is True and norm == "RMSNorm"


def test_unknown_op_names_fail_before_weights_load(tiny_llama: Path) -> None:
    with pytest.raises(ValidationError, match="^--custom-ops has '-rms_nrom': there is no op "
                       "'rms_nrom'.*rms_norm, rotary_embedding, silu_and_mul"):
        LLM(str(tiny_llama), in_process=True, custom_ops=("-rms_nrom",))
