"""The state invariants, checked on what one operation touched (the fast path).

Each function here is the restriction of the catalogue invariant of the same
name to the blocks and keys in `ctx.delta`: it reports under that name, and a
violation it reports is one the full definition reports too. The converse
does not hold (an untouched block cannot be seen here, nor a new adjacency
between two untouched free blocks), which is why the harness still runs the
full definitions, unchanged, in its periodic audit.
"""

from __future__ import annotations

from invariants.catalogue.context import NOT_FREE, CheckContext, Delta
from model.contract.prefix import names_head


def _delta(ctx: CheckContext) -> Delta:
    assert ctx.delta is not None
    return ctx.delta


def block_in_exactly_one_place(ctx: CheckContext) -> list[str]:
    """Each touched block is either in use or in the free queue, never both or neither."""
    out = []
    for b, (ref, _, prev, _) in _delta(ctx).blocks.items():
        free = prev != NOT_FREE
        if (ref > 0) + free != 1:
            out.append(f"block {b}: ref {ref}, in free queue {free}, in pinned tier False")
    return out


def no_negative_ref_count(ctx: CheckContext) -> list[str]:
    """No touched block has a negative ref count."""
    return [f"block {b}: ref count {s[0]}" for b, s in _delta(ctx).blocks.items() if s[0] < 0]


def ref_count_matches_tables(ctx: CheckContext) -> list[str]:
    """A touched block's ref count equals the block-table entries naming it."""
    d = _delta(ctx)
    return [
        f"block {b}: ref count {s[0]} but {d.uses.get(b, 0)} table entries"
        for b, s in d.blocks.items()
        if s[0] != d.uses.get(b, 0)
    ]


def hash_map_points_at_holders(ctx: CheckContext) -> list[str]:
    """Touched keys name only blocks carrying them; touched blocks are named by their key."""
    d = _delta(ctx)
    bs = [g.block_size for g in ctx.config.groups]
    out = []
    key_of = d.key_of
    for key, blocks in d.holders.items():
        for b in blocks:
            primary = key_of.get(b)
            if primary is key:  # targets hand out one key object per prefix: the usual case
                continue
            if primary is None:
                out.append(f"{key.short()} -> block {b}, which carries no hash")
            elif primary != key and not (
                primary.group == key.group
                and len(primary.tokens) - bs[key.group] < len(key.tokens) < len(primary.tokens)
                and names_head(key.tokens, primary.tokens)
            ):
                out.append(f"{key.short()} -> block {b}, whose hash is {primary.short()}")
    for b, (_, carried, _, _) in d.blocks.items():
        if carried is not None and b not in d.holders.get(carried, ()):
            out.append(f"block {b} carries {carried.short()} but the map does not point at it")
    return out


def uncached_reused_before_cached(ctx: CheckContext) -> list[str]:
    """No touched free block stands in a (cached, uncached) pair of neighbours."""
    d = _delta(ctx)
    exempt = ctx.history.evicted_in_place
    for b, (_, _, prev, nxt) in d.blocks.items():
        if prev == NOT_FREE:
            continue
        for left, right in ((prev, b), (b, nxt)):
            if left > 0 and right > 0 and left in d.key_of and right not in d.key_of and right not in exempt:
                return [f"uncached block {right} sits behind cached block {left} in the free queue"]
    return []


def cached_reused_lru_first(ctx: CheckContext) -> list[str]:
    """Two adjacent cached free blocks, one touched, are in the order they were freed."""
    d = _delta(ctx)
    tick = ctx.history.free_tick
    for b, (_, _, prev, nxt) in d.blocks.items():
        if prev == NOT_FREE or b not in d.key_of:
            continue
        for left, right in ((prev, b), (b, nxt)):
            both_cached = left > 0 and right > 0 and left in d.key_of and right in d.key_of
            if both_cached and tick.get(right, 0) < tick.get(left, 0):
                return [
                    f"cached block {right} (freed at step {tick.get(right, 0)}) is reused after block "
                    f"{left} (freed at step {tick.get(left, 0)})"
                ]
    return []


def events_match_hash_map(ctx: CheckContext) -> list[str]:
    """For every touched key, the events announced exactly its holders."""
    d = _delta(ctx)
    shadow = ctx.history.shadow
    return sorted(
        f"{k.short()}: events say {shadow.get(k, 0)} holder(s), map has {len(v)}"
        for k, v in d.holders.items()
        if shadow.get(k, 0) != len(v)
    )


DELTA_CHECKS = {
    f.__name__: f
    for f in (
        block_in_exactly_one_place,
        no_negative_ref_count,
        ref_count_matches_tables,
        hash_map_points_at_holders,
        uncached_reused_before_cached,
        cached_reused_lru_first,
        events_match_hash_map,
    )
}
