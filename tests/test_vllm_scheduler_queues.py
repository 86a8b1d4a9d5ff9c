"""The order a step leaves the scheduler's queues in (`model.policy.queues`, `StepResult.queues`).

Model tests (no vLLM): a preempted request goes to the front of `waiting`, the
later preempted first; an admitted request to the back of `running`; a skipped
request (a load in flight, an async load just admitted) back to the front of
the queue it holds blocks for, in skip order, ahead of the unreached; the
request the pass stops at stays. The Checker judges the order only where the
target states it (`TargetFeatures.queues`), and a run says where it does not.

vLLM tests: vLLM's real `Scheduler` leaves its queues as the model states
(preemption beside a waiting request; two async loads skipped, then one
promoted), and the negative controls: each queue mutant of the zoo
(`preempted_to_queue_back`, `skipped_holding_reversed`,
`skipped_holding_to_waiting`) is caught on a trace the unmutated scheduler passes,
and so is a target that reports a planted wrong order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from drive import Drive

from invariants.targets.model_target import ModelTarget
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, GroupSpec
from model.contract.observation import Observation, Queues, StepResult
from model.contract.ops import AddRequest, Loaded, Offer, Op, Sample, Step
from model.machine.allocator import AllocatorModel
from model.policy.queues import StepQueues

FULL_SWA = Config(
    groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=5)),
    num_blocks=9,
    retention_interval=0,
    max_model_len=4096,
)
FULL = Config(groups=(GroupSpec("full", 4),), num_blocks=16, max_model_len=4096, kv_connector=True)
PROMPT = (1, 2, 3) * 6
PROMPT13 = tuple(range(1, 14))

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")


# ------------------------------------------------------------------ the rule (model.policy.queues)
def test_preempted_requests_wait_in_front_the_latest_first() -> None:
    q = StepQueues(["a", "b", "c"], [], ["w"])
    q.preempted("c")
    q.preempted("b")
    assert q.left() == Queues(("a",), (), ("b", "c", "w"))
    with pytest.raises(AssertionError, match="not the last running"):
        StepQueues(["a", "b"], [], []).preempted("a")


def test_skipped_requests_come_back_in_skip_order_to_the_queue_they_hold_blocks_for() -> None:
    q = StepQueues(["r"], ["h1", "h2", "h3"], ["w1", "w2", "w3", "w4"])
    q.skipped("h1", holds_blocks=True)
    q.admitted("h2")
    q.skipped("h3", holds_blocks=True)
    q.skipped("w1", holds_blocks=True)  # admitted to an async load: it now holds blocks
    q.admitted("w2")
    q.skipped("w3", holds_blocks=False)
    # The pass stopped at w4: it stays where it was.
    assert q.left() == Queues(("r", "h2", "w2"), ("h1", "h3", "w1"), ("w3", "w4"))
    with pytest.raises(AssertionError, match="front of the queue"):
        StepQueues([], ["h"], ["w"]).admitted("w")


def model_ops() -> list[Op]:
    """Two async loads and a plain request in one step, then one load reports; each step an
    engine's (every request held, running then holding then waiting, a budget that does not
    bind)."""
    return [
        AddRequest("r0", PROMPT13),
        AddRequest("r1", PROMPT13[::-1]),
        AddRequest("r2", (5, 6, 7)),
        Offer("r0", 13, "async"),
        Offer("r1", 13, "async"),
        Step(("r0", "r1", "r2"), 64),
        Loaded("r1", True),
        Sample("r2", 1),
        Step(("r2", "r0", "r1"), 64),
    ]


def test_the_model_states_the_queues_of_a_connector_step() -> None:
    m = AllocatorModel(FULL)
    obs = [m.apply(op) for op in model_ops()]
    assert obs[5].queues == Queues(("r2",), ("r0", "r1"), ())  # type: ignore[union-attr]
    # r0's load has not reported (skipped again); r1 is promoted and runs.
    assert obs[8].queues == Queues(("r2", "r1"), ("r0",), ())  # type: ignore[union-attr]


def test_the_model_states_a_preemption_beside_a_waiting_request() -> None:
    d = preemption_drive(lambda cfg: ModelTarget(cfg))
    assert d.found == []
    step = next(o for o in d.seen if isinstance(o, StepResult) and o.preempted)
    assert step.queues == Queues(("r0",), (), ("r1", "r2"))


def test_the_reference_scheduler_leaves_its_queues_as_the_model_states() -> None:
    """reference_impl's own scheduler (no connector: nothing holds blocks while it waits)."""
    from invariants.targets.reference import ReferenceTarget

    d = preemption_drive(ReferenceTarget)
    assert d.found == []
    step = next(o for o in d.seen if isinstance(o, StepResult) and o.preempted)
    assert step.queues == Queues(("r0",), (), ("r1", "r2"))


