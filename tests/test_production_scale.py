"""Production-scale fuzzing against the real vLLM: the unmutated release runs
clean, and a broken one (cached blocks freed to the front of the free queue,
reused first) is caught at vLLM's pool size, its trace written and shrunk
within the shrink limit, the whole command within its budget."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from invariants.targets.vllm_env import vllm_available

_OK, _REASON = vllm_available()
if not _OK:
    pytest.skip(f"vllm target: {_REASON}", allow_module_level=True)

from invariants.cli.main import main  # noqa: E402
from invariants.zoo.mutants_vllm import activate  # noqa: E402

ARGS = ["fuzz", "--target", "vllm", "--scale", "production", "--seed", "0", "--no-db"]


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
    assert trace["violation"].startswith("snapshot")
    # Caught after 16 operations; shrinking (bounded by --shrink-s) never lengthens it.
    assert len(trace["ops"]) <= 16 and "shrunk" in out
    assert elapsed < budget + 5


def test_production_zoo_reports_each_mutant_and_a_clean_control(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "zoo.json"
    argv = ["zoo", "--target", "vllm", "--scale", "production", "--budget-s", "8"]
    assert main([*argv, "--only", "cached_blocks_prepended", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "caught 1/1 at production scale" in text and "control (unmutated vllm" in text
    rows = {c["name"]: c["outcome"] for c in json.loads(out.read_text())["cases"]}
    assert rows == {"cached_blocks_prepended": "passed", "control": "passed"}


def test_production_zoo_needs_the_vllm_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["zoo", "--scale", "production"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
