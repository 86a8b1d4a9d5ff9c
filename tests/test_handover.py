"""The hand-over from fuzzing to explore (`invariants.explore.handover`, `sentence`).

- a long trace that reaches a planted defect comes back as the shortest
  sequence over its own operations, same check, replayable; a trace that is
  already shortest is said to be, with every shorter sequence checked;
- a violation of another check prunes its path, counted, and never stands in
  for the one handed over;
- the sentence names the operation and the first field that differs;
- ids are not renamed in a vocabulary search (control: renaming would merge
  states whose continuations differ);
- a checker holding a mutant's rebound method or local class forks correctly;
- the zoo hands its fuzz traces over and reports both lengths.
"""

from __future__ import annotations

import time
import types
from pathlib import Path
from typing import Any

from invariants.explore.configs import check_configurations
from invariants.explore.fingerprint import fingerprint
from invariants.explore.fork import Freezer
from invariants.explore.handover import shortest_trace, vocabulary
from invariants.explore.instances import default_grid
from invariants.explore.search import new_checker, replay
from invariants.explore.sentence import describe_op, first_field_difference
from invariants.harness.checker import Checker, Violation
from invariants.harness.fuzz import replayer
from invariants.harness.trace import read_trace
from invariants.targets.base import TargetCrash, TargetRefusal
from invariants.targets.model_target import ModelTarget
from invariants.targets.reference import ReferenceTarget
from invariants.zoo.explore_hunt import format_kills, hunt
from invariants.zoo.runner import reference_entries, run_entry, unmutated_entry
from model.contract.config import Config, GroupSpec, validate
from model.contract.observation import Done, Observation, ScheduleResult, StepResult
from model.contract.ops import AddRequest, Finish, Op, Preempt, Probe, Sample, Schedule, Step

CFG = validate(Config(groups=(GroupSpec("full", 2),), num_blocks=6, max_model_len=24))


