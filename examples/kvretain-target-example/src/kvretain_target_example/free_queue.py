"""The fork's change: the free queue as an insertion-ordered dict.

Same contract as vLLM's `FreeKVCacheBlockQueue`: the head is reused first;
`append_n` links blocks at the tail in order, `prepend_n` at the head in
order (blocks[0] becomes the first element); `popleft_n(n)` returns the
first n blocks head to tail; `remove` unlinks one block from anywhere.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any


class DictFreeQueue:
    def __init__(self, blocks: Sequence[Any] = ()) -> None:
        self._blocks: OrderedDict[int, Any] = OrderedDict((b.block_id, b) for b in blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def popleft(self) -> Any:
        if not self._blocks:
            raise ValueError("No free blocks available")
        return self._blocks.popitem(last=False)[1]

    def popleft_n(self, n: int) -> list[Any]:
        assert n <= len(self._blocks), f"cannot pop {n} of {len(self._blocks)} free blocks"
        return [self._blocks.popitem(last=False)[1] for _ in range(n)]

    def remove(self, block: Any) -> None:
        if block.block_id not in self._blocks:
            raise RuntimeError(f"remove() called on an invalid block: {block!r}")
        del self._blocks[block.block_id]

    def append(self, block: Any) -> None:
        self.append_n((block,))

    def append_n(self, blocks: Sequence[Any]) -> None:
        for block in blocks:
            self._blocks[block.block_id] = block

    def prepend_n(self, blocks: Sequence[Any]) -> None:
        # Walk backwards so that blocks[0] ends up first.
        for block in reversed(blocks):
            self._blocks[block.block_id] = block
            self._blocks.move_to_end(block.block_id, last=False)

    def iter_blocks(self) -> Iterator[Any]:
        return iter(list(self._blocks.values()))

    def get_all_free_blocks(self) -> list[Any]:
        return list(self._blocks.values())
