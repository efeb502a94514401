"""A Hugging Face checkpoint written as llama.cpp's ``convert_hf_to_gguf.py`` writes it.

The one converter of the GGUF tests (loader, ``gguf`` quantization, architectures). The
file's metadata, names and tensor layout follow llama.cpp's converter, not the engine's
loader, so a test that loads the file back checks the loader's mapping:

* tensor names come from ``gguf``'s own table (``gguf.get_tensor_name_map``, the one the
  converter uses), never from the engine;
* ``llama`` files (Llama, Mistral, Mixtral) get their ``attn_q``/``attn_k`` rows permuted
  as the converter's ``LlamaModel.permute`` does;
* Mixtral's and Qwen3-MoE's per-expert tensors are stacked per layer into ``[E, ...]``
  (``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``), as the converter merges them;
* Gemma's norm weights are stored as ``1 + w``;
* the metadata keys are the converter's for each architecture (see :func:`_metadata`).

Storage types: every matrix (and stacked expert tensor) as ``types[<gguf module>]`` or
``default``; vectors (norms, biases) always F32, as llama.cpp keeps them.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

#: ``config.model_type`` -> llama.cpp architecture.
ARCHITECTURES = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mistral": gguf.MODEL_ARCH.LLAMA,
    "mixtral": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
}

_EXPERT = re.compile(r"^(model\.layers\.\d+\.(?:block_sparse_moe|mlp)\.experts)\.(\d+)\.(\w+)"
                     r"\.weight$")


def rope_theta(config: Any) -> float:
    """The (global) rope base of a transformers 5 config."""
    params = dict(config.rope_parameters)
    params = params.get("full_attention", params)
    return float(params["rope_theta"])


def store(array: np.ndarray, qtype: QT) -> tuple[np.ndarray, QT | None]:
    """``(data, raw_dtype)`` for ``GGUFWriter.add_tensor``: ``array`` in type ``qtype``."""
    if qtype == QT.F32:
        return array.astype(np.float32), None
    if qtype == QT.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rows from halves to pairs."""
    pairs = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
    permuted: np.ndarray = pairs.swapaxes(1, 2).reshape(w.shape)
    return permuted


def converter_tensors(config: Any, state: dict[str, torch.Tensor], *,
                      stack_experts: bool = True) -> list[tuple[str, np.ndarray]]:
    """``(gguf name, float32 array)`` of every tensor, as the converter writes them.

    ``stack_experts=False``: one tensor per expert, ``blk.N.ffn_gate.J.weight``, as the
    first llama.cpp Mixtral files had them.
    """
    arch = ARCHITECTURES[config.model_type]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = defaultdict(dict)
    out: list[tuple[str, np.ndarray]] = []
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in state.items():
        if tied and hf_name == "lm_head.weight":
            continue
        data = tensor.float().numpy()
        match = _EXPERT.match(hf_name)
        if match:
            experts[(match.group(1), match.group(3))][int(match.group(2))] = data
            continue
        out.append((_gguf_name(names, hf_name), data))
    for (prefix, proj), by_expert in experts.items():
        stacked_name = _gguf_name(names, f"{prefix}.{proj}.weight")
        if stack_experts:
            out.append((stacked_name, np.stack([by_expert[j] for j in sorted(by_expert)])))
        else:
            head = stacked_name.removesuffix("_exps.weight")
            out.extend((f"{head}.{j}.weight", by_expert[j]) for j in sorted(by_expert))
    converted = []
    for name, data in out:
        if arch == gguf.MODEL_ARCH.LLAMA and ".attn_q." in name:
            data = llama_permute(data, config.num_attention_heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and ".attn_k." in name:
            data = llama_permute(data, config.num_key_value_heads)
        elif arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3) and name.endswith(
                "norm.weight"):
            data = data + 1.0
        converted.append((name, data))
    return converted


