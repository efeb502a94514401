"""The attention-backend contract: how paged attention is computed over the KV cache.

An attention backend is three classes that work together, all in the worker process:

* :class:`AttentionBackend`: the entry in ``engine.attention_backends``. Class methods only
  (never instantiated): what it supports, the KV-cache layout, and its two other classes.
* :class:`AttentionMetadataBuilder`: built once per attention group (layers sharing one
  :class:`AttentionSpec`); turns the engine's :class:`CommonAttentionMetadata` into the
  backend's own metadata, once per step.
* :class:`AttentionImpl`: one per attention layer; ``forward`` writes the step's new keys
  and values into the layer's KV cache and computes attention.

One step in a worker: ``metadata = builder.build(common)`` once per attention group, then
``impl.forward(q, k, v, kv_cache[layer], metadata, output)`` in each layer of the group.

KV-cache layout: the engine allocates one tensor per layer, shaped by
:meth:`AttentionBackend.get_kv_cache_shape` and typed ``spec.kv_cache_dtype``. A token's
*slot* is ``block_id * block_size + offset_in_block``. Block 0 is the *null block*: the
engine never gives it to a request, so padding entries of ``slot_mapping`` and unused
entries of ``block_table`` point at it, and a kernel may write there unconditionally (a
captured CUDA graph cannot skip padding rows).

Selection (in each worker, once per model): ``--attention-backend NAME`` names the only
candidate; otherwise the platform's default. :func:`select_backend` asks each
candidate's :meth:`~AttentionBackend.supports` and raises
:class:`~engine.sdk.errors.UnsupportedError` listing every candidate with its reason
when none fits. Each attention layer's own spec is then checked against the chosen
backend as the model builds it (:func:`backend_supports`); the layers are grouped by spec,
one metadata builder per group (since 1.1).

.. versionadded:: 1.0
"""

from __future__ import annotations

import enum
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from engine.sdk.capture import CaptureContext, GraphKind, not_declared
from engine.sdk.context import PluginContext
from engine.sdk.errors import UnsupportedError
from engine.sdk.plugin import Plugin, PluginOptions
from engine.sdk.support import Support

if TYPE_CHECKING:
    import torch

    from engine.sdk.platform import PlatformInfo

MetadataT = TypeVar("MetadataT")


