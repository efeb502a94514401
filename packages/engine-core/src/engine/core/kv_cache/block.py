"""KV-cache blocks and the LRU queue of free blocks.

A block holds the KV of ``block_size`` consecutive tokens of one sequence. Blocks are
shared by reference count: a full block whose content is identified by a block hash may
be held by several requests at once (a common prefix), and stays in the prefix cache after
its last holder frees it, until it is evicted to make room.

Free queue (doubly linked through the blocks themselves, so removing a block from the
middle is O(1))::

    head                                                      tail
     [b7] <-> [b2] <-> [b9] <-> ... <-> [b4] <-> [b3] <-> [b12]
     ^ evicted first                     freed most recently ^

Every block with ``ref_cnt == 0`` is in the queue, and only those. Allocation pops from
the head; a cached block that a new request hits is pulled out of the middle.
"""

from __future__ import annotations

from collections.abc import Iterator

#: A block's content identity: SHA-256 digest chaining the parent block's hash, the block's
#: token ids and optional extra keys (see ``engine.core.kv_cache.block_hash``).
BlockHash = bytes


class KVCacheBlock:
    """One block of the paged KV cache (metadata only; the tensors live in the workers).

    Attributes:
        block_id: Index of the block in the workers' KV tensors, in ``[1, num_blocks]``.
        ref_cnt: Requests currently holding the block. 0 means it is in the free queue.
        block_hash: Hash of the block's content while it is registered in the prefix
            cache, else None.
        prev_free: Previous block in the free queue (None at the head or when not queued).
        next_free: Next block in the free queue (None at the tail or when not queued).
    """

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Free blocks in eviction (LRU) order: O(1) popleft, append, appendleft and remove.

    The queue links the blocks through their ``prev_free``/``next_free`` fields instead of
    wrapping them, so :meth:`remove` needs no search. A block must be in at most one queue.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head: KVCacheBlock | None = None
        self._tail: KVCacheBlock | None = None
        self._num_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._num_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Blocks from head (next to evict) to tail."""
        block = self._head
        while block is not None:
            yield block
            block = block.next_free

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block (the least recently freed).

        Raises:
            IndexError: the queue is empty.
        """
        block = self._head
        if block is None:
            raise IndexError("no free KV-cache block left")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        """Add ``block`` at the tail (evicted last)."""
        block.prev_free = self._tail
        block.next_free = None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        self._num_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Add ``block`` at the head (evicted first)."""
        block.prev_free = None
        block.next_free = self._head
        if self._head is None:
            self._tail = block
        else:
            self._head.prev_free = block
        self._head = block
        self._num_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block``, which must be in this queue, in O(1)."""
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None:
            self._head = next_block
        else:
            prev_block.next_free = next_block
        if next_block is None:
            self._tail = prev_block
        else:
            next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self._num_blocks -= 1
