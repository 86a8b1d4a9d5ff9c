"""The fast path (deltas) against the audit (full snapshots, the catalogue as written).

- every target's `partial` equals the reference definition read off a full snapshot;
- on random runs of every target, checking by deltas and by the audit alone agree;
- a corruption of a block no delta lists escapes the fast path and is caught by the
  periodic audit, within `audit_every` operations.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from invariants.harness.checker import Checker, InvalidOp
from invariants.harness.known_findings import explain
from invariants.harness.machine import build_machine
from invariants.harness.run_stats import FuzzStats
from invariants.harness.strategies import configs
from invariants.targets import available_targets, target_factory
from invariants.targets.base import partial_from_snapshot, table_changes
from invariants.targets.model_target import ModelTarget
from model.contract.config import Config, GroupSpec
from model.contract.observation import Observation, StepResult
from model.contract.ops import AddRequest, Finish, Op, Preempt, Probe, Sample, Schedule, Step

TARGETS = ["model", "reference", "vllm-manager"]
CFG = Config(
    groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=6)), num_blocks=14, retention_interval=0
)


def _target(name: str):
    reason = available_targets().get(name)
    if reason is not None:
        pytest.skip(f"{name} unavailable: {reason}")
    return target_factory(name)


def random_ops(
    rng: random.Random, checker: Checker, n: int, seen: list[tuple[int, str, str]] | None = None
) -> list[Op]:
    """A well-formed random trace over a small alphabet (shared prefixes, pressure).
    Each step's violations go to `seen` (operation index, check, message); without
    it, every violation must be a known finding whose claim it meets."""
    ops: list[Op] = []
    prefix = tuple(rng.choice((1, 2)) for _ in range(9))
    next_rid = 0
    for _ in range(n):
        reqs = checker.model.requests
        kind = rng.choice(["add", "schedule", "schedule", "schedule", "step", "finish", "preempt", "probe"])
        op: Op | None = None
        if kind == "add" and len(reqs) < 4:
            op = AddRequest(
                f"r{next_rid}",
                prefix[: rng.randint(0, 9)] + tuple(rng.choice((1, 2, 3)) for _ in range(rng.randint(1, 9))),
            )
            next_rid += 1
        elif kind == "schedule" and reqs:
            rid = rng.choice(sorted(reqs))
            r = reqs[rid]
            op = (
                Sample(rid, rng.choice((1, 2)))
                if r.running and r.num_computed == r.num_tokens
                else Schedule(rid, rng.choice((1, 4, 8, 64)))
            )
            if r.num_tokens > 60:
                op = Finish(rid)
        elif kind == "step" and reqs:
            ready = sorted(r for r, q in reqs.items() if not (q.running and q.num_computed >= q.num_tokens))
            if ready:
                op = Step(tuple(rng.sample(ready, rng.randint(1, len(ready)))), rng.choice((4, 8, 64)))
        elif kind == "finish" and reqs:
            op = Finish(rng.choice(sorted(reqs)))
        elif kind == "preempt":
            running = sorted(rid for rid, r in reqs.items() if r.running)
            op = Preempt(rng.choice(running)) if running else None
        elif kind == "probe":
            op = Probe(prefix + (rng.choice((1, 2)),))
        if op is None:
            continue
        try:
            checker.validate(op)
        except InvalidOp:
            continue
        ops.append(op)
        found = checker.step(op)
        if seen is None:
            assert [v for v in found if explain(checker.target.name, v) is None] == [], op
        else:
            seen += [(len(ops) - 1, v.check, v.message) for v in found]
    return ops


@pytest.mark.parametrize("name", TARGETS)
def test_partial_equals_the_snapshot_definition(name):
    factory = _target(name)
    rng = random.Random(7)
    checker = Checker(factory(CFG), audit_every=1)
    random_ops(rng, checker, 80)
    target = checker.target
    snap = target.snapshot()  # drains events: both sides below see none
    blocks = set(rng.sample(range(1, CFG.num_blocks), 6))
    rids = sorted(snap.tables)[:2] + ["gone"]
    keys = set(list(snap.cached)[:3])
    assert target.partial(blocks, rids, keys) == partial_from_snapshot(snap, blocks, rids, keys)


@pytest.mark.parametrize("name", TARGETS)
def test_fast_path_agrees_with_audit_on_random_runs(name):
    factory = _target(name)
    for seed in range(3):
        fast = Checker(factory(CFG), audit_every=1000)
        by_delta: list[tuple[int, str, str]] = []
        ops = random_ops(random.Random(seed), fast, 120, by_delta)
        assert fast.audits == 0  # every step went by deltas, batched steps too
        assert any(isinstance(op, Step) for op in ops)
        shape = fast.shape()  # what the fuzz statistics count, from the mirror
        mirror = _mirror_state(fast)
        assert fast.audit() == []
        # The deltas kept the mirror as a full snapshot rebuilds it: the partial
        # reads skipped no block whose ref count or key changed.
        assert mirror == _mirror_state(fast)
        snap = fast.last
        assert shape == (len(snap.free_queue), len(snap.pinned_queue), len(snap.cached), len(snap.tables))
        full = Checker(factory(CFG), audit_every=1)
        by_audit = [(i, v.check, v.message) for i, op in enumerate(ops) for v in full.step(op)]
        # The same violations, at the same operations, whatever they are (no tolerance).
        assert sorted(by_delta) == sorted(by_audit)


def _mirror_state(checker: Checker) -> tuple[object, ...]:
    """The mirror's ref counts, keys, hash map, tables and counts (not the free-queue
    links of untouched blocks: a neighbour leaving the queue changes them unread)."""
    return (
        [state[:2] for state in checker._blocks],
        dict(checker._key_of),
        dict(checker._holders),
        dict(checker._tables),
        +checker._uses,
        set(checker._free_uncached),
        checker._in_use,
    )


@pytest.mark.parametrize("name", TARGETS)
def test_partial_given_the_tables_before_equals_the_snapshot_definition(name):
    factory = _target(name)
    rng = random.Random(11)
    checker = Checker(factory(CFG), audit_every=1)
    random_ops(rng, checker, 60)
    target = checker.target
    before = dict(target.snapshot().tables)
    random_ops(rng, checker, 6)
    snap = target.snapshot()
    rids = sorted(set(before) | set(snap.tables)) + ["gone"]
    blocks = set(rng.sample(range(1, CFG.num_blocks), 2))
    got = target.partial(blocks, rids, set(), before)
    assert got == partial_from_snapshot(snap, blocks, rids, set(), before)
    # The tables bring only blocks they held before or hold now.
    every = partial_from_snapshot(snap, blocks, rids, set())
    held_before = {b for table in before.values() for g in table for b in g}
    assert set(got.blocks) <= set(every.blocks) | held_before


def test_table_changes_start_at_the_first_difference():
    rng = random.Random(3)
    for _ in range(400):
        groups = rng.randint(1, 3)
        a = tuple(tuple(rng.choice((0, 1, 2, 3, 4)) for _ in range(rng.randint(0, 8))) for _ in range(groups))
        b = tuple(
            g[: rng.randint(0, len(g))] + tuple(rng.choice((0, 1, 5)) for _ in range(rng.randint(0, 3)))
            for g in a
        )
        left, joined = table_changes(a, b)
        want_left: list[int] = []
        want_joined: list[int] = []
        for x, y in zip(a, b):
            start = next((i for i in range(min(len(x), len(y))) if x[i] != y[i]), min(len(x), len(y)))
            want_left += [v for v in x[start:] if v]
            want_joined += [v for v in y[start:] if v]
        assert (left, joined) == (want_left, want_joined), (a, b)
    assert table_changes((), ((1, 2),)) == ([], [1, 2])
    assert table_changes(((1, 2),), ()) == ([1, 2], [])


@pytest.mark.parametrize("name", ["model", "reference"])
def test_machine_with_deltas_is_clean(name):
    """Clean apart from the known findings (eagle-swa-short-run-double-pop holds on the
    model and the reference too: they follow vLLM's Eagle SWA pops), each counted."""
    from invariants.harness.known_findings import is_known_violation

    stats = FuzzStats(audit_every=4)
    run_state_machine_as_test(
        build_machine(
            target_factory(name),
            configs(allow_fine=name != "reference"),
            stats,
            tolerated=lambda v: is_known_violation(name, v),
        )
    )
    assert stats.steps > 0


def reorder_free_queue(target: ModelTarget, order: Callable[[list[int]], list[int]]) -> None:
    """Rewrite a model target's free queue in place (the same queue object)."""
    q = target._model.pool.queue
    blocks = q.blocks
    for b in blocks:
        q.remove(b)
    q.append_n(order(blocks))


def swap_middle(blocks: list[int]) -> list[int]:
    """Two neighbours in the middle of the queue swapped; the head and tail stay."""
    i = len(blocks) // 2
    assert 0 < i < len(blocks) - 2
    return [*blocks[:i], blocks[i + 1], blocks[i], *blocks[i + 2 :]]


class MovesAnUntouchedBlock(ModelTarget):
    """Mutant: after its 6th operation, quietly swaps two free blocks in the middle
    of the queue; no operation names them and the queue's ends stay, so only a
    full snapshot shows it."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.n = 0

    def apply(self, op: Op) -> Observation:
        out = super().apply(op)
        self.n += 1
        if self.n == 6:
            reorder_free_queue(self, swap_middle)
        return out


OPS = [
    AddRequest("a", (1, 2, 3, 4, 5)),
    Schedule("a", 8),
    Sample("a", 1),
    AddRequest("b", (7, 7)),
    Schedule("b", 8),
]
MORE = [Probe((1, 2, 3, 4, 9)), Sample("b", 1), Probe((1, 2)), Probe((7, 7, 1)), Probe((5,)), Probe((6,))]


def _first_violation(checker: Checker, ops: list[Op]) -> int | None:
    for i, op in enumerate(ops):
        if checker.step(op):
            return i
    return None


def test_a_change_the_delta_does_not_list_is_caught_by_the_audit():
    cfg = Config(groups=(GroupSpec("full", 4),), num_blocks=16)
    ops = OPS + [Probe((1, 2, 3, 4, 9))] + MORE
    # The fast path alone does not see it (the corrupted block is never touched) ...
    blind = Checker(MovesAnUntouchedBlock(cfg), audit_every=10_000)
    assert _first_violation(blind, ops) is None
    # ... the end-of-run audit does,
    assert any(v.check == "snapshot" for v in blind.audit())
    # and so does the periodic audit, within audit_every operations of the corruption.
    periodic = Checker(MovesAnUntouchedBlock(cfg), audit_every=4)
    at = _first_violation(periodic, ops)
    assert at is not None and 5 <= at < 5 + 4


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000))
def test_fast_path_flags_what_the_audit_flags_on_a_visible_mutant(seed):
    """A mutant that corrupts a touched block is caught at the same step by both paths."""

    class LeaksOnFinish(ModelTarget):
        def apply(self, op: Op) -> Observation:
            if isinstance(op, Finish) and seed % 2:
                self._model.requests.pop(op.rid)
                from model.contract.observation import Done

                return Done()
            return super().apply(op)

    rng = random.Random(seed)
    ops = []
    probe = Checker(ModelTarget(CFG), audit_every=1)
    for i in range(4):
        ops += [
            AddRequest(f"r{i}", tuple(rng.choice((1, 2)) for _ in range(6))),
            Schedule(f"r{i}", 8),
            Finish(f"r{i}"),
        ]
    for op in ops:
        probe.step(op)
    fast = _first_violation(Checker(LeaksOnFinish(CFG), audit_every=1000), ops)
    full = _first_violation(Checker(LeaksOnFinish(CFG), audit_every=1), ops)
    assert fast == full
    assert (fast is not None) == bool(seed % 2)


class DropsATableEntryInAStep(ModelTarget):
    """Mutant: after each batched step, the first scheduled request loses the last
    block of its group-0 table (a block its forward pass reads, no longer held)."""

    def apply(self, op: Op) -> Observation:
        out = super().apply(op)
        if isinstance(op, Step) and isinstance(out, StepResult):
            for rid, result in out.results:
                table = self._model.groups[0].tables.get(rid)
                if result.scheduled and table:
                    self._model.pool.ref[table.pop()] -= 1
                    break
        return out


def test_a_batched_step_is_judged_on_the_fast_path_as_by_the_audit():
    ops: list[Op] = [AddRequest("a", (1, 2, 3, 4, 5, 6)), AddRequest("b", (1, 2, 9)), Step(("a", "b"), 64)]
    found = {}
    for every in (1, 1000):
        checker = Checker(DropsATableEntryInAStep(CFG), audit_every=every)
        for op in ops:
            violations = checker.step(op)
        found[every] = {v.check for v in violations}
        assert checker.audits == (len(ops) if every == 1 else 0)
    assert "step_blocks_stay_held" in found[1000]
    assert found[1000] == found[1]


def test_the_promise_probe_after_a_finish_answers_as_a_fresh_request():
    """The vLLM adapter serves the probe right after a Finish from the finished request
    (its hashes, no rehash): the answer equals a fresh request's and the model's."""
    factory = _target("vllm-manager")
    cfg = Config(groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=6)), num_blocks=32)
    prompt = (1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2)
    for sample in (False, True):
        target, model = factory(cfg), ModelTarget(cfg)
        ops: list[Op] = [AddRequest("a", prompt), Schedule("a", 64)]
        ops += [Sample("a", 3)] if sample else []
        for op in [*ops, Finish("a")]:
            target.apply(op)
            model.apply(op)
        reused, fresh = target.apply(Probe(prompt)), target.apply(Probe(prompt))
        assert reused == fresh == model.apply(Probe(prompt))
        assert reused.hit > 0
        assert target.driver.probe_seq == (2 if sample else 1)  # without outputs, no new request was built


def test_checks_skipped_on_an_untouched_delta_have_nothing_to_report(monkeypatch):
    """`check_delta` skips the checks that read only touched blocks and keys when an
    operation touched none: on random runs every skipped check, run anyway, reports
    nothing; and a corrupted touched block is still reported."""
    import invariants.catalogue as catalogue
    from invariants.catalogue.context import CheckContext, Delta, History, StateView

    skipped = [(n, f) for n, f in catalogue.FAST_CHECKS if (n, f) not in catalogue._UNTOUCHED_CHECKS]
    assert {n for n, _ in skipped} == set(catalogue.DELTA_CHECKS) | {"no_waste"}
    untouched = []
    real = catalogue.check_delta

    def every_check(ctx):
        if not (ctx.delta.blocks or ctx.delta.holders):
            untouched.append(type(ctx.op).__name__)
            assert [msg for _, f in skipped for msg in f(ctx)] == []
        return real(ctx)

    monkeypatch.setattr("invariants.harness.checker.check_delta", every_check)
    for seed in range(2):
        random_ops(random.Random(seed), Checker(ModelTarget(CFG), audit_every=1000), 120)
    assert {"AddRequest", "Probe"} <= set(untouched)
    # Negative control: a touched block with a negative ref count is still reported.
    bad = Delta({3: (-1, None, -1, -1)}, {}, {}, {}, {}, {}, set(), False, 0)
    view = StateView({})
    ctx = CheckContext(CFG, Finish("r"), None, view, view, History(), delta=bad)  # type: ignore[arg-type]
    assert "no_negative_ref_count" in {name for name, _ in real(ctx)}
