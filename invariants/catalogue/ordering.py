"""Eviction-order invariants: which free block is reused first."""

from __future__ import annotations

from invariants.catalogue.context import CheckContext
from model.contract.observation import StepResult
from model.contract.ops import Schedule, Step


def uncached_reused_before_cached(ctx: CheckContext) -> list[str]:
    """In the regular free queue every block without a hash precedes every
    cached block, so scratch is always reused before a cached prefix (#43447).
    Exempt: blocks whose hash `evict_blocks` dropped in place (vLLM keeps their
    queue position; `block_pool.py` `evict_blocks`)."""
    s = ctx.after
    seen_cached = None
    for b in s.free_queue:
        if b in s.block_hash:
            seen_cached = seen_cached or b
        elif seen_cached is not None and b not in ctx.history.evicted_in_place:
            return [f"uncached block {b} sits behind cached block {seen_cached} in the free queue"]
    return []


def cached_reused_lru_first(ctx: CheckContext) -> list[str]:
    """Cached free blocks are reused least-recently-freed first: along the
    queue, the step at which each cached block was freed never decreases."""
    last_tick, last_block = -1, None
    for b in ctx.after.free_queue:
        if b not in ctx.after.block_hash:
            continue
        tick = ctx.history.free_tick.get(b, 0)
        if tick < last_tick:
            return [
                f"cached block {b} (freed at step {tick}) is reused after block {last_block} (freed at step {last_tick})"
            ]
        last_tick, last_block = tick, b
    return []


def _left_pinned_tier(ctx: CheckContext) -> list[int]:
    """Pinned blocks the op moved out of the tier other than by a hit."""
    hits: set[int] = set()
    obs = ctx.obs
    for result in (r for _, r in obs.results) if isinstance(obs, StepResult) else (obs,):
        if getattr(result, "hit_blocks", None):
            hits |= {b for g in result.hit_blocks for b in g}  # type: ignore[union-attr]
    now = set(ctx.after.pinned_queue)
    return [b for b in ctx.before.pinned_queue if b not in now and b not in hits]


def pinned_reused_only_under_pressure(ctx: CheckContext) -> list[str]:
    """A pinned block is demoted only when the regular queue cannot serve the
    allocation: then every block that was in the regular queue is in use (#40676);
    in a `Step` too (a step gives back no block it took: `scratch_never_flushes_cache`)."""
    if not isinstance(ctx.op, (Schedule, Step)):
        return []
    left = _left_pinned_tier(ctx)
    if not left:
        return []
    # A copy's endpoints may be taken and released again within the step (model.contract.fine_mamba).
    copied = {b for pair in getattr(ctx.obs, "copies", ()) for b in pair}
    still_free = [b for b in ctx.before.free_queue if b in set(ctx.after.free_queue) and b not in copied]
    if still_free:
        return [f"pinned blocks {left} demoted while regular free blocks {still_free[:5]} stayed free"]
    return []


def pinned_demoted_oldest_first(ctx: CheckContext) -> list[str]:
    """Demotion takes the oldest pinned blocks first (#40676 `demote_n`), in a
    `Schedule` or a `Step`."""
    if not isinstance(ctx.op, (Schedule, Step)):
        return []
    left = set(_left_pinned_tier(ctx))
    order = [b for b in ctx.before.pinned_queue if b in left or b in set(ctx.after.pinned_queue)]
    demoted_prefix = order[: len(left)]
    if set(demoted_prefix) != left:
        return [f"demoted {sorted(left)} but the oldest pinned blocks were {demoted_prefix}"]
    return []


def pinned_blocks_are_cached(ctx: CheckContext) -> list[str]:
    """The pinned tier holds only cached blocks with the pinned flag: pinning an
    uncached block would waste the pool for a hit that can never come."""
    s = ctx.after
    return [
        f"pinned-tier block {b}: hash {b in s.block_hash}, flag {b in s.pinned}"
        for b in s.pinned_queue
        if b not in s.block_hash or b not in s.pinned
    ]