class WrongQueues(ModelTarget):
    """A planted defect: every step reports its waiting queue reversed."""

    def apply(self, op: Op) -> Observation:
        obs = super().apply(op)
        if isinstance(obs, StepResult) and obs.queues is not None:
            q = obs.queues
            return replace(obs, queues=Queues(q.running, q.holding, q.waiting[::-1]))
        return obs


class Unobserved(WrongQueues):
    """The same defect on a target that does not state its queues: left unjudged."""

    features = replace(ModelTarget.features, queues=False)


def test_a_wrong_queue_order_is_caught_where_stated_and_unjudged_elsewhere() -> None:
    """Negative control: the planted order is flagged with the step's queues on each side;
    the same target declaring no queues is not judged on them."""
    found = preemption_drive(WrongQueues).found
    assert [v.check for v in found] == ["policy_drift"]  # every contract kept: a queue-order policy
    assert "the queues the step left (running, holding, waiting)" in found[0].message
    assert "('r1', 'r2')" in found[0].message and "('r2', 'r1')" in found[0].message
    assert preemption_drive(Unobserved).found == []


def test_a_run_says_where_the_queue_order_is_unjudged() -> None:
    from invariants.harness.fuzz import _not_generated

    assert not any("queue order" in line for line in _not_generated("vllm"))
    assert not any("queue order" in line for line in _not_generated("model"))
    assert not any("queue order" in line for line in _not_generated("reference"))
    assert any("queue order" in line for line in _not_generated("vllm-manager"))


# ------------------------------------------------------------------ traces against a target
def preemption_drive(factory: Callable[[Config], Any]) -> Drive:
    """Two growing requests in a pool too small for both, a third waiting: the step that
    preempts r1 leaves it in front of r2."""
    d = Drive(FULL_SWA, factory).do(
        AddRequest("r0", PROMPT[:7]), AddRequest("r1", PROMPT[::-1][:7]), AddRequest("r2", (9, 8, 7))
    )
    token = 0
    for _ in range(3):
        for rid in ("r0", "r1"):
            r = d.checker.model.requests[rid]
            if r.running and r.num_computed == r.num_tokens:
                token = token % 3 + 1
                d.do(Sample(rid, token))
        d.do(Step(("r0", "r1", "r2"), 64))
    return d


def connector_drive(factory: Callable[[Config], Any]) -> Drive:
    return Drive(FULL, factory).do(*model_ops())


QUEUE_TRACES: dict[str, Callable[[Callable[[Config], Any]], Drive]] = {
    "preempted_to_queue_back": preemption_drive,
    "skipped_holding_reversed": connector_drive,
    "skipped_holding_to_waiting": connector_drive,
}


@needs_vllm
@pytest.mark.vllm
def test_vllm_leaves_its_queues_as_the_model_states() -> None:
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    for trace in (preemption_drive, connector_drive):
        d = trace(VllmSchedulerTarget)
        assert d.found == []
        steps = [o for o in d.seen if isinstance(o, StepResult)]
        assert steps and all(o.queues is not None for o in steps)
    assert Queues(("r2", "r1"), ("r0",), ()) in [o.queues for o in steps]


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(QUEUE_TRACES))
def test_queue_mutant_is_caught(name: str) -> None:
    """Negative controls: each queue mutant of vLLM's scheduler is caught, by the queue
    order alone, on a trace the unmutated scheduler passes."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget
    from invariants.zoo.mutants_scheduler import activate

    assert QUEUE_TRACES[name](VllmSchedulerTarget).found == []
    with activate(name) as factory:
        found = QUEUE_TRACES[name](factory).found
    assert found and "the queues the step left" in found[0].message, found[:1]


@needs_vllm
@pytest.mark.vllm
def test_the_async_scheduler_is_judged_on_its_queues() -> None:
    """`AsyncScheduler` runs the same `schedule()`: its queues agree with the model
    (one step ahead), and the preemption mutant is caught there too (negative control)."""
    from invariants.targets.vllm_async_scheduler_target import VllmAsyncSchedulerTarget
    from invariants.zoo.mutants_scheduler import activate

    d = preemption_drive(VllmAsyncSchedulerTarget)
    assert d.found == []
    assert Queues(("r0",), (), ("r1", "r2")) in [o.queues for o in d.seen if isinstance(o, StepResult)]
    with activate("preempted_to_queue_back"):  # patches `Scheduler`, which AsyncScheduler inherits
        found = preemption_drive(VllmAsyncSchedulerTarget).found
    assert found and "the queues the step left" in found[0].message, found[:1]
