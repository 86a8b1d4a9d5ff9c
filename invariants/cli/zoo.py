"""`kvretain zoo`: run every check against each mutant; what is caught, how fast, by which check.

    kvretain zoo [--target reference|vllm|vllm-async-scheduler|vllm-manager|sglang] [--budget-s T] [--quick] [--only NAME] [--seed N]
                 [--out DIR]
    kvretain zoo --target vllm-manager --scale production [--budget-s T] [--only NAME]
    kvretain zoo --target vllm-manager --explore [--depth D] [--budget-s T] [--only NAME]

Prints a progress line per mutant, then a table (mutant, killed/SURVIVED,
the first check that killed it and the other checks that fired on the same
step, time to kill, the config strategy, the seed, the shrunk trace) and a
summary line (kill rate, median and max time to kill). The unmutated target
is run the same way first, as the control: it must survive every hunt.

Exit codes: 0 every mutant killed and the control clean; 1 a survivor (or
the control flagged); 2 bad usage or an unavailable target (one line).

`--scale production` runs each vLLM mutant through a production-scale fuzz
run instead (`invariants.zoo.production`) and reports which ones the serving
workload meets and how fast; only the control decides the exit code there
(a mutant in a path the presets never take is reported, not failed).

`--explore` hunts each mutant by exhaustive search alone (`invariants.zoo.
explore_hunt`): the explore grid, smallest instance first, breadth first to
`--depth` (default 6), each later instance only as deep as the shortest
counterexample found so far minus one; the table gives each mutant's shortest
counterexample depth and instance. Exit 1 when a mutant survives.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from invariants.cli.fuzz import positive_float
from invariants.results import CaseResult, add_output_flags, write_results, zoo_cases
from invariants.zoo.runner import (
    MutantResult,
    ZooEntry,
    ZooReport,
    async_scheduler_entries,
    reference_entries,
    run_entry,
    run_zoo,
    scheduler_entries,
    unmutated_entry,
    vllm_entries,
)

# The subset `verify --quick` and the tests run: one per family, all fast.
QUICK_SUBSET = (
    "swa_slide_appends_uncached",
    "swa_mask_floor",
    "latest_boundary_dropped",
    "eagle_extra_block_dropped",
    "blockstored_unmasked_tokens",
    "pin_by_refcount",
    "retention_validation_lax",
    "mamba_sparse_unhashed_crash",
    "reuse_without_evict",
    "mask_flag_not_restored",
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `zoo`; `args.func` is `run`."""
    p = subparsers.add_parser(
        "zoo",
        help="mutants that re-create real bugs: which check kills each, how fast",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--target",
        choices=("reference", "vllm", "vllm-async-scheduler", "vllm-manager", "sglang"),
        default="reference",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="fuzzing budget per mutant in seconds (default 60, --quick 15)",
    )
    p.add_argument("--quick", action="store_true", help="a fixed subset of mutants, small budgets")
    p.add_argument(
        "--only", action="append", metavar="NAME", help="run only this mutant (repeatable, or a,b)"
    )
    p.add_argument("--seed", type=int, default=0, help="first Hypothesis seed (batch i uses seed + i)")
    p.add_argument(
        "--shrink-s",
        type=positive_float,
        default=None,
        help="shrinking budget per kill (default 10, --quick 3)",
    )
    p.add_argument("--out", default="kvretain-traces/zoo", help="where shrunk traces are written")
    p.add_argument("--no-control", action="store_true", help="skip the unmutated control run")
    p.add_argument(
        "--scale",
        choices=("small", "production"),
        default="small",
        help="production: each vLLM mutant through `fuzz --scale production` (real presets and pool sizes)",
    )
    p.add_argument(
        "--explore",
        action="store_true",
        help="hunt each mutant by exhaustive search (the explore grid) alone",
    )
    p.add_argument("--depth", type=int, default=6, help="--explore: the deepest search (default 6)")
    add_output_flags(p)
    p.set_defaults(func=run)
    return p