class CudaGraphSupport(enum.IntEnum):
    """Which batches a backend can run inside a captured CUDA graph; ordered, least first.

    The engine caps its graph mode with ``min(requested_mode, backend.cudagraph_support)``.

    Attributes:
        NEVER: Attention must run eagerly (the engine captures no graph around it).
        UNIFORM_SINGLE_TOKEN_DECODE: Only batches in which every request has exactly one
            query token (plain decode).
        UNIFORM_BATCH: Batches in which every request has the same query length (decode
            with speculative tokens included).
        ALWAYS: Any batch, mixed prefill and decode included.

    .. versionadded:: 1.0
    """

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@dataclass(frozen=True)
class AttentionSpec:
    """What an attention layer needs from a backend; the input of ``supports``.

    Head counts are per tensor-parallel rank (what one worker computes). Fields are only
    ever added, with defaults that keep the old meaning, within a major version.

    Attributes:
        num_heads: Query heads on this rank.
        num_kv_heads: Key/value heads on this rank; divides ``num_heads`` (GQA/MQA when
            smaller).
        head_size: Elements per head.
        dtype: Dtype of query, key, value and output, e.g. ``"bfloat16"``.
        kv_cache_dtype: Dtype of the KV cache, resolved by the engine (never ``"auto"``),
            e.g. ``"bfloat16"`` or ``"float8_e4m3fn"``.
        block_size: Tokens per KV-cache block.
        sliding_window: Attend only to the last ``sliding_window`` tokens (the query
            token included); ``None`` for full attention.
        is_causal: Causal masking (decoder self-attention).
        platform: The device the backend would run on; ``None`` only in unit tests.
        logits_soft_cap: Cap the scores smoothly: after scaling, before masking and the
            softmax, each score ``s`` becomes ``cap * tanh(s / cap)`` (Gemma 2's
            ``attn_logit_softcapping``); ``None`` for none. A backend answers it only if it
            lists ``"logits_soft_cap"`` in :attr:`AttentionBackend.answered_spec_fields`
            (added in 1.1).
        has_sinks: Attention sinks (GPT-OSS): each query head has a learned logit that
            joins its scores in the softmax and is dropped after, so it only adds
            ``exp(sink)`` to the denominator. The values are the layer's
            :attr:`AttentionImplParams.sinks`. Answered only by a backend listing
            ``"has_sinks"`` in :attr:`AttentionBackend.answered_spec_fields` (added in 1.1).

    Raises:
        ValueError: A count is not positive, ``num_kv_heads`` does not divide
            ``num_heads``, ``logits_soft_cap`` is not a finite number > 0, or
            ``has_sinks`` is not a bool.

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Added ``logits_soft_cap`` and ``has_sinks``.
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: str
    kv_cache_dtype: str
    block_size: int
    sliding_window: int | None = None
    is_causal: bool = True
    platform: PlatformInfo | None = None
    logits_soft_cap: float | None = None
    has_sinks: bool = False

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"AttentionSpec.{name} must be an integer >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"AttentionSpec.num_kv_heads ({self.num_kv_heads}) must divide num_heads "
                f"({self.num_heads})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"AttentionSpec.sliding_window must be >= 1 or None, got {self.sliding_window}"
            )
        cap = self.logits_soft_cap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                                or not math.isfinite(cap) or cap <= 0):
            raise ValueError(
                f"AttentionSpec.logits_soft_cap must be a finite number > 0 or None, got {cap!r}"
            )
        if not isinstance(self.has_sinks, bool):
            raise ValueError(f"AttentionSpec.has_sinks must be a bool, got {self.has_sinks!r}")

    def describe(self) -> str:
        """One line for error messages, e.g. ``heads=32/8 head_size=128 dtype=bfloat16 ...``."""
        text = (
            f"heads={self.num_heads}/{self.num_kv_heads} head_size={self.head_size} "
            f"dtype={self.dtype} kv_cache_dtype={self.kv_cache_dtype} block_size={self.block_size}"
        )
        text += "" if self.sliding_window is None else f" sliding_window={self.sliding_window}"
        text += "" if self.logits_soft_cap is None else f" logits_soft_cap={self.logits_soft_cap}"
        text += " sinks" if self.has_sinks else ""
        text += "" if self.is_causal else " non-causal"
        return text + ("" if self.platform is None else f" platform={self.platform.name}")


@dataclass(frozen=True, kw_only=True)
class AttentionContext(PluginContext):
    """What a metadata builder is told: one attention group in one worker.

    Attributes:
        spec: The spec every layer of the group shares.
        layer_names: The layers of the group, in model order (e.g.
            ``"model.layers.0.self_attn.attn"``).
        device: Device the step's tensors live on, e.g. ``"cpu"`` or ``"cuda:0"``.
        max_num_reqs: Most requests in one step (size persistent buffers with it).
        max_num_batched_tokens: Most tokens in one step.
        max_model_len: Longest sequence, prompt plus output.

    .. versionadded:: 1.0
    """

    spec: AttentionSpec
    layer_names: tuple[str, ...]
    device: str
    max_num_reqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class CommonAttentionMetadata:
    """The step's batch layout, built by the engine once per step for every backend.

    Tokens of all scheduled requests are flattened into one batch of ``num_tokens`` rows;
    request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i + 1]``, which are its
    last ``query_len`` tokens (the ones computed this step). ``num_tokens >=
    num_actual_tokens``: rows past ``num_actual_tokens`` are padding (CUDA-graph sizes).

    Device tensors are on the worker's device; ``*_cpu`` tensors are host copies of the
    same values, for backends that need them in Python without a device sync.

    Attributes:
        query_start_loc: ``[num_reqs + 1]`` int32, device. Cumulative query lengths;
            ``query_start_loc[0] == 0`` and ``query_start_loc[num_reqs] ==
            num_actual_tokens``.
        query_start_loc_cpu: ``[num_reqs + 1]`` int32, host copy of ``query_start_loc``.
        seq_lens: ``[num_reqs]`` int32, device. Each request's context length after this
            step: tokens already in the KV cache plus this step's query tokens.
        seq_lens_cpu: ``[num_reqs]`` int32, host copy of ``seq_lens``.
        block_table: ``[num_reqs, max_num_blocks_per_req]`` int32, device. Row ``i`` lists
            request ``i``'s KV blocks in order; entries past ``ceil(seq_lens[i] /
            block_size)`` are 0 (the null block) and must not be read as context.
        slot_mapping: ``[num_tokens]`` int64, device. The cache slot each row's new key and
            value are written to; padding rows point into the null block.
        num_reqs: Requests in the step.
        num_actual_tokens: Real (unpadded) tokens in the step.
        max_query_len: Longest query of the step (1 for a pure-decode step).
        max_seq_len: Longest ``seq_lens`` entry.

    .. versionadded:: 1.0
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        """``[num_reqs]`` int32 host tensor: query tokens per request this step."""
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def is_uniform_decode(self) -> bool:
        """True when every request has exactly one query token."""
        return self.max_query_len == 1


