"""The Llama family: Llama 2/3 (incl. llama3 rope scaling), Mistral, Qwen2, via config switches.

Switches read from the Hugging Face config:

* ``num_key_value_heads`` < ``num_attention_heads``: grouped-query attention;
* ``attention_bias`` (Llama) or the Qwen2 architecture: bias on q, k, v;
* ``tie_word_embeddings``: the LM head reuses the embedding table;
* rope (5.x ``rope_parameters``, 4.x ``rope_theta`` / ``rope_scaling``, and
  ``partial_rotary_factor``): read by ``engine.sdk.layers.rope_settings``, as a plugin
  reads them; the frequencies in ``layers.rope``;
* ``head_dim``: when it is not ``hidden_size / num_attention_heads`` (Mistral variants);
* ``sliding_window`` (Mistral, when ``use_sliding_window`` is not False).

Layers come from the ``LayerFactory`` in the model context, so quantization, attention
backends, custom ops and tensor parallelism apply. q/k/v and gate/up are fused into one
matmul each; under tensor parallelism they are column-parallel, o_proj and down_proj
row-parallel, the embedding and LM head split by vocabulary rows.

Variants reuse the modules through class attributes: ``LlamaForCausalLM.decoder_layer_cls``,
``LlamaDecoderLayer.attention_cls`` and ``LlamaAttention.per_head`` (q and k per head,
before the rotation), as Qwen3 (``models.qwen3``) does for its q/k norms, and
``LlamaAttention.rope`` / ``softmax_scale`` / ``attention_options`` (a layer's rope
settings, score scale and ``layers.attention`` keywords), as Gemma (``models.gemma2``) and
GPT-OSS (``models.gpt_oss``) do for their per-layer windows, soft caps and sinks;
``LlamaDecoderLayer.mlp_cls`` / ``mlp_prefix`` (the MLP and its checkpoint name), as
Mixtral (``models.mixtral``) does for its mixture of experts, and ``build_mlp`` (the MLP of
one layer), as Qwen3-MoE (``models.qwen3_moe``) does for its dense ``mlp_only_layers``.
A checkpoint may also hold ``qkv_proj`` / ``gate_up_proj`` already fused (Phi-3,
``models.phi3``): such a tensor loads as one of the whole layer (shard ``None``), which
``Linear.load_weight`` cuts into its logical outputs, each rank taking its part of each.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.core.model_executor.layers.linear import copy_into_parameter
from engine.sdk.capture import CaptureContext
from engine.sdk.layers import LayerFactory, rope_settings
from engine.sdk.model import ModelContext, ModelInterface
from engine.sdk.support import Support

#: Checkpoint names folded into fused layers: (fused name, checkpoint name, shard index).
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def _head_dim(config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layers: LayerFactory, prefix: str, qkv_bias: bool) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = _head_dim(config)
        total_q, total_kv = total_heads * self.head_dim, total_kv_heads * self.head_dim
        # Column-parallel by heads; this rank's sizes come back from the layer.
        self.qkv_proj = layers.linear(
            f"{prefix}.qkv_proj", config.hidden_size, (total_q, total_kv, total_kv),
            bias=qkv_bias, parallel="column", head_size=self.head_dim,
        )
        self.q_size, self.kv_size, _ = self.qkv_proj.output_partition_sizes
        self.num_heads = self.q_size // self.head_dim
        self.num_kv_heads = self.kv_size // self.head_dim
        self.o_proj = layers.linear(f"{prefix}.o_proj", total_q, (config.hidden_size,),
                                    bias=bool(getattr(config, "attention_bias", False)),
                                    parallel="row")
        rope = self.rope(config)
        self.rotary_emb = layers.rotary_embedding(
            self.head_dim, int(self.head_dim * rope.get("partial_rotary_factor", 1.0)),
            config.max_position_embeddings, rope,
        )
        self.attn = layers.attention(
            f"{prefix}.attn", num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim, scale=self.softmax_scale(config),
            **self.attention_options(config, prefix),
        )

    def rope(self, config: Any) -> dict[str, Any]:
        """This layer's rope settings (Gemma 3 reads them per layer type)."""
        return rope_settings(config)

    def softmax_scale(self, config: Any) -> float:
        """The attention scores' scale: ``head_dim ** -0.5`` (Gemma: its own scalar)."""
        return float(self.head_dim**-0.5)

    def attention_options(self, config: Any, prefix: str) -> dict[str, Any]:
        """The keyword options of this layer's ``layers.attention``.

        ``prefix`` is the attention's, ``model.layers.{i}.self_attn``. Here
        ``sliding_window`` from the config (``None`` when ``use_sliding_window`` is
        False); GPT-OSS chooses the window per layer and adds ``sinks``.
        """
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            window = None
        return {"sliding_window": window}

    def per_head(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-head step on q and k (``[tokens, heads, head_dim]``) before the rotation.

        None here; Qwen3 normalises each head.
        """
        return q, k

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: Any) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = hidden.shape[0]
        q, k = self.rotary_emb(positions, *self.per_head(
            q.reshape(num_tokens, self.num_heads, self.head_dim),
            k.reshape(num_tokens, self.num_kv_heads, self.head_dim),
        ))
        out = self.attn(q.reshape(num_tokens, self.q_size), k.reshape(num_tokens, self.kv_size),
                        v.contiguous(), metadata)
        projected: torch.Tensor = self.o_proj(out)
        return projected


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, layers: LayerFactory, prefix: str) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{prefix}: hidden_act {act!r} is not supported; supported: silu")
        bias = bool(getattr(config, "mlp_bias", False))
        size = config.intermediate_size
        self.gate_up_proj = layers.linear(f"{prefix}.gate_up_proj", config.hidden_size,
                                          (size, size), bias=bias, parallel="column")
        self.down_proj = layers.linear(f"{prefix}.down_proj", size, (config.hidden_size,),
                                       bias=bias, parallel="row")
        self.act = layers.silu_and_mul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_up_proj(x)))
        return out


def input_norm(norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's first norm: ``(norm(hidden + residual), hidden + residual)``.

    The first layer has no residual yet (``None``): it keeps a copy of its input.
    """
    if residual is None:
        residual = hidden.clone()  # rms_norm replacements may normalise in place
        normed: torch.Tensor = norm(hidden)
        return normed, residual
    result: tuple[torch.Tensor, torch.Tensor] = norm(hidden, residual)
    return result


class LlamaDecoderLayer(nn.Module):
    #: The attention module of each layer (a variant's subclass replaces it).
    attention_cls: type[LlamaAttention] = LlamaAttention
    #: The MLP of each layer, built as ``mlp_cls(config, layers, prefix)`` (Mixtral's
    #: mixture of experts replaces it), held as ``self.mlp``.
    mlp_cls: type[nn.Module] = LlamaMLP
    #: The MLP's checkpoint name under the layer (Mixtral: ``block_sparse_moe``).
    mlp_prefix: str = "mlp"

    def __init__(self, config: Any, layers: LayerFactory, prefix: str, qkv_bias: bool) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = layers.rms_norm(config.hidden_size, eps)
        self.self_attn = self.attention_cls(config, layers, f"{prefix}.self_attn", qkv_bias)
        self.post_attention_layernorm = layers.rms_norm(config.hidden_size, eps)
        self.mlp = self.build_mlp(config, layers, prefix)

    def build_mlp(self, config: Any, layers: LayerFactory, prefix: str) -> nn.Module:
        """This layer's MLP (``prefix``: the layer's, ``model.layers.{i}``).

        ``mlp_cls(config, layers, f"{prefix}.{mlp_prefix}")`` here; a variant whose layers
        differ (Qwen3-MoE's dense ``mlp_only_layers``) chooses per layer.
        """
        return self.mlp_cls(config, layers, f"{prefix}.{self.mlp_prefix}")

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
        metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = input_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        out: torch.Tensor = self.mlp(hidden)
        return out, residual


class LlamaForCausalLM(nn.Module, ModelInterface):
    """Llama-family decoder (see the module docstring for the config switches)."""

    #: Whether q/k/v carry a bias regardless of ``attention_bias`` (Qwen2 sets True).
    qkv_bias_default = False
    #: The decoder layer (a variant with another attention, e.g. Qwen3's, replaces it).
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    #: ``tie_word_embeddings`` when the config does not say (transformers' default for the
    #: architecture: Gemma ties).
    tie_word_embeddings_default = False

    def __init__(self, ctx: ModelContext, prefix: str = "") -> None:
        nn.Module.__init__(self)
        config = ctx.hf_config
        layers = ctx.layers
        if layers is None:
            raise ValueError(f"{type(self).__name__} is built with the engine's layer factory "
                             f"(ModelContext.layers), got None")
        self.config = config
        self.embed_tokens = layers.embedding("model.embed_tokens", config.vocab_size,
                                             config.hidden_size,
                                             scale=self.embedding_scale(config))
        self.layers = nn.ModuleList(self.build_layers(config, layers))
        self.norm = layers.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings",
                                                self.tie_word_embeddings_default))
        # Tied: the head's weight becomes the embedding table once loaded (one tensor), and
        # the head still goes through a linear kernel.
        self.lm_head = layers.linear("lm_head", config.hidden_size, (config.vocab_size,),
                                     kind="lm_head", parallel="column")

    def embedding_scale(self, config: Any) -> float | None:
        """The embedding rows' scale (``layers.embedding(scale=...)``): none; Gemma's."""
        return None

    def build_layers(self, config: Any, layers: LayerFactory) -> list[nn.Module]:
        """The decoder layers ``model.layers.{i}``: ``decoder_layer_cls`` each (Gemma: by type)."""
        qkv_bias = self.qkv_bias_default or bool(getattr(config, "attention_bias", False))
        return [self.decoder_layer_cls(config, layers, f"model.layers.{i}", qkv_bias)
                for i in range(config.num_hidden_layers)]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def capture_support(self, ctx: CaptureContext) -> Support:
        """Yes: its modules and ``compute_logits`` only call layers and views (any graph)."""
        return Support.yes()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Under tensor parallelism every rank calls this; rank 0 gets the full logits.
        logits: torch.Tensor = self.lm_head(hidden_states)
        return logits.float()

    def _module_for(self, name: str) -> tuple[nn.Module, str, int | None] | None:
        """Map a checkpoint tensor name to (module, parameter name, shard)."""
        module_path, _, param_name = name.rpartition(".")
        shard = None
        for fused, original, index in STACKED_PARAMS:
            if module_path.endswith(f".{original}"):
                module_path = module_path[: -len(original)] + fused
                shard = index
                break
        path = module_path.removeprefix("model.") if module_path.startswith("model.") else (
            module_path)
        try:
            module = self.get_submodule(path)
        except AttributeError:
            return None
        return module, param_name, shard

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding table is the head
            target = self._module_for(name)
            if target is None:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                                 f"{type(self).__name__}")
            module, param_name, shard = target
            loader = getattr(module, "load_weight", None)
            if callable(loader):
                loader(param_name, tensor, shard)
            else:
                copy_into_parameter(module, param_name, tensor, name)
            loaded.add(name)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for module in self.modules():
            finish = getattr(module, "process_weights_after_loading", None)
            if callable(finish):
                finish()
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a sliding window (when configured)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with a bias on q, k and v."""

    qkv_bias_default = True
