"""``engine.testing.plugin_context``: the context a plugin gets from the engine, for unit tests.

The options it validates are the ones the engine gives the same plugin for the same
``plugin_options`` values; the context class and process follow the plugin's base class;
a bad value or a foreign class is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pydantic
import pytest
from pydantic import Field

from engine.core import LLM
from engine.sdk import (
    KVConnectorRole,
    LogitsProcessor,
    LogitsProcessorContext,
    PluginOptions,
    StatLogger,
    StatLoggerContext,
)
from engine.sdk.groups import STAT_LOGGERS
from engine.testing import plugin_context, plugin_options
from engine.testing.test_plugins import entry_installer


class PortLogger(StatLogger):
    """Keeps every context it was built with."""

    built: ClassVar[list[StatLoggerContext]] = []

    class Options(PluginOptions):
        port: int = Field(8125, ge=1, le=65535)
        prefix: str = "engine"

    def __init__(self, ctx: StatLoggerContext) -> None:
        super().__init__(ctx)
        PortLogger.built.append(ctx)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        pass


class Strength(LogitsProcessor):
    class Options(PluginOptions):
        strength: float = Field(1.0, ge=0)

    def __init__(self, ctx: LogitsProcessorContext) -> None:
        super().__init__(ctx)

    def apply(self, logits: Any) -> Any:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: Any) -> None:
        pass


def test_the_options_are_the_ones_the_engine_gives(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry_installer(monkeypatch, "acme-stats", "0.1")(STAT_LOGGERS, "ports", PortLogger)
    PortLogger.built.clear()
    values = {"port": "9125", "prefix": "t"}  # as --plugin-option ports.port=9125 gives it
    with LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32, in_process=True,
             plugins="acme-stats", plugin_options={"ports": values}):
        (engine_ctx,) = PortLogger.built
    ctx = plugin_context(PortLogger, values, plugin_name="ports",
                         num_kv_blocks=engine_ctx.num_kv_blocks)
    assert isinstance(ctx, StatLoggerContext)
    assert ctx.options == engine_ctx.options == PortLogger.Options(port=9125, prefix="t")
    assert (ctx.process, ctx.plugin_name) == (engine_ctx.process, "ports") == (
        "frontend", "ports")
    assert PortLogger(plugin_context(PortLogger)).ctx.options == PortLogger.Options()


def test_the_context_class_and_process_follow_the_base_class() -> None:
    ctx = plugin_context(Strength, {"strength": 2}, max_num_reqs=4, vocab_size=32)
    assert isinstance(ctx, LogitsProcessorContext)
    assert (ctx.options.strength, ctx.process, ctx.plugin_name) == (2.0, "worker", "Strength")
    from engine.core.kv_connectors import OffloadConnector

    sides = {role: plugin_context(OffloadConnector, role=role, engine_id="e", block_size=4,
                                  num_blocks=8, num_layers=1, num_kv_heads=1, head_size=4,
                                  kv_cache_dtype="float32")
             for role in KVConnectorRole}
    assert {role: ctx.process for role, ctx in sides.items()} == {
        KVConnectorRole.SCHEDULER: "engine_core", KVConnectorRole.WORKER: "worker"}
    assert sides[KVConnectorRole.WORKER].plugin_name == "offload"


def test_bad_options_and_foreign_classes_are_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="port"):
        plugin_context(PortLogger, {"port": 0})
    with pytest.raises(pydantic.ValidationError, match="prot"):
        plugin_options(PortLogger, {"prot": 1})  # unknown keys too, as the engine refuses
    given = PortLogger.Options(port=1)
    assert plugin_options(PortLogger, given) is given
    with pytest.raises(TypeError, match="must be a PortLogger.Options or a mapping"):
        plugin_options(PortLogger, Strength.Options())
    with pytest.raises(TypeError, match="not a subclass of a plugin base class"):
        plugin_context(int)  # type: ignore[arg-type]
