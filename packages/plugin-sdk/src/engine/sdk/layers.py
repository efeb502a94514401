"""``LayerFactory``: the layers a model plugin builds through ``ModelContext.layers``.

The engine hands every model a factory (``ctx.layers``). Layers built by it honour the
selected quantization method, attention backend, linear kernels, custom-op replacements
and tensor parallelism, so a model that builds its linear, embedding, attention, norm,
rotary and activation layers through it gets every plugin seam for free. Plain torch is
fine for the rest (``LayerNorm``, ``F.gelu``, ...).

Sizes are always the whole model's; under tensor parallelism each rank's factory builds
that rank's part (Megatron-style) and the layer reports it
(:attr:`LinearLayer.output_partition_sizes`). The layers are ``torch.nn.Module`` objects:
assign them as submodules.

Loading: every layer that holds checkpoint tensors has
``load_weight(param_name, tensor, shard)``; after the whole checkpoint is loaded, call
``process_weights_after_loading()`` on every module that has it (quantization methods
repack there)::

    class MyForCausalLM(torch.nn.Module, ModelInterface):
        def __init__(self, ctx: ModelContext, prefix: str = "") -> None:
            torch.nn.Module.__init__(self)
            layers = ctx.layers
            if layers is None:  # only in a ModelContext built by hand
                raise ValidationError("MyForCausalLM is built by the engine")
            self.qkv = layers.linear("model.layers.0.qkv_proj", 64, (64, 32, 32),
                                     parallel="column", head_size=16)
            q_size, kv_size, _ = self.qkv.output_partition_sizes

Rope: :func:`rope_settings` reads a transformers config's rope settings (transformers
4.x ``rope_theta`` / ``rope_scaling`` or 5.x ``rope_parameters``) in the shape
:meth:`LayerFactory.rotary_embedding` takes (added in 1.1).

This module only describes the interface (``typing.Protocol``); the engine's
implementation is ``engine.core.model_executor.layers.factory.LayerFactory``.

.. versionadded:: 1.1
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from engine.sdk._rope import rope_settings

if TYPE_CHECKING:
    import torch

    from engine.sdk.ops import (
        FusedMoEOp,
        GeluAndMulOp,
        RMSNormOp,
        RotaryEmbeddingOp,
        SiluAndMulOp,
    )

__all__ = ["AttentionLayer", "EmbeddingLayer", "FusedMoELayer", "LayerFactory", "LinearLayer",
           "rope_settings"]


@runtime_checkable
class LinearLayer(Protocol):
    """A linear layer from :meth:`LayerFactory.linear`: ``y = layer(x)``, ``x W^T + b``.

    Its parameters belong to the layer's quantize method (unquantized: ``weight``
    ``[out, in]`` in the model dtype) plus ``bias`` when built with ``bias=True``.

    Attributes:
        weight: The layer's weight as its quantize method registered it. A model ties its
            LM head to the embedding by assigning ``head.weight = embedding.weight`` after
            loading.

    .. versionadded:: 1.1
    """

    weight: torch.Tensor

    @property
    def output_partition_sizes(self) -> tuple[int, ...]:
        """This rank's features of each fused logical output (q, k, v; gate, up).

        The whole model's sizes on one rank; with ``parallel="column"`` each rank's share.
        Read the head counts to give :meth:`LayerFactory.attention` from it.

        .. versionadded:: 1.1
        """

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, input features] -> [num_tokens, output features]``.

        Row-parallel layers return the sum over ranks (the bias added once); a
        column-parallel LM head returns the full logits ``[num_tokens, vocab]`` on rank 0
        and its own vocabulary shard elsewhere.

        .. versionadded:: 1.1
        """

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        """Copy this rank's part of a full checkpoint tensor into parameter ``param_name``.

        Called: by the model's ``load_weights``, once per checkpoint tensor of the layer.

        Args:
            param_name: The parameter (``"weight"``, ``"bias"``, a quantization method's
                ``"weight_scale"``, ...): the checkpoint name's last component.
            tensor: The whole model's tensor, as the checkpoint stores it.
            shard: For a layer fusing several checkpoint tensors (q, k, v), the index in
                ``output_sizes`` of the one given; ``None`` otherwise (also for one tensor
                holding every fused output).

        Raises:
            ValueError: the layer has no such parameter, or the shape does not fit (the
                message names both shapes).

        .. versionadded:: 1.1
        """

    def process_weights_after_loading(self) -> None:
        """Let the quantize method repack what was loaded; once, after the whole checkpoint.

        .. versionadded:: 1.1
        """


