"""vLLM's model options in the engine: --load-format, --tokenizer, --generation-config,
--kv-cache-dtype, --dtype aliases, and the notes for options that change nothing here."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.core.config import EngineConfig
from engine.core.model_loader import (
    DummyWeights,
    initialize_dummy_weights,
    iter_weights,
    load_generation_defaults,
    resolve_model,
)
from engine.core.vllm_options import check_kv_cache_dtype, option_notes
from engine.sdk.errors import ValidationError


@pytest.fixture(scope="module")
def config_only(tiny_llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint's config.json alone: no weights, no tokenizer."""
    folder = tmp_path_factory.mktemp("config-only")
    shutil.copy(tiny_llama_checkpoint / "config.json", folder / "config.json")
    return folder


def test_dummy_load_reads_no_weight_file_and_generates(config_only: Path,
                                                      tiny_llama_checkpoint: Path) -> None:
    from engine.core import LLM, SamplingParams

    assert not list(config_only.glob("*.safetensors"))
    with pytest.raises(ValidationError, match="no \\*.safetensors"):
        list(iter_weights(resolve_model(str(config_only)), torch.float32, progress=False))
    with LLM(str(config_only), load_format="dummy", tokenizer=str(tiny_llama_checkpoint),
             dtype="float32", num_kv_blocks=16, plugins="none", in_process=True) as llm:
        weights = [p for p in llm.llm_engine.core.executor.worker.model.parameters()
                   if p.is_floating_point()]
        assert all(p.abs().max() <= 1e-3 for p in weights)
        output = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True),
                              use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 4


def test_dummy_weights_are_small_uniform_zero_for_integers_and_repeatable() -> None:
    def build() -> nn.Module:
        model = nn.Linear(64, 32)
        model.register_parameter("packed", nn.Parameter(
            torch.full((8,), 7, dtype=torch.uint8), requires_grad=False))
        initialize_dummy_weights(model)
        return model

    first, second = build(), build()
    assert 0 < first.weight.abs().max() <= 1e-3
    assert first.weight.std() > 1e-4  # not all equal
    assert torch.equal(first.packed, torch.zeros(8, dtype=torch.uint8))
    assert torch.equal(first.weight, second.weight)
    assert list(DummyWeights()) == []


def test_dummy_weights_come_from_iter_weights(config_only: Path) -> None:
    weights = iter_weights(resolve_model(str(config_only), load_format="dummy"), torch.float32)
    assert isinstance(weights, DummyWeights)


@pytest.mark.parametrize(("load_format", "kind", "words"), [
    ("gguf", "hf", "--load-format gguf reads a .gguf file, but the model"),
    ("safetensors", "gguf", "--load-format safetensors reads a Hugging Face directory"),
])
def test_load_format_must_match_the_model(load_format: str, kind: str, words: str,
                                          config_only: Path) -> None:
    model = str(config_only) if kind == "hf" else None  # None: the built-in GGUF model
    with pytest.raises(ValidationError, match=words) as info:
        resolve_model(model, load_format=load_format)
    assert info.value.param == "load_format"
    assert "--load-format auto" in str(info.value)


