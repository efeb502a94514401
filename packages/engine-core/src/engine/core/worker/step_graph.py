"""The model's forward pass as a CPU step graph (``engine.core.native.graph``), where it can be.

``capture_step_graph`` records the loaded model's forward pass once the KV cache exists and
the worker extensions have started; the model runner then replays it for every step of up
to ``StepGraph.rows`` tokens (one C call instead of ~10 Python-wrapped calls per layer) and
runs the model eagerly for larger steps. The graph is the CPU's counterpart of CUDA graphs,
so ``--enforce-eager`` (or a platform's ``enforce_eager``) turns it off.

A graph replays native kernel calls only and skips the pass's Python, so it is captured
only where every component of the pass says it may be (``capture_support`` with
``GraphKind.CPU_STEP_GRAPH``, ``engine.sdk.capture``; ``capture_components`` asks them):
the model for its own modules, each custom op, linear layer (its quantization method and
linear kernel) and attention layer (its implementation). The engine's own declare where
they run native kernels: the built-in Llama family, ``rms_norm``/``rotary_embedding``/
``silu_and_mul`` on their CPU path, the ``cpu`` linear kernel with its packed weights
(AVX-512: oneDNN takes 4+ rows on other CPUs, which a graph cannot call), the ``cpu``
attention backend, the embedding. A plugin's component is recorded where it declares too
(a subclass inherits its base's answer). What the engine checks whatever they answer:
one rank, no KV connector, no module hooks, the ``cpu`` backend's metadata builder (the
graph's static inputs hold its metadata: a backend reusing that builder may be recorded);
``engine.core.native.graph`` refuses any torch op that computes outside the native
kernels, naming it and the module it ran in.

Anything refused (a component that does not declare, GGUF weights kept quantized, a torch
op a graph cannot record) leaves the model eager, with one INFO line saying why; requests
are served the same either way. Before the graph is used, a short pass of both on the
null block must give the same hidden states bit for bit.

The model's ``compute_logits`` is recorded as a second stage where it can be (it ends in
a conversion to float32, done after the replay): a step whose every token is sampled
(decode steps: one token per request) replays both and takes its logits from the graph;
any other step replays the layers alone and runs ``compute_logits`` eagerly on the rows it
samples, as without a graph. A ``compute_logits`` the graph cannot record (torch compute
of its own, say) stays eager for every step, which the INFO line says.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.core.native.graph import KernelGraph, NotCapturable, record
from engine.core.native.runtime import GraphRuntime
from engine.core.plugin_faults import ForwardAttribution
from engine.core.worker.capture import capture_or_explain
from engine.core.worker.capture_components import PassComponents, held_tensors
from engine.core.worker.step_inputs import StepInputs, build_step_inputs
from engine.sdk.attention import (
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    GraphMetadata,
)
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.platform import PlatformInfo

logger = logging.getLogger(__name__)

#: The most tokens a graph takes (the CPU platform's step budget); larger steps run eagerly
#: (prefill-heavy steps, where a step's Python is a small part of its time).
MAX_GRAPH_TOKENS = 512
#: Token counts recorded besides the largest (see engine.core.native.graph). Not 1: torch
#: skips copies of one-row views (a one-row slice is contiguous), which a replay of a
#: larger pass makes anyway, to the same values; the eager check below covers 1 token.
EXTRA_RECORDINGS = (2, 3, 4)


class _Inputs:
    """The graph's static inputs: each step's are copied in before a run.

    The token ids and positions, and the attention backend's metadata in buffers of its
    own (``AttentionMetadataBuilder.graph_metadata``).
    """

    def __init__(self, rows: int, metadata: GraphMetadata[Any]) -> None:
        self.input_ids = torch.zeros(rows, dtype=torch.int64)
        self.positions = torch.zeros(rows, dtype=torch.int64)
        self.attention = metadata
        self._arrays = [self.input_ids.numpy(), self.positions.numpy()]

    def tensors(self) -> list[torch.Tensor]:
        return [self.input_ids, self.positions, *self.attention.tensors()]

    def metadata(self, rows: int) -> Any:
        return self.attention.view(rows)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor,
             common: CommonAttentionMetadata) -> None:
        rows = input_ids.shape[0]
        ids, pos = self._arrays
        ids[:rows] = input_ids.numpy()
        pos[:rows] = positions.numpy()
        self.attention.fill(common)


class StepGraph:
    """A captured forward pass for steps of up to ``rows`` tokens (CPU ``step_graph``).

    ``run`` gives what ``model(input_ids, positions, builder.build(common))`` would.
    """

    def __init__(self, graph: KernelGraph, inputs: _Inputs,
                 builder: AttentionMetadataBuilder[Any], max_reqs: int,
                 max_blocks: int) -> None:
        self.graph = graph
        self.inputs = inputs
        #: The attention metadata builder (``inputs`` holds its graph metadata).
        self.builder = builder
        self.max_reqs = max_reqs
        self.max_blocks = max_blocks
        #: Why ``compute_logits`` is not the graph's second stage (None: it is).
        self.head_refused: str | None = None

    @property
    def rows(self) -> int:
        return self.graph.rows

    def takes(self, inputs: StepInputs) -> bool:
        """Whether this step fits the graph (else the model runs eagerly)."""
        reqs, blocks = inputs.common.block_table.shape
        return (0 < inputs.input_ids.shape[0] <= self.graph.rows and reqs <= self.max_reqs
                and blocks <= self.max_blocks)

    def run(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The hidden states ``[tokens, hidden]`` and the logits, where the graph made them.

        The logits are ``model.compute_logits`` of the rows in ``inputs.logits_indices``;
        None: the caller computes them. The hidden states are a view the next run
        overwrites.
        """
        self.inputs.fill(inputs.input_ids, inputs.positions, inputs.common)
        rows = inputs.input_ids.shape[0]
        if self.graph.num_stages == 1 or inputs.logits_indices.shape[0] != rows:
            return self.graph.run(rows), None
        logits = self.graph.run(rows, stages=2)
        # A copy in float32 (as compute_logits returns): the sampler and the logits
        # processors may change it in place or keep it, and the next run overwrites the
        # arena's.
        return self.graph.output(0, rows), logits.to(torch.float32, copy=True)


