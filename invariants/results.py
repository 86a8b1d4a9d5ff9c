"""Machine-readable results for CI: JUnit XML and JSON.

Every command that ends with a table (`fuzz`, `verify`, `conformance`, `zoo`)
can also write its rows as JUnit XML (`--junit-xml PATH`, one test case per
row, so a CI shows each row as a test) and as JSON (`--json PATH`). A failing
row carries the path of its replayable trace, so the CI can keep the trace as
an artifact and the failure links to it. Files are written atomically: a run
that dies leaves no partial file.

Two kinds of verdict: a defect (a contract broken: an invariant, a crash, a
seeds' mechanism diverging) fails its row; *policy drift* (every contract kept,
one of vLLM's policy decisions made otherwise than the model predicts) is its
own field, `policy_drift` (the first drift's sentence, policy, count, trace),
and counted apart in the JSON's `policy_drift` total. An undeclared drift fails
its row too (exit 4), a declared one passes with the field set
(docs/semantics.md, "Verdicts").
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Outcome = Literal["passed", "failed", "error", "skipped"]
RESULTS_FORMAT = "kvretain-results"
RESULTS_VERSION = 1


@dataclass
class CaseResult:
    """One row of a command's table."""

    name: str
    group: str
    outcome: Outcome
    seconds: float = 0.0
    message: str = ""
    trace: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    # Policy drift, apart from defects: None where the row saw none.
    policy_drift: dict[str, Any] | None = None


def output_path(text: str) -> Path:
    """An output file path, checked before the run starts (not after an hour of fuzzing)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {parent} is a file, not a directory")
    if parent is not None and not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: {parent} is not writable")
    return path


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--junit-xml",
        metavar="PATH",
        type=output_path,
        help="also write the rows as JUnit XML (one test case each)",
    )
    parser.add_argument("--json", metavar="PATH", type=output_path, help="also write the rows as JSON")


def _atomic_write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def junit_xml(suite: str, cases: list[CaseResult]) -> bytes:
    root = ET.Element("testsuites", name="kvretain")
    ts = ET.SubElement(
        root,
        "testsuite",
        name=suite,
        tests=str(len(cases)),
        failures=str(sum(c.outcome == "failed" for c in cases)),
        errors=str(sum(c.outcome == "error" for c in cases)),
        skipped=str(sum(c.outcome == "skipped" for c in cases)),
        time=f"{sum(c.seconds for c in cases):.3f}",
    )
    for c in cases:
        tc = ET.SubElement(
            ts, "testcase", classname=f"{suite}.{c.group}", name=c.name, time=f"{c.seconds:.3f}"
        )
        body = "\n".join(
            [
                c.message,
                *(f"{k}: {v}" for k, v in c.figures.items()),
                *([f"trace: {c.trace}"] if c.trace else []),
            ]
        )
        if c.outcome in ("failed", "error"):
            tag = "failure" if c.outcome == "failed" else "error"
            el = ET.SubElement(tc, tag, message=c.message[:200], type=c.group)
            el.text = body
        elif c.outcome == "skipped":
            ET.SubElement(tc, "skipped", message=c.message[:200])
        if c.trace:
            props = ET.SubElement(tc, "properties")
            ET.SubElement(props, "property", name="trace", value=c.trace)
        if c.outcome == "passed" and body:
            ET.SubElement(tc, "system-out").text = body
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def results_json(command: str, cases: list[CaseResult], exit_code: int | None = None) -> bytes:
    payload = {
        "format": RESULTS_FORMAT,
        "version": RESULTS_VERSION,
        "command": command,
        "exit_code": exit_code,
        "ok": all(c.outcome in ("passed", "skipped") for c in cases),
        # A run that skipped a row did not check it: `ok` with skips is not `complete`.
        "complete": not any(c.outcome == "skipped" for c in cases),
        "counts": {o: sum(c.outcome == o for c in cases) for o in ("passed", "failed", "error", "skipped")},
        # Rows that drifted from a predicted policy (every contract kept), apart from defects.
        "policy_drift": sum(c.policy_drift is not None for c in cases),
        "cases": [asdict(c) for c in cases],
    }
    return (json.dumps(payload, indent=1, default=str) + "\n").encode()


def write_results(args: argparse.Namespace, command: str, cases: list[CaseResult], exit_code: int) -> None:
    """Write what `--junit-xml` / `--json` asked for (nothing when neither was given)."""
    junit, js = getattr(args, "junit_xml", None), getattr(args, "json", None)
    if junit:
        _atomic_write(Path(junit), junit_xml(f"kvretain.{command}", cases))
    if js:
        _atomic_write(Path(js), results_json(command, cases, exit_code))


def fuzz_case(report: Any, group: str = "fuzz") -> CaseResult:
    """A fuzz run (a `harness.fuzz.FuzzReport`) as one row."""
    failure = report.failure
    drift = report.drift_json() if getattr(report, "drifts", 0) else None
    message = str(failure.violations[0]) if failure is not None else report.verdict
    if failure is None and drift is not None:
        message = f"{report.verdict}: {drift['first']}"
    return CaseResult(
        name=f"{report.target}/{report.config}",
        group=group,
        outcome="failed" if report.exit_code else "passed",
        seconds=report.seconds,
        message=message,
        trace=str(report.trace_path or report.drift_trace_path or "") or None,
        policy_drift=drift,
        figures={
            "seed": report.seed,
            "steps": report.stats.steps,
            "ops_per_s": round(report.ops_per_s),
            "hit_rate": round(report.stats.hit_rate, 4),
            "known": report.stats.known.to_json(),
            # tolerated crashes, crashes raised by kvretain's adapter, other new crashes
            "crashes": dict(report.crashes),
            "not_generated": list(getattr(report, "not_generated", ())),
        },
    )


def zoo_cases(report: Any, control_ok: bool | None) -> list[CaseResult]:
    """A zoo run (a `zoo.runner.ZooReport`): a killed mutant passes (its checks work),
    a survivor fails; not-applicable mutants are skipped; the control is one more row."""
    cases = [
        CaseResult(
            name=r.name,
            group=r.target,
            outcome="passed" if r.killed else "failed",
            seconds=r.seconds,
            message=(f"killed by {r.check}" + (" (as policy drift)" if getattr(r, "drift", False) else ""))
            if r.killed
            else (r.note or "no check fired within the budget"),
            trace=str(r.trace_path) if r.trace_path else None,
            figures={"strategy": r.strategy, "seconds_to_kill": r.seconds_to_kill, "steps": r.steps},
            policy_drift={"detail": r.detail} if getattr(r, "drift", False) else None,
        )
        for r in report.results
    ]
    cases += [CaseResult(name, report.target, "skipped", 0.0, why) for name, why in report.not_applicable]
    if control_ok is not None:
        cases.append(
            CaseResult(
                "control (unmutated)",
                report.target,
                "passed" if control_ok else "failed",
                message="clean" if control_ok else "the unmutated target was flagged",
            )
        )
    return cases
