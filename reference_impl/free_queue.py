"""FreeKVCacheBlockQueue: an O(1) intrusive doubly-linked list of free blocks.

Contract:
- the head is reused first, the tail last; `get_all_free_blocks()` lists
  head -> tail and `num_free_blocks` always equals its length;
- every operation is O(1) per block and allocates nothing: links live in the
  blocks (`prev_free_block` / `next_free_block`) between two sentinels;
- a block is linked into at most one queue at a time (the pinned tier of
  #40676 is a second instance sharing the same link fields, so membership is
  exclusive by construction); a block outside every queue has both links None.
- `append`/`append_n`/`prepend_n` do not check membership (as in vLLM): callers
  must only insert blocks that are in no queue.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .block import KVCacheBlock


class FreeKVCacheBlockQueue:
    def __init__(self, blocks: Sequence[KVCacheBlock] = ()) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        first = self.fake_free_list_head.next_free_block
        if first is None or first is self.fake_free_list_tail:
            raise ValueError("No free blocks available")
        self._unlink(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n == 0:
            return []
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks from a queue of {self.num_free_blocks}")
        out: list[KVCacheBlock] = []
        curr = self.fake_free_list_head.next_free_block
        for _ in range(n):
            assert curr is not None
            out.append(curr)
            nxt = curr.next_free_block
            curr.prev_free_block = curr.next_free_block = None
            curr = nxt
        assert curr is not None
        self.fake_free_list_head.next_free_block = curr
        curr.prev_free_block = self.fake_free_list_head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on an invalid block: {block!r}")
        self._unlink(block)

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self.append_n((block,))

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Link `blocks` at the tail in order: blocks[-1] becomes the last element."""
        if not blocks:
            return
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Link `blocks` at the head in order: blocks[0] becomes the first element."""
        if not blocks:
            return
        first = self.fake_free_list_head.next_free_block
        assert first is not None
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def iter_blocks(self) -> Iterator[KVCacheBlock]:
        curr = self.fake_free_list_head.next_free_block
        while curr is not None and curr is not self.fake_free_list_tail:
            yield curr
            curr = curr.next_free_block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self.iter_blocks())
