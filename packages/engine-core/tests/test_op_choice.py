"""The measured custom-op choice (``engine.core.kernel_choice.op_selection``).

Where no ``--custom-ops`` item names an op and several implementations have a CPU path,
the worker builds the op from the fastest on the model's shape, whatever the priorities
(no tie error between third parties either); one that raises or computes something else
is left out, named; the decision is kept; small models keep the ranked order.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import pytest
import torch

from engine.core.custom_op_selection import select_custom_ops
from engine.core.kernel_choice import op_selection, store
from engine.core.kernel_choice.op_selection import OpMeasurer, OpShape
from engine.core.model_executor.layers.builtin_ops import RMSNorm
from engine.core.plugins import PluginCatalog, PluginEntry
from engine.core.plugins._allowlist import Allowlist
from engine.core.plugins._local import plugin_reference
from engine.kernels.cpu.native import native_kernels
from engine.kernels.ops import RMSNorm as KernelsRMSNorm
from engine.sdk.groups import CUSTOM_OPS
from engine.sdk.ops import RMSNormOp
from engine.sdk.platform import PlatformInfo

NATIVE = native_kernels()  # built before a test points ENGINE_CACHE_DIR elsewhere
CPU = PlatformInfo("cpu", "cpu")
SHAPE = OpShape(hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=2,
                head_size=64, dtype="float32")


class SlowNorm(RMSNormOp):
    """A CPU path of its own, ranked above everything, ten times the work."""

    priority: ClassVar[int] = 1000

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        for _ in range(10):
            out = self.forward_native(x.clone(), None if residual is None else residual.clone())
        return out


class WrongNorm(RMSNormOp):
    priority: ClassVar[int] = 1000

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        out = self.forward_native(x, residual)
        return (out[0] * 2, out[1]) if isinstance(out, tuple) else out * 2


def catalog(*ops: tuple[str, type]) -> PluginCatalog:
    entries = [PluginEntry(CUSTOM_OPS, "rms_norm", plugin_reference(cls), dist, "1.0")
               for dist, cls in ops]
    return PluginCatalog(entries, Allowlist.from_env(None))


def chosen(plugins: PluginCatalog, shape: OpShape = SHAPE) -> type | None:
    selected = select_custom_ops(plugins, None, "cpu", CPU, OpMeasurer(shape, "cpu", 64))
    return selected["rms_norm"][1] if "rms_norm" in selected else None


@pytest.mark.skipif(NATIVE is None, reason="engine-kernels' CPU path needs the native kernels")
@pytest.mark.usefixtures("choice_cache")
def test_the_fastest_implementation_is_built_whatever_the_priorities(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    plugins = catalog(("engine-kernels", KernelsRMSNorm), ("slow-norms", SlowNorm),
                      ("wrong-norms", WrongNorm))
    with caplog.at_level(logging.INFO):
        assert chosen(plugins) is KernelsRMSNorm  # the engine's C++, priority 0
    assert "custom op rms_norm: engine-kernels for 1 row" in caplog.text
    assert "(engine-kernels 1.0) [default: measured fastest here" in caplog.text
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "WrongNorm (wrong-norms) left out of the measured choice" in warning
    assert "differs from the reference (forward_native)" in warning
    (record,) = store.stored()
    assert record.key["what"] == "custom_op" and record.plan.names == ("engine-kernels",)

    monkeypatch.setattr(op_selection, "time_ops", lambda *a: pytest.fail("measured again"))
    assert chosen(plugins) is KernelsRMSNorm  # read back


@pytest.mark.usefixtures("choice_cache")
def test_two_third_parties_of_equal_standing_are_measured_not_refused() -> None:
    class FastNorm(SlowNorm):
        def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
            return self.forward_native(x, residual)

    # unmeasured, two third parties ranked first together stop start-up (a tie)
    assert chosen(catalog(("engine-kernels", KernelsRMSNorm), ("slow-norms", SlowNorm),
                          ("fast-norms", FastNorm))) in (
        KernelsRMSNorm, FastNorm)  # the engine's C++ or the faster of the two, never the slow


def test_small_models_keep_the_ranked_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(op_selection, "time_ops", lambda *a: pytest.fail("measured"))
    small = OpShape(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                    head_size=16, dtype="float32")
    assert chosen(catalog(("slow-norms", SlowNorm)), small) is SlowNorm  # priority 1000
    assert RMSNorm is not SlowNorm
