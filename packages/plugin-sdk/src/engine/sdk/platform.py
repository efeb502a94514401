"""``Platform``: the device family the engine runs on (CPU, CUDA, or an out-of-tree one).

A platform plugin publishes, in ``engine.platforms``, a zero-argument callable that returns
its :class:`Platform` subclass when the host has its device, or ``None`` when it does not.
Every process calls the detectors on first use. Exactly one out-of-tree platform may claim
the host (two is an error naming both); an out-of-tree platform wins over the built-ins.

.. versionadded:: 1.0
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from engine.sdk.plugin import Plugin
from engine.sdk.support import Support

if TYPE_CHECKING:
    from engine.sdk.attention import AttentionSpec


@dataclass(frozen=True)
class PlatformInfo:
    """What a capability hook may know about the device (frozen, picklable).

    Attributes:
        name: Platform name, e.g. ``"cpu"`` or ``"cuda"``.
        device_type: The torch device type, e.g. ``"cpu"``, ``"cuda"``.
        device_name: Human-readable device name, e.g. ``"NVIDIA H200"``.
        device_capability: ``(major, minor)`` compute capability, or ``None`` where the
            notion does not apply (CPU).
        total_memory_bytes: Memory of one device in bytes.
        supported_dtypes: Activation dtypes the device computes in, e.g.
            ``("bfloat16", "float32")``.

    .. versionadded:: 1.0
    """

    name: str
    device_type: str
    device_name: str = ""
    device_capability: tuple[int, int] | None = None
    total_memory_bytes: int = 0
    supported_dtypes: tuple[str, ...] = ("float32",)


@dataclass
class PlatformConfig:
    """The settings a platform may change in :meth:`Platform.check_and_update_config`.

    This is the only mutable configuration object in the SDK. The engine fills it with the
    operator's values, lets the platform adjust it, validates the result, and freezes its
    configuration. ``None`` means "the operator did not choose; engine default".

    Attributes:
        dtype: Model dtype (``"bfloat16"``, ``"float16"``, ``"float32"``).
        block_size: Tokens per KV-cache block (``None``: the operator gave no
            ``--block-size``; the engine's default, 16, applies after the platform).
        attention_backend: Name of the attention backend to use.
        enforce_eager: Disable graph capture.
        custom_ops: ``--custom-ops`` items (``+name``, ``+name=DISTRIBUTION``, ``-name``,
            ``all``, ``none``) choosing custom-op implementations; applied before the
            operator's, which win.
        worker_extensions: Names of worker extensions to add.
        max_num_batched_tokens: The token budget of one step (``None``: the engine's
            default, 2048). A platform sets it only where the operator left it ``None``,
            to the step size its device serves best (the CPU platform: 512).

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Added ``max_num_batched_tokens``.
    """

    dtype: str | None = None
    block_size: int | None = None
    attention_backend: str | None = None
    enforce_eager: bool = False
    custom_ops: list[str] = field(default_factory=list)
    worker_extensions: list[str] = field(default_factory=list)
    max_num_batched_tokens: int | None = None


class Platform(Plugin, ABC):
    """A device family: how to query devices, and its defaults.

    Subclasses set the class attributes and implement the class methods; the engine never
    instantiates a platform.

    Example::

        class MyNPU(Platform):
            name = "my_npu"
            device_type = "npu"
            dist_backend = "hccl"

            @classmethod
            def is_available(cls) -> Support:
                return Support.yes() if my_driver.count() else Support.no("no NPU found")
            ...

        def detect() -> type[Platform] | None:       # entry point in engine.platforms
            return MyNPU if my_driver.count() else None

    Attributes:
        name: Unique platform name, shown in logs and ``PlatformInfo.name``.
        device_type: The torch device type tensors are placed on.
        dist_backend: ``torch.distributed`` backend between ranks (``gloo``, ``nccl``, ...).

    .. versionadded:: 1.0
    """

    name: ClassVar[str]
    device_type: ClassVar[str]
    dist_backend: ClassVar[str] = "gloo"

    @classmethod
    @abstractmethod
    def is_available(cls) -> Support:
        """Whether this host can run the platform, and if not, why.

        Called: by the engine in every process, once, when the platform is selected.
        Must: not raise; a missing driver is ``Support.no("...")``.
        """

    @classmethod
    @abstractmethod
    def device_count(cls) -> int:
        """Number of devices of this platform on the host."""

    @classmethod
    @abstractmethod
    def get_device_name(cls, index: int = 0) -> str:
        """Human-readable name of device ``index``."""

    @classmethod
    def get_device_capability(cls, index: int = 0) -> tuple[int, int] | None:
        """``(major, minor)`` compute capability of device ``index``; ``None`` if meaningless."""
        return None

    @classmethod
    @abstractmethod
    def get_device_total_memory(cls, index: int = 0) -> int:
        """Total memory of device ``index`` in bytes."""

    @classmethod
    def supported_dtypes(cls) -> tuple[str, ...]:
        """Activation dtypes this platform computes in, best first."""
        return ("float32",)

    @classmethod
    def info(cls, index: int = 0) -> PlatformInfo:
        """A frozen :class:`PlatformInfo` for device ``index`` (what capability hooks get)."""
        return PlatformInfo(
            name=cls.name,
            device_type=cls.device_type,
            device_name=cls.get_device_name(index),
            device_capability=cls.get_device_capability(index),
            total_memory_bytes=cls.get_device_total_memory(index),
            supported_dtypes=cls.supported_dtypes(),
        )

    @classmethod
    @abstractmethod
    def default_attention_backend(cls, spec: AttentionSpec) -> str:
        """Name (in ``engine.attention_backends``) of the backend to use for ``spec``.

        Called: in each worker, once per distinct attention spec, when the operator did not
        pass ``--attention-backend``.
        """

    @classmethod
    def check_and_update_config(cls, config: PlatformConfig) -> None:
        """Adjust the engine configuration for this platform before it is frozen.

        Called: once per process at start-up, after the operator's values are filled in.
        May: change any field of ``config``. The engine validates the result and names this
        platform in the error if a value it set is invalid.
        """
