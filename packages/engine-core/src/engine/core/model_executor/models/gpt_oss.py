"""GPT-OSS: a Llama-family decoder with attention sinks, alternating windows and biased experts.

What GPT-OSS (transformers' ``modeling_gpt_oss``) changes in
:mod:`engine.core.model_executor.models.llama`:

* attention: q/k/v and o carry biases (``attention_bias``); each head has a learned
  ``sinks`` logit joined to its softmax (``layers.attention(..., sinks=True)``; the
  checkpoint's ``self_attn.sinks`` ``[num_heads]``, this rank's heads); layer ``i`` has
  the ``sliding_window`` when ``layer_types[i]`` is ``"sliding_attention"`` and full
  attention when it is ``"full_attention"``; rope as the config says (YaRN in the
  released checkpoints, ``engine.sdk.layers.rope_settings``), neox-style;
* the MLP (checkpoint name ``mlp``) is a mixture of ``num_local_experts`` experts: a
  router ``mlp.router`` (``[E, hidden]`` with a bias; a replicated ``layers.linear``),
  each token to its ``num_experts_per_tok`` best experts by logit with a softmax over
  those (the ``fused_moe`` op's ``renormalize``), and experts with biases and the clamped
  SwiGLU ``swigluoai`` (``swiglu_alpha``, ``swiglu_limit``) in one ``layers.fused_moe``.

The checkpoint stores the experts stacked (``mlp.experts.gate_up_proj`` ``[E, H, 2I]``
with gate and up interleaved, columns ``0::2`` and ``1::2``, ``gate_up_proj_bias``
``[E, 2I]`` likewise, ``down_proj`` ``[E, I, H]``, ``down_proj_bias`` ``[E, H]``): the
loader transposes them to the op's layout and de-interleaves gate and up before the layer
takes them (each rank its slice). ``router_aux_loss_coef`` and ``output_router_logits``
are training-only. Released checkpoints quantize the experts as MXFP4, which this model
does not read (a clear error): a bf16/fp32 (dequantized) checkpoint is needed.

Built only through the ``LayerFactory`` in the model context (the seam a model plugin
uses). Sinks need an attention backend that implements them (``AttentionSpec.has_sinks``:
the ``torch`` and ``cpu`` backends). The built-in ``fused_moe`` cannot be recorded by the
CPU step graph, so the model runs eagerly there (the engine logs why) unless a replacement
says it can be.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.core.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)
from engine.sdk.layers import LayerFactory
from engine.sdk.model import ModelContext

#: ``layer_types`` values and whether the layer has the sliding window.
LAYER_TYPES = {"sliding_attention": True, "full_attention": False}


def layer_index(prefix: str) -> int:
    """``i`` of ``model.layers.{i}...``."""
    return int(prefix.split(".")[2])


def sliding_window_of(config: Any, layer: int) -> int | None:
    """Layer ``layer``'s window: ``sliding_window`` for a ``"sliding_attention"`` layer.

    Raises:
        ValueError: ``layer_types`` is missing a layer or names another type.
    """
    types = getattr(config, "layer_types", None)
    if types is None or len(types) != config.num_hidden_layers:
        raise ValueError(f"GPT-OSS needs layer_types, one per layer "
                         f"({config.num_hidden_layers}), got {types!r}")
    kind = types[layer]
    if kind not in LAYER_TYPES:
        raise ValueError(f"layer_types[{layer}] is {kind!r}; supported: "
                         f"{', '.join(LAYER_TYPES)}")
    return config.sliding_window if LAYER_TYPES[kind] else None


class GptOssAttention(LlamaAttention):
    """Llama's attention with a per-layer window and per-head sinks."""

    def attention_options(self, config: Any, prefix: str) -> dict[str, Any]:
        return {"sliding_window": sliding_window_of(config, layer_index(prefix)),
                "sinks": True}


class GptOssMLP(nn.Module):
    """Router (with bias) plus biased ``swigluoai`` experts: ``experts(x, router(x))``."""

    def __init__(self, config: Any, layers: LayerFactory, prefix: str) -> None:
        super().__init__()
        experts = config.num_local_experts
        self.router = layers.linear(f"{prefix}.router", config.hidden_size, (experts,),
                                    bias=True, parallel="replicated")
        self.experts = layers.fused_moe(
            f"{prefix}.experts", experts, config.num_experts_per_tok, config.hidden_size,
            config.intermediate_size, renormalize=True, activation="swigluoai",
            swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
            swiglu_limit=float(config.swiglu_limit), bias=True,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.experts(x, self.router(x))
        return out


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention
    mlp_cls = GptOssMLP


def to_op_layout(param_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A stacked GPT-OSS expert tensor in the ``fused_moe`` layer's layout.

    ``gate_up_proj`` ``[E, H, 2I]`` (interleaved) -> ``[E, 2I, H]`` (gate rows, then up);
    ``gate_up_proj_bias`` ``[E, 2I]`` (interleaved) -> gate's, then up's; ``down_proj``
    ``[E, I, H]`` -> ``[E, H, I]``; ``down_proj_bias`` unchanged.
    """
    if param_name == "gate_up_proj":
        tensor = tensor.transpose(1, 2)
    if param_name in ("gate_up_proj", "gate_up_proj_bias"):
        return torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
    if param_name == "down_proj":
        return tensor.transpose(1, 2)
    return tensor


class GptOssForCausalLM(LlamaForCausalLM):
    """GPT-OSS decoder (see the module docstring)."""

    decoder_layer_cls = GptOssDecoderLayer

    def __init__(self, ctx: ModelContext, prefix: str = "") -> None:
        quant = getattr(ctx.hf_config, "quantization_config", None) or {}
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(
            quant, "quant_method", None)
        if method == "mxfp4":
            raise ValueError("GptOssForCausalLM: MXFP4-quantized experts "
                             "(quantization_config.quant_method 'mxfp4') are not supported; "
                             "use a bf16/fp32 (dequantized) checkpoint")
        super().__init__(ctx, prefix)

    def _module_for(self, name: str) -> tuple[nn.Module, str, int | None] | None:
        # Sinks belong to the attention layer (``self_attn.attn``); the stacked experts
        # to the layer's one ``fused_moe``.
        if name.endswith(".self_attn.sinks"):
            path = name.removeprefix("model.").removesuffix(".sinks")
            try:
                return self.get_submodule(f"{path}.attn"), "sinks", None
            except AttributeError:
                return None
        head, found, rest = name.partition(".mlp.experts.")
        if not found:
            return super()._module_for(name)
        try:
            module = self.get_submodule(f"{head.removeprefix('model.')}.mlp.experts")
        except AttributeError:
            return None
        return module, rest, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(
            (name, to_op_layout(name.rpartition(".mlp.experts.")[2], tensor)
             if ".mlp.experts." in name else tensor)
            for name, tensor in weights
        )