class LeaksAfterResume(ModelTarget):
    """Planted defect: finishing a request that was preempted and re-admitted drops
    it without freeing its blocks (shortest: add, admit, preempt, re-admit, finish)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.preempted: set[str] = set()

    def apply(self, op: Op) -> Observation:
        if isinstance(op, Preempt):
            self.preempted.add(op.rid)
        req = self.model.requests.get(getattr(op, "rid", ""))
        if isinstance(op, Finish) and op.rid in self.preempted and req is not None and req.running:
            del self.model.requests[op.rid]
            return Done()
        return super().apply(op)


PADDED: list[Op] = [
    AddRequest("a", (1, 2, 1)),
    Probe((1, 2)),
    AddRequest("b", (2, 2)),
    Step(("a", "b"), 64),
    Finish("b"),
    Probe((1, 2, 1)),
    Preempt("a"),
    Schedule("a", 64),
    Finish("a"),
]


def _violation(ops: list[Op]) -> Violation:
    _, found = replay(LeaksAfterResume, CFG, tuple(ops), lambda v: None)
    assert found, "the padded trace must reach the planted defect"
    return found[0]


def _deadline() -> float:
    return time.monotonic() + 60


def test_a_long_trace_comes_back_shortest_over_its_operations() -> None:
    v = _violation(PADDED)
    h = shortest_trace(
        CFG, PADDED, v, LeaksAfterResume, "model", tolerate=lambda v: None, deadline=_deadline()
    )
    assert h.shorter and len(h.ops) == 5 and h.original == len(PADDED)
    assert h.depth_completed == 4  # every sequence of <= 4 of its operations was clean
    kinds = [type(op).__name__ for op in h.ops]
    assert kinds[0::2] == ["AddRequest", "Preempt", "Finish"]
    assert {kinds[1], kinds[3]} <= {"Step", "Schedule"}  # admitted alone, or by a step over it alone
    assert h.violation.check == v.check
    _, again = replay(LeaksAfterResume, CFG, h.ops, lambda v: None)
    assert again and again[0].check == v.check
    _, clean = replay(ModelTarget, CFG, h.ops, lambda v: None)
    assert not clean
    assert h.sentence.startswith("op 4 (finish a)")
    assert "shortest trace 5 operations (fuzz: 9)" in h.summary()


def test_a_shortest_trace_is_said_to_be_one() -> None:
    ops: list[Op] = [
        AddRequest("a", (1, 2, 1)),
        Schedule("a", 64),
        Preempt("a"),
        Schedule("a", 64),
        Finish("a"),
    ]
    h = shortest_trace(
        CFG, ops, _violation(ops), LeaksAfterResume, "model", tolerate=lambda v: None, deadline=_deadline()
    )
    assert not h.shorter and h.depth_completed == 4 and list(h.ops) == ops
    assert "are shortest over its vocabulary" in h.summary()


def test_another_check_prunes_its_path_and_is_counted() -> None:
    v = _violation(PADDED)
    other = Violation("not_" + v.check, "x")
    deadline = time.monotonic() + 5  # the second search (explore alphabet) would go on to depth 6
    h = shortest_trace(
        CFG, PADDED, other, LeaksAfterResume, "model", tolerate=lambda v: None, deadline=deadline
    )
    assert not h.shorter and h.other_violations > 0
    assert h.violation is other


def test_the_budget_is_kept() -> None:
    v = _violation(PADDED)
    start = time.monotonic()
    h = shortest_trace(
        CFG, PADDED, v, LeaksAfterResume, "model", tolerate=lambda v: None, deadline=start + 0.01
    )
    assert time.monotonic() - start < 5 and "budget spent" in h.stopped
    assert list(h.ops) == PADDED


def test_vocabulary_adds_each_step_over_fewer_requests() -> None:
    vocab = vocabulary([AddRequest("a", (1,)), Step(("a", "b", "c"), 4), AddRequest("a", (1,))])
    steps = [op.rids for op in vocab if isinstance(op, Step)]
    assert steps == [("a", "b", "c"), ("a", "b"), ("a", "c"), ("b", "c"), ("a",), ("b",), ("c",)]
    assert sum(isinstance(op, AddRequest) for op in vocab) == 1


def test_first_field_difference_names_the_field() -> None:
    want = StepResult((("r0", ScheduleResult(4, True, hit=2)), ("r1", ScheduleResult(2, True, hit=0))))
    got = StepResult((("r0", ScheduleResult(4, True, hit=2)), ("r1", ScheduleResult(2, True, hit=2))))
    assert first_field_difference(want, got) == ("results[r1].hit", 0, 2)
    assert first_field_difference(want, want) is None
    assert first_field_difference(ScheduleResult(1, True), None) == (
        "the result",
        ScheduleResult(1, True),
        None,
    )
    assert describe_op(Step(("r0", "r1"), 8)) == "step r0,r1 budget 8"


def test_a_vocabulary_search_does_not_rename_requests() -> None:
    """Control: with renaming, a state holding request a and one holding request b
    (same prompt) merge, though an operation naming a only applies to one of them."""

    def after(ops: list[Op]) -> Checker:
        checker = new_checker(ModelTarget, CFG)
        for op in ops:
            assert checker.step(op) == []
        return checker

    a, b = after([AddRequest("a", (1, 2))]), after([AddRequest("b", (1, 2))])
    assert fingerprint(a.model, a.history) == fingerprint(b.model, b.history)
    assert fingerprint(a.model, a.history, rename=False) != fingerprint(b.model, b.history, rename=False)


class Holder:
    n = 0


def test_a_rebound_method_and_a_local_class_fork_with_their_copy() -> None:
    """A mutant rebinds a method on one object (plain pickle saves it by a name that
    does not exist) or defines its class in a function: the fork still works, and
    the copy's method acts on the copy."""

    class Local(Holder):
        pass

    def bump(self: Holder) -> None:
        self.n += 1

    for obj in (Holder(), Local()):
        obj.step = types.MethodType(bump, obj)  # type: ignore[attr-defined]
        freezer = Freezer()
        twin: Any = freezer.thaw(freezer.freeze(obj))  # type: ignore[arg-type]
        twin.step()
        assert (twin.n, obj.n) == (1, 0) and type(twin) is type(obj)
        assert freezer.plain is False


def test_the_zoo_hands_a_fuzz_trace_over(tmp_path: Path) -> None:
    entry = reference_entries(["negative_block_count"])[0]
    r = run_entry(entry, budget_s=30, shrink_s=5, out_dir=tmp_path, progress=False)
    assert r.killed and r.fuzz_ops is not None and r.handover is not None
    assert len(r.handover.ops) <= r.fuzz_ops
    assert r.trace_lengths().startswith(f"{r.fuzz_ops} -> {len(r.handover.ops)} (<=")
    assert r.detail == r.handover.sentence and r.detail.startswith("op ")
    trace = read_trace(r.trace_path)  # type: ignore[arg-type]
    assert len(trace.ops) == len(r.handover.ops)


def test_zoo_explore_gives_the_shortest_depth_over_the_grid(tmp_path: Path) -> None:
    grid = default_grid()
    entry = reference_entries(["reuse_without_evict"])[0]
    k = hunt(entry, grid, depth=4, budget_s=60, out_dir=tmp_path)
    assert k.killed and k.length == 2 and k.instance == grid[0].name
    assert k.trace is not None and read_trace(k.trace).violation
    # Iterative deepening: every instance was clean to depth 1 before the depth-2 kill.
    assert k.covered[0] == ("configurations", 0, "clean")
    assert all(d >= 1 or verdict == "skipped" for _, d, verdict in k.covered[1:])
    assert len(k.covered) == len(grid) + 1  # and the configurations, depth 0
    # Control: the unmutated reference is clean over the same grid to depth 2.
    clean = hunt(unmutated_entry("reference", "generated", ()), grid, depth=2, budget_s=60)
    assert not clean.killed and clean.skipped == 0
    assert {verdict for _, _, verdict in clean.covered} <= {"clean", "skipped"}
    assert "1/2 killed by exhaustive search alone" in format_kills([k, clean])


