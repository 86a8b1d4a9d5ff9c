"""The free queue, as a plain list: the order in which free blocks are reused.

Contract (vLLM `FreeKVCacheBlockQueue`, `block_pool.py` `free_blocks`):
- the head is reused first; `popleft_n(n)` takes the first n in order;
- `prepend_n(bs)` puts `bs[0]` at the head (uncached blocks: reused first,
  most recently freed first); `append_n(bs)` puts `bs[-1]` at the tail (cached
  blocks: reused last, least recently freed first);
- `remove(b)` takes b out from anywhere (a hit on a free cached block);
- a block is in the queue at most once.

The pinned tier (#40676) is a second queue of the same kind, oldest first;
`demote_n(n)` moves its n oldest blocks to the tail of the regular queue.
"""

from __future__ import annotations

from collections.abc import Iterable


class FreeQueue:
    def __init__(self, block_ids: Iterable[int] = ()) -> None:
        self.blocks: list[int] = list(block_ids)

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.blocks

    def popleft(self) -> int:
        if not self.blocks:
            raise ValueError("No free blocks available")
        return self.blocks.pop(0)

    def popleft_n(self, n: int) -> list[int]:
        if n < 0 or n > len(self.blocks):
            raise ValueError(f"popleft_n({n}) on a queue of {len(self.blocks)} blocks")
        taken, self.blocks = self.blocks[:n], self.blocks[n:]
        return taken

    def remove(self, block_id: int) -> None:
        self.blocks.remove(block_id)

    def append_n(self, block_ids: Iterable[int]) -> None:
        new = list(block_ids)
        assert set(new).isdisjoint(self.blocks), "block already in the queue"
        self.blocks.extend(new)

    def prepend_n(self, block_ids: Iterable[int]) -> None:
        new = list(block_ids)
        assert set(new).isdisjoint(self.blocks), "block already in the queue"
        self.blocks[:0] = new


def demote_n(pinned: FreeQueue, regular: FreeQueue, n: int) -> list[int]:
    """Move the n oldest pinned blocks to the regular tail; return them."""
    moved = pinned.popleft_n(min(n, len(pinned)))
    regular.append_n(moved)
    return moved
