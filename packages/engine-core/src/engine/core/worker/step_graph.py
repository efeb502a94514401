"""The model's forward pass as a CPU step graph (``engine.core.native.graph``), where it can be.

``capture_step_graph`` records the loaded model's forward pass once the KV cache exists and
the worker extensions have started; the model runner then replays it for every step of up
to ``StepGraph.rows`` tokens (one C call instead of ~10 Python-wrapped calls per layer) and
runs the model eagerly for larger steps. The graph is the CPU's counterpart of CUDA graphs,
so ``--enforce-eager`` (or a platform's ``enforce_eager``) turns it off.

A graph replays native kernel calls only, so it is captured only where every part of the
forward pass is the engine's own and has no Python side effect a replay would skip:

* one of the built-in Llama-family models (a plugin's model runs eagerly, as does a
  subclass of a built-in one);
* every linear layer unquantized on the ``cpu`` linear kernel with its packed weights
  (AVX-512: oneDNN takes 4+ rows on other CPUs, which a graph cannot call), the built-in
  ``rms_norm``/``rotary_embedding``/``silu_and_mul`` on their CPU path, the ``cpu``
  attention backend;
* one rank, no KV connector, no module hooks.

Anything else (a custom-op or linear-kernel plugin, GGUF weights kept quantized, a torch
op a graph cannot record) leaves the model eager, with one INFO line saying why; requests
are served the same either way. Before the graph is used, a short pass of both on the
null block must give the same hidden states bit for bit.

Where the LM head is a layer the graph runs too, it is recorded as a second stage: a step
whose every token is sampled (decode steps: one token per request) replays both and takes
its logits from the graph; any other step replays the layers alone and runs the head
eagerly on the rows it samples (``model.compute_logits``), as without a graph.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.core.attention.cpu_backend import CpuAttentionImpl, CpuAttentionMetadata
from engine.core.model_executor.layers import builtin_ops
from engine.core.model_executor.layers.attention import Attention
from engine.core.model_executor.layers.embedding import VocabEmbedding
from engine.core.model_executor.layers.linear import Linear, UnquantizedLinearMethod
from engine.core.model_executor.linear_kernels import CpuLinearKernel
from engine.core.model_executor.models import llama
from engine.core.native.graph import KernelGraph, NotCapturable, record
from engine.core.native.library import NativeKernels
from engine.core.worker.capture import capture_or_explain
from engine.core.worker.step_inputs import StepInputs, build_step_inputs
from engine.sdk.attention import AttentionMetadataBuilder

logger = logging.getLogger(__name__)

#: The most tokens a graph takes (the CPU platform's step budget); larger steps run eagerly
#: (prefill-heavy steps, where a step's Python is a small part of its time).
MAX_GRAPH_TOKENS = 512
#: Token counts recorded besides the largest (see engine.core.native.graph). Not 1: torch
#: skips copies of one-row views (a one-row slice is contiguous), which a replay of a
#: larger pass makes anyway, to the same values; the eager check below covers 1 token.
EXTRA_RECORDINGS = (2, 3, 4)
#: Modules a graph may run, beyond those checked one by one in ``_refusal``.
_CONTAINERS = (llama.LlamaForCausalLM, llama.MistralForCausalLM, llama.Qwen2ForCausalLM,
               llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP, VocabEmbedding)
_OPS = (builtin_ops.RMSNorm, builtin_ops.RotaryEmbedding, builtin_ops.SiluAndMul)


class _Inputs:
    """The graph's static inputs: each step's are copied in before a run."""

    def __init__(self, rows: int, max_reqs: int, max_blocks: int) -> None:
        self.input_ids = torch.zeros(rows, dtype=torch.int64)
        self.positions = torch.zeros(rows, dtype=torch.int64)
        self.slots = torch.zeros(rows, dtype=torch.int64)
        self.requests = torch.zeros(rows, dtype=torch.int32)
        self.token_positions = torch.zeros(rows, dtype=torch.int32)
        self.block_table = torch.zeros(max_reqs, max_blocks, dtype=torch.int32)
        self._arrays = [t.numpy() for t in self.tensors()]

    def tensors(self) -> list[torch.Tensor]:
        return [self.input_ids, self.positions, self.slots, self.requests,
                self.token_positions, self.block_table]

    def metadata(self, rows: int) -> CpuAttentionMetadata:
        return CpuAttentionMetadata(slots=self.slots[:rows], block_table=self.block_table,
                                    requests=self.requests[:rows],
                                    positions=self.token_positions[:rows])

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor,
             metadata: CpuAttentionMetadata) -> None:
        rows = input_ids.shape[0]
        ids, pos, slots, requests, token_positions, table = self._arrays
        ids[:rows] = input_ids.numpy()
        pos[:rows] = positions.numpy()
        slots[:rows] = metadata.slots.numpy()
        requests[:rows] = metadata.requests.numpy()
        token_positions[:rows] = metadata.positions.numpy()
        reqs, blocks = metadata.block_table.shape
        table[:reqs, :blocks] = metadata.block_table.numpy()


class StepGraph:
    """A captured forward pass for steps of up to ``rows`` tokens (CPU ``step_graph``).

    ``run`` gives what ``model(input_ids, positions, builder.build(common))`` would.
    """

    def __init__(self, graph: KernelGraph, inputs: _Inputs,
                 builder: AttentionMetadataBuilder[Any], max_reqs: int,
                 max_blocks: int) -> None:
        self.graph = graph
        self.inputs = inputs
        #: The cpu backend's metadata builder: each step's metadata, copied into ``inputs``.
        self.builder = builder
        self.max_reqs = max_reqs
        self.max_blocks = max_blocks

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
        self.inputs.fill(inputs.input_ids, inputs.positions, self.builder.build(inputs.common))
        rows = inputs.input_ids.shape[0]
        if self.graph.num_stages == 1 or inputs.logits_indices.shape[0] != rows:
            return self.graph.run(rows), None
        logits = self.graph.run(rows, stages=2)
        # A copy in float32 (as compute_logits returns): the sampler and the logits
        # processors may change it in place or keep it, and the next run overwrites the
        # arena's.
        return self.graph.output(0, rows), logits.to(torch.float32, copy=True)


def capture_step_graph(model: nn.Module, kernels: NativeKernels | None,
                       builder: AttentionMetadataBuilder[Any], *, max_tokens: int,
                       max_reqs: int, max_blocks: int, block_size: int,
                       kv_caches: Sequence[torch.Tensor]) -> StepGraph:
    """Record ``model``'s forward pass for steps of up to ``max_tokens`` tokens.

    Raises:
        NotCapturable: the forward pass cannot be a graph; the message says why.
    """
    if kernels is None:
        raise NotCapturable("the CPU kernels are not built here")
    rows = min(max_tokens, MAX_GRAPH_TOKENS)
    if rows < 2:
        raise NotCapturable(f"steps of {rows} token are too small to be worth a graph")
    if type(model) not in _CONTAINERS[:3]:
        raise NotCapturable(f"the model class {type(model).__name__} is not one of the "
                            f"engine's built-in models")
    inputs = _Inputs(rows, max_reqs, max_blocks)
    known = [*model.parameters(), *model.buffers(), *kv_caches, *inputs.tensors(),
             *_kernel_tensors(model)]

    def forward(count: int) -> torch.Tensor:
        out: torch.Tensor = model(inputs.input_ids[:count], inputs.positions[:count],
                                  inputs.metadata(count))
        return out

    counts = [rows, *(n for n in EXTRA_RECORDINGS if n < rows)]
    head = _head(model)
    with torch.inference_mode(), _only_known_modules():
        recordings = [record(kernels, forward, count, known, then=head) for count in counts]
    step_graph = StepGraph(KernelGraph.from_recordings(kernels, recordings), inputs, builder,
                           max_reqs, max_blocks)
    null_blocks = [cache[:, 0].clone() for cache in kv_caches]  # the check writes there
    try:
        _check_against_eager(model, step_graph, block_size)
    finally:
        for cache, block in zip(kv_caches, null_blocks, strict=True):
            cache[:, 0] = block
    return step_graph


def _head(model: nn.Module) -> nn.Module | None:
    """The LM head, where ``compute_logits`` is it alone and the graph can run it."""
    lm_head = getattr(model, "lm_head", None)
    if getattr(type(model), "compute_logits", None) is not (
            llama.LlamaForCausalLM.compute_logits) or not (
            isinstance(lm_head, nn.Module)) or _refusal(lm_head) is not None:
        return None
    return lm_head


def _kernel_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Tensors the linear kernels hold outside the parameters (the packed weights)."""
    found = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "kernel", None)
        found += [v for v in vars(kernel).values() if isinstance(v, torch.Tensor)
                  and v.layout == torch.strided and not v.is_mkldnn] if (
            kernel is not None) else []  # oneDNN's own copies have no storage to point at
    return found


