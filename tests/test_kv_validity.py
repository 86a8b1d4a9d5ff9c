"""KV validity through KV-connector load failures (`History.unwritten`, `hit_serves_written_kv`).

A load that failed leaves garbage in the blocks it was writing, until a step
computes them again. The history learns it from the reports (`Loaded.invalid`,
a whole failed load) and from the steps (a recompute from the cut, a fresh
take); the invariant flags a hit that hands such a block out. vLLM 0.33.0
keeps a sync load's failed blocks' hashes under "recompute": a cut request
preempted or aborted before it recomputes them leaves them to be hit, the
known finding "sync-load-failed-block-hash-kept"; a request sharing such a
block keeps it as computed for the same recompute, and reads it if that never
came (`step_reads_written_kv`, "sync-load-failed-block-read-before-recompute").
The model states vLLM's behaviour, so both are flagged on both, tolerated only
as their claims state.

Model tests need no vLLM; the vLLM tests replay the finding's traces through the
real `Scheduler`, show the legitimate recompute in place clean there, and catch
a planted scheduler (a zoo mutant caching a failed block) by this invariant.
"""

from __future__ import annotations

import pytest

from invariants.catalogue.context import Unwritten
from invariants.harness.checker import Checker, Violation
from invariants.harness.known_findings import explain, load_known_findings
from invariants.harness.trace import read_trace
from invariants.targets.model_target import ModelTarget
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, GroupSpec
from model.contract.ops import AddRequest, Finish, Loaded, Offer, Op, Preempt, Probe, Step

FULL = Config(groups=(GroupSpec("full", 4),), num_blocks=16, max_model_len=4096, kv_connector=True)
P13 = tuple(range(1, 14))
FINDING = "sync-load-failed-block-hash-kept"
CHECK = "hit_serves_written_kv"
SHARED = "sync-load-failed-block-read-before-recompute"
DATA = "tests/data/kv_failed_block_hit_after_{}.json"

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")


def cut_ops() -> list[Op]:
    """r0 (13 tokens) loads its first 12 sync (blocks 1-3, cached at the admission); the
    step's output names block 2 (index 1) failed: r0 is cut to 4."""
    return [AddRequest("r0", P13), Offer("r0", 12, "sync"), Step(("r0",), 64), Loaded("r0", True, (2,))]


def flagged(checker: Checker, ops: list[Op]) -> list[tuple[int, Violation]]:
    return [(i, v) for i, op in enumerate(ops) for v in checker.step(op)]


# ------------------------------------------------------------------ the history, on the model
def test_a_recompute_in_place_writes_the_block_back() -> None:
    """The cut request recomputes from its cut: a chunk ending inside the block leaves
    it unwritten (a probe then is flagged), the next one writes it whole (clean)."""
    c = Checker(ModelTarget(FULL))
    assert flagged(c, cut_ops()) == []
    assert c.history.unwritten == {2: Unwritten("r0's sync load failed on it")}
    assert flagged(c, [Step(("r0",), 2)]) == [] and c.history.unwritten[2].written == 2
    found = flagged(c, [Probe(P13)])
    assert [v.check for _, v in found] == [CHECK] and "block 2 (index 1)" in found[0][1].message
    assert flagged(c, [Step(("r0",), 64), Probe(P13)]) == [] and not c.history.unwritten


def test_a_request_sharing_the_block_in_the_recomputing_step_is_served() -> None:
    """r1 hits block 2 in the step r0 recomputes it: the forward pass writes each layer's
    KV before attention reads it, so the hit is sound; so is every lookup after."""
    c = Checker(ModelTarget(FULL))
    ops = cut_ops() + [AddRequest("r1", P13), Step(("r0", "r1"), 64), Probe(P13)]
    assert flagged(c, ops) == []
    # The same admission in a step r0 sits out reads the failed block.
    c = Checker(ModelTarget(FULL))
    found = flagged(c, cut_ops() + [AddRequest("r1", P13), Step(("r1",), 64)])
    assert [(i, v.check) for i, v in found] == [(5, CHECK)]


def shared_ops() -> list[Op]:
    """r0 loads 12 tokens sync (blocks 1-3); r1 hits them in the same step and computes 4
    tokens; the output names block 2 failed: r0 is cut to 4, r1 back to its hit (12),
    keeping block 2, which r0 marked for recomputation."""
    r1 = P13[:12] + tuple(range(50, 58))
    return [AddRequest("r0", P13), AddRequest("r1", r1), Offer("r0", 12, "sync"), Step(("r0", "r1"), 5)]


def test_a_request_keeping_a_marked_block_reads_it_only_once_recomputed() -> None:
    """r1 reads block 2 in the step r0 recomputes it: sound. r0 aborted first, r1's next
    step reads KV never written (the finding read-before-recompute)."""
    c = Checker(ModelTarget(FULL))
    assert flagged(c, shared_ops() + [Loaded("r0", True, (2,)), Step(("r0", "r1"), 64)]) == []
    assert not c.history.unwritten
    c = Checker(ModelTarget(FULL))
    found = flagged(c, shared_ops() + [Loaded("r0", True, (2,)), Finish("r0"), Step(("r1",), 64)])
    assert [(i, v.check, v.message) for i, v in found] == [
        (
            6,
            "step_reads_written_kv",
            "r1 computes tokens [12, 20) reading group 0 block 2 (index 1): r0's sync load failed on it "
            "and no step has written it since",
        )
    ]


