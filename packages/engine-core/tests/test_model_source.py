"""``resolve_model``: what the MODEL argument may be, and the errors for everything else."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core.model_loader import ModelSource, default_model_path, resolve_model
from engine.sdk.errors import ValidationError


def test_default() -> None:
    source = resolve_model(None)
    assert source == ModelSource(
        "gguf", default_model_path().parent, default_model_path().name, "SmolLM2-135M-Instruct.Q4_1"
    )
    assert source.weights_path == default_model_path()


def test_hf_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    source = resolve_model(str(tmp_path))
    assert (source.kind, source.path, source.gguf_file) == ("hf", tmp_path.resolve(), None)
    assert source.display_name == str(tmp_path)
    assert source.gguf_path is None
    assert source.weights_path == tmp_path.resolve()


def test_gguf_file_and_directory_holding_one(tmp_path: Path) -> None:
    (tmp_path / "m.Q4_0.gguf").write_bytes(b"GGUF")
    by_file = resolve_model(tmp_path / "m.Q4_0.gguf")
    assert (by_file.kind, by_file.path, by_file.gguf_file) == (
        "gguf",
        tmp_path.resolve(),
        "m.Q4_0.gguf",
    )
    assert by_file.display_name == str(tmp_path / "m.Q4_0.gguf")
    by_dir = resolve_model(str(tmp_path))
    assert by_dir.gguf_path == by_file.gguf_path


def test_frozen(tmp_path: Path) -> None:
    source = resolve_model(None)
    with pytest.raises(AttributeError):
        source.kind = "hf"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("setup", "argument", "message"),
    [
        (None, "HuggingFaceTB/SmolLM2-135M-Instruct", "is not a local file or directory"),
        ("model.txt", "model.txt", "is not a .gguf file"),
        ("empty_dir", "empty_dir", "has no config.json"),
        ("two_ggufs", "two_ggufs", "several .gguf files (a.gguf, b.gguf): pass one"),
    ],
)
def test_rejected(tmp_path: Path, setup: str | None, argument: str, message: str) -> None:
    if setup == "model.txt":
        (tmp_path / setup).write_text("x")
    elif setup == "empty_dir":
        (tmp_path / setup).mkdir()
    elif setup == "two_ggufs":
        (tmp_path / setup).mkdir()
        (tmp_path / setup / "a.gguf").write_bytes(b"")
        (tmp_path / setup / "b.gguf").write_bytes(b"")
    target = argument if setup is None else str(tmp_path / argument)
    with pytest.raises(ValidationError) as info:
        resolve_model(target)
    text = str(info.value)
    assert message in text
    assert "a local Hugging Face model directory" in text
    assert "not downloaded" in text
    assert info.value.param == "model"
