"""A selected attention backend's options reach its metadata builder, as they reach its impl."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from engine.core import LLM
from engine.core.attention import TorchAttentionBackend
from engine.sdk import PluginOptions, SamplingParams
from engine.sdk.groups import ATTENTION_BACKENDS
from engine.testing.test_plugins import entry_installer

SEEN: list[Any] = []


class WindowedBackend(TorchAttentionBackend):
    """The torch backend with an option; records what its builder is given."""

    name: ClassVar[str] = "test_windowed"

    class Options(PluginOptions):
        window: int = 1

    @classmethod
    def get_builder_cls(cls) -> Any:
        base = super().get_builder_cls()

        class Recording(base):  # type: ignore[misc, valid-type]
            def __init__(self, ctx: Any) -> None:
                SEEN.append(ctx.options)
                super().__init__(ctx)

        return Recording


def test_the_builder_gets_the_backend_s_validated_options(
        monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> None:
    entry_installer(monkeypatch, "acme-plugins", "0.1.0")(ATTENTION_BACKENDS, "test_windowed",
                                                          WindowedBackend)
    SEEN.clear()
    with LLM(str(tiny_llama), dtype="float32", in_process=True, num_kv_blocks=32,
             attention_backend="test_windowed",
             plugin_options={"test_windowed": {"window": 3}}) as llm:
        llm.generate({"prompt_token_ids": [5, 6, 7]},
                     SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert SEEN and all(isinstance(o, WindowedBackend.Options) and o.window == 3 for o in SEEN)