def _err(msg: str) -> int:
    print(f"kvretain: error: {msg}", file=sys.stderr)
    return 2


def _entries(target: str, only: list[str] | None) -> tuple[list[ZooEntry], list[tuple[str, str]]]:
    if target == "reference":
        return reference_entries(only), []
    if target == "vllm":  # the scheduler's mutants, then the allocator's, all through the real Scheduler
        allocator, na = vllm_entries(only, target="vllm")
        return scheduler_entries(only) + allocator, na
    if target == "vllm-async-scheduler":
        return async_scheduler_entries(only), []
    return vllm_entries(only)


def _known(target: str) -> set[str]:
    from invariants.zoo.mutants_reference import REFERENCE_MUTANTS

    if target == "reference":
        return set(REFERENCE_MUTANTS)
    if target == "vllm":
        from invariants.zoo.mutants_scheduler import SCHEDULER_MUTANTS
        from invariants.zoo.mutants_vllm import NOT_APPLICABLE, VLLM_MUTANTS

        return set(SCHEDULER_MUTANTS) | set(VLLM_MUTANTS) | set(NOT_APPLICABLE)
    if target == "vllm-async-scheduler":
        from invariants.zoo.mutants_scheduler import ASYNC_SCHEDULER_MUTANTS

        return set(ASYNC_SCHEDULER_MUTANTS)
    from invariants.zoo.mutants_vllm import NOT_APPLICABLE, VLLM_MUTANTS

    return set(VLLM_MUTANTS) | set(NOT_APPLICABLE)


def _progress_line(r: MutantResult) -> None:
    when = f"{r.seconds_to_kill:.2f}s" if r.seconds_to_kill is not None else f"{r.seconds:.0f}s"
    if r.seconds_to_trace is not None:
        when += f" (shrunk trace at {r.seconds_to_trace:.2f}s)"
    print(
        f"[zoo] {r.target} {r.name}: {r.verdict} by {r.check} in {when}"
        + (f" ({r.detail[:120]})" if r.detail else "")
        + (f" [{r.note}]" if r.note else ""),
        file=sys.stderr,
        flush=True,
    )


def control(
    target: str,
    strategies: list[str],
    *,
    seed: int,
    budget_s: float,
    out: Path | None,
    checks: tuple[str, ...],
) -> list[MutantResult]:
    """Run the unmutated target through every strategy the mutants use (with the direct checks once)."""
    results = []
    for i, name in enumerate(strategies):
        entry = unmutated_entry(target, name, checks if i == 0 else ())
        r = run_entry(entry, seed=seed, budget_s=budget_s, shrink_s=3.0, out_dir=out, progress=False)
        results.append(r)
        if r.killed:
            _progress_line(r)
    return results


def _run_sglang(args: argparse.Namespace) -> int:
    """`zoo --target sglang`: SGLang's own mutants and hunt (invariants/cli/sglang.py); no explore grid."""
    from invariants.cli.sglang import cmd_zoo_sglang

    if args.explore:
        return _err("--explore: the explore grid drives vLLM-shaped allocators; SGLang has no instances yet")

    if args.only:
        args.only = [n for item in args.only for n in item.split(",") if n]
    return cmd_zoo_sglang(args)


