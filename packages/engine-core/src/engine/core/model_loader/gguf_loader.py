"""Loading a GGUF file (llama.cpp's format): config, dequantized weights with HF names, metadata.

Weights come out exactly as ``transformers`` would load them from the same file:

1. name: ``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight`` (see
   :data:`GGUF_TO_HF_LAYER` and each architecture's table in
   :mod:`~engine.core.model_loader.gguf_architectures`: Phi-3's fused ``attn_qkv`` /
   ``ffn_up`` -> ``qkv_proj`` / ``gate_up_proj``, Gemma's four norms, the stacked experts
   ``blk.N.ffn_{gate,up,down}_exps`` ``[E, ...]`` -> ``...experts.{w1,w3,w2}.weight``
   (Mixtral) or ``...experts.{gate,up,down}_proj.weight`` (Qwen3-MoE), which the engine's
   MoE layer loads stacked; the first Mixtral files' one tensor per expert,
   ``blk.N.ffn_gate.J.weight``, -> ``...experts.J.w1.weight``);
2. values: ``gguf.quants.dequantize`` (numpy) to float32, whatever the storage type
   (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, the IQ types, TQ, MXFP4:
   every type the installed ``gguf`` can dequantize; F64 is added here). Types it cannot
   (gguf 0.19: Q8_1, Q8_K, integer types) fail before anything loads, naming a tensor;
3. shape: GGUF lists dimensions fastest-first (``[in, out]``); torch wants ``[out, in]``;
4. rows of ``attn_q``/``attn_k`` (weight and bias) un-permuted for the ``llama``
   architecture. llama.cpp's converter reorders each head's rows from HF's rotate-half layout
   ``[x_0..x_{d/2-1}, y_0..y_{d/2-1}]`` to interleaved pairs ``[x_0, y_0, x_1, y_1, ...]``::

       gguf = hf.reshape(heads, 2, d // 2, cols).swapaxes(1, 2).reshape(hf.shape)
       hf   = gguf.reshape(heads, d // 2, 2, cols).swapaxes(1, 2).reshape(gguf.shape)

   with ``heads`` the query heads for ``attn_q`` and the key/value heads for ``attn_k``;
   the other architectures' converters do not permute;
5. Gemma 2/3: every ``*norm.weight`` minus 1 (llama.cpp stores ``1 + w``; Hugging Face's
   parameter, which the model uses as ``x * (1 + w)``, is ``w``);
6. cast to the requested dtype.

Tied embeddings: a file without ``output.weight`` yields no ``lm_head.weight``; the config
says ``tie_word_embeddings=True``.

With ``packed=True`` (the ``gguf`` quantization method, ``--quantization gguf``) matrices
skip steps 2, 3 and 6: they are yielded as their stored bytes, ``uint8 [rows, row_bytes]``
(rows still un-permuted for ``attn_q``/``attn_k``: rows are whole in every block format),
and :func:`gguf_quantization_settings` tells the method each matrix's type. Expert tensors
(stacked or not) are always dequantized (the ``fused_moe`` op holds float
weights; the ``gguf`` method serves linear layers and the embedding only).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from tqdm import tqdm
from transformers import PretrainedConfig

from engine.core.model_loader._gguf_reader import field_value, get_value, open_gguf
from engine.core.model_loader.gguf_architectures import LLAMA_LAYER_NAMES
from engine.core.model_loader.gguf_config import gguf_architecture, gguf_config_from_reader
from engine.sdk.errors import UnsupportedError

logger = logging.getLogger(__name__)

GGUF_TO_HF_GLOBAL: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
"""Tensors outside the layers: GGUF name -> HF name."""

GGUF_TO_HF_LAYER: dict[str, str] = LLAMA_LAYER_NAMES
"""Per-layer modules of the Llama family: ``blk.N.<gguf>.{weight,bias}`` ->
``model.layers.N.<hf>.{weight,bias}`` (other architectures: their
:attr:`~engine.core.model_loader.gguf_architectures.GGUFArchitecture.layer_names`)."""

_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
#: llama.cpp's first Mixtral files (before stacked experts, still loaded by llama.cpp):
#: one tensor per expert, ``blk.N.ffn_gate.J.weight``.
_PER_EXPERT_RE = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight$")


def gguf_to_hf_name(name: str, layer_names: dict[str, str] | None = None) -> str:
    """Return the Hugging Face parameter name of a GGUF tensor.

    Args:
        name: The GGUF tensor name (``blk.3.attn_q.weight``).
        layer_names: The architecture's per-layer table (default: the Llama family's,
            :data:`GGUF_TO_HF_LAYER`).

    Raises:
        UnsupportedError: The tensor has no Hugging Face counterpart here (e.g. llama.cpp's
            ``rope_freqs.weight``, which Llama 3.1 files carry instead of rope scaling
            metadata).
    """
    if name in GGUF_TO_HF_GLOBAL:
        return GGUF_TO_HF_GLOBAL[name]
    table = GGUF_TO_HF_LAYER if layer_names is None else layer_names
    match = _LAYER_RE.match(name)
    if match and match.group(2) in table:
        layer, module, kind = match.groups()
        return f"model.layers.{layer}.{table[module]}.{kind}"
    match = _PER_EXPERT_RE.match(name)
    if match and f"{match.group(2)}_exps" in table:
        layer, module, expert = match.groups()
        experts, _, projection = table[f"{module}_exps"].rpartition(".")
        return f"model.layers.{layer}.{experts}.{expert}.{projection}.weight"
    raise UnsupportedError(f"GGUF tensor {name!r} has no Hugging Face equivalent; not supported")


def hf_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """The torch shape of a GGUF tensor (GGUF lists dimensions in reverse)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (see the module docstring).

    Args:
        weight: ``attn_q``/``attn_k`` weight ``[heads * head_dim, in]`` or bias ``[heads *
            head_dim]`` in GGUF row order.
        num_heads: Query heads for ``attn_q``, key/value heads for ``attn_k``.

    Returns:
        The tensor in Hugging Face row order (a new tensor).
    """
    head_dim = weight.shape[0] // num_heads
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape)


def _dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.F64:  # gguf leaves F64 out; the reader gives float64
        return data.view(np.float64)
    return gguf.quants.dequantize(data, qtype)


def _can_dequantize(qtype: GGMLQuantizationType) -> bool:
    _block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        _dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def check_supported_types(reader: GGUFReader) -> None:
    """Fail before loading anything if some tensor's storage type cannot be dequantized.

    Raises:
        UnsupportedError: One reason per unsupported type, naming its first tensor.
    """
    first_of_type: dict[GGMLQuantizationType, str] = {}
    for tensor in reader.tensors:
        first_of_type.setdefault(tensor.tensor_type, tensor.name)
    reasons = [
        (f"{name} ({qtype.name})", f"gguf {_gguf_version()} cannot dequantize {qtype.name}")
        for qtype, name in first_of_type.items()
        if not _can_dequantize(qtype)
    ]
    if reasons:
        raise UnsupportedError("the GGUF file uses unsupported tensor types", reasons)


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """Dequantize one GGUF tensor to a float32 torch tensor of its torch shape.

    Raises:
        UnsupportedError: ``gguf`` cannot dequantize the tensor's type (names both).
    """
    try:
        values = _dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as err:
        raise UnsupportedError(
            f"GGUF tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which gguf "
            f"{_gguf_version()} cannot dequantize"
        ) from err
    if not values.flags.writeable:  # F32 comes back as a view of the read-only file mapping
        values = values.copy()
    return torch.from_numpy(values.astype(np.float32, copy=False)).reshape(hf_shape(tensor))


def load_gguf_config(path: str | os.PathLike[str]) -> PretrainedConfig:
    """Build the ``transformers`` config described by a GGUF file.

    See :func:`~engine.core.model_loader.gguf_config.gguf_config_from_reader`.
    """
    return gguf_config_from_reader(open_gguf(path))


def is_packed_matrix(tensor: ReaderTensor) -> bool:
    """Whether ``--quantization gguf`` keeps ``tensor`` in its storage format.

    Matrices (``.weight`` with two dimensions: linear layers and the embedding) are kept;
    norms, biases and experts (stacked, or one tensor per expert) are always dequantized.
    """
    return (tensor.name.endswith(".weight") and len(tensor.shape) == 2
            and not _PER_EXPERT_RE.match(tensor.name))


def packed_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """The stored bytes of a GGUF matrix: ``uint8 [rows, row_bytes]`` (a copy)."""
    data = np.ascontiguousarray(tensor.data)
    rows = hf_shape(tensor)[0]
    return torch.from_numpy(data.view(np.uint8).reshape(rows, -1).copy())


def gguf_quantization_settings(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``gguf`` quantization settings of a file: each matrix's storage type.

    Returns:
        ``{"quant_method": "gguf", "tensor_types": {hf_module_name: type_name}}`` (module
        names without ``.weight``, e.g. ``"model.layers.0.self_attn.q_proj": "Q4_1"``).

    Raises:
        UnsupportedError: A tensor has no Hugging Face name.
    """
    reader = open_gguf(path)
    _, mapping = gguf_architecture(reader)
    types = {gguf_to_hf_name(t.name, mapping.layer_names).removesuffix(".weight"):
             t.tensor_type.name for t in reader.tensors if is_packed_matrix(t)}
    return {"quant_method": "gguf", "tensor_types": types}


