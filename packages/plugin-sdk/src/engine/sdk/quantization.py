"""The quantization contract: how a weight format is parsed, stored, loaded and applied.

A quantization method is two classes:

* :class:`QuantizationConfig`: the entry in ``engine.quantization``. Parses the
  checkpoint's quantization settings, says where it can run, and hands each layer its
  :class:`QuantizeMethod` (or ``None`` to leave the layer unquantized).
* :class:`QuantizeMethod`: per layer, in the worker: registers the layer's (quantized)
  parameters, post-processes them after loading, and computes the layer's output.

Lifecycle::

    # every process, at start-up (the front end reports errors before any weight loads)
    cfg_cls = <selected by --quantization NAME or the checkpoint's quant_method>
    check_quantization_support(cfg_cls, platform, act_dtype)   # UnsupportedError if not
    cfg = cfg_cls.from_config(quant_dict)                       # ValidationError if bad
    # worker, while building the model, once per layer
    method = cfg.get_quant_method(info, info.prefix)            # None -> unquantized
    method.create_weights(layer, info)
    # worker, after the checkpoint is loaded
    method.process_weights_after_loading(layer)
    # worker, every forward pass
    y = method.apply(layer, x, bias)

Weight loading: the engine copies checkpoint tensor ``<prefix>.<param_name>`` into the
layer parameter ``<param_name>``. A parameter may carry attributes that tell it how:

* ``weight_loader`` (a :class:`WeightLoader`): called with the full, unsharded checkpoint
  tensor; it copies this rank's part into the parameter.
* otherwise ``output_dim`` / ``input_dim`` (int): the dimension split across ranks for
  column- / row-parallel layers, and where fused shards (``output_partition_sizes``) are
  stacked. A parameter with neither is copied whole (per-tensor scales).

Dtypes: a floating-point checkpoint tensor reaches a floating-point parameter (and its
``weight_loader``) in the dtype the method created the parameter with, cast once from the
checkpoint's values: a float32 ``weight_scale`` in a bfloat16 model gets the checkpoint's
float32 values, unrounded. Integer tensors and parameters are never cast. (Engines before
SDK 1.1 rounded every floating-point tensor to the model dtype first.)

Linear methods usually delegate the matmul to a :class:`~engine.sdk.linear_kernel.
LinearKernel` obtained through ``LayerInfo.linear_kernel_selector``, so that faster
kernels (and ``--linear-kernel`` / ``--disabled-kernels``) apply to them.

.. versionadded:: 1.0
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from engine.sdk.capture import CaptureContext, not_declared
from engine.sdk.errors import UnsupportedError
from engine.sdk.plugin import Plugin
from engine.sdk.support import Support

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

    from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
    from engine.sdk.platform import PlatformInfo

#: Layer kinds the engine asks about. New kinds may be added in a minor version; a method
#: must return ``None`` from ``get_quant_method`` for kinds it does not know.
LAYER_KINDS = ("linear", "embedding", "lm_head")

#: How a layer is split across tensor-parallel ranks.
PARALLEL_STYLES = ("replicated", "column", "row")


#: Chooses a :class:`~engine.sdk.linear_kernel.LinearKernel` class for a configuration.
LinearKernelSelector = Callable[["LinearKernelConfig"], "type[LinearKernel]"]


def _no_kernel_selector(config: LinearKernelConfig) -> type[LinearKernel]:
    raise UnsupportedError(
        f"no linear kernel selector in this LayerInfo (built outside the engine?) for "
        f"{config.describe()}; pass linear_kernel_selector=..."
    )


class WeightLoader(Protocol):
    """The ``weight_loader`` attribute a parameter may carry.

    .. versionadded:: 1.0
    """

    def __call__(
        self, param: torch.nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None
    ) -> None:
        """Copy this rank's part of ``loaded_weight`` into ``param``.

        Args:
            param: The parameter being loaded.
            loaded_weight: The checkpoint tensor, full size (not sharded).
            shard_id: For fused layers (QKV, gate/up), the index of the logical output in
                ``LayerInfo.output_partition_sizes`` this tensor belongs to; ``None`` for a
                tensor covering the whole layer.
        """


@dataclass(frozen=True)
class LayerInfo:
    """What a quantization method is told about one layer.

    Attributes:
        prefix: The layer's full name in the checkpoint, e.g.
            ``"model.layers.0.self_attn.qkv_proj"``.
        kind: One of :data:`LAYER_KINDS`: ``"linear"`` (``y = x W^T + b``), ``"lm_head"``
            (a linear producing logits), ``"embedding"`` (a lookup; ``input_size`` is the
            vocabulary size, ``output_size`` the embedding width).
        input_size: Input features of the whole layer (all ranks).
        output_size: Output features of the whole layer (all ranks).
        input_size_per_partition: Input features on this rank (``input_size /
            tp_size`` for row-parallel and embedding layers, else ``input_size``).
        output_partition_sizes: Output features on this rank of each logical output
            fused into the layer, in order (``(q, k, v)`` for a QKV projection, one entry
            for an unfused layer). Their sum is the rank's output width. A column-parallel
            ``"lm_head"`` has ``ceil(vocab / tp_size)`` rows on every rank (rows past the
            vocabulary are zero padding).
        params_dtype: Dtype of unquantized parameters and activations, e.g. ``"bfloat16"``.
        tp_rank: This worker's tensor-parallel rank.
        tp_size: Number of tensor-parallel ranks.
        parallel: One of :data:`PARALLEL_STYLES`: ``"column"`` splits outputs across
            ranks, ``"row"`` splits inputs (outputs are summed across ranks by the engine),
            ``"replicated"`` keeps the whole layer on every rank.
        has_bias: Whether the layer has a bias (the engine creates and loads it,
            unquantized, and passes it to ``apply``).
        linear_kernel_selector: Chooses a linear kernel for a configuration, honouring the
            installed kernels, the platform, ``--linear-kernel`` and ``--disabled-kernels``
            (raises :class:`~engine.sdk.errors.UnsupportedError` listing each rejection).
            Always set by the engine; the default (for hand-built objects in tests) raises
            ``UnsupportedError``.

    Raises:
        ValueError: ``kind`` or ``parallel`` is unknown, or a size is not positive.

    .. versionadded:: 1.0
    """

    prefix: str
    kind: str
    input_size: int
    output_size: int
    input_size_per_partition: int
    output_partition_sizes: tuple[int, ...]
    params_dtype: str
    tp_rank: int = 0
    tp_size: int = 1
    parallel: str = "replicated"
    has_bias: bool = False
    linear_kernel_selector: LinearKernelSelector = field(
        default_factory=lambda: _no_kernel_selector, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"LayerInfo.kind must be one of {LAYER_KINDS}, got {self.kind!r}")
        if self.parallel not in PARALLEL_STYLES:
            raise ValueError(
                f"LayerInfo.parallel must be one of {PARALLEL_STYLES}, got {self.parallel!r}"
            )
        sizes = (self.input_size, self.output_size, self.input_size_per_partition)
        if not self.output_partition_sizes or min(sizes + self.output_partition_sizes) < 1:
            raise ValueError(f"LayerInfo sizes must be positive, got {self!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"LayerInfo.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}"
            )

    @property
    def output_size_per_partition(self) -> int:
        """Output features on this rank: ``sum(output_partition_sizes)``."""
        return sum(self.output_partition_sizes)


class QuantizeMethod(ABC):
    """How one layer stores and applies its quantized weights.

    Called: in the worker. ``create_weights`` once while the model is built,
    ``process_weights_after_loading`` once after the checkpoint is loaded, ``apply`` once
    per forward pass of the layer. One instance may serve one layer or several.

    .. versionadded:: 1.0
    """

    @abstractmethod
    def create_weights(self, layer: torch.nn.Module, info: LayerInfo) -> None:
        """Register the layer's parameters (this rank's shapes) on ``layer``.

        Called: in the worker, once per layer, while the model is built (on the target
        device, before any checkpoint tensor is read).

        Args:
            layer: The module to register parameters on (``layer.register_parameter``).
            info: The layer's sizes, parallel style, dtype and the kernel selector.

        Must: register every parameter the checkpoint provides for the layer, under the
        checkpoint's name (``weight``, ``weight_scale``, ...), with ``requires_grad=False``;
        give each sharded parameter ``output_dim``/``input_dim`` or a ``weight_loader``
        (see the module docstring). Must not register the bias (the engine does).

        May: create a floating-point parameter in another dtype than
        ``info.params_dtype`` (e.g. float32 scales): it is loaded in that dtype from the
        checkpoint's values (module docstring, "Dtypes"; since 1.1).
        """
        raise NotImplementedError

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Convert the loaded parameters into the form ``apply`` uses.

        Called: in the worker, once per layer after every checkpoint tensor is loaded,
        before the first forward pass. Default: nothing.

        May: repack, transpose or replace parameters, and build a linear kernel's state.
        """
        return None

    @abstractmethod
    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The layer's output for ``x``.

        Called: in the worker, once per forward pass of the layer.

        Args:
            layer: The module holding the parameters from ``create_weights``.
            x: ``"linear"``/``"lm_head"``: ``[num_tokens, input_size_per_partition]`` in
                ``params_dtype``. ``"embedding"``: ``[num_tokens]`` int64 ids local to
                this rank's vocabulary shard (the engine masks foreign ids and reduces).
            bias: ``[output_size_per_partition]`` or ``None``; for row-parallel layers
                the engine passes it only on rank 0.

        Returns:
            ``[num_tokens, output_size_per_partition]`` in ``params_dtype``.

        Must: not modify ``x`` or the parameters.
        """
        raise NotImplementedError

    def capture_support(self, ctx: CaptureContext) -> Support:
        """Whether a graph of ``ctx.kind`` can record this method's ``apply``.

        Called: in the worker, once per layer the method serves, each time the engine
        records the forward pass (:mod:`engine.sdk.capture`).

        Answer for the method's own code in ``apply``: the engine also asks every
        :class:`~engine.sdk.linear_kernel.LinearKernel` the method holds as an attribute
        (``self.kernel = info.linear_kernel_selector(config)(config)``), so a method whose
        ``apply`` only calls its kernel answers yes. A method that reaches its kernel
        another way answers with the kernel's ``capture_support`` too.

        Default: no (the pass runs eagerly, with this method named in the log).

        Returns:
            ``Support.yes()``, or ``Support.no(reason)``.

        Must: not raise.

        .. versionadded:: 1.1
        """
        return not_declared(f"quantization method {type(self).__qualname__}", ctx)


class QuantizationConfig(Plugin, ABC):
    """A quantization method: parses its settings and gives layers their QuantizeMethod.

    Published in ``engine.quantization``; selected by ``--quantization NAME`` or by the
    checkpoint's ``quantization_config.quant_method`` equal to :attr:`name`.

    Example::

        class Int8Config(QuantizationConfig):
            name = "my_int8"

            def __init__(self, skip: tuple[str, ...]) -> None:
                self.skip = skip

            @classmethod
            def from_config(cls, config: dict[str, Any]) -> Int8Config:
                skip = config.get("modules_to_not_convert", [])
                if not isinstance(skip, list):
                    raise ValidationError("modules_to_not_convert must be a list")
                return cls(tuple(skip))

            @classmethod
            def supported_act_dtypes(cls) -> list[str]:
                return ["bfloat16", "float16", "float32"]

            @classmethod
            def is_supported(cls, platform: PlatformInfo) -> Support:
                return Support.yes()

            def get_quant_method(self, layer, prefix):
                if layer.kind != "linear" or any(s in prefix for s in self.skip):
                    return None
                return Int8LinearMethod()

    Attributes:
        name: Unique method name (``--quantization NAME``, and the checkpoint's
            ``quant_method``).
        reads_gguf_blocks: Whether this method takes a GGUF file's matrices as stored
            (default False: the engine dequantizes a GGUF file at load, and the method
            gets an unquantized checkpoint with ``{}`` settings). True: selected on a
            ``.gguf`` model (``--quantization NAME``), :meth:`from_config` receives
            ``{"quant_method": "gguf", "tensor_types": {module: ggml_type_name}}`` (every
            matrix by its Hugging Face module name without ``.weight``, e.g.
            ``"model.layers.0.self_attn.q_proj": "Q4_1"``), and every matrix (linear
            layers, the LM head, the embedding) is loaded as its stored bytes, ``uint8
            [rows, row_bytes]`` in GGUF's block layout (norms and biases are dequantized):
            the method's parameters for every such layer must take them. The engine's own
            ``gguf`` method is one.

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Added ``reads_gguf_blocks``.
    """

    name: ClassVar[str] = ""
    reads_gguf_blocks: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        """Build the configuration from the checkpoint's quantization settings.

        Called: in every process at start-up, once (the front end first, so errors are
        reported before any weight is loaded).

        Args:
            config: ``quantization_config`` from ``config.json``, else the JSON content of
                the first file of :meth:`config_filenames` found in the checkpoint; an
                empty dict when neither exists (``--quantization`` on an unquantized
                checkpoint).

        Raises:
            ValidationError: A key is missing or invalid; the message names it and what
                is allowed.

        Must: be deterministic (every process builds its own instance from the same dict).
        """
        raise NotImplementedError

    @classmethod
    def config_filenames(cls) -> list[str]:
        """Checkpoint files that may hold the settings when ``config.json`` has none.

        Called: in every process, at start-up. Default: none (``config.json`` only).

        Returns:
            File names relative to the checkpoint directory, e.g.
            ``["quantize_config.json"]``, in the order they are tried.
        """
        return []

    @classmethod
    @abstractmethod
    def supported_act_dtypes(cls) -> list[str]:
        """Activation dtypes this method computes in, e.g. ``["bfloat16", "float16"]``.

        Called: in every process at start-up; a model dtype not listed stops start-up
        with a message listing these.
        """
        raise NotImplementedError

    @classmethod
    @abstractmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        """Whether this method runs on ``platform``, and if not, why.

        Called: in every process at start-up, before weights are loaded.

        Returns:
            ``Support.yes()``, or ``Support.no(reason)`` saying what is needed, e.g.
            ``"needs a CUDA device with compute capability >= 8.9, found cpu"``.

        Must: not raise; not assume any platform (CPU, CUDA and out-of-tree ones all ask).
        """
        raise NotImplementedError

    @abstractmethod
    def get_quant_method(self, layer: LayerInfo, prefix: str) -> QuantizeMethod | None:
        """The method that stores and applies ``layer``'s weights, or None to skip it.

        Called: in the worker, once per layer while the model is built.

        Args:
            layer: The layer's sizes, kind, parallel style and kernel selector.
            prefix: The layer's full name (equal to ``layer.prefix``).

        Returns:
            A :class:`QuantizeMethod`, or ``None`` to leave the layer unquantized (the
            engine then uses its default unquantized method).

        Must: return ``None`` for kinds it does not handle.
        """
        raise NotImplementedError


def check_quantization_support(
    config_cls: type[QuantizationConfig], platform: PlatformInfo, act_dtype: str
) -> Support:
    """Whether ``config_cls`` can run here with activations in ``act_dtype``.

    Called: by the engine in every process at start-up, before ``from_config``; the
    engine turns a ``no`` into :class:`~engine.sdk.errors.UnsupportedError`.

    Returns:
        ``Support.no`` for abstract methods left, the class's ``is_supported`` reason, or
        an unsupported activation dtype (listing the supported ones); else yes.

    Raises:
        TypeError: ``is_supported`` did not return a :class:`~engine.sdk.support.Support`.

    .. versionadded:: 1.0
    """
    if inspect.isabstract(config_cls):
        missing = ", ".join(sorted(getattr(config_cls, "__abstractmethods__", ())))
        return Support.no(f"abstract methods left unimplemented: {missing}")
    answer = config_cls.is_supported(platform)
    if not isinstance(answer, Support):
        raise TypeError(
            f"quantization {config_cls.name or config_cls.__qualname__}: is_supported() must "
            f"return engine.sdk.Support, got {answer!r}"
        )
    if not answer.ok:
        return answer
    dtypes = config_cls.supported_act_dtypes()
    if act_dtype not in dtypes:
        return Support.no(
            f"activation dtype {act_dtype} is not supported; supported: {', '.join(dtypes)}"
        )
    return Support.yes()
