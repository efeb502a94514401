"""GGUF files of qwen3, qwen3moe, phi3, llama.cpp's Mixtral layout, gemma2 and gemma3.

Each file is written from a tiny Hugging Face checkpoint as llama.cpp's converter writes it
(``engine.testing.gguf_writer``: gguf's own name table, stacked experts, permuted Llama
q/k rows, Gemma's ``1 + w`` norms, the converter's metadata keys). Then:

* the config built from the metadata equals the checkpoint's where it matters;
* the tensors loaded back equal the checkpoint's (F32 exactly, F16 rounded once; stacked
  experts equal the per-expert tensors stacked);
* the engine on the F32 file gives transformers' logits (1e-4) and greedy tokens on the
  checkpoint; on a Q8_0 file, dequantized and with ``--quantization gguf`` (the
  matrices kept as Q8_0 blocks; the experts dequantized at load), transformers' on the
  checkpoint with every matrix rounded through Q8_0 (``round_trip_checkpoint``);
* Gemma 2/3: config, names and values only (the tensors also equal what transformers' own
  GGUF loader makes of the file); served end to end in ``test_gguf_gemma``;
* what cannot load fails with a reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file
from transformers import AutoConfig, Gemma2Config, Gemma3TextConfig, PretrainedConfig

from engine.core.distributed import Slice, TensorParallelGroup
from engine.core.model_executor.layers.builtin_ops import FusedMoE
from engine.core.model_executor.layers.fused_moe import MoELayer
from engine.core.model_executor.models.mixtral import MixtralForCausalLM
from engine.core.model_executor.models.phi3 import Phi3ForCausalLM
from engine.core.model_executor.models.qwen3 import Qwen3ForCausalLM
from engine.core.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.core.model_loader import iter_gguf_weights, load_gguf_config
from engine.sdk.errors import UnsupportedError
from engine.testing.gguf_checks import gguf_checks, gguf_files
from engine.testing.gguf_writer import (
    round_trip_checkpoint,
    write_checkpoint_gguf,
    write_gguf,
)
from engine.testing.models import build_tiny_checkpoint

#: kind -> (build_tiny_checkpoint overrides, engine class). Qwen3-MoE as llama.cpp can
#: write and run it: every layer sparse (its qwen3moe has no dense MLP tensors), top-k
#: weights renormalised (its graph always does; the released models' configs say so too),
#: experts of 64 (whole Q8_0 blocks in ``ffn_down_exps``' rows).
KINDS: dict[str, tuple[dict[str, Any], type]] = {
    "qwen3": ({}, Qwen3ForCausalLM),
    "qwen3_moe": ({"mlp_only_layers": [], "moe_intermediate_size": 64, "norm_topk_prob": True},
                  Qwen3MoeForCausalLM),
    "phi3": ({}, Phi3ForCausalLM),
    "mixtral": ({}, MixtralForCausalLM),
}

EXPECTED_ARCH = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "phi3": "phi3",
                 "mixtral": "llama"}


@pytest.fixture(scope="module", params=sorted(KINDS))
def files(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, Any]:
    kind = request.param
    overrides, cls = KINDS[kind]
    return gguf_files(tmp_path_factory.mktemp(f"gguf_{kind}"), kind, cls, overrides, f16=True)




def hf_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, per-expert tensors stacked under the name without ``J.``."""
    state = load_file(checkpoint / "model.safetensors")
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, tensor in state.items():
        head, found, rest = name.partition(".experts.")
        if found:
            expert, _, leaf = rest.partition(".")
            stacked.setdefault(f"{head}.experts.{leaf}", {})[int(expert)] = tensor
        else:
            out[name] = tensor
    for name, by_expert in stacked.items():
        out[name] = torch.stack([by_expert[j] for j in sorted(by_expert)])
    return out


def same(got: Any, want: Any) -> bool:
    """Equal; floats within float32 rounding (GGUF stores metadata floats as float32)."""
    if isinstance(want, float):
        return bool(got == pytest.approx(want, rel=1e-6))
    return bool(got == want)


