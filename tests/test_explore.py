"""Exhaustive small-scope search (`invariants.explore`, `kvretain explore`).

- a planted defect that needs one specific 5-operation sequence is found with
  exactly that shortest trace, which replays; the unmutated target is clean;
- the fingerprint merges renamed requests but never states that differ in
  free-queue order (negative control), and merging loses no state: the search
  reaches exactly the fingerprints a brute-force enumeration without merging does;
- a fork equals re-execution; the grid is valid; the certificate counts add up;
- the budget is kept; bad input exits 2.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest

from invariants.cli.main import main
from invariants.explore.alphabet import alphabet, rid_name
from invariants.explore.certificate import CLEAN, VIOLATION
from invariants.explore.fingerprint import canonical, fingerprint, request_names
from invariants.explore.fork import Freezer
from invariants.explore.grid import explore_grid
from invariants.explore.instances import Instance, default_grid, grid_by_name
from invariants.explore.search import Limits, _is_valid, explore, new_checker, replay
from invariants.harness.checker import Checker
from invariants.harness.trace import read_trace
from invariants.targets.model_target import ModelTarget
from model.contract.config import Config, GroupSpec, validate
from model.contract.free_queue import LinkedFreeQueue
from model.contract.observation import Done, Observation
from model.contract.ops import AddRequest, Finish, Op, Preempt, Schedule, Step

TINY = grid_by_name(["full-p3-r1"])[0]
TWO = Instance(
    "full-p5-r2-test",
    validate(Config(groups=(GroupSpec("full", 2),), num_blocks=5, max_model_len=24)),
    max_requests=2,
    prompt_lengths=(2, 3),
    budgets=(64,),
)


class LeaksAfterResume(ModelTarget):
    """Planted defect: finishing a request that was preempted and then re-admitted
    drops it without freeing its blocks. The shortest path is add, admit, preempt,
    re-admit, finish: five operations."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.preempted: set[str] = set()

    def apply(self, op: Op) -> Observation:
        if isinstance(op, Preempt):
            self.preempted.add(op.rid)
        req = self._model.requests.get(getattr(op, "rid", ""))
        if isinstance(op, Finish) and op.rid in self.preempted and req is not None and req.running:
            del self._model.requests[op.rid]  # its tables and ref counts stay: a leak
            return Done()
        return super().apply(op)


def _kinds(ops: list[Op]) -> list[str]:
    return [type(op).__name__ for op in ops]


def test_planted_defect_is_found_with_its_shortest_trace(tmp_path: Path) -> None:
    cert = explore(TINY, LeaksAfterResume, "model", Limits(6), out_dir=tmp_path)
    assert cert.verdict == VIOLATION
    assert cert.trace_length == 5 and cert.depth_completed == 4  # every shorter sequence was clean
    assert cert.reproduced
    trace = read_trace(cert.trace)  # type: ignore[arg-type]
    assert _kinds(trace.ops) in (
        [a, s1, "Preempt", s2, "Finish"]
        for a in ("AddRequest",)
        for s1 in ("Schedule", "Step")
        for s2 in ("Schedule", "Step")
    )
    assert trace.target == "model" and trace.violation
    # The trace file replays the defect from scratch; the unmutated model is clean on it.
    _, found = replay(LeaksAfterResume, trace.config, tuple(trace.ops), lambda v: None)
    assert found
    _, clean = replay(ModelTarget, trace.config, tuple(trace.ops), lambda v: None)
    assert not clean
    assert main(["replay", str(cert.trace), "--target", "model"]) == 0


def test_unmutated_target_is_clean_to_the_same_depth() -> None:
    cert = explore(TINY, ModelTarget, "model", Limits(5))
    assert cert.verdict == CLEAN and cert.depth_completed == 5
    assert cert.fork_checks == 2 and cert.error is None


def _checker_after(ops: list[Op], instance: Instance = TWO) -> Checker:
    checker = new_checker(ModelTarget, instance.config)
    for op in ops:
        assert checker.step(op) == []
    return checker


def _fp(checker: Checker) -> object:
    return fingerprint(checker.model, checker.history)


TWO_FREED: list[Op] = [
    AddRequest("r00", (1, 2)),
    AddRequest("r01", (2, 1)),
    Step(("r00", "r01"), 64),
    Finish("r00"),
    Finish("r01"),
]


def _reorder_queue(checker: Checker) -> None:
    """Swap the first two blocks of the model's free queue (nothing else changes)."""
    pool = checker.model.pool
    blocks = pool.queue.blocks
    blocks[0], blocks[1] = blocks[1], blocks[0]
    pool.queue = LinkedFreeQueue(blocks)


