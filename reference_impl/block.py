"""KVCacheBlock: one physical KV-cache page and its prefix-cache metadata.

Invariants maintained by BlockPool (not by this class):
- `ref_cnt` counts the block tables (plus in-flight lookups) holding the block;
  a non-null block with ref_cnt 0 is linked into exactly one free tier;
- `block_hash` is the primary key under which the hash map holds this block
  (None = uncached); `block_hash_num_tokens` is the prefix length it covers;
- `is_pinned` (PR #40676) routes the block to the pinned tier when its last
  reference goes; it survives touch-then-release and is cleared by demotion
  and by reallocation;
- the null block (id 0) is never free, never hashed and its ref_cnt is not
  maintained.
"""

from __future__ import annotations

from .hashing import BlockHashWithGroupId


class KVCacheBlock:
    __slots__ = (
        "block_id",
        "ref_cnt",
        "_block_hash",
        "_block_hash_num_tokens",
        "prev_free_block",
        "next_free_block",
        "is_null",
        "is_pinned",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: BlockHashWithGroupId | None = None
        self._block_hash_num_tokens: int | None = None
        # Intrusive links: the free queue threads itself through the blocks.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False
        self.is_pinned = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self._block_hash_num_tokens

    def set_block_hash(self, key: BlockHashWithGroupId, num_tokens: int | None) -> None:
        assert self._block_hash is None, "a block gets a primary key only once per residency"
        self._block_hash = key
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        self._block_hash = None
        self._block_hash_num_tokens = None

    def __repr__(self) -> str:
        flags = "".join(
            f
            for f, on in (("N", self.is_null), ("P", self.is_pinned), ("H", self._block_hash is not None))
            if on
        )
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}{', ' + flags if flags else ''})"
