"""`kvretain fuzz`, `replay`, `conformance` and `bench`: the stateful harness against one target."""

from __future__ import annotations

import argparse
from pathlib import Path

from invariants.harness.trace import read_trace
from invariants.report import table


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a bad value is one usage line, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _say(line: str) -> None:
    print(f"kvretain fuzz: {line}", flush=True)


def cmd_fuzz(args: argparse.Namespace) -> int:
    from invariants.harness.fuzz import DEFAULT_STEPS, format_failure, format_summary, run_fuzz

    steps = args.steps if args.steps is not None else (None if args.budget_s else DEFAULT_STEPS)
    print(
        f"kvretain fuzz: target {args.target}, config {args.config or 'generated'}, seed {args.seed}, "
        f"steps {steps or 'until the budget'}, budget {args.budget_s or 'none'} s",
        flush=True,
    )
    report = run_fuzz(
        args.target,
        config_name=args.config,
        steps=steps,
        seed=args.seed,
        budget_s=args.budget_s,
        shrink_s=args.shrink_s,
        out_dir=Path(args.out),
        database=None if args.no_db else Path(args.db),
        audit_every=args.audit_every,
        log=_say,
    )
    if report.failure is not None:
        print(format_failure(report))
    print(format_summary([report]))
    return 1 if report.failure is not None else 0


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
    return run_conformance(steps=args.steps, budget_s=args.budget_s, seed=args.seed, out=Path(args.out))


# ---------------------------------------------------------------- bench
def cmd_bench(args: argparse.Namespace) -> int:
    from invariants.harness.bench import run_bench

    return run_bench(requests=args.requests, seed=args.seed)
