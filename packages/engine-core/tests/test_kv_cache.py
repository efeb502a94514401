"""KV-cache bookkeeping: free queue, block hashes, block pool, manager."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from engine.core.kv_cache import (
    ROOT_BLOCK_HASH,
    BlockHash,
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    extend_block_hashes,
    hash_block_tokens,
)


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def ids(blocks: object) -> list[int]:
    return [b.block_id for b in blocks]  # type: ignore[attr-defined]


def assert_pool_consistent(pool: BlockPool) -> None:
    queued = list(pool.free_block_queue)
    assert len(queued) == len(pool.free_block_queue) == pool.num_free_blocks
    assert {b.block_id for b in queued} == {b.block_id for b in pool.blocks if b.ref_cnt == 0}


# -- free queue ----------------------------------------------------------------------


def test_free_queue_order_and_o1_operations() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4] and len(queue) == 5
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3] and len(queue) == 2
    queue.append(blocks[4])
    queue.appendleft(blocks[0])
    assert ids(queue) == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    assert [queue.popleft().block_id for _ in range(3)] == [1, 3, 4]
    assert len(queue) == 0 and list(queue) == []
    with pytest.raises(IndexError, match="no free KV-cache block"):
        queue.popleft()
    queue.appendleft(blocks[2])
    assert ids(queue) == [2]


# -- block hashes --------------------------------------------------------------------


def test_block_hash_layout_is_sha256_of_parent_and_packed_tokens() -> None:
    tokens = [1, 2, 3, 70000]
    expected = hashlib.sha256(ROOT_BLOCK_HASH + struct.pack("<4q", *tokens)).digest()
    assert hash_block_tokens(None, tokens) == expected
    child = hash_block_tokens(expected, [5, 6, 7, 8])
    assert child == hashlib.sha256(expected + struct.pack("<4q", 5, 6, 7, 8)).digest()


def test_block_hash_is_stable_across_processes() -> None:
    code = (
        "from engine.core.kv_cache import hash_block_tokens as h;"
        "print(h(h(None, [1, 2, 3, 4]), [5, 6, 7, 8], ('lora', 3)).hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    here = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8], ("lora", 3))
    assert out == here.hex()


def test_block_hash_chains_the_whole_prefix_and_extra_keys() -> None:
    a0 = hash_block_tokens(None, [1, 2])
    b0 = hash_block_tokens(None, [9, 2])
    assert hash_block_tokens(a0, [3, 4]) != hash_block_tokens(b0, [3, 4])
    assert hash_block_tokens(a0, [3, 4]) != hash_block_tokens(a0, [3, 4], ("lora", 1))
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5], block_size=2, num_blocks=1)
    extend_block_hashes(hashes, [1, 2, 3, 4, 5], block_size=2, num_blocks=2)
    assert hashes == [a0, hash_block_tokens(a0, [3, 4])]


# -- block pool ----------------------------------------------------------------------


def test_pool_allocates_frees_and_evicts_least_recent_first() -> None:
    pool = BlockPool(6)
    first = pool.get_new_blocks(4)
    assert ids(first) == [1, 2, 3, 4] and all(b.ref_cnt == 1 for b in first)
    assert pool.num_free_blocks == 2 and pool.get_usage() == pytest.approx(4 / 6)
    h = [hash_block_tokens(None, [i]) for i in range(3)]
    pool.cache_full_blocks(first[:3], h)
    pool.free_blocks(reversed(first))  # tail first: block 4 (uncached) goes to the head
    assert_pool_consistent(pool)
    assert ids(pool.free_block_queue) == [4, 5, 6, 3, 2, 1]
    again = pool.get_new_blocks(4)  # 4, 5, 6 then evicts 3 (the sequence's tail)
    assert ids(again) == [4, 5, 6, 3]
    assert pool.get_cached_block(h[2]) is None and again[3].block_hash is None
    assert pool.get_cached_block(h[0]) is first[0]
    with pytest.raises(ValueError, match="cannot allocate 3 KV-cache blocks: only 2 of 6"):
        pool.get_new_blocks(3)
    pool.free_blocks(again)
    assert_pool_consistent(pool)


def test_pool_touch_revives_cached_block_and_double_free_is_an_error() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [b"h" * 32])
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 3
    pool.touch([block])
    pool.touch([block])
    assert block.ref_cnt == 2 and pool.num_free_blocks == 2
    assert_pool_consistent(pool)
    pool.free_blocks([block, block])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([block])


def test_pool_keeps_first_block_for_a_duplicate_hash() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"x" * 32])
    pool.cache_full_blocks([b], [b"x" * 32])
    assert pool.get_cached_block(b"x" * 32) is a and b.block_hash is None
    pool.uncache_block(b)  # no-op: b is not cached
    assert pool.get_cached_block(b"x" * 32) is a


def test_pool_reset_prefix_cache() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"a" * 32, b"b" * 32])
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False  # b is held: it stays cached
    assert pool.get_cached_block(b"a" * 32) is None and pool.get_cached_block(b"b" * 32) is b
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True and pool.num_cached_blocks == 0


def test_pool_without_caching_registers_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a" * 32, b"b" * 32])
    assert pool.num_cached_blocks == 0


# -- manager -------------------------------------------------------------------------


def test_allocation_caches_full_blocks_at_allocation_time() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=8)
    req = FakeRequest("a", list(range(10)))
    blocks = kv.allocate_slots(req, 10)
    assert blocks is not None and ids(blocks) == [1, 2, 3]
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    assert len(req.block_hashes) == 2
    req.num_computed_tokens = 10
    req.all_token_ids += [10, 11]  # decode: token 10 is computed, then token 11
    assert kv.allocate_slots(req, 1) == []
    assert blocks[2].block_hash is None
    req.num_computed_tokens = 11
    assert kv.allocate_slots(req, 1) == []  # fills block 2: cached now
    assert blocks[2].block_hash == req.block_hashes[2]
    kv.free(req)
    assert kv.num_free_blocks == 8 and kv.get_block_ids("a") == []


def test_computed_blocks_never_cover_the_whole_sequence() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=8)
    first = FakeRequest("a", list(range(8)))
    kv.allocate_slots(first, 8)
    kv.free(first)
    same = FakeRequest("b", list(range(8)))
    hit_blocks, num_hit = kv.get_computed_blocks(same)
    assert num_hit == 4 and len(hit_blocks) == 1  # the last token is always recomputed
    longer = FakeRequest("c", list(range(9)))
    hit_blocks, num_hit = kv.get_computed_blocks(longer)
    assert num_hit == 8 and ids(hit_blocks) == ids(kv.block_pool.blocks[:2])
    other = FakeRequest("d", [99, *range(1, 9)])
    assert kv.get_computed_blocks(other) == ([], 0)


def test_hits_are_shared_and_stats_count_admissions_once() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=6)
    a = FakeRequest("a", list(range(10)))
    kv.allocate_slots(a, 10)
    b = FakeRequest("b", list(range(10)))
    for _ in range(3):  # looked up at every step while waiting
        hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    new_blocks = kv.allocate_slots(b, 2, hit_blocks)
    assert new_blocks is not None and len(new_blocks) == 1
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert [blk.ref_cnt for blk in kv.get_blocks("b")] == [2, 2, 1]
    stats = kv.make_prefix_cache_stats()
    assert (stats.queries, stats.hits, stats.reset) == (20, 8, False)
    assert kv.make_prefix_cache_stats().queries == 0
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 6 and kv.usage == 0.0


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=4)
    a = FakeRequest("a", list(range(9)))
    kv.allocate_slots(a, 9)  # 3 blocks, 2 cached
    kv.free(a)
    b = FakeRequest("b", list(range(9)) + [50] * 8)  # hits 2 evictable blocks, needs 3 more
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    free_before = ids(kv.block_pool.free_block_queue)
    assert not kv.can_allocate(b, 9, hit_blocks)
    assert kv.allocate_slots(b, 9, hit_blocks) is None
    assert ids(kv.block_pool.free_block_queue) == free_before
    assert kv.get_block_ids("b") == [] and all(blk.ref_cnt == 0 for blk in hit_blocks)
    assert kv.make_prefix_cache_stats().queries == 9  # only a's admission
    assert kv.allocate_slots(b, 8, hit_blocks) is not None  # 2 hits + 2 new = 4 blocks


def test_free_with_num_valid_tokens_uncaches_unwritten_blocks() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=4)
    a = FakeRequest("a", list(range(16)))
    a.num_computed_tokens = 0
    kv.allocate_slots(a, 12)  # blocks 0..2 cached at allocation
    assert kv.block_pool.num_cached_blocks == 3
    kv.free(a, num_valid_tokens=5)  # the step was cancelled: only 5 tokens were written
    assert kv.block_pool.num_cached_blocks == 1
    assert kv.get_computed_blocks(FakeRequest("b", list(range(16))))[1] == 4


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(block_size=2, num_blocks=4, enable_prefix_caching=False)
    a = FakeRequest("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    assert a.block_hashes == [] and kv.block_pool.num_cached_blocks == 0
    kv.free(a)
    assert kv.get_computed_blocks(FakeRequest("b", [1, 2, 3])) == ([], 0)
    assert kv.make_prefix_cache_stats().queries == 0
    assert kv.reset_prefix_cache() is True
    assert kv.make_prefix_cache_stats().reset is True


def test_manager_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        KVCacheManager(block_size=0, num_blocks=4)
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        KVCacheManager(block_size=4, num_blocks=0)
