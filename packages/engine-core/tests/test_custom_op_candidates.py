"""Several implementations of one op coexist: eligibility, priority, the operator's choice.

The catalogs here hold entries of several distributions for ``rms_norm`` (an engine-kernels-
like first-party one with CPU and CUDA paths, third parties' with a CPU path) beside
engine-core's built-in (the reference, a path of its own on no device);
``test_custom_op_selection.py`` covers the items themselves.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import pytest
import torch

from engine.core.custom_op_selection import (
    CustomOpSettings,
    builtin_entry,
    describe_candidates,
    plan_custom_ops,
    select_custom_ops,
)
from engine.core.model_executor.layers.builtin_ops import BUILTIN_IMPLEMENTATIONS
from engine.core.plugins import Allowlist, PluginCatalog, PluginEntry, discover_entries
from engine.core.plugins._local import plugin_reference
from engine.sdk import PlatformInfo, Support
from engine.sdk.errors import PluginError, ValidationError
from engine.sdk.groups import CUSTOM_OPS
from engine.sdk.ops import RMSNormOp

CPU = PlatformInfo(name="cpu", device_type="cpu")


class KernelsLikeRMSNorm(RMSNormOp):
    """A CPU and a CUDA path, as engine-kernels' ops have."""

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        return self.forward_native(x, residual)

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        return self.forward_native(x, residual)


class AcmeRMSNorm(RMSNormOp):
    """A third party's replacement with a CPU path."""

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        return self.forward_native(x, residual)


class OtherRMSNorm(AcmeRMSNorm):
    """A second third party's, of equal standing."""


class PreferredRMSNorm(AcmeRMSNorm):
    priority: ClassVar[int] = 10


class FallbackRMSNorm(AcmeRMSNorm):
    priority: ClassVar[int] = -1


class PickyRMSNorm(AcmeRMSNorm):
    """Refuses every device, with a reason."""

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return Support.no("needs AVX-1024")


def _entry(cls: type, distribution: str) -> PluginEntry:
    return PluginEntry(CUSTOM_OPS, "rms_norm", plugin_reference(cls), distribution, "1.0")


KERNELS = _entry(KernelsLikeRMSNorm, "engine-kernels")
ACME = _entry(AcmeRMSNorm, "acme-ops")
OTHER = _entry(OtherRMSNorm, "other-ops")


def _catalog(*entries: PluginEntry) -> PluginCatalog:
    builtins = [e for e in discover_entries()
                if e.group == CUSTOM_OPS and e.distribution == "engine-core"]
    return PluginCatalog([*builtins, *entries], Allowlist.from_env(None))


def _rms(catalog: PluginCatalog, *items: str, platform: PlatformInfo = CPU) -> Any:
    plan = plan_custom_ops(catalog, CustomOpSettings(items), platform.device_type, platform)
    return next(c for c in plan if c.name == "rms_norm")


def test_engine_core_registers_its_built_ins_as_entries() -> None:
    catalog = _catalog()
    for op, cls in BUILTIN_IMPLEMENTATIONS.items():
        entry = builtin_entry(catalog, op)
        assert entry.value == f"{cls.__module__}:{cls.__qualname__}"
        assert entry.distribution == "engine-core"


def test_a_third_party_replacement_beside_the_engine_s_own_is_used_where_it_has_a_path(
) -> None:
    choice = _rms(_catalog(KERNELS, ACME))
    assert choice.chosen == ACME
    assert choice.reason == ("default: ranks first with a cpu path (priority 0, a third "
                             "party's over the engine's)")
    assert ("passed over: engine.core.model_executor.layers.builtin_ops:RMSNorm (engine-core "
            "0.1.0): it has no cpu path") in choice.full_reason
    lines = describe_candidates(choice)
    assert lines[0].startswith("  engine.core.model_executor.layers.builtin_ops:RMSNorm")
    assert any(line.startswith(f"* {ACME.value}") and "eligible" in line for line in lines)
    assert _rms(_catalog(KERNELS)).chosen == KERNELS  # alone: the engine's CPU path
    # On CUDA the engine-kernels-like one has a path; acme's has none.
    cuda = PlatformInfo(name="cuda", device_type="cuda")
    assert _rms(_catalog(KERNELS, ACME), platform=cuda).chosen == KERNELS


