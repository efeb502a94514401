"""``LayerFactory``: how models build layers that honour every plugin seam.

A model never instantiates a linear, norm, rotary or attention layer class directly: it
asks the factory it received in ``ModelContext.layers``; the SDK's
``engine.sdk.layers.LayerFactory`` protocol is the interface this class implements (and
models may rely on). The factory applies the selected
quantization method, the selected attention backend, custom-op replacements and tensor
parallelism, so a model plugin gets them all for free.

Tensor parallelism: the model gives whole-model sizes and a parallel style per linear layer
(``parallel="column"`` for qkv and gate/up, ``"row"`` for o_proj and down_proj, ``"column"``
with ``kind="lm_head"`` for the LM head); the factory works out this rank's part (see
``engine.core.distributed.sharding``) and the layer exposes it
(``Linear.output_partition_sizes``). The embedding is always split by vocabulary rows.
Attention layers get this rank's head counts, which the model reads off its qkv layer.
A fused mixture-of-experts layer holds every expert with this rank's share of each
expert's intermediate size, and sums the ranks' outputs (``layers.fused_moe``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

import torch

from engine.core.distributed import (
    SINGLE,
    Slice,
    TensorParallelGroup,
    even_slice,
    head_slice,
    vocab_slice,
)
from engine.core.model_executor.layers.attention import Attention
from engine.core.model_executor.layers.builtin_ops import BUILTIN_IMPLEMENTATIONS
from engine.core.model_executor.layers.embedding import QuantizedVocabEmbedding, VocabEmbedding
from engine.core.model_executor.layers.fused_moe import MoELayer
from engine.core.model_executor.layers.linear import Linear, LinearShards, UnquantizedLinearMethod
from engine.core.model_executor.layers.rope import cos_sin_cache
from engine.core.model_executor.linear_kernels import TorchLinearKernel
from engine.sdk.attention import (
    AttentionBackend,
    AttentionImplParams,
    AttentionSpec,
    backend_supports,
)
from engine.sdk.errors import UnsupportedError
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig, select_linear_kernel
from engine.sdk.ops import (
    CustomOp,
    FusedMoEOp,
    GeluAndMulOp,
    RMSNormOp,
    RotaryEmbeddingOp,
    SiluAndMulOp,
)
from engine.sdk.platform import PlatformInfo
from engine.sdk.plugin import PluginOptions
from engine.sdk.quantization import LayerInfo, QuantizationConfig

logger = logging.getLogger(__name__)


def default_kernel_selector(config: LinearKernelConfig) -> type[LinearKernel]:
    """engine-core's reference kernels, for hand-built factories (e.g. in tests).

    ``F.linear`` for unquantized layers and ``int8_reference`` for int8 weights; a factory
    for another scheme (engine-kernels' GGUF, a plugin's) is given a selector over its
    kernels.
    """
    from engine.core.quantization.int8_kernels import Int8ReferenceKernel

    kernels = [TorchLinearKernel, Int8ReferenceKernel]
    return select_linear_kernel(kernels, PlatformInfo("cpu", "cpu"), config)


def _label(backend: type[AttentionBackend]) -> str:
    return backend.name or f"{backend.__module__}:{backend.__qualname__}"


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class LayerFactory:
    """Builds layers for one model.

    Attributes:
        dtype: Parameter and activation dtype.
        block_size: KV-cache block size (part of every attention spec).
        attention_backend: The selected backend class.
        backend_options: The backend's validated options.
        quant_config: The selected quantization method's configuration, or None. Every
            linear layer, the LM head and the embedding ask its ``get_quant_method``
            (``None``: the layer stays unquantized).
        op_classes: Op name -> replacement class to build; ops not in it are built from
            ``builtin_ops.BUILTIN_IMPLEMENTATIONS``.
        dispatch_key: Dispatch key for enabled custom ops (the platform's device type).
        linear_kernel_selector: Chooses the linear kernel of each layer (default: the
            ``torch`` kernel; the engine passes one over every installed kernel).
        tp: The tensor-parallel group this worker belongs to (default: one rank).
        max_model_len: The longest sequence the engine serves (``None``: each rotary
            layer's ``max_position``); LongRoPE chooses its factors by it (``layers.rope``).
        attention_layers: Filled as attention layers are built: name -> layer.
        fallback_backend: The backend (with its options) that serves the whole model
            instead when ``attention_backend`` refuses a layer's spec; None (the default,
            and where the operator named the backend): such a layer is an error. The
            engine gives the ``torch`` reference backend where the backend is the
            platform's default.
    """

    dtype: torch.dtype
    block_size: int
    attention_backend: type[AttentionBackend]
    backend_options: PluginOptions = field(default_factory=PluginOptions)
    quant_config: QuantizationConfig | None = None
    op_classes: dict[str, type[CustomOp]] = field(default_factory=dict)
    dispatch_key: str = "cpu"
    linear_kernel_selector: Callable[[LinearKernelConfig], type[LinearKernel]] = field(
        default_factory=lambda: default_kernel_selector)
    tp: TensorParallelGroup = SINGLE
    max_model_len: int | None = None
    attention_layers: dict[str, Attention] = field(default_factory=dict)
    fallback_backend: tuple[type[AttentionBackend], PluginOptions] | None = None

    @property
    def dtype_name(self) -> str:
        """The dtype as the SDK spells it."""
        return _DTYPE_NAMES[self.dtype]

    @property
    def tp_rank(self) -> int:
        """This worker's tensor-parallel rank."""
        return self.tp.rank

    @property
    def tp_size(self) -> int:
        """Number of tensor-parallel ranks."""
        return self.tp.size

    def linear(
        self, prefix: str, input_size: int, output_sizes: Sequence[int], *, bias: bool = False,
        kind: str = "linear", parallel: str = "replicated", head_size: int | None = None,
    ) -> Linear:
        """A linear layer; ``output_sizes`` lists fused logical outputs (q, k, v; gate, up).

        Args:
            prefix: The layer's checkpoint name.
            input_size: Input features of the whole layer.
            output_sizes: Output features of each fused logical output, whole model.
            bias: Whether the layer has a bias.
            kind: ``"linear"`` or ``"lm_head"``.
            parallel: ``"replicated"``, ``"column"`` (outputs split; an ``lm_head`` is split
                by vocabulary rows, padded to ``ceil(vocab / tp)`` per rank, and its logits
                are gathered on rank 0) or ``"row"`` (inputs split, outputs summed).
            head_size: For a column-parallel attention projection: split each output by
                whole heads of this size; an output with fewer heads than ranks (KV heads)
                gives each rank the one head its query heads use.

        Raises:
            ValueError: a size does not split across the ranks.
        """
        sizes = tuple(output_sizes)
        shards = self._shards(input_size, sizes, kind, parallel, head_size)
        info = LayerInfo(
            prefix=prefix, kind=kind, input_size=input_size, output_size=sum(sizes),
            input_size_per_partition=shards.input_slice.size,
            output_partition_sizes=tuple(part.size for part in shards.output_slices),
            params_dtype=self.dtype_name, tp_rank=self.tp_rank, tp_size=self.tp_size,
            parallel=parallel, has_bias=bias, linear_kernel_selector=self.linear_kernel_selector,
        )
        method = None
        if self.quant_config is not None:
            method = self.quant_config.get_quant_method(info, prefix)
        gather = sizes[0] if kind == "lm_head" and parallel == "column" else None
        return Linear(info, method or UnquantizedLinearMethod(), shards=shards, tp=self.tp,
                      gather_size=gather)

    def _shards(self, input_size: int, sizes: tuple[int, ...], kind: str, parallel: str,
                head_size: int | None) -> LinearShards:
        rank, size = self.tp_rank, self.tp_size
        if parallel == "row":
            return LinearShards(sizes, tuple(Slice(0, n) for n in sizes),
                                even_slice(input_size, rank, size, "input features"))
        if parallel != "column":
            return LinearShards.whole(input_size, sizes)
        if kind == "lm_head":
            if len(sizes) != 1:
                raise ValueError(f"an lm_head has one output (the vocabulary), got {sizes}")
            return LinearShards(sizes, (vocab_slice(sizes[0], rank, size),), Slice(0, input_size))
        if head_size is None:
            slices = [even_slice(n, rank, size, "output features") for n in sizes]
        else:
            slices = [self._head_features(n, head_size) for n in sizes]
        return LinearShards(sizes, tuple(slices), Slice(0, input_size))

    def _head_features(self, features: int, head_size: int) -> Slice:
        """This rank's features of an output made of heads (see ``sharding.head_slice``)."""
        if features % head_size:
            raise ValueError(f"{features} output features are not whole heads of {head_size}")
        heads = head_slice(features // head_size, self.tp_rank, self.tp_size)
        return Slice(heads.start * head_size, heads.size * head_size)

    def embedding(self, prefix: str, vocab_size: int, hidden_size: int, *,
                  scale: float | None = None) -> VocabEmbedding | QuantizedVocabEmbedding:
        """The token embedding table (split by vocabulary rows across the ranks).

        The quantization method is asked with ``kind="embedding"``; when it returns a
        method, the table is a :class:`QuantizedVocabEmbedding` whose storage and lookup
        are the method's. ``scale``: each row looked up is multiplied by it, rounded to the
        model dtype (the table, and a tied head's weight, stay unscaled).
        """
        if self.quant_config is not None:
            rows = vocab_slice(vocab_size, self.tp_rank, self.tp_size).size
            info = LayerInfo(
                prefix=prefix, kind="embedding", input_size=vocab_size, output_size=hidden_size,
                input_size_per_partition=rows, output_partition_sizes=(hidden_size,),
                params_dtype=self.dtype_name, tp_rank=self.tp_rank, tp_size=self.tp_size,
                parallel="row", linear_kernel_selector=self.linear_kernel_selector,
            )
            method = self.quant_config.get_quant_method(info, prefix)
            if method is not None:
                return QuantizedVocabEmbedding(info, method, self.tp, scale=scale)
        return VocabEmbedding(vocab_size, hidden_size, self.dtype, prefix, self.tp, scale=scale)

    def attention(
        self, prefix: str, *, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
        sliding_window: int | None = None, logits_soft_cap: float | None = None,
        sinks: bool = False,
    ) -> Attention:
        """An attention layer served by the selected backend.

        ``num_heads`` / ``num_kv_heads`` are this rank's heads (what its qkv layer
        produces, e.g. ``qkv.output_partition_sizes[0] // head_size``); the KV cache is
        sized by them. With ``sinks`` the layer holds a float32 ``[num_heads]`` parameter
        ``sinks`` that the implementation reads (``AttentionImplParams.sinks``); its
        ``load_weight("sinks", whole)`` keeps this rank's heads of the checkpoint's tensor.

        Every layer's spec is checked against the backend (``backend_supports``): a
        layer it refuses moves the whole model to ``fallback_backend`` (the layers built
        so far get its implementation; one WARNING says why) where there is one.

        Raises:
            UnsupportedError: the backend refuses this layer's spec (its ``supports``, or
                a spec field it does not answer) and there is no fallback, or the fallback
                refuses one of the layers too; naming the layer, the backend(s) and why.
        """
        spec = AttentionSpec(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
            dtype=self.dtype_name, kv_cache_dtype=self.dtype_name, block_size=self.block_size,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, has_sinks=sinks,
        )
        answer = backend_supports(self.attention_backend, spec)
        if not answer:
            self._fall_back(prefix, spec, answer.reason)
        # Zeros until the model loads them; the parameter and the impl share the tensor.
        sink_values = torch.zeros(num_heads, dtype=torch.float32) if sinks else None
        params = AttentionImplParams(spec=spec, layer_name=prefix, scale=scale,
                                     options=self.backend_options, sinks=sink_values)
        impl = self.attention_backend.get_impl_cls()(params)
        layer = Attention(impl, prefix, num_heads, num_kv_heads, head_size,
                          tp_rank=self.tp_rank, tp_size=self.tp_size)
        self.attention_layers[prefix] = layer
        return layer

    def _fall_back(self, prefix: str, spec: AttentionSpec, reason: str) -> None:
        """Serve the model with ``fallback_backend``: ``attention_backend`` refused ``prefix``.

        Raises:
            UnsupportedError: there is no fallback, or it refuses a layer as well.
        """
        name = _label(self.attention_backend)
        reasons = [(name, reason)]
        problem = f"attention layer {prefix!r} ({spec.describe()}): attention backend " \
                  f"{name!r} cannot serve it"
        if self.fallback_backend is None or self.fallback_backend[0] is self.attention_backend:
            raise UnsupportedError(problem, reasons)
        backend, options = self.fallback_backend
        specs = {n: layer.impl.params.spec for n, layer in self.attention_layers.items()}
        for layer_name, layer_spec in {**specs, prefix: spec}.items():
            answer = backend_supports(backend, layer_spec)
            if not answer:
                raise UnsupportedError(
                    f"{problem}, and the fallback {_label(backend)!r} cannot serve layer "
                    f"{layer_name!r} ({layer_spec.describe()})",
                    [*reasons, (_label(backend), answer.reason)])
        logger.warning("attention: backend %r (the engine's choice: no --attention-backend) "
                       "cannot serve layer %r (%s: %s); the %r backend serves the whole model",
                       name, prefix, spec.describe(), reason, _label(backend))
        self.attention_backend, self.backend_options = backend, options
        self.fallback_backend = None
        for layer in self.attention_layers.values():
            layer.impl = backend.get_impl_cls()(replace(layer.impl.params, options=options))

    def _op(self, name: str) -> type[CustomOp]:
        return self.op_classes.get(name, BUILTIN_IMPLEMENTATIONS[name])

    # The op classes are the engine's built-in implementations or replacements, all
    # subclasses of the contracts (``engine.sdk.ops.check_replacement``), hence the casts.

    def rms_norm(self, hidden_size: int, eps: float) -> RMSNormOp:
        """``rms_norm``: call ``op(x)`` or ``op(x, residual)``."""
        cls = cast(type[RMSNormOp], self._op("rms_norm"))
        return cls(hidden_size, eps, dtype=self.dtype, dispatch_key=self.dispatch_key)

    def rotary_embedding(
        self, head_size: int, rotary_dim: int, max_position: int, rope: Mapping[str, Any],
        *, is_neox_style: bool = True,
    ) -> RotaryEmbeddingOp:
        """``rotary_embedding`` with the cache for ``rope`` (see ``layers.rope``)."""
        cache = cos_sin_cache(rotary_dim, max_position, dict(rope), self.max_model_len)
        cls = cast(type[RotaryEmbeddingOp], self._op("rotary_embedding"))
        return cls(head_size, rotary_dim, cache, is_neox_style, dispatch_key=self.dispatch_key)

    def silu_and_mul(self) -> SiluAndMulOp:
        """``silu_and_mul``: ``silu(x[..., :d]) * x[..., d:]``."""
        cls = cast(type[SiluAndMulOp], self._op("silu_and_mul"))
        return cls(dispatch_key=self.dispatch_key)

    def gelu_and_mul(self, approximate: Literal["none", "tanh"] = "none") -> GeluAndMulOp:
        """``gelu_and_mul``: ``gelu(x[..., :d], approximate=approximate) * x[..., d:]``.

        Raises:
            ValueError: ``approximate`` is neither ``"none"`` nor ``"tanh"``.
        """
        cls = cast(type[GeluAndMulOp], self._op("gelu_and_mul"))
        return cls(approximate, dispatch_key=self.dispatch_key)

    def fused_moe(self, prefix: str, num_experts: int, top_k: int, hidden_size: int,
                  intermediate_size: int, *, renormalize: bool = True,
                  activation: Literal["silu", "swigluoai"] = "silu",
                  swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                  bias: bool = False) -> MoELayer:
        """``fused_moe``: every expert, this rank's share of each intermediate dimension.

        With ``bias`` the down projection's bias is loaded on rank 0 only (zeros on the
        others), so the ranks' sum counts it once.

        Raises:
            ValueError: ``intermediate_size`` does not split across the ranks, a size or
                ``top_k`` is out of range, or an unknown ``activation`` or a non-positive
                ``swiglu_limit`` (the op's checks).
        """
        part = even_slice(intermediate_size, self.tp_rank, self.tp_size,
                          "expert intermediate features")
        cls = cast(type[FusedMoEOp], self._op("fused_moe"))
        op = cls(num_experts, top_k, hidden_size, part.size, renormalize=renormalize,
                 activation=activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                 bias=bias, dtype=self.dtype, dispatch_key=self.dispatch_key)
        return MoELayer(op, prefix, part, self.tp)
