"""A persistent-batch simulator: random request churn, as an engine's worker produces it.

The simulator keeps slots the way the engine does: a request owns a slot while it runs;
when requests finish or are preempted their slots are emptied, arrivals fill holes (or are
appended at the end), and the batch is condensed by moving the last requests down into the
holes, so slots ``0 .. batch_size - 1`` are occupied after every step. Now and then it
reorders the batch with swaps, resumes preempted requests (their output ids are not
empty), and gives prompts as embeddings (``prompt_token_ids`` None). Each step yields the
:class:`~engine.sdk.logits_processor.BatchUpdate` describing the change, and
:attr:`BatchSimulator.slots` is the ground truth a processor's view is checked against.

Everything is driven by one seeded ``random.Random``: the same seed gives the same run.

Example::

    sim = BatchSimulator(lambda rng: SamplingParams(), seed=0)
    for _ in range(100):
        update = sim.next_update()       # hand it to update_state
        rows = sim.slots                 # row i of the logits belongs to rows[i]
        sim.sample()                     # each request generates a token
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.sdk.logits_processor import (
    AddedRequest,
    BatchUpdate,
    MoveDirectionality,
    MovedRequest,
)
from engine.sdk.sampling_params import SamplingParams

__all__ = ["BatchSimConfig", "BatchSimulator", "SimRequest", "SimStats"]

MakeParams = Callable[[random.Random], SamplingParams]


@dataclass(frozen=True)
class BatchSimConfig:
    """Shape of the simulated workload.

    Attributes:
        max_num_reqs: Slots in the batch (the processor context's ``max_num_reqs``).
        vocab_size: Columns of the logits; generated token ids are below it.
        max_prompt_len: Prompts have 1 to this many tokens.
        max_arrivals: At most this many requests arrive per step.
        preempt_prob: Per running request and step: it is preempted (resumed later).
        swap_prob: Per step: the batch is reordered by one or more swaps.
        append_prob: Per arrival: it is appended at the end (then moved into a hole)
            instead of filling a hole directly.
        sample_prob: Per running request and step: it generates a token (otherwise it
            is, say, in the middle of a chunked prefill).
        embeds_prob: Per new request: its prompt is given as embeddings.
        ghost_prob: Per step: ``removed`` also lists an empty slot, as an engine does for
            a request added and removed between two updates (never seen by processors).
        phase_len: Every this many steps the finishing rate changes, so the batch size
            wanders between nearly empty and full.
    """

    max_num_reqs: int = 16
    vocab_size: int = 64
    max_prompt_len: int = 8
    max_arrivals: int = 4
    preempt_prob: float = 0.03
    swap_prob: float = 0.25
    append_prob: float = 0.3
    sample_prob: float = 0.9
    embeds_prob: float = 0.05
    ghost_prob: float = 0.05
    phase_len: int = 40


@dataclass(eq=False)
class SimRequest:
    """One simulated request.

    Attributes:
        req_id: ``"req-N"``, unique within a simulator.
        params: Its sampling parameters, from ``make_params``.
        prompt_token_ids: Its prompt, or None for embeddings.
        output_token_ids: The live list handed to processors in ``AddedRequest``.
        expected_output_ids: The simulator's own copy, to detect a processor writing to
            the live list.
    """

    req_id: str
    params: SamplingParams
    prompt_token_ids: tuple[int, ...] | None
    output_token_ids: list[int] = field(default_factory=list)
    expected_output_ids: list[int] = field(default_factory=list)


@dataclass
class SimStats:
    """What the churn covered (tests assert on it so a quiet run cannot pass unnoticed)."""

    num_steps: int = 0
    num_requests: int = 0
    num_added: int = 0
    num_removed: int = 0
    num_ghost_removals: int = 0
    num_reused_slots: int = 0
    num_resumed: int = 0
    num_moves: int = 0
    num_swaps: int = 0
    num_added_then_moved: int = 0
    num_unchanged_steps: int = 0
    min_batch_size: int = 1 << 30
    max_batch_size: int = 0


class BatchSimulator:
    """Produces one :class:`BatchUpdate` per step from random, engine-like churn.

    Args:
        make_params: Builds the sampling parameters of each new request.
        seed: Seeds every random choice.
        config: The workload shape.
    """

    def __init__(self, make_params: MakeParams, *, seed: int = 0,
                 config: BatchSimConfig | None = None) -> None:
        self.config = config or BatchSimConfig()
        self.rng = random.Random(seed)
        self.stats = SimStats()
        self._make_params = make_params
        self._slots: list[SimRequest] = []
        self._paused: list[SimRequest] = []
        self._finish_prob = 0.1
        #: Human-readable summary of the last update (for failure messages).
        self.last_update_summary = "none yet"

    @property
    def slots(self) -> tuple[SimRequest, ...]:
        """The requests in the batch; element ``i`` owns slot and logits row ``i``."""
        return tuple(self._slots)

    @property
    def batch_size(self) -> int:
        """Number of requests in the batch."""
        return len(self._slots)

    def next_update(self) -> BatchUpdate | None:
        """Churn the batch for a new step; returns the update, or None if nothing changed."""
        cfg, rng = self.config, self.rng
        if self.stats.num_steps % cfg.phase_len == 0:
            self._finish_prob = rng.choice((0.02, 0.05, 0.1, 0.2, 0.4, 0.7))
        self.stats.num_steps += 1
        ghosts = self._ghost_removal()
        work: list[SimRequest | None] = list(self._slots)
        removed = self._remove(work)
        added = self._add(work, removed)
        moved = self._condense_and_reorder(work, added)
        removed += ghosts
        self._slots = [req for req in work if req is not None]
        self._record(removed, added, moved)
        if not (removed or added or moved):
            self.stats.num_unchanged_steps += 1
            self.last_update_summary = "None (no change)"
            return None
        return BatchUpdate(batch_size=len(self._slots), removed=tuple(removed),
                           added=tuple(added), moved=tuple(moved))

    def sample(self) -> None:
        """Append a random token to the output of (most of) the running requests."""
        for req in self._slots:
            if self.rng.random() < self.config.sample_prob:
                token = self.rng.randrange(self.config.vocab_size)
                req.output_token_ids.append(token)
                req.expected_output_ids.append(token)

    def _remove(self, work: list[SimRequest | None]) -> list[int]:
        removed = []
        for index, req in enumerate(work):
            draw = self.rng.random()
            if req is None or draw >= self._finish_prob + self.config.preempt_prob:
                continue
            if draw >= self._finish_prob:
                self._paused.append(req)
            work[index] = None
            removed.append(index)
        self.rng.shuffle(removed)  # the contract does not promise an order
        return removed

    def _ghost_removal(self) -> list[int]:
        """A slot that was empty before the update, to list in ``removed``; or nothing."""
        first_empty = len(self._slots)  # the batch was dense before this update
        if first_empty >= self.config.max_num_reqs or \
                self.rng.random() >= self.config.ghost_prob:
            return []
        self.stats.num_ghost_removals += 1
        return [self.rng.randrange(first_empty, self.config.max_num_reqs)]

    def _add(self, work: list[SimRequest | None], removed: list[int]) -> list[AddedRequest]:
        cfg, rng = self.config, self.rng
        num_running = sum(req is not None for req in work)
        num_new = rng.randint(0, min(cfg.max_arrivals, cfg.max_num_reqs - num_running))
        if num_running + num_new == 0:
            num_new = 1  # a step always has at least one request
        holes = sorted(removed) if rng.random() < 0.5 else list(removed)
        added = []
        for _ in range(num_new):
            req = self._next_request()
            can_append = len(work) < cfg.max_num_reqs
            if holes and not (can_append and rng.random() < cfg.append_prob):
                index = holes.pop(0)
            else:
                index = len(work)
                work.append(None)
            work[index] = req
            added.append(AddedRequest(index=index, params=req.params,
                                      prompt_token_ids=req.prompt_token_ids,
                                      output_token_ids=req.output_token_ids))
        return added

    def _next_request(self) -> SimRequest:
        cfg, rng = self.config, self.rng
        if self._paused and rng.random() < 0.5:
            self.stats.num_resumed += 1
            return self._paused.pop(rng.randrange(len(self._paused)))
        prompt: tuple[int, ...] | None = None
        if rng.random() >= cfg.embeds_prob:
            length = rng.randint(1, cfg.max_prompt_len)
            prompt = tuple(rng.randrange(cfg.vocab_size) for _ in range(length))
        self.stats.num_requests += 1
        return SimRequest(f"req-{self.stats.num_requests}", self._make_params(rng), prompt)

    def _condense_and_reorder(self, work: list[SimRequest | None],
                              added: list[AddedRequest]) -> list[MovedRequest]:
        rng, moved = self.rng, []
        added_lists = {id(a.output_token_ids) for a in added}

        def relocate(src: int, dst: int, kind: MoveDirectionality) -> None:
            req = work[src]
            if req is not None and id(req.output_token_ids) in added_lists:
                self.stats.num_added_then_moved += 1
            if kind is MoveDirectionality.MOVE:
                work[dst], work[src] = req, None
            else:
                work[dst], work[src] = req, work[dst]
            moved.append(MovedRequest(src, dst, kind))

        num_swaps = 0
        while True:
            while work and work[-1] is None:
                work.pop()
            holes = [i for i, req in enumerate(work) if req is None]
            if holes and rng.random() < 0.85:
                # Condense: the last request goes into the lowest hole. A SWAP with an
                # empty slot means the same thing; engines may emit either.
                swap = rng.random() < 0.3
                kind = MoveDirectionality.SWAP if swap else MoveDirectionality.MOVE
                relocate(len(work) - 1, holes[0], kind)
            elif holes or (num_swaps < 4 and rng.random() < (
                    self.config.swap_prob if num_swaps == 0 else 0.4)):
                # Reorder; while holes remain either side may be one.
                if len(work) < 2:
                    return moved
                first, second = rng.sample(range(len(work)), 2)
                relocate(first, second, MoveDirectionality.SWAP)
                num_swaps += 1
            else:
                return moved

    def _record(self, removed: list[int], added: list[AddedRequest],
                moved: list[MovedRequest]) -> None:
        stats = self.stats
        stats.num_removed += len(removed)
        stats.num_added += len(added)
        stats.num_reused_slots += len({a.index for a in added} & set(removed))
        stats.num_moves += sum(m.directionality is MoveDirectionality.MOVE for m in moved)
        stats.num_swaps += sum(m.directionality is MoveDirectionality.SWAP for m in moved)
        stats.min_batch_size = min(stats.min_batch_size, len(self._slots))
        stats.max_batch_size = max(stats.max_batch_size, len(self._slots))
        req_ids = {id(r.output_token_ids): r.req_id for r in self._slots}
        added_text = ", ".join(f"{req_ids[id(a.output_token_ids)]}@{a.index}" for a in added)
        moved_text = ", ".join(
            f"{m.from_index}{'<->' if m.directionality is MoveDirectionality.SWAP else '->'}"
            f"{m.to_index}"
            for m in moved
        )
        self.last_update_summary = (
            f"batch_size={len(self._slots)} removed={removed} added=[{added_text}] "
            f"moved=[{moved_text}]"
        )
