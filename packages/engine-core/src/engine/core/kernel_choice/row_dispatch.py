"""One linear layer run by several kernels, each serving the row counts it was fastest at.

``RowDispatchKernel.of(plan, classes)`` makes the kernel class a layer gets when its
measured plan (``engine.core.kernel_choice.plan``) chose different kernels for different
row buckets. Each kernel prepares the layer's weights in its own layout (so the layer
holds a copy per kernel), and each step's product goes to the kernel of its row count.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.core.kernel_choice.buckets import bucket_index, upper_bounds
from engine.core.kernel_choice.plan import KernelPlan
from engine.sdk.capture import CaptureContext
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
from engine.sdk.platform import PlatformInfo
from engine.sdk.support import Support


class RowDispatchKernel(LinearKernel):
    """Dispatches each product to the kernel its row bucket chose (see the module)."""

    plan: ClassVar[KernelPlan]
    classes: ClassVar[dict[str, type[LinearKernel]]]

    @classmethod
    def of(cls, plan: KernelPlan,
           classes: dict[str, type[LinearKernel]]) -> type[RowDispatchKernel]:
        """The class for ``plan``; ``classes`` maps each of its kernel names to its class."""
        name = "+".join(plan.names)
        return type(f"RowDispatchKernel[{name}]", (cls,),
                    {"name": name, "plan": plan,
                     "classes": {n: classes[n] for n in plan.names},
                     "__module__": cls.__module__})

    def __init__(self, config: LinearKernelConfig) -> None:
        super().__init__(config)
        self.kernels = {name: kernel(config) for name, kernel in self.classes.items()}
        self._by_bucket = [self.kernels[name] for name in self.plan.kernels]
        self._uppers = upper_bounds(self.plan.buckets)

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return Support.yes()  # each kernel was asked before it was measured

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        return Support.yes()

    def kernel_for(self, rows: int) -> LinearKernel:
        """The kernel that multiplies ``rows`` rows."""
        return self._by_bucket[bucket_index(self._uppers, rows)]

    def capture_support(self, ctx: CaptureContext) -> Support:
        """The kernel's answer where one kernel serves every step a graph replays.

        A graph replays one set of calls for every step size up to ``ctx.max_tokens``, so
        a layer whose steps of that many rows go to different kernels stays eager.
        """
        used = dict.fromkeys(
            name for bucket, name in zip(self.plan.buckets, self.plan.kernels, strict=True)
            if bucket.lower <= max(ctx.max_tokens, 1))
        if len(used) > 1:
            return Support.no(
                f"its steps go to different linear kernels by row count ("
                f"{'; '.join(self.plan.describe_buckets())}), and a graph replays the same "
                f"calls for every step size")
        return self.kernels[next(iter(used))].capture_support(ctx)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        for kernel in self.kernels.values():
            kernel.process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return self.kernel_for(rows).apply(layer, x, bias)
