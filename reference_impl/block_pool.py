"""BlockPool: the physical blocks, the free tiers and the prefix-cache hash map.

Invariants (the judged properties; see docs/semantics.md "Free queue and pool"):
- every non-null block is in exactly one of {active (ref_cnt > 0), regular
  free queue, pinned tier}; `get_num_free_blocks()` counts the regular queue;
- the hash map holds key -> blocks in insertion order (duplicates allowed: two
  requests that computed the same prefix keep separate blocks); a block is
  reachable under its primary key and under any secondary (partial) keys, and
  the map holds no key for a block that does not carry it;
- free routing: a block whose last reference goes is pinned -> pinned tier
  tail; unhashed (or caching off) -> regular head (`prepend_n`, given order);
  hashed -> regular tail (`append_n`, given order). Uncached blocks are thus
  always reused before cached ones, cached ones least-recently-freed first;
- pinned blocks are reused only when the regular queue cannot serve a
  request: `get_new_blocks` first demotes the shortfall (oldest first) to the
  regular tail; a reallocated block loses its keys (one BlockRemoved per key,
  primary first) and its pinned flag; only keyed blocks are pinned.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from .block import KVCacheBlock
from .free_queue import FreeKVCacheBlockQueue
from .hashing import (
    BlockHashWithGroupId,
    block_hash_for_group,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from .request import Request


class BlockHashToBlockMap:
    """key -> {block_id: block}, inner dicts in insertion order."""

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        return next(iter(blocks.values())) if blocks else None

    def contain(self, key: BlockHashWithGroupId, block_id: int) -> bool:
        blocks = self._cache.get(key)
        return blocks is not None and block_id in blocks

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        self._cache.setdefault(key, {})[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        block = blocks.pop(block_id, None)
        if not blocks:
            del self._cache[key]
        return block

    def items(self) -> Iterator[tuple[BlockHashWithGroupId, list[KVCacheBlock]]]:
        for key, blocks in self._cache.items():
            yield key, list(blocks.values())

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    free_queue_cls: type[FreeKVCacheBlockQueue] = FreeKVCacheBlockQueue

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
    ) -> None:
        assert num_gpu_blocks >= 2
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = self.free_queue_cls(self.blocks)
        # PR #40676's pinned tier, reviewed into "a second FreeKVCacheBlockQueue".
        self.pinned_block_queue = self.free_queue_cls([])
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Secondary keys per block id, insertion-ordered (vLLM uses a set).
        self.cached_block_hashes_by_block: dict[int, dict[BlockHashWithGroupId, None]] = {}
        self.kv_event_queue: list[KVCacheEvent] = []

    # ----------------------------------------------------------------- lookup
    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One block per group, or None if any group misses. Pure."""
        out: list[KVCacheBlock] = []
        for gid in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(block_hash, gid)
            )
            if block is None:
                return None
            out.append(block)
        return out

    # ---------------------------------------------------------------- caching
    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Key blocks [num_cached, num_full) of `blocks`, skipping null and masked ones.

        A masked block is never revisited: the caller advances its cached
        count past it, so it stays uncached for its lifetime.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        assert block_mask is None or len(block_mask) == num_full_blocks - num_cached_blocks
        hbs = self.hash_block_size
        stored: list[int] = []
        for idx in range(num_cached_blocks, num_full_blocks):
            blk = blocks[idx]
            if blk.is_null or (block_mask is not None and not block_mask[idx - num_cached_blocks]):
                continue
            block_hash = block_hash_for_group(request.block_hashes, hbs, block_size, idx)
            num_hash_tokens = (idx + 1) * block_size
            if blk.block_hash is not None:
                # Only legal case: a partial (prompt-tail) entry promoted to full.
                assert blk.block_hash_num_tokens is not None and blk.block_hash_num_tokens < num_hash_tokens
                self._emit_block_removed(self._remove_cached_block_hashes(blk))
            self._insert_block_hash(
                make_block_hash_with_group_id(block_hash, kv_cache_group_id), blk, num_hash_tokens
            )
            stored.append(idx)
        if self.enable_kv_cache_events:
            self._emit_block_stored(request, stored, block_size, kv_cache_group_id)

    def _emit_block_stored(self, request: Request, stored: list[int], block_size: int, group_id: int) -> None:
        """One BlockStored per contiguous run of stored blocks, chained to the block before it.

        A run's parent hash and token ids re-derive each of its hashes, which a
        single event spanning a masked gap could not (seed profile, #42258).
        """
        hbs = self.hash_block_size
        start = 0
        while start < len(stored):
            end = start + 1
            while end < len(stored) and stored[end] == stored[end - 1] + 1:
                end += 1
            lo, hi = stored[start], stored[end - 1] + 1
            hashes = tuple(
                block_hash_for_group(request.block_hashes, hbs, block_size, i) for i in range(lo, hi)
            )
            parent = block_hash_for_group(request.block_hashes, hbs, block_size, lo - 1) if lo else None
            tokens = tuple(request.all_token_ids[lo * block_size : hi * block_size])
            self.kv_event_queue.append(BlockStored(hashes, parent, tokens, block_size, group_id))
            start = end

    def cache_partial_block(
        self,
        request: Request,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> BlockHashWithGroupId | None:
        """Make `block` reachable from the hbs-aligned prefix `num_tokens` inside it.

        The key becomes the block's primary if it has none, else a secondary
        key; a primary covering fewer tokens is dropped first (promotion).
        """
        if block.is_null:
            return None
        hbs = self.hash_block_size
        assert num_tokens % hbs == 0 and block_size % hbs == 0
        k = num_tokens // hbs
        assert 0 < k <= len(request.block_hashes)
        block_hash = request.block_hashes[k - 1]
        key = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
        already_cached = block.block_hash == key or self.cached_block_hash_to_block.contain(
            key, block.block_id
        )
        if replace_existing_hashes:
            self._emit_block_removed(self._remove_cached_block_hashes(block))
            already_cached = False
        elif (
            not already_cached
            and block.block_hash is not None
            and block.block_hash_num_tokens is not None
            and block.block_hash_num_tokens < num_tokens
        ):
            self._emit_block_removed(self._remove_cached_block_hashes(block))
        self._insert_block_hash(key, block, num_tokens)
        if self.enable_kv_cache_events and not already_cached:
            parent = request.block_hashes[k - 2] if k > 1 else None
            tokens = tuple(request.all_token_ids[(k - 1) * hbs : num_tokens])
            self.kv_event_queue.append(BlockStored((block_hash,), parent, tokens, hbs, kv_cache_group_id))
        return key

    def _insert_block_hash(
        self, key: BlockHashWithGroupId, block: KVCacheBlock, num_tokens: int | None
    ) -> None:
        if block.block_hash == key or self.cached_block_hash_to_block.contain(key, block.block_id):
            return
        if block.block_hash is None:
            block.set_block_hash(key, num_tokens)
        else:
            self.cached_block_hashes_by_block.setdefault(block.block_id, {})[key] = None
        self.cached_block_hash_to_block.insert(key, block)

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        """Drop every key of `block` (primary first); return those that were in the map."""
        keys: list[BlockHashWithGroupId] = []
        if block.block_hash is not None:
            keys.append(block.block_hash)
        keys.extend(self.cached_block_hashes_by_block.pop(block.block_id, ()))
        removed = [k for k in keys if self.cached_block_hash_to_block.pop(k, block.block_id) is not None]
        block.reset_hash()
        return removed

    def _emit_block_removed(self, keys: Iterable[BlockHashWithGroupId]) -> None:
        if not self.enable_kv_cache_events:
            return
        for key in keys:
            self.kv_event_queue.append(BlockRemoved((get_block_hash(key),), get_group_id(key)))

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        removed = self._remove_cached_block_hashes(block)
        self._emit_block_removed(removed)
        return bool(removed)

    # ------------------------------------------------------------- allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop from the regular head, demoting the shortfall from the pinned tier first.

        Reused blocks lose their keys and their pin.
        """
        if num_blocks > self.get_num_available_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        shortfall = num_blocks - self.free_block_queue.num_free_blocks
        if shortfall > 0:
            self.demote_n(shortfall)
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            block.is_pinned = False
        return ret

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on hit blocks; a free one leaves whichever tier holds it."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                # The pin survives: a later release re-routes it to the pinned tier.
                (self.pinned_block_queue if block.is_pinned else self.free_block_queue).remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; route blocks reaching 0 (first = reused first)."""
        evict_first: list[KVCacheBlock] = []
        evict_last: list[KVCacheBlock] = []
        pinned: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of block {block.block_id}"
            if block.ref_cnt:
                continue
            if block.is_pinned:
                pinned.append(block)
            elif block.block_hash is None or not self.enable_caching:
                evict_first.append(block)
            else:
                evict_last.append(block)
        self.free_block_queue.prepend_n(evict_first)
        self.free_block_queue.append_n(evict_last)
        self.pinned_block_queue.append_n(pinned)

    def demote_n(self, n: int) -> int:
        """Move the `n` oldest pinned blocks (fewer if the tier is short) to the regular tail."""
        n = min(n, self.pinned_block_queue.num_free_blocks)
        demoted = self.pinned_block_queue.popleft_n(n)
        for block in demoted:
            block.is_pinned = False
        self.free_block_queue.append_n(demoted)
        return n

    # ------------------------------------------------------------ maintenance
    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the keys of the given blocks (in iteration order); ref counts stay.

        An unkeyed block cannot stay pinned: its pin is cleared, and if it was
        waiting in the pinned tier it moves to the regular head (it is now an
        uncached free block). Other queue positions are untouched.
        """
        for block_id in dict.fromkeys(block_ids):
            if not 0 <= block_id < len(self.blocks):
                raise ValueError(f"Invalid block_id {block_id} (pool has {len(self.blocks)} blocks)")
            block = self.blocks[block_id]
            self._maybe_evict_cached_block(block)
            if block.is_pinned:
                if block.ref_cnt == 0 and not block.is_null:
                    self.pinned_block_queue.remove(block)
                    self.free_block_queue.prepend_n([block])
                block.is_pinned = False

    def reset_prefix_cache(self) -> bool:
        """Forget every key if no block is in use; demote every pinned block (tier order kept)."""
        if self.get_num_available_blocks() != self.num_gpu_blocks - 1:
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        for block in self.blocks:
            block.reset_hash()
        self.demote_n(self.pinned_block_queue.num_free_blocks)
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def get_num_free_blocks(self) -> int:
        """Blocks in the regular queue (reusable without demotion)."""
        return self.free_block_queue.num_free_blocks

    def get_num_pinned_blocks(self) -> int:
        return self.pinned_block_queue.num_free_blocks

    def get_num_available_blocks(self) -> int:
        """Free blocks of both tiers (what admission may count on)."""
        return self.free_block_queue.num_free_blocks + self.pinned_block_queue.num_free_blocks

    def get_usage(self) -> float:
        total = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_available_blocks() / total if total else 0.0

    def take_events(self) -> list[KVCacheEvent]:
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
