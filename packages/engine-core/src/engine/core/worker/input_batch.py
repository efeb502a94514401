"""The persistent input batch: running requests in reusable slots, with numpy buffers.

Each running request owns a *slot* ``i``: row ``i`` of ``token_ids_cpu``, ``block_table``
and the per-slot sampling parameters, and row ``i`` of the logits. Slots are reused, and
buffers are written only when something changes, so building a step's inputs is
vectorised numpy over ``[:num_reqs]``.

Per step the model runner calls, in this order::

    remove_request(id)            for finished and preempted requests (slot -> hole)
    add_request(state)            for new / resumed requests (lowest free slot)
    append_block_ids(id, ids)     for running requests that got new blocks
    set_num_computed_tokens(...)
    commit_batch_update()         condense (MOVE last -> lowest hole) and tell every
                                  logits processor what changed
    make_sampling_metadata(...)   after the forward pass, before the sampler
    append_tokens(rows, ids)      sampled tokens of rows that finished their prompt

Slot changes recorded between two commits become one
:class:`~engine.sdk.logits_processor.BatchUpdate` (removed -> added -> moved). Condensing
moves the request in the highest occupied slot into the lowest hole, one-way (``MOVE``),
until slots ``0 .. num_reqs - 1`` are all occupied. Once condensed, no request may be
added or removed until the commit (the moves must be the update's last entries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.core.sample.batch_params import BatchSamplingParams, TokenBuffers
from engine.core.sample.metadata import SamplingMetadata
from engine.core.sample.sampler import make_request_generator
from engine.sdk.logits_processor import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
)
from engine.sdk.sampling_params import SamplingParams
from engine.sdk.scheduler import NewRequestData

if TYPE_CHECKING:
    from engine.core.sample.faults import LogitsFaults

__all__ = ["CachedRequestState", "InputBatch"]


@dataclass(eq=False)
class CachedRequestState:
    """A request as the worker holds it while it runs.

    Attributes:
        req_id: The request id.
        prompt_token_ids: The prompt.
        sampling_params: How to sample it.
        output_token_ids: Tokens generated so far; the batch appends to this very list,
            which is the one logits processors get as ``AddedRequest.output_token_ids``.
        block_ids: KV-cache blocks of the sequence, in order.
        num_computed_tokens: Tokens whose KV is in the cache.
        generator: The request's own random generator (seeded random requests), else None.
    """

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    generator: torch.Generator | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @classmethod
    def from_new_request(cls, data: NewRequestData, *,
                         device: torch.device | str) -> CachedRequestState:
        """Build the state of a new (or resumed) request.

        A seeded random request gets a generator seeded with ``params.seed`` and advanced
        past the tokens it generated before a preemption, so it continues as if it had
        never been preempted.

        Args:
            data: The scheduler's description of the request.
            device: The device the logits live on.

        Returns:
            The state, with a fresh output list holding ``data.output_token_ids``.
        """
        params = data.sampling_params
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = make_request_generator(params.seed, device,
                                               num_draws=len(data.output_token_ids))
        return cls(req_id=data.req_id, prompt_token_ids=tuple(data.prompt_token_ids),
                   sampling_params=params, output_token_ids=list(data.output_token_ids),
                   block_ids=list(data.block_ids),
                   num_computed_tokens=data.num_computed_tokens, generator=generator)


class InputBatch:
    """Running requests in persistent slots; see the module docstring for the protocol.

    Args:
        max_num_reqs: Slots (most requests in one step).
        max_model_len: Longest sequence (prompt + output) a slot can hold.
        max_num_blocks_per_req: Columns of ``block_table``.
        vocab_size: Columns of the logits.
        device: Where sampling tensors go.
        logits_processors: Every processor of the worker; each gets ``update_state`` on
            every commit.
        faults: Records a processor's failure instead of raising it (rank 0's worker);
            None lets exceptions propagate.

    Attributes:
        token_ids_cpu: ``[max_num_reqs, max_model_len]`` int32 prompt + output ids.
        num_tokens: ``[max_num_reqs]`` int32 prompt + output length.
        num_prompt_tokens: ``[max_num_reqs]`` int32 prompt length.
        num_computed_tokens: ``[max_num_reqs]`` int32 tokens with KV in the cache.
        block_table: ``[max_num_reqs, max_num_blocks_per_req]`` int32 block ids.
        num_blocks: ``[max_num_reqs]`` int32 valid entries per ``block_table`` row.
        sampling: Per-slot sampling parameters and feature sets.
        req_id_to_index: Slot of each request in the batch.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int,
                 vocab_size: int, device: torch.device | str,
                 logits_processors: Sequence[LogitsProcessor],
                 faults: LogitsFaults | None = None) -> None:
        self.max_num_reqs = max_num_reqs
        self.faults = faults
        self.max_model_len = max_model_len
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.logits_processors = tuple(logits_processors)

        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.sampling = BatchSamplingParams(max_num_reqs, vocab_size, self.device,
                                            self.logits_processors)
        self._tokens = TokenBuffers(self.token_ids_cpu, self.num_prompt_tokens,
                                    self.num_tokens)

        self._states: list[CachedRequestState | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self._num_slots_used = 0  # 1 + highest occupied slot
        self._removed: set[int] = set()
        self._added: dict[int, AddedRequest] = {}
        self._moved: list[MovedRequest] = []

    # -- views -----------------------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        """Requests in the batch."""
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Request ids in slot order (dense after a commit)."""
        return [s.req_id for s in self._states[: self._num_slots_used] if s is not None]

    def get_request(self, req_id: str) -> CachedRequestState:
        """The state of a request in the batch (KeyError if absent)."""
        state = self._states[self.req_id_to_index[req_id]]
        if state is None:  # pragma: no cover - req_id_to_index and _states agree
            raise KeyError(req_id)
        return state

    # -- churn -----------------------------------------------------------------------

    def add_request(self, state: CachedRequestState) -> int:
        """Place a request in the lowest free slot and write its buffers.

        Args:
            state: The request; its ``output_token_ids`` list becomes the live list.

        Returns:
            The slot.

        Raises:
            ValueError: The request is already in the batch, or does not fit in
                ``max_model_len`` / ``max_num_blocks_per_req``.
            RuntimeError: The batch is full, or it was condensed and not committed yet.
        """
        self._check_not_condensed("add_request")
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"request {state.req_id!r} is already in the batch")
        if state.num_tokens > self.max_model_len:
            raise ValueError(f"request {state.req_id!r} has {state.num_tokens} tokens; "
                             f"max_model_len is {self.max_model_len}")
        if len(state.block_ids) > self.max_num_blocks_per_req:
            raise ValueError(f"request {state.req_id!r} has {len(state.block_ids)} blocks; "
                             f"at most {self.max_num_blocks_per_req} fit")
        try:
            slot = self._states.index(None)
        except ValueError:
            raise RuntimeError(f"the batch is full ({self.max_num_reqs} requests)") from None
        self._write_slot(slot, state)
        self._added[slot] = AddedRequest(index=slot, params=state.sampling_params,
                                         prompt_token_ids=state.prompt_token_ids,
                                         output_token_ids=state.output_token_ids)
        return slot

    def _write_slot(self, slot: int, state: CachedRequestState) -> None:
        num_prompt = len(state.prompt_token_ids)
        num_tokens = state.num_tokens
        self.token_ids_cpu[slot, :num_prompt] = state.prompt_token_ids
        self.token_ids_cpu[slot, num_prompt:num_tokens] = state.output_token_ids
        self.num_prompt_tokens[slot] = num_prompt
        self.num_tokens[slot] = num_tokens
        self.num_computed_tokens[slot] = state.num_computed_tokens
        self.num_blocks[slot] = len(state.block_ids)
        self.block_table[slot, : len(state.block_ids)] = state.block_ids
        self.sampling.add(state.req_id, slot, state.sampling_params, state.generator)
        self._states[slot] = state
        self.req_id_to_index[state.req_id] = slot
        self._num_slots_used = max(self._num_slots_used, slot + 1)

    def remove_request(self, req_id: str) -> int | None:
        """Take a request out of the batch, leaving a hole in its slot.

        Returns:
            The slot it held, or None when it was not in the batch.

        Raises:
            RuntimeError: The batch was condensed and not committed yet.
        """
        self._check_not_condensed("remove_request")
        slot = self.req_id_to_index.pop(req_id, None)
        if slot is None:
            return None
        self._states[slot] = None
        self.sampling.remove(req_id)
        self._added.pop(slot, None)  # added and removed before any commit: never seen
        self._removed.add(slot)
        return slot

    def condense(self) -> None:
        """Fill holes by moving the highest occupied slots down (recorded as MOVEs)."""
        num_reqs = self.num_reqs
        holes = [i for i in range(num_reqs) if self._states[i] is None]
        last = self._num_slots_used - 1
        for hole in holes:
            while self._states[last] is None:
                last -= 1
            self._move(last, hole)
            last -= 1
        self._num_slots_used = num_reqs

    def _move(self, src: int, dst: int) -> None:
        state = self._states[src]
        if state is None:  # pragma: no cover - condense only moves occupied slots
            raise RuntimeError(f"slot {src} is empty")
        num_tokens, num_blocks = self.num_tokens[src], self.num_blocks[src]
        self.token_ids_cpu[dst, :num_tokens] = self.token_ids_cpu[src, :num_tokens]
        self.block_table[dst, :num_blocks] = self.block_table[src, :num_blocks]
        for array in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens,
                      self.num_blocks):
            array[dst] = array[src]
        self.sampling.move(src, dst)
        self._states[dst], self._states[src] = state, None
        self.req_id_to_index[state.req_id] = dst
        self._moved.append(MovedRequest(src, dst, MoveDirectionality.MOVE))

    def commit_batch_update(self) -> BatchUpdate | None:
        """Condense, then hand the changes since the last commit to every processor.

        Called once per step, after all adds and removes and before the forward pass.

        Returns:
            The update (removed -> added -> moved), or None when nothing changed; each
            logits processor's ``update_state`` got the same value.
        """
        self.condense()
        update = None
        if self._removed or self._added or self._moved:
            update = BatchUpdate(
                batch_size=self.num_reqs,
                removed=tuple(sorted(self._removed)),
                added=tuple(self._added[i] for i in sorted(self._added)),
                moved=tuple(self._moved),
            )
        self._removed, self._added, self._moved = set(), {}, []
        faults = self.faults
        for processor in self.logits_processors:
            if faults is None:
                processor.update_state(update)
            else:
                faults.update_state(processor, update)
        return update

    def _check_not_condensed(self, method: str) -> None:
        if self._moved:
            raise RuntimeError(f"{method} after condense(): call commit_batch_update() first")

    # -- per-step updates ----------------------------------------------------------------

    def append_block_ids(self, req_id: str, block_ids: Sequence[int]) -> None:
        """Append newly allocated KV blocks to a request's block table row.

        Raises:
            ValueError: The row would exceed ``max_num_blocks_per_req``.
        """
        if not block_ids:
            return
        slot = self.req_id_to_index[req_id]
        start = int(self.num_blocks[slot])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(f"request {req_id!r} would have {end} blocks; at most "
                             f"{self.max_num_blocks_per_req} fit")
        self.block_table[slot, start:end] = block_ids
        self.num_blocks[slot] = end
        self.get_request(req_id).block_ids.extend(block_ids)

    def set_num_computed_tokens(self, req_id: str, num_computed_tokens: int) -> None:
        """Record how many of a request's tokens have KV in the cache."""
        slot = self.req_id_to_index[req_id]
        self.num_computed_tokens[slot] = num_computed_tokens
        self.get_request(req_id).num_computed_tokens = num_computed_tokens

    def append_token(self, req_index: int, token_id: int) -> None:
        """Append a sampled token to the request in slot ``req_index``.

        Writes ``token_ids_cpu``, ``num_tokens`` and the live output list.

        Raises:
            ValueError: The slot is empty or full (``max_model_len``).
        """
        self.append_tokens(np.array([req_index]), np.array([token_id]))

    def append_tokens(self, req_indices: np.ndarray | Sequence[int],
                      token_ids: np.ndarray | Sequence[int]) -> None:
        """Append one sampled token to each of several slots (distinct) at once.

        Args:
            req_indices: Slots of the requests that sampled a token this step.
            token_ids: The tokens, one per slot.

        Raises:
            ValueError: A slot is empty or full (``max_model_len``).
        """
        slots = np.asarray(req_indices, dtype=np.int64)
        tokens = np.asarray(token_ids, dtype=np.int64)
        if slots.shape != tokens.shape:
            raise ValueError(f"{len(slots)} slots but {len(tokens)} tokens")
        positions = self.num_tokens[slots]
        if len(slots) and int(positions.max()) >= self.max_model_len:
            raise ValueError(f"a request reached max_model_len ({self.max_model_len})")
        output_lists = []
        for slot in slots.tolist():
            state = self._states[slot]
            if state is None:
                raise ValueError(f"append_tokens on empty slot {slot}")
            output_lists.append(state.output_token_ids)
        self.token_ids_cpu[slots, positions] = tokens
        self.num_tokens[slots] = positions + 1
        for output, token in zip(output_lists, tokens.tolist(), strict=True):
            output.append(token)

    # -- sampling ----------------------------------------------------------------------

    def make_sampling_metadata(self, is_partial: np.ndarray) -> SamplingMetadata:
        """Build the sampler's inputs for the committed batch.

        Args:
            is_partial: ``[num_reqs]`` bool, True on rows of requests whose prompt is not
                complete after this step (their token is discarded, their generator must
                not advance).

        Returns:
            The metadata. Its tensors may be views of this batch's buffers: use it before
            the batch changes again.

        Raises:
            ValueError: ``is_partial`` has the wrong length.
            RuntimeError: Changes are pending: call :meth:`commit_batch_update` first.
        """
        if self._removed or self._added or self._moved:
            raise RuntimeError("make_sampling_metadata with uncommitted batch changes: call "
                               "commit_batch_update() first")
        is_partial = np.asarray(is_partial, dtype=bool)
        if is_partial.shape != (self.num_reqs,):
            raise ValueError(f"is_partial has shape {is_partial.shape}; the batch has "
                             f"{self.num_reqs} requests")
        return self.sampling.make_metadata(self.req_id_to_index, is_partial, self._tokens)
