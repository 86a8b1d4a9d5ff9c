"""Keeping the History up to date from what the target reported."""

from __future__ import annotations

from collections.abc import Container, Mapping

from invariants.catalogue.context import NOT_FREE, Delta, History, RequestHistory, Unwritten
from invariants.catalogue.isolation import note_isolation
from model.contract.observation import (
    AllBlocksCleared,
    BlockIds,
    BlockKey,
    BlockRemoved,
    BlockStored,
    Event,
    LoadCut,
    Observation,
    ScheduleResult,
    Snapshot,
    StepResult,
    block_key,
)
from model.contract.ops import AddRequest, EvictBlocks, Finish, Loaded, Offer, Op, Preempt, Sample
from model.contract.prefix import Tokens, lookahead_of
from model.contract.worker_table import appended, shipped_table
from model.policy.spec_decode import PLACEHOLDER, verified_drafts

Tables = Mapping[str, tuple[BlockIds, ...]]  # per request, per group, its block table


def replay_events(shadow: dict[BlockKey, int], events: tuple[Event, ...]) -> list[str]:
    """Apply KV events to an event consumer's view of the hash map; return anomalies."""
    problems: list[str] = []
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            shadow.clear()
        elif isinstance(ev, BlockStored):
            for h in ev.block_hashes:
                key = BlockKey(ev.group, h)
                shadow[key] = shadow.get(key, 0) + 1
        elif isinstance(ev, BlockRemoved):
            key = BlockKey(ev.group, ev.block_hash)
            if shadow.get(key, 0) <= 0:
                problems.append(f"BlockRemoved for {key.short()}, which no BlockStored announced")
                continue
            shadow[key] -= 1
            if not shadow[key]:
                del shadow[key]
    return problems


def update_history(
    history: History, op: Op, obs: Observation, before: Snapshot, after: Snapshot
) -> list[str]:
    """Advance the history past `op`; returns event anomalies found on the way."""
    history.tick += 1
    was_free, free_now = set(before.free_queue), set(after.free_queue)
    for b in after.free_queue:
        if b not in was_free:
            history.free_tick[b] = history.tick
    _released_copies(history, obs, free_now)
    if isinstance(op, EvictBlocks):
        history.evicted_in_place |= {b for b in op.block_ids if b in free_now}
    history.evicted_in_place &= free_now
    history.ever_cached.update(after.cached)
    problems = replay_events(history.shadow, after.events)
    note_failed_loads(history, op, before.tables)
    advance_requests(history, op, obs, after.tables)
    note_written(history, op, obs, after.tables)
    note_isolation(history, op, obs, after.events, after.tables)
    return problems


def update_history_delta(
    history: History,
    op: Op,
    obs: Observation,
    delta: Delta,
    events: tuple[Event, ...],
    tables: tuple[Tables, Tables] = ({}, {}),
) -> list[str]:
    """`update_history` from what the operation touched (the fast path; same result):
    `tables`, the tables of the requests it names before and after it."""
    history.tick += 1
    before = delta.before_blocks
    for b, state in delta.blocks.items():
        if state[2] == NOT_FREE:
            history.evicted_in_place.discard(b)
            continue
        was = before.get(b)
        if was is None or was[2] == NOT_FREE:
            history.free_tick[b] = history.tick
    if getattr(obs, "copies", ()):
        _released_copies(history, obs, {b for b, st in delta.blocks.items() if st[2] != NOT_FREE})
    if isinstance(op, EvictBlocks):
        history.evicted_in_place |= {b for b in op.block_ids if b in delta.blocks and delta.is_free(b)}
    history.ever_cached.update(k for k, v in delta.holders.items() if v)
    problems = replay_events(history.shadow, events)
    note_failed_loads(history, op, tables[0])
    advance_requests(history, op, obs, tables[1])
    note_written(history, op, obs, tables[1])
    note_isolation(history, op, obs, events, tables[1])
    return problems


def _released_copies(history: History, obs: Observation, free_now: set[int]) -> None:
    """A copy's endpoint can leave the free queue and come back within one step
    (taken as a copy's destination, released when the step's copies are taken):
    it was freed at this step even though both snapshots show it free."""
    for pair in getattr(obs, "copies", ()):
        for b in pair:
            if b in free_now:
                history.free_tick[b] = history.tick


FINISHED_KEPT = 1024
# ... and at most this many of their tokens: a finished 1M-token prompt would
# otherwise stay alive for a thousand more requests.
FINISHED_TOKENS = 1 << 20


