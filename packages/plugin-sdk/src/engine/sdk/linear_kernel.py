"""The linear-kernel contract: interchangeable matmul implementations for one weight scheme.

A quantization method (or the unquantized linear layer) describes what it needs as a
:class:`LinearKernelConfig` and asks the engine for a kernel; the engine picks one of the
installed :class:`LinearKernel` classes (entry points in ``engine.linear_kernels``) with
:func:`select_linear_kernel`:

1. ``--disabled-kernels a,b`` removes kernels by name;
2. ``--linear-kernel NAME`` forces exactly one (an error, with its reason, if it cannot
   run the config here);
3. otherwise the remaining kernels are tried by descending :attr:`LinearKernel.priority`
   (ties broken by name, so the choice is deterministic), and the first whose
   ``is_supported(platform)`` and ``can_implement(config)`` are both yes wins;
4. when none fits, one :class:`~engine.sdk.errors.UnsupportedError` lists every kernel
   with the reason it was rejected.

Priority convention: torch reference fallbacks 0; optimized built-ins (Triton, CUDA) 100;
a third-party kernel meant to win over the built-ins uses more than 100, one meant as a
fallback less than 100. Negative priorities are allowed for last resorts.

.. versionadded:: 1.0
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from engine.sdk.capture import CaptureContext, not_declared
from engine.sdk.errors import UnsupportedError, ValidationError
from engine.sdk.plugin import Plugin
from engine.sdk.support import Support

if TYPE_CHECKING:
    import torch

    from engine.sdk.platform import PlatformInfo

#: The reason shown for a kernel removed by ``--disabled-kernels``.
DISABLED_REASON = "disabled by --disabled-kernels"


@dataclass(frozen=True)
class LinearKernelConfig:
    """What a kernel must implement for one linear layer (sizes are per tensor-parallel rank).

    The ``scheme`` fixes the names, shapes and dtypes of the parameters the quantization
    method registers on the layer (e.g. ``"fp8_w8a8"``: ``weight`` ``[out, in]``
    float8_e4m3fn and ``weight_scale`` float32); a kernel must only claim schemes whose
    layout it knows.

    Attributes:
        scheme: The weight scheme, e.g. ``"unquantized"``, ``"int8_w8a8"``, ``"fp8_w8a8"``,
            ``"w4a16"``.
        weight_dtype: Dtype of the stored weight, e.g. ``"bfloat16"``, ``"int8"``,
            ``"float8_e4m3fn"``, ``"uint4"``.
        act_dtype: Dtype of the input activations and of the output, e.g. ``"bfloat16"``.
        input_size: Input features of this rank's shard (K).
        output_size: Output features of this rank's shard (N).
        group_size: Input elements sharing one weight scale; ``None`` for one scale per
            output channel (or per tensor, as the scheme defines).
        has_bias: Whether ``apply`` receives a bias.
        zero_point: Whether the scheme stores weight zero points (asymmetric quantization).

    .. versionadded:: 1.0
    """

    scheme: str
    weight_dtype: str
    act_dtype: str
    input_size: int
    output_size: int
    group_size: int | None = None
    has_bias: bool = False
    zero_point: bool = False

    def describe(self) -> str:
        """One line for error messages."""
        group = "channelwise" if self.group_size is None else f"group_size={self.group_size}"
        return (
            f"scheme={self.scheme} weight={self.weight_dtype} act={self.act_dtype} "
            f"[{self.input_size} -> {self.output_size}] {group}"
            + (" zero_point" if self.zero_point else "")
            + (" bias" if self.has_bias else "")
        )


class LinearKernel(Plugin, ABC):
    """One matmul implementation, chosen per layer configuration by priority.

    Called: in the worker. The class methods during model construction (selection), then
    one instance per linear layer: ``process_weights_after_loading`` once after the
    checkpoint is loaded, ``apply`` once per forward pass of that layer.

    Example::

        class TorchInt8Kernel(LinearKernel):
            name = "torch_int8"
            priority = 0

            @classmethod
            def is_supported(cls, platform: PlatformInfo) -> Support:
                return Support.yes()

            @classmethod
            def can_implement(cls, config: LinearKernelConfig) -> Support:
                if config.scheme != "int8_w8a8":
                    return Support.no(f"scheme {config.scheme} is not int8_w8a8")
                return Support.yes()

            def apply(self, layer, x, bias=None):
                w = layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype)[:, None]
                return torch.nn.functional.linear(x, w, bias)

    Attributes:
        name: Unique kernel name, used by ``--linear-kernel`` and ``--disabled-kernels``.
        priority: Higher is tried first (see the module docstring for the convention).

    .. versionadded:: 1.0
    """

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0

    def __init__(self, config: LinearKernelConfig) -> None:
        """Store the configuration this instance serves.

        Called: in the worker, once per linear layer, after selection chose this class.

        Args:
            config: The layer's configuration; ``can_implement(config)`` was yes.
        """
        self.config = config

    @classmethod
    @abstractmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        """Whether this kernel runs on ``platform`` at all, and if not, why.

        Called: in the worker during selection, before ``can_implement``.

        Args:
            platform: Device type, name, compute capability, dtypes.

        Returns:
            ``Support.yes()`` or ``Support.no(reason)``, e.g. ``"needs compute capability
            >= 8.9, found 8.0"``.

        Must: not raise (a missing optional dependency is a ``no`` naming it).
        """
        raise NotImplementedError

    @classmethod
    @abstractmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        """Whether this kernel implements ``config``, and if not, why.

        Called: in the worker during selection, only when ``is_supported`` was yes.

        Returns:
            ``Support.yes()`` or ``Support.no(reason)`` naming the first unsupported field
            and what is supported.

        Must: not raise; answer every field of ``config``.
        """
        raise NotImplementedError

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack or convert the layer's loaded parameters into the layout ``apply`` uses.

        Called: in the worker, once per layer after all checkpoint weights are loaded,
        before the first forward pass. Default: nothing.

        May: replace the layer's parameters (same names) or add new ones.
        """

    @abstractmethod
    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Compute ``x @ W^T + bias`` with the layer's weights.

        Called: in the worker, once per forward pass of the layer.

        Args:
            layer: The module holding the parameters of the scheme.
            x: ``[num_tokens, input_size]``, ``config.act_dtype``.
            bias: ``[output_size]`` or ``None``.

        Returns:
            ``[num_tokens, output_size]``, ``config.act_dtype``.

        Must: not modify ``x`` or the layer's parameters.
        """
        raise NotImplementedError

    def capture_support(self, ctx: CaptureContext) -> Support:
        """Whether a graph of ``ctx.kind`` can record this instance's ``apply``.

        Called: in the worker, once per linear layer each time the engine records the
        forward pass (:mod:`engine.sdk.capture`), after ``process_weights_after_loading``.

        Answer for this instance: a kernel whose recordable path needs state it may not
        have (a packed weight, a dtype) says no where it lacks it.

        * ``GraphKind.CUDA_GRAPHS``: yes when ``apply`` launches CUDA work only (no host
          synchronisation, no allocation whose size depends on tensor values, nothing
          else a replay would skip).
        * ``GraphKind.CPU_STEP_GRAPH``: the graph replays native calls only, so a
          kernel that computes in torch (``F.linear``, ``torch.mm``) cannot be recorded.
          A kernel can be when ``apply`` only makes views, allocations and copies around
          native calls: its own C code called through a
          :class:`~engine.sdk.graph_calls.GraphFunction`, or a first-party kernel it
          composes (hold an instance, call its ``apply``, answer with its
          ``capture_support``), or subclasses keeping its ``apply``.

        Default: no (the pass runs eagerly, with this kernel named in the log).

        Returns:
            ``Support.yes()``, or ``Support.no(reason)``.

        Must: not raise.

        .. versionadded:: 1.1
        """
        return not_declared(f"linear kernel {_label(type(self))!r}", ctx)


def _label(cls: type[LinearKernel]) -> str:
    return cls.name or f"{cls.__module__}:{cls.__qualname__}"


def _as_support(kernel: type[LinearKernel], hook: str, answer: object) -> Support:
    if not isinstance(answer, Support):
        raise TypeError(
            f"linear kernel {_label(kernel)}: {hook}() must return engine.sdk.Support, "
            f"got {answer!r}"
        )
    return answer


def _check(
    kernel: type[LinearKernel], platform: PlatformInfo, config: LinearKernelConfig
) -> Support:
    """Abstractness, then ``is_supported``, then ``can_implement``; the first ``no`` wins."""
    if inspect.isabstract(kernel):
        missing = ", ".join(sorted(getattr(kernel, "__abstractmethods__", ())))
        return Support.no(f"abstract methods left unimplemented: {missing}")
    answer = _as_support(kernel, "is_supported", kernel.is_supported(platform))
    if not answer.ok:
        return answer
    return _as_support(kernel, "can_implement", kernel.can_implement(config))


def select_linear_kernel(
    candidates: Sequence[type[LinearKernel]],
    platform: PlatformInfo,
    config: LinearKernelConfig,
    *,
    forced: str | None = None,
    disabled: Collection[str] = (),
) -> type[LinearKernel]:
    """Choose the kernel for ``config`` on ``platform``.

    Called: by the engine in the worker, once per distinct layer configuration (through
    the selector it hands to quantization methods in ``LayerInfo``).

    Args:
        candidates: The installed kernel classes, in any order.
        platform: The device.
        config: What the layer needs.
        forced: ``--linear-kernel``: the only kernel considered.
        disabled: ``--disabled-kernels``: names never chosen.

    Returns:
        The highest-priority kernel (ties broken by name) that supports the platform and
        implements the config; or ``forced`` when it can.

    Raises:
        ValidationError: ``forced`` or a ``disabled`` name is not a known kernel (the
            message lists the known ones), or ``forced`` is also disabled.
        UnsupportedError: No kernel fits (``reasons`` has one entry per kernel, disabled
            ones included), or the forced one does not (its reason).
        ValueError: Two candidates share a name.

    .. versionadded:: 1.0
    """
    by_name: dict[str, type[LinearKernel]] = {}
    for kernel in candidates:
        label = _label(kernel)
        other = by_name.setdefault(label, kernel)
        if other is not kernel:
            raise ValueError(
                f"two linear kernels are named {label!r}: {other.__module__}:"
                f"{other.__qualname__} and {kernel.__module__}:{kernel.__qualname__}"
            )
    known = ", ".join(sorted(by_name)) or "(none installed)"
    unknown = sorted(set(disabled) - set(by_name))
    if unknown:
        raise ValidationError(
            f"--disabled-kernels names unknown linear kernel(s) {', '.join(unknown)}; "
            f"known: {known}",
            param="disabled_kernels",
        )
    where = f"{config.describe()} on {platform.name}"
    if forced is not None:
        if forced not in by_name:
            raise ValidationError(
                f"--linear-kernel {forced!r} is not a known linear kernel; known: {known}",
                param="linear_kernel",
            )
        if forced in disabled:
            raise ValidationError(
                f"--linear-kernel {forced!r} is also listed in --disabled-kernels",
                param="linear_kernel",
            )
        answer = _check(by_name[forced], platform, config)
        if not answer.ok:
            raise UnsupportedError(
                f"linear kernel {forced!r} (--linear-kernel) cannot run {where}",
                [(forced, answer.reason)],
            )
        return by_name[forced]
    reasons: list[tuple[str, str]] = []
    for label, kernel in sorted(by_name.items(), key=lambda item: (-item[1].priority, item[0])):
        if label in disabled:
            reasons.append((label, DISABLED_REASON))
            continue
        answer = _check(kernel, platform, config)
        if answer.ok:
            return kernel
        reasons.append((label, answer.reason))
    raise UnsupportedError(f"no linear kernel can run {where}", reasons)
