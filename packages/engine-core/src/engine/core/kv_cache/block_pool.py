"""``BlockPool``: every KV-cache block, its reference count, the free queue and the cache.

Block life cycle::

    free, uncached --get_new_blocks--> held (ref_cnt >= 1) --cache_full_block--> held, cached
          ^                                |                                        |
          |                           free_blocks                              free_blocks
          |                                v                                        v
          +------- evicted by get_new_blocks --------------------------- free, cached
                                                                    (touch() revives it)

A cached block keeps its content after its last holder frees it; a later request whose
prefix hashes to it takes it back with :meth:`BlockPool.touch` instead of recomputing.
Free blocks are evicted least recently freed first; free blocks without a hash hold
nothing reusable and are queued at the head, so they are reused before any cached block.

Block ids are ``1 .. num_blocks``: id 0 is the workers' null block (see the SDK's
``CommonAttentionMetadata``), where padding rows read and write, so the pool never hands it
out. The workers' KV tensors therefore hold ``num_blocks + 1`` blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.core.kv_cache.block import BlockHash, FreeBlockQueue, KVCacheBlock


class BlockPool:
    """Owns ``num_blocks`` KV-cache blocks: allocation, ref counts, LRU eviction, hashes.

    Args:
        num_blocks: Blocks in the pool (ids ``1 .. num_blocks``; 0 is the null block).
        enable_caching: Whether full blocks may be registered by hash for reuse.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(1, num_blocks + 1)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self._hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are evictable)."""
        return len(self.free_block_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held or free)."""
        return len(self._hash_to_block)

    def get_usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks (ref_cnt 1 each), evicting cached ones as needed.

        Raises:
            ValueError: fewer than ``num_blocks`` blocks are free.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} KV-cache blocks: only {self.num_free_blocks} "
                f"of {self.num_blocks} are free"
            )
        new_blocks = []
        popleft = self.free_block_queue.popleft
        for _ in range(num_blocks):
            block = popleft()
            if block.block_hash is not None:
                self._uncache(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a holder to each block (a prefix-cache hit); free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one holder of each block; blocks nobody holds join the free queue.

        Args:
            ordered_blocks: Blocks in eviction order: the first one freed is evicted first
                among cached blocks. Free a request's blocks tail first, so a shared
                prefix outlives the request's private suffix.

        Raises:
            RuntimeError: a block is freed more often than it was taken (an engine bug).
        """
        queue = self.free_block_queue
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"{block!r} freed more often than it was allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block registered under ``block_hash``, or None."""
        return self._hash_to_block.get(block_hash)

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash]
    ) -> None:
        """Register each full block under its hash (pairs of ``blocks`` and ``block_hashes``).

        A hash that already names another block keeps that block; the new block stays
        private to its request (its content is equal, so nothing is lost but sharing).
        """
        if not self.enable_caching:
            return
        hash_to_block = self._hash_to_block
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is None and block_hash not in hash_to_block:
                block.block_hash = block_hash
                hash_to_block[block_hash] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Remove ``block`` from the prefix cache (its content must not be reused)."""
        if block.block_hash is not None:
            self._uncache(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block nobody holds.

        Returns:
            True if no block was held, so the cache is now empty; False if some blocks are
            held by requests (those stay cached).
        """
        for block in self.free_block_queue:
            if block.block_hash is not None:
                self._uncache(block)
        return self.num_free_blocks == self.num_blocks

    def _uncache(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is not None and self._hash_to_block.get(block_hash) is block:
            del self._hash_to_block[block_hash]
        block.block_hash = None
