"""Gemma 3, text only (transformers' ``Gemma3ForCausalLM``, model type ``gemma3_text``).

Gemma 2's decoder (:mod:`engine.core.model_executor.models.gemma2`: ``1 + weight`` norms
loaded as such, four norms per layer, the embeddings scaled by ``sqrt(hidden_size)`` by
the embedding layer, tied head, tanh-GELU MLP, ``query_pre_attn_scalar``, per-layer sliding window,
``final_logit_softcapping`` when set), and what Gemma 3 changes:

* per-head RMSNorms of q and k (``q_norm``, ``k_norm``, ``[head_dim]``, ``1 + weight``
  like every Gemma norm) before the rotation, as Qwen3 (``models.qwen3``) has them;
* ``layer_types`` (``sliding_attention`` / ``full_attention``; 4.x configs:
  ``sliding_window_pattern``, every 6th layer global);
* rope per layer type: 5.x configs hold one set of settings per type in
  ``rope_parameters`` (``engine.sdk.layers.rope_settings(config, layer_type=...)``);
  4.x configs give the global layers ``rope_theta`` / ``rope_scaling`` and the sliding
  ones ``rope_local_base_freq`` unscaled;
* no attention soft-capping: transformers' Gemma 3 ignores ``attn_logit_softcapping``,
  and so does this class.

Refused when built: a multimodal ``Gemma3Config`` (``Gemma3ForConditionalGeneration``,
the 4B and larger checkpoints: this class serves the text-only decoder) and
``use_bidirectional_attention``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from engine.core.model_executor.models.gemma2 import (
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    GemmaAttention,
    gemma_layer_types,
)
from engine.sdk.layers import LayerFactory, rope_settings

#: transformers 4.x's rope base of the sliding layers when the config gives none.
DEFAULT_LOCAL_ROPE_THETA = 10000.0
#: transformers 4.x's ``sliding_window_pattern`` when the config gives none.
DEFAULT_SLIDING_PATTERN = 6


class Gemma3Attention(GemmaAttention):
    """Gemma attention plus per-head RMSNorms of q and k; rope settings per layer type."""

    def __init__(self, config: Any, layers: LayerFactory, prefix: str, layer_type: str) -> None:
        super().__init__(config, layers, prefix, layer_type)
        self.q_norm = layers.rms_norm(self.head_dim, config.rms_norm_eps)
        self.k_norm = layers.rms_norm(self.head_dim, config.rms_norm_eps)

    def rope(self, config: Any) -> dict[str, Any]:
        layer_type = self.layer_type
        params = getattr(config, "rope_parameters", None)
        if isinstance(params, Mapping) and layer_type in params:
            return rope_settings(config, layer_type=layer_type)
        if layer_type == "sliding_attention":  # 4.x: an unscaled local base
            base = getattr(config, "rope_local_base_freq", None) or DEFAULT_LOCAL_ROPE_THETA
            return {"rope_type": "default", "rope_theta": float(base)}
        return rope_settings(config)

    def logits_soft_cap(self, config: Any) -> float | None:
        return None

    def per_head(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Contiguous copies: q and k are views into the fused qkv output, and a norm may
        # work in place.
        return self.q_norm(q.contiguous()), self.k_norm(k.contiguous())


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text decoder (see the module docstring)."""

    gemma_layer_cls = Gemma3DecoderLayer

    def check_config(self, config: Any) -> None:
        if getattr(config, "text_config", None) is not None or getattr(
                config, "vision_config", None) is not None:
            raise ValueError(
                f"{type(self).__name__} serves Gemma 3's text-only decoder (model type "
                f"gemma3_text, as the 1B checkpoints); this config is multimodal (model type "
                f"{getattr(config, 'model_type', None)!r}, Gemma3ForConditionalGeneration), "
                f"which is not supported")
        super().check_config(config)

    def layer_types(self, config: Any) -> list[str]:
        """``layer_types``, else every ``sliding_window_pattern``-th layer global (4.x)."""
        every = getattr(config, "sliding_window_pattern", None) or DEFAULT_SLIDING_PATTERN
        return gemma_layer_types(config, sliding_every=int(every))
