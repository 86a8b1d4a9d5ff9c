"""`kvretain fuzz`, `replay`, `conformance` and `bench`: the stateful harness against one target."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from invariants.errors import UsageError
from invariants.harness.trace import read_trace
from invariants.report import table, wrap
from invariants.results import CaseResult, fuzz_case, write_results

if TYPE_CHECKING:
    from invariants.harness.fuzz import FuzzReport


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


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (0 turns the option off)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _steps(args: argparse.Namespace, default: int) -> int | None:
    """--steps when given; else the budget decides (None); else `default`."""
    return args.steps if args.steps is not None else (None if args.budget_s else default)


def _say(line: str) -> None:
    print(wrap(f"kvretain fuzz: {line}"), flush=True)


@dataclass
class ProductionOutcome:
    """What a production-scale run ended with: the verdict line, its figures, and
    the (shrunk) trace of a violation."""

    verdict: str
    summary: str
    ops: int
    ops_per_s: float
    seconds: float
    trace: Path | None = None
    violation: str | None = None


def fuzz_production(
    target: str,
    *,
    seed: int,
    steps: int | None,
    budget_s: float | None,
    shrink_s: float | None,
    out: Path,
    audit_every: int | None = None,
    say: Callable[[str], None] = _say,
) -> ProductionOutcome:
    """Episodes of the production workload on `target` (see `run_production`); a
    violation is written as a trace at once, then shrunk within the budget."""
    import time

    from invariants.harness.fuzz import _tolerance, shrink_failure
    from invariants.harness.known_findings import clean_verdict
    from invariants.harness.production import format_production, run_production
    from invariants.harness.run_stats import ViolationFound
    from invariants.harness.trace import Trace, write_trace
    from invariants.targets import REAL_SCHEDULER_TARGETS, target_factory

    factory, tolerated = target_factory(target), _tolerance(target)
    start = time.monotonic()
    kw = {"audit_every": audit_every} if audit_every else {}
    stats, failures, seconds = run_production(
        factory,
        seed=seed,
        steps=steps,
        budget_s=budget_s,
        tolerated=tolerated,
        log=say,
        engine=target in REAL_SCHEDULER_TARGETS,
        **kw,
    )
    verdict = clean_verdict(stats.known)
    path = violation = None
    if failures:
        setting, checker, found = failures[0]
        verdict = "VIOLATION"
        path = out / f"kvretain-{target}-production-seed{seed}.json"
        write_trace(Trace(setting.config, checker.ops, seed, target, str(found[0])), path)
        say(f"violation: {found[0]} after {stats.ops:,} operations; unshrunk trace {path}")
        budget_left = None if budget_s is None else max(budget_s - (time.monotonic() - start), 0.0)
        failure = shrink_failure(
            ViolationFound(found, setting.config, checker.ops),
            factory,
            tolerated,
            time.monotonic(),
            budget_left,
            shrink_s or 60.0,
            say,
        )
        violation = str(failure.violations[0])
        write_trace(Trace(setting.config, failure.ops, seed, target, violation), path)
        print(f"VIOLATION: {violation}\nshrunk trace ({len(failure.ops)} operations): {path}")
    return ProductionOutcome(
        verdict,
        format_production(target, seed, stats, seconds, verdict),
        stats.ops,
        stats.ops / seconds if seconds else 0.0,
        seconds,
        path,
        violation,
    )


def cmd_fuzz_production(args: argparse.Namespace) -> int:
    """`fuzz --scale production`: real layouts and pool sizes, a serving workload."""
    if args.config:
        raise UsageError(
            "--config: --scale production runs its own presets (dsv4-flash, gemma-like, kimi-linear-like)"
        )
    steps = _steps(args, 20_000)
    print(
        f"kvretain fuzz --scale production: target {args.target}, seed {args.seed}, "
        f"steps {steps or 'until the budget'}, budget {args.budget_s or 'none'} s",
        flush=True,
    )
    outcome = fuzz_production(
        args.target,
        seed=args.seed,
        steps=steps,
        budget_s=args.budget_s,
        shrink_s=args.shrink_s,
        out=Path(args.out),
        audit_every=args.audit_every,
    )
    print(outcome.summary)
    return 1 if outcome.violation is not None else 0


def cmd_fuzz(args: argparse.Namespace) -> int:
    from invariants.harness.fuzz import (
        DEFAULT_STEPS,
        format_failure,
        format_features,
        format_summary,
        run_fuzz,
    )
    from invariants.harness.known_findings import format_known

    if getattr(args, "ray", None) or getattr(args, "seeds", None):  # a campaign on Ray
        from invariants.cli.campaign import cmd_fuzz_campaign

        return cmd_fuzz_campaign(args)
    if args.target == "sglang":  # its own ops, model and checks (invariants/cli/sglang.py)
        from invariants.cli.sglang import cmd_fuzz_sglang

        return cmd_fuzz_sglang(args)
    if args.scale == "production":
        return cmd_fuzz_production(args)
    if args.config:
        from invariants.layouts.presets import preset

        preset(args.config)  # an unknown name is the one line, before any other output
    _declared_or_exit()

    steps = _steps(args, DEFAULT_STEPS)
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
        _hand_over(report, args.budget_s)
    print(format_summary([report]))
    if report.stats.known:
        print(format_known(report.stats.known))
    print(format_features([report]))
    rc = report.exit_code  # 1 a defect, 4 policy drift alone (undeclared), else 0
    case = fuzz_case(report)
    if args.target.startswith("vllm"):  # which release's rules judged, and any profile drift
        from invariants.targets.vllm_capabilities import profile_json, profile_lines

        for line in profile_lines():
            print(line)
        case.figures["profile_check"] = profile_json()
    write_results(args, "fuzz", [case], rc)
    return rc


HANDOVER_S = 30.0
"""Without a budget, the hand-over to explore gets this long."""
HANDOVER_MAX_S = 60.0
"""With one, it gets what is left of the budget, at most this long: the verdict is
printed before it, and a run that found a violation early ends soon after it."""


def _hand_over(report: FuzzReport, budget_s: float | None) -> None:
    """Search the shrunk trace's operations exhaustively for a shorter one, within what
    is left of the budget (at most `HANDOVER_MAX_S`); print it, its sentence, and write
    it beside the fuzz trace."""
    import time

    from invariants.explore.handover import shortest_trace
    from invariants.harness.fuzz import _tolerance
    from invariants.harness.trace import Trace, write_trace
    from invariants.targets import target_factory
    from invariants.targets.vllm_env import replay_command

    failure = report.failure
    assert failure is not None
    left = HANDOVER_S if budget_s is None else min(HANDOVER_MAX_S, budget_s - report.seconds)
    if left <= 0.5:
        print("hand-over to explore: skipped, the budget is spent (the trace above is the fuzzer's)")
        return
    h = shortest_trace(
        failure.config,
        failure.ops,
        failure.violations[0],
        target_factory(report.target),
        report.target,
        tolerate=_tolerance(report.target),
        deadline=time.monotonic() + left,
    )
    print(wrap(f"hand-over to explore: {h.summary()}"))
    print(wrap(f"first difference: {h.sentence}"))
    if h.shorter and report.trace_path is not None:
        path = report.trace_path.with_name(report.trace_path.stem + "-shortest.json")
        write_trace(Trace(failure.config, list(h.ops), report.seed, report.target, str(h.violation)), path)
        print(wrap(f"shortest trace ({len(h.ops)} operations) written to {path}; {replay_command(path)}"))


# ---------------------------------------------------------------- replay
def cmd_replay(args: argparse.Namespace) -> int:
    from invariants.cli.sglang import cmd_replay_sglang, is_radix_trace
    from invariants.harness.known_findings import format_crash_counts
    from invariants.harness.replay import replay

    if is_radix_trace(Path(args.trace)):  # a `fuzz --target sglang` trace
        return cmd_replay_sglang(Path(args.trace))
    trace = read_trace(args.trace)
    _declared_or_exit()
    targets = args.target or [trace.target or "reference"]
    print(
        f"kvretain replay: {args.trace}: {len(trace.ops)} operations, seed {trace.seed}, "
        f"recorded on {trace.target}: {trace.violation}"
    )
    rows, failed, drifted = [], False, False
    for name in targets:
        result = replay(trace, name)
        first = result.violations[0] if result.violations else result.drift[0] if result.drift else None
        failed |= not result.clean
        drifted |= bool(result.drift) and not all(v.declared for _, v in result.drift)
        for i, v in result.violations[:10]:
            print(f"  {name}: op {i}: {v}")
        for i, v in result.drift:
            print(
                f"  {name}: op {i}: POLICY DRIFT{' (declared)' if v.declared else ''}, not a defect: {v.message}; "
                f"after it {result.after_drift} operation(s) judged by the model-independent checks, "
                f"{result.unjudged} not judged (the target refused one drawn from the model's state)"
            )
        for i, v in result.known[:3]:
            print(f"  {name}: op {i}: known finding: {v}")
        crashes = format_crash_counts(result.crashes)
        if crashes:
            print(f"  {name}: {crashes}")
        rows.append(
            (
                name,
                result.verdict,
                len(result.violations),
                len(result.drift),
                len(result.known),
                f"op {first[0]}: {first[1].check}" if first else "-",
            )
        )
    print(table(["target", "verdict", "violations", "drift", "known", "first"], rows))
    return 1 if failed else 4 if drifted else 0


def _declared_or_exit() -> None:
    """`KVRETAIN_DECLARED_POLICIES` read before the run: an unknown name is one line, exit 2."""
    from invariants.errors import UsageError
    from invariants.harness.checker import declared_policies

    try:
        declared_policies()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def cmd_conformance(args: argparse.Namespace) -> int:
    from invariants.harness.conformance import run_conformance
    from invariants.targets import target_factory

    target_factory("vllm-manager")  # one line and exit 2 when vLLM cannot be imported
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

    if args.compare_compiled:
        return _compare_compiled(args)

    if args.target == "sglang":
        from invariants.cli.sglang import cmd_bench_sglang

        return cmd_bench_sglang(args)
    if args.scale == "production":
        from invariants.harness.bench import run_production_bench

        return run_production_bench(ops=args.requests * 10, seed=args.seed)
    return run_bench(requests=args.requests, seed=args.seed)


def _compare_compiled(args: argparse.Namespace) -> int:
    """`bench --compare-compiled`: checked/raw and explore's states per CPU second, pure Python
    against the compiled build (`make compiled`), in one run; exit 1 if their certificates differ."""
    from invariants.compiled import choose
    from invariants.explore.bench import BENCH_INSTANCE
    from invariants.explore.compiled_bench import compare as compare_explore
    from invariants.harness.compiled_bench import compare as compare_checked

    state, _ = choose(honour_env=False)
    if not state.modules:
        raise UsageError(f"--compare-compiled needs a usable compiled build: {state.why}")
    print(
        f"kvretain bench --compare-compiled: {args.requests} request cycles, seed {args.seed}; "
        f"explore depth {args.explore_depth}; one child process per variant and round, CPU time"
    )
    compare_checked(args.requests, args.seed, args.rounds)
    _, same = compare_explore("vllm-manager", BENCH_INSTANCE, args.explore_depth, args.rounds)
    return 0 if same else 1
