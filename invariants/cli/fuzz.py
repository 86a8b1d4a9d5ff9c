"""`kvretain fuzz`, `replay`, `conformance` and `bench`: the stateful harness against one target."""

from __future__ import annotations

import argparse
from pathlib import Path

from invariants.harness.trace import read_trace
from invariants.report import table
from invariants.results import CaseResult, fuzz_case, write_results


def cmd_fuzz(args: argparse.Namespace) -> int:
    from invariants.harness.fuzz import format_failure, format_features, format_summary, run_fuzz

    print(
        f"kvretain fuzz: target {args.target}, config {args.config or 'generated'}, seed {args.seed}, "
        f"steps {args.steps}, budget {args.budget_s or 'none'} s",
        flush=True,
    )
    report = run_fuzz(
        args.target,
        config_name=args.config,
        steps=args.steps,
        seed=args.seed,
        budget_s=args.budget_s,
        out_dir=Path(args.out),
    )
    if report.failure is not None:
        print(format_failure(report))
    print(format_summary([report]))
    print(format_features([report]))
    rc = 1 if report.failure is not None else 0
    write_results(args, "fuzz", [fuzz_case(report)], rc)
    return rc


# ---------------------------------------------------------------- replay
def cmd_replay(args: argparse.Namespace) -> int:
    from invariants.harness.replay import replay

    trace = read_trace(args.trace)
    targets = args.target or [trace.target or "reference"]
    print(
        f"kvretain replay: {args.trace}: {len(trace.ops)} operations, seed {trace.seed}, "
        f"recorded on {trace.target}: {trace.violation}"
    )
    rows, failed = [], False
    for name in targets:
        result = replay(trace, name)
        first = result.violations[0] if result.violations else None
        failed |= not result.clean
        for i, v in result.violations[:10]:
            print(f"  {name}: op {i}: {v}")
        for i, v in result.known[:3]:
            print(f"  {name}: op {i}: known finding: {v}")
        rows.append(
            (
                name,
                "clean" if result.clean else "VIOLATION",
                len(result.violations),
                len(result.known),
                f"op {first[0]}: {first[1].check}" if first else "-",
            )
        )
    print(table(["target", "verdict", "violations", "known", "first"], rows))
    return 1 if failed else 0


def cmd_conformance(args: argparse.Namespace) -> int:
    from invariants.harness.conformance import run_conformance
    from invariants.targets import target_factory

    target_factory("vllm")  # one line and exit 2 when vLLM cannot be imported
    rows: list = []
    rc = run_conformance(
        steps=args.steps, budget_s=args.budget_s, seed=args.seed, out=Path(args.out), sink=rows
    )
    cases = [
        CaseResult(r.feature, "conformance", "passed" if r.ok else "failed", r.seconds, r.verdict, r.trace)
        for r in rows
    ]
    write_results(args, "conformance", cases, rc)
    return rc


# ---------------------------------------------------------------- bench
def cmd_bench(args: argparse.Namespace) -> int:
    from invariants.harness.bench import run_bench

    return run_bench(requests=args.requests, seed=args.seed)