def test_a_whole_failed_load_marks_its_external_blocks_until_taken_fresh() -> None:
    """An async load that failed whole wrote none of its blocks; its re-admission frees
    them and takes fresh ones (what a fresh block holds its owner writes)."""
    c = Checker(ModelTarget(FULL))
    ops: list[Op] = [AddRequest("r0", P13), Offer("r0", 13, "async"), Step(("r0",), 64)]
    assert flagged(c, ops + [Loaded("r0", False)]) == []
    assert c.history.unwritten == {b: Unwritten("r0's failed async load never wrote it") for b in (1, 2, 3)}
    assert flagged(c, [Step(("r0",), 64)]) == [] and not c.history.unwritten


def test_a_sync_loads_external_blocks_are_taken_fresh() -> None:
    """Found by `fuzz --target model --seed 0`: under "fail" a whole failed load ends its
    request, freeing its unwritten blocks; a sync load takes them as external blocks
    (which `new_blocks` does not list) and another request hits them in that step."""
    c = Checker(ModelTarget(FULL.with_(kv_load_failure_policy="fail")))
    ops: list[Op] = [AddRequest("r0", P13), Offer("r0", 13, "async"), Step(("r0",), 64), Loaded("r0", False)]
    assert flagged(c, ops) == [] and set(c.history.unwritten) == {1, 2, 3}
    other = tuple(range(60, 73))
    ops = [AddRequest("r1", other), Offer("r1", 12, "sync"), AddRequest("r2", other), Step(("r1", "r2"), 64)]
    assert flagged(c, ops) == []
    step = c.last_obs
    assert dict(step.results)["r2"].hit == 12  # type: ignore[attr-defined]
    assert not set(c.model.snapshot().tables["r1"][0]) & set(c.history.unwritten)


def test_a_named_block_the_load_did_not_write_keeps_its_kv() -> None:
    """A report may name a hit block (computed by an earlier step, never written by the
    load): only the load's own blocks lose their KV."""
    c = Checker(ModelTarget(FULL))
    ops: list[Op] = [AddRequest("r0", P13), Step(("r0",), 64), Finish("r0")]
    ops += [AddRequest("r1", P13 + (7, 7, 7)), Offer("r1", 16, "async"), Step(("r1",), 64)]
    assert flagged(c, ops) == []
    assert c.model.snapshot().tables["r1"] == ((1, 2, 3, 4),)  # hit 1-3, block 4 loaded
    assert flagged(c, [Loaded("r1", True, (3, 4))]) == []
    assert c.history.unwritten == {4: Unwritten("r1's async load failed on it")}


# ------------------------------------------------------------------ the finding, through vLLM
@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("end", ["preempt", "finish"])
def test_vllm_serves_a_sync_load_failed_block_after_the_cut_request_leaves(end: str) -> None:
    """The finding's traces: vLLM and the model agree on every observation and snapshot,
    and the hit is flagged on both, explained by the finding alone."""
    from invariants.harness.replay import replay

    finding = next(f for f in load_known_findings() if f.id == FINDING)
    trace = read_trace(DATA.format(end))
    if end == "finish":  # the finding's own trace: the engine's steps (a stated budget)
        assert trace.ops == finding.trace.ops and trace.config == finding.trace.config
    assert trace.config.max_num_batched_tokens and Preempt("r0") not in trace.ops  # the engine's steps
    if end == "preempt":  # r0 is preempted by vLLM's own step, under pool pressure (r1 grows)
        c = Checker(ModelTarget(trace.config))
        preempted = [op for op in trace.ops if not c.step(op) and getattr(c.last_obs, "preempted", ())]
        assert preempted and isinstance(preempted[0], Step)
    else:
        assert trace.ops[4] == Finish("r0")
    # On vLLM the shadow worker sees the same read (`worker_reads_own_prefix`: the finding's view).
    for target, seen in (("vllm", {CHECK, "worker_reads_own_prefix"}), ("model", {CHECK})):
        result = replay(trace, target)
        assert result.clean and {v.check for _, v in result.known} == seen, target
        assert all(explain(target, v) is finding for _, v in result.known)