def _refusal(module: nn.Module) -> str | None:
    """Why the graph cannot run ``module`` (None: it can)."""
    kind = type(module)
    if module._forward_hooks or module._forward_pre_hooks:
        return "it has forward hooks, which a graph would not call"
    if kind in _CONTAINERS:
        return None
    if kind in _OPS:
        chosen = getattr(module, "_forward_impl", None)
        if getattr(chosen, "__func__", None) is not kind.forward_cpu:
            return "it does not run its CPU kernel here"
        return None
    if kind is Linear:
        method: Any = module.quant_method
        kernel = getattr(method, "kernel", None)
        if type(method) is not UnquantizedLinearMethod or type(kernel) is not CpuLinearKernel:
            return (f"its product is {type(kernel or method).__name__}, not the cpu linear "
                    f"kernel's")
        if kernel.panels is None:
            return "its weight is not packed here (oneDNN multiplies 4+ rows)"
        return None
    if kind is Attention:
        impl: Any = module.impl
        if type(impl) is not CpuAttentionImpl:
            return f"its backend is {type(impl).__name__}, not the cpu backend"
        if module.kv_connector is not None:
            return "a KV connector hooks it"
        return None
    return f"{kind.__module__}.{kind.__qualname__} is not a layer the graph knows"


@contextlib.contextmanager
def _only_known_modules() -> Iterator[None]:
    def check(module: nn.Module, args: Any) -> None:
        reason = _refusal(module)
        if reason is not None:
            raise NotCapturable(f"{type(module).__name__}: {reason}")

    handle = nn.modules.module.register_module_forward_pre_hook(check)
    try:
        if len(nn.modules.module._global_forward_hooks) or len(
                nn.modules.module._global_forward_pre_hooks) > 1:
            raise NotCapturable("global module hooks are registered")
        yield
    finally:
        handle.remove()


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


def try_capture(model: nn.Module, kernels: NativeKernels | None,
                builder: AttentionMetadataBuilder[Any], *, enforce_eager: bool,
                reasons: Sequence[str], quiet: bool = False, **kwargs: Any) -> StepGraph | None:
    """``capture_step_graph``, or None; one INFO line (DEBUG if ``quiet``) says which."""
    return capture_or_explain(
        logger, "CPU step graph", lambda: capture_step_graph(model, kernels, builder, **kwargs),
        _describe, refused=NotCapturable, enforce_eager=enforce_eager, reasons=reasons,
        quiet=quiet)


def _describe(graph: StepGraph) -> str:
    head = ("the LM head included for decode steps" if graph.graph.num_stages > 1
            else "the LM head eager")
    return (f"the forward pass runs as {graph.graph.num_ops} native calls for steps of up "
            f"to {graph.rows} tokens, {head} (arena "
            f"{graph.graph.arena_bytes / (1 << 20):.1f} MiB)")


__all__ = ["MAX_GRAPH_TOKENS", "StepGraph", "capture_step_graph", "try_capture"]
