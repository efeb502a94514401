"""Decode steps replayed as CUDA graphs: the GPU counterpart of ``step_graph``.

A decode step of a small model on a GPU is bound by the host: every layer launches a
handful of kernels (norms, projections, rotary, the KV write, attention), each costing
the CPU more than the GPU spends on it. ``capture_cuda_graphs`` records the forward pass
once per batch size in ``capture_sizes`` into ``torch.cuda.CUDAGraph`` objects after the KV
cache exists; a decode step of ``n`` requests then copies its inputs into the graphs'
static buffers and replays the smallest graph of at least ``n`` rows: one launch.

Which steps: decode-only batches (every request one query token), as long as the
attention backend's ``cudagraph_support`` is at least ``UNIFORM_SINGLE_TOKEN_DECODE``
(a backend at ``NEVER`` keeps every step eager) and every component of the pass says CUDA
graphs may capture it (``capture_support`` with ``GraphKind.CUDA_GRAPHS``,
``engine.sdk.capture``; ``capture_components`` asks them during a warm-up pass): the model
for its own modules, each custom op, linear layer (quantization method, linear kernel) and
attention implementation. One that does not declare keeps the model eager, named in the
INFO line. Prefill and mixed steps run eagerly.
Padding rows of a graph (``n`` below its size) read and write only the null block:
their slots are the null block's first, their context one token, their block-table row
whatever it held (read, never written). Their outputs are dropped.

A backend's side of the contract: what its metadata builder builds from the engine's
``CommonAttentionMetadata`` reads those tensors (the engine refills them in place every
step), or buffers of the builder's own that ``build`` refills: ``build`` runs every step
before the replay. Launch parameters may depend on ``num_reqs``, ``num_actual_tokens`` and
``max_query_len`` (equal for every replay of one graph) but not on other host values
(``max_seq_len`` is ``max_model_len`` in a graph; ``seq_lens_cpu`` is refilled).

``--enforce-eager`` turns graphs off, as do tensor parallelism and KV connectors (their
collectives and hooks run in Python between layers). A capture that fails (a model or
plugin that synchronises with the host mid-pass, say) leaves the model eager with one
INFO line saying why; before graphs are used, a replay must give the eager pass's hidden
states on the null block.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.core.plugin_faults import ForwardAttribution
from engine.core.worker.capture import capture_or_explain
from engine.core.worker.capture_components import PassComponents
from engine.core.worker.step_inputs import StepInputs, build_step_inputs
from engine.sdk.attention import (
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    CudaGraphSupport,
)
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.platform import PlatformInfo

logger = logging.getLogger(__name__)

#: The largest decode batch captured (vLLM's default is 512; larger batches are rarely
#: host-bound).
MAX_CAPTURE_SIZE = 256
#: Relative difference a replay may show against the eager pass at capture (kernels may
#: pick other reduction orders inside a graph; a wrong buffer shows as O(1)).
CHECK_TOLERANCE = 2e-2


class NotCapturable(Exception):
    """The forward pass cannot be captured as CUDA graphs; the message says why."""


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8, up to ``max_num_seqs`` (included)."""
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8))
    return [*sizes, top]


class DecodeBuffers:
    """The graphs' static inputs; each step's are copied in before a replay.

    Rows past a step's ``n`` are padding: slot 0 (the null block), context length 1.
    """

    def __init__(self, max_reqs: int, max_blocks: int, max_model_len: int,
                 device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.max_model_len = max_model_len
        self.input_ids = zeros(max_reqs)
        self.positions = zeros(max_reqs)
        self.slot_mapping = zeros(max_reqs)
        self.seq_lens = torch.ones(max_reqs, dtype=torch.int32, device=device)
        self.seq_lens_cpu = torch.ones(max_reqs, dtype=torch.int32)
        self.block_table = zeros(max_reqs, max_blocks, dtype=torch.int32)
        # One query token per request: the query starts never change.
        self.query_start_loc_cpu = torch.arange(max_reqs + 1, dtype=torch.int32)
        self.query_start_loc = self.query_start_loc_cpu.to(device)

    def common(self, size: int) -> CommonAttentionMetadata:
        """The metadata of a decode batch of ``size`` rows, over the static buffers."""
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1],
            query_start_loc_cpu=self.query_start_loc_cpu[:size + 1],
            seq_lens=self.seq_lens[:size], seq_lens_cpu=self.seq_lens_cpu[:size],
            block_table=self.block_table[:size], slot_mapping=self.slot_mapping[:size],
            num_reqs=size, num_actual_tokens=size, max_query_len=1,
            max_seq_len=self.max_model_len)

    def fill(self, inputs: StepInputs, size: int) -> None:
        """Copy a decode step's inputs in; rows ``n`` to ``size`` become padding."""
        common = inputs.common
        n = common.num_reqs
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(common.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(common.seq_lens, non_blocking=True)
        self.seq_lens_cpu[:n] = common.seq_lens_cpu
        blocks = common.block_table.shape[1]
        self.block_table[:n, :blocks].copy_(common.block_table, non_blocking=True)
        if n < size:  # padding writes only the null block; stale rows may be real slots
            self.slot_mapping[n:size].zero_()
            self.seq_lens[n:size].fill_(1)
            self.seq_lens_cpu[n:size] = 1


class CudaGraphs:
    """Captured decode graphs, one per batch size; the model runner's ``step_graph``.

    ``run`` gives what ``model(input_ids, positions, builder.build(common))`` would.
    """

    def __init__(self, buffers: DecodeBuffers, builder: AttentionMetadataBuilder[Any],
                 graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]) -> None:
        self.buffers = buffers
        self.builder = builder
        self.graphs = graphs
        self.sizes = sorted(graphs)
        self.max_blocks = buffers.block_table.shape[1]

    @property
    def rows(self) -> int:
        """The largest batch a graph takes."""
        return self.sizes[-1]

    def takes(self, inputs: StepInputs) -> bool:
        """Whether this step is a decode batch a graph takes (else the model runs eagerly)."""
        common = inputs.common
        return (common.max_query_len == 1 and common.num_actual_tokens == common.num_reqs
                and 0 < common.num_reqs <= self.rows
                and common.block_table.shape[1] <= self.max_blocks)

    def size_for(self, n: int) -> int:
        """The smallest captured size of at least ``n`` rows."""
        return next(s for s in self.sizes if s >= n)

    def run(self, inputs: StepInputs) -> tuple[torch.Tensor, None]:
        """The hidden states ``[n, hidden]``, a view the next replay overwrites.

        The logits are the runner's to compute: the LM head is not captured.
        """
        n = inputs.common.num_reqs
        size = self.size_for(n)
        self.buffers.fill(inputs, size)
        self.builder.build(self.buffers.common(size))  # a builder's own buffers, refilled
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[:n], None


