"""Structural invariants: every block is accounted for exactly once."""

from __future__ import annotations

from collections import Counter

from invariants.catalogue.context import CheckContext
from model.contract.prefix import names_head


def block_in_exactly_one_place(ctx: CheckContext) -> list[str]:
    """Every non-null block is in exactly one of: active (ref > 0), the regular
    free queue, the pinned tier; the null block 0 is never free and has ref 0.
    Guards against leaks and double frees (#40676 ref_cnt=2 pinning, #52707)."""
    s = ctx.after
    out: list[str] = []
    free, pinned = set(s.free_queue), set(s.pinned_queue)
    if 0 in free or 0 in pinned or s.ref_cnt[0] != 0:
        out.append("the null block 0 is free or referenced")
    for b in range(1, s.num_blocks):
        places = (s.ref_cnt[b] > 0) + (b in free) + (b in pinned)
        if places != 1:
            out.append(
                f"block {b}: ref {s.ref_cnt[b]}, in free queue {b in free}, in pinned tier {b in pinned}"
            )
    return out


def no_negative_ref_count(ctx: CheckContext) -> list[str]:
    """No ref count is negative (a double free; #40676 review, loophole 3)."""
    return [f"block {b}: ref count {r}" for b, r in enumerate(ctx.after.ref_cnt) if r < 0]


def free_queue_has_no_duplicates(ctx: CheckContext) -> list[str]:
    """No block is reachable twice from the free queues (a corrupted linked list)."""
    counts = Counter(ctx.after.free_queue + ctx.after.pinned_queue)
    return [f"block {b} appears {n} times in the free queues" for b, n in counts.items() if n > 1]


def ref_count_matches_tables(ctx: CheckContext) -> list[str]:
    """A block's ref count equals the number of block-table entries naming it:
    no leaked reference, and no block handed to two requests unless shared
    through a hit (#33775 / #44409 class)."""
    uses: Counter[int] = Counter()
    for groups in ctx.after.tables.values():
        for table in groups:
            uses.update(b for b in table if b)
    return [
        f"block {b}: ref count {r} but {uses.get(b, 0)} table entries"
        for b, r in enumerate(ctx.after.ref_cnt)
        if b and r != uses.get(b, 0)
    ]


def hash_map_points_at_holders(ctx: CheckContext) -> list[str]:
    """The hash map names only blocks carrying that hash: the block's primary
    key, or a shorter prefix of it inside the same block (a partial key).
    A stale entry here is a wrong hit, i.e. a corrupted output."""
    s = ctx.after
    sizes = [g.block_size for g in ctx.config.groups]
    block_hash, cached = s.block_hash, s.cached
    out: list[str] = []
    for key, blocks in cached.items():
        for b in blocks:
            primary = block_hash.get(b)
            if primary is key:  # targets hand out one key object per prefix: the usual case
                continue
            if primary is None:
                out.append(f"{key.short()} -> block {b}, which carries no hash")
            elif primary != key and not (
                primary.group == key.group
                and len(primary.tokens) - sizes[key.group] < len(key.tokens) < len(primary.tokens)
                and names_head(key.tokens, primary.tokens)
            ):
                out.append(f"{key.short()} -> block {b}, whose hash is {primary.short()}")
    for b, key in block_hash.items():
        if b not in cached.get(key, ()):
            out.append(f"block {b} carries {key.short()} but the map does not point at it")
    return out