@dataclass(frozen=True, kw_only=True)
class AttentionImplParams:
    """What one attention layer's implementation is built from.

    Attributes:
        spec: The layer's spec (head counts, dtypes, block size, sliding window, ...).
        layer_name: The layer's name, e.g. ``"model.layers.0.self_attn.attn"``.
        scale: Softmax scale applied to ``q @ k^T`` (usually ``head_size ** -0.5``).
        options: The backend's validated options (its ``Options`` model).
        sinks: With ``spec.has_sinks``: the layer's attention sinks, a float32 ``[num_heads]``
            tensor (this rank's heads) on the layer's device; otherwise None. The layer
            owns it and the model loads the checkpoint's values into it (in place) after
            the implementation is built: read it in ``forward``, never copy it in
            ``__init__``. Its storage stays put (a CPU step graph may record its pointer).

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Added ``sinks``.
    """

    spec: AttentionSpec
    layer_name: str
    scale: float
    options: PluginOptions = field(default_factory=PluginOptions)
    sinks: torch.Tensor | None = None


class AttentionMetadataBuilder(ABC, Generic[MetadataT]):
    """Turns the engine's batch layout into a backend's metadata, once per step.

    Called: constructed in the worker once per attention group, after the KV cache is
    allocated. ``build`` is called once per step per group on the worker's main thread.

    Type parameter ``MetadataT`` is the backend's metadata type (any object; a frozen
    dataclass is usual).

    .. versionadded:: 1.0
    """

    def __init__(self, ctx: AttentionContext) -> None:
        """Store ``ctx`` (spec, layer names, device, limits); subclasses may preallocate."""
        self.ctx = ctx

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> MetadataT:
        """Build this step's metadata from the common batch layout.

        Called: in the worker, once per step per attention group, before the model's
        forward; the result is passed unchanged to every layer's
        :meth:`AttentionImpl.forward` in that group.

        Args:
            common: The step's layout; its tensors are only valid during this step.

        Returns:
            The backend's metadata.

        Must: not modify ``common``'s tensors. May: keep references to them for the step,
        and reuse buffers allocated in ``__init__`` across steps.
        """
        raise NotImplementedError

    def graph_metadata(self, ctx: CaptureContext) -> GraphMetadata[MetadataT] | None:
        """This builder's metadata in buffers a graph of ``ctx.kind`` can hold, or None.

        Called: in the worker, each time the engine records the forward pass into a CPU
        step graph (``ctx.kind`` is ``GraphKind.CPU_STEP_GRAPH``; ``ctx.max_tokens``,
        ``ctx.max_reqs`` and ``ctx.max_blocks_per_req`` size the buffers). CUDA graphs
        do not ask it.

        Returns:
            A :class:`GraphMetadata` sized for ``ctx``, or None (the default): the
            backend's metadata is built per step, so the model runs eagerly with that
            reason logged, naming this builder.

        .. versionadded:: 1.1
        """
        return None