def test_config(files: dict[str, Any]) -> None:
    config = load_gguf_config(files["f32"])
    reference = AutoConfig.from_pretrained(files["hf"])
    assert gguf.GGUFReader(str(files["f32"])).fields["general.architecture"].contents() == (
        EXPECTED_ARCH[files["kind"]])
    assert type(config) is type(reference)
    assert config.architectures == reference.architectures
    keys = ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "tie_word_embeddings", "rms_norm_eps",
            "max_position_embeddings", "bos_token_id", "eos_token_id", "rope_parameters"]
    keys += {"qwen3": ["head_dim"],
             "qwen3_moe": ["head_dim", "num_experts", "num_experts_per_tok",
                           "moe_intermediate_size", "mlp_only_layers", "decoder_sparse_step",
                           "norm_topk_prob"],
             "phi3": ["original_max_position_embeddings", "sliding_window"],
             "mixtral": ["num_local_experts", "num_experts_per_tok", "sliding_window"],
             }[files["kind"]]
    for key in keys:
        assert same(getattr(config, key), getattr(reference, key)), key
    if files["kind"] == "phi3":
        assert config.partial_rotary_factor == 1.0


def test_weights(files: dict[str, Any]) -> None:
    expected = hf_state(files["hf"])
    if AutoConfig.from_pretrained(files["hf"]).tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    loaded = dict(iter_gguf_weights(files["f32"], torch.float32, progress=False))
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    half = dict(iter_gguf_weights(files["f16"], torch.float32, progress=False))
    for name, tensor in expected.items():
        rounded = tensor.half().float() if tensor.dim() > 1 else tensor
        assert torch.equal(half[name], rounded), name


def test_f32_file_equals_transformers(files: dict[str, Any]) -> None:
    gguf_checks(files, "f32", "hf").logits_and_greedy_tokens()


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_q8_0_file_equals_transformers_on_rounded_weights(
        files: dict[str, Any], quantization: str | None) -> None:
    options = {} if quantization is None else {"quantization": "gguf",
                                               "linear_kernel": "gguf_dequant"}
    model = gguf_checks(files, "q8", "q8_reference", **options).logits_and_greedy_tokens()
    attention = model.layers[0].self_attn
    if quantization:
        assert attention.qkv_proj.weight.dtype == torch.uint8  # Q8_0 blocks
        assert attention.o_proj.weight.dtype == torch.uint8
    else:
        assert attention.qkv_proj.weight.dtype == torch.float32
    experts = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert all(m.op.w13.dtype == torch.float32 for m in experts)  # dequantized at load
    assert bool(experts) == (files["kind"] in ("mixtral", "qwen3_moe"))


@pytest.fixture(scope="module")
def per_expert_mixtral(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """llama.cpp's first Mixtral layout: one tensor per expert (``blk.N.ffn_gate.J``)."""
    root = tmp_path_factory.mktemp("gguf_mixtral_per_expert")
    hf = build_tiny_checkpoint(root / "hf", "mixtral")
    return {
        "kind": "mixtral", "cls": MixtralForCausalLM, "hf": hf,
        "f32": write_checkpoint_gguf(root / "f32.gguf", hf, stack_experts=False),
        "q8": write_checkpoint_gguf(root / "q8.gguf", hf, default=QT.Q8_0,
                                    stack_experts=False),
        "q8_reference": round_trip_checkpoint(hf, root / "hf_q8", QT.Q8_0),
    }


def test_per_expert_mixtral_file(per_expert_mixtral: dict[str, Any]) -> None:
    files = per_expert_mixtral
    names = [t.name for t in gguf.GGUFReader(str(files["f32"])).tensors]
    assert "blk.1.ffn_down.3.weight" in names and "blk.1.ffn_down_exps.weight" not in names
    loaded = dict(iter_gguf_weights(files["f32"], torch.float32, progress=False))
    expected = load_file(files["hf"] / "model.safetensors")
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in expected.items())
    gguf_checks(files, "f32", "hf").logits_and_greedy_tokens()
    model = gguf_checks(files, "q8", "q8_reference", quantization="gguf",
                   linear_kernel="gguf_dequant").logits_and_greedy_tokens()
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.uint8
    assert model.layers[0].mlp.experts.op.w13.dtype == torch.float32


