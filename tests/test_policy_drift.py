"""Two kinds of verdict: a defect (a contract broken) and *policy drift* (every contract
kept, one of vLLM's policy decisions made otherwise than the model predicts).

Model-only tests: a target that reports a different queue order (a policy, every
contract kept) drifts once, then is judged by the model-independent checks alone,
which still catch a planted contract break after the drift (negative control: the
same break without the drift is a defect too); the drift classifier refuses a
different preemption where one side preempted nobody or whose victims were not
running or still hold blocks, and a step
that differs beyond its queues; `KVRETAIN_DECLARED_POLICIES` and its bad input.

vLLM tests: the zoo mutant `preempt_oldest` (FCFS preempting the oldest running
request) is policy drift, not a violation; `preempt_keeps_computed_tokens` (a
contract break) is a defect with no drift; the unmutated scheduler is clean. A short
fuzz run under `preempt_oldest` ends "POLICY DRIFT" (exit 4, a declared policy 0),
its JSON row carries the `policy_drift` field, and replay says the same.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from drive import Drive

from invariants.harness.checker import (
    DECLARED_POLICIES_ENV,
    POLICY_DRIFT,
    Checker,
    declared_policies,
)
from invariants.targets.model_target import ModelTarget
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, GroupSpec
from model.contract.observation import Observation, Queues, ScheduleResult, Snapshot, StepResult
from model.contract.ops import AddRequest, Finish, Op, Sample

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_scheduler_queues import preemption_drive  # noqa: E402

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")


def drifting_drive(factory: Any) -> Drive:
    """`preemption_drive` (its last step preempts r1 with r2 waiting), then r0 runs on
    and finishes: operations after the step where a queue-order policy shows."""
    return preemption_drive(factory).steps(("r0",), 64, 2).do(Finish("r0"))


class WrongQueues(ModelTarget):
    """A target whose steps leave `waiting` in the reverse order: a queue-order policy of
    its own, every contract kept (its blocks are the model's)."""

    def apply(self, op: Op) -> Observation:
        obs = super().apply(op)
        if isinstance(obs, StepResult) and obs.queues is not None and len(obs.queues.waiting) > 1:
            q = obs.queues
            return replace(obs, queues=Queues(q.running, q.holding, q.waiting[::-1]))
        return obs


class Broken(ModelTarget):
    """A planted contract break: from its 12th operation on, its snapshots show a negative
    ref count on block 1 (`no_negative_ref_count`)."""

    applied = 0

    def apply(self, op: Op) -> Observation:
        self.applied += 1
        return super().apply(op)

    def snapshot(self) -> Snapshot:
        snap = super().snapshot()
        if self.applied < 12:
            return snap
        return replace(snap, ref_cnt=(snap.ref_cnt[0], -1, *snap.ref_cnt[2:]))


class WrongQueuesThenBroken(WrongQueues, Broken):
    pass


def test_a_queue_order_policy_of_its_own_is_drift_said_once() -> None:
    d = drifting_drive(WrongQueues)
    assert [v.check for v in d.found] == [POLICY_DRIFT], d.found
    v = d.found[0]
    assert v.policy == "queue-order"
    assert "the queues the step left (running, holding, waiting)" in v.message
    assert "model/policy/queues.py" in v.message and f"{DECLARED_POLICIES_ENV}=queue-order" in v.message
    c = d.checker
    assert c.drift == v and c.drift_at is not None
    # The operations after it were judged by the model-independent checks, none skipped.
    assert c.after_drift == len(c.ops) - 1 - c.drift_at > 0 and c.unjudged == 0
    assert d.audited() == d.found  # the last audit compares nothing with the model: clean
    # Control: the model itself (the prediction) never drifts from itself.
    assert drifting_drive(ModelTarget).found == []


def test_contracts_are_still_judged_after_the_drift() -> None:
    """After the drift the planted break is still caught, as the invariant it breaks (no
    snapshot difference: the model is no longer compared); without the drift the same
    break is a defect too (negative control of the post-drift judging)."""
    after = drifting_drive(WrongQueuesThenBroken)
    checks = [v.check for v in after.found]
    assert checks[0] == POLICY_DRIFT and after.checker.drift_at is not None
    assert after.checker.drift_at < 11, "the break must come after the drift for this test"
    assert "no_negative_ref_count" in checks[1:] and "snapshot" not in checks, checks
    alone = [v.check for v in drifting_drive(Broken).found]
    assert "no_negative_ref_count" in alone and POLICY_DRIFT not in alone


def _checker() -> Checker:
    c = Checker(ModelTarget(Config(groups=(GroupSpec("full", 4),), num_blocks=8, max_model_len=64)))
    for op in (AddRequest("a", (1, 2, 3)), AddRequest("b", (4, 5, 6))):
        c.step(op)
    c._running_before = frozenset({"a", "b"})
    return c


def _step(preempted: tuple[str, ...], waiting: tuple[str, ...] = ()) -> StepResult:
    return StepResult((("a", ScheduleResult(3, False)),), preempted, queues=Queues(("a",), (), waiting))


def test_the_drift_classifier_refuses_what_no_policy_explains() -> None:
    """Negative controls of `_drifted`: a different victim is drift only where the victim
    was running in the step and holds no block; a difference beyond the queues with the
    same victims is a defect."""
    assert _checker()._drifted(_step(("b",)), _step(("a",)), {}) is not None
    assert _checker()._drifted(_step(("b",)), _step(("z",)), {}) is None  # not running there
    assert _checker()._drifted(_step(("b",)), _step(("a",)), {"a": ((3,),)}) is None  # still holds
    assert _checker()._drifted(_step(("b",)), _step(("a", "a")), {}) is None  # twice
    # Whether to preempt at all is the allocator's mechanism, not the victim policy.
    assert _checker()._drifted(_step(()), _step(("a",)), {}) is None
    assert _checker()._drifted(_step(("b",)), _step(()), {}) is None
    differs = StepResult((("a", ScheduleResult(2, False)),), ("b",), queues=Queues(("a",), (), ()))
    assert _checker()._drifted(_step(("b",)), differs, {}) is None
    assert _checker()._drifted(_step((), ("a", "b")), _step((), ("b", "a")), {}) is not None
    assert _checker()._drifted(Sample, _step(()), {}) is None  # type: ignore[arg-type]


def test_declared_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    assert declared_policies("preemption, queue-order") == {"preemption", "queue-order"}
    assert declared_policies("") == frozenset()
    with pytest.raises(ValueError, match="unknown policy lifo"):
        declared_policies("preemption,lifo")
    v = preemption_drive(WrongQueues).found[0]
    assert not v.declared
    monkeypatch.setenv(DECLARED_POLICIES_ENV, "queue-order")
    assert v.declared


def test_a_bad_declaration_is_one_line_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from invariants.cli.main import main

    monkeypatch.setenv(DECLARED_POLICIES_ENV, "bogus")
    assert main(["fuzz", "--steps", "5", "--no-db"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown policy bogus" in err[0]


# ------------------------------------------------------------------ vLLM's real scheduler
def _preemption_trace(factory: Any) -> Drive:
    from test_vllm_scheduler import preemption_trace

    return preemption_trace(factory)


@needs_vllm
@pytest.mark.vllm
def test_preempting_the_oldest_is_policy_drift_not_a_violation() -> None:
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget
    from invariants.zoo.mutants_scheduler import activate

    clean = _preemption_trace(VllmSchedulerTarget)
    assert clean.found == [] and clean.checker.drift is None and clean.preempted
    with activate("preempt_oldest") as factory:
        d = _preemption_trace(factory)
    assert [v.check for v in d.found] == [POLICY_DRIFT], d.found
    v = d.found[0]
    assert v.policy == "preemption"
    assert "vllm preempted r0 where the model's vLLM-policy prediction" in v.message
    assert "preempted r1" in v.message and "self.running.pop()" in v.message
    assert "KVRETAIN_DECLARED_POLICIES=preemption" in v.message


@needs_vllm
@pytest.mark.vllm
def test_a_contract_break_is_a_defect() -> None:
    from test_vllm_scheduler import LIFECYCLE, lifecycle

    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget
    from invariants.zoo.mutants_scheduler import activate

    # LIFECYCLE's pool preempts (engine steps: pool pressure preempts, no client does).
    assert lifecycle(LIFECYCLE, VllmSchedulerTarget).found == []
    with activate("preempt_keeps_computed_tokens") as factory:
        d = lifecycle(LIFECYCLE, factory)
    checks = [v.check for v in d.found]
    assert "scheduler_queues_consistent" in checks and POLICY_DRIFT not in checks
    assert d.checker.drift is None


@needs_vllm
@pytest.mark.vllm
def test_fuzz_and_replay_report_drift_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short fuzz run of the engine's own steps under `preempted_to_queue_back` (a preempted
    request queued behind the waiting ones, every contract kept): POLICY DRIFT (exit 4), no
    violation, the drift's trace written; the JSON row's `policy_drift` field; declared:
    exit 0; the trace replays as drift under the mutant and clean on vLLM."""
    from invariants.harness.fuzz import format_summary, run_fuzz
    from invariants.harness.replay import replay
    from invariants.harness.trace import read_trace
    from invariants.results import fuzz_case, results_json
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget
    from invariants.zoo.mutants_scheduler import activate
    from invariants.zoo.runner import config_strategy

    class Anonymous(VllmSchedulerTarget):
        # Identities only change the example stream; the drift is in requests without them.
        identities: frozenset[str] = frozenset()

    strategy = config_strategy("scheduler", allow_pinning=False, allow_fine=True, real_scheduler=True)
    with activate("preempted_to_queue_back") as factory:
        report = run_fuzz(
            "vllm",
            factory=Anonymous,
            strategy=strategy,
            steps=2000,
            seed=0,
            budget_s=60,
            shrink_s=10,
            out_dir=tmp_path,
            progress=False,
            stop_at_drift=True,
        )
        assert report.failure is None, report.failure
        assert report.drifts >= 1 and report.verdict == "POLICY DRIFT" and report.exit_code == 4
        assert "POLICY DRIFT in" in format_summary([report])
        case = fuzz_case(report)
        payload = json.loads(results_json("fuzz", [case], report.exit_code))
        assert payload["policy_drift"] == 1 and case.outcome == "failed"
        assert payload["cases"][0]["policy_drift"]["policy"] == "queue-order"
        assert report.drift_trace_path is not None and report.drift_trace_path.exists()
        trace = read_trace(str(report.drift_trace_path))
        monkeypatch.setattr("invariants.harness.replay.target_factory", lambda name: factory)
        mutated = replay(trace, "vllm")
        assert mutated.clean and mutated.drift and mutated.verdict == "POLICY DRIFT"
        monkeypatch.setenv(DECLARED_POLICIES_ENV, "queue-order")
        assert report.exit_code == 0 and report.verdict == "POLICY DRIFT (declared)"
    monkeypatch.undo()
    unmutated = replay(trace, "vllm")
    assert unmutated.verdict == "clean", (unmutated.violations, unmutated.drift)