class GraphMetadata(ABC, Generic[MetadataT]):
    """A backend's metadata in buffers that stay put: what a recorded graph reads.

    A graph recorded with the CPU step graph (:class:`~engine.sdk.capture.GraphKind`)
    fixes every pointer of the forward pass, the metadata's included: the engine records
    the pass with :meth:`view`'s metadata, then, before each replay, has :meth:`fill` copy
    the step's layout into the same buffers. Returned by
    :meth:`AttentionMetadataBuilder.graph_metadata`.

    .. versionadded:: 1.1
    """

    @abstractmethod
    def tensors(self) -> Sequence[torch.Tensor]:
        """The buffers :meth:`view`'s metadata points into (the recording may read them).

        Called: once, when the engine records the pass.
        """
        raise NotImplementedError

    @abstractmethod
    def view(self, num_tokens: int) -> MetadataT:
        """The metadata of a pass of ``num_tokens`` rows, made of views of :meth:`tensors`.

        Called: while the engine records the pass, at several token counts up to the
        graph's largest; every tensor's size along its token axis should be
        ``num_tokens`` (or a multiple), everything else the same at every count.
        """
        raise NotImplementedError

    @abstractmethod
    def fill(self, common: CommonAttentionMetadata) -> None:
        """Copy this step's layout into the buffers; a replay follows.

        Called: in the worker, once per step the graph runs, before the replay. The step
        has at most the graph's ``max_tokens`` tokens, ``max_reqs`` requests and
        ``max_blocks_per_req`` blocks per request (:class:`~engine.sdk.capture.CaptureContext`).

        Must: leave :meth:`view`'s metadata for ``common.num_actual_tokens`` rows equal to
        what :meth:`AttentionMetadataBuilder.build` gives for ``common``, as the layers
        read it.
        """
        raise NotImplementedError


