"""``engine.models`` entry ``Qwen2MoeForCausalLM``: Qwen2-MoE, built through ``ctx.layers``.

Qwen2-MoE (Qwen1.5-MoE) is Qwen2's decoder (q/k/v bias, no o_proj bias) whose MLP is, on
its sparse layers, a mixture of experts beside a **shared expert**:

    out = experts(x, gate(x)) + sigmoid(shared_expert_gate(x)) * shared_expert(x)

``gate`` is the router (``[num_experts, hidden]``, no bias); the ``num_experts`` SwiGLU
experts of ``moe_intermediate_size`` (``experts.J.gate_proj``, ``up_proj``, ``down_proj``)
are one ``layers.fused_moe``: each token's ``num_experts_per_tok`` best softmax weights,
renormalised only with ``norm_topk_prob`` (off in Qwen1.5-MoE). The shared expert is a
plain SwiGLU MLP of ``shared_expert_intermediate_size`` and its gate a one-output linear.
Layer ``i`` is sparse when ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step ==
0``; the others have a dense SwiGLU MLP of ``intermediate_size``.

Under tensor parallelism the experts split their intermediate size (``fused_moe``), the
shared expert is column/row parallel like the dense MLP, and the router and the shared
expert's gate are replicated. The sigmoid and the sums are torch compute, which CUDA graphs
capture and the CPU step graph cannot record (nor the built-in ``fused_moe``), hence
``capture_support``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.sdk import (
    CaptureContext,
    GraphKind,
    LayerFactory,
    ModelContext,
    ModelInterface,
    Support,
    ValidationError,
)
from engine.sdk.layers import rope_settings

#: Checkpoint projections folded into fused layers: name -> (fused name, shard).
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class Qwen2MoeAttention(nn.Module):
    def __init__(self, cfg: Any, layers: LayerFactory, prefix: str) -> None:
        super().__init__()
        head_dim = int(getattr(cfg, "head_dim", None)
                       or cfg.hidden_size // cfg.num_attention_heads)
        total_q = cfg.num_attention_heads * head_dim
        total_kv = (cfg.num_key_value_heads or cfg.num_attention_heads) * head_dim
        self.qkv_proj = layers.linear(f"{prefix}.qkv_proj", cfg.hidden_size,
                                      (total_q, total_kv, total_kv),
                                      bias=bool(getattr(cfg, "qkv_bias", True)),
                                      parallel="column", head_size=head_dim)
        self.sizes = self.qkv_proj.output_partition_sizes  # this rank's q, k, v
        self.o_proj = layers.linear(f"{prefix}.o_proj", total_q, (cfg.hidden_size,),
                                    parallel="row")
        self.rotary_emb = layers.rotary_embedding(head_dim, head_dim,
                                                  cfg.max_position_embeddings,
                                                  rope_settings(cfg))
        self.attn = layers.attention(f"{prefix}.attn", num_heads=self.sizes[0] // head_dim,
                                     num_kv_heads=self.sizes[1] // head_dim,
                                     head_size=head_dim, scale=head_dim**-0.5)
        self.head_dim = head_dim

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = torch.split(self.qkv_proj(hidden), list(self.sizes), dim=-1)
        q, k = self.rotary_emb(positions, q.reshape(tokens, -1, self.head_dim),
                               k.reshape(tokens, -1, self.head_dim))
        out = self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v.contiguous(),
                        attn_metadata)
        projected: torch.Tensor = self.o_proj(out)
        return projected


class Qwen2MoeMLP(nn.Module):
    """A SwiGLU MLP: the dense layers' and the shared expert."""

    def __init__(self, layers: LayerFactory, prefix: str, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_up_proj = layers.linear(f"{prefix}.gate_up_proj", hidden, (inner, inner),
                                          parallel="column")
        self.down_proj = layers.linear(f"{prefix}.down_proj", inner, (hidden,),
                                       parallel="row")
        self.act = layers.silu_and_mul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_up_proj(x)))
        return out