def capture_step_graph(model: nn.Module, runtime: GraphRuntime | None,
                       builder: AttentionMetadataBuilder[Any], *, max_tokens: int,
                       max_reqs: int, max_blocks: int, block_size: int,
                       kv_caches: Sequence[torch.Tensor],
                       attribution: ForwardAttribution | None = None,
                       platform: PlatformInfo | None = None) -> StepGraph:
    """Record ``model``'s forward pass for steps of up to ``max_tokens`` tokens.

    ``attribution`` names the plugins of refused components; ``platform`` is what they
    are told (``CaptureContext``).

    Raises:
        NotCapturable: the forward pass cannot be a graph; the message says why.
    """
    if runtime is None:
        raise NotCapturable("the step graph's runtime (a C++ library) is not built here")
    rows = min(max_tokens, MAX_GRAPH_TOKENS)
    if rows < 2:
        raise NotCapturable(f"steps of {rows} token are too small to be worth a graph")
    ctx = CaptureContext(kind=GraphKind.CPU_STEP_GRAPH, platform=platform, max_tokens=rows,
                         max_reqs=max_reqs, max_blocks_per_req=max_blocks)
    components = PassComponents(model, ctx, attribution)
    why = components.model_refusal()
    if why is not None:
        raise NotCapturable(why)
    inputs = _Inputs(rows, _graph_metadata(builder, ctx, components))
    known = [*model.parameters(), *model.buffers(), *kv_caches, *inputs.tensors(),
             *held_tensors(model)]

    def forward(count: int) -> torch.Tensor:
        out: torch.Tensor = model(inputs.input_ids[:count], inputs.positions[:count],
                                  inputs.metadata(count))
        return out

    counts = [rows, *(n for n in EXTRA_RECORDINGS if n < rows)]
    with torch.inference_mode():
        head_refused, recordings = _record(components, runtime, forward, counts, known)
    step_graph = StepGraph(KernelGraph.from_recordings(runtime, recordings), inputs, builder,
                           max_reqs, max_blocks)
    step_graph.head_refused = head_refused
    null_blocks = [cache[:, 0].clone() for cache in kv_caches]  # the check writes there
    try:
        _check_against_eager(model, step_graph, block_size)
    finally:
        for cache, block in zip(kv_caches, null_blocks, strict=True):
            cache[:, 0] = block
    return step_graph


def _graph_metadata(builder: AttentionMetadataBuilder[Any], ctx: CaptureContext,
                    components: PassComponents) -> GraphMetadata[Any]:
    """The builder's metadata in fixed buffers; NotCapturable naming it where it has none."""
    try:
        metadata = builder.graph_metadata(ctx)
    except Exception as exc:  # noqa: BLE001 - a plugin hook failing: eager, named
        raise NotCapturable(f"({components.label(builder)}): graph_metadata raised "
                            f"{type(exc).__name__}: {exc}") from None
    if metadata is None:
        raise NotCapturable(f"({components.label(builder)}): it gives no metadata a graph "
                            f"can hold (its graph_metadata returns None)")
    return metadata


