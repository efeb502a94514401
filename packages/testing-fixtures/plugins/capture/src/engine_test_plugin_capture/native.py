"""``test_capture_native``: a linear kernel whose product is its own C code, recorded.

``matmul.c`` (beside this file) is compiled on first use by the SDK's builder
(``engine.sdk.native.load_library``: cached by source and CPU, as the engine's own
kernels are) and called through an ``engine.sdk.graph_calls.GraphFunction``:
eagerly it runs; while the engine records the CPU step graph, the call is recorded with
its pointers and replayed in C with the engine's own kernels. ``apply`` makes only views,
an allocation and (for rows that are not contiguous) a copy around it, so the kernel
answers yes to the CPU step graph. ``CALLS`` counts its eager calls in this process.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import ClassVar

import torch

from engine.sdk import CaptureContext, LinearKernel, LinearKernelConfig, PlatformInfo, Support
from engine.sdk.capture import GraphKind, not_declared
from engine.sdk.graph_calls import GraphFunction
from engine.sdk.native import NativeBuildError, load_library

SOURCE = Path(__file__).with_name("matmul.c")
#: Eager calls of the product in this process (a replay makes none).
CALLS: dict[str, int] = {"apply": 0}


@functools.cache
def matmul() -> GraphFunction:
    """The compiled product; raises ``NativeBuildError``."""
    return GraphFunction.from_library(load_library("engine_test_plugin_capture", [SOURCE]),
                                      "test_capture_matmul", "test_capture.matmul")


class NativeMatmulKernel(LinearKernel):
    """float32 ``x W^T + b`` in the plugin's own C code."""

    name: ClassVar[str] = "test_capture_native"
    priority: ClassVar[int] = -10

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        if platform.device_type != "cpu":
            return Support.no(f"runs on the CPU, not {platform.device_type}")
        try:
            matmul()
        except NativeBuildError as exc:
            return Support.no(str(exc))
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        if (config.scheme != "unquantized" or config.weight_dtype != "float32"
                or config.act_dtype != "float32"):
            return Support.no(f"float32 unquantized only, not {config.scheme} "
                              f"({config.weight_dtype} weights, {config.act_dtype} activations)")
        return Support.yes()

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        weight: torch.Tensor = layer.weight  # type: ignore[assignment]
        n, k = weight.shape
        rows = x.reshape(-1, k)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], n, dtype=torch.float32)
        status = matmul()(rows, rows.stride(0), rows.shape[0], weight, n, k, bias, out, n)
        if status:
            raise RuntimeError(f"test_capture.matmul returned status {status}")
        CALLS["apply"] += 1
        return out.view(*x.shape[:-1], n)

    def capture_support(self, ctx: CaptureContext) -> Support:
        if ctx.kind is GraphKind.CPU_STEP_GRAPH:
            return Support.yes()  # views, an allocation, a copy and a GraphFunction call
        return not_declared(f"linear kernel {self.name!r}", ctx)
