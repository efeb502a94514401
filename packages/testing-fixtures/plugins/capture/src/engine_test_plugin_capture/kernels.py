"""Two linear kernels that declare graph capture (``engine.linear_kernels``).

The CPU step graph replays the engine's native kernel calls only, so a kernel is recorded
when its ``apply`` makes views and copies around a call of a kernel that is:
``ComposedCpuKernel`` composes the engine's first-party ``cpu`` kernel, found through its
entry point (where the engine ships it: this package imports nothing of the engine but
the SDK), and answers what that kernel answers. ``DeclaredTorchKernel`` declares yes but
multiplies with ``F.linear``: the recorder refuses it, naming the torch op, and the model
runs eagerly.
"""

from __future__ import annotations

import functools
from importlib.metadata import entry_points
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.sdk import CaptureContext, LinearKernel, LinearKernelConfig, PlatformInfo, Support
from engine.sdk.groups import LINEAR_KERNELS

#: Distributions the composed kernel may come from (the engine's own).
FIRST_PARTY = ("engine-core", "engine-kernels")
#: How many layers each kernel prepared (``process_weights_after_loading``), in this
#: process: outside the forward pass, so it is no side effect a replay would skip.
PREPARED: dict[str, int] = {}


@functools.cache
def first_party_kernel(name: str) -> type[LinearKernel] | None:
    """The engine's own linear kernel registered as ``name``, or None."""
    for entry in entry_points(group=LINEAR_KERNELS, name=name):
        if entry.dist is not None and entry.dist.name in FIRST_PARTY:
            kernel: type[LinearKernel] = entry.load()
            return kernel
    return None


class ComposedCpuKernel(LinearKernel):
    """The engine's ``cpu`` kernel, composed: recorded wherever it is."""

    name: ClassVar[str] = "test_capture_cpu"
    priority: ClassVar[int] = -10

    def __init__(self, config: LinearKernelConfig) -> None:
        super().__init__(config)
        inner = first_party_kernel("cpu")
        if inner is None:
            raise RuntimeError("test_capture_cpu: the engine's 'cpu' linear kernel is not "
                               "installed")
        self.inner = inner(config)

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        inner = first_party_kernel("cpu")
        if inner is None:
            return Support.no("the engine's 'cpu' linear kernel is not installed")
        return inner.is_supported(platform)

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        inner = first_party_kernel("cpu")
        return Support.no("no 'cpu' kernel") if inner is None else inner.can_implement(config)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        PREPARED[self.name] = PREPARED.get(self.name, 0) + 1
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.apply(layer, x, bias)

    def capture_support(self, ctx: CaptureContext) -> Support:
        return self.inner.capture_support(ctx)  # apply adds nothing to the inner kernel's


class DeclaredTorchKernel(LinearKernel):
    """Declares capture support, multiplies with ``F.linear``: the recorder refuses it."""

    name: ClassVar[str] = "test_capture_torch"
    priority: ClassVar[int] = -10

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        if config.scheme != "unquantized" or config.weight_dtype != config.act_dtype:
            return Support.no(f"scheme {config.scheme} ({config.weight_dtype} weights, "
                              f"{config.act_dtype} activations) is not unquantized")
        return Support.yes()

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        weight: torch.Tensor = layer.weight  # type: ignore[assignment]
        return F.linear(x, weight, bias)

    def capture_support(self, ctx: CaptureContext) -> Support:
        return Support.yes()  # wrong for the CPU step graph: the recorder says so