class Qwen2MoeSparseMoeBlock(nn.Module):
    """Routed experts (``fused_moe``) plus the gated shared expert."""

    def __init__(self, cfg: Any, layers: LayerFactory, prefix: str) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        renormalize = bool(getattr(cfg, "norm_topk_prob", False))  # Qwen1.5-MoE: false
        self.gate = layers.linear(f"{prefix}.gate", hidden, (cfg.num_experts,))  # replicated
        self.experts = layers.fused_moe(f"{prefix}.experts", cfg.num_experts,
                                        cfg.num_experts_per_tok, hidden,
                                        cfg.moe_intermediate_size, renormalize=renormalize)
        self.shared_expert = Qwen2MoeMLP(layers, f"{prefix}.shared_expert", hidden,
                                         cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = layers.linear(f"{prefix}.shared_expert_gate", hidden, (1,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed: torch.Tensor = self.experts(x, self.gate(x))
        shared: torch.Tensor = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared


def is_sparse_layer(cfg: Any, index: int) -> bool:
    """transformers' rule for a layer with experts."""
    return (index not in (getattr(cfg, "mlp_only_layers", None) or []) and cfg.num_experts > 0
            and (index + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0)


class Qwen2MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layers: LayerFactory, index: int) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        self.input_layernorm = layers.rms_norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen2MoeAttention(cfg, layers, f"{prefix}.self_attn")
        self.post_attention_layernorm = layers.rms_norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module
        if is_sparse_layer(cfg, index):
            self.mlp = Qwen2MoeSparseMoeBlock(cfg, layers, f"{prefix}.mlp")
        else:
            self.mlp = Qwen2MoeMLP(layers, f"{prefix}.mlp", cfg.hidden_size,
                                   cfg.intermediate_size)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden.clone()  # an rms_norm replacement may normalise in place
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen2MoeForCausalLM(nn.Module, ModelInterface):
    """Qwen2-MoE decoder (see the module docstring)."""

    def __init__(self, ctx: ModelContext, prefix: str = "") -> None:
        nn.Module.__init__(self)
        cfg, layers = ctx.hf_config, ctx.layers
        if layers is None:  # only in a ModelContext built by hand
            raise ValidationError("Qwen2MoeForCausalLM is built by the engine "
                                  "(ctx.layers is None)")
        if getattr(cfg, "use_sliding_window", False):
            raise ValidationError("Qwen2MoeForCausalLM supports use_sliding_window false only")
        if cfg.hidden_act != "silu":
            raise ValidationError(f"Qwen2MoeForCausalLM supports hidden_act 'silu' only, "
                                  f"got {cfg.hidden_act!r}")
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.embed_tokens = layers.embedding("model.embed_tokens", cfg.vocab_size,
                                             cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2MoeDecoderLayer(cfg, layers, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = layers.rms_norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = layers.linear("lm_head", cfg.hidden_size, (cfg.vocab_size,),
                                     kind="lm_head", parallel="column")

    def capture_support(self, ctx: CaptureContext) -> Support:
        # The shared expert's sigmoid and the sums are torch compute: CUDA graphs capture
        # them (the fused_moe op answers for itself), the CPU step graph cannot.
        if ctx.kind is GraphKind.CUDA_GRAPHS:
            return Support.yes()
        return Support.no("the shared expert's sigmoid gate and the expert sums are torch "
                          "compute")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden_states)
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        used: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied below: the embedding table is the head
            module, param, shard = self._target(name)
            load_weight = getattr(module, "load_weight", None)  # layers from ctx.layers
            if load_weight is not None:
                load_weight(param, tensor, shard)
            else:  # a norm: copy into its weight
                with torch.no_grad():
                    getattr(module, param).copy_(tensor)
            used.add(name)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for module in self.modules():  # lets a quantization method repack what was loaded
            after_loading = getattr(module, "process_weights_after_loading", None)
            if after_loading is not None:
                after_loading()
        return used

    def _target(self, name: str) -> tuple[nn.Module, str, int | None]:
        """The module, parameter name and fused shard a checkpoint tensor loads into."""
        path = name.removeprefix("model.")
        head, is_expert, rest = path.partition(".experts.")
        if is_expert:  # every expert's tensor goes to the layer's one fused_moe
            path, param, shard = f"{head}.experts", rest, None  # rest: "J.gate_proj.weight"
        else:
            path, _, param = path.rpartition(".")
            owner, _, leaf = path.rpartition(".")
            shard = None
            if leaf in FUSED:
                leaf, shard = FUSED[leaf]
                path = f"{owner}.{leaf}"
        try:
            return self.get_submodule(path), param, shard
        except AttributeError:
            raise ValueError(f"checkpoint tensor {name!r} matches no module of "
                             f"Qwen2MoeForCausalLM") from None
