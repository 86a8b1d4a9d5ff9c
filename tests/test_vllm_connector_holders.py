"""Failed KV-connector blocks held by several requests (`model.connector`, `model.queues`).

Model tests (no vLLM): between steps the model keeps vLLM's `running` and
`kv_holding_waiting` order (the step's own requests as it left them, then those
it left aside); a load failed on a block several requests hold cuts the first of
them in scan order (the async loads in `kv_holding_waiting` order, then the
running requests in `running`'s, marking afresh) at that block, and a later one
holding only marked blocks keeps its computed tokens; what generation may name
(`failable_blocks`): shared blocks under "recompute", not those a request
awaiting its sample covers, and under "fail" none another scanned
request covers (vLLM would end them all at once, in a set's order).

vLLM tests: the real `Scheduler` agrees on both traces, and the negative
controls: the zoo mutants `invalid_scan_running_reversed` and
`invalid_block_marks_ignored` are caught on a trace the unmutated scheduler
passes, and so is a model whose running order is planted reversed.
"""

from __future__ import annotations

from typing import Any

import pytest
from drive import Drive, Factory

from invariants.harness.checker import Checker, InvalidOp, Violation
from invariants.targets.model_target import ModelTarget
from invariants.targets.vllm_env import vllm_available
from model.allocator import AllocatorModel
from model.config import Config, GroupSpec
from model.connector import failable_blocks, scan_order
from model.observation import LoadCut
from model.ops import AddRequest, Finish, Loaded, Offer, Op, Probe, Sample, Step

FULL = Config(groups=(GroupSpec("full", 4),), num_blocks=24, max_model_len=4096, kv_connector=True)
PROMPT = tuple(range(1, 14))  # 13 tokens

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")


def running_holders_ops() -> list[Op]:
    """Two running requests and an async load share blocks 1-2 (Full4): r0 computed 8
    of its 13 tokens; r1 hits them, computes its 15 and is sampled; a step of r1 alone
    leaves `running` as [r1, r0]; r2 hits r1's blocks 1-3 and loads 2 tokens async;
    the load fails on block 2: r2 is cut to 4 (its own scan), r1 (first in `running`)
    to 4, and r0 (holding only the marked block) keeps its 8."""
    return [
        AddRequest("r0", PROMPT),
        Step(("r0",), 8),
        AddRequest("r1", PROMPT + (7, 7)),
        Step(("r1",), 64),
        Sample("r1", 3),
        AddRequest("r2", PROMPT + (8, 8)),
        Offer("r2", 15, "async"),
        Step(("r2",), 64),
        Loaded("r2", True, (2,)),
        Step(("r0", "r1", "r2"), 64),
        Sample("r0", 5),
        Sample("r1", 4),
        Sample("r2", 4),
        Finish("r0"),
        Finish("r1"),
        Finish("r2"),
        Probe(PROMPT),
    ]


def async_holders_ops() -> list[Op]:
    """Two async loads hitting r0's blocks 1-2 admitted in one step (`kv_holding_waiting`
    [r1, r2]); r2's load fails on block 2: r1 (first in that queue) marks it and is cut
    to 4, r2 keeps its tokens (vLLM reverts it to them: its blocks were all marked);
    the running scan marks afresh: r0 is cut to 4. Both loads are promoted, r1
    recomputing from its cut."""
    return [
        AddRequest("r0", PROMPT),
        Step(("r0",), 8),
        AddRequest("r1", PROMPT + (7, 7)),
        AddRequest("r2", PROMPT + (8, 8)),
        Offer("r1", 14, "async"),
        Offer("r2", 14, "async"),
        Step(("r1", "r2"), 64),
        Loaded("r2", True, (2,)),
        Loaded("r1", True),
        Step(("r0", "r1", "r2"), 64),
        Finish("r0"),
        Finish("r1"),
        Finish("r2"),
        Probe(PROMPT),
    ]


def apply_all(m: AllocatorModel, ops: list[Op]) -> list[object]:
    return [m.apply(op) for op in ops]


# ------------------------------------------------------------------ the contract, on the model
def test_the_model_keeps_the_running_order_of_the_requests_a_step_leaves_aside() -> None:
    m = AllocatorModel(FULL)
    apply_all(m, running_holders_ops()[:8])
    assert scan_order(m) == (["r2"], ["r1", "r0"])
    m.apply(Step(("r0", "r1"), 64))
    assert scan_order(m) == (["r2"], ["r0", "r1"])
    m.apply(Finish("r0"))
    assert scan_order(m) == (["r2"], ["r1"])


def test_several_running_holders_the_first_in_running_order_is_cut() -> None:
    m = AllocatorModel(FULL)
    ops = running_holders_ops()
    apply_all(m, ops[:8])
    assert failable_blocks(m, m.requests["r2"]) == [1, 2, 3, 5]
    assert m.apply(ops[8]) == LoadCut(4, (("r1", 4),))
    assert m.requests["r0"].num_computed == 8  # it held only the marked block
    # Negative control: with `running` planted the other way round, r0 is the one cut.
    planted = AllocatorModel(FULL)
    apply_all(planted, ops[:8])
    planted.order.running.reverse()
    assert planted.apply(ops[8]) == LoadCut(4, (("r0", 4),))


