"""Production-scale fuzzing against the real vLLM: the unmutated release runs
clean, and a broken one (cached blocks freed to the front of the free queue,
reused first) is caught at vLLM's pool size, its trace written and shrunk
within the shrink limit, the whole command within its budget; and the
fine-grained settings reach vLLM's partial-hash-hit path (copy-on-write),
which the preset's default unit never does."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from invariants.targets.vllm_env import vllm_available

_OK, _REASON = vllm_available()
if not _OK:
    pytest.skip(f"vllm target: {_REASON}", allow_module_level=True)

from invariants.cli.main import main  # noqa: E402
from invariants.zoo.mutants_vllm import activate  # noqa: E402

ARGS = ["fuzz", "--target", "vllm-manager", "--scale", "production", "--seed", "0", "--no-db"]


def test_unmutated_vllm_runs_clean_at_production_scale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*ARGS, "--steps", "40", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "clean" in out and "VIOLATION" not in out
    assert not list(tmp_path.iterdir())


def test_broken_free_order_is_caught_and_shrunk_within_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    budget = 60.0
    start = time.monotonic()
    with activate("cached_blocks_prepended"):
        rc = main([*ARGS, "--budget-s", str(budget), "--shrink-s", "5", "--out", str(tmp_path)])
    elapsed = time.monotonic() - start
    out = capsys.readouterr().out
    assert rc == 1 and "VIOLATION" in out
    traces = list(tmp_path.glob("*.json"))
    assert len(traces) == 1
    trace = json.loads(traces[0].read_text())
    # Blocks come off the free queue in the wrong order: vLLM hands out other blocks than the
    # model (an observation) or its free queue differs from the model's (the snapshot).
    assert trace["violation"].split(":")[0] in ("observation", "snapshot")
    caught = re.search(r"after (\d+) operations", out)
    assert caught and int(caught.group(1)) <= 16  # within the first episode's first steps
    # shrinking (bounded by --shrink-s) never lengthens it
    assert len(trace["ops"]) <= int(caught.group(1)) and "shrunk" in out
    assert elapsed < budget + 5


def test_production_zoo_reports_each_mutant_and_a_clean_control(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "zoo.json"
    argv = ["zoo", "--target", "vllm-manager", "--scale", "production", "--budget-s", "8"]
    assert main([*argv, "--only", "cached_blocks_prepended", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "caught 1/1 at production scale" in text and "control (unmutated vllm" in text
    rows = {c["name"]: c["outcome"] for c in json.loads(out.read_text())["cases"]}
    assert rows == {"cached_blocks_prepended": "passed", "control": "passed"}


def test_production_zoo_needs_the_vllm_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["zoo", "--scale", "production"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def _copies_in_a_squeezed_kimi_episode(fine: bool, ops: int) -> tuple[bool, int]:
    """vLLM's partial-hash-hit switch, and the copy-on-write copies it queued over `ops` operations."""
    import random

    from invariants.harness.checker import Checker, InvalidOp
    from invariants.harness.production import settings_for, workload
    from invariants.targets.vllm_target import VllmManagerTarget
    from model.contract.fine_mamba import fine_hits_enabled
    from model.contract.observation import ScheduleResult, StepResult

    setting = next(
        s
        for s in settings_for(0)
        if s.name == "kimi-linear-like" and s.squeezed and fine_hits_enabled(s.config) == fine
    )
    target = VllmManagerTarget(setting.config)
    checker = Checker(target)
    stream = workload(setting.config, random.Random(3), checker, setting.longest)
    copies = 0
    for _ in range(ops):
        try:
            found = checker.step(next(stream))
        except InvalidOp:
            continue
        assert all(v.check == "stored_tokens_match_hashes" for v in found), found
        obs = checker.last_obs
        if isinstance(obs, (ScheduleResult, StepResult)):
            copies += len(obs.copies)
    return bool(target.manager.coordinator.enable_partial_hash_hits), copies


def test_the_fine_grained_settings_take_vllms_partial_hash_hit_path() -> None:
    """At a 64-token unit vLLM's coordinator hits inside Mamba blocks and copies states on write."""
    partial, copies = _copies_in_a_squeezed_kimi_episode(fine=True, ops=200)
    assert partial and copies > 0


