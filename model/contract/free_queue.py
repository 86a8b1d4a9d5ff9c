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

`FreeQueue` is the definition (a list); `LinkedFreeQueue` is the same contract
in O(1) per block, which the model's pool uses at production pool sizes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Union


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


def demote_n(pinned: AnyFreeQueue, regular: AnyFreeQueue, n: int) -> list[int]:
    """Move the n oldest pinned blocks to the regular tail; return them."""
    moved = pinned.popleft_n(min(n, len(pinned)))
    regular.append_n(moved)
    return moved


_HEAD, _TAIL = -1, -2  # sentinels (block ids are >= 0)


class LinkedFreeQueue:
    """`FreeQueue`'s contract, stated the same way, with O(1) work per block
    moved: a doubly linked list over block ids, the shape of vLLM's
    `FreeKVCacheBlockQueue`. A pool of 156k blocks removes a hit block from the
    middle of the queue without a scan. `FreeQueue` stays the definition: the
    model's tests run both on random operation sequences and compare orders.
    """

    def __init__(self, block_ids: Iterable[int] = ()) -> None:
        self._next: dict[int, int] = {_HEAD: _TAIL}
        self._prev: dict[int, int] = {_TAIL: _HEAD}
        self.append_n(block_ids)

    def __len__(self) -> int:
        return len(self._next) - 1

    def __contains__(self, block_id: int) -> bool:
        return block_id >= 0 and block_id in self._next

    @property
    def blocks(self) -> list[int]:
        """Head to tail (O(n): snapshots only)."""
        out = []
        b = self._next[_HEAD]
        while b != _TAIL:
            out.append(b)
            b = self._next[b]
        return out

    def ends(self) -> tuple[int, int] | None:
        """(head, tail): the next block to be reused and the last; None when empty (O(1))."""
        if not len(self):
            return None
        return self._next[_HEAD], self._prev[_TAIL]

    def neighbours(self, block_id: int) -> tuple[int | None, int | None]:
        """The blocks before and after `block_id` (None at an end of the queue)."""
        p, n = self._prev[block_id], self._next[block_id]
        return (None if p == _HEAD else p), (None if n == _TAIL else n)

    def _unlink(self, b: int) -> None:
        p, n = self._prev.pop(b), self._next.pop(b)
        self._next[p] = n
        self._prev[n] = p

    def popleft(self) -> int:
        if not len(self):
            raise ValueError("No free blocks available")
        b = self._next[_HEAD]
        self._unlink(b)
        return b

    def popleft_n(self, n: int) -> list[int]:
        if n < 0 or n > len(self):
            raise ValueError(f"popleft_n({n}) on a queue of {len(self)} blocks")
        nxt, prv = self._next, self._prev
        out: list[int] = []
        b = nxt[_HEAD]
        for _ in range(n):  # cut the first n off as one run: one relink, not n
            out.append(b)
            del prv[b]
            b = nxt.pop(b)
        nxt[_HEAD], prv[b] = b, _HEAD
        return out

    def remove(self, block_id: int) -> None:
        if block_id not in self:
            raise ValueError(f"block {block_id} is not in the queue")
        self._unlink(block_id)

    def append_n(self, block_ids: Iterable[int]) -> None:
        self._splice(self._prev[_TAIL], block_ids)

    def prepend_n(self, block_ids: Iterable[int]) -> None:
        self._splice(_HEAD, block_ids)

    def _splice(self, at: int, block_ids: Iterable[int]) -> None:
        """Link `block_ids`, in order, right after `at`."""
        nxt, prv = self._next, self._prev
        end = nxt[at]
        for b in block_ids:
            assert b >= 0 and b not in nxt, "block already in the queue"
            nxt[at], prv[b], nxt[b] = b, at, end
            at = b
        prv[end] = at


AnyFreeQueue = Union[FreeQueue, LinkedFreeQueue]
