"""Gemma 2 (transformers' ``Gemma2ForCausalLM``), built only through ``ctx.layers``.

What Gemma 2 is next to the Llama family (:mod:`engine.core.model_executor.models.llama`,
whose weight loading and fused q/k/v, gate/up layers it reuses):

* RMSNorms that scale by ``1 + weight`` (computed in float32 by transformers). The
  engine's ``rms_norm`` op scales by ``weight``, so each checkpoint norm weight is loaded
  as ``weight + 1`` (added in float32, stored in the model dtype), the convention
  llama.cpp's Gemma GGUF files already store. In bfloat16 that rounds ``1 + weight`` to
  the model dtype, and the op multiplies in it: a rounding transformers does not make
  (its float32 product is rounded once); the greedy tokens still follow it;
* four norms per layer, transformers' residual pattern::

      h = h + post_attention_layernorm(attn(input_layernorm(h)))
      h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

  with the residual adds fused into ``input_layernorm`` and ``pre_feedforward_layernorm``;
* the embeddings scaled by ``hidden_size ** 0.5`` rounded to the model dtype (as
  transformers casts the normaliser): ``layers.embedding(..., scale=...)``, the layer's
  own output scale (the CPU step graph records it), so the table stays as stored: a
  quantized one (llama.cpp's GGUF files quantize ``token_embd``) as well, and the tied LM
  head reads the unscaled rows, as transformers' does;
* the MLP ``down(gelu_tanh(gate(x)) * up(x))`` (``hidden_activation``
  ``gelu_pytorch_tanh``; ``gelu`` is the exact one) through ``layers.gelu_and_mul``;
* attention scaled by ``query_pre_attn_scalar ** -0.5``, ``head_dim`` from the config;
  ``sliding_window`` on the ``sliding_attention`` layers of ``layer_types`` (transformers'
  default: the even layers), global attention on the others;
* logit soft-capping: ``attn_logit_softcapping`` (``cap * tanh(scores / cap)`` before the
  softmax, passed to ``layers.attention(..., logits_soft_cap=...)``, which the ``cpu``
  and ``torch`` attention backends serve and a backend that does not is refused for) and
  ``final_logit_softcapping`` (the same on the LM head's logits, in ``compute_logits``:
  elementwise, so each tensor-parallel rank may cap its own shard).

Refused when built: ``use_bidirectional_attention`` (the encoder variants) and a hidden
activation other than the two GELUs. A loader that hands over norm weights already holding
the ``+ 1`` (llama.cpp's GGUF files) must subtract it first. The model's own modules all
declare themselves capturable; where the ``gelu_and_mul`` op chosen has no native CPU
kernel (the built-in one is torch ops), the CPU step graph says so and the pass runs
eagerly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.core.model_executor.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    input_norm,
)
from engine.sdk.layers import LayerFactory
from engine.sdk.model import ModelContext

SLIDING = "sliding_attention"
FULL = "full_attention"
#: ``hidden_activation`` -> ``gelu_and_mul``'s ``approximate``.
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


def gemma_layer_types(config: Any, sliding_every: int = 2) -> list[str]:
    """Each layer's attention kind: the config's ``layer_types``, else the old pattern.

    Without ``layer_types`` (transformers 4.x configs) every ``sliding_every``-th layer
    (counting from 1) is global and the others slide: Gemma 2 alternates (2), Gemma 3's
    ``sliding_window_pattern`` is 6.
    """
    count = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        types = [FULL if (i + 1) % sliding_every == 0 else SLIDING for i in range(count)]
    types = list(types)
    unknown = sorted(set(types) - {SLIDING, FULL})
    if len(types) != count or unknown:
        raise ValueError(f"layer_types must name {count} layers, each {SLIDING!r} or "
                         f"{FULL!r}; got {types!r}")
    return types


class GemmaAttention(LlamaAttention):
    """Llama's attention (fused q/k/v, o, rope, ``per_head``) with Gemma's scale and window.

    ``layer_type`` (``sliding_attention`` or ``full_attention``) picks the window and, in
    Gemma 3, the rope settings; it is set before Llama's construction asks the hooks.
    """

    def __init__(self, config: Any, layers: LayerFactory, prefix: str, layer_type: str) -> None:
        self.layer_type = layer_type
        super().__init__(config, layers, prefix,
                         qkv_bias=bool(getattr(config, "attention_bias", False)))

    def softmax_scale(self, config: Any) -> float:
        return float(config.query_pre_attn_scalar ** -0.5)

    def attention_options(self, config: Any, prefix: str) -> dict[str, Any]:
        window = config.sliding_window if self.layer_type == SLIDING else None
        return {"sliding_window": window, "logits_soft_cap": self.logits_soft_cap(config)}

    def logits_soft_cap(self, config: Any) -> float | None:
        """The attention scores' soft cap: Gemma 2's ``attn_logit_softcapping``."""
        cap = getattr(config, "attn_logit_softcapping", None)
        return None if cap is None else float(cap)


class GemmaMLP(nn.Module):
    """``down(gelu(gate(x)) * up(x))`` with gate and up fused into one column-parallel matmul."""

    def __init__(self, config: Any, layers: LayerFactory, prefix: str) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in ACTIVATIONS:
            raise ValueError(f"{prefix}: hidden_activation {act!r} is not supported; "
                             f"supported: {', '.join(ACTIVATIONS)}")
        size = config.intermediate_size
        self.gate_up_proj = layers.linear(f"{prefix}.gate_up_proj", config.hidden_size,
                                          (size, size), parallel="column")
        self.down_proj = layers.linear(f"{prefix}.down_proj", size, (config.hidden_size,),
                                       parallel="row")
        self.act = layers.gelu_and_mul(approximate="tanh" if ACTIVATIONS[act] == "tanh"
                                       else "none")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_up_proj(x)))
        return out


class Gemma2DecoderLayer(nn.Module):
    """Attention and MLP, each between a pre- and a post-norm (module docstring)."""

    #: The attention module of each layer (Gemma 3's adds q/k norms).
    attention_cls: type[GemmaAttention] = GemmaAttention

    def __init__(self, config: Any, layers: LayerFactory, prefix: str, layer_type: str) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = layers.rms_norm(size, eps)
        self.self_attn = self.attention_cls(config, layers, f"{prefix}.self_attn", layer_type)
        self.post_attention_layernorm = layers.rms_norm(size, eps)
        self.pre_feedforward_layernorm = layers.rms_norm(size, eps)
        self.mlp = GemmaMLP(config, layers, f"{prefix}.mlp")
        self.post_feedforward_layernorm = layers.rms_norm(size, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
        metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, residual)`` in, the same out: the layer's input is their sum."""
        hidden, residual = input_norm(self.input_layernorm, hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        out: torch.Tensor = self.post_feedforward_layernorm(self.mlp(hidden))
        return out, residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 decoder (see the module docstring); Llama's forward pass and loader."""

    #: The decoder layer, built as ``cls(config, layers, prefix, layer_type)``.
    gemma_layer_cls: type[Gemma2DecoderLayer] = Gemma2DecoderLayer
    tie_word_embeddings_default = True

    def __init__(self, ctx: ModelContext, prefix: str = "") -> None:
        self.check_config(ctx.hf_config)
        super().__init__(ctx, prefix)
        cap = getattr(self.config, "final_logit_softcapping", None)
        self.final_logit_softcapping = None if cap is None else float(cap)

    def embedding_scale(self, config: Any) -> float:
        return float(config.hidden_size ** 0.5)

    def build_layers(self, config: Any, layers: LayerFactory) -> list[nn.Module]:
        return [self.gemma_layer_cls(config, layers, f"model.layers.{i}", layer_type)
                for i, layer_type in enumerate(self.layer_types(config))]

    def check_config(self, config: Any) -> None:
        """Refuse what this class does not serve (clear errors, before any layer is built)."""
        if getattr(config, "use_bidirectional_attention", None):
            raise ValueError(f"{type(self).__name__}: use_bidirectional_attention is not "
                             f"supported; the engine serves Gemma as a causal decoder")

    def layer_types(self, config: Any) -> list[str]:
        """Each layer's attention kind (Gemma 2 without ``layer_types``: alternating)."""
        return gemma_layer_types(config, sliding_every=2)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Llama's loader on Gemma's tensors: the norms' weights as ``1 + weight``."""
        return super().load_weights(self._gemma_tensors(weights))

    def _gemma_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith("norm.weight"):
                tensor = tensor.float() + 1.0
            yield name, tensor