def test_fingerprint_keeps_free_queue_order() -> None:
    """Negative control: states that differ only in free-queue order are never merged."""
    a = _checker_after(TWO_FREED)
    b = copy.deepcopy(a)
    assert _fp(a) == _fp(b)
    _reorder_queue(b)
    assert a.model.snapshot().free_queue != b.model.snapshot().free_queue
    assert _fp(a) != _fp(b)
    # And they are different states: the same next operations hand out different blocks.
    nxt: list[Op] = [AddRequest("r02", (1, 1)), Schedule("r02", 64)]
    assert [a.model.apply(op) for op in nxt] != [b.model.apply(op) for op in nxt]


def test_fingerprint_merges_renamed_requests_only() -> None:
    renamed: list[Op] = [
        AddRequest("x", (1, 2)),
        AddRequest("y", (2, 1)),
        Step(("x", "y"), 64),
        Finish("x"),
        Finish("y"),
    ]
    assert _fp(_checker_after(TWO_FREED)) == _fp(_checker_after(renamed))
    # Arrival order is state (a step's FCFS queue): swapping the prompts is not a renaming.
    swapped: list[Op] = [AddRequest("r00", (2, 1)), AddRequest("r01", (1, 2)), Step(("r00", "r01"), 64)]
    same: list[Op] = [AddRequest("r00", (1, 2)), AddRequest("r01", (2, 1)), Step(("r00", "r01"), 64)]
    assert _fp(_checker_after(swapped)) != _fp(_checker_after(same))
    checker = _checker_after(same)
    assert request_names(checker.model, checker.history) == {"r00": "L0", "r01": "L1"}
    assert canonical(["r00", "zz", 3], {"r00": "L0"}) == ("L0", "zz", 3)


def _brute_force(instance: Instance, depth: int) -> set[object]:
    """Every fingerprint reachable in <= depth operations, each sequence re-executed
    from scratch, nothing merged."""
    seen = {_fp(new_checker(ModelTarget, instance.config))}
    layer: list[tuple[Op, ...]] = [()]
    for _ in range(depth):
        nxt = []
        for path in layer:
            base = _checker_after(list(path), instance)
            n_added = sum(isinstance(op, AddRequest) for op in path)
            for op in alphabet(instance, base.model, n_added, _is_valid(base)):
                checker = _checker_after([*path, op], instance)
                seen.add(_fp(checker))
                nxt.append((*path, op))
        layer = nxt
    return seen


def test_merging_loses_no_state() -> None:
    """With merging, the search reaches exactly the states brute force reaches."""
    cert = explore(TWO, ModelTarget, "model", Limits(3))
    assert cert.verdict == CLEAN and cert.depth_completed == 3
    assert cert.states == len(_brute_force(TWO, 3))


