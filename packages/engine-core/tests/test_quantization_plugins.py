"""Selecting a quantization method: by flag, by the checkpoint, by a settings file; errors.

``engine-test-plugin-quant`` provides ``test_quant_fp16`` (linear weights stored in
float16) and the kernel of its scheme. Each test proves the method is reached (its
counters move, its weights are float16) and selective (runs that do not select it leave
both untouched), and that every failure is reported at start-up, before a weight is read.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core import LLM
from engine.core.config import EngineConfig
from engine.core.startup import prepare
from engine.sdk import PluginError, SamplingParams, UnsupportedError, ValidationError

DIST = "engine-test-plugin-quant"
NAME = "test_quant_fp16"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(3, 20)), [5, 9, 4, 7] * 5]
LINEARS = 8  # 2 layers x (qkv, o, gate_up, down); not the embedding, not the LM head


@contextmanager
def calls() -> Iterator[Counter[str]]:
    """What the plugin counted inside the block (filled in at its end)."""
    from engine_test_plugin_quant.counters import CALLS

    before = Counter(CALLS)
    diff: Counter[str] = Counter()
    yield diff
    diff.update({k: v - before[k] for k, v in CALLS.items() if v != before[k]})


def llm(path: Path, **kwargs: Any) -> LLM:
    kwargs.setdefault("plugins", DIST)
    kwargs.setdefault("dtype", "float32")
    return LLM(str(path), in_process=True, num_kv_blocks=64, **kwargs)


def greedy(engine: LLM) -> list[list[int]]:
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                              use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def with_settings(tiny_llama: Path, tmp_path: Path, settings: dict[str, Any] | None = None,
                  files: dict[str, Any] | None = None) -> Path:
    """A copy of the tiny checkpoint with ``quantization_config`` and/or extra JSON files."""
    path = shutil.copytree(tiny_llama, tmp_path / "checkpoint")
    if settings is not None:
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = settings
        (path / "config.json").write_text(json.dumps(config))
    for name, content in (files or {}).items():
        (path / name).write_text(json.dumps(content))
    return path


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    with LLM(str(tiny_llama), dtype="float32", in_process=True, num_kv_blocks=64,
             plugins="none") as engine:
        return greedy(engine)


def test_selected_by_flag(tiny_llama: Path, plugins_on_path: Path,
                          reference: list[list[int]]) -> None:
    with calls() as counted, llm(tiny_llama, quantization=NAME) as engine:
        assert greedy(engine) == reference  # float16 weights of this model: same tokens
        setup = engine.llm_engine.setup
        model = engine.llm_engine.core.worker.model
        assert setup.quantization is not None and setup.quantization.origin == "--quantization"
        assert setup.quantization.settings == {}
        assert model.layers[0].mlp.down_proj.weight.dtype == torch.float16
        assert model.lm_head.weight.dtype == torch.float32  # kind lm_head: None
        assert type(model.layers[0].mlp.down_proj.quant_method.kernel).__name__ == (
            "HalfWeightKernel")
    assert counted[f"{NAME}.from_config"] == 1 and counted[f"{NAME}.is_supported"] >= 1
    assert counted[f"{NAME}.create_weights"] == LINEARS
    assert counted[f"{NAME}.process_weights_after_loading"] == LINEARS
    assert counted["test_quant_fp16_matmul.process_weights_after_loading"] == LINEARS
    steps = counted[f"{NAME}.apply"] // LINEARS
    assert steps > 0 and counted[f"{NAME}.apply"] == steps * LINEARS
    assert counted["test_quant_fp16_matmul.apply"] == counted[f"{NAME}.apply"]
    # every linear layer, the LM head and the embedding were asked
    assert counted[f"{NAME}.get_quant_method"] == LINEARS + 2


def test_not_selected_is_untouched(tiny_llama: Path, plugins_on_path: Path,
                                   reference: list[list[int]]) -> None:
    with calls() as counted, llm(tiny_llama) as engine:  # allowed, not selected
        assert engine.llm_engine.setup.quantization is None
        assert greedy(engine) == reference
        assert engine.llm_engine.core.worker.model.layers[0].mlp.down_proj.weight.dtype == (
            torch.float32)
    assert not any(key.startswith(f"{NAME}.") for key in counted)
    assert counted["test_quant_fp16_matmul.apply"] == 0


def test_selected_by_the_checkpoints_quant_method(tiny_llama: Path, tmp_path: Path,
                                                  plugins_on_path: Path) -> None:
    settings = {"quant_method": NAME, "skip": ["down_proj"]}
    path = with_settings(tiny_llama, tmp_path, settings)
    with calls() as counted, llm(path) as engine:
        setup = engine.llm_engine.setup
        assert setup.quantization is not None and setup.quantization.name == NAME
        assert setup.quantization.origin == "config.json quantization_config"
        assert setup.quantization.settings == settings
        layer = engine.llm_engine.core.worker.model.layers[1]
        assert layer.mlp.down_proj.weight.dtype == torch.float32  # the skip setting arrived
        assert layer.mlp.gate_up_proj.weight.dtype == torch.float16
        greedy(engine)
    assert counted[f"{NAME}.create_weights"] == LINEARS - 2
    # The flag wins, and the method it names gets the checkpoint's settings: int8 (online)
    # refuses a checkpoint quantized with another method rather than stacking on it.
    with calls() as counted, pytest.raises(ValidationError, match="quantized with "
                                                                  f"{NAME!r}"):
        llm(path, quantization="int8")
    assert not counted


def test_selected_by_a_settings_file(tiny_llama: Path, tmp_path: Path,
                                     plugins_on_path: Path) -> None:
    path = with_settings(tiny_llama, tmp_path, files={f"{NAME}.json": {"skip": ["qkv_proj"]}})
    with calls() as counted, llm(path) as engine:
        setup = engine.llm_engine.setup
        assert setup.quantization is not None and setup.quantization.origin == f"{NAME}.json"
        model = engine.llm_engine.core.worker.model
        assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
        assert model.layers[0].self_attn.o_proj.weight.dtype == torch.float16
    assert counted[f"{NAME}.create_weights"] == LINEARS - 2


@pytest.mark.slow
def test_shards_reach_the_method_on_every_rank(tiny_llama: Path, tmp_path: Path,
                                               plugins_on_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               reference: list[list[int]]) -> None:
    log = tmp_path / "create_weights.jsonl"
    monkeypatch.setenv("ENGINE_TEST_QUANT_LOG", str(log))
    with llm(tiny_llama, quantization=NAME, tensor_parallel_size=2) as engine:
        assert greedy(engine) == reference
    records = [json.loads(line) for line in log.read_text().splitlines()]
    by_rank = {(r["tp_rank"], r["prefix"]): r for r in records if r["tp_size"] == 2}
    assert len(by_rank) == 2 * LINEARS  # worker processes, both ranks
    for rank in (0, 1):
        assert by_rank[rank, "model.layers.0.mlp.gate_up_proj"]["shape"] == [128, 64]
        assert by_rank[rank, "model.layers.0.mlp.down_proj"]["shape"] == [64, 64]
        assert by_rank[rank, "model.layers.0.self_attn.qkv_proj"]["parallel"] == "column"
        assert by_rank[rank, "model.layers.0.self_attn.o_proj"]["shape"] == [64, 32]


# -- errors, all at start-up -----------------------------------------------------------------


def test_unknown_quant_method_lists_the_installed_ones(tiny_llama: Path, tmp_path: Path,
                                                       plugins_on_path: Path) -> None:
    path = with_settings(tiny_llama, tmp_path, {"quant_method": "awq", "bits": 4})
    with calls() as counted, pytest.raises(PluginError) as info:
        llm(path)
    message = str(info.value)
    assert "quantized with quant_method 'awq' (config.json quantization_config)" in message
    assert f"Installed: gguf, int8, {NAME}." in message
    assert not counted  # nothing of any method ran
    with pytest.raises(PluginError, match="Installed: gguf, int8\\."):
        llm(path, plugins="none")


def test_installed_but_not_allowed_says_why(tiny_llama: Path, tmp_path: Path,
                                            plugins_on_path: Path) -> None:
    path = with_settings(tiny_llama, tmp_path, {"quant_method": NAME})
    with pytest.raises(PluginError) as info:
        llm(path, plugins="none")
    assert f"quant_method {NAME!r}" in str(info.value)
    assert "installed but not allowed: --plugins=none" in str(info.value)


@pytest.mark.parametrize("method", ["", "engine_test_plugin_quant.method:HalfWeightConfig", 3])
def test_a_checkpoint_names_an_entry_only(tiny_llama: Path, tmp_path: Path, method: Any,
                                          plugins_on_path: Path) -> None:
    path = with_settings(tiny_llama, tmp_path, {"quant_method": method})
    with pytest.raises(ValidationError, match="quant_method must be the name of an "
                                              "engine.quantization method"):
        prepare(EngineConfig(model=str(path), plugins=DIST))


def test_unknown_flag_lists_the_available_ones(tiny_llama: Path, plugins_on_path: Path) -> None:
    with pytest.raises(PluginError, match=f"no plugin named 'awq' in group engine.quantization. "
                                          f"Available: gguf, int8, {NAME}"):
        prepare(EngineConfig(model=str(tiny_llama), quantization="awq", plugins=DIST))


def test_unsupported_platform_and_dtype_stop_before_loading(
        tiny_llama: Path, plugins_on_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with calls() as counted, pytest.raises(UnsupportedError) as info:
        llm(tiny_llama, quantization=NAME, dtype="float16")
    assert info.value.reasons == ((NAME, "activation dtype float16 is not supported; "
                                         "supported: float32, bfloat16"),)
    monkeypatch.setenv("ENGINE_TEST_QUANT_UNSUPPORTED", "1")
    with pytest.raises(UnsupportedError) as info:
        llm(tiny_llama, quantization=NAME)
    assert f"quantization method {NAME!r} (from --quantization) cannot run on platform cpu" in (
        str(info.value))
    assert info.value.reasons == ((NAME, "switched off by ENGINE_TEST_QUANT_UNSUPPORTED"),)
    assert counted[f"{NAME}.from_config"] == 0 and counted[f"{NAME}.create_weights"] == 0


def test_bad_settings_name_the_key(tiny_llama: Path, tmp_path: Path,
                                   plugins_on_path: Path) -> None:
    path = with_settings(tiny_llama, tmp_path, {"quant_method": NAME, "skip": "o_proj"})
    with calls() as counted, pytest.raises(ValidationError) as info:
        llm(path)
    assert info.value.param == "skip"
    assert f"quantization method {NAME!r}: skip must be a list of strings" in str(info.value)
    assert "(settings from config.json quantization_config)" in str(info.value)
    assert counted[f"{NAME}.create_weights"] == 0