def test_the_operator_forces_any_implementation() -> None:
    catalog = _catalog(KERNELS, ACME)
    assert _rms(catalog, "+rms_norm=engine-kernels").chosen == KERNELS
    assert _rms(catalog, "+rms_norm=engine-kernels").reason == (
        "--custom-ops: +rms_norm=engine-kernels")
    forced = _rms(catalog, "+rms_norm=engine-core")
    assert forced.reason.startswith("--custom-ops: +rms_norm=engine-core (used although it "
                                    "says: it has no cpu path of its own")
    assert not _rms(catalog, "-rms_norm").use_replacement
    assert not _rms(catalog, "+rms_norm=engine-core").use_replacement
    assert _rms(catalog, "none", "+rms_norm=acme_ops").chosen == ACME  # normalised
    by_path = _rms(_catalog(KERNELS), f"+rms_norm={ACME.value}")  # no entry point needed
    assert by_path.chosen.value == ACME.value and by_path.use_replacement
    replaced = select_custom_ops(catalog, CustomOpSettings(("+rms_norm=engine-kernels",)),
                                 "cpu", CPU)
    assert replaced["rms_norm"][0] == KERNELS and replaced["rms_norm"][1] is KernelsLikeRMSNorm


def test_two_third_parties_of_equal_standing_need_the_operator_only_when_used(
        caplog: pytest.LogCaptureFixture) -> None:
    catalog = _catalog(KERNELS, ACME, OTHER)
    with pytest.raises(PluginError) as info:
        _rms(catalog)
    message = str(info.value)
    assert "op 'rms_norm' has 2 replacements of equal standing for the cpu" in message
    assert f"{ACME.value} (acme-ops 1.0), {OTHER.value} (other-ops 1.0)" in message
    assert "--custom-ops +rms_norm=acme-ops or --custom-ops +rms_norm=other-ops" in message
    assert _rms(catalog, "+rms_norm=other-ops").chosen == OTHER
    assert not _rms(catalog, "-rms_norm").use_replacement  # the op is not replaced: no error
    with caplog.at_level(logging.INFO, "engine.worker"):  # the other ops still start
        select_custom_ops(catalog, CustomOpSettings(("-rms_norm",)), "cpu", CPU)
    assert "rms_norm = built-in" in caplog.text
    # engine plugins list reports it instead of failing.
    [undecided] = [c for c in plan_custom_ops(catalog, None, "cpu", CPU, strict=False)
                   if c.name == "rms_norm"]
    assert undecided.error is not None and "equal standing" in undecided.error


def test_on_a_device_nothing_has_a_path_for_the_built_in_runs_the_reference() -> None:
    npu = PlatformInfo(name="acme_npu", device_type="npu")
    choice = _rms(_catalog(KERNELS, ACME), platform=npu)
    assert not choice.use_replacement
    assert choice.reason == "default: no implementation has a path of its own for npu"
    assert len(choice.passed_over) == 3  # the built-in, engine-kernels' and acme's
    assert _rms(_catalog(KERNELS, ACME), "+rms_norm", platform=npu).chosen == ACME


def test_priority_ranks_before_the_third_party_rule() -> None:
    preferred = _entry(PreferredRMSNorm, "preferred-ops")
    assert _rms(_catalog(ACME, OTHER, preferred)).chosen == preferred  # no tie at the top
    fallback = _entry(FallbackRMSNorm, "fallback-ops")
    assert _rms(_catalog(KERNELS, fallback)).chosen == KERNELS  # priority 0 beats -1
    assert _rms(_catalog(KERNELS, fallback), "+rms_norm=fallback-ops").chosen == fallback
    assert _rms(_catalog(fallback)).chosen == fallback  # the only one with a cpu path


def test_is_supported_refusals_are_passed_over_with_their_reason() -> None:
    picky = _entry(PickyRMSNorm, "picky-ops")
    choice = _rms(_catalog(picky))
    assert not choice.use_replacement
    assert f"{picky.value} (picky-ops 1.0): needs AVX-1024" in choice.full_reason
    assert _rms(_catalog(picky), "+rms_norm").chosen == picky  # the only replacement


def test_an_unknown_choice_is_refused_before_any_load_listing_the_providers() -> None:
    catalog = _catalog(KERNELS, ACME)
    with pytest.raises(ValidationError) as info:
        CustomOpSettings(("+rms_norm=acme",)).validate(catalog)
    assert ("no allowed distribution 'acme' provides 'rms_norm'; its implementations come "
            "from engine-core, acme-ops, engine-kernels") in str(info.value)
    with pytest.raises(ValidationError, match="-NAME takes no =CHOICE"):
        CustomOpSettings(("-rms_norm=acme-ops",)).validate(catalog)
    with pytest.raises(ValidationError, match="=CHOICE is empty"):
        CustomOpSettings(("+rms_norm=",)).validate(catalog)
    CustomOpSettings(("+rms_norm=engine-core",)).validate(catalog)
    CustomOpSettings((), ("+rms_norm=not-installed",), "acme").validate(catalog)  # ignored
    assert not _rms(catalog, "-rms_norm").use_replacement