def test_several_async_loads_holding_a_failed_block_the_first_in_the_queue_is_cut() -> None:
    m = AllocatorModel(FULL)
    ops = async_holders_ops()
    apply_all(m, ops[:7])
    assert scan_order(m) == (["r1", "r2"], ["r0"])
    # The running scan marks afresh: r0 is cut at block 2 too.
    assert m.apply(ops[7]) == LoadCut(14, (("r0", 4), ("r1", 4)))
    assert m.exercised["connector: another async load holding a failed block cut"] == 1
    m.apply(ops[8])
    assert m.requests["r1"].load == "loaded" and m.requests["r2"].load == "loaded"


def test_what_generation_may_name_with_several_holders() -> None:
    ops = running_holders_ops()
    # A holder awaiting its sample covers blocks 1-3: they are not named.
    w = AllocatorModel(FULL)
    apply_all(w, ops[:4] + ops[5:8])  # r1 not sampled: it awaits its sample
    assert w.requests["r1"].awaits_sample and failable_blocks(w, w.requests["r2"]) == [5]
    # "fail": a block another scanned request covers is not named (vLLM ends them all).
    f = AllocatorModel(FULL.with_(kv_load_failure_policy="fail"))
    apply_all(f, ops[:8])
    assert failable_blocks(f, f.requests["r2"]) == [5]
    c = Checker(ModelTarget(FULL.with_(kv_load_failure_policy="fail")))
    for op in ops[:8]:
        c.step(op)
    with pytest.raises(InvalidOp, match="'invalid'"):
        c.step(Loaded("r2", True, (2,)))


# ------------------------------------------------------------------ the real Scheduler
def judged(factory: Factory, cfg: Config, ops: list[Op]) -> tuple[list[Violation], list[object]]:
    """The violations no known finding explains (a last audit too), and the observations."""
    d = Drive(cfg, factory).do(*ops)
    return d.audited(), d.seen


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("trace", [running_holders_ops, async_holders_ops])
def test_real_scheduler_agrees_with_several_holders(trace: object) -> None:
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    ops = trace()  # type: ignore[operator]
    found, seen = judged(VllmSchedulerTarget, FULL, ops)
    assert found == []
    assert seen[8 if trace is running_holders_ops else 7] in (
        LoadCut(4, (("r1", 4),)),
        LoadCut(14, (("r0", 4), ("r1", 4))),
    )


@needs_vllm
@pytest.mark.vllm
def test_an_offer_never_admitted_ends_with_its_request() -> None:
    """The scripted connector forgets a finished request's offer, as the model does: a
    new request of the same id is not offered it (the zoo's shrinker reuses ids)."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    prompt = (2, 2, 2, 1, 2, 3, 2, 1, 2, 2)
    ops: list[Op] = [
        AddRequest("r1", prompt),
        Offer("r1", 10, "async"),
        Finish("r1"),
        AddRequest("r1", prompt),
        Step(("r1",), 64),
    ]
    assert judged(VllmSchedulerTarget, FULL, ops)[0] == []


HOLDER_MUTANTS = ("invalid_scan_running_reversed", "invalid_block_marks_ignored")


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("name", HOLDER_MUTANTS)
def test_holder_mutant_is_caught(name: str) -> None:
    """Negative controls: each mutant of the failed-block scan order is caught on a
    trace the unmutated scheduler passes."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget
    from invariants.zoo.mutants_scheduler import activate

    assert judged(VllmSchedulerTarget, FULL, running_holders_ops())[0] == []
    with activate(name) as factory:
        found, _ = judged(factory, FULL, running_holders_ops())
    assert found and "LoadCut" in found[0].message, found[:1]


# ------------------------------------------------------------------ failed-load-rollback-reserves-against-itself
def rollback_finding() -> Any:
    from invariants.harness.known_findings import load_known_findings

    return next(f for f in load_known_findings() if f.id == "failed-load-rollback-reserves-against-itself")


def test_a_rolled_back_load_reserves_against_its_own_admission_finding() -> None:
    """The finding's trace: flagged on the model with the rollback named, tolerated as
    the finding; control: the same refusal without a rollback is not the finding."""
    from invariants.harness.known_findings import is_known_violation
    from model.ops import Schedule

    f = rollback_finding()
    checker = Checker(ModelTarget(f.trace.config))
    found: list[Violation] = []
    for op in f.trace.ops:
        found += checker.step(op)
    assert [v.check for v in found] == ["fitting_request_admitted"]
    assert found[0].message.endswith("after its failed load was rolled back")
    assert is_known_violation("model", found[0])
    message = found[0].message.removesuffix(" after its failed load was rolled back")
    plain = Violation(found[0].check, message, config=found[0].config, op=found[0].op)
    assert not is_known_violation("model", plain)
    # vLLM keeps it among the in-flight prefills: the model counts its own reserve.
    m = AllocatorModel(f.trace.config)
    for op in f.trace.ops[:-1]:
        m.apply(op)
    assert m.requests["r0"].prefilling and not m.requests["r0"].num_computed
    assert isinstance(f.trace.ops[-1], Schedule)


@needs_vllm
@pytest.mark.vllm
def test_vllm_refuses_a_rolled_back_load_as_the_model_does() -> None:
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    f = rollback_finding()
    target = VllmSchedulerTarget(f.trace.config)
    checker = Checker(target, audit_every=1)
    for op in f.trace.ops:
        assert checker.step(op) == []
    sched = target.vllm_scheduler
    # Holding nothing, r0 still reserves its whole sequence, more than the idle pool.
    assert [r.request_id for r in sched._inflight_prefills] == ["r0"]
    assert sched._inflight_prefill_reserved_blocks() > sched.kv_cache_manager.block_pool.get_num_free_blocks()
