"""``ModelRunner``: turns one ``SchedulerOutput`` into one ``ModelRunnerOutput``.

Per step::

    update the persistent batch from the scheduler's deltas (see ``_update_states``)
    flatten the scheduled tokens into inputs              (``step_inputs``)
    build attention metadata once, run the model once
    logits of each request's last scheduled token -> sampler -> tokens (+ logprobs)
    append tokens of requests that completed their sequence; prompt logprobs if asked

The batch holds exactly the requests scheduled this step; requests the scheduler skipped
this step keep their state in ``self.requests`` and re-enter the batch when scheduled.

Under tensor parallelism every rank runs this with the same scheduler output: each runs
the model and every ``compute_logits`` call (the layers' collectives need all ranks, in the
same order), rank 0 alone samples (with the logits processors) and broadcasts the sampled
ids, so every rank appends the same tokens to its batch; logprobs are computed on rank 0,
and the other ranks return an empty output.

With a KV connector, every step (also one that runs no forward pass) is wrapped in the
connector's ``start_step`` / ``finish_step`` (``engine.core.worker.kv_connector``); its
finished transfers go into ``finished_sending`` / ``finished_recving``.

A plugin that raises fails requests, not the worker (``ModelRunnerOutput.failed``): a logits
processor the rows it served (``engine.core.sample.faults``); a ``PluginError`` naming a
plugin raised while the step runs (a KV connector hook, a custom op), or an exception
whose traceback ends in a plugin's module (``engine.core.plugin_faults``), every request of
the step, whose tokens are then discarded. Any other exception is a bug and propagates.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from engine.core.distributed import SINGLE, TensorParallelGroup, broadcast_from_driver
from engine.core.plugin_faults import ForwardAttribution
from engine.core.sample.faults import LogitsFaults
from engine.core.sample.logprobs import compute_logprobs, gather_logprobs, to_sample_logprobs
from engine.core.sample.sampler import Sampler
from engine.core.structured_output.bitmask import apply_grammar_bitmask
from engine.core.worker.input_batch import CachedRequestState, InputBatch
from engine.core.worker.step_inputs import StepInputs, build_step_inputs
from engine.sdk.attention import AttentionMetadataBuilder
from engine.sdk.errors import PluginError, PluginFailure
from engine.sdk.scheduler import ModelRunnerOutput, SampleLogprobs, SchedulerOutput

if TYPE_CHECKING:
    from engine.core.worker.kv_connector import WorkerKVConnector


class CapturedSteps(Protocol):
    """The forward pass replayed from a capture for the steps it ``takes``.

    ``engine.core.worker.step_graph.StepGraph`` on the CPU,
    ``engine.core.worker.cuda_graphs.CudaGraphs`` on CUDA.
    """

    def takes(self, inputs: StepInputs) -> bool: ...

    def run(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The hidden states, and the logits of ``inputs.logits_indices`` if it made them.

        None for the logits: the runner calls ``model.compute_logits``.
        """
        ...

_EMPTY = ModelRunnerOutput(req_ids=(), sampled_token_ids=())