@runtime_checkable
class EmbeddingLayer(Protocol):
    """The token embedding from :meth:`LayerFactory.embedding`: ``vectors = layer(ids)``.

    Attributes:
        weight: ``[ceil(vocab / tp_size), hidden]``, this rank's rows of the table (rows
            past the vocabulary are zero); a quantization method that handles embeddings
            stores it in its own format.

    .. versionadded:: 1.1
    """

    weight: torch.Tensor

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[num_tokens]`` int64 ids -> ``[num_tokens, hidden]`` (full rows on every rank).

        .. versionadded:: 1.1
        """

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        """Copy this rank's rows of the checkpoint's full table into ``param_name``.

        Args:
            param_name: ``"weight"`` (or a quantization method's parameter).
            tensor: The whole table; a checkpoint vocabulary smaller than the config's
                leaves the missing rows zero, rows past it are ignored.
            shard: ``None``.

        Raises:
            ValueError: an unknown parameter or a width that does not fit.

        .. versionadded:: 1.1
        """


@runtime_checkable
class AttentionLayer(Protocol):
    """Attention over the paged KV cache, from :meth:`LayerFactory.attention`.

    The selected attention backend computes it; the layer's KV cache is bound by the
    engine after the cache is allocated.

    .. versionadded:: 1.1
    """

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_metadata: Any) -> torch.Tensor:
        """Attend for the flattened tokens of one step.

        Args:
            query: ``[num_tokens, num_heads * head_size]``.
            key: ``[num_tokens, num_kv_heads * head_size]`` (written to the cache first).
            value: Like ``key``.
            attn_metadata: The ``attn_metadata`` the model's ``forward`` received, unchanged.

        Returns:
            ``[num_tokens, num_heads * head_size]``.

        .. versionadded:: 1.1
        """


@runtime_checkable
class FusedMoELayer(Protocol):
    """A mixture-of-experts MLP from :meth:`LayerFactory.fused_moe`.

    ``out = layer(hidden, router_logits)``: the ``fused_moe`` op
    (:class:`engine.sdk.ops.FusedMoEOp`, or its selected replacement) over this rank's
    share of every expert, summed over the tensor-parallel ranks.

    Attributes:
        op: The op; it holds the parameters ``w13`` ``[E, 2 * I_shard, H]`` and ``w2``
            ``[E, H, I_shard]`` (with ``bias`` also ``w13_bias`` ``[E, 2 * I_shard]`` and
            ``w2_bias`` ``[E, H]``, the checkpoint's on rank 0 and zeros on the others).

    .. versionadded:: 1.1
    """

    op: FusedMoEOp

    def __call__(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, H]`` and ``[num_tokens, E]`` -> ``[num_tokens, H]``, on every rank.

        .. versionadded:: 1.1
        """

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        """Copy this rank's part of one expert's (or every expert's) checkpoint tensor.

        Called: by the model's ``load_weights``, once per expert tensor (or once per
        stacked tensor).

        Args:
            param_name: The checkpoint name after the layer's prefix: one expert's
                ``"J.w1.weight"``, ``"J.w3.weight"``, ``"J.w2.weight"`` (Mixtral) or
                ``"J.gate_proj.weight"``, ``"J.up_proj.weight"``, ``"J.down_proj.weight"``
                (Qwen-MoE), ``J`` the expert's index; without ``J.`` (``"w1.weight"``)
                the tensor holds every expert stacked, as GGUF files store them; or every
                expert's, stacked with the expert as dim 0 in the op's layout:
                ``"gate_up_proj"`` ``[E, 2 * I, H]`` (gate rows, then up rows),
                ``"down_proj"`` ``[E, H, I]``, and with ``bias`` ``"gate_up_proj_bias"``
                ``[E, 2 * I]`` and ``"down_proj_bias"`` ``[E, H]`` (a model whose
                checkpoint stores them otherwise, e.g. GPT-OSS's transposed, interleaved
                ``gate_up_proj``, rearranges them first).
            tensor: The whole tensor: ``[I, H]`` for one expert's gate and up, ``[H, I]``
                for its down; stacked per projection ``[E, I, H]`` and ``[E, H, I]``; the
                op-layout shapes above.
            shard: ``None``.

        Raises:
            ValueError: an unknown name, an expert out of range, or a shape that does not
                fit (the message names both shapes).

        .. versionadded:: 1.1
        """


@runtime_checkable
class LayerFactory(Protocol):
    """Builds one model's layers; what ``ModelContext.layers`` holds in every worker.

    Called: by the model's ``__init__``, in the worker, under the device's ``torch.device``
    context; once per layer. Every rank makes the same calls with the same whole-model
    sizes.

    .. versionadded:: 1.1
    """

    @property
    def tp_rank(self) -> int:
        """This worker's tensor-parallel rank (``0`` on one device).

        .. versionadded:: 1.1
        """

    @property
    def tp_size(self) -> int:
        """The number of tensor-parallel ranks (``1`` on one device).

        .. versionadded:: 1.1
        """

    def linear(self, prefix: str, input_size: int, output_sizes: Sequence[int], *,
               bias: bool = False, kind: Literal["linear", "lm_head"] = "linear",
               parallel: Literal["replicated", "column", "row"] = "replicated",
               head_size: int | None = None) -> LinearLayer:
        """A linear layer, possibly fusing several logical outputs, possibly sharded.

        The quantization method is asked for the layer (``get_quant_method`` with
        ``kind``); ``None`` leaves it unquantized. Its matmul is a linear kernel chosen
        for the method's scheme.

        Args:
            prefix: The layer's checkpoint name (``"model.layers.0.self_attn.qkv_proj"``);
                quantization methods match on it.
            input_size: Input features, whole model.
            output_sizes: Output features of each fused logical output, whole model: one
                entry for a plain layer, ``(q, k, v)`` or ``(gate, up)`` for fused ones.
            bias: Whether the layer has a bias.
            kind: ``"linear"``, or ``"lm_head"`` for the head (one output: the vocabulary).
            parallel: ``"replicated"`` (every rank holds everything), ``"column"``
                (outputs split across ranks; an ``lm_head`` is split by vocabulary rows,
                ``ceil(vocab / tp_size)`` per rank, and its logits gathered on rank 0) or
                ``"row"`` (inputs split, the ranks' outputs summed).
            head_size: With ``parallel="column"`` for an attention projection: split each
                output by whole heads of this size; an output with fewer heads than ranks
                (KV heads) gives each rank the one head its query heads use.

        Returns:
            The layer (a ``torch.nn.Module``).

        Raises:
            ValueError: a size does not split across the ranks, an ``lm_head`` with more
                than one output, or outputs that are not whole heads of ``head_size``.
            UnsupportedError: no linear kernel can run the layer's scheme here (each
                kernel's reason listed).

        .. versionadded:: 1.1
        """

    def embedding(self, prefix: str, vocab_size: int, hidden_size: int, *,
                  scale: float | None = None) -> EmbeddingLayer:
        """The token embedding table, split by vocabulary rows across the ranks.

        The quantization method is asked with ``kind="embedding"``; when it returns a
        method, the table's storage and lookup are that method's.

        Args:
            prefix: The table's checkpoint name (``"model.embed_tokens"``).
            vocab_size: Rows of the whole table.
            hidden_size: Width of a row.
            scale: Multiply every row looked up by this number, first rounded to the model
                dtype (the product as torch computes a tensor of that dtype times a
                0-dimensional tensor of that dtype holding it: Gemma's
                ``embeds * sqrt(hidden_size)``). The table stays as stored, so an LM head
                tied to it reads the unscaled rows. It works with a quantized table too
                (the scale follows the method's lookup), and the engine's CPU step graph
                records it. None: the rows as stored. Not a finite number: ``ValueError``.

        Returns:
            The layer (a ``torch.nn.Module``).

        .. versionadded:: 1.1
        """

    def attention(self, prefix: str, *, num_heads: int, num_kv_heads: int, head_size: int,
                  scale: float, sliding_window: int | None = None,
                  logits_soft_cap: float | None = None,
                  sinks: bool = False) -> AttentionLayer:
        """An attention layer served by the selected attention backend.

        Args:
            prefix: A unique name of the layer; it names the layer's KV cache.
            num_heads: This rank's query heads (e.g. ``q_size // head_size`` from the
                qkv layer's :attr:`LinearLayer.output_partition_sizes`).
            num_kv_heads: This rank's key/value heads (fewer than ``num_heads``: GQA).
            head_size: Elements per head.
            scale: Softmax scale, usually ``head_size ** -0.5``.
            sliding_window: Attend to at most this many past tokens; ``None``: all.
            logits_soft_cap: Cap the scaled scores smoothly, ``cap * tanh(score / cap)``
                before the softmax (Gemma 2's ``attn_logit_softcapping``); ``None``: no
                cap (:attr:`engine.sdk.attention.AttentionSpec.logits_soft_cap`).
            sinks: Attention sinks (GPT-OSS): the layer then has a parameter ``sinks``,
                float32 ``[num_heads]`` (this rank's heads), one logit per head added to
                the softmax's denominator
                (:attr:`engine.sdk.attention.AttentionSpec.has_sinks`). Load it with
                ``layer.load_weight("sinks", tensor)``, ``tensor`` the checkpoint's
                whole ``[num_heads * tp_size]`` (e.g. ``model.layers.N.self_attn.sinks``):
                the layer keeps its rank's heads.

        Returns:
            The layer (a ``torch.nn.Module``).

        Raises:
            ValueError: a count is not positive, ``num_kv_heads`` does not divide
                ``num_heads``, or ``logits_soft_cap`` is not a finite number > 0.

        .. versionadded:: 1.1
        """

    def rms_norm(self, hidden_size: int, eps: float) -> RMSNormOp:
        """The ``rms_norm`` op (or its selected replacement), weight ``[hidden_size]``.

        Call it as ``norm(x) -> y`` or ``norm(x, residual) -> (y, new_residual)``
        (:class:`engine.sdk.ops.RMSNormOp`); load its ``weight`` by copying the
        checkpoint tensor into it.

        Args:
            hidden_size: The normalised (last) dimension.
            eps: Added to the mean square.

        Returns:
            The op (a ``torch.nn.Module``).

        .. versionadded:: 1.1
        """

    def rotary_embedding(self, head_size: int, rotary_dim: int, max_position: int,
                         rope: Mapping[str, Any], *,
                         is_neox_style: bool = True) -> RotaryEmbeddingOp:
        """The ``rotary_embedding`` op (or its replacement) with the cache for ``rope``.

        Call it as ``rope(positions, query, key) -> (query, key)`` with
        ``[num_tokens, heads, head_size]`` tensors (:class:`engine.sdk.ops.RotaryEmbeddingOp`).

        Args:
            head_size: Elements per head.
            rotary_dim: Leading elements of each head that rotate (even, <= head_size).
            max_position: Positions covered (the config's ``max_position_embeddings``).
            rope: The rope settings: ``rope_type`` (``"default"``, ``"linear"``,
                ``"llama3"``, ``"yarn"``, ``"longrope"`` (also read as ``"su"``) or
                ``"dynamic"``), ``rope_theta`` (the base), plus the type's own keys
                (``"linear"``, ``"dynamic"``: ``factor``; ``"llama3"``: ``factor``,
                ``low_freq_factor``, ``high_freq_factor``,
                ``original_max_position_embeddings``; ``"yarn"``: ``factor``,
                ``original_max_position_embeddings``, optional ``beta_fast``,
                ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``attention_factor``,
                ``truncate``; ``"longrope"``: ``short_factor``, ``long_factor``,
                ``original_max_position_embeddings``, optional ``factor``,
                ``attention_factor``), as transformers spells them and with its
                semantics; :func:`rope_settings` reads them from a transformers config of
                either era (other keys are ignored). YaRN's and LongRoPE's attention
                factor scales the cache's cosines and sines. LongRoPE uses its long factors
                for every position when the engine serves sequences longer than
                ``original_max_position_embeddings`` (its ``max_model_len``), else the
                short ones (vLLM's rule; transformers chooses per forward pass).
                ``"dynamic"`` (NTK) changes nothing below ``max_position``, as in
                transformers.
            is_neox_style: Rotate halves (NeoX, Llama) or interleaved pairs (GPT-J).

        Returns:
            The op (a ``torch.nn.Module``).

        Raises:
            ValueError: an unsupported ``rope_type`` (the message lists the supported
                ones), or an odd or too large ``rotary_dim``.
            KeyError: a key the ``rope_type`` needs is missing (the message names the type,
                the key and the supported types).

        .. versionadded:: 1.1
        """

    def silu_and_mul(self) -> SiluAndMulOp:
        """The ``silu_and_mul`` op (or its replacement): ``silu(x[..., :d]) * x[..., d:]``.

        Returns:
            The op (a ``torch.nn.Module``; :class:`engine.sdk.ops.SiluAndMulOp`).

        .. versionadded:: 1.1
        """

    def gelu_and_mul(self, approximate: Literal["none", "tanh"] = "none") -> GeluAndMulOp:
        """The ``gelu_and_mul`` op (or its replacement): ``gelu(x[..., :d]) * x[..., d:]``.

        Args:
            approximate: ``"none"`` (exact, erf) or ``"tanh"`` (transformers'
                ``gelu_pytorch_tanh``), as :func:`torch.nn.functional.gelu` takes it.

        Returns:
            The op (a ``torch.nn.Module``; :class:`engine.sdk.ops.GeluAndMulOp`).

        Raises:
            ValueError: ``approximate`` is neither ``"none"`` nor ``"tanh"``.

        .. versionadded:: 1.1
        """

    def fused_moe(self, prefix: str, num_experts: int, top_k: int, hidden_size: int,
                  intermediate_size: int, *, renormalize: bool = True,
                  activation: Literal["silu", "swigluoai"] = "silu",
                  swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                  bias: bool = False) -> FusedMoELayer:
        """A mixture-of-experts MLP: the ``fused_moe`` op (or its selected replacement).

        The router (``gate``) is the model's own: a replicated ``linear(..., (num_experts,))``
        whose output is the layer's ``router_logits``. Each expert is a SwiGLU MLP
        (``w2 @ (silu(w1 @ x) * (w3 @ x))``; GPT-OSS's clamped variant with
        ``activation="swigluoai"``, biases with ``bias``); under tensor parallelism every
        rank holds every expert with an even share of its intermediate size, and the layer
        sums the ranks' outputs, as a row-parallel linear does (the down projection's bias
        counted once).

        Args:
            prefix: The experts' checkpoint name (``"model.layers.0.block_sparse_moe.experts"``
                for Mixtral, ``"model.layers.0.mlp.experts"`` for Qwen3-MoE); expert tensors
                are named ``{prefix}.J.w1.weight`` and so on (:meth:`FusedMoELayer.load_weight`).
            num_experts: Experts ``E``.
            top_k: Experts per token.
            hidden_size: ``H``.
            intermediate_size: Each expert's intermediate size, whole model.
            renormalize: Renormalise the ``top_k`` routing weights to sum to one (Mixtral;
                Qwen3-MoE's ``norm_topk_prob``); see :class:`engine.sdk.ops.FusedMoEOp`.
            activation: The experts' gated activation: ``"silu"`` (SwiGLU) or
                ``"swigluoai"`` (GPT-OSS: ``(clamp(up) + 1) * gate * sigmoid(alpha * gate)``,
                gate clamped from above); see :class:`engine.sdk.ops.FusedMoEOp`.
            swiglu_alpha: ``"swigluoai"``'s ``alpha`` (GPT-OSS's ``swiglu_alpha``).
            swiglu_limit: ``"swigluoai"``'s clamp limit (GPT-OSS's ``swiglu_limit``).
            bias: The experts' gate/up and down projections carry biases.

        Returns:
            The layer (a ``torch.nn.Module``).

        Raises:
            ValueError: ``intermediate_size`` does not split across the ranks, a size or
                ``top_k`` is out of range, or an unknown ``activation`` or a non-positive
                ``swiglu_limit``.

        .. versionadded:: 1.1
        """