@pytest.mark.parametrize(("value", "words"), [
    ("pt", "only safetensors are read here"),
    ("bitsandbytes", "--quantization NAME"),
    ("sharded_state", "--tensor-parallel-size"),
    ("nonsense", "is not one of: auto, safetensors, gguf, dummy"),
])
def test_unusable_load_formats_say_why(value: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        EngineConfig(load_format=value)


def test_tokenizer_must_be_local(tmp_path: Path) -> None:
    source = resolve_model(None, tokenizer=str(tmp_path))
    assert source.tokenizer_source.path == tmp_path.resolve()
    assert resolve_model(None).tokenizer_source == resolve_model(None)
    with pytest.raises(ValidationError, match="not a local directory") as info:
        resolve_model(None, tokenizer="org/some-hub-name")
    assert info.value.param == "tokenizer"


def _with_generation_config(folder: Path, values: dict[str, object]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


def test_generation_config_auto_vllm_and_folder(tmp_path: Path) -> None:
    model = _with_generation_config(tmp_path / "model", {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_new_tokens": 12, "do_sample": True,
        "eos_token_id": [2, 3]})
    other = _with_generation_config(tmp_path / "other", {"temperature": 0.3})
    source = resolve_model(str(model))
    auto = load_generation_defaults(source, "auto")
    assert dict(auto.values) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                 "repetition_penalty": 1.1, "max_tokens": 12}
    assert load_generation_defaults(source, "vllm").values == {}
    assert dict(load_generation_defaults(source, str(other)).values) == {"temperature": 0.3}
    # Given values win; then the file's; then the caller's fallback; then SamplingParams'.
    params = auto.sampling_params({"temperature": 0.0, "top_p": None}, {"max_tokens": 64})
    assert (params.temperature, params.top_p, params.max_tokens) == (0.0, 0.9, 12)
    assert load_generation_defaults(source, "vllm").sampling_params(
        {}, {"max_tokens": 64}).max_tokens == 64


def test_generation_config_auto_without_a_file_is_the_engine_defaults(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert load_generation_defaults(resolve_model(str(tmp_path)), "auto").values == {}


@pytest.mark.parametrize(("values", "folder_name", "words"), [
    ({"temperature": -1}, "model", "temperature must be a number >= 0"),
    ({"top_k": 2.5}, "model", "top_k must be an integer"),
    (None, "missing", "is not a folder"),
    (None, "empty", "has no generation_config.json"),
])
def test_bad_generation_config_is_refused(tmp_path: Path, values: dict[str, object] | None,
                                          folder_name: str, words: str) -> None:
    if values is not None:
        _with_generation_config(tmp_path / folder_name, values)
    if folder_name == "empty":
        (tmp_path / "empty").mkdir()
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    with pytest.raises(ValidationError, match=words) as info:
        load_generation_defaults(resolve_model(str(tmp_path / "base")),
                                 str(tmp_path / folder_name))
    assert info.value.param == "generation_config"


def test_vllm_dtype_spellings() -> None:
    assert EngineConfig(dtype="half").dtype == "float16"
    assert EngineConfig(dtype="float").dtype == "float32"
    assert EngineConfig(dtype="bfloat16").dtype == "bfloat16"


def test_kv_cache_dtype_is_the_model_dtype_or_refused() -> None:
    check_kv_cache_dtype("auto", "bfloat16")
    check_kv_cache_dtype("bfloat16", "bfloat16")
    with pytest.raises(ValidationError, match="--dtype float16 to run the whole model"):
        check_kv_cache_dtype("float16", "bfloat16")
    with pytest.raises(ValueError, match="no attention backend here reads an 8-bit KV cache"):
        EngineConfig(kv_cache_dtype="fp8_e4m3")


def test_options_that_change_nothing_say_so() -> None:
    config = EngineConfig(trust_remote_code=True, gpu_memory_utilization=0.85)
    remote, memory = option_notes(config, "cpu")
    assert remote.startswith("--trust-remote-code: would let transformers run Python code")
    assert "never runs checkpoint code" in remote
    assert memory.startswith("--gpu-memory-utilization 0.85: would size the KV cache")
    assert "on a CPU" in memory and "--kv-cache-memory" in memory
    assert option_notes(config, "cuda") == [remote]  # on CUDA it sizes the cache
    explicit = EngineConfig(gpu_memory_utilization=0.85, kv_cache_memory=4)
    assert "--kv-cache-memory is given and wins" in option_notes(explicit, "cuda")[0]
    assert option_notes(EngineConfig(), "cpu") == []
    with pytest.raises(ValueError, match="less than or equal to 1"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_notes_and_generation_defaults_are_logged_at_startup(
        tmp_path: Path, tiny_llama_checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    from engine.core.startup import prepare

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_checkpoint, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    with caplog.at_level(logging.WARNING, logger="engine"):
        setup = prepare(EngineConfig(model=str(model), trust_remote_code=True, plugins="none"))
    assert dict(setup.generation_defaults.values) == {"temperature": 0.7}
    assert any(r.getMessage().startswith("--trust-remote-code: would") for r in caplog.records)
    assert any("temperature=0.7" in r.getMessage() and "--generation-config vllm"
               in r.getMessage() for r in caplog.records)
