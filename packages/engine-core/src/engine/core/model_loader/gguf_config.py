"""A Hugging Face config built from a GGUF file's metadata (llama.cpp key names).

llama.cpp stores the model's hyper-parameters under ``<arch>.<key>`` (``llama.block_count``,
``llama.attention.head_count``, ...). :func:`gguf_config_from_reader` turns them into the
``transformers`` config class of the same architecture, so the rest of the engine sees one
kind of config whether the checkpoint was a Hugging Face directory or a GGUF file.

Supported architectures (``general.architecture``, see
:mod:`~engine.core.model_loader.gguf_architectures`): ``llama`` (Llama 2/3, Mistral, SmolLM,
...; with ``llama.expert_count``: Mixtral), ``qwen2``, ``qwen3``, ``qwen3moe``, ``phi3``,
``gemma2`` and ``gemma3``.
"""

from __future__ import annotations

from typing import Any

import transformers
from gguf import GGUFReader
from transformers import PretrainedConfig

from engine.core.model_loader._gguf_reader import array_length, get_value, tensor_names
from engine.core.model_loader.gguf_architectures import (
    GGUF_ARCHITECTURES,
    GGUFArchitecture,
    resolve_architecture,
)
from engine.sdk.errors import UnsupportedError


def gguf_architecture(reader: GGUFReader) -> tuple[str, GGUFArchitecture]:
    """The file's ``general.architecture`` and its mapping.

    Raises:
        UnsupportedError: The architecture is missing or not in :data:`GGUF_ARCHITECTURES`.
    """
    arch = get_value(reader, "general.architecture")
    mapping = resolve_architecture(str(arch), get_value(reader, f"{arch}.expert_count"))
    if mapping is None:
        supported = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise UnsupportedError(
            f"GGUF architecture {arch!r} is not supported (supported: {supported}; "
            f"llama with llama.expert_count: Mixtral)"
        )
    return str(arch), mapping


def _required(reader: GGUFReader, key: str) -> Any:
    value = get_value(reader, key)
    if value is None:
        raise UnsupportedError(f"the GGUF file has no {key!r} metadata, which is required")
    return value


