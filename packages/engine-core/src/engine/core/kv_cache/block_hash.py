"""Chained block hashes: the identity of a full block's content for prefix caching.

The hash of block ``i`` of a sequence covers the whole prefix up to and including that
block, by chaining::

    hash_0 = H(ROOT,   tokens[0:B],   extra_0)
    hash_1 = H(hash_0, tokens[B:2B],  extra_1)
    hash_i = H(hash_{i-1}, tokens[iB:(i+1)B], extra_i)

so two requests share block ``i`` only if every token before its end is equal. ``H`` is
SHA-256 over a fixed layout (32-byte parent digest, then each token id as 8 little-endian
bytes, then the pickled extra keys if any): stable across processes and runs, unlike
Python's salted ``hash()``. Only full blocks are hashed, once each, and each request keeps
its hashes (``block_hashes``) so they are never computed twice.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Sequence
from functools import lru_cache

from engine.core.kv_cache.block import BlockHash

#: Parent of the first block of every sequence.
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"engine.core.kv_cache/root").digest()


@lru_cache(maxsize=8)
def _token_struct(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<{num_tokens}q")


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
) -> BlockHash:
    """Hash one full block chained to its parent.

    Args:
        parent_hash: Hash of the previous block, or None for the first block of a sequence.
        token_ids: The block's token ids (exactly ``block_size`` of them).
        extra_keys: Anything else the KV depends on (e.g. a LoRA id); must pickle
            deterministically (ints, strings, tuples of them).

    Returns:
        A 32-byte SHA-256 digest.
    """
    digest = hashlib.sha256(ROOT_BLOCK_HASH if parent_hash is None else parent_hash)
    digest.update(_token_struct(len(token_ids)).pack(*token_ids))
    if extra_keys is not None:
        digest.update(pickle.dumps(extra_keys, protocol=4))
    return digest.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, num_blocks: int
) -> None:
    """Append hashes to ``block_hashes`` until it covers the first ``num_blocks`` blocks.

    Args:
        block_hashes: A request's hashes so far (hashes of its first full blocks, in order).
        token_ids: The request's tokens (at least ``num_blocks * block_size`` of them).
        block_size: Tokens per block.
        num_blocks: How many leading blocks must be hashed.
    """
    parent = block_hashes[-1] if block_hashes else None
    for index in range(len(block_hashes), num_blocks):
        start = index * block_size
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        block_hashes.append(parent)
