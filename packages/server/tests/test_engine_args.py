"""``--plugin-option`` on the command line: plain and group-qualified names."""

from __future__ import annotations

import pytest

from engine.sdk import ValidationError
from engine.server.cli._engine_args import parse_plugin_options
from engine.server.cli._main import build_parser


def test_plugin_options_parse_plain_and_qualified_names() -> None:
    options = parse_plugin_options([
        "my_proc.strength=0.5", "my_proc.mode=fast", "attention_backends:torch.window=3",
        "pkg.mod:Cls.flags=[1, 2]"])
    assert options == {"my_proc": {"strength": 0.5, "mode": "fast"},
                       "attention_backends:torch": {"window": 3},
                       "pkg.mod:Cls": {"flags": [1, 2]}}


@pytest.mark.parametrize("item", ["strength=0.5", "my_proc.strength", ".x=1", "p.=1"])
def test_malformed_plugin_option_says_what_is_allowed(item: str) -> None:
    with pytest.raises(ValidationError, match=r"\[GROUP:\]NAME\.KEY=VALUE"):
        parse_plugin_options([item])


def test_qualified_plugin_option_reaches_the_config() -> None:
    from engine.server.cli._engine_args import engine_config_from_args

    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--plugin-option", "attention_backends:torch.window=3"])
    config = engine_config_from_args(args)
    assert config.plugin_options == {"engine.attention_backends:torch": {"window": 3}}
    assert config.options_for("engine.attention_backends", "torch") == {"window": 3}
    assert config.options_for("engine.linear_kernels", "torch") == {}
