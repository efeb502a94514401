"""Mixtral: the Llama family's decoder with a sparse mixture of experts in place of the MLP.

What Mixtral changes in :mod:`engine.core.model_executor.models.llama` (whose attention,
norms, rope settings, ``sliding_window`` and ``tie_word_embeddings`` switches all apply):
each layer's MLP is ``block_sparse_moe``: a router ``gate`` (``[num_local_experts,
hidden]``, no bias; a replicated ``layers.linear``) and ``num_local_experts`` SwiGLU
experts (``experts.J.w1`` gate, ``w3`` up, ``w2`` down) in one ``layers.fused_moe``; each
token goes to its ``num_experts_per_tok`` best experts, softmax weights renormalised over
them. ``router_jitter_noise`` is training-only and ignored.

Built only through the ``LayerFactory`` in the model context (the seam a model plugin
uses): quantization applies to the attention projections, the router and the head; the
experts run the ``fused_moe`` custom op, whichever implementation is selected (a plugin
can replace it), with each expert's intermediate size split over tensor-parallel ranks.
The built-in ``fused_moe`` cannot be recorded by the CPU step graph, so the model runs
eagerly there (the engine logs why) unless a replacement says it can be.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.core.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.sdk.layers import LayerFactory


class MixtralSparseMoeBlock(nn.Module):
    """Router plus experts: ``experts(x, gate(x))``."""

    def __init__(self, config: Any, layers: LayerFactory, prefix: str) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{prefix}: hidden_act {act!r} is not supported; supported: silu")
        experts, top_k, intermediate, renormalize = self.expert_settings(config)
        self.gate = layers.linear(f"{prefix}.gate", config.hidden_size, (experts,),
                                  parallel="replicated")
        self.experts = layers.fused_moe(
            f"{prefix}.experts", experts, top_k, config.hidden_size, intermediate,
            renormalize=renormalize,
        )

    @classmethod
    def expert_settings(cls, config: Any) -> tuple[int, int, int, bool]:
        """(experts, experts per token, each expert's intermediate size, renormalize).

        Mixtral's: ``num_local_experts``, ``num_experts_per_tok``, ``intermediate_size``,
        always renormalised (Qwen3-MoE reads its own names).
        """
        return (config.num_local_experts, config.num_experts_per_tok,
                config.intermediate_size, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.experts(x, self.gate(x))
        return out


class MixtralDecoderLayer(LlamaDecoderLayer):
    mlp_cls = MixtralSparseMoeBlock
    mlp_prefix = "block_sparse_moe"


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral sparse mixture-of-experts decoder (see the module docstring)."""

    decoder_layer_cls: type[LlamaDecoderLayer] = MixtralDecoderLayer

    def _module_for(self, name: str) -> tuple[nn.Module, str, int | None] | None:
        # The MLP is held as ``mlp`` under the checkpoint's ``block_sparse_moe``; every
        # expert's tensor goes to the one fused layer, named after its prefix.
        name = name.replace(".block_sparse_moe.", ".mlp.")
        head, found, rest = name.partition(".experts.")
        if not found:
            return super()._module_for(name)
        try:
            module = self.get_submodule(f"{head.removeprefix('model.')}.experts")
        except AttributeError:
            return None
        return module, rest, None
