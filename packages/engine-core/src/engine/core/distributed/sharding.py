"""Which part of a layer each tensor-parallel rank holds (Megatron-style).

* column-parallel (qkv, gate/up, the LM head): each rank holds a contiguous slice of the
  outputs of every fused logical output; no communication;
* row-parallel (o_proj, down_proj): each rank holds a slice of the inputs (the outputs of
  the column-parallel layer before it) and the partial outputs are summed;
* attention heads: ``num_heads / tp`` query heads per rank. KV heads are split the same
  way when ``tp`` divides them; when there are fewer KV heads than ranks (``tp`` a multiple
  of them) each rank holds the one KV head its query heads use::

      4 query heads, 1 KV head, tp=2:  rank 0: q0 q1 | kv0     rank 1: q2 q3 | kv0
      8 query heads, 2 KV heads, tp=4: rank r: q(2r) q(2r+1) | kv(r // 2)

* vocabulary (embedding and LM head): ``ceil(vocab / tp)`` rows per rank, the last rank's
  padded with zero rows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slice:
    """A contiguous range ``[start, start + size)`` of a dimension."""

    start: int
    size: int


def even_slice(total: int, rank: int, size: int, what: str = "features") -> Slice:
    """Rank ``rank``'s equal share of ``total``.

    Raises:
        ValueError: ``size`` does not divide ``total``.
    """
    if total % size:
        raise ValueError(f"{total} {what} cannot be split evenly across {size} "
                         f"tensor-parallel ranks")
    share = total // size
    return Slice(rank * share, share)


def heads_divide(num_heads: int, size: int) -> bool:
    """Whether ``num_heads`` heads split evenly over, or divide, ``size`` ranks."""
    return num_heads % size == 0 or size % num_heads == 0


def head_slice(num_heads: int, rank: int, size: int) -> Slice:
    """The heads (indices, not features) rank ``rank`` holds; see the module docstring.

    Raises:
        ValueError: the heads neither split evenly nor divide ``size``.
    """
    if num_heads % size == 0:
        return even_slice(num_heads, rank, size, "heads")
    if size % num_heads == 0:
        return Slice(rank // (size // num_heads), 1)
    raise ValueError(f"{num_heads} heads can be neither split nor replicated across {size} "
                     f"tensor-parallel ranks")


def vocab_slice(vocab_size: int, rank: int, size: int) -> Slice:
    """Rank ``rank``'s rows of a vocabulary-parallel table: ``ceil(vocab / size)`` rows.

    The slice may run past ``vocab_size`` on the last ranks (padding rows, kept zero).
    """
    rows = -(-vocab_size // size)
    return Slice(rank * rows, rows)