def test_merging_check_catches_an_unsound_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: a fingerprint that merges states with different futures (it keeps only
    counts) makes the search miss states that brute force reaches."""

    def coarse(model: object, history: object, snap: object = None, **_: object) -> object:
        reqs = model.requests.values()  # type: ignore[attr-defined]
        return (len(model.pool.queue), tuple(sorted(r.num_computed for r in reqs)))  # type: ignore[attr-defined]

    monkeypatch.setattr("invariants.explore.search.fingerprint", coarse)
    monkeypatch.setattr(f"{__name__}.fingerprint", coarse)
    cert = explore(TWO, ModelTarget, "model", Limits(3))
    assert cert.states < len(_brute_force(TWO, 3))


def test_certificate_counts() -> None:
    cert = explore(TWO, ModelTarget, "model", Limits(3))
    assert cert.states == sum(cert.new_states) and cert.new_states[0] == 1
    assert len(cert.new_states) == 4
    # Transitions: every operation the alphabet offers from every state of depth < 3.
    expected = 0
    layer: list[tuple[Op, ...]] = [()]
    seen = {_fp(_checker_after([]))}
    for _ in range(3):
        nxt = []
        for path in layer:
            base = _checker_after(list(path))
            ops = alphabet(TWO, base.model, sum(isinstance(op, AddRequest) for op in path), _is_valid(base))
            expected += len(ops)
            for op in ops:
                fp = _fp(_checker_after([*path, op]))
                if fp not in seen:
                    seen.add(fp)
                    nxt.append((*path, op))
        layer = nxt
    assert cert.transitions == expected
    data = cert.to_json()
    assert data["states"] == cert.states and data["verdict"] == CLEAN


def test_fork_equals_reexecution() -> None:
    ops: list[Op] = [
        AddRequest("r00", (1, 2, 1)),
        Schedule("r00", 2),
        AddRequest("r01", (1, 2)),
        Step(("r00", "r01"), 64),
    ]
    checker = _checker_after(ops)
    freezer = Freezer()
    thawed = freezer.thaw(freezer.freeze(checker))
    assert thawed.target.snapshot() == _checker_after(ops).target.snapshot()
    assert _fp(thawed) == _fp(checker)
    # A thawed copy is independent of its original.
    thawed.step(Finish("r00"))
    assert _fp(thawed) != _fp(checker)


def test_grid_configs_are_valid_and_span_the_layouts() -> None:
    grid = default_grid()
    assert len({i.name for i in grid}) == len(grid)
    for inst in grid:
        assert validate(inst.config) is inst.config
        assert 3 <= inst.config.num_blocks <= 8 and 1 <= inst.max_requests <= 3
    shapes = {tuple(g.kind for g in i.config.groups) for i in grid}
    assert {("full",), ("swa",), ("full", "swa"), ("full", "mamba"), ("full", "swa", "mamba")} <= shapes
    assert {i.config.retention_interval for i in grid} >= {None, 0, 2, 4}
    assert any(i.config.eagle for i in grid) and any(i.config.num_lookahead_tokens for i in grid)
    assert any(len({g.block_size for g in i.config.groups}) > 1 for i in grid)
    assert rid_name(3) == "r03"


def test_budget_is_kept_and_says_what_it_skipped() -> None:
    start = time.monotonic()
    report = explore_grid(default_grid()[:3], ModelTarget, "model", depth=30, max_states=10**6, budget_s=1.0)
    # Unbudgeted, depth 30 runs for hours; the slack is for a machine shared with other jobs.
    assert time.monotonic() - start < 10.0
    # Each instance says what the budget cut: its search ("budget spent"), or, where the budget
    # was gone before it started (a loaded machine), the whole instance (`skipped`).
    assert report.certificates
    for cert in report.certificates:
        assert cert.depth_completed < 30
        assert "budget spent" in cert.stopped or "budget was spent" in (cert.skipped or ""), cert


def test_cli_certificate_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    code = main(["explore", "--instance", "full-p3-r1", "--depth", "2", "--quiet", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "full-p3-r1" in text and "2/2" in text and "holds" in text
    data = json.loads(out.read_text())
    case = data["cases"][0]
    assert case["outcome"] == "passed" and case["figures"]["depth_completed"] == 2
    assert "configurations: 1232 checked" in text
    configs = data["cases"][-1]
    assert configs["name"] == "configurations" and configs["outcome"] == "passed"
    assert configs["figures"]["checked"] == 1232 and configs["figures"]["refused"] == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["explore", "--instance", "nope"],
        ["explore", "--depth", "0"],
        ["explore", "--max-states", "-1"],
        ["explore", "--budget-s", "0"],
        ["explore", "--target", "nope"],
    ],
)
def test_bad_input_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvretain: error:")


def test_all_alphabet_ops_are_valid_and_ordered() -> None:
    checker = _checker_after([AddRequest("r00", (1, 2)), Schedule("r00", 64)])
    ops = alphabet(TWO, checker.model, 1, _is_valid(checker))
    assert _kinds(ops)[:2] == ["AddRequest", "AddRequest"]
    assert all(_is_valid(checker)(op) for op in ops)
    assert not any(isinstance(op, Schedule) for op in ops)  # r00 owes a sample first


def test_parallel_grid_gives_the_sequential_certificates() -> None:
    grid = default_grid()[:3]
    one = explore_grid(grid, ModelTarget, "model", depth=3, max_states=10**6, budget_s=60.0)
    two = explore_grid(grid, ModelTarget, "model", depth=3, max_states=10**6, budget_s=60.0, jobs=2)
    assert [c.instance for c in two.certificates] == [i.name for i in grid]
    assert [(c.states, c.transitions, c.new_states) for c in one.certificates] == [
        (c.states, c.transitions, c.new_states) for c in two.certificates
    ]


class LeaksOnOnePrompt(LeaksAfterResume):
    """Planted defect needing one specific 5-operation sequence: the leak of
    `LeaksAfterResume`, for a request whose prompt is exactly (1, 2, 1, 1, 2)."""

    PROMPT = (1, 2, 1, 1, 2)

    def apply(self, op: Op) -> Observation:
        req = self._model.requests.get(getattr(op, "rid", ""))
        if isinstance(op, Finish) and req is not None and tuple(req.prompt) != self.PROMPT:
            self.preempted.discard(op.rid)
        return super().apply(op)


def test_a_defect_fuzzing_does_not_draw_is_found_with_its_shortest_trace(tmp_path: Path) -> None:
    """Seed-0 fuzzing ran 60 s (about 36,000 operations) without drawing it (the slow
    test below); the search finds it with its 5 operations."""
    cert = explore(TINY, LeaksOnOnePrompt, "model", Limits(5), out_dir=tmp_path)
    assert cert.verdict == VIOLATION and cert.trace_length == 5 and cert.reproduced
    first = cert.path[0]
    assert isinstance(first, AddRequest) and first.prompt == LeaksOnOnePrompt.PROMPT
    assert _kinds(list(cert.path))[2::2] == ["Preempt", "Finish"]


@pytest.mark.slow
def test_seed_0_fuzzing_does_not_draw_the_one_prompt_defect_in_60_s(tmp_path: Path) -> None:
    from invariants.harness.fuzz import run_fuzz

    report = run_fuzz(
        "model", factory=LeaksOnOnePrompt, budget_s=60, seed=0, progress=False, out_dir=tmp_path
    )
    assert report.failure is None and report.stats.steps > 10_000
