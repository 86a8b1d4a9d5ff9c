"""vLLM's allocator state and KV events, read as the model's.

`SnapshotReader.snapshot()` reads the pool (free queue walked from its head,
ref counts, the hash map `cached_block_hash_to_block._cache`, each block's
key), the block tables (`get_block_ids`) and drains `take_events()`;
`partial()` reads only what an operation touched (`PartialState`). Hashes are
named by `vllm_names.KeyTranslator`.

`EventTranslator` turns each of vLLM's KV events into the model's, every field
translated (`vllm_hashing.event_fields`); a field the installed release lacks
takes the model's value and is listed by `uncompared()`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from model.contract.observation import AllBlocksCleared, BlockKey, BlockRemoved, BlockStored, Event, Snapshot

from .base import END, NOT_FREE, PartialState, Tables, TargetCrash, closure, event_keys
from .vllm_capabilities import Capabilities
from .vllm_hashing import EventGaps, event_fields, event_gaps
from .vllm_names import KeyTranslator
from .vllm_session import VllmSession

BlockRow = tuple[int, BlockKey | None, int, int]


class EventTranslator:
    """vLLM's KV events as the model's `Event`s."""

    def __init__(self, session: VllmSession, keys: KeyTranslator) -> None:
        self.s = session
        self.keys = keys
        self._gaps: tuple[Capabilities, EventGaps] | None = None

    def drain(self) -> tuple[Event, ...]:
        """`take_events()`, translated."""
        return tuple(e for ev in self.s.manager.take_events() for e in self.translate(ev))

    def translate(self, ev: Any) -> list[Event]:
        """vLLM's KV event as the model's, every field translated (`vllm_hashing.event_fields`)."""
        kv, gaps, name = self.s.v, self.gaps, self.keys.event_prefix
        if isinstance(ev, kv["BlockStored"]):
            parent = None if ev.parent_block_hash is None else name(ev.parent_block_hash)
            hashes = tuple(name(h) for h in ev.block_hashes)
            meta = event_fields(ev, BlockStored, gaps, self.s.config, len(hashes))
            return [BlockStored(ev.group_idx, hashes, parent, tuple(ev.token_ids), ev.block_size, **meta)]
        if isinstance(ev, kv["BlockRemoved"]):
            meta = event_fields(ev, BlockRemoved, gaps, self.s.config, 1)
            return [BlockRemoved(ev.group_idx, name(h), **meta) for h in ev.block_hashes]
        if isinstance(ev, kv["AllBlocksCleared"]):
            return [AllBlocksCleared()]
        raise TargetCrash(f"unexpected KV event {type(ev).__name__}")

    @property
    def gaps(self) -> EventGaps:
        """The event fields the installed release lacks (for the session's capabilities)."""
        caps = self.s.caps
        if self._gaps is None or self._gaps[0] is not caps:
            self._gaps = (caps, event_gaps(caps.event_fields, self.s.v["BlockRemoved"]))
        return self._gaps[1]

    def uncompared(self) -> tuple[str, ...]:
        """The KV event fields no comparison sees on this release; none on vLLM 0.33.0."""
        return self.gaps.uncompared()


class SnapshotReader:
    """Full snapshots and partial states of one session's pool and tables."""

    def __init__(self, session: VllmSession, keys: KeyTranslator, events: EventTranslator) -> None:
        self.s = session
        self.keys = keys
        self.events = events

    def table_ids(self) -> list[str]:
        """The ids whose tables a snapshot reads: the session's requests."""
        return sorted(self.s.requests)

    def table(self, rid: str) -> tuple[tuple[int, ...], ...]:
        """`rid`'s per-group block table, () when it holds none."""
        if rid not in self.s.requests:
            return ()
        table = tuple(tuple(ids) for ids in self.s.manager.get_block_ids(rid))
        return table if any(table) else ()

    def snapshot(self) -> Snapshot:
        pool, key = self.s.pool, self.keys.key
        n = len(pool.blocks)
        ref = tuple(0 if b.is_null else b.ref_cnt for b in pool.blocks)
        cached: dict[BlockKey, tuple[int, ...]] = {}
        for raw, val in pool.cached_block_hash_to_block._cache.items():
            cached[key(raw)] = _holder_ids(val)
        block_hash = {b.block_id: key(b.block_hash) for b in pool.blocks if b.block_hash is not None}
        tables: dict[str, tuple[tuple[int, ...], ...]] = {}
        for rid in self.table_ids():
            per_group = self.table(rid)
            if per_group:
                tables[rid] = per_group
        snap = Snapshot(
            free_queue=_walk_free_queue(pool.free_block_queue, n),
            pinned_queue=(),
            ref_cnt=ref,
            pinned=frozenset(),
            cached=cached,
            block_hash=block_hash,
            tables=tables,
            events=self.events.drain(),
        )
        self.keys.prune()
        return snap

    def partial(
        self,
        blocks: Iterable[int],
        rids: Iterable[str],
        keys: Iterable[BlockKey],
        before: Tables | None = None,
    ) -> PartialState:
        """What an operation touched, read from those blocks and tables only (see `PartialState`)."""
        queue = self.s.pool.free_block_queue
        head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
        tables = {}
        for rid in rids:
            tables[rid] = self.table(rid)
        events = self.events.drain()
        want, want_keys = closure(tables, blocks, keys, before)
        holders: dict[BlockKey, tuple[int, ...]] = {}
        for k in event_keys(events):
            holders[k] = self._held(k)
            want.update(holders[k])
        out: dict[int, BlockRow] = {}
        for b in want:
            out[b] = row = self._block_row(b, head, tail)
            if row[1] is not None:
                want_keys.add(row[1])
        for k in want_keys:
            if k not in holders:
                holders[k] = self._held(k)
        self.keys.prune()
        first, last = head.next_free_block, tail.prev_free_block
        ends = (END, END) if first is tail or first is None else (first.block_id, last.block_id)
        return PartialState(out, holders, tables, queue.num_free_blocks, events, ends)

    def _held(self, k: BlockKey) -> tuple[int, ...]:
        """The blocks vLLM's hash map holds under `k` (none when it has no hash)."""
        h = self.keys.map_key(k)
        val = None if h is None else self.s.pool.cached_block_hash_to_block._cache.get(h)
        return () if val is None else _holder_ids(val)

    def _block_row(self, b: int, head: Any, tail: Any) -> BlockRow:
        """(ref count, key, previous and next free block) of block `b`."""
        blk = self.s.pool.blocks[b]
        key = None if blk.block_hash is None else self.keys.key(blk.block_hash)
        prev, nxt = blk.prev_free_block, blk.next_free_block
        links = (
            (NOT_FREE, NOT_FREE)
            if prev is None or nxt is None
            # `is`: a KVCacheBlock's `==` compares every field
            else (END if prev is head else prev.block_id, END if nxt is tail else nxt.block_id)
        )
        return (blk.ref_cnt, key, *links)


def _holder_ids(val: Any) -> tuple[int, ...]:
    """A hash-map entry's block ids: one block, or a dict of them."""
    return (val.block_id,) if not isinstance(val, dict) else tuple(b.block_id for b in val.values())


def _walk_free_queue(queue: Any, num_blocks: int) -> tuple[int, ...]:
    """Head to tail; a corrupted (cyclic) list ends with -1 instead of looping forever."""
    out: list[int] = []
    cur = queue.fake_free_list_head.next_free_block
    while cur is not None and cur is not queue.fake_free_list_tail:
        if len(out) > num_blocks:
            out.append(-1)
            break
        out.append(cur.block_id)
        cur = cur.next_free_block
    return tuple(out)