def test_phi3_partial_rotary_factor_and_window(tmp_path: Path) -> None:
    # Phi-4-mini rotates part of each head: llama.cpp writes rope.dimension_count.
    from transformers import Phi3Config

    config = Phi3Config(vocab_size=64, hidden_size=64, intermediate_size=64,
                        num_hidden_layers=1, num_attention_heads=4, pad_token_id=0,
                        partial_rotary_factor=0.75, sliding_window=32,
                        max_position_embeddings=128, original_max_position_embeddings=64)
    loaded = load_gguf_config(write_gguf(tmp_path / "p.gguf", config, {}))
    assert loaded.partial_rotary_factor == 0.75
    assert (loaded.sliding_window, loaded.original_max_position_embeddings) == (32, 64)
    config.sliding_window = None  # written as 0
    loaded = load_gguf_config(write_gguf(tmp_path / "p0.gguf", config, {}))
    assert loaded.sliding_window is None


# -- Gemma 2 / 3: the config and the tensors (the engine's models are built elsewhere) -------


def tiny_gemma(kind: str) -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    common: dict[str, Any] = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                              "num_hidden_layers": 7, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "head_dim": 32,
                              "max_position_embeddings": 256, "sliding_window": 16,
                              "query_pre_attn_scalar": 32, "pad_token_id": 0}
    config: PretrainedConfig
    if kind == "gemma2":
        config = Gemma2Config(**common, attn_logit_softcapping=40.0,
                              final_logit_softcapping=20.0)
    else:
        config = Gemma3TextConfig(**common, final_logit_softcapping=25.0, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)  # Gemma's norms are 1 + w: w near 0
    return config, dict(model.state_dict())


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_config_names_and_norms(tmp_path: Path, kind: str) -> None:
    config, state = tiny_gemma(kind)
    path = write_gguf(tmp_path / f"{kind}.gguf", config, state)
    loaded_config = load_gguf_config(path)
    assert type(loaded_config) is type(config)
    assert loaded_config.architectures == ["Gemma2ForCausalLM" if kind == "gemma2"
                                           else "Gemma3ForCausalLM"]
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "head_dim",
                "num_attention_heads", "num_key_value_heads", "sliding_window",
                "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "layer_types", "rope_parameters", "tie_word_embeddings", "rms_norm_eps"):
        assert same(getattr(loaded_config, key), getattr(config, key)), key
    reader = gguf.GGUFReader(str(path))
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    norm = state["model.layers.0.pre_feedforward_layernorm.weight"].numpy()
    assert np.array_equal(stored["blk.0.ffn_norm.weight"], norm + 1)  # llama.cpp: 1 + w
    loaded = dict(iter_gguf_weights(path, torch.float32, progress=False))
    expected = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        if name.endswith("norm.weight"):  # (1 + w) - 1: w within float32 rounding of 1 + w
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=1e-7)
        else:
            assert torch.equal(loaded[name], tensor), name
    # transformers' own GGUF loader (which also subtracts 1 from Gemma's norms) agrees.
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                     dtype=torch.float32).state_dict()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, reference[name]), name


def test_gemma_27b_query_scale(tmp_path: Path) -> None:
    # llama.cpp scales the 27B models' queries by 1/sqrt(hidden / heads), as their HF
    # configs say (Gemma 2 27B: 46 layers, query_pre_attn_scalar 144 = 4608 / 32).
    config = Gemma2Config(vocab_size=64, hidden_size=128, intermediate_size=64,
                          num_hidden_layers=46, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, pad_token_id=0)
    path = write_gguf(tmp_path / "g.gguf", config, {})
    assert load_gguf_config(path).query_pre_attn_scalar == 32
    config.num_hidden_layers = 45
    path = write_gguf(tmp_path / "g45.gguf", config, {})
    assert load_gguf_config(path).query_pre_attn_scalar == 16


