"""``KVCacheManager``: which blocks each request holds, prefix-cache lookups, allocation.

Block layout of one request (``block_size`` 4) at an ``allocate_slots`` call::

    tokens:  |  0  1  2  3 |  4  5  6  7 |  8  9 10 11 | 12 13 14 15 | 16 17 .. |
    blocks:  [     b5      ][     b1     ][     b9     ][    b2      ][   b7  ..
             |<- prefix-cache hits ----->|<- computed ->|<--- new tokens --->|
             |   (new_computed_blocks)   |   earlier    |  (num_new_tokens)  |
                                                        ^ num_computed_tokens
             |<------------ full blocks: hashed and cached ----------->|  (partial: not)

``allocate_slots`` has three stages:

1. Count: ``ceil((num_computed + num_new_tokens) / block_size)`` blocks are needed; the
   request holds some and the hits bring some; the rest must come from the free queue,
   which also contains the hits that nobody holds (touching them takes them out). If the
   free queue is too short, return None and change nothing.
2. Take: touch the hits first (so eviction cannot pick them), then pop new blocks.
3. Cache: every block that is full once this step's tokens are computed is registered
   under its chained hash *now*, at allocation. The workers write all new KV of a step
   before any attention read in each layer, so a request scheduled later in the same step
   (an identical prompt, an n > 1 sibling) may already read these blocks in that pass.

The first allocation of a request is its admission: its prefix-cache lookup is counted in
the stats then (a request waiting at the head of the queue is looked up every step, but
counted once). ``get_computed_blocks`` never returns the whole sequence: at least its last
token is recomputed, because sampling needs the logits at that position.

A KV connector that loads blocks *asynchronously* fills them after the step that allocated
them, so those blocks must not be found by other requests before the load completes:
``allocate_slots(..., delay_caching=True)`` skips stage 3, and :meth:`KVCacheManager.cache_blocks`
registers them once the load is reported done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.core.kv_cache.block import BlockHash, KVCacheBlock
from engine.core.kv_cache.block_hash import extend_block_hashes
from engine.core.kv_cache.block_pool import BlockPool
from engine.sdk.stats import PrefixCacheStats


class KVCacheRequest(Protocol):
    """What the manager reads from a request (the scheduler's ``Request`` provides it)."""

    @property
    def request_id(self) -> str:
        """Unique id."""

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length."""

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is in the request's blocks."""

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt followed by the output so far."""

    @property
    def block_hashes(self) -> list[BlockHash]:
        """Hashes of the request's leading full blocks; the manager extends this list."""


class KVCacheManager:
    """Maps requests to KV-cache blocks, with prefix caching by chained block hashes.

    Args:
        block_size: Tokens per block.
        num_blocks: Blocks in the pool.
        enable_prefix_caching: Share full blocks between requests by content hash.
    """

    def __init__(self, block_size: int, num_blocks: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the cache.
        self._req_to_num_cached_blocks: dict[str, int] = {}
        self._num_queried_tokens = 0
        self._num_hit_tokens = 0
        self._was_reset = False

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (evictable cached blocks included)."""
        return self.block_pool.num_free_blocks

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request``'s tokens. Side-effect free on the cache.

        Called for a request that holds no blocks (waiting or preempted). The hit stops
        below ``num_tokens``: at most ``(num_tokens - 1) // block_size`` blocks.

        Returns:
            The cached blocks, in order, and the number of tokens they hold.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        block_hashes = request.block_hashes
        pool = self.block_pool
        hit_blocks: list[KVCacheBlock] = []
        for index in range(max_num_blocks):
            if index == len(block_hashes):
                extend_block_hashes(block_hashes, request.all_token_ids, self.block_size, index + 1)
            block = pool.get_cached_block(block_hashes[index])
            if block is None:
                break
            hit_blocks.append(block)
        return hit_blocks, len(hit_blocks) * self.block_size

    def can_allocate(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> bool:
        """Whether :meth:`allocate_slots` with the same arguments would succeed."""
        num_needed = self._num_blocks_to_allocate(request, num_new_tokens, new_computed_blocks)
        return num_needed is not None

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        *,
        delay_caching: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Give ``request`` room for ``num_new_tokens`` more tokens (see the module header).

        Args:
            request: The request; ``num_computed_tokens`` excludes ``new_computed_blocks``.
            num_new_tokens: Tokens to compute (or load through a KV connector) this step.
            new_computed_blocks: Prefix-cache hits from :meth:`get_computed_blocks`, only
                on the request's first allocation (admission).
            delay_caching: Do not register the new full blocks in the prefix cache now
                (their KV arrives later: an asynchronous connector load); call
                :meth:`cache_blocks` when it has arrived.

        Returns:
            The newly allocated blocks (hits excluded; possibly empty), or None when the
            pool is short of free blocks, in which case nothing changed.
        """
        num_needed = self._num_blocks_to_allocate(request, num_new_tokens, new_computed_blocks)
        if num_needed is None:
            return None
        request_id = request.request_id
        blocks = self._req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self._req_to_blocks[request_id] = []
            self._req_to_num_cached_blocks[request_id] = len(new_computed_blocks)
            if self.enable_prefix_caching:
                self._num_queried_tokens += request.num_tokens
                self._num_hit_tokens += len(new_computed_blocks) * self.block_size
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_needed) if num_needed else []
        blocks.extend(new_blocks)
        if self.enable_prefix_caching and not delay_caching:
            num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
            self.cache_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Register the request's blocks that are full within its first ``num_tokens`` tokens.

        Blocks registered earlier are skipped; unknown requests are ignored.
        """
        blocks = self._req_to_blocks.get(request.request_id)
        if blocks is None or not self.enable_prefix_caching:
            return
        num_full_blocks = min(num_tokens, request.num_tokens) // self.block_size
        if num_full_blocks > self._req_to_num_cached_blocks[request.request_id]:
            self._cache_full_blocks(request, blocks, num_full_blocks)

    def free(self, request: KVCacheRequest, num_valid_tokens: int | None = None) -> None:
        """Release the request's blocks, tail first (a shared prefix is evicted last).

        Args:
            request: The request; unknown requests are ignored.
            num_valid_tokens: When the step that would have written the request's newest
                blocks is cancelled (the request is preempted after it was scheduled in the
                step being built), the tokens whose KV really is in the blocks: blocks past
                them leave the prefix cache. None: every cached block is valid.
        """
        blocks = self._req_to_blocks.pop(request.request_id, None)
        self._req_to_num_cached_blocks.pop(request.request_id, None)
        if blocks is None:
            return
        if num_valid_tokens is not None:
            for block in blocks[num_valid_tokens // self.block_size :]:
                self.block_pool.uncache_block(block)
        self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> Sequence[KVCacheBlock]:
        """The blocks ``request_id`` holds, in sequence order (empty if none)."""
        return self._req_to_blocks.get(request_id, ())

    def get_block_ids(self, request_id: str) -> list[int]:
        """Ids of the blocks ``request_id`` holds, in sequence order (its block table)."""
        return [block.block_id for block in self._req_to_blocks.get(request_id, ())]

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Lookups since the previous call (counted at each request's admission).

        Local hits only: tokens a KV connector supplies are counted by the scheduler's
        connector bridge (``SchedulerStats.connector_prefix_cache``).
        """
        stats = PrefixCacheStats(
            queries=self._num_queried_tokens, hits=self._num_hit_tokens, reset=self._was_reset
        )
        self._num_queried_tokens = self._num_hit_tokens = 0
        self._was_reset = False
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block nobody holds. False if some blocks are held."""
        self._was_reset = True
        return self.block_pool.reset_prefix_cache()

    def _num_blocks_to_allocate(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
    ) -> int | None:
        """New blocks the allocation needs, or None if the free queue cannot supply them."""
        blocks = self._req_to_blocks.get(request.request_id)
        num_hits = len(new_computed_blocks)
        num_held = num_hits if blocks is None else num_hits + len(blocks)
        num_tokens = request.num_computed_tokens + num_hits * self.block_size + num_new_tokens
        num_needed = max(-(-num_tokens // self.block_size) - num_held, 0)
        if num_needed == 0 and num_hits == 0:
            return 0
        # Hits nobody holds sit in the free queue: taking them shortens it.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_needed + num_evictable_hits > self.block_pool.num_free_blocks:
            return None
        return num_needed

    def _cache_full_blocks(
        self, request: KVCacheRequest, blocks: list[KVCacheBlock], num_full_blocks: int
    ) -> None:
        num_cached = self._req_to_num_cached_blocks[request.request_id]
        block_hashes = request.block_hashes
        extend_block_hashes(block_hashes, request.all_token_ids, self.block_size, num_full_blocks)
        self.block_pool.cache_full_blocks(
            blocks[num_cached:num_full_blocks], block_hashes[num_cached:num_full_blocks]
        )
        self._req_to_num_cached_blocks[request.request_id] = num_full_blocks