def run(args: argparse.Namespace) -> int:
    """`kvretain zoo`: every selected mutant hunted within its budget, then the unmutated target
    run as a control; exit 0 only when every mutant is killed soundly and the control is clean."""
    if args.target == "sglang":
        return _run_sglang(args)
    from invariants.targets import TargetUnavailable, available_targets

    t_start = time.monotonic()
    reason = available_targets().get(args.target)
    if reason is not None:
        return _err(f"target {args.target}: {reason}")
    only: list[str] | None = None
    if args.only:
        only = [n for item in args.only for n in item.split(",") if n]
        unknown = [n for n in only if n not in _known(args.target)]
        if unknown:
            return _err(
                f"--only: unknown mutant(s) {', '.join(unknown)} (known: {', '.join(sorted(_known(args.target)))})"
            )
    elif args.quick:
        only = [n for n in QUICK_SUBSET if n in _known(args.target)]
    budget = args.budget_s if args.budget_s is not None else (15.0 if args.quick else 60.0)
    shrink = args.shrink_s if args.shrink_s is not None else (3.0 if args.quick else 10.0)
    if budget <= 0:
        return _err("--budget-s: must be positive")
    if args.depth < 1:
        return _err(f"--depth: must be >= 1, got {args.depth}")
    out = Path(args.out)
    try:
        entries, na = _entries(args.target, only)
    except TargetUnavailable as exc:
        return _err(str(exc))
    if args.scale == "production" and args.target != "vllm-manager":
        return _err("--scale production: runs the vLLM mutants (give --target vllm-manager)")
    if args.target.startswith("vllm"):
        from invariants.targets.vllm_env import vllm_modules

        vllm_modules()
    print(f"kvretain zoo: start-up (importing {args.target}) {time.monotonic() - t_start:.1f} s", flush=True)
    if args.scale == "production":
        return _production(args, [e.name for e in entries], budget)
    if args.explore:
        return _explore(args, entries, budget, out)
    print(
        f"kvretain zoo: target {args.target}, {len(entries)} mutant(s), budget {budget:.0f} s each, "
        f"shrink {shrink:.0f} s, seed {args.seed} (batch i uses seed + i)",
        flush=True,
    )
    t0 = time.monotonic()
    report = run_zoo(
        entries,
        target=args.target,
        seed=args.seed,
        budget_s=budget,
        shrink_s=shrink,
        out_dir=out,
        progress=True,
        not_applicable=na,
        on_result=_progress_line,
    )
    control_ok = True if args.no_control else _unmutated_control(args, entries, budget, out)
    print(report.table())
    print(report.summary() + f"; wall {time.monotonic() - t0:.0f} s")
    for r in report.results:
        if r.unsound:
            print(f"UNSOUND {r.name}: its killing trace fails the unmutated {r.target} too: {r.unsound}")
        elif not r.killed:
            print(f"SURVIVOR {r.name}: {r.note or 'no check fired within the budget'}")
    rc = 0 if report.ok and control_ok else 1
    write_results(args, "zoo", zoo_cases(report, None if args.no_control else control_ok), rc)
    return rc


def _unmutated_control(args: argparse.Namespace, entries: list[ZooEntry], budget: float, out: Path) -> bool:
    """The unmutated target over every strategy the mutants used (at most 10 s each): clean, or
    FLAGGED with what fired (a kill there means a check flags correct behaviour)."""
    strategies = list(dict.fromkeys(e.strategy for e in entries))
    checks = tuple(dict.fromkeys(c for e in entries for c in e.checks))
    print(
        f"[zoo] control: unmutated {args.target} over {', '.join(strategies)}",
        file=sys.stderr,
        flush=True,
    )
    ctl = control(args.target, strategies, seed=args.seed, budget_s=min(budget, 10.0), out=out, checks=checks)
    control_ok = not any(r.killed for r in ctl)
    flagged = [f"{r.strategy}: {r.check}: {r.detail[:100]}" for r in ctl if r.killed]
    print(
        f"control (unmutated {args.target}, {sum(r.steps for r in ctl)} steps over {len(ctl)} strategies): "
        + ("clean" if control_ok else "FLAGGED: " + "; ".join(flagged))
    )
    return control_ok