def iter_gguf_weights(
    path: str | os.PathLike[str], dtype: torch.dtype, *, progress: bool = True,
    packed: bool = False,
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Yield ``(hf_name, tensor)`` for every tensor of a GGUF file, dequantized.

    Args:
        path: The ``.gguf`` file.
        dtype: The dtype of every yielded tensor (values are dequantized in float32 first).
        progress: Show a tqdm progress bar on stderr.
        packed: Yield matrices (:func:`is_packed_matrix`) as their stored bytes
            (:func:`packed_tensor`, rows still un-permuted for ``attn_q``/``attn_k``)
            instead of dequantized, for ``--quantization gguf``.

    Yields:
        Hugging Face parameter names and tensors, in file order.

    Raises:
        UnsupportedError: Before the first tensor: the architecture or a tensor type is not
            supported, or a tensor has no Hugging Face name.
    """
    reader = open_gguf(path)
    arch, mapping = gguf_architecture(reader)
    if not packed:
        check_supported_types(reader)
    num_heads = int(get_value(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(get_value(reader, f"{arch}.attention.head_count_kv", num_heads))
    bar = tqdm(
        reader.tensors, desc=f"Loading {Path(path).name}", unit="tensor", disable=not progress
    )
    # Fail before loading.
    names = [gguf_to_hf_name(tensor.name, mapping.layer_names) for tensor in reader.tensors]
    experts = [t for t in reader.tensors
               if len(t.shape) == 3 or _PER_EXPERT_RE.match(t.name)]
    if packed and experts:
        logger.info("gguf: %d expert tensors (%s) are dequantized at load: the "
                    "fused_moe op holds float weights", len(experts),
                    ", ".join(sorted({t.tensor_type.name for t in experts})))
    for name, tensor in zip(names, bar, strict=True):
        keep = packed and is_packed_matrix(tensor)
        weight = packed_tensor(tensor) if keep else dequantize_tensor(tensor)
        if mapping.permutes_qk and ".attn_q." in tensor.name:
            weight = unpermute_qk(weight, num_heads)
        elif mapping.permutes_qk and ".attn_k." in tensor.name:
            weight = unpermute_qk(weight, num_kv_heads)
        elif mapping.norm_offset and tensor.name.endswith("norm.weight"):
            weight = weight - mapping.norm_offset  # Gemma: llama.cpp stores 1 + w
        yield name, weight if keep else weight.to(dtype)


@dataclass(frozen=True)
class GGUFTokenizerMetadata:
    """The tokenizer facts a GGUF file records (``tokenizer.*`` keys).

    Attributes:
        model: ``tokenizer.ggml.model``: ``gpt2`` (byte-level BPE), ``llama``
            (SentencePiece), ...
        pre: ``tokenizer.ggml.pre``, the pre-tokenizer flavour (e.g. ``smollm``), if any.
        num_tokens: The number of tokens in the vocabulary.
        bos_token_id: Begin-of-sequence id, if any.
        eos_token_id: End-of-sequence id, if any.
        pad_token_id: Padding id, if any.
        unk_token_id: Unknown-token id, if any.
        add_bos_token: Whether encoding prepends BOS, if the file says.
        add_eos_token: Whether encoding appends EOS, if the file says.
        chat_template: The Jinja chat template (``tokenizer.chat_template``), if any.
    """

    model: str | None
    pre: str | None
    num_tokens: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    add_bos_token: bool | None
    add_eos_token: bool | None
    chat_template: str | None


def gguf_tokenizer_metadata(path: str | os.PathLike[str]) -> GGUFTokenizerMetadata:
    """Read the tokenizer metadata of a GGUF file (not the vocabulary itself)."""
    reader = open_gguf(path)
    tokens = reader.fields.get("tokenizer.ggml.tokens")

    def value(key: str) -> Any:
        return get_value(reader, f"tokenizer.{key}")

    return GGUFTokenizerMetadata(
        model=value("ggml.model"),
        pre=value("ggml.pre"),
        num_tokens=0 if tokens is None else len(tokens.data),
        bos_token_id=value("ggml.bos_token_id"),
        eos_token_id=value("ggml.eos_token_id"),
        pad_token_id=value("ggml.padding_token_id"),
        unk_token_id=value("ggml.unknown_token_id"),
        add_bos_token=value("ggml.add_bos_token"),
        add_eos_token=value("ggml.add_eos_token"),
        chat_template=value("chat_template"),
    )


def gguf_metadata(path: str | os.PathLike[str], *, max_array_items: int = 16) -> dict[str, Any]:
    """Every metadata key of a GGUF file, decoded; long arrays are cut to their first items.

    Args:
        path: The ``.gguf`` file.
        max_array_items: Arrays longer than this (the vocabulary, the merges) are replaced by
            their first ``max_array_items`` items followed by ``"... (N items)"``.
    """
    reader = open_gguf(path)
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        value = field_value(field)
        if isinstance(value, list) and len(value) > max_array_items:
            value = [*value[:max_array_items], f"... ({len(value)} items)"]
        out[key] = value
    return out
