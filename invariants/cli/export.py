"""`kvretain export TRACE`: a standalone vLLM regression test from a trace.

    kvretain export TRACE [--out FILE.py] [--issue FILE.md]

Writes a pytest file in the style of vLLM's tests/v1/core that replays the
trace through vLLM's public API and asserts the property that broke, with
the specification's value as a literal; `--issue` also writes the upstream
report. Bad input (an unreadable or malformed trace, one that records no
violation, an output path that is not a .py file): one line, exit code 2, no
file written. A trace of `fuzz --target sglang` (it names a radix layout) is
exported by `invariants/export/sglang_file.py` as a file that imports only
SGLang and torch.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from invariants.errors import UsageError
from invariants.export.issue import render_issue
from invariants.export.plan import ExportError, plan_export
from invariants.export.pytest_file import exported_test_name, render_test
from invariants.harness.trace import read_trace


def add_parser(sub: Any) -> None:
    e = sub.add_parser("export", help="a standalone vLLM pytest file (and upstream report) from a trace")
    e.add_argument("trace", help="a trace file written by fuzz / zoo (kvretain-trace JSON)")
    e.add_argument("--out", help="the pytest file to write (default: test_<property>.py beside the trace)")
    e.add_argument("--issue", metavar="PATH", help="also write the upstream report (Markdown) here")
    e.set_defaults(func=cmd_export)


def _write(path: Path, text: str) -> None:
    """Atomically: a failure leaves no partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cmd_export(args: argparse.Namespace) -> int:
    from invariants.cli.sglang import is_radix_trace

    if is_radix_trace(Path(args.trace)):
        return _export_sglang(args)
    trace = read_trace(args.trace)
    try:
        plan = plan_export(trace)
        # Rendering refuses what the plan allows but a file cannot state (a real scheduler's drafts).
        source = render_test(plan)
    except ExportError as exc:
        raise UsageError(f"{args.trace}: {exc}") from None
    out = Path(args.out) if args.out else Path(args.trace).with_name(f"{exported_test_name(plan)}.py")
    if out.suffix != ".py":
        raise UsageError(f"--out: a pytest file must end in .py, got {str(out)!r}")
    if args.issue and Path(args.issue).suffix != ".md":
        raise UsageError(f"--issue: the report is Markdown and must end in .md, got {args.issue!r}")
    report = render_issue(plan, source, out.name, _sentence(plan.trace)) if args.issue else None
    _write(out, source)
    print(f"kvretain export: {plan.expectation.property} ({plan.expectation.kind}) -> {out}")
    if report is not None:
        _write(Path(args.issue), report)
        print(f"kvretain export: upstream report -> {args.issue}")
    return 0


def _sentence(trace: Any) -> str:
    """The trace in words, as explore names a counterexample: each operation as a short
    phrase (`describe_op`), then the violation's one line."""
    from invariants.explore.sentence import describe_op
    from model.contract.ops import AddRequest

    def phrase(op: Any) -> str:
        return f"add {op.rid} ({len(op.prompt)} tokens)" if isinstance(op, AddRequest) else describe_op(op)

    return "; ".join(phrase(op) for op in trace.ops) + f": {trace.violation}"


def _export_sglang(args: argparse.Namespace) -> int:
    """An SGLang finding (a `fuzz --target sglang` trace): a pytest file that imports only SGLang."""
    from invariants.cli.sglang import _unavailable
    from invariants.export.sglang_file import plan_sglang_export, render_sglang_test, test_name

    if args.issue:
        raise UsageError("--issue: not available for SGLang findings yet (the pytest file only)")
    why = _unavailable()
    if why is not None:
        raise UsageError(f"target sglang: {why}")
    try:
        plan = plan_sglang_export(Path(args.trace))
    except ExportError as exc:
        raise UsageError(f"{args.trace}: {exc}") from None
    out = Path(args.out) if args.out else Path(args.trace).with_name(f"{test_name(plan)}.py")
    if out.suffix != ".py":
        raise UsageError(f"--out: a pytest file must end in .py, got {str(out)!r}")
    _write(out, render_sglang_test(plan))
    print(f"kvretain export: {plan.invariant} (SGLang {plan.layout.name}, {plan.core} core) -> {out}")
    return 0
