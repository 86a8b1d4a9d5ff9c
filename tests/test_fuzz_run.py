"""`kvretain fuzz` as a promise: the budget bounds the run, shrinking included;
a violation is reported the moment it is seen; failures are remembered."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from hypothesis import strategies as st

from invariants.cli.main import main
from invariants.harness.fuzz import run_fuzz
from invariants.harness.shrink import shrink
from invariants.harness.trace import read_trace
from invariants.targets.model_target import ModelTarget
from model.contract.config import Config, GroupSpec
from model.contract.observation import Done, Observation
from model.contract.ops import AddRequest, Finish, Op, Schedule, Step

CFG = Config(groups=(GroupSpec("full", 4),), num_blocks=12)


class Leak(ModelTarget):
    """A broken target whose violation needs a few finishes."""

    name = "leak"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.finishes = 0

    def apply(self, op: Op) -> Observation:
        if isinstance(op, Finish):
            self.finishes += 1
            if self.finishes >= 3:
                return Done()  # the request's blocks are never freed: a leak
        return super().apply(op)


class SlowLeak(Leak):
    """`Leak` whose every operation is slow, so that shrinking a failure takes far longer
    than the budget (for the tests of the budget; the others use `Leak`, whose runs end
    once the failure is shrunk instead of sleeping through a budget)."""

    name = "slow-leak"

    def apply(self, op: Op) -> Observation:
        time.sleep(0.02)
        return super().apply(op)


def test_budget_bounds_a_slow_shrink(tmp_path):
    lines: list[str] = []
    start = time.monotonic()
    report = run_fuzz(
        "model",
        factory=SlowLeak,
        strategy=st.just(CFG),
        budget_s=6.0,
        shrink_s=60.0,
        out_dir=tmp_path,
        progress=False,
        log=lines.append,
    )
    elapsed = time.monotonic() - start
    assert report.failure is not None
    assert elapsed < 6.0 + 4.0, elapsed  # budget plus the shrink grace plus one replay
    assert lines[0].startswith("violation: ") and "seed 0" in lines[0]
    assert any(line.startswith("shrunk ") for line in lines)
    # The trace on disk is the final (shrunk) one, and it replays to a violation.
    trace = read_trace(report.trace_path)
    assert len(trace.ops) == len(report.failure.ops) <= report.unshrunk_ops


@pytest.mark.parametrize(
    ("budget_s", "spent_s", "searched_s"),
    [(300.0, 19.0, 60.0), (40.0, 19.0, 21.0), (None, 19.0, 30.0)],
)
def test_hand_over_to_explore_gets_the_budget_left_at_most_a_minute(
    monkeypatch, budget_s, spent_s, searched_s
):
    """A violation found 19 s into a 300 s run ends about a minute later, not at 300 s
    (the verdict is printed before the search). Control: a budget with less left than
    the cap gives the search what is left; none gives it HANDOVER_S."""
    import invariants.explore.handover as handover
    from invariants.cli import fuzz as fuzz_cli

    deadlines: list[float] = []

    def shortest_trace(*args, deadline, **kw):
        deadlines.append(deadline - time.monotonic())
        raise StopIteration

    monkeypatch.setattr(handover, "shortest_trace", shortest_trace)
    failure = SimpleNamespace(config=CFG, ops=[], violations=["planted"])
    report = SimpleNamespace(failure=failure, seconds=spent_s, target="model", trace_path=None, seed=0)
    with pytest.raises(StopIteration):
        fuzz_cli._hand_over(report, budget_s)
    assert searched_s - 1.0 < deadlines[0] <= searched_s


def test_first_violation_written_before_shrinking(tmp_path):
    seen: list[bool] = []

    def log(line: str) -> None:
        if line.startswith("violation: "):
            seen.append((tmp_path / "kvretain-model-seed0.json").exists())

    run_fuzz(
        "model",
        factory=Leak,
        strategy=st.just(CFG),
        budget_s=5.0,
        out_dir=tmp_path,
        progress=False,
        log=log,
    )
    assert seen == [True]


def test_shrink_respects_its_deadline():
    ops: list[Op] = [AddRequest(f"r{i}", (1, 2, 3)) for i in range(50)]

    def fails(candidate: list[Op]) -> int | None:
        time.sleep(0.05)
        return len(candidate) - 1 if len(candidate) >= 10 else None

    start = time.monotonic()
    best, tries = shrink(ops, fails, time.monotonic() + 0.5)
    assert time.monotonic() - start < 0.5 + 0.2
    assert 10 <= len(best) < 50 and tries > 0


def test_shrink_finds_the_minimum_when_time_allows():
    ops: list[Op] = [AddRequest("a", (1, 2, 3, 4)), Schedule("a", 8)] + [
        AddRequest(f"r{i}", (5,)) for i in range(20)
    ]

    def fails(candidate: list[Op]) -> int | None:  # fails once "a" is scheduled
        for i, op in enumerate(candidate):
            if op == Schedule("a", 8) or (isinstance(op, Schedule) and op.rid == "a"):
                return (
                    i
                    if any(o == AddRequest("a", o.prompt) for o in candidate[:i] if isinstance(o, AddRequest))
                    else None
                )
        return None

    best, _ = shrink(ops, fails, time.monotonic() + 10)
    assert len(best) == 2 and isinstance(best[1], Schedule)


def test_shrink_takes_a_dropped_request_out_of_the_steps_it_shared():
    """Requests batched with the culprit go, although every step names them."""
    ops: list[Op] = [AddRequest(f"r{i}", (i + 1,)) for i in range(16)] + [AddRequest("a", (1, 2, 3, 4))]
    ops += [Step(tuple(f"r{i}" for i in range(j, j + 4)) + ("a",), 8) for j in range(0, 16, 4)]

    def fails(candidate: list[Op]) -> int | None:  # fails at the fourth step that schedules "a"
        if not any(op == AddRequest("a", (1, 2, 3, 4)) for op in candidate):
            return None
        steps = [i for i, op in enumerate(candidate) if isinstance(op, Step) and "a" in op.rids]
        return steps[3] if len(steps) >= 4 else None

    best, _ = shrink(ops, fails, time.monotonic() + 10)
    assert best == [AddRequest("a", (1, 2, 3, 4))] + [Step(("a",), 8)] * 4


def test_budget_decides_without_steps(capsys):
    assert main(["fuzz", "--target", "model", "--budget-s", "3", "--no-db"]) == 0
    out = capsys.readouterr().out
    assert "until the budget" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("model "))
    steps, seconds = int(row[5]), float(row[-1])
    assert steps > 0 and 2.5 < seconds < 3 + 1  # the budget, not 2,000 steps, ended the run


def test_numeric_arguments_are_validated(capsys):
    for argv in (
        ["--steps", "-5"],
        ["--steps", "0"],
        ["--budget-s", "0"],
        ["--budget-s", "nan"],
        ["--shrink-s", "-1"],
    ):
        assert main(["fuzz", "--target", "model", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and argv[0] in err[0], err
    # The other commands' counts and budgets too: each of these ran before (verify and the
    # zoo the whole job; conformance with -3 steps; plan issued "-1 prefixes"; prove ran
    # CrossHair for -3 s and failed its controls).
    for argv in (
        ["verify", "--steps", "0"],
        ["verify", "--budget-s", "-5"],
        ["conformance", "--steps", "-3"],
        ["conformance", "--budget-s", "-1"],
        ["zoo", "--shrink-s", "-1"],
        ["plan", "--preset", "dsv4-tiny", "--pool-blocks", "100", "--max-prefixes", "-1"],
        ["prove", "--crosshair", "-3"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and argv[-2] in err[0], err


def test_failures_are_remembered(tmp_path):
    """A failure found once is replayed first next run (the example database)."""
    db = tmp_path / "examples"
    kw = dict(factory=Leak, strategy=st.just(CFG), out_dir=tmp_path, progress=False, database=db)
    first = run_fuzz("model", seed=1, budget_s=20.0, **kw)
    assert first.failure is not None and any(db.rglob("*"))
    again = run_fuzz("model", seed=99, budget_s=20.0, **kw)
    assert again.failure is not None
    assert again.stats.examples == 1  # the remembered example, first
    none = run_fuzz("model", seed=99, budget_s=20.0, **{**kw, "database": None})
    assert none.stats.examples >= again.stats.examples


def test_trace_names_the_violation(tmp_path):
    report = run_fuzz(
        "model", factory=Leak, strategy=st.just(CFG), budget_s=20.0, out_dir=tmp_path, progress=False
    )  # the run ends at the catch; 5 s ran out before it on a worker sharing a loaded machine
    data = json.loads(report.trace_path.read_text())
    assert data["violation"] and data["violation"].split(":")[0] == report.failure.violations[0].check


def test_production_scale_runs_real_presets(capsys):
    assert main(["fuzz", "--target", "model", "--scale", "production", "--steps", "150", "--no-db"]) == 0
    out = capsys.readouterr().out
    assert "156,281" in out  # dsv4-flash at vLLM's 14.5x concurrency for 1M tokens
    assert "checked tok/s" in out and "peak RSS MiB" in out and "clean" in out


def test_production_settings_and_a_clean_episode():
    from invariants.harness.production import (
        CONCURRENCY,
        FINE_HASH,
        run_production,
        settings_for,
    )
    from model.contract.fine_mamba import fine_hits_enabled

    plan = settings_for(0)
    assert {s.name for s in plan if s.squeezed} == {"dsv4-flash", "gemma-like", "kimi-linear-like"}
    assert {s.config.retention_interval is None for s in plan} == {True, False}
    assert all(s.config.num_blocks >= CONCURRENCY for s in plan)
    assert {s.config.eagle for s in plan} == {True, False}  # speculative decoding every other episode
    first = plan[:3]  # a short budget meets every preset and every retention kind
    assert len({s.name for s in first}) == 3
    # ... and vLLM's fine-grained prefix matching, which only kimi's aligned Mamba groups allow
    fine = [s for s in plan if fine_hits_enabled(s.config)]
    assert {s.name for s in fine} == {"kimi-linear-like"} and {s.config.hash_block_size for s in fine} == {
        FINE_HASH
    }
    assert len(fine) == 6 and any(fine_hits_enabled(s.config) for s in first)  # 3 retentions x 2 pools
    # ... and serving without prefix caching, Mamba groups in 'none' mode
    off = [s for s in plan if not s.config.enable_caching]
    assert {s.name for s in off} == {"kimi-linear-like"} and {s.squeezed for s in off} == {True, False}
    assert all(g.mamba_cache_mode == "none" for s in off for g in s.config.groups if g.kind == "mamba")
    assert len({s.config.retention_interval is None or s.config.retention_interval == 0 for s in first}) == 2
    stats, failures, _ = run_production(
        ModelTarget, seed=1, steps=120, budget_s=120, tolerated=lambda v: False, log=lambda line: None
    )
    assert not failures and stats.ops == 120 and stats.tokens > 0


def test_production_rejects_a_preset_argument(capsys):
    assert main(["fuzz", "--scale", "production", "--config", "dsv4-tiny"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_an_unknown_preset_is_one_line_and_nothing_else(capsys, tmp_path):
    assert main(["fuzz", "--target", "model", "--config", "no-such-preset", "--out", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "no-such-preset" in err
    assert not list(tmp_path.iterdir())


def test_shrinking_a_prompt_keeps_its_multimodal_items_within_it():
    """A shortened prompt drops every item that no longer fits whole, so the shrunk trace
    loads (`model.contract.ops.op_from_json` validates item bounds) and no item is cut short:
    an identifier (a content hash) fixes its length, and a shorter item under the same one
    is an input no engine gets (a zoo trace so shrunk failed unmutated vLLM: two requests
    with one image identifier at two lengths)."""
    from dataclasses import replace

    import pytest

    from model.contract.ops import op_from_json, op_to_json

    add = AddRequest("a", tuple(range(1, 13)), mm=(("img0", 2, 3), ("img1", 6, 4), ("img2", 10, 2)))
    ops: list[Op] = [add, Schedule("a", 16)]

    def fails(candidate: list[Op]) -> int | None:  # fails while "a" has at least 7 tokens
        first = candidate[0] if candidate else None
        return 1 if isinstance(first, AddRequest) and len(first.prompt) >= 7 and len(candidate) > 1 else None

    best, _ = shrink(ops, fails, time.monotonic() + 10)
    shrunk = best[0]
    assert isinstance(shrunk, AddRequest) and len(shrunk.prompt) == 7
    assert shrunk.mm == (("img0", 2, 3),)  # img1 across the cut at 7 and img2 past it dropped
    assert all(m in add.mm for m in shrunk.mm)  # every kept item as it was
    assert op_from_json(op_to_json(shrunk)) == shrunk  # the shrunk trace loads
    # control: the prompt cut alone, items untouched, is what failed to load
    with pytest.raises(ValueError, match="past the prompt"):
        op_from_json(op_to_json(replace(add, prompt=add.prompt[:7])))


def test_a_run_builds_its_test_once_and_seeds_each_batch(tmp_path, monkeypatch):
    """The Hypothesis test is built once per run (building digests the machine's source) and
    batch i runs on seed + i, as when each batch built its own; control: one seed for every
    batch runs other examples."""
    from invariants.harness import fuzz

    built, seeds = [], []
    real_build, real_seed = fuzz.get_state_machine_test, fuzz.hypothesis_seed

    def build(*a, **kw):
        built.append(1)
        return real_build(*a, **kw)

    def seed(value):
        seeds.append(value)
        return real_seed(value)

    monkeypatch.setattr(fuzz, "get_state_machine_test", build)
    monkeypatch.setattr(fuzz, "hypothesis_seed", seed)
    kw = dict(strategy=st.just(CFG), out_dir=tmp_path, progress=False)
    run = run_fuzz("model", steps=900, seed=7, **kw)
    assert run.stats.batches >= 2 and built == [1]
    assert seeds == [7 + i for i in range(run.stats.batches)]

    def figures(report: object) -> tuple[int, int, int]:
        s = report.stats  # type: ignore[attr-defined]
        return (s.steps, s.examples, s.hit_tokens)

    assert figures(run_fuzz("model", steps=900, seed=7, **kw)) == figures(run)
    monkeypatch.setattr(fuzz, "hypothesis_seed", lambda value: real_seed(7))
    assert figures(run_fuzz("model", steps=900, seed=7, **kw)) != figures(run)
