"""Qwen3-MoE: the Qwen3 decoder with Mixtral's mixture of experts in place of the MLP.

What Qwen3-MoE changes in :mod:`engine.core.model_executor.models.qwen3` (whose per-head
q/k norms and Llama-family switches all apply: grouped-query attention, ``head_dim``,
``attention_bias``, ``tie_word_embeddings``, rope settings; ``use_sliding_window`` is
refused as for Qwen3): a sparse layer's MLP (checkpoint name ``mlp``) is
:class:`~engine.core.model_executor.models.mixtral.MixtralSparseMoeBlock` read with
Qwen3-MoE's names: a router ``gate`` (``[num_experts, hidden]``, no bias) and
``num_experts`` SwiGLU experts of ``moe_intermediate_size`` (``experts.J.gate_proj``,
``up_proj``, ``down_proj``) in one ``layers.fused_moe``; each token goes to its
``num_experts_per_tok`` best experts, the softmax weights renormalised over them when
``norm_topk_prob`` (the ``fused_moe`` ``renormalize`` option).

Which layers are sparse follows transformers exactly: layer ``i`` is when ``i not in
mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``; the others
have Llama's dense SwiGLU MLP of ``intermediate_size`` (``mlp.gate_proj``, ``up_proj``,
``down_proj``). ``router_aux_loss_coef`` and ``output_router_logits`` are training-only.

Built only through the ``LayerFactory`` in the model context (the seam a model plugin
uses), as Mixtral is: quantization applies to the attention projections, the dense MLPs,
the router and the head; the experts run the ``fused_moe`` custom op (or its selected
replacement), each expert's intermediate size split over tensor-parallel ranks. The
built-in ``fused_moe`` cannot be recorded by the CPU step graph, so the model runs eagerly
there (the engine logs why) unless a replacement says it can be.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.core.model_executor.models.llama import LlamaMLP
from engine.core.model_executor.models.mixtral import MixtralForCausalLM, MixtralSparseMoeBlock
from engine.core.model_executor.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM
from engine.sdk.layers import LayerFactory


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` has experts (transformers' ``Qwen3MoeDecoderLayer`` rule)."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1)
    return (layer_idx not in mlp_only and config.num_experts > 0
            and (layer_idx + 1) % step == 0)


class Qwen3MoeSparseMoeBlock(MixtralSparseMoeBlock):
    """Mixtral's router plus experts, sized by Qwen3-MoE's config names."""

    @classmethod
    def expert_settings(cls, config: Any) -> tuple[int, int, int, bool]:
        return (config.num_experts, config.num_experts_per_tok,
                config.moe_intermediate_size, bool(getattr(config, "norm_topk_prob", False)))


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    mlp_cls = Qwen3MoeSparseMoeBlock

    def build_mlp(self, config: Any, layers: LayerFactory, prefix: str) -> nn.Module:
        # LlamaForCausalLM names its layers ``model.layers.{i}``.
        if is_sparse_layer(config, int(prefix.rpartition(".")[2])):
            return super().build_mlp(config, layers, prefix)
        return LlamaMLP(config, layers, f"{prefix}.{self.mlp_prefix}")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM, MixtralForCausalLM):
    """Qwen3-MoE decoder (see the module docstring).

    Qwen3's construction (its ``use_sliding_window`` check) and Mixtral's weight routing
    (every ``mlp.experts.J.*`` tensor to the layer's one ``fused_moe``).
    """

    decoder_layer_cls = Qwen3MoeDecoderLayer
