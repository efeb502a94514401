"""A Hugging Face config built from a GGUF file's metadata (llama.cpp key names).

llama.cpp stores the model's hyper-parameters under ``<arch>.<key>`` (``llama.block_count``,
``llama.attention.head_count``, ...). :func:`gguf_config_from_reader` turns them into the
``transformers`` config class of the same architecture, so the rest of the engine sees one
kind of config whether the checkpoint was a Hugging Face directory or a GGUF file.

Supported architectures (``general.architecture``): ``llama`` (Llama 2/3, Mistral, SmolLM,
...), ``qwen2`` and ``qwen3``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import transformers
from gguf import GGUFReader
from transformers import PretrainedConfig

from engine.core.model_loader._gguf_reader import array_length, get_value, tensor_names
from engine.sdk.errors import UnsupportedError


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one llama.cpp architecture maps to ``transformers``.

    Attributes:
        config_class: The ``transformers`` config class name.
        hf_architecture: The model class name written to ``config.architectures``.
        permutes_qk: Whether llama.cpp's converter permuted the rows of ``attn_q`` /
            ``attn_k`` (it does for the ``llama`` architecture, whose rotary embedding
            rotates interleaved pairs in llama.cpp and halves in ``transformers``).
    """

    config_class: str
    hf_architecture: str
    permutes_qk: bool


GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaConfig", "LlamaForCausalLM", permutes_qk=True),
    "qwen2": GGUFArchitecture("Qwen2Config", "Qwen2ForCausalLM", permutes_qk=False),
    "qwen3": GGUFArchitecture("Qwen3Config", "Qwen3ForCausalLM", permutes_qk=False),
}
"""``general.architecture`` -> how to load it."""


def gguf_architecture(reader: GGUFReader) -> tuple[str, GGUFArchitecture]:
    """The file's ``general.architecture`` and its mapping.

    Raises:
        UnsupportedError: The architecture is missing or not in :data:`GGUF_ARCHITECTURES`.
    """
    arch = get_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise UnsupportedError(
            f"GGUF architecture {arch!r} is not supported (supported: {supported})"
        )
    return arch, GGUF_ARCHITECTURES[arch]


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
    value = get_value(reader, f"{arch}.vocab_size")
    if value is not None:
        return int(value)
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF dims are [hidden, vocab]
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
        layer count, sizes, head counts, head size, rope base and scaling, RMS-norm epsilon,
        context length, vocabulary size, ``tie_word_embeddings`` (true when the file has no
        ``output.weight``) and the bos/eos/pad ids.

    Raises:
        UnsupportedError: The architecture, a per-layer head count, partial rotary
            embeddings or the rope scaling type is not supported, or a required key is
            missing.
    """
    arch, mapping = gguf_architecture(reader)
    p = f"{arch}."
    hidden_size = int(_required(reader, p + "embedding_length"))
    num_heads = _per_model(_required(reader, p + "attention.head_count"), "head_count")
    num_kv_heads = _per_model(get_value(reader, p + "attention.head_count_kv", num_heads), "kv")
    head_dim = int(get_value(reader, p + "attention.key_length", hidden_size // num_heads))
    rope_dim = get_value(reader, p + "rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise UnsupportedError(
            f"partial rotary embeddings (rope.dimension_count={rope_dim}, head size "
            f"{head_dim}) are not supported"
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
    config_class = getattr(transformers, mapping.config_class)
    config: PretrainedConfig = config_class(**kwargs)
    return config
