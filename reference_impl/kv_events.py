"""KV cache events, in the seeds' profile (#42258 review).

Contract: a `BlockStored` names a contiguous run of blocks that entered the
hash map in one caching call (a call storing blocks around masked gaps emits
one event per run; a call storing nothing emits none), `token_ids` are the
concatenated tokens of exactly those blocks and `parent_block_hash` is the hash
of the block just before the run (None at position 0), so every hash of the
event re-derives from its parent and tokens. One
`BlockRemoved` per key leaving the map; `AllBlocksCleared` on a reset.
Hash values are raw `BlockHash` bytes (not vLLM's int conversion).
"""

from __future__ import annotations

from dataclasses import dataclass

from .hashing import BlockHash


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    group_idx: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    group_idx: int


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
