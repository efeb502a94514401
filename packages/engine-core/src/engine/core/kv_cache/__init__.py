"""The paged KV cache's bookkeeping: blocks, the block pool, prefix caching, the manager."""

from engine.core.kv_cache.block import BlockHash, FreeBlockQueue, KVCacheBlock
from engine.core.kv_cache.block_hash import ROOT_BLOCK_HASH, extend_block_hashes, hash_block_tokens
from engine.core.kv_cache.block_pool import BlockPool
from engine.core.kv_cache.manager import KVCacheManager, KVCacheRequest

__all__ = [
    "KVCacheManager",
    "KVCacheRequest",
    "BlockPool",
    "KVCacheBlock",
    "FreeBlockQueue",
    "BlockHash",
    "ROOT_BLOCK_HASH",
    "hash_block_tokens",
    "extend_block_hashes",
]