@needs_vllm
@pytest.mark.vllm
def test_vllm_lets_a_request_read_a_marked_block_its_marker_never_recomputed() -> None:
    """The second finding's trace: agreed on everything, flagged on both, explained by it;
    its claim names the running read under "recompute" only."""
    from invariants.harness.replay import replay

    finding = next(f for f in load_known_findings() if f.id == SHARED)
    trace = read_trace("tests/data/kv_failed_block_shared_read_after_finish.json")
    assert trace.ops == finding.trace.ops and trace.config == finding.trace.config
    for target in ("vllm", "model"):
        result = replay(trace, target)
        seen = {"step_reads_written_kv"} | ({"worker_reads_own_prefix"} if target == "vllm" else set())
        assert result.clean and {v.check for _, v in result.known} == seen, target
        assert all(explain(target, v) is finding for _, v in result.known)
    cfg, step = trace.config, trace.ops[-1]
    msg = "r1 computes tokens [12, 20) reading group 0 block 2 (index 1): r0's {} and no step has written it since"
    assert finding.claims("step_reads_written_kv", msg.format("sync load failed on it"), cfg, step)
    assert not finding.claims("step_reads_written_kv", msg.format("async load failed on it"), cfg, step)
    fail = cfg.with_(kv_load_failure_policy="fail")
    assert not finding.claims("step_reads_written_kv", msg.format("sync load failed on it"), fail, step)
    assert not finding.claims("step_reads_written_kv", msg.format("sync load failed on it"), cfg, Probe(P13))


@needs_vllm
@pytest.mark.vllm
def test_vllm_recomputing_in_place_is_clean_and_fail_evicts() -> None:
    """The legitimate path through vLLM: r1 shares the block in the step r0 recomputes
    it (audited and fast path); under "fail" the failed blocks' hashes go (r1 hits 4).
    The shared block on the engine's own steps: built with a 10-token budget, the step
    running r0's sync load leaves r1 (24 tokens, 12 hit) short of its prompt, so the
    output names block 2 failed (`shared_ops`' scenario); the next step, r0 recomputes
    from its cut (9 tokens) and r1 goes on from its hit (1 token, reading block 2)."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    ops = cut_ops() + [AddRequest("r1", P13), Step(("r0", "r1"), 64), Probe(P13)]
    r1 = P13[:12] + tuple(range(50, 62))
    shared = [AddRequest("r0", P13), AddRequest("r1", r1), Offer("r0", 12, "sync"), Step(("r0", "r1"), 10)]
    shared += [Loaded("r0", True, (2,)), Step(("r0", "r1"), 10)]
    for audit_every in (1, 50):
        for cfg, trace in ((FULL, ops), (FULL.with_(max_num_batched_tokens=10), shared)):
            c = Checker(VllmSchedulerTarget(cfg), audit_every=audit_every)
            assert flagged(c, trace) == [] and c.audit() == []
            if trace is shared:  # r1 read block 2 in the step r0 recomputed it
                assert [(rid, r.scheduled) for rid, r in c.last_obs.results] == [("r0", 9), ("r1", 1)]  # type: ignore[attr-defined]
    c = Checker(VllmSchedulerTarget(FULL.with_(kv_load_failure_policy="fail")), audit_every=1)
    assert flagged(c, cut_ops() + [AddRequest("r1", P13), Step(("r1",), 64)]) == []
    assert c.last_obs.results[0][1].hit == 4  # type: ignore[attr-defined]


@needs_vllm
@pytest.mark.vllm
def test_the_tolerance_matches_nothing_else() -> None:
    """The claim: a sync load's named block, one group, caching, "recompute", a lookup."""
    finding = next(f for f in load_known_findings() if f.id == FINDING)
    cfg, step = finding.trace.config, finding.trace.ops[-1]
    msg = "hit 12 reads group 0 block 2 (index 1): r0's {} and no step has written it since"
    assert finding.claims(CHECK, msg.format("sync load failed on it"), cfg, step)
    assert finding.claims(CHECK, msg.format("sync load failed on it"), cfg, Probe(P13))
    for other in ("async load failed on it", "failed async load never wrote it"):
        assert not finding.claims(CHECK, msg.format(other), cfg, step)
    known = msg.format("sync load failed on it")
    assert not finding.claims(CHECK, known, cfg.with_(kv_load_failure_policy="fail"), step)
    assert not finding.claims(CHECK, known, cfg.with_(enable_caching=False), step)
    two = cfg.with_(groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=5)))
    assert not finding.claims(CHECK, known, two, step)
    assert not finding.claims(CHECK, known, cfg, Finish("r0"))
    assert not finding.claims("hit_blocks_hold_their_prefix", known, cfg, step)


@needs_vllm
@pytest.mark.vllm
def test_a_scheduler_caching_a_failed_block_is_caught_by_the_invariant() -> None:
    """Negative control on a planted target: the zoo mutant that cuts an async load at
    the END of its first failed block caches that block at promotion; the probe after
    hits it, flagged by hit_serves_written_kv and not explained by the finding."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget
    from invariants.zoo.mutants_scheduler import activate

    prompt = tuple(range(30, 45))
    ops: list[Op] = [AddRequest("r2", prompt), Offer("r2", 12, "async"), Step(("r2",), 64)]
    ops += [Loaded("r2", True, (1,)), Step(("r2",), 64), Probe(prompt)]
    assert flagged(Checker(VllmSchedulerTarget(FULL), audit_every=1), ops) == []
    with activate("invalid_block_cut_keeps_failed_block") as factory:
        found = [v for _, v in flagged(Checker(factory(FULL), audit_every=1), ops) if v.check == CHECK]
    assert [v.message for v in found] == [
        "hit 12 reads group 0 block 1 (index 0): r2's async load failed on it and no step has written it since"
    ]
    assert explain("vllm", found[0]) is None
