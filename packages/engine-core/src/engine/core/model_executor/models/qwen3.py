"""Qwen3 (dense): the Llama family's decoder with an RMSNorm over each query and key head.

What Qwen3 adds to :mod:`engine.core.model_executor.models.llama` (whose config switches
all apply: grouped-query attention, ``head_dim`` from the config, ``attention_bias`` for a
bias on q, k, v and o (none by default), ``tie_word_embeddings``, rope settings read by
``engine.sdk.layers.rope_settings``):

* ``q_norm`` and ``k_norm`` (checkpoint weights ``[head_dim]``): an RMSNorm of each head
  of q and k, before the rotation; built with ``layers.rms_norm(head_dim, eps)`` and called
  on contiguous ``[tokens, heads, head_dim]`` copies, so the native kernel runs them on
  ``tokens * heads`` rows and the CPU step graph records them.

Like the Llama family, it is built only through the ``LayerFactory`` in the model context
(the seam a model plugin uses), so quantization, attention backends, custom ops, tensor
parallelism and graph capture apply. Qwen3's sliding window (``use_sliding_window``: on the
layers from ``max_window_layers`` up) is not supported; the released checkpoints leave it
off.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.core.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)
from engine.sdk.layers import LayerFactory
from engine.sdk.model import ModelContext


class Qwen3Attention(LlamaAttention):
    """Llama attention plus per-head RMSNorms of q and k (``q_norm``, ``k_norm``)."""

    def __init__(self, config: Any, layers: LayerFactory, prefix: str, qkv_bias: bool) -> None:
        super().__init__(config, layers, prefix, qkv_bias)
        self.q_norm = layers.rms_norm(self.head_dim, config.rms_norm_eps)
        self.k_norm = layers.rms_norm(self.head_dim, config.rms_norm_eps)

    def per_head(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Contiguous copies: q and k are views into the fused qkv output, and a norm may
        # work in place.
        return self.q_norm(q.contiguous()), self.k_norm(k.contiguous())


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense decoder: Llama plus per-head q/k RMSNorm (see the module docstring)."""

    decoder_layer_cls = Qwen3DecoderLayer

    def __init__(self, ctx: ModelContext, prefix: str = "") -> None:
        if getattr(ctx.hf_config, "use_sliding_window", False):
            raise ValueError(f"{type(self).__name__}: use_sliding_window true is not "
                             f"supported (Qwen3's window applies from max_window_layers "
                             f"up); the released Qwen3 checkpoints leave it false")
        super().__init__(ctx, prefix)
