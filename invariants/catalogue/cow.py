"""Copy-on-write copies: a copy reads cached state and writes a block nobody else holds.

With fine-grained Mamba hits (`model.contract.fine_mamba`) a block keyed at a boundary
inside it is shared content that its reader goes on writing, so vLLM queues a
copy (source, destination) that the worker runs before the step's forward
pass, and keeps one extra reference on both endpoints until the scheduler has
taken the step's copies (`KVCacheManager.take_kv_cache_block_copies`,
`Scheduler._free_cow_retained_blocks`). A wrong copy corrupts an output
silently: a destination that was someone's block is overwritten, a source
reused in the step is read after another request wrote it, a copy whose
destination nobody reads is a lost hit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from invariants.catalogue.context import CheckContext
from model.contract.observation import BlockKey, ScheduleResult, StepResult
from model.contract.ops import Schedule
from model.machine.async_scheduling import FENCED


def _results(obs: object) -> list[ScheduleResult]:
    if isinstance(obs, ScheduleResult):
        return [obs]
    if isinstance(obs, StepResult):
        return [r for _, r in obs.results]
    return []


def _admitted(ctx: CheckContext) -> set[str]:
    obs = ctx.obs
    if isinstance(obs, ScheduleResult):
        return {ctx.op.rid} if obs.admitted and isinstance(ctx.op, Schedule) else set()
    if isinstance(obs, StepResult):
        return {rid for rid, r in obs.results if r.admitted}
    return set()


def _holders(tables: Mapping[str, tuple[tuple[int, ...], ...]], b: int) -> set[str]:
    """The requests whose tables name `b` (blocks held in fenced frees read nothing)."""
    return {rid for rid, table in tables.items() if rid != FENCED and any(b in group for group in table)}


def _entries(tables: Mapping[str, tuple[tuple[int, ...], ...]], b: int) -> int:
    """The table entries reading `b` (not the `FENCED` pseudo-table: `model.machine.async_scheduling`, 6)."""
    return sum(group.count(b) for rid, table in tables.items() if rid != FENCED for group in table)


@dataclass(frozen=True)
class _StepView:
    """What the copy rules read of the state around one step, from full
    snapshots (an audit) or from the delta (the fast path): the requests that
    held a block both before and after the step, the block-table entries that
    read it after, and a block's key before and after."""

    kept: Callable[[int], list[str]]
    uses: Callable[[int], int]
    key_before: Callable[[int], BlockKey | None]
    key_after: Callable[[int], BlockKey | None]


def _snapshot_view(ctx: CheckContext) -> _StepView:
    before, after = ctx.before.tables, ctx.after.tables
    return _StepView(
        kept=lambda b: sorted(_holders(before, b) & _holders(after, b)),
        uses=lambda b: _entries(after, b),
        key_before=ctx.before.block_hash.get,
        key_after=ctx.after.block_hash.get,
    )


def _delta_view(ctx: CheckContext) -> _StepView:
    """A step changes only the tables of the requests it names (`ctx.before` /
    `ctx.after` hold those); every other request's table reads the same blocks
    before and after, so its entries are the delta's `uses` minus the named ones.
    A copy's endpoints are touched blocks: their keys are in the delta."""
    d = ctx.delta
    assert d is not None
    before, after = ctx.before.tables, ctx.after.tables

    def fenced(
        b: int,
    ) -> int:  # references held in fenced frees read nothing (`model.machine.async_scheduling`, 6)
        return sum(g.count(b) for g in after.get(FENCED, ()))

    def kept(b: int) -> list[str]:
        named = sorted(_holders(before, b) & _holders(after, b))
        others = d.uses.get(b, 0) - _entries(after, b) - fenced(b)
        return named + (["a request the step did not name"] if others > 0 else [])

    def key(blocks: Mapping[int, tuple[int, BlockKey | None, int, int]], b: int) -> BlockKey | None:
        state = blocks.get(b)
        return None if state is None else state[1]

    return _StepView(
        kept=kept,
        uses=lambda b: d.uses.get(b, 0) - fenced(b),
        key_before=lambda b: key(d.before_blocks, b),
        key_after=lambda b: key(d.blocks, b),
    )


def copies_sound(ctx: CheckContext) -> list[str]:
    """Every copy a step queued (fine-grained Mamba hits, vLLM 0.33.0
    `_apply_cow` / `move_block_hashes`) writes a block nobody else reads and
    reads cached state. A hit that ends inside a block is copied: its last hit
    block in that group is the source, the first block the step hands the
    request there is the destination (the reader never writes the shared
    block). No request that held a destination before the step still holds
    it (but one admitted afresh in the step: a failed load's blocks were freed
    at its promotion first), and at most one block-table entry reads it after; a destination a
    table reads copies a source that carries a key (a hit on cached state);
    the source is never handed out as a new block in the same
    step (the copy would read what another request wrote); a key the source
    lost in the step moved to the destination (the key follows the state it
    names). A hit followed by a KV connector's external tokens is cut to its
    last whole scheduler block first, so it is not copied (`model.machine.connector`).
    Runs on every operation: on the fast path from the step's delta
    (the endpoints are touched blocks), in an audit from whole snapshots."""
    copies = getattr(ctx.obs, "copies", ())
    if not copies:
        return _partial_hits_copied(ctx, set())
    view = _snapshot_view(ctx) if ctx.delta is None else _delta_view(ctx)
    new: list[int] = [b for r in _results(ctx.obs) for g in r.new_blocks or () for b in g if b]
    # Admitted in the step with blocks held before it: a failed load's, freed at its promotion
    # before the fresh admission (`model.machine.connector`), so they may come back as a destination.
    readmitted = _admitted(ctx)
    out = []
    for src, dst in copies:
        name = f"copy {src} -> {dst}"
        if not src or not dst or src == dst:
            out.append(f"{name}: endpoints must be two distinct real blocks")
            continue
        kept = [rid for rid in view.kept(dst) if rid not in readmitted]
        if kept:
            out.append(f"{name}: destination is still held by {kept}, which held it before the step")
        uses = view.uses(dst)
        if uses > 1:
            out.append(f"{name}: destination read by {uses} block-table entries")
        lost, after = view.key_before(src), view.key_after(src)
        if uses and lost is None and after is None:
            out.append(f"{name}: source carries no key (the copy reads no cached state)")
        if src in new:
            out.append(
                f"{name}: source was allocated in the same step (the copy runs before its content is written)"
            )
        if new.count(dst) > 1:
            out.append(f"{name}: destination handed out {new.count(dst)} times in the step")
        if lost is not None and after is None and view.key_after(dst) != lost:
            out.append(f"{name}: source lost its key {lost.short()} but the destination does not carry it")
    return out + _partial_hits_copied(ctx, set(copies))


def _partial_hits_copied(ctx: CheckContext, copies: set[tuple[int, int]]) -> list[str]:
    out = []
    for r in _results(ctx.obs):
        if not r.admitted or not r.hit or r.hit_blocks is None or r.new_blocks is None:
            continue
        if r.external:  # a KV connector's tokens replace the hit's sub-block tail (`model.machine.connector`)
            continue
        for g, (hits, new) in enumerate(zip(r.hit_blocks, r.new_blocks)):
            if not hits or not hits[-1] or r.hit % ctx.config.groups[g].block_size == 0:
                continue
            want = (hits[-1], new[0] if new else 0)
            if want not in copies:
                out.append(
                    f"group {g}: hit {r.hit} ends inside block {hits[-1]} but no copy {want[0]} -> {want[1]}"
                )
    return out