def capture_cuda_graphs(model: nn.Module, builder: AttentionMetadataBuilder[Any],
                        support: CudaGraphSupport, *, sizes: Sequence[int], max_blocks: int,
                        max_model_len: int, block_size: int, device: torch.device,
                        attribution: ForwardAttribution | None = None,
                        platform: PlatformInfo | None = None) -> CudaGraphs:
    """Capture ``model``'s decode pass for each batch size in ``sizes``.

    ``attribution`` names the plugins of refused components; ``platform`` is what they
    are told (``CaptureContext``).

    Raises:
        NotCapturable: the backend, a component or the forward pass cannot be captured;
            says why.
    """
    if support < CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE:
        raise NotCapturable(f"the attention backend's cudagraph_support is "
                            f"{support.name}")
    if not sizes:
        raise NotCapturable("no batch size to capture")
    components = PassComponents(model, CaptureContext(
        kind=GraphKind.CUDA_GRAPHS, platform=platform, max_tokens=max(sizes),
        decode_only=True), attribution)
    why = components.model_refusal()
    if why is not None:
        raise NotCapturable(why)
    buffers = DecodeBuffers(max(sizes), max_blocks, max_model_len, device)
    top = max(sizes)
    with torch.inference_mode(), components.checked(NotCapturable):  # asks every component
        model(buffers.input_ids[:top], buffers.positions[:top],
              builder.build(buffers.common(top)))
    pool = torch.cuda.graph_pool_handle()
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    with torch.inference_mode():
        for size in sorted(sizes, reverse=True):  # the largest first: the rest reuse its pool
            graphs[size] = _capture_one(model, builder, buffers, size, pool)
    captured = CudaGraphs(buffers, builder, graphs)
    _check_against_eager(model, captured, block_size)
    return captured


def _capture_one(model: nn.Module, builder: AttentionMetadataBuilder[Any],
                 buffers: DecodeBuffers, size: int,
                 pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    ids, positions = buffers.input_ids[:size], buffers.positions[:size]
    metadata = builder.build(buffers.common(size))
    try:
        model(ids, positions, metadata)  # warm-up outside the graph: JIT, library handles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = model(ids, positions, metadata)
    except Exception as exc:
        raise NotCapturable(f"capturing a decode batch of {size} failed: "
                            f"{type(exc).__name__}: {exc}") from exc
    return graph, hidden


def _check_against_eager(model: nn.Module, graphs: CudaGraphs, block_size: int) -> None:
    """Replays of the smallest and the largest size on the null block against eager passes.

    Every row is token 0 at position 0 in slot 0, the padding rows of the fresh buffers
    too (rows sharing a slot must write the same keys); one row short of the largest size,
    so a padded replay is checked.
    """
    for size in sorted({graphs.sizes[0], graphs.rows}):
        n = size - 1 if size > 1 else 1
        ones = np.ones(n, dtype=np.int32)
        inputs = build_step_inputs(
            num_scheduled=ones, num_computed=ones - 1, num_tokens=ones,
            token_ids=np.zeros((n, 1), dtype=np.int32),
            block_table=np.zeros((n, 1), dtype=np.int32), block_size=block_size,
            device=graphs.buffers.input_ids.device)
        with torch.inference_mode():
            want = model(inputs.input_ids, inputs.positions,
                         graphs.builder.build(inputs.common)).float()
            got = graphs.run(inputs)[0].float()
        scale = float(want.abs().max()) or 1.0
        error = float((got - want).abs().max()) / scale
        if not error <= CHECK_TOLERANCE:
            raise NotCapturable(f"a replay of {n} tokens differs from the eager pass by "
                                f"{error:.3g} of its largest value (a bug: please report it)")


def try_capture_cuda(model: nn.Module, builder: AttentionMetadataBuilder[Any],
                     support: CudaGraphSupport, *, enforce_eager: bool,
                     reasons: Sequence[str], quiet: bool = False,
                     **kwargs: Any) -> CudaGraphs | None:
    """``capture_cuda_graphs``, or None; one INFO line (DEBUG if ``quiet``) says which."""
    return capture_or_explain(
        logger, "CUDA graphs", lambda: capture_cuda_graphs(model, builder, support, **kwargs),
        lambda graphs: (f"decode batches of up to {graphs.rows} requests replay graphs "
                        f"captured for sizes {', '.join(map(str, graphs.sizes))}"),
        refused=NotCapturable, enforce_eager=enforce_eager, reasons=reasons, quiet=quiet)


__all__ = ["CudaGraphs", "DecodeBuffers", "capture_cuda_graphs", "capture_sizes",
           "try_capture_cuda"]