# -- what cannot load -------------------------------------------------------------------------


def metadata_file(path: Path, arch: str, keys: dict[str, int | bool],
                  tensors: tuple[str, ...]) -> Path:
    """A GGUF file of ``arch`` with integer (or bool) ``keys`` and small zero ``tensors``."""
    writer = gguf.GGUFWriter(str(path), arch)
    base = {"block_count": 2, "embedding_length": 64, "context_length": 64,
            "feed_forward_length": 64, "attention.head_count": 4, "vocab_size": 64}
    for key, value in {**base, **keys}.items():
        if isinstance(value, bool):
            writer.add_bool(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    for name in tensors:
        writer.add_tensor(name, np.zeros((4, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_phi3_long_rope_factors_are_refused(tmp_path: Path) -> None:
    # llama.cpp stores LongRoPE (128k Phi-3) as two tensors and no rope scaling type.
    path = metadata_file(tmp_path / "long.gguf", "phi3", {}, ("rope_factors_long.weight",))
    with pytest.raises(UnsupportedError, match="LongRoPE factors"):
        load_gguf_config(path)


def test_llama_experts_in_some_layers_only_are_refused(tmp_path: Path) -> None:
    path = metadata_file(tmp_path / "partial.gguf", "llama",
                         {"expert_count": 4, "expert_used_count": 2},
                         ("blk.0.ffn_gate_inp.weight",))
    with pytest.raises(UnsupportedError, match=r"layers without experts \(\[1\]\)"):
        load_gguf_config(path)


@pytest.mark.parametrize("norm", [None, False, True])
def test_qwen3moe_dense_layers_and_renormalisation(tmp_path: Path, norm: bool | None) -> None:
    # Layers without a router are dense (mlp_only_layers); top-k weights renormalised
    # unless the file says otherwise (llama.cpp's qwen3moe graph always renormalises).
    keys: dict[str, int | bool] = {"block_count": 3, "expert_count": 4,
                                   "expert_used_count": 2, "expert_feed_forward_length": 32}
    if norm is not None:
        keys["expert_weights_norm"] = norm
    path = metadata_file(tmp_path / "moe.gguf", "qwen3moe", keys,
                         ("blk.0.ffn_gate_inp.weight", "blk.2.ffn_gate_inp.weight"))
    config = load_gguf_config(path)
    assert config.mlp_only_layers == [1]
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        4, 2, 32)
    assert config.norm_topk_prob is (True if norm is None else norm)


def test_stacked_expert_tensors_load_and_wrong_shapes_are_refused() -> None:
    # Rank 1 of 2: each expert's second half of the intermediate size, as per-expert loads.
    torch.manual_seed(0)
    w1, w3, w2 = torch.randn(4, 96, 64), torch.randn(4, 96, 64), torch.randn(4, 64, 96)
    layers = [MoELayer(FusedMoE(4, 2, 64, 48, renormalize=True, dtype=torch.float32),
                       "model.layers.0.block_sparse_moe.experts", Slice(48, 48),
                       TensorParallelGroup(1, 2)) for _ in range(2)]
    for name, tensor in (("w1", w1), ("w3", w3), ("w2", w2)):
        layers[0].load_weight(f"{name}.weight", tensor)
        for j in range(4):
            layers[1].load_weight(f"{j}.{name}.weight", tensor[j])
    assert torch.equal(layers[0].op.w13, layers[1].op.w13)
    assert torch.equal(layers[0].op.w2, layers[1].op.w2)
    assert torch.equal(layers[0].op.w13[:, :48], w1[:, 48:])
    assert torch.equal(layers[0].op.w2, w2[..., 48:])
    layer = layers[0]
    with pytest.raises(ValueError, match=r"has shape \(3, 64, 96\), the model expects "
                                         r"\(4, 64, 96\)"):
        layer.load_weight("w2.weight", torch.ones(3, 64, 96))
    with pytest.raises(ValueError, match="without J: every expert stacked"):
        layer.load_weight("w5.weight", torch.ones(4, 64, 96))
