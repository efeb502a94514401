"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): the Llama family's decoder with fused checkpoint tensors.

What Phi-3 (transformers' ``Phi3Config`` / ``Phi3ForCausalLM``) is, next to
:mod:`engine.core.model_executor.models.llama`, whose modules it reuses unchanged:

* the checkpoint stores ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` already fused
  (q, k, v and gate, up stacked along the output rows). They load into the same fused
  layers Llama builds, as tensors "of the whole layer" (shard ``None``):
  ``Linear.load_weight`` cuts such a tensor into its logical outputs (q, k, v; gate, up)
  from the layer's ``output_partition_sizes`` and gives each rank its part of each, so
  tensor parallelism shards them as it shards Llama's separate ``q_proj`` ... tensors;
* ``sliding_window`` (Phi-3-mini: 2047) applies to every layer; Llama's attention passes
  it to ``layers.attention`` (a key ``j`` is seen from position ``i`` when
  ``i - sliding_window < j <= i``, as transformers masks);
* ``partial_rotary_factor`` (Phi-4-mini: 0.75): the first ``head_dim * factor`` elements
  of each head rotate (``layers.rotary_embedding(head_dim, rotary_dim, ...)``), read by
  ``engine.sdk.layers.rope_settings``;
* ``rope_scaling`` of type ``longrope`` (4.x configs: also ``su``), of the 128k variants
  (Phi-3-*-128k, Phi-3.5-mini, Phi-4-mini), with the config's top-level
  ``original_max_position_embeddings``: its short factors or its long ones for every
  position, by the engine's ``max_model_len`` against ``original_max_position_embeddings``
  (vLLM's rule; transformers switches per forward pass; see
  ``engine.core.model_executor.layers.rope``), and the attention factor on cos and sin;
* ``resid_pdrop``, ``embd_pdrop`` and ``attention_dropout`` are training-only: ignored.

Like the Llama family, it is built only through the ``LayerFactory`` in the model context
(``ctx.layers``), so quantization, attention backends, custom ops, tensor parallelism and
graph capture apply.
"""

from __future__ import annotations

from engine.core.model_executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 decoder: Llama's modules, fused checkpoint tensors (see the module docstring)."""