class LeaksPastFiveTokens(ModelTarget):
    """Planted defect: finishing a request that computed 5 or more tokens drops it
    without freeing its blocks (by decoding, or by a longer prompt)."""

    def apply(self, op: Op) -> Observation:
        req = self.model.requests.get(getattr(op, "rid", ""))
        if isinstance(op, Finish) and req is not None and req.num_computed >= 5:
            del self.model.requests[op.rid]
            return Done()
        return super().apply(op)


def test_the_explore_alphabet_finds_what_the_traces_own_operations_cannot() -> None:
    """The trace decodes past 5 tokens; a 5-token prompt gets there in 3 operations,
    which no sequence of the trace's own operations does."""
    ops: list[Op] = [AddRequest("a", (1, 2, 1)), Schedule("a", 64)]
    decode: list[Op] = [Sample("a", 2), Schedule("a", 64)]
    ops += decode * 2 + [Finish("a")]
    _, found = replay(LeaksPastFiveTokens, CFG, tuple(ops), lambda v: None)
    assert found
    h = shortest_trace(
        CFG, ops, found[0], LeaksPastFiveTokens, "model", tolerate=lambda v: None, deadline=_deadline()
    )
    assert len(h.ops) == 3 and "the explore alphabet found 3" in h.stopped
    first = h.ops[0]
    assert isinstance(first, AddRequest) and len(first.prompt) == 5
    assert h.depth_completed == len(ops) - 1  # the trace's own operations: nothing shorter


def test_a_laxer_configuration_rule_dies_at_depth_0() -> None:
    """The configurations are operation zero: the reference's retention-validation
    mutant builds what the model rejects; the unmutated reference builds none of it."""
    entry = reference_entries(["retention_validation_lax"])[0]
    k = hunt(entry, default_grid(), depth=1, budget_s=60)
    assert k.killed and k.length == 0 and k.instance == "configurations"
    assert "accepted a configuration the model rejects: prefix_cache_retention_interval" in k.violation
    report = check_configurations(ReferenceTarget)
    assert report.ok and report.checked == 1232
    assert report.valid > 0 and report.checked - report.valid > 0  # both kinds are in the domain

    def crashes(config: Config) -> ReferenceTarget:
        raise RuntimeError("boom")

    bad = check_configurations(crashes, keep=1)
    assert not bad.ok and "raised RuntimeError: boom, not ConfigError" in bad.violations[0][1].message


class CrashesOnResumedFinish(ModelTarget):
    """Planted crash: finishing a request that was preempted and re-admitted raises
    (shortest: add, admit, preempt, re-admit, finish). `steered` refuses a step that
    names fewer requests than are live, as an engine target does (`TargetRefusal`);
    its control raises a plain `TargetCrash` there instead."""

    refusal: type[Exception] = TargetRefusal

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.preempted: set[str] = set()

    def apply(self, op: Op) -> Observation:
        if isinstance(op, Step) and set(op.rids) != set(self.model.requests):
            raise self.refusal(f"step over {list(op.rids)}: held {sorted(self.model.requests)}")
        if isinstance(op, Preempt):
            self.preempted.add(op.rid)
        if isinstance(op, Finish) and op.rid in self.preempted:
            raise TargetCrash(f"finish {op.rid}: planted crash")
        return super().apply(op)


class CrashesOnSteeredStep(CrashesOnResumedFinish):
    refusal = TargetCrash


STEERED: list[Op] = [
    AddRequest("a", (1, 2, 1)),
    AddRequest("b", (2, 2)),
    Step(("a", "b"), 64),
    Finish("b"),
    Preempt("a"),
    Step(("a",), 64),
    Finish("a"),
]


def test_a_refused_step_is_no_trace_of_the_crash_hunted() -> None:
    """The hand-over and the shrink predicate skip a candidate the target refuses (a step
    over a subset of the live requests): the crash they return is the planted one.
    Control: where the same refusal is a plain crash, both take it for the crash hunted."""
    found = {}
    for target in (CrashesOnResumedFinish, CrashesOnSteeredStep):
        _, violations = replay(target, CFG, tuple(STEERED), lambda v: None)
        assert [v.check for v in violations] == ["crash"] and "planted crash" in violations[0].message
        h = shortest_trace(
            CFG, STEERED, violations[0], target, "model", tolerate=lambda v: None, deadline=_deadline()
        )
        fails = replayer(target, CFG, "crash", lambda v: None)
        found[target] = (h, fails([AddRequest("a", (1, 2, 1)), AddRequest("b", (2, 2)), Step(("a",), 64)]))
    h, refused = found[CrashesOnResumedFinish]
    assert "planted crash" in h.violation.message and isinstance(h.ops[-1], Finish) and refused is None
    h, crashed = found[CrashesOnSteeredStep]
    assert "step over" in h.violation.message and len(h.ops) < len(STEERED) and crashed == 2