def _gguf_name(names: gguf.TensorNameMap, hf_name: str) -> str:
    gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if gguf_name is None:
        raise ValueError(f"llama.cpp has no name for {hf_name!r}")
    return gguf_name


def _metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    """The keys llama.cpp's converter writes for ``config``'s architecture."""
    arch = ARCHITECTURES[config.model_type]
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads)
    if arch != gguf.MODEL_ARCH.PHI3:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_rope_dimension_count(head_dim)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == gguf.MODEL_ARCH.QWEN3MOE:
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == gguf.MODEL_ARCH.PHI3:
        factor = getattr(config, "partial_rotary_factor", None) or 1.0
        writer.add_rope_dimension_count(int(factor * config.hidden_size)
                                        // config.num_attention_heads)
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)
    if arch == gguf.MODEL_ARCH.GEMMA2:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if arch == gguf.MODEL_ARCH.GEMMA3:
        writer.add_sliding_window(config.sliding_window)
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        full = dict(config.rope_parameters["full_attention"])
        if full.get("rope_type", "default") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    for key, setter in (("bos_token_id", writer.add_bos_token_id),
                        ("eos_token_id", writer.add_eos_token_id),
                        ("pad_token_id", writer.add_pad_token_id)):
        value = getattr(config, key, None)
        if isinstance(value, int):
            setter(value)


def write_gguf(path: Path, config: Any, state: dict[str, torch.Tensor], *,
               types: dict[str, QT] | None = None, default: QT = QT.F32,
               extra: dict[str, Any] | None = None, stack_experts: bool = True) -> Path:
    """Write ``state`` (a transformers state dict of ``config``) as a GGUF file at ``path``.

    Args:
        path: The ``.gguf`` file to write.
        config: The transformers config (``model_type`` picks the llama.cpp architecture).
        state: The Hugging Face tensors.
        types: Storage type per GGUF module (``"attn_q"``, ``"ffn_down_exps"``, ...).
        default: The storage type of the other matrices.
        extra: More metadata: ``str`` values as strings, numbers as float32.
        stack_experts: Experts stacked per layer (llama.cpp's converter today), or one
            tensor per expert (its first Mixtral files: ``blk.N.ffn_gate.J.weight``).

    Returns:
        ``path``.
    """
    arch = ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(writer, config)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_float32(key, value)
    for name, data in converter_tensors(config, state, stack_experts=stack_experts):
        module = name.split(".")[2] if name.startswith("blk.") else name.split(".")[0]
        qtype = (types or {}).get(module, default) if data.ndim > 1 else QT.F32
        stored, raw_dtype = store(data, qtype)
        writer.add_tensor(name, stored, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_checkpoint_gguf(path: Path, checkpoint: Path, **kwargs: Any) -> Path:
    """:func:`write_gguf` of a Hugging Face checkpoint directory (config + safetensors)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        state.update(load_file(file))
    return write_gguf(path, config, state, **kwargs)


def round_trip_checkpoint(checkpoint: Path, out: Path, qtype: QT) -> Path:
    """A copy of ``checkpoint`` whose matrices hold what a ``qtype`` GGUF file holds.

    Each matrix goes through ``gguf.quants.quantize`` and ``dequantize`` (the reference a
    quantized GGUF file is checked against); vectors are unchanged. Tokenizer files are
    copied.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for file in checkpoint.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, out / file.name)
    for file in sorted(checkpoint.glob("*.safetensors")):
        state = load_file(file)
        rounded = {}
        for name, tensor in state.items():
            if tensor.dim() < 2:
                rounded[name] = tensor
                continue
            data, raw = store(tensor.float().numpy(), qtype)
            values = data if raw is None else gguf.quants.dequantize(data, raw)
            rounded[name] = torch.from_numpy(np.ascontiguousarray(values, np.float32)).reshape(
                tensor.shape).to(tensor.dtype).contiguous()
        save_file(rounded, str(out / file.name), metadata={"format": "pt"})
    return out
