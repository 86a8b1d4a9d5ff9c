"""`kvretain export --issue`: the upstream report says what breaks in its title, gives a
five-line summary (trigger, consequence, vLLM function, fix direction, test), the test
file, and the shortest trace in words (explore's phrases), never a dump of operation
objects. Control: a trace that is no known finding gets the property's title and the
fields it cannot know are said to be unknown."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from invariants.cli.main import main
from invariants.harness.known_findings import load_known_findings
from invariants.harness.trace import Trace, write_trace
from model.contract.config import Config, GroupSpec
from model.contract.ops import AddRequest, Finish, Schedule

FINDINGS = {f.id: f for f in load_known_findings()}


def _report(tmp_path: Path, trace: Trace) -> str:
    path = write_trace(trace, tmp_path / "trace.json")
    out, issue = tmp_path / "t.py", tmp_path / "r.md"
    assert main(["export", str(path), "--out", str(out), "--issue", str(issue)]) == 0
    return issue.read_text()


def _summary(report: str) -> list[str]:
    lines = report.splitlines()
    return lines[2:7]


@pytest.mark.parametrize("fid", ["sync-load-failed-block-hash-kept", "eagle-swa-short-run-double-pop"])
def test_report_of_a_known_finding(fid: str, tmp_path: Path) -> None:
    f = FINDINGS[fid]
    report = _report(tmp_path, f.trace)
    kind, _, what = f.consequence.partition(":")
    assert report.splitlines()[0] == f"# [Bug]: {kind}: {re.sub(r' [(][^)]*[)]', '', what).strip()}"
    summary = _summary(report)
    assert [line.split("**")[1] for line in summary] == [
        "Trigger",
        "Consequence",
        "vLLM function",
        "Fix direction",
        "Test",
    ]
    assert f.reachability in summary[0] and f.consequence in summary[1] and f.where in summary[2]
    assert "`t.py`" in summary[4]
    # The trace in words: one line of phrases ending with the violation; no op objects.
    ends = f": {f.trace.violation}"
    (words,) = [ln for ln in report.splitlines() if ln.startswith("add ") and ln.endswith(ends)]
    assert words.startswith("add ") and "; " in words
    assert '{"op":' not in report and "AddRequest(" not in report
    assert "```python" in report


def test_report_of_an_unknown_trace_names_the_property(tmp_path: Path) -> None:
    cfg = Config(groups=(GroupSpec("full", 4),), num_blocks=8)
    ops = [AddRequest("r0", tuple(range(1, 10))), Schedule("r0", 16), Finish("r0")]
    trace = Trace(cfg, list(ops), 0, "vllm-manager", "snapshot: free queue differs (a planted report)")
    report = _report(tmp_path, trace)
    assert report.splitlines()[0].startswith("# [Bug]: prefix caching breaks snapshot: free queue differs")
    summary = _summary(report)
    assert summary[0] == "- **Trigger**: full4, 8 blocks"
    assert summary[2] == "- **vLLM function**: not located yet"
    assert summary[3].startswith("- **Fix direction**: restore `snapshot`")
    assert "add r0 (9 tokens); schedule r0 budget 16; finish r0: snapshot: free queue differs" in report
