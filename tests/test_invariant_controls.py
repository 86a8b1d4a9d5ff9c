"""Negative controls for every invariant of the catalogue.

Each invariant holds on the contexts of a real model run, and fails on the same
context with one realistic corruption (the state a known bug class leaves
behind). `test_every_invariant_has_a_control` keeps the two lists in step.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
from drive import check_contexts

from invariants.catalogue import BY_NAME, INVARIANTS, CheckContext
from invariants.catalogue.context import Unwritten
from invariants.catalogue.isolation import IsolationLedger
from invariants.harness.checker import Checker
from invariants.targets.model_target import ModelTarget
from model.contract.config import Config, GroupSpec
from model.contract.extra_keys import Identity
from model.contract.observation import BlockKey, BlockStored, ProbeResult, ScheduleResult, StepResult
from model.contract.ops import AddRequest, Finish, Loaded, Offer, Probe, Sample, Schedule, Step

FULL_SWA = (GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=6))
SYS = tuple([1, 2, 3, 1] * 5)


def run(cfg: Config, ops) -> list[CheckContext]:
    """The contexts the checks are handed on the model (each with its history as it stood):
    every invariant holds on them."""
    with check_contexts(copy_history=True) as contexts:
        chk = Checker(ModelTarget(cfg))
        for op in ops:
            assert chk.step(op) == [], op
    return contexts


def workload(eagle: bool = False, pin: bool = False):
    cfg = Config(
        groups=FULL_SWA,
        num_blocks=24,
        retention_interval=0,
        eagle=eagle,
        pin_swa_on_drop=pin,
        pin_min_drop_blocks=1,
    )
    ops = [
        AddRequest("a", SYS + (2, 2)),
        Schedule("a", 8),
        Schedule("a", 8),
        Schedule("a", 8),
        Sample("a", 3),
        Finish("a"),
        AddRequest("b", SYS + (3,)),
        Schedule("b", 64),
        Probe(SYS + (1,)),
    ]
    return cfg, ops, run(cfg, ops)


@pytest.fixture(scope="module")
def plain():
    return workload()


def holds(name: str, ctx: CheckContext) -> None:
    assert BY_NAME[name].check(ctx) == [], name


def fails(name: str, ctx: CheckContext) -> None:
    assert BY_NAME[name].check(ctx), f"{name} did not catch the corruption"


def ctx_of(contexts, op_type):
    return next(c for c in reversed(contexts) if isinstance(c.op, op_type))


def test_all_invariants_hold_on_real_runs(plain):
    for eagle in (False, True):
        for pin in (False, True):
            for ctx in workload(eagle, pin)[2]:
                for inv in INVARIANTS:
                    assert inv.check(ctx) == [], (inv.name, ctx.op)


def test_block_in_exactly_one_place(plain):
    ctx = ctx_of(plain[2], Finish)
    leaked = ctx.after.free_queue[0]
    fails(
        "block_in_exactly_one_place",
        replace(ctx, after=replace(ctx.after, free_queue=ctx.after.free_queue[1:])),
    )
    assert leaked


def test_no_negative_ref_count(plain):
    ctx = ctx_of(plain[2], Finish)
    refs = list(ctx.after.ref_cnt)
    refs[3] = -1
    fails("no_negative_ref_count", replace(ctx, after=replace(ctx.after, ref_cnt=tuple(refs))))


def test_free_queue_has_no_duplicates(plain):
    ctx = ctx_of(plain[2], Finish)
    q = ctx.after.free_queue
    fails("free_queue_has_no_duplicates", replace(ctx, after=replace(ctx.after, free_queue=q + q[:1])))


def test_ref_count_matches_tables(plain):
    ctx = ctx_of(plain[2], Schedule)
    refs = list(ctx.after.ref_cnt)
    b = ctx.after.tables["b"][0][0]
    refs[b] += 1  # a reference nobody's table holds: a leak
    fails("ref_count_matches_tables", replace(ctx, after=replace(ctx.after, ref_cnt=tuple(refs))))


def test_hash_map_points_at_holders(plain):
    ctx = ctx_of(plain[2], Finish)
    cached = dict(ctx.after.cached)
    key = next(iter(cached))
    other = next(b for b in range(1, 24) if b not in cached[key] and b in ctx.after.block_hash)
    cached[key] = cached[key] + (other,)  # a reused block whose old hash was not evicted
    fails("hash_map_points_at_holders", replace(ctx, after=replace(ctx.after, cached=cached)))


def test_uncached_reused_before_cached(plain):
    ctx = ctx_of(plain[2], Finish)
    q = list(ctx.after.free_queue)
    uncached = next(b for b in q if b not in ctx.after.block_hash)
    q.remove(uncached)
    q.append(uncached)  # pre-#43447: freed scratch appended behind cached prefixes
    fails("uncached_reused_before_cached", replace(ctx, after=replace(ctx.after, free_queue=tuple(q))))


def test_cached_reused_lru_first(plain):
    ctx = ctx_of(plain[2], Finish)
    cached = [b for b in ctx.after.free_queue if b in ctx.after.block_hash]
    hist = copy.deepcopy(ctx.history)
    hist.free_tick[cached[0]] = hist.tick + 5
    fails("cached_reused_lru_first", replace(ctx, history=hist))


def _pinned_ctx():
    cfg, ops, contexts = workload(pin=True)
    ctx = ctx_of(contexts, Schedule)
    return ctx


def test_pinned_reused_only_under_pressure():
    ctx = _pinned_ctx()
    before, after = ctx.before, ctx.after
    active = next(b for b in range(1, 24) if after.ref_cnt[b] > 0)
    free = after.free_queue[0]
    b4 = replace(
        before,
        pinned_queue=(active,),
        free_queue=(free,) + tuple(b for b in before.free_queue if b not in (free, active)),
    )
    fails("pinned_reused_only_under_pressure", replace(ctx, before=b4, obs=ScheduleResult(1, False)))


def test_pinned_demoted_oldest_first():
    ctx = _pinned_ctx()
    after = ctx.after
    active = next(b for b in range(1, 24) if after.ref_cnt[b] > 0)
    oldest = after.free_queue[-1]
    b4 = replace(ctx.before, pinned_queue=(oldest, active))
    a2 = replace(after, pinned_queue=(oldest,), free_queue=after.free_queue[:-1])
    fails("pinned_demoted_oldest_first", replace(ctx, before=b4, after=a2, obs=ScheduleResult(1, False)))


def test_pinned_blocks_are_cached(plain):
    ctx = ctx_of(plain[2], Finish)
    uncached = next(b for b in ctx.after.free_queue if b not in ctx.after.block_hash)
    a2 = replace(
        ctx.after,
        free_queue=tuple(b for b in ctx.after.free_queue if b != uncached),
        pinned_queue=(uncached,),
        pinned=frozenset({uncached}),
    )
    fails("pinned_blocks_are_cached", replace(ctx, after=a2))


def test_no_waste(plain):
    ctx = ctx_of(plain[2], Schedule)  # b's admission under retention 0
    key = BlockKey(1, (SYS + (3,))[:4])  # SWA block 0: far below every retained boundary
    assert key not in ctx.after.cached
    a2 = replace(ctx.after, cached={**ctx.after.cached, key: (5,)})
    fails("no_waste", replace(ctx, after=a2))


def test_hit_backed_by_cache(plain):
    ctx = ctx_of(plain[2], Probe)
    obs = ctx.obs
    assert isinstance(obs, ProbeResult)
    fails("hit_backed_by_cache", replace(ctx, obs=replace(obs, hit=obs.hit + 4)))


def test_hit_blocks_hold_their_prefix(plain):
    ctx = ctx_of(plain[2], Probe)
    obs = ctx.obs
    assert isinstance(obs, ProbeResult) and obs.hit > 0
    wrong = tuple(tuple(23 if b else 0 for b in g) for g in obs.hit_blocks)
    fails("hit_blocks_hold_their_prefix", replace(ctx, obs=replace(obs, hit_blocks=wrong)))


def _drop_keys(ctx: CheckContext, pred) -> CheckContext:
    hist = copy.deepcopy(ctx.history)
    hist.ever_cached = {k for k in hist.ever_cached if not pred(k)}
    return replace(
        ctx,
        history=hist,
        after=replace(ctx.after, cached={k: v for k, v in ctx.after.cached.items() if not pred(k)}),
    )


def test_promise_kept(plain):
    ctx = ctx_of(plain[2], Finish)
    holds("promise_kept", ctx)
    # retention 0 dropped the replay tail (#43447 "interval 0 gives no hits")
    fails("promise_kept", _drop_keys(ctx, lambda k: k.group == 1))


def test_eagle_extra_block_kept():
    ctx = ctx_of(workload(eagle=True)[2], Finish)
    holds("eagle_extra_block_kept", ctx)
    swa = sorted((k for k in ctx.history.ever_cached if k.group == 1), key=lambda k: len(k.tokens))
    peek = swa[-1]
    fails("eagle_extra_block_kept", _drop_keys(ctx, lambda k: k == peek))


def test_scratch_never_flushes_cache(plain):
    ctx = ctx_of(plain[2], Schedule)
    b4, after = ctx.before, ctx.after
    cached_free = next(b for b in b4.free_queue if b in b4.block_hash)
    uncached_free = next(b for b in after.free_queue if b not in after.block_hash)
    b4 = replace(
        b4, free_queue=(uncached_free, cached_free), block_hash={cached_free: b4.block_hash[cached_free]}
    )
    refs = list(after.ref_cnt)
    refs[cached_free] = 1
    a2 = replace(
        after, ref_cnt=tuple(refs), block_hash={k: v for k, v in after.block_hash.items() if k != cached_free}
    )
    fails("scratch_never_flushes_cache", replace(ctx, before=b4, after=a2))
    # The uncached block served the step after all: a copy-on-write destination
    # that came back holding the moved keys (a Mamba state copied mid-block).
    key = next(iter(after.block_hash.values()))
    moved = replace(a2, block_hash={**a2.block_hash, uncached_free: key})
    holds("scratch_never_flushes_cache", replace(ctx, before=b4, after=moved))
    copied = replace(ctx.obs, copies=((cached_free, uncached_free),))
    holds("scratch_never_flushes_cache", replace(ctx, before=b4, after=a2, obs=copied))


def test_events_match_hash_map(plain):
    ctx = ctx_of(plain[2], Finish)
    hist = copy.deepcopy(ctx.history)
    hist.shadow.pop(next(iter(hist.shadow)))  # a BlockStored that was never emitted
    fails("events_match_hash_map", replace(ctx, history=hist))


def test_stored_tokens_match_hashes(plain):
    ctx = ctx_of(plain[2], Finish)
    # vLLM 0.33.0's shape under a mask: one stored hash, the whole token range
    ev = BlockStored(1, (SYS[:16],), SYS[:8], SYS[8:16], 4)
    fails("stored_tokens_match_hashes", replace(ctx, after=replace(ctx.after, events=(ev,))))


def test_fitting_request_admitted(plain):
    ctx = ctx_of(plain[2], Schedule)
    idle = replace(ctx.before, ref_cnt=tuple(0 for _ in ctx.before.ref_cnt))
    refused = ScheduleResult(0, False, 0, 0, ((), ()), None)
    fails("fitting_request_admitted", replace(ctx, before=idle, obs=refused))


CONNECTOR = Config(groups=(GroupSpec("full", 4),), num_blocks=16, kv_connector=True)
P13 = tuple(range(1, 14))


def test_admission_keeps_watermark():
    """ra runs; r0 is admitted beside it and the step leaves 1 free block. Held with
    watermark 0 and with a one-block watermark; planted: a two-block watermark (the pool
    left below it, as vLLM's undercounted Mamba state leaves it) fails; the same breach
    with nobody running before the admission (ra's entry gone, queues unobserved) is not
    judged (the watermark did not bind it)."""
    cfg = Config(groups=(GroupSpec("full", 4),), num_blocks=8)
    ops = [AddRequest("ra", (7, 7, 7)), Schedule("ra", 64), Sample("ra", 7)]
    contexts = run(cfg, ops + [AddRequest("r0", tuple(range(1, 18))), Step(("ra", "r0"), 64)])
    step = ctx_of(contexts, Step)
    assert [rid for rid, res in step.obs.results if res.admitted] == ["r0"]
    assert len(step.after.free_queue) == 1
    holds("admission_keeps_watermark", step)
    holds("admission_keeps_watermark", replace(step, config=cfg.with_(watermark=0.125)))
    planted = replace(step, config=cfg.with_(watermark=0.25))
    fails("admission_keeps_watermark", planted)
    alone = replace(step.obs, results=step.obs.results[1:], queues=None)
    holds("admission_keeps_watermark", replace(planted, obs=alone))


def test_hit_serves_written_kv():
    """r0's sync load fails on block 2 (index 1: tokens 4..7); r1 hits it in the step
    that recomputes it (r0 resumes at its cut, 4), then a probe: both hold. Planted: the
    block left unwritten, or written short of what the hit reads, fails the admission
    and the probe; written whole, it holds."""
    ops = [AddRequest("r0", P13), Offer("r0", 12, "sync"), Step(("r0",), 64), Loaded("r0", True, (2,))]
    contexts = run(CONNECTOR, ops + [AddRequest("r1", P13), Step(("r0", "r1"), 64), Probe(P13)])
    assert ctx_of(contexts, Loaded).history.unwritten == {2: Unwritten("r0's sync load failed on it")}
    step, probe = ctx_of(contexts, Step), ctx_of(contexts, Probe)
    assert dict(step.obs.results)["r1"].hit_blocks == ((1, 2, 3),) and not step.history.unwritten
    for ctx in (step, probe):
        holds("hit_serves_written_kv", ctx)
        for written, flagged in ((0, True), (3, True), (4, False)):
            history = copy.deepcopy(ctx.history)
            history.unwritten[2] = Unwritten("planted", written)
            (fails if flagged else holds)("hit_serves_written_kv", replace(ctx, history=history))
    # A block the hit does not hand out is not its business.
    history = copy.deepcopy(probe.history)
    history.unwritten[4] = Unwritten("planted")
    holds("hit_serves_written_kv", replace(probe, history=history))


def test_step_reads_written_kv():
    """The step in which r0 resumes at its cut (4) and recomputes block 2 holds (it reads
    only block 1, and r1 is judged by its hit). Planted: block 1 left unwritten, or
    written short of the 4 tokens r0 reads, fails; written whole, it holds."""
    ops = [AddRequest("r0", P13), Offer("r0", 12, "sync"), Step(("r0",), 64), Loaded("r0", True, (2,))]
    step = ctx_of(run(CONNECTOR, ops + [AddRequest("r1", P13), Step(("r0", "r1"), 64)]), Step)
    assert dict(step.obs.results)["r0"].scheduled == 9 and step.after.tables["r0"][0][:2] == (1, 2)
    holds("step_reads_written_kv", step)
    for written, flagged in ((0, True), (3, True), (4, False)):
        history = copy.deepcopy(step.history)
        history.unwritten[1] = Unwritten("planted", written)
        (fails if flagged else holds)("step_reads_written_kv", replace(step, history=history))


# ---------------------------------------------------------------- isolation
ISOLATION_CFG = Config(groups=(GroupSpec("full", 4),), num_blocks=24)
TWO_READERS = [AddRequest("a", SYS), Schedule("a", 64), Finish("a"), AddRequest("b", SYS), Schedule("b", 64)]


def test_hit_written_by_same_identity():
    ctx = run(ISOLATION_CFG, TWO_READERS)[-1]
    holds("hit_written_by_same_identity", ctx)
    # Control: the blocks b hit are said to have been written by another tenant.
    ledger = copy.deepcopy(ctx.history.isolation)
    ledger.writer = {blk: Identity(salt="other") for blk in ledger.writer}
    history = copy.deepcopy(ctx.history)
    history.isolation = ledger
    fails("hit_written_by_same_identity", replace(ctx, history=history))


def test_events_carry_block_keys():
    contexts = run(ISOLATION_CFG, [AddRequest("a", SYS, salt="t"), Schedule("a", 64)])
    ctx = next(c for c in contexts if any(isinstance(e, BlockStored) for e in c.after.events))
    holds("events_carry_block_keys", ctx)
    ev = next(e for e in ctx.after.events if isinstance(e, BlockStored))
    assert ev.extra_keys is not None and ev.extra_keys[0] == ("t",)
    # Control: each block published with the keys of the block before it.
    shifted = replace(ev, extra_keys=(None, *ev.extra_keys[:-1]))
    fails("events_carry_block_keys", replace(ctx, after=replace(ctx.after, events=(shifted,))))


def test_router_sees_target_hits():
    ctx = run(ISOLATION_CFG, TWO_READERS)[-1]
    holds("router_sees_target_hits", ctx)
    # Control: a router that heard no events sees none of b's hit.
    history = copy.deepcopy(ctx.history)
    history.isolation = IsolationLedger()
    fails("router_sees_target_hits", replace(ctx, history=history))


def test_every_invariant_has_a_control():
    tested = {name[len("test_") :] for name in globals() if name.startswith("test_")}
    assert {inv.name for inv in INVARIANTS} <= tested


# ---------------------------------------------------------------- batched steps
MAMBA_STEP = Config(groups=(GroupSpec("full", 4), GroupSpec("mamba", 4)), num_blocks=32)
STEP_OPS = [AddRequest("a", SYS + (2, 2)), AddRequest("b", SYS + (3, 3)), Step(("a", "b"), 64)]


@pytest.fixture(scope="module")
def batched():
    return run(MAMBA_STEP, STEP_OPS)


def test_step_blocks_stay_held(batched):
    ctx = ctx_of(batched, Step)
    holds("step_blocks_stay_held", ctx)
    full_a, mamba_a = ctx.after.tables["a"]
    # The step frees a block that a's forward pass still reads (the state it writes).
    freed = replace(ctx.after, tables={**ctx.after.tables, "a": (full_a, mamba_a[:-1] + (0,))})
    fails("step_blocks_stay_held", replace(ctx, after=freed))
    # ... or hands a block a held before the step to b as a new block.
    (_, a_result), (_, b_result) = ctx.obs.results
    stolen = replace(b_result, new_blocks=((full_a[0],), ()))
    held = replace(ctx.before, tables={**ctx.before.tables, "a": ((full_a[0],), ())})
    fails(
        "step_blocks_stay_held", replace(ctx, before=held, obs=StepResult((("a", a_result), ("b", stolen))))
    )
    # A block b allocated this step and a hits (attention) is not a reuse.
    holds("step_blocks_stay_held", replace(ctx, obs=StepResult((("a", a_result), ("b", stolen)))))


def test_mamba_state_not_read_while_written(batched):
    """The model's guard refuses b; without it b resumes from the state a writes."""
    ctx = ctx_of(batched, Step)
    holds("mamba_state_not_read_while_written", ctx)
    (_, a_result), (_, b_refused) = ctx.obs.results
    assert not b_refused.admitted and b_refused.hit == 20
    full_a, mamba_a = ctx.after.tables["a"]
    hit_blocks = ((*full_a[:5],), (0, 0, 0, 0, mamba_a[4]))
    b_admitted = replace(
        b_refused, scheduled=2, admitted=True, hit_blocks=hit_blocks, new_blocks=((30,), (31,))
    )
    history = copy.deepcopy(ctx.history)
    history.requests["b"].running, history.requests["b"].num_computed = True, 22
    tables = {**ctx.after.tables, "b": ((*full_a[:5], 30), (0, 0, 0, 0, mamba_a[4], 31))}
    broken = replace(
        ctx,
        obs=StepResult((("a", a_result), ("b", b_admitted))),
        after=replace(ctx.after, tables=tables),
        history=history,
    )
    fails("mamba_state_not_read_while_written", broken)


CHUNKED_OPS = [AddRequest("a", SYS + (2, 2)), Step(("a",), 8), Step(("a",), 8), Step(("a",), 8)]


def test_mamba_state_in_worker_table():
    """a's third chunk (the Mamba split cuts it at token 20) reads its state from
    column 3 of the worker's Mamba table (the block the second chunk wrote) and
    writes column 4. Corruptions: the
    worker's state column null (a moved draft block's nulled entry shipped, as a
    re-admission does), a block the request does not hold, the state read from
    a column past the worker's table."""
    ctx = [c for c in run(MAMBA_STEP, CHUNKED_OPS) if isinstance(c.op, Step)][-1]
    holds("mamba_state_in_worker_table", ctx)
    r = ctx.history.requests["a"]
    full, mamba = r.worker
    assert r.read_from == (16, 0) and r.num_computed == 20 and len(mamba) == 5
    assert mamba[3] != 0 and mamba[4] == ctx.after.tables["a"][1][4] != 0

    def planted(worker=None, read_from=None):  # the history with a's worker view replaced
        history = copy.deepcopy(ctx.history)
        planted_r = history.requests["a"]
        planted_r.worker = worker or planted_r.worker
        planted_r.read_from = read_from or planted_r.read_from
        return replace(ctx, history=history)

    fails("mamba_state_in_worker_table", planted(worker=(full, (*mamba[:4], 0))))
    other = next(b for b in range(1, MAMBA_STEP.num_blocks) if b not in mamba and b not in full)
    fails("mamba_state_in_worker_table", planted(worker=(full, (*mamba[:4], other))))
    fails("mamba_state_in_worker_table", planted(worker=(full, (*mamba[:3], 0, *mamba[4:]))))
    fails("mamba_state_in_worker_table", planted(read_from=(16, 9)))


def test_hit_checks_cover_batched_admissions(batched):
    """b's lookup inside the step hits a's freshly cached blocks: the hit checks
    accept it, and catch a hit block that holds another prefix."""
    ctx = ctx_of(batched, Step)
    holds("hit_backed_by_cache", ctx)
    holds("hit_blocks_hold_their_prefix", ctx)
    (_, a_result), (_, b_result) = ctx.obs.results
    full_hits, mamba_hits = b_result.hit_blocks
    swapped = (full_hits[1], full_hits[0], *full_hits[2:])
    wrong = replace(b_result, hit_blocks=(swapped, mamba_hits))
    fails("hit_blocks_hold_their_prefix", replace(ctx, obs=StepResult((("a", a_result), ("b", wrong)))))
    longer = replace(b_result, hit=24)
    fails("hit_backed_by_cache", replace(ctx, obs=StepResult((("a", a_result), ("b", longer)))))


# ---------------------------------------------------------------- copy-on-write copies
FINE = Config(
    groups=(GroupSpec("full", 16), GroupSpec("mamba", 64)),
    num_blocks=40,
    retention_interval=0,
    hash_block_size=16,
)
PROMPT150 = tuple(range(1000, 1150))
FINE_OPS = (
    [AddRequest("a", PROMPT150)]
    + [Schedule("a", 64)] * 4
    + [Finish("a"), AddRequest("b", PROMPT150), Schedule("b", 64)]
)


@pytest.fixture(scope="module")
def fine():
    return run(FINE, FINE_OPS)


def test_copies_sound(fine):
    """a keys its state at 144 (inside its third Mamba block) and moves the key to a
    copy; b hits 144 and reads a private copy. Corruptions: the copy reversed, the
    copies dropped, a source handed out again, a moved key lost."""
    producer = next(c for c in fine if isinstance(c.op, Schedule) and c.obs.copies and c.op.rid == "a")
    consumer = ctx_of(fine, Schedule)
    holds("copies_sound", producer)
    holds("copies_sound", consumer)
    ((src, dst),) = consumer.obs.copies
    assert consumer.obs.hit == 144 and consumer.obs.hit_blocks[1][-1] == src
    fails("copies_sound", replace(consumer, obs=replace(consumer.obs, copies=((dst, src),))))
    fails("copies_sound", replace(consumer, obs=replace(consumer.obs, copies=())))
    reused = replace(
        consumer.obs, new_blocks=(consumer.obs.new_blocks[0] + (src,), consumer.obs.new_blocks[1])
    )
    fails("copies_sound", replace(consumer, obs=reused))
    ((psrc, pdst),) = producer.obs.copies
    left_behind = {**producer.after.block_hash, psrc: producer.before.block_hash[psrc]}
    left_behind.pop(pdst)
    # A key left on the source is beyond this invariant (the differential check sees it: the model moves it).
    holds("copies_sound", replace(producer, after=replace(producer.after, block_hash=left_behind)))
    moved_nowhere = dict(producer.after.block_hash)
    moved_nowhere.pop(pdst)
    fails("copies_sound", replace(producer, after=replace(producer.after, block_hash=moved_nowhere)))


def test_copies_sound_spares_a_destination_freed_by_a_failed_load_in_the_step() -> None:
    """A failed async load ('recompute') is freed at its promotion and admitted afresh in
    the same step; its fine-grained hit's copy may land in a block the load had held.
    The destination is fresh then. Control: the same step with that request not
    admitted (so it kept the block through the step) is a destination still held."""
    from pathlib import Path

    from invariants.harness.trace import read_trace

    trace = read_trace(Path(__file__).parent / "data" / "fine_connector_failed_load_copy.json")
    step = ctx_of(run(trace.config, trace.ops), Step)
    assert step.obs.copies and dict(step.obs.results)["r1"].admitted
    holds("copies_sound", step)
    kept = StepResult(
        tuple((rid, replace(r, admitted=False)) for rid, r in step.obs.results), copies=step.obs.copies
    )
    fails("copies_sound", replace(step, obs=kept))