def _per_model(value: Any, key: str) -> int:
    """A count that llama.cpp may store per layer (a list); it must be the same everywhere."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise UnsupportedError(f"{key!r} differs between layers ({value!r}); not supported")
        return int(value[0])
    return int(value)


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    prefix = f"{arch}.rope.scaling."
    kind = get_value(reader, prefix + "type")
    factor = get_value(reader, prefix + "factor")
    if kind is None and get_value(reader, f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", get_value(reader, f"{arch}.rope.scale_linear")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        original = get_value(reader, prefix + "original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (
            ("attn_factor", "attention_factor"),
            ("yarn_beta_fast", "beta_fast"),
            ("yarn_beta_slow", "beta_slow"),
        ):
            value = get_value(reader, prefix + gguf_key)
            if value is not None:
                scaling[hf_key] = float(value)
        return scaling
    raise UnsupportedError(f"GGUF rope scaling type {kind!r} is not supported (linear, yarn)")


def _special_ids(reader: GGUFReader) -> dict[str, int]:
    ids = {}
    for name, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("pad", "padding_token_id"),
    ):
        value = get_value(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            ids[f"{name}_token_id"] = int(value)
    return ids


def _vocab_size(reader: GGUFReader, arch: str) -> int:
    """The embedding's rows; else ``<arch>.vocab_size``; else the tokenizer's token count.

    The embedding first: llama.cpp's gemma3 converter drops the rows past the tokenizer's
    vocabulary (262208 -> 262144), which the model's table must match.
    """
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF dims are [hidden, vocab]
    value = get_value(reader, f"{arch}.vocab_size")
    if value is not None:
        return int(value)
    tokens = array_length(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise UnsupportedError("the GGUF file states no vocabulary size")
    return tokens


def gguf_config_from_reader(reader: GGUFReader) -> PretrainedConfig:
    """Build the ``transformers`` config described by an open GGUF file's metadata.

    Args:
        reader: The open file (see :func:`~engine.core.model_loader.gguf_loader.open_gguf`).

    Returns:
        A config of the architecture's class (e.g. ``transformers.LlamaConfig``) with
        layer count, sizes, head counts, head size (``attention.key_length``), rope base and
        scaling, RMS-norm epsilon, context length, vocabulary size, ``tie_word_embeddings``
        (true when the file has no ``output.weight``), the bos/eos/pad ids, and what the
        architecture adds (:func:`_architecture_settings`: experts, Phi-3's partial rotary
        factor and window, Gemma's soft-capping, windows and query scale).

    Raises:
        UnsupportedError: The architecture, a per-layer head count, partial rotary
            embeddings (but for phi3), the rope scaling type or a layout the engine's model
            cannot express is not supported, or a required key is missing.
    """
    arch, mapping = gguf_architecture(reader)
    p = f"{arch}."
    hidden_size = int(_required(reader, p + "embedding_length"))
    num_heads = _per_model(_required(reader, p + "attention.head_count"), "head_count")
    num_kv_heads = _per_model(get_value(reader, p + "attention.head_count_kv", num_heads), "kv")
    head_dim = int(get_value(reader, p + "attention.key_length", hidden_size // num_heads))
    rope_dim = get_value(reader, p + "rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim and arch != "phi3":
        raise UnsupportedError(
            f"partial rotary embeddings (rope.dimension_count={rope_dim}, head size "
            f"{head_dim}) are not supported for GGUF architecture {arch!r} (only phi3)"
        )
    names = set(tensor_names(reader))
    kwargs: dict[str, Any] = {
        "architectures": [mapping.hf_architecture],
        "num_hidden_layers": int(_required(reader, p + "block_count")),
        "hidden_size": hidden_size,
        "intermediate_size": _per_model(_required(reader, p + "feed_forward_length"), "ffn"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rope_theta": float(get_value(reader, p + "rope.freq_base", 10000.0)),
        "vocab_size": _vocab_size(reader, arch),
        "tie_word_embeddings": "output.weight" not in names,
        "pad_token_id": None,
        **_special_ids(reader),
    }
    optional = {
        "rms_norm_eps": get_value(reader, p + "attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": get_value(reader, p + "context_length"),
        "rope_scaling": _rope_scaling(reader, arch),
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
    kwargs.update(_architecture_settings(reader, arch, mapping, kwargs, names))
    config_class = getattr(transformers, mapping.config_class)
    config: PretrainedConfig = config_class(**kwargs)
    return config


def _architecture_settings(reader: GGUFReader, arch: str, mapping: GGUFArchitecture,
                           common: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The config values an architecture adds to (or changes in) the common ones."""
    p = f"{arch}."
    layers = int(common["num_hidden_layers"])
    if mapping.stacked_experts:
        return _expert_settings(reader, arch, mapping, layers, names)
    if arch == "phi3":
        return _phi3_settings(reader, common, names)
    if arch in ("gemma2", "gemma3"):
        # llama.cpp scales queries by 1/sqrt(head size), but 1/sqrt(hidden / heads) for the
        # 27B models (Gemma 2: 46 layers, Gemma 3: 62), as their HF configs'
        # query_pre_attn_scalar say.
        big = layers == (46 if arch == "gemma2" else 62)
        window = get_value(reader, p + "attention.sliding_window")
        settings: dict[str, Any] = {
            "query_pre_attn_scalar": (common["hidden_size"] // common["num_attention_heads"]
                                      if big else common["head_dim"]),
            "sliding_window": int(window) if window else None,
        }
        if arch == "gemma2":
            for key in ("attn_logit_softcapping", "final_logit_softcapping"):
                value = get_value(reader, p + key)
                settings[key] = None if value is None else float(value)
            return settings
        return settings | _gemma3_rope_and_layers(reader, layers)
    return {}


def _expert_settings(reader: GGUFReader, arch: str, mapping: GGUFArchitecture, layers: int,
                     names: set[str]) -> dict[str, Any]:
    """Mixtral (``llama`` with experts) and Qwen3-MoE: expert counts and sizes, routing."""
    p = f"{arch}."
    experts = int(_required(reader, p + "expert_count"))
    used = int(_required(reader, p + "expert_used_count"))
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
    if mapping.config_class == "MixtralConfig":
        if len(sparse) != layers:
            dense = sorted(set(range(layers)) - set(sparse))
            raise UnsupportedError(
                f"GGUF llama file with {experts} experts has layers without experts "
                f"({dense}); Mixtral needs experts in every layer")
        size = get_value(reader, p + "expert_feed_forward_length")
        settings: dict[str, Any] = {"num_local_experts": experts, "num_experts_per_tok": used,
                                    "sliding_window": None}
        if size is not None:
            settings["intermediate_size"] = int(size)
        return settings
    # Qwen3-MoE. llama.cpp's qwen3moe graph always renormalises the top-k weights (as
    # transformers' GGUF loader assumes); a file may say otherwise in expert_weights_norm.
    norm = get_value(reader, p + "expert_weights_norm")
    return {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(_required(reader, p + "expert_feed_forward_length")),
        "norm_topk_prob": True if norm is None else bool(norm),
        "decoder_sparse_step": 1,
        # Layers written without a router have a dense MLP (``mlp_only_layers``).
        "mlp_only_layers": [i for i in range(layers) if i not in sparse],
    }


def _phi3_settings(reader: GGUFReader, common: dict[str, Any], names: set[str]
                   ) -> dict[str, Any]:
    """Phi-3: partial rotary factor, sliding window (0: none), original context length."""
    if "rope_factors_long.weight" in names or "rope_factors_short.weight" in names:
        raise UnsupportedError(
            "this phi3 GGUF file carries LongRoPE factors (rope_factors_long/short: the "
            "128k-context Phi-3, Phi-3.5 and Phi-4-mini models), which are not supported; "
            "supported: Phi-3 files without them (e.g. Phi-3-mini-4k)")
    rope_dim = get_value(reader, "phi3.rope.dimension_count")
    window = get_value(reader, "phi3.attention.sliding_window")
    original = get_value(reader, "phi3.rope.scaling.original_context_length")
    settings: dict[str, Any] = {
        "partial_rotary_factor": 1.0 if rope_dim is None else int(rope_dim) / common[
            "head_dim"],
        "sliding_window": int(window) if window else None,
    }
    if original is not None:
        settings["original_max_position_embeddings"] = int(original)
    return settings


def _gemma3_rope_and_layers(reader: GGUFReader, layers: int) -> dict[str, Any]:
    """Gemma 3: the sliding layers' rope base and which layers slide.

    llama.cpp's gemma3 graph uses a base of 10000 for sliding layers (``rope.freq_base_swa``
    when the file states one) and slides five layers of every six unless the file lists
    ``attention.sliding_window_pattern`` per layer.
    """
    pattern = get_value(reader, "gemma3.attention.sliding_window_pattern")
    softcap = get_value(reader, "gemma3.final_logit_softcapping")
    settings: dict[str, Any] = {
        "rope_local_base_freq": float(get_value(reader, "gemma3.rope.freq_base_swa", 10000.0)),
        "final_logit_softcapping": None if softcap is None else float(softcap),
        "attn_logit_softcapping": None,
    }
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise UnsupportedError(f"gemma3.attention.sliding_window_pattern lists "
                                   f"{len(pattern)} layers, the file has {layers}")
        settings["layer_types"] = ["sliding_attention" if slide else "full_attention"
                                   for slide in pattern]
    elif pattern is not None:
        settings["sliding_window_pattern"] = int(pattern)
    return settings