def forget(history: History, cached: Container[BlockKey]) -> None:
    """Bound what a long run keeps, dropping no fact a check of a live request reads.

    `ever_cached` loses the keys neither in the hash map now nor naming a prefix
    of a live request: `promise_kept` asks only about the finishing request's own
    prefixes, and a request that needs a key again caches (or hits) it while it
    lives, which records it anew. `finished` keeps the last `FINISHED_KEPT`
    requests holding at most `FINISHED_TOKENS` tokens (the latest always; in
    `advance_requests`): older ones could only widen what `no_waste` accepts.
    Runs when `ever_cached` outgrows `forget_at`.
    """
    if len(history.ever_cached) <= history.forget_at:
        return
    live = [r.tokens for r in history.requests.values()]
    history.ever_cached = {k for k in history.ever_cached if k in cached or any(_names(k, t) for t in live)}
    history.forget_at = max(history.forget_at, 2 * len(history.ever_cached))


def _names(k: BlockKey, tokens: Tokens) -> bool:
    """`k` names a prefix of `tokens` (with its lookahead tokens, where it covers some)."""
    n, lookahead = len(k.tokens), lookahead_of(k.tokens)
    return len(tokens) >= n + lookahead and block_key(k.group, tokens, n, lookahead) == k


def note_failed_loads(history: History, op: Op, tables: Tables) -> None:
    """KV validity, lost: a connector's load that failed leaves garbage in the
    blocks it was writing, the ones holding the request's external tokens (past
    its hit: `model.machine.connector`): those a `Loaded` names failed (vLLM's
    `invalid_block_ids`), all of them when the whole load failed (`ok` False).
    They hold no valid KV (`History.unwritten`); a named block outside them (a
    hit block, computed by an earlier step) the load never wrote. `tables`: the
    requests' tables before the report (it may end the request). Not marked:
    KV the load's step computed on top of a failed block (vLLM's dependent
    blocks); a full-attention hit on it covers the failed block too, but an SWA
    window or a Mamba state past it is not judged."""
    if not isinstance(op, Loaded) or (op.ok and not op.invalid):
        return
    r = history.requests.get(op.rid)
    if r is None or not r.external:
        return
    load = "sync" if r.running else "async"  # an async load's request waits until promoted
    for bs, table in zip(history.block_sizes, tables.get(op.rid, ())):
        for b in table[r.hit // bs : -(-(r.hit + r.external) // bs)]:
            if b and not op.ok:
                history.unwritten[b] = Unwritten(f"{op.rid}'s failed {load} load never wrote it")
            elif b and b in op.invalid:
                history.unwritten[b] = Unwritten(f"{op.rid}'s {load} load failed on it")


def note_written(history: History, op: Op, obs: Observation, tables: Tables) -> None:
    """KV validity, regained: a step that computes tokens of an unwritten block
    writes them (counted from the block's start: a recompute resumes at its
    cut, the block's start); once every token is written it is valid again. A
    block an allocation takes fresh leaves the set too: what it holds from then
    on its new owner's step or load writes, as for every fresh block.
    `tables`: the scheduled requests' tables after the step."""
    if not history.unwritten or not isinstance(obs, (ScheduleResult, StepResult)):
        return
    results = obs.results if isinstance(obs, StepResult) else ((getattr(op, "rid", ""), obs),)
    preempted = obs.preempted if isinstance(obs, StepResult) else ()
    for rid, result in results:
        fresh = [b for ids in result.new_blocks or () for b in ids]
        if result.hit is not None and result.hit_blocks is not None:
            # An admission holds its hit blocks and fresh ones (a connector's external
            # blocks are not in `new_blocks`).
            for table, hit in zip(tables.get(rid, ()), result.hit_blocks):
                fresh += set(table) - set(hit)
        for b in fresh:
            history.unwritten.pop(b, None)
        r = history.requests.get(rid)
        if r is None or rid in preempted or result.scheduled <= 0:
            continue
        end = r.num_computed
        start = end - result.scheduled
        for bs, table in zip(history.block_sizes, tables.get(rid, ())):
            for j in range(start // bs, min(-(-end // bs), len(table))):
                u = history.unwritten.get(table[j])
                if u is None or start > j * bs + u.written:
                    continue
                u.written = max(u.written, min(end - j * bs, bs))
                if u.written >= bs:
                    del history.unwritten[table[j]]


def advance_requests(history: History, op: Op, obs: Observation, tables: Tables | None = None) -> None:
    """The per-request facts: prompt, outputs, progress, boundaries, preemption.
    `tables`: the named requests' tables after `op` (an admission's worker table
    where its observation does not name every block)."""
    after = tables or {}
    if isinstance(op, AddRequest):
        history.requests[op.rid] = RequestHistory(op.tokens())
    elif isinstance(op, Sample):
        _sampled(history.requests[op.rid], op)
    elif isinstance(op, Preempt):
        _preempted(history.requests[op.rid])
    elif isinstance(op, Offer):
        history.requests[op.rid].offered = op.num_tokens
    elif isinstance(op, Loaded) and (not op.ok or op.invalid) and op.rid in history.requests:
        for rid in obs.dropped if isinstance(obs, LoadCut) else ():
            r = history.requests[rid]
            r.drop_outputs(1 + r.accepted)  # its sample rode on the report and was skipped
        if history.failed_load_ends:
            for rid in {op.rid, *(obs.ended if isinstance(obs, LoadCut) else ())}:
                history.requests.pop(rid, None)  # ended with an error (`model.machine.connector`)
        else:
            # A failed connector load keeps nothing; one failed on some blocks, what its cut says.
            history.requests[op.rid].num_computed = obs.num_computed if isinstance(obs, LoadCut) else 0
            history.requests[op.rid].rolled_back |= not history.requests[op.rid].num_computed
        for rid, computed in obs.others if isinstance(obs, LoadCut) else ():
            if rid in history.requests:  # not ended: a sync load's failed blocks cut them too
                history.requests[rid].num_computed = computed
    elif isinstance(op, Finish):
        r = history.requests.pop(op.rid)
        history.finished[op.rid] = r
        history.finished_tokens += len(r.prompt) + len(r.outputs)
        while len(history.finished) > 1 and (
            len(history.finished) > FINISHED_KEPT or history.finished_tokens > FINISHED_TOKENS
        ):
            old = history.finished.pop(next(iter(history.finished)))
            history.finished_tokens -= len(old.prompt) + len(old.outputs)
    elif isinstance(obs, ScheduleResult):
        r = history.requests[op.rid]  # type: ignore[union-attr]
        _scheduled(r, obs, obs.copies, after.get(op.rid))  # type: ignore[union-attr]
    elif isinstance(obs, StepResult):
        for rid, result in obs.results:
            _scheduled(history.requests[rid], result, obs.copies, after.get(rid))
        for rid in obs.preempted:
            _preempted(history.requests[rid])


def _preempted(r: RequestHistory) -> None:
    """Back to waiting with nothing computed; the worker drops its table."""
    r.running, r.num_computed, r.ever_preempted, r.rolled_back = False, 0, True, False
    r.drafts, r.verifying = (), ()
    r.worker, r.state_end, r.accepted = None, 0, 0


def _sampled(r: RequestHistory, op: Sample) -> None:
    """Accepted drafts and the token appended, rejected drafts rolled back (`model.policy.spec_decode`)."""
    r.num_computed -= len(r.verifying) - op.accepted
    r.outputs.extend((*r.verifying[: op.accepted], op.token))
    r.verifying, r.drafts = (), op.drafts
    r.accepted = op.accepted


def _scheduled(
    r: RequestHistory,
    obs: ScheduleResult,
    copies: tuple[tuple[int, int], ...] = (),
    table: tuple[BlockIds, ...] | None = None,
) -> None:
    _computed(r, obs)
    r.rolled_back &= obs.scheduled <= 0
    if obs.scheduled <= 0 or obs.new_blocks is None:
        return
    # The worker's table and Mamba state position (`model.contract.worker_table`).
    if obs.hit is not None and obs.admitted:
        if obs.external == 0 and obs.hit_blocks is not None:
            r.worker = shipped_table(obs.hit_blocks, obs.new_blocks, set(copies))
        else:
            # A connector's external blocks sit between the hit and the chunk, and the
            # observation does not name them. An admission ships its whole table
            # (`get_blocks`), and nothing else in its step changes it: the table after it.
            r.worker = table
        r.read_from = (r.num_computed - obs.scheduled, 0)
    elif obs.hit is None:
        r.worker = appended(r.worker, obs.new_blocks) if r.worker is not None and not obs.admitted else None
        r.read_from = (r.state_end, r.accepted)
    else:
        return
    r.state_end, r.accepted = r.num_computed, 0


def _computed(r: RequestHistory, obs: ScheduleResult) -> None:
    num_tokens = len(r.prompt) + len(r.outputs)
    if obs.hit is not None:
        if obs.shared_prefix_boundary:
            r.boundaries.add(obs.shared_prefix_boundary)
        if obs.admitted or obs.external:
            r.offered, r.external = 0, obs.external  # the offer is consumed by the admission
        if obs.admitted:
            r.running, r.num_computed, r.hit = True, obs.hit + obs.external + obs.scheduled, obs.hit
            # Scheduled past its tokens: the admission was padded with placeholder drafts.
            r.verifying = (PLACEHOLDER,) * max(r.num_computed - num_tokens, 0)
        elif obs.external:  # an async connector load holds the hit and external tokens' blocks
            r.num_computed, r.hit = obs.hit + obs.external, obs.hit
    elif obs.scheduled:
        # The draft positions the step reached: the proposal's, then placeholders (an async
        # scheduler verifies k slots however many drafts were proposed: `model.machine.async_scheduling`).
        reach = r.num_computed + obs.scheduled - num_tokens
        slots = r.drafts + (PLACEHOLDER,) * max(reach - len(r.drafts), 0)
        r.verifying = verified_drafts(slots, r.num_computed, num_tokens, obs.scheduled)
        r.drafts = ()
        r.num_computed += obs.scheduled
        r.running = r.running or obs.admitted  # a connector's load promoted (no lookup)