def test_control_the_default_unit_never_takes_it() -> None:
    partial, copies = _copies_in_a_squeezed_kimi_episode(fine=False, ops=200)
    assert not partial and copies == 0


def test_the_production_bench_says_where_the_checked_time_goes() -> None:
    """The phases partition the checked time: they add up to it, audits on their own."""
    from invariants.harness.bench import run_production_bench

    lines: list[str] = []
    assert run_production_bench(ops=40, log=lines.append) == 0
    for target in ("vllm-manager", "vllm"):  # the real Scheduler on both sides of the second
        where = next(line for line in lines if line.startswith(f"where checked time goes on {target}: "))
        shares = dict(re.findall(r"([a-z][a-z ,()]+?) (\d+)%", where.split(": ", 1)[1]))
        assert {"target apply", "model apply", "checks and history"} <= set(shares)
        assert any(k.startswith("audits") for k in shares)
        assert 95 <= sum(int(v) for v in shares.values()) <= 105  # each share rounded
        # raw is vLLM's own time: the adapter that drives it is no part of it
        rows = "\n".join(lines).splitlines()
        driven = next(row for row in rows if row.startswith(f"{target} driven by the adapter"))
        assert 0 < float(driven.split()[-1]) <= 1
    assert any("vs raw vLLM" in line for line in lines)
    assert any(
        line.startswith("vllm raw: its Scheduler and allocator") for line in "\n".join(lines).splitlines()
    )


def test_the_production_bench_runs_one_configuration_whatever_the_seed() -> None:
    """Each seed's plan orders (and drafts) its settings differently; the bench's stays put."""
    from invariants.harness.bench import run_production_bench

    heads = []
    for seed in (1, 2):
        lines: list[str] = []
        assert run_production_bench(ops=10, seed=seed, log=lines.append) == 0
        heads.append(lines[0].rsplit(", seed", 1)[0])
    assert heads[0] == heads[1] and "dsv4-flash, 156,281 blocks, retention 1024" in heads[0]


def test_the_vllm_clock_counts_only_time_inside_vllm() -> None:
    """`_VllmClock` adds the time of vLLM's calls and nothing the adapter does around them."""
    from invariants.harness.bench import BENCH_CONFIG, _VllmClock
    from invariants.targets import target_factory
    from model.contract.ops import AddRequest, Finish, Probe, Schedule

    target = target_factory("vllm-manager")(BENCH_CONFIG)
    clock = _VllmClock.attach(target)
    target.apply(AddRequest("a", tuple(range(1, 100))))
    assert clock.seconds > 0  # the request was built (and hashed) by vLLM
    built = clock.seconds
    t = time.perf_counter()
    for op in (Schedule("a", 4096), Finish("a"), Probe(tuple(range(1, 100)))):
        target.apply(op)
    assert built < clock.seconds < built + (time.perf_counter() - t)


def test_control_time_outside_vllm_is_not_counted() -> None:
    from invariants.harness.bench import BENCH_CONFIG, _VllmClock
    from invariants.targets import target_factory

    target = target_factory("vllm-manager")(BENCH_CONFIG)
    clock = _VllmClock.attach(target)
    target.snapshot()  # reads vLLM's state: adapter work (a name table, a walk of the free queue)
    time.sleep(0.05)
    assert clock.seconds < 0.05


def test_verify_runs_vllm_at_production_scale_and_fails_on_a_violation(tmp_path: Path) -> None:
    """`make verify` has a production-scale row: a broken free order fails it, with a trace."""
    from invariants.cli.verify import production_row

    with activate("cached_blocks_prepended"):
        check, target, verdict, figure, seconds, good, trace = production_row(20.0, 0, tmp_path)
    assert (check, target) == ("fuzz (production scale)", "vllm")
    assert not good and verdict.startswith("VIOLATION") and trace is not None and trace.exists()


def test_control_the_production_row_holds_on_unmutated_vllm(tmp_path: Path) -> None:
    from invariants.cli.verify import production_row

    # The real scheduler's first episode (building it, hashing a long prompt) takes seconds.
    check, target, verdict, figure, seconds, good, trace = production_row(15.0, 0, tmp_path)
    assert good and verdict.startswith("clean") and trace is None and not list(tmp_path.iterdir())
    assert int(figure.split()[0].replace(",", "")) > 0  # it ran operations