class AttentionImpl(ABC, Generic[MetadataT]):
    """The attention computation of one layer.

    Called: constructed once per attention layer in the worker while the model is built;
    ``forward`` once per step per layer.

    .. versionadded:: 1.0
    """

    def __init__(self, params: AttentionImplParams) -> None:
        """Store ``params``: spec, layer name, softmax scale, the backend's options."""
        self.params = params

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: MetadataT,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Store this step's keys and values, then compute attention into ``output``.

        Called: in the worker, once per step for this layer, inside the model's forward.

        Args:
            query: ``[num_tokens, num_heads, head_size]``, ``spec.dtype``.
            key: ``[num_tokens, num_kv_heads, head_size]``, ``spec.dtype``: the keys of the
                step's new tokens (rows aligned with ``query``).
            value: ``[num_tokens, num_kv_heads, head_size]``, ``spec.dtype``.
            kv_cache: This layer's cache, shaped by
                :meth:`AttentionBackend.get_kv_cache_shape`, ``spec.kv_cache_dtype``.
            metadata: What the group's builder returned for this step.
            output: ``[num_tokens, num_heads, head_size]``, ``spec.dtype``, preallocated.

        Returns:
            ``output``, holding for each real row the attention of its query over its
            request's context (cached tokens plus this step's tokens up to and including
            itself when causal; the last ``sliding_window`` of them when set), scaled by
            ``params.scale``.

        Must: write ``key[i]`` and ``value[i]`` into ``kv_cache`` at ``slot_mapping[i]``
        for every row ``i < num_actual_tokens`` before reading the cache; fill
        ``output[:num_actual_tokens]``. May: write padding rows (their slots are in the
        null block) and leave ``output``'s padding rows with any value.
        """
        raise NotImplementedError

    def capture_support(self, ctx: CaptureContext) -> Support:
        """Whether a graph of ``ctx.kind`` can record this layer's ``forward``.

        Called: in the worker, once per attention layer each time the engine records the
        forward pass (:mod:`engine.sdk.capture`).

        * ``GraphKind.CUDA_GRAPHS``: the backend's :attr:`AttentionBackend.cudagraph_support`
          is its declaration (since 1.0; the engine checks it first); the default says
          yes to defer to it. Override to refuse per layer.
        * ``GraphKind.CPU_STEP_GRAPH``: only native calls made through a
          :class:`~engine.sdk.graph_calls.GraphFunction` can be replayed (see
          :class:`~engine.sdk.capture.GraphKind`), with the metadata the builder's
          :meth:`AttentionMetadataBuilder.graph_metadata` holds: a backend computing in
          torch answers no (the default).

        Returns:
            ``Support.yes()``, or ``Support.no(reason)``.

        Must: not raise.

        .. versionadded:: 1.1
        """
        if ctx.kind is GraphKind.CUDA_GRAPHS:
            return Support.yes()
        return not_declared(f"attention implementation {type(self).__qualname__}", ctx)


class AttentionBackend(Plugin, ABC):
    """An attention implementation: capability answers, KV layout and its two classes.

    Published in ``engine.attention_backends``; never instantiated (class methods only).

    Example (a complete one is in ``docs/plugins/attention-backends.md``)::

        class MyBackend(AttentionBackend):
            name = "my_backend"

            @classmethod
            def supports(cls, spec: AttentionSpec) -> Support:
                if spec.head_size not in (64, 128):
                    return Support.no(f"head size {spec.head_size} not in 64, 128")
                return Support.yes()
            ...  # get_impl_cls, get_builder_cls, get_kv_cache_shape

    Attributes:
        name: Unique backend name (also the entry-point name by convention).
        cudagraph_support: The graph mode this backend tolerates; caps the engine's.

    .. versionadded:: 1.0
    """

    name: ClassVar[str] = ""
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER
    answered_spec_fields: ClassVar[frozenset[str]] = frozenset()
    """The :class:`AttentionSpec` fields added since 1.0 that :meth:`supports` answers.

    A backend written before a field existed cannot refuse it: its ``supports`` never looks
    at it. So the engine (:func:`backend_supports`) itself refuses a spec that sets such a
    field (to anything but its default, e.g. ``logits_soft_cap`` not None) for a backend
    that does not list it here, naming the field. List a field once ``supports`` answers
    it, implementing it or refusing it with a reason. Fields added in 1.1:
    ``"logits_soft_cap"``, ``"has_sinks"``. An unknown name is a ``TypeError`` at class
    creation.

    .. versionadded:: 1.1
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "answered_spec_fields" in cls.__dict__:
            fields = cls.__dict__["answered_spec_fields"]
            if isinstance(fields, (str, bytes)) or not isinstance(fields, Iterable):
                raise TypeError(f"{cls.__qualname__}.answered_spec_fields must be a collection "
                                f"of AttentionSpec field names, got {fields!r}")
            unknown = sorted(str(f) for f in fields if f not in ADDED_SPEC_FIELDS)
            if unknown:
                raise TypeError(
                    f"{cls.__qualname__}.answered_spec_fields: {', '.join(unknown)} not among "
                    f"the AttentionSpec fields added since 1.0 "
                    f"({', '.join(sorted(ADDED_SPEC_FIELDS))})")
            cls.answered_spec_fields = frozenset(fields)

    @classmethod
    @abstractmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        """The :class:`AttentionImpl` subclass built for each layer.

        Called: in the worker, once per attention layer while the model is built.
        """
        raise NotImplementedError

    @classmethod
    @abstractmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder[Any]]:
        """The :class:`AttentionMetadataBuilder` subclass built for each attention group.

        Called: in the worker, once per attention group after the KV cache is allocated.
        """
        raise NotImplementedError

    @classmethod
    @abstractmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV-cache tensor.

        Called: in the worker while sizing and allocating the KV cache (also with
        ``num_blocks=1`` to learn the size of one block).

        Args:
            num_blocks: Blocks in the cache, the null block 0 included.
            block_size: Tokens per block.
            num_kv_heads: Key/value heads on this rank.
            head_size: Elements per head.

        Returns:
            The shape, e.g. ``(2, num_blocks, block_size, num_kv_heads, head_size)``.

        Must: be a pure function, and hold exactly ``num_blocks`` times the elements of a
        one-block cache (keys and values of ``block_size`` tokens per block).
        """
        raise NotImplementedError

    @classmethod
    @abstractmethod
    def supports(cls, spec: AttentionSpec) -> Support:
        """Whether this backend can serve layers with ``spec``, and if not, why.

        Called: in the worker, once per distinct spec during backend selection, and with
        each attention layer's own spec as the model is built (since 1.1), before any
        model weights are loaded; also by ``engine plugins check``.

        Args:
            spec: Head geometry, dtypes, block size, sliding window, causality, platform,
                and the fields listed in :attr:`answered_spec_fields` (since 1.1).

        Returns:
            ``Support.yes()``, or ``Support.no(reason)`` naming the first unsupported
            property and what is supported, e.g. ``"head size 80 not supported (64, 128)"``.

        Must: answer every field of ``spec`` (a field it cannot handle is a ``no``); not
        raise; not import heavy dependencies it does not need to answer.
        """
        raise NotImplementedError


ADDED_SPEC_FIELDS: Mapping[str, object] = MappingProxyType(
    {"logits_soft_cap": None, "has_sinks": False})
"""The :class:`AttentionSpec` fields added since 1.0, each with the default that keeps the
1.0 meaning (see :attr:`AttentionBackend.answered_spec_fields`).

