"""A linear kernel's product as the CPU step graph replays it, for timing.

Steps of up to ``MAX_GRAPH_TOKENS`` tokens run as one recorded graph when every component
of the forward pass can be recorded: a kernel the graph records then costs its native
call and nothing of its Python. So a kernel that says it can be recorded
(``capture_support`` for ``CPU_STEP_GRAPH``) is timed replayed from a graph of its own
product; one that cannot, or whose recording is refused, is timed calling ``apply``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from engine.core.native.graph import KernelGraph, NotCapturable, record
from engine.core.native.runtime import graph_runtime
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.linear_kernel import LinearKernel
from engine.sdk.platform import PlatformInfo


def graph_replays(pairs: Sequence[tuple[LinearKernel, nn.Module]], x: torch.Tensor,
                  platform: PlatformInfo | None) -> list[Callable[[], object]] | None:
    """Per (kernel, layer), a call replaying its product of ``x`` from a graph.

    None where a step of ``x``'s rows would not run the kernel in a graph.
    """
    from engine.core.worker.capture_components import own_tensors
    from engine.core.worker.step_graph import MAX_GRAPH_TOKENS

    runtime = graph_runtime()
    rows = x.shape[0]
    if runtime is None or rows > MAX_GRAPH_TOKENS:
        return None
    ctx = CaptureContext(kind=GraphKind.CPU_STEP_GRAPH, platform=platform, max_tokens=rows)
    replays: list[Callable[[], object]] = []
    for kernel, layer in pairs:
        try:
            if not kernel.capture_support(ctx).ok:
                return None
        except Exception:  # noqa: BLE001 - the step graph names it; timed as it runs then
            return None
        try:
            known = [*layer.parameters(), x, *own_tensors(kernel)]
            recording = record(runtime, functools.partial(_product, kernel, layer, x), rows,
                               known)
            graph = KernelGraph.from_recordings(runtime, [recording])
        except NotCapturable:
            return None
        replays.append(functools.partial(graph.run, rows))
    return replays


def _product(kernel: LinearKernel, layer: nn.Module, x: torch.Tensor, rows: int,
             ) -> torch.Tensor:
    return kernel.apply(layer, x[:rows], getattr(layer, "bias", None))


__all__ = ["graph_replays"]