class _HeadRefused(NotCapturable):
    """``compute_logits`` cannot be a stage of the graph (the layers may still be)."""


def _record(components: PassComponents, runtime: GraphRuntime,
            forward: Callable[[int], torch.Tensor], counts: Sequence[int],
            known: Sequence[torch.Tensor]) -> tuple[str | None, list[Any]]:
    """Recordings of the pass at ``counts`` tokens, with ``compute_logits`` where it can be.

    Returns why ``compute_logits`` was left out (None: it is the second stage), and the
    recordings.
    """
    model: Any = components.model
    compute_logits: Callable[[torch.Tensor], torch.Tensor] = model.compute_logits

    def head(hidden: torch.Tensor) -> torch.Tensor:
        try:
            return compute_logits(hidden)
        except _HeadRefused:
            raise
        except NotCapturable as exc:
            raise _HeadRefused(str(exc)) from None

    try:
        with components.checked(NotCapturable):
            return None, [record(runtime, forward, n, known, then=head) for n in counts]
    except _HeadRefused as exc:
        head_refused = str(exc)
    with components.checked(NotCapturable):
        return head_refused, [record(runtime, forward, n, known) for n in counts]


def _check_against_eager(model: nn.Module, step_graph: StepGraph, block_size: int) -> None:
    """The graph's hidden states and logits must be the model's, exactly.

    Passes on the null block: a request of 1 token, one of 4, and 4 requests of 1 token
    (the LM head stage).
    """
    tokens, reqs = min(4, step_graph.rows), min(4, step_graph.rows, step_graph.max_reqs)
    for num_reqs, rows in sorted({(1, 1), (1, tokens), (reqs, 1)}):
        inputs = build_step_inputs(
            num_scheduled=np.full(num_reqs, rows, dtype=np.int32),
            num_computed=np.zeros(num_reqs, dtype=np.int32),
            num_tokens=np.full(num_reqs, rows, dtype=np.int32),
            token_ids=np.tile(np.arange(1, rows + 1, dtype=np.int32), (num_reqs, 1)),
            block_table=np.zeros((num_reqs, -(-rows // block_size)), dtype=np.int32),
            block_size=block_size, device=torch.device("cpu"))
        with torch.inference_mode():
            want = model(inputs.input_ids, inputs.positions,
                         step_graph.builder.build(inputs.common)).clone()
            got, logits = step_graph.run(inputs)
            compute_logits: Any = model.compute_logits
            want_logits: Any = None if logits is None else compute_logits(
                want.index_select(0, inputs.logits_indices))
        what = f"{num_reqs} request(s) of {rows} token(s)"
        if not torch.equal(got, want):
            raise NotCapturable(f"its replay of {what} did not give the eager pass's hidden "
                                f"states (a bug: please report it)")
        if logits is not None and not torch.equal(logits, want_logits):
            raise NotCapturable(f"its replay of the LM head for {what} did not give the eager "
                                f"logits (a bug: please report it)")


def try_capture(model: nn.Module, runtime: GraphRuntime | None,
                builder: AttentionMetadataBuilder[Any], *, enforce_eager: bool,
                reasons: Sequence[str], quiet: bool = False, **kwargs: Any) -> StepGraph | None:
    """``capture_step_graph``, or None; one INFO line (DEBUG if ``quiet``) says which."""
    return capture_or_explain(
        logger, "CPU step graph", lambda: capture_step_graph(model, runtime, builder, **kwargs),
        _describe, refused=NotCapturable, enforce_eager=enforce_eager, reasons=reasons,
        quiet=quiet)


def _describe(graph: StepGraph) -> str:
    head = ("the LM head included for decode steps" if graph.graph.num_stages > 1
            else f"the LM head eager ({graph.head_refused})" if graph.head_refused
            else "the LM head eager")
    return (f"the forward pass runs as {graph.graph.num_ops} native calls for steps of up "
            f"to {graph.rows} tokens, {head} (arena "
            f"{graph.graph.arena_bytes / (1 << 20):.1f} MiB)")


__all__ = ["MAX_GRAPH_TOKENS", "StepGraph", "capture_step_graph", "try_capture"]
