"""``engine.models`` entry ``Qwen3ForCausalLM``: Qwen3 built through ``ctx.layers``, capturable.

Qwen3 is a Llama-like decoder with an RMSNorm over each query and key head (``q_norm``,
``k_norm``, weight ``[head_dim]``) before the rotation, and a ``head_dim`` of its own. Its
modules only call the layers ``ctx.layers`` built, make views and copies, so it declares
that a graph may record its forward pass (``capture_support``): every layer answers for
itself, and the CPU step graph replays the whole pass, per-head norms included.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.sdk import (
    CaptureContext,
    LayerFactory,
    ModelContext,
    ModelInterface,
    Support,
    ValidationError,
)
from engine.sdk.layers import rope_settings

#: Checkpoint projections folded into fused layers: (checkpoint name, fused name, shard).
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Any, layers: LayerFactory, prefix: str) -> None:
        super().__init__()
        self.head_dim = int(getattr(cfg, "head_dim", None)
                            or cfg.hidden_size // cfg.num_attention_heads)
        total_q = cfg.num_attention_heads * self.head_dim
        total_kv = (cfg.num_key_value_heads or cfg.num_attention_heads) * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = layers.linear(f"{prefix}.qkv_proj", cfg.hidden_size,
                                      (total_q, total_kv, total_kv), bias=bias,
                                      parallel="column", head_size=self.head_dim)
        self.q_size, self.kv_size, _ = self.qkv_proj.output_partition_sizes
        self.num_heads = self.q_size // self.head_dim
        self.num_kv_heads = self.kv_size // self.head_dim
        self.o_proj = layers.linear(f"{prefix}.o_proj", total_q, (cfg.hidden_size,), bias=bias,
                                    parallel="row")
        self.q_norm = layers.rms_norm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = layers.rms_norm(self.head_dim, cfg.rms_norm_eps)
        self.rotary_emb = layers.rotary_embedding(self.head_dim, self.head_dim,
                                                  cfg.max_position_embeddings,
                                                  rope_settings(cfg))
        self.attn = layers.attention(f"{prefix}.attn", num_heads=self.num_heads,
                                     num_kv_heads=self.num_kv_heads, head_size=self.head_dim,
                                     scale=self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = torch.split(self.qkv_proj(hidden), [self.q_size, self.kv_size, self.kv_size],
                              dim=-1)
        # Per-head norms on [tokens, heads, head_dim] copies (the norm may work in place).
        q = self.q_norm(q.reshape(tokens, self.num_heads, self.head_dim).contiguous())
        k = self.k_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim).contiguous())
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q.reshape(tokens, self.q_size), k.reshape(tokens, self.kv_size),
                        v.contiguous(), attn_metadata)
        projected: torch.Tensor = self.o_proj(out)
        return projected


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Any, layers: LayerFactory, prefix: str) -> None:
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValidationError(f"Qwen3ForCausalLM supports hidden_act 'silu' only, got "
                                  f"{cfg.hidden_act!r}")
        size = cfg.intermediate_size
        self.gate_up_proj = layers.linear(f"{prefix}.gate_up_proj", cfg.hidden_size,
                                          (size, size), parallel="column")
        self.down_proj = layers.linear(f"{prefix}.down_proj", size, (cfg.hidden_size,),
                                       parallel="row")
        self.act = layers.silu_and_mul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_up_proj(x)))
        return out


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layers: LayerFactory, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = layers.rms_norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg, layers, f"{prefix}.self_attn")
        self.post_attention_layernorm = layers.rms_norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg, layers, f"{prefix}.mlp")

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


class Qwen3ForCausalLM(nn.Module, ModelInterface):
    """Qwen3 dense decoder: Llama plus per-head q/k RMSNorm; a graph may record it."""

    def __init__(self, ctx: ModelContext, prefix: str = "") -> None:
        nn.Module.__init__(self)
        cfg, layers = ctx.hf_config, ctx.layers
        if layers is None:  # only in a ModelContext built by hand
            raise ValidationError("Qwen3ForCausalLM is built by the engine (ctx.layers is None)")
        if getattr(cfg, "use_sliding_window", False):
            raise ValidationError("Qwen3ForCausalLM here supports use_sliding_window false only")
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.embed_tokens = layers.embedding("model.embed_tokens", cfg.vocab_size,
                                             cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, layers, f"model.layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        self.norm = layers.rms_norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = layers.linear("lm_head", cfg.hidden_size, (cfg.vocab_size,),
                                     kind="lm_head", parallel="column")

    def capture_support(self, ctx: CaptureContext) -> Support:
        # Its modules and compute_logits only call layers from ctx.layers, make views and
        # copies: nothing a replay would skip. The layers answer for themselves.
        return Support.yes()

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
        path, _, param = name.rpartition(".")
        path = path.removeprefix("model.")
        owner, _, leaf = path.rpartition(".")
        shard = None
        if leaf in FUSED:
            leaf, shard = FUSED[leaf]
            path = f"{owner}.{leaf}"
        try:
            return self.get_submodule(path), param, shard
        except AttributeError:
            raise ValueError(f"checkpoint tensor {name!r} matches no module of "
                             f"Qwen3ForCausalLM") from None
