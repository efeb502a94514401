"""``BatchUpdate``: how a logits processor learns which request sits in which logits row.

The engine keeps a *persistent batch*. Every running request owns a *slot*, and row ``i``
of the logits tensor handed to ``LogitsProcessor.apply`` belongs to the request in slot
``i``. Between two steps requests finish, are preempted, or arrive; the engine then
condenses the batch so that slots ``0 .. batch_size - 1`` are exactly the occupied ones.
The :class:`BatchUpdate` it passes to ``LogitsProcessor.update_state`` lists those changes,
to be applied in this order (the order is part of the contract)::

    1. removed  every slot in ``removed`` becomes empty
    2. added    each AddedRequest is placed in slot ``index`` (often a slot just emptied)
    3. moved    each MovedRequest, in list order:
                  SWAP a<->b  slots a and b exchange contents
                  MOVE a->b   slot b takes slot a's contents (what b held is gone),
                              slot a becomes empty

Example: A B C D in slots 0-3; B and C finish, E arrives, D is moved into the hole::

    slot            0  1  2  3
    before          A  B  C  D
    1. removed      A  .  .  D    removed=(1, 2)
    2. added        A  E  .  D    added=(AddedRequest(index=1, params=E's, ...),)
    3. moved        A  E  D  .    moved=(MovedRequest(3, 2, MoveDirectionality.MOVE),)
    after           A  E  D       batch_size=3: the next logits tensor has 3 rows

:func:`process_dict_updates` applies an update to a ``slot -> state`` dict and covers
every edge case; most processors need nothing else.

.. versionadded:: 1.0
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from engine.sdk.sampling_params import SamplingParams

T = TypeVar("T")

__all__ = [
    "AddedRequest",
    "BatchUpdate",
    "MoveDirectionality",
    "MovedRequest",
    "process_dict_updates",
]


class MoveDirectionality(enum.Enum):
    """How a :class:`MovedRequest` relocates slot contents.

    Attributes:
        SWAP: Slots ``from_index`` and ``to_index`` exchange their contents (either may be
            empty as far as a processor's own state is concerned).
        MOVE: One-way: the request in ``from_index`` goes to ``to_index``, replacing whatever
            was there, and ``from_index`` becomes empty.

    .. versionadded:: 1.0
    """

    SWAP = "swap"
    MOVE = "move"


@dataclass(frozen=True)
class AddedRequest:
    """A request that entered the batch (new, or resumed after preemption).

    Attributes:
        index: The slot it was placed in. The slot is empty at that point: either it was
            never used, or its previous request is listed in ``BatchUpdate.removed``.
        params: The request's sampling parameters; processor parameters are in
            ``params.extra_args``.
        prompt_token_ids: The prompt's token ids, or None when the prompt was given as
            embeddings.
        output_token_ids: A *live* list of the tokens generated so far. The engine appends
            each sampled token to this same list object, so a processor may keep a reference
            and read it at every ``apply``; when ``apply`` runs it holds every token sampled
            for the request before the current step. It is not empty when a preempted
            request resumes. Processors must never modify it.

    .. versionadded:: 1.0
    """

    index: int
    params: SamplingParams
    prompt_token_ids: tuple[int, ...] | None
    output_token_ids: list[int]


@dataclass(frozen=True)
class MovedRequest:
    """A slot's contents relocated to another slot (condensing or reordering the batch).

    Attributes:
        from_index: The slot the request leaves.
        to_index: The slot it goes to.
        directionality: ``SWAP`` (exchange) or ``MOVE`` (one-way, ``from_index`` ends empty).

    .. versionadded:: 1.0
    """

    from_index: int
    to_index: int
    directionality: MoveDirectionality


@dataclass(frozen=True)
class BatchUpdate:
    """What changed in the persistent batch since the previous ``update_state`` call.

    Apply ``removed``, then ``added``, then ``moved`` (each in order); see the module
    docstring for a diagram. The engine guarantees:

    * every request that left the batch since the previous update (finished, aborted or
      preempted) has its slot in ``removed``, even when an added request reuses that slot
      in the same update; ``removed`` may also list a slot whose request the processor
      never saw (added and removed between two updates): removing it is a no-op;
    * an added request's ``index`` is empty once ``removed`` is applied;
    * after all three steps the occupied slots are exactly ``0 .. batch_size - 1``;
    * every index is in ``[0, max_num_reqs)`` of the processor's context.

    Attributes:
        batch_size: Number of requests in the batch once the update is applied. They
            occupy slots ``0 .. batch_size - 1``, and the logits tensor passed to the next
            ``apply`` has exactly ``batch_size`` rows, row ``i`` belonging to slot ``i``.
        removed: Slots whose request left the batch.
        added: Requests that entered the batch.
        moved: Slot relocations, applied in order after ``removed`` and ``added``.

    .. versionadded:: 1.0
    """

    batch_size: int
    removed: tuple[int, ...] = ()
    added: tuple[AddedRequest, ...] = ()
    moved: tuple[MovedRequest, ...] = ()


def process_dict_updates(
    req_state: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, tuple[int, ...] | None, list[int]], T | None],
) -> bool:
    """Apply ``batch_update`` to a ``slot -> state`` dict holding per-request state.

    ``new_state(params, prompt_token_ids, output_token_ids)`` is called once for each added
    request and returns that request's state, or None when the processor does not apply
    to the request (the slot then has no entry). Applies removed -> added -> moved and
    handles every edge case: an added request whose slot still holds a stale entry
    replaces it (or clears it when ``new_state`` returns None); a ``SWAP`` where only one
    side has an entry moves that entry; a ``MOVE`` onto a slot with an entry overwrites it,
    and a ``MOVE`` from a slot without one clears the target.

    Called: by processors, from ``update_state``.

    Args:
        req_state: The dict to update in place; values must not be None.
        batch_update: The update passed to ``update_state``; None changes nothing.
        new_state: Builds the state of an added request, or None for "no state".

    Returns:
        True when ``req_state`` changed (useful to rebuild a cached tensor only then).

    Example::

        def update_state(self, batch_update):
            process_dict_updates(
                self.slot_to_bias, batch_update,
                lambda params, prompt_ids, output_ids: (params.extra_args or {}).get("bias"),
            )

    .. versionadded:: 1.0
    """
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        if index in req_state:
            del req_state[index]
            changed = True
    for added in batch_update.added:
        state = new_state(added.params, added.prompt_token_ids, added.output_token_ids)
        if state is not None:
            req_state[added.index] = state
            changed = True
        elif added.index in req_state:
            del req_state[added.index]
            changed = True
    for move in batch_update.moved:
        src, dst = move.from_index, move.to_index
        if src == dst:
            continue
        src_state = req_state.pop(src, None)
        dst_state = req_state.pop(dst, None)
        if src_state is not None:
            req_state[dst] = src_state
        if dst_state is not None and move.directionality is MoveDirectionality.SWAP:
            req_state[src] = dst_state
        changed = changed or src_state is not None or dst_state is not None
    return changed