def _explore(args: argparse.Namespace, entries: list[ZooEntry], budget: float, out: Path) -> int:
    """`zoo --explore`: each mutant's shortest counterexample over the explore grid."""
    from invariants.explore.instances import default_grid
    from invariants.zoo.explore_hunt import format_kills, hunt

    grid = default_grid()
    print(
        f"kvretain zoo --explore: target {args.target}, {len(entries)} mutant(s), grid of {len(grid)} "
        f"instances, depth {args.depth}, budget {budget:.0f} s each",
        flush=True,
    )
    out.mkdir(parents=True, exist_ok=True)
    kills = []
    for entry in entries:
        k = hunt(entry, grid, depth=args.depth, budget_s=budget, out_dir=out)
        kills.append(k)
        verdict = f"killed at depth {k.length} on {k.instance}" if k.killed else "SURVIVED"
        print(f"[zoo explore] {entry.name}: {verdict} ({k.seconds:.1f} s)", file=sys.stderr, flush=True)
    print(format_kills(kills))
    rc = 0 if kills and all(k.killed for k in kills) else 1
    cases = [
        CaseResult(
            k.name,
            f"{args.target}-explore",
            "passed" if k.killed else "failed",
            k.seconds,
            f"depth {k.length} on {k.instance}: {k.violation[:160]}" if k.killed else "survived",
            figures={"depth": k.length, "instances": len(k.covered), "not_reached": k.skipped},
        )
        for k in kills
    ]
    write_results(args, "zoo", cases, rc)
    return rc


def _production(args: argparse.Namespace, names: list[str], budget: float) -> int:
    """`zoo --scale production`: each mutant through a production run; the control must stay clean."""
    from invariants.zoo import production

    print(
        f"kvretain zoo --scale production: {len(names)} vLLM mutant(s), budget {budget:.0f} s each "
        f"(a production fuzz run, stopped at the first violation), seed {args.seed}",
        flush=True,
    )

    def line(h: production.ProductionHunt) -> None:
        verdict = f"caught by {h.check}" if h.caught else "not caught"
        print(f"[zoo production] {h.name}: {verdict} after {h.ops:,} ops in {h.seconds:.1f} s", flush=True)

    hunts = production.hunt(names, seed=args.seed, budget_s=budget, on_result=line)
    print(production.report(hunts))
    # A mutant the workload does not meet is a figure, not a failure: "skipped".
    cases = [
        CaseResult(
            h.name,
            "vllm-production",
            "passed" if h.caught else "skipped",
            h.seconds,
            h.violation[:200] if h.caught else "not met by the production workload within the budget",
            figures={"ops": h.ops, "episodes": h.episodes},
        )
        for h in hunts
    ]
    rc = 0
    if not args.no_control:
        ctl = production.control(seed=args.seed, budget_s=budget)
        print(
            f"control (unmutated vllm, {ctl.ops:,} ops, {ctl.episodes} episodes): "
            + (f"FLAGGED: {ctl.violation[:160]}" if ctl.caught else "clean")
        )
        rc = 1 if ctl.caught else 0
        cases.append(
            CaseResult(
                "control",
                "vllm-production",
                "failed" if ctl.caught else "passed",
                ctl.seconds,
                ctl.violation[:200],
            )
        )
    write_results(args, "zoo", cases, rc)
    return rc


LAST_REPORT: ZooReport | None = None


def verify_row(quick: bool = False) -> tuple[str, str, str, str, float, bool]:
    """The `kvretain verify` row: the reference zoo (the quick subset when `quick`)."""
    global LAST_REPORT
    from invariants.zoo.mutants_reference import REFERENCE_MUTANTS

    t0 = time.monotonic()
    names = list(QUICK_SUBSET) if quick else list(REFERENCE_MUTANTS)
    report = run_zoo(
        reference_entries(names),
        target="reference",
        budget_s=15.0 if quick else 60.0,
        shrink_s=1.0 if quick else 5.0,
        out_dir=Path("kvretain-traces/zoo"),
        progress=False,
        on_result=_progress_line,
    )
    LAST_REPORT = report
    killed = sum(r.killed for r in report.results)
    times = sorted(report.kill_times)
    med = times[len(times) // 2] if times else 0.0
    figure = f"{killed}/{len(report.results)} mutants killed, median {med:.1f} s, max {max(times, default=0):.1f} s"
    verdict = (
        "every mutant killed"
        if report.ok
        else "SURVIVORS: " + ", ".join(r.name for r in report.results if not r.killed)[:60]
    )
    return ("zoo", "reference", verdict, figure, time.monotonic() - t0, report.ok)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvretain")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["zoo", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
