"""Hugging Face directories: config.json and (sharded) safetensors, written by transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.core.model_loader import (
    iter_safetensors_weights,
    iter_weights,
    load_config,
    load_hf_config,
    resolve_model,
    safetensors_files,
)
from engine.sdk.errors import ValidationError

# transformers 5 still accepts the legacy `rope_theta` keyword (and 4.x needs it).
ROPE_THETA: dict[str, Any] = {"rope_theta": 12345.0}


def tiny_model(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        bos_token_id=5,
        eos_token_id=6,
        **ROPE_THETA,
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, Path]:
    model = tiny_model(tied=False)
    folder = tmp_path_factory.mktemp("untied")
    model.save_pretrained(folder)  # transformers 5 always writes safetensors
    return model, folder


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, Path]:
    model = tiny_model(tied=True)
    folder = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(folder, max_shard_size="40KB")
    return model, folder


def test_config(untied: tuple[LlamaForCausalLM, Path]) -> None:
    model, folder = untied
    config = load_hf_config(folder)
    assert isinstance(config, LlamaConfig)
    for key in ("num_hidden_layers", "hidden_size", "num_key_value_heads", "vocab_size"):
        assert getattr(config, key) == getattr(model.config, key)
    assert config.rope_parameters is not None
    assert config.rope_parameters["rope_theta"] == 12345.0
    assert config.tie_word_embeddings is False
    assert (config.bos_token_id, config.eos_token_id) == (5, 6)
    assert load_config(resolve_model(str(folder))).to_dict() == config.to_dict()


def test_single_file_weights_equal(untied: tuple[LlamaForCausalLM, Path]) -> None:
    model, folder = untied
    assert [f.name for f in safetensors_files(folder)] == ["model.safetensors"]
    loaded = dict(iter_safetensors_weights(folder, torch.float32, progress=False))
    expected = model.state_dict()
    assert loaded.keys() == expected.keys()
    assert "lm_head.weight" in loaded
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_sharded_weights_equal(sharded: tuple[LlamaForCausalLM, Path]) -> None:
    model, folder = sharded
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = safetensors_files(folder)
    assert len(shards) > 2
    assert {f.name for f in shards} == set(index["weight_map"].values())
    names = [name for name, _ in iter_safetensors_weights(folder, torch.float32, progress=False)]
    assert len(names) == len(set(names))  # each tensor once
    loaded = dict(iter_weights(resolve_model(str(folder)), torch.float32, progress=False))
    expected = dict(model.state_dict())
    expected.pop("lm_head.weight")  # tied: not saved
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_dtype_cast_and_progress(
    untied: tuple[LlamaForCausalLM, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model, folder = untied
    loaded = dict(iter_safetensors_weights(folder, torch.bfloat16, progress=True))
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(loaded[name], model.state_dict()[name].bfloat16())
    err = capsys.readouterr().err
    assert f"Loading {folder.name}" in err
    assert f"{len(loaded)}/{len(loaded)}" in err


def test_directory_errors(tmp_path: Path, untied: tuple[LlamaForCausalLM, Path]) -> None:
    with pytest.raises(ValidationError, match="has no config.json"):
        load_hf_config(tmp_path)
    with pytest.raises(ValidationError, match="has no \\*.safetensors weights$"):
        safetensors_files(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValidationError, match="found pytorch_model.bin: only safetensors"):
        list(iter_safetensors_weights(tmp_path, torch.float32))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(ValidationError, match="missing: model-00001-of-00002.safetensors") as info:
        safetensors_files(tmp_path)
    assert info.value.param == "model"