class ModelRunner:
    """Runs the model for the worker; owns the persistent batch and the sampler."""

    def __init__(
        self, *, model: Any, builder: AttentionMetadataBuilder[Any], input_batch: InputBatch,
        block_size: int, device: torch.device, vocab_size: int,
        tp: TensorParallelGroup = SINGLE, kv_connector: WorkerKVConnector | None = None,
        faults: LogitsFaults | None = None, attribution: ForwardAttribution | None = None,
    ) -> None:
        self.model = model
        self.kv_connector = kv_connector
        self.tp = tp
        self.builder = builder
        self.input_batch = input_batch
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        self.faults = faults
        self.attribution = attribution
        self.sampler = Sampler(faults)
        self.requests: dict[str, CachedRequestState] = {}
        #: The forward pass captured for the steps it takes (a CPU step graph or CUDA
        #: graphs, set by the worker); None: every step eager.
        self.step_graph: CapturedSteps | None = None

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run the model once as a prefill and once as a decode on the null block.

        The first forward pass pays one-time set-up (kernel generation for the matmul
        shapes, the first touch of buffers; ~100 ms on the CPU), which would otherwise land
        on the first step a server runs, and every request in the burst behind it waits for
        that step. Block 0 is the null block, which no request's attention reads, so the
        keys written there are harmless; the outputs are dropped and no plugin hook of the
        step (KV connector, logits processors, sampler) runs.
        """
        n = self.block_size
        token_ids = np.zeros((1, n), dtype=np.int32)
        block_table = np.zeros((1, 1), dtype=np.int32)
        for computed, scheduled in ((0, n), (n - 1, 1)):
            inputs = build_step_inputs(
                num_scheduled=np.array([scheduled], dtype=np.int32),
                num_computed=np.array([computed], dtype=np.int32),
                num_tokens=np.array([n], dtype=np.int32), token_ids=token_ids,
                block_table=block_table, block_size=n, device=self.device)
            hidden = self.model(inputs.input_ids, inputs.positions,
                                self.builder.build(inputs.common))
            self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))

    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            batch.remove_request(req_id)
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            batch.remove_request(new.req_id)  # resumed after preemption: start afresh
            self.requests[new.req_id] = CachedRequestState.from_new_request(
                new, device=self.device)
        cached = out.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            if req_id in batch.req_id_to_index:
                batch.append_block_ids(req_id, block_ids)
                batch.set_num_computed_tokens(req_id, num_computed)
            else:
                state = self.requests[req_id]
                state.block_ids.extend(block_ids)
                state.num_computed_tokens = num_computed
        for req_id in [r for r in batch.req_ids if r not in out.num_scheduled_tokens]:
            batch.remove_request(req_id)
        for req_id in out.num_scheduled_tokens:
            if req_id not in batch.req_id_to_index:
                batch.add_request(self.requests[req_id])
        batch.commit_batch_update()

    def _inputs(self, out: SchedulerOutput) -> StepInputs:
        batch = self.input_batch
        n = batch.num_reqs
        num_scheduled = np.fromiter(
            (out.num_scheduled_tokens[r] for r in batch.req_ids), dtype=np.int32, count=n)
        return build_step_inputs(
            num_scheduled=num_scheduled, num_computed=batch.num_computed_tokens[:n],
            num_tokens=batch.num_tokens[:n], token_ids=batch.token_ids_cpu[:n],
            block_table=batch.block_table[:n], block_size=self.block_size, device=self.device,
        )

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; see the module docstring."""
        if self.faults is not None:
            self.faults.reset()
        self._update_states(out)
        connector = self.kv_connector
        try:
            if connector is not None:
                connector.start_step(out)
            output = self._run(out)
        except PluginError as exc:
            output = self._failed_step(out, exc)
        except Exception as exc:
            named = self.attribution.error(exc) if self.attribution is not None else None
            if named is None:
                raise
            named.__cause__ = exc
            output = self._failed_step(out, named)
        if connector is None:
            return output
        try:
            sending, recving = connector.finish_step(out)
        except PluginError as exc:
            return self._failed_step(out, exc, output)
        if sending or recving:
            output = replace(output, finished_sending=sending, finished_recving=recving)
        return output

    def _failed_step(self, out: SchedulerOutput, exc: PluginError,
                     output: ModelRunnerOutput | None = None) -> ModelRunnerOutput:
        """Every request of the step failed (``exc`` names the plugin); tokens discarded.

        Raises:
            PluginError: ``exc`` names no plugin (an engine bug, not a plugin's).
        """
        if exc.plugin is None:
            raise exc
        failure = PluginFailure.from_error(exc)
        failed = dict(output.failed) if output is not None else {}
        failed.update((req_id, failed.get(req_id, failure)) for req_id in out.num_scheduled_tokens)
        req_ids = tuple(self.input_batch.req_ids)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=((),) * len(req_ids),
                                 failed=failed)

    def _run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        batch = self.input_batch
        if out.total_num_scheduled_tokens == 0 or batch.num_reqs == 0:
            return _EMPTY
        inputs = self._inputs(out)
        graph = self.step_graph
        logits = None
        if graph is not None and graph.takes(inputs):
            hidden, logits = graph.run(inputs)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions,
                                self.builder.build(inputs.common))
        if logits is None:
            logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        req_ids = batch.req_ids
        if not self.tp.is_driver:  # follow rank 0's tokens; its output is the step's
            sampled_ids = torch.empty(len(req_ids), dtype=torch.int64, device=self.device)
            self._append_tokens(broadcast_from_driver(sampled_ids, self.tp), inputs)
            self._prompt_logprobs(hidden, inputs, req_ids)
            return _EMPTY
        if out.grammar_bitmask is not None:  # structured outputs: disallowed tokens -> -inf
            apply_grammar_bitmask(logits, out.grammar_bitmask, req_ids)
        sampling = batch.make_sampling_metadata(inputs.is_partial)
        sampled = self.sampler(logits, sampling)
        sampled_ids = sampled.sampled_token_ids.to(torch.int64).contiguous()
        complete, tokens = self._append_tokens(broadcast_from_driver(sampled_ids, self.tp),
                                               inputs)
        token_rows: list[tuple[int, ...]] = [()] * len(req_ids)
        failed = self.faults.by_request(req_ids) if self.faults is not None else {}
        for row in complete.tolist():
            if req_ids[row] not in failed:
                token_rows[row] = (int(tokens[row]),)
        logprobs = None
        if sampled.logprobs is not None:
            logprobs = self._sample_logprobs(sampled.logprobs, req_ids, inputs.is_partial)
        return ModelRunnerOutput(
            req_ids=tuple(req_ids), sampled_token_ids=tuple(token_rows), logprobs=logprobs,
            prompt_logprobs=self._prompt_logprobs(hidden, inputs, req_ids), failed=failed,
        )

    def _append_tokens(self, sampled_ids: torch.Tensor,
                       inputs: StepInputs) -> tuple[np.ndarray, np.ndarray]:
        """Append each complete request's token; returns (complete rows, all tokens)."""
        complete = np.flatnonzero(~inputs.is_partial)
        tokens = sampled_ids.cpu().numpy()
        self.input_batch.append_tokens(complete, tokens[complete])
        return complete, tokens

    def _sample_logprobs(self, tensors: Any, req_ids: list[str],
                         is_partial: np.ndarray) -> SampleLogprobs:
        ids, lps, ranks = (tensors.token_ids.tolist(), tensors.logprobs.tolist(),
                           tensors.ranks.tolist())
        out_ids, out_lps, out_ranks = [], [], []
        for row, req_id in enumerate(req_ids):
            k = self.requests[req_id].sampling_params.logprobs
            keep = k is not None and not is_partial[row]
            out_ids.append(tuple(ids[row][: 1 + k]) if keep else ())  # type: ignore[operator]
            out_lps.append(tuple(lps[row][: 1 + k]) if keep else ())  # type: ignore[operator]
            out_ranks.append(int(ranks[row]) if keep else 0)
        return SampleLogprobs(tuple(out_ids), tuple(out_lps), tuple(out_ranks))

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs,
                         req_ids: list[str]) -> dict[str, SampleLogprobs]:
        result: dict[str, SampleLogprobs] = {}
        for row, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            k = state.sampling_params.prompt_logprobs
            num_prompt = len(state.prompt_token_ids)
            start = int(inputs.num_computed[row])
            if k is None or start >= num_prompt - 1:
                continue
            first = int(inputs.query_start[row])
            count = int(inputs.query_start[row + 1]) - first
            # Positions start .. end-1 predict prompt tokens start+1 .. end.
            end = min(start + count, num_prompt - 1)
            rows = hidden[first: first + (end - start)]
            logits = self.model.compute_logits(rows)  # on every rank: it gathers
            if not self.tp.is_driver:
                continue
            logprobs = compute_logprobs(logits)
            targets = torch.tensor(state.prompt_token_ids[start + 1: end + 1], device=self.device)
            gathered = gather_logprobs(logprobs, k, targets)
            result[req_id] = to_sample_logprobs(gathered, [k] * (end - start))
        return result