.. versionadded:: 1.1
"""


def _label(cls: type[AttentionBackend]) -> str:
    return cls.name or f"{cls.__module__}:{cls.__qualname__}"


def backend_supports(backend: type[AttentionBackend], spec: AttentionSpec) -> Support:
    """``backend.supports(spec)``, after refusing the fields the backend does not answer.

    A spec that sets a field added since 1.0 (to anything but its default) is refused for a
    backend that does not list the field in :attr:`AttentionBackend.answered_spec_fields`,
    without asking it: its ``supports`` predates the field and would say yes to it unseen.

    Called: by the engine wherever it asks a backend about a spec (selection, the
    platform's default, the measured choice, each layer of a model).

    Returns:
        ``Support.yes()``, or ``Support.no(reason)``.

    Raises:
        TypeError: ``supports`` returned something other than a
            :class:`~engine.sdk.support.Support`.

    .. versionadded:: 1.1
    """
    for field_name, default in ADDED_SPEC_FIELDS.items():
        value = getattr(spec, field_name)
        if value != default and field_name not in backend.answered_spec_fields:
            return Support.no(
                f"{field_name}={value!r} not supported: the backend does not declare that it "
                f"answers AttentionSpec.{field_name} (a backend lists the fields added since "
                f"SDK 1.0 that its supports() answers in answered_spec_fields)")
    answer = backend.supports(spec)
    if not isinstance(answer, Support):
        raise TypeError(
            f"attention backend {_label(backend)}: supports() must return "
            f"engine.sdk.Support, got {answer!r}"
        )
    return answer


def select_backend(
    candidates: Sequence[type[AttentionBackend]], spec: AttentionSpec
) -> type[AttentionBackend]:
    """The first candidate whose ``supports(spec)`` is yes (:func:`backend_supports`).

    Called: by the engine in each worker, once per distinct spec. Candidates are in
    preference order: just the forced one for ``--attention-backend``, otherwise the
    platform default first.

    Args:
        candidates: Backend classes to try, in order.
        spec: What the layers need.

    Returns:
        The chosen backend class.

    Raises:
        UnsupportedError: No candidate fits; ``reasons`` holds one ``(name, reason)`` per
            candidate, a candidate with abstract methods left included.
        TypeError: A candidate's ``supports`` returned something other than a
            :class:`~engine.sdk.support.Support`.

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Asks through :func:`backend_supports`: a candidate is refused a
        spec field added since 1.0 that it does not list in ``answered_spec_fields``.
    """
    reasons: list[tuple[str, str]] = []
    for backend in candidates:
        if inspect.isabstract(backend):
            missing = ", ".join(sorted(getattr(backend, "__abstractmethods__", ())))
            reasons.append((_label(backend), f"abstract methods left unimplemented: {missing}"))
            continue
        answer = backend_supports(backend, spec)
        if answer.ok:
            return backend
        reasons.append((_label(backend), answer.reason))
    if not reasons:
        raise UnsupportedError(f"no attention backend candidates for {spec.describe()}")
    raise UnsupportedError(f"no attention backend supports {spec.describe()}", reasons)
