"""Model plugin: ``Sdk1LlamaForCausalLM``, a Llama decoder built from ``ctx.layers``.

Serves any Llama checkpoint whose ``config.json`` names this architecture. Layers come
from the engine's layer factory (``ModelContext.layers``), so the selected attention
backend, linear kernels, quantization and custom-op replacements apply. q/k/v and
gate/up are fused (one matmul each); rope settings (``rope_parameters`` or
``rope_theta`` + ``rope_scaling``) are passed to the factory's rotary embedding.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.sdk import ModelContext, ModelInterface, ValidationError
from engine_test_plugin_sdk1.counters import count

#: Checkpoint projection -> (fused layer, shard index in its output_sizes).
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def rope_settings(config: Any) -> dict[str, Any]:
    """``{"rope_type", "rope_theta", ...scaling keys}`` from either config style."""
    settings = dict(getattr(config, "rope_parameters", None) or {})
    for key, value in dict(getattr(config, "rope_scaling", None) or {}).items():
        settings.setdefault(key, value)
    if "type" in settings and "rope_type" not in settings:
        settings["rope_type"] = settings.pop("type")
    settings.setdefault("rope_type", "default")
    theta = settings.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    settings["rope_theta"] = float(theta)
    return settings


class Sdk1Attention(nn.Module):
    def __init__(self, config: Any, layers: Any, prefix: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // self.num_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = layers.linear(f"{prefix}.qkv_proj", config.hidden_size,
                                      (self.q_size, self.kv_size, self.kv_size), bias=bias)
        self.o_proj = layers.linear(f"{prefix}.o_proj", self.q_size, (config.hidden_size,),
                                    bias=bias)
        self.rotary_emb = layers.rotary_embedding(
            self.head_dim, self.head_dim, config.max_position_embeddings, rope_settings(config))
        self.attn = layers.attention(f"{prefix}.attn", num_heads=self.num_heads,
                                     num_kv_heads=self.num_kv_heads, head_size=self.head_dim,
                                     scale=self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: Any
                ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        tokens = hidden.shape[0]
        q, k = self.rotary_emb(positions, q.reshape(tokens, self.num_heads, self.head_dim),
                               k.reshape(tokens, self.num_kv_heads, self.head_dim))
        out = self.attn(q.reshape(tokens, self.q_size), k.reshape(tokens, self.kv_size),
                        v.contiguous(), metadata)
        projected: torch.Tensor = self.o_proj(out)
        return projected


class Sdk1MLP(nn.Module):
    def __init__(self, config: Any, layers: Any, prefix: str) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = layers.linear(f"{prefix}.gate_up_proj", config.hidden_size,
                                          (size, size))
        self.down_proj = layers.linear(f"{prefix}.down_proj", size, (config.hidden_size,))
        self.act = layers.silu_and_mul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_up_proj(x)))
        return out


class Sdk1DecoderLayer(nn.Module):
    def __init__(self, config: Any, layers: Any, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = layers.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Sdk1Attention(config, layers, f"{prefix}.self_attn")
        self.post_attention_layernorm = layers.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Sdk1MLP(config, layers, f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, metadata: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Sdk1LlamaForCausalLM(nn.Module, ModelInterface):
    """Llama (GQA, rope scaling, optional tied head), with its own module tree."""

    def __init__(self, ctx: ModelContext, prefix: str = "") -> None:
        nn.Module.__init__(self)
        config, layers = ctx.hf_config, ctx.layers
        if layers is None:
            raise ValidationError("Sdk1LlamaForCausalLM needs the engine's layer factory "
                                  "(ModelContext.layers)")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValidationError(f"Sdk1LlamaForCausalLM supports hidden_act 'silu' only, "
                                  f"got {act!r}")
        if getattr(config, "mlp_bias", False):
            raise ValidationError("Sdk1LlamaForCausalLM does not support mlp_bias")
        self.embed_tokens = layers.embedding("model.embed_tokens", config.vocab_size,
                                             config.hidden_size)
        self.layers = nn.ModuleList(Sdk1DecoderLayer(config, layers, f"model.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = layers.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = layers.linear("lm_head", config.hidden_size, (config.vocab_size,))
        self.loaded_names: set[str] = set()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any
                ) -> torch.Tensor:
        count("Sdk1LlamaForCausalLM.forward")
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
        count("Sdk1LlamaForCausalLM.load_weights")
        used: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # recomputed from the config
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            module_path, _, param = name.removeprefix("model.").rpartition(".")
            parent, _, leaf = module_path.rpartition(".")
            shard = None
            if leaf in FUSED:
                leaf, shard = FUSED[leaf]
                module_path = f"{parent}.{leaf}"
            try:
                module = self.get_submodule(module_path)
            except AttributeError:
                raise ValueError(f"checkpoint tensor {name!r} matches no module of "
                                 f"Sdk1LlamaForCausalLM") from None
            load_weight = getattr(module, "load_weight", None)  # layers from ctx.layers
            if callable(load_weight):
                load_weight(param, tensor, shard)
            else:  # plain torch modules (none in this model today)
                with torch.no_grad():
                    getattr(module, param).copy_(tensor)
            used.add(name)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for module in self.modules():  # lets quantization methods and kernels repack
            after_loading = getattr(module, "process_weights_after_loading", None)
            if callable(after_loading) and module is not self:
                after_loading()
        self.loaded_names = used
        return used
