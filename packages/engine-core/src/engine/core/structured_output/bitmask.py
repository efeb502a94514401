"""Apply a step's grammar bitmask to the logits (in the worker, before sampling).

The mask becomes an additive bias: each byte of the bitmask indexes a ``[256, 8]`` table
of ``0`` / ``-inf`` (bit ``j`` of a byte is its ``j``-th token), so one ``index_select``
and one add replace unpacking bits and a masked fill (64 x 49,152 fp32 logits: ~2 ms
against ~24 ms for unpacking the bits, and ~7.5 ms for
``xgrammar.apply_token_bitmask_inplace``, measured on 2 Zen 4 cores). The bitmask's int32
words are little-endian, so byte ``k`` of word ``i`` holds tokens ``32 * i + 8 * k`` to
``32 * i + 8 * k + 7``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sdk.structured_output import GrammarBitmask

#: ``_BITS[b, j]``: bit ``j`` of byte ``b`` is set.
_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()
_BIAS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
#: The bias of the last step, reused (grown when a step has more rows).
_BUFFERS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _bias_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    table = _BIAS.get((dtype, device))
    if table is None:
        table = torch.zeros(256, 8, dtype=dtype)
        table[~_BITS] = float("-inf")
        table = _BIAS[(dtype, device)] = table.to(device)
    return table


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool ``[rows, vocab_size]`` view of an int32 bitmask.

    Bit ``j`` of word ``i`` is token ``32 * i + j``.
    """
    rows = bitmask.shape[0]
    return _BITS.to(bitmask.device)[_bytes(bitmask)].view(rows, -1)[:, :vocab_size]


def _bytes(bitmask: torch.Tensor) -> torch.Tensor:
    return bitmask.to(torch.int32).contiguous().view(torch.uint8).view(-1).int()


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarBitmask,
                          req_ids: Sequence[str]) -> None:
    """Set the logits of disallowed tokens to ``-inf`` in the rows of ``grammar.req_ids``.

    ``logits`` has one row per request of ``req_ids``. A row whose mask allows nothing is
    left unmasked: the grammar then refuses the sampled token and the engine fails that
    request, instead of sampling from an all ``-inf`` row.
    """
    index = {req_id: row for row, req_id in enumerate(req_ids)}
    bitmask = grammar.bitmask
    nonempty = bitmask.any(dim=1).tolist()
    pairs = [(index[req_id], i) for i, req_id in enumerate(grammar.req_ids)
             if req_id in index and nonempty[i]]
    if not pairs:
        return
    rows = [row for row, _ in pairs]
    masks = bitmask[[i for _, i in pairs]].to(logits.device)
    vocab = logits.shape[1]
    table = _bias_table(logits.dtype, logits.device)
    positions = _bytes(masks)
    # Into a kept buffer: a fresh one (12 MB at 64 x 49,152) costs more in page faults
    # than the lookup itself.
    buffer = _BUFFERS.get((logits.dtype, logits.device))
    if buffer is None or buffer.numel() < positions.numel() * 8:
        # A normal tensor (not an inference one), writable in and out of inference mode.
        with torch.inference_mode(False):
            buffer = _BUFFERS[(logits.dtype, logits.device)] = torch.empty(
                positions.numel() * 8, dtype=logits.dtype, device=logits.device)
    bias = buffer[: positions.numel() * 8].view(-1, 8)
    torch.index_select(table, 0, positions, out=bias)
    bias = bias.view(len(rows), -1)[:, :vocab]
    if rows == list(range(logits.shape[0])):
        logits.add_(bias)
    else:
        logits.index_add_(0, torch.tensor(rows, device=logits.device), bias)
