"""`kvretain explore`: every operation sequence to a depth, over a grid of small instances.

    kvretain explore [--target model|reference|vllm|vllm-async-scheduler|...] [--depth D] [--max-states N]
                     [--budget-s T] [--instance NAME ...] [--jobs N] [--ray ADDRESS] [--list]
                     [--out DIR] [--json PATH]

Breadth-first search (`invariants.explore`): every operation the alphabet
offers from every reached state, each transition checked by the harness's
Checker against the model and the whole catalogue, states merged by a
canonical fingerprint. Progress lines (depth, frontier, states/s) go to
stderr; stdout gets the certificate: per instance, the depth completed,
distinct states, transitions, time, and the verdict (clean, known findings
with counts, or VIOLATION with the path of its shortest replayable trace),
then the distinct states first reached at each depth, the transitions by
operation kind (drafts, offers and load/save reports named), and what merging
states assumed (on "vllm" and "vllm-async-scheduler" the scheduler's hidden
state is part of every fingerprint: `invariants.targets.vllm_hidden_state`).

The grid follows the target's features (`invariants.explore.instances`): on
a real scheduler the Eagle instance has a lookahead slot (samples carry
drafts), and a target that can attach a KV connector gets a connector
instance (offers, load and save reports).

Before the grid, operation zero: every configuration of a small domain, valid
or not, is built (`invariants.explore.configs`); the target must build
nothing the model rejects, and the valid ones it refuses are counted. Its time
counts against the budget.

`--ray ADDRESS` spreads each instance's frontier over a Ray cluster's workers
(`invariants.campaign`, docs/campaigns.md): the same certificates, each state
expanded once cluster-wide.

`--restore live|pickle`: how the search returns to a state between the
operations it tries from it (restored in place, or thawed afresh per
operation: the definition); the certificate is the same. `--bench` prints the
states/s of each on one instance (`--instance`, default full+swa-p7-dense;
`--depth`, default 5) in one run, alternating, with their ratio; it exits 1 if
their certificates differ (`invariants.explore.bench`).

`--budget-s` is a promise: the run ends within it; the table says, per
instance, where the search stopped and why.

Exit codes: 0 every instance clean (known findings allowed, counted); 1 a
violation (or a fork that disagreed with re-execution, or a configuration the
model rejects that the target builds); 2 bad usage, an unknown
instance or target (one line); 3 clean but some instances skipped (named).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from invariants.cli.fuzz import positive_float, positive_int
from invariants.errors import UsageError
from invariants.explore.bench import BENCH_DEPTH, BENCH_INSTANCE, bench_restore
from invariants.explore.certificate import HEADERS, Certificate
from invariants.explore.configs import ConfigReport, check_configurations
from invariants.explore.grid import GridReport, explore_grid
from invariants.explore.instances import Instance, default_grid, features_of, grid_by_name
from invariants.explore.search import RESTORES
from invariants.report import Progress, table
from invariants.results import CaseResult, add_output_flags, write_results
from invariants.targets import TARGET_NAMES, Target, target_factory
from model.contract.config import Config

DEFAULT_DEPTH = 6
DEFAULT_MAX_STATES = 50_000
DEFAULT_BUDGET_S = 600.0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `explore`; `args.func` is `run`."""
    p = subparsers.add_parser(
        "explore",
        help="exhaustive small-scope checking: every operation sequence to a depth, with a certificate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", choices=TARGET_NAMES, default="model", help="the allocator under test")
    p.add_argument("--depth", type=positive_int, help=f"operations per sequence (default {DEFAULT_DEPTH})")
    p.add_argument(
        "--max-states",
        type=positive_int,
        default=DEFAULT_MAX_STATES,
        help="distinct states per instance before the search stops",
    )
    p.add_argument(
        "--budget-s",
        type=positive_float,
        default=DEFAULT_BUDGET_S,
        help="wall-clock bound for the whole grid (shared: time an instance leaves passes to those not finished)",
    )
    p.add_argument(
        "--instance", action="append", metavar="NAME", help="search only this instance (repeatable, or a,b)"
    )
    p.add_argument(
        "--jobs", type=positive_int, default=1, help="instances searched at once (processes; 2 on 2 cores)"
    )
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="spread each instance's frontier over a Ray cluster's workers (local, local:N, auto, "
        "HOST:PORT; the optional extra kvretain[ray]); docs/campaigns.md",
    )
    p.add_argument(
        "--restore",
        choices=RESTORES,
        default="live",
        help="how a state is returned to between the operations tried from it: live (restored in place) "
        "or pickle (thawed afresh, the definition); the certificate is the same",
    )
    p.add_argument(
        "--bench",
        action="store_true",
        help=f"states/s with each restore on one instance (default {BENCH_INSTANCE}, depth {BENCH_DEPTH}), "
        "in one run, and their ratio",
    )
    p.add_argument(
        "--rounds", type=positive_int, default=1, help="with --bench: searches per restore (the best counts)"
    )
    p.add_argument("--list", action="store_true", help="list the grid's instances and exit")
    p.add_argument("--out", default="kvretain-traces/explore", help="where counterexample traces are written")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    add_output_flags(p)
    p.set_defaults(func=run)
    return p


def _names(raw: list[str] | None) -> list[str] | None:
    if not raw:
        return None
    return [n for item in raw for n in item.split(",") if n]


def _list(target: str) -> int:
    rows = []
    for inst in default_grid(features_of(target_factory(target))):
        cfg = inst.config
        groups = "+".join(
            f"{g.kind}{g.block_size}" + (f"w{g.sliding_window}" if g.sliding_window else "")
            for g in cfg.groups
        )
        rows.append(
            [
                inst.name,
                groups,
                cfg.num_blocks,
                cfg.retention_interval,
                "on" if cfg.eagle else "off",
                cfg.num_lookahead_tokens,
                "on" if cfg.kv_connector else "off",
                inst.max_requests,
                ",".join(map(str, inst.prompt_lengths)),
                ",".join(map(str, inst.budgets)),
            ]
        )
    headers = [
        "instance",
        "groups",
        "blocks",
        "retention",
        "eagle",
        "lookahead",
        "connector",
        "requests",
        "prompts",
        "budgets",
    ]
    print(table(headers, rows))
    return 0


def run(args: argparse.Namespace) -> int:
    """The `explore` command (see the module docstring for exit codes)."""
    if args.list:
        return _list(args.target)
    if args.bench:
        return _bench(args)
    if args.depth is None:
        args.depth = DEFAULT_DEPTH
    factory = target_factory(args.target)
    try:
        instances = grid_by_name(_names(args.instance), features_of(factory))
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    if args.ray and args.jobs > 1:
        raise UsageError("--jobs and --ray: with --ray the Ray workers share each instance's frontier")
    started = time.monotonic()
    configs = check_configurations(factory)
    if args.ray:
        report = _on_ray(args, instances, started)
    else:
        print(
            f"kvretain explore: target {args.target}, depth {args.depth}, {len(instances)} instance(s), "
            f"max {args.max_states} states each, budget {args.budget_s:.0f}s, {args.jobs} job(s)",
            flush=True,
        )
        report = _local(args, instances, factory, started)
    print(certificate_text(report))
    print(configs.summary())
    code = 1 if report.violations or not configs.ok else 3 if report.skipped else 0
    cases = [_case(c) for c in report.certificates] + [_configs_case(configs)]
    write_results(args, "explore", cases, code)
    return code


def _local(
    args: argparse.Namespace, instances: list[Instance], factory: Callable[[Config], Target], started: float
) -> GridReport:
    return explore_grid(
        instances,
        factory,
        args.target,
        depth=args.depth,
        max_states=args.max_states,
        budget_s=max(args.budget_s - (time.monotonic() - started), 1.0),
        out_dir=Path(args.out),
        progress=Progress("explore", enabled=not args.quiet),
        jobs=args.jobs,
        restore=args.restore,
    )


def _on_ray(args: argparse.Namespace, instances: list[Instance], started: float) -> GridReport:
    """The grid on a Ray cluster (`invariants.campaign.explore`): the same certificates."""
    from invariants.campaign import connect
    from invariants.campaign.explore import explore_grid_on_ray

    session = connect(args.ray)
    try:
        print(
            f"kvretain explore: target {args.target}, depth {args.depth}, {len(instances)} instance(s), "
            f"max {args.max_states} states each, budget {args.budget_s:.0f}s, "
            f"on Ray ({args.ray}, {session.workers} worker(s))",
            flush=True,
        )
        return explore_grid_on_ray(
            session,
            instances,
            args.target,
            depth=args.depth,
            max_states=args.max_states,
            budget_s=max(args.budget_s - (time.monotonic() - started), 1.0),
            out_dir=Path(args.out),
            progress=Progress("explore", enabled=not args.quiet),
            restore=args.restore,
        )
    finally:
        session.close()


def _bench(args: argparse.Namespace) -> int:
    """`--bench`: each restore's states/s on one instance (`invariants.explore.bench`)."""
    factory = target_factory(args.target)
    names = _names(args.instance) or [BENCH_INSTANCE]
    try:
        instance = grid_by_name(names[:1], features_of(factory))[0]
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    bench = bench_restore(instance, factory, args.target, args.depth or BENCH_DEPTH, args.rounds)
    print(bench.text())
    code = 0 if bench.same else 1
    case = CaseResult(
        name=f"bench {instance.name}",
        group="explore",
        outcome="passed" if bench.same else "failed",
        message=f"live/pickle states/s {bench.ratio():.2f}x",
        figures=bench.to_json(),
    )
    write_results(args, "explore", [case], code)
    return code


def _configs_case(report: ConfigReport) -> CaseResult:
    return CaseResult(
        name="configurations",
        group="explore",
        outcome="passed" if report.ok else "failed",
        message=report.summary(),
        figures={"checked": report.checked, "valid": report.valid, "refused": report.refused},
    )


def certificate_text(report: GridReport) -> str:
    """The certificate table, states by depth, and a summary line."""
    lines = [table(HEADERS, [c.row() for c in report.certificates], right=(2, 3, 4, 5))]
    lines.append("\ndistinct states first reached at each depth (depth 0 = the empty allocator):")
    for c in report.certificates:
        if not c.skipped:
            lines.append(f"  {c.instance}: {' '.join(map(str, c.new_states))}")
    lines.append("\ntransitions by operation kind:")
    for c in report.certificates:
        if not c.skipped:
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(c.op_kinds.items()))
            lines.append(f"  {c.instance}: {kinds}")
    steps = [(c.instance, c.steps) for c in report.certificates if c.steps and not c.skipped]
    if steps:
        lines.append("\nsteps chosen by:")
        lines += [f"  {name}: {text}" for name, text in steps]
    for text in dict.fromkeys(c.merging for c in report.certificates if c.merging):
        lines.append(f"\nstates merged: {text}")
    for c in report.certificates:
        if c.violation:
            lines.append(f"\n{c.instance}: {c.violation}")
            lines.append(f"  shortest trace ({c.trace_length} operations): {c.trace}")
            lines.append(f"  re-run from scratch: {'reproduced' if c.reproduced else 'NOT reproduced'}")
    lines.append(_summary(report))
    return "\n".join(lines)


def _summary(report: GridReport) -> str:
    searched = [c for c in report.certificates if not c.skipped]
    head = (
        f"\n{len(searched)} instance(s), depth >= {report.min_depth()} on every one, "
        f"{report.states} states, {report.transitions} transitions in {report.seconds:.1f}s"
    )
    if report.violations:
        return head + f": {len(report.violations)} VIOLATION(s)"
    skipped = report.skipped
    if skipped:
        return (
            head + f": holds, {len(skipped)} instance(s) skipped ({', '.join(c.instance for c in skipped)})"
        )
    return head + ": holds"


def _case(c: Certificate) -> CaseResult:
    outcome = "skipped" if c.skipped else "failed" if (c.violation or c.error) else "passed"
    return CaseResult(
        name=c.instance,
        group="explore",
        outcome=outcome,  # type: ignore[arg-type]
        seconds=c.seconds,
        message=c.verdict_text(),
        trace=str(c.trace) if c.trace else None,
        figures=c.to_json(),
    )


# `kvretain verify`'s row: every sequence of at most the stated depth on every instance of
# the real scheduler's grid; the budget is a bound, and an instance it cuts short fails the row.
VERIFY_TARGET = "vllm"
VERIFY_MIN_DEPTH = 3
VERIFY_QUICK_MIN_DEPTH = 2
VERIFY_BUDGET_S = 150.0
VERIFY_QUICK_BUDGET_S = 40.0


def verify_row(
    target: str = VERIFY_TARGET,
    quick: bool = False,
    out: Path | None = None,
    *,
    instances: list[Instance] | None = None,
    factory: Callable[[Config], Target] | None = None,
) -> tuple[str, str, str, str, float, bool, Any]:
    """(check, target, verdict, figure, seconds, good, trace) for `kvretain verify`: every
    instance of `target`'s grid (`instances`, by default `default_grid` for its features)
    searched to the stated minimum depth (`VERIFY_MIN_DEPTH`, quick:
    `VERIFY_QUICK_MIN_DEPTH`) within the budget (two processes).

    The row holds only when no instance violated, none was skipped, and every one
    completed that depth (a budget too small for it fails the row, never lowers the
    claim); the figure names the minimum, each instance's depth and the skipped ones.
    `factory` replaces the target's constructor (a test's planted refusal)."""
    build = factory or target_factory(target)
    grid = instances if instances is not None else default_grid(features_of(build))
    minimum = VERIFY_QUICK_MIN_DEPTH if quick else VERIFY_MIN_DEPTH
    report = explore_grid(
        grid,
        build,
        target,
        depth=minimum,
        max_states=DEFAULT_MAX_STATES,
        budget_s=VERIFY_QUICK_BUDGET_S if quick else VERIFY_BUDGET_S,
        out_dir=out,
        jobs=2,
    )
    return verify_verdict(report, minimum)


def verify_verdict(report: GridReport, minimum: int) -> tuple[str, str, str, str, float, bool, Any]:
    """The verify row of a searched grid (see `verify_row`): fails on a violation, a
    skipped instance, or an instance below depth `minimum`."""
    searched = [c for c in report.certificates if not c.skipped]
    depths = "/".join(str(c.depth_completed) for c in searched)
    shallow = [c for c in searched if c.depth_completed < minimum]
    skipped = report.skipped
    figure = (
        f"minimum depth {minimum}: depth >= {report.min_depth()} on {len(searched)} of "
        f"{len(report.certificates)} instances ({depths}), {report.states:,} states"
        + (f", {len(skipped)} skipped" if skipped else "")
    )
    bad = report.violations
    known = sum(c.known.total for c in report.certificates)
    if bad:
        verdict = f"VIOLATION: {bad[0].instance}: {bad[0].violation or bad[0].error}"
    elif skipped:
        verdict = f"FAILED: {len(skipped)} instance(s) skipped: " + ", ".join(
            f"{c.instance} ({c.skipped})" for c in skipped
        )
    elif shallow:
        verdict = f"FAILED: below depth {minimum}: " + ", ".join(
            f"{c.instance} ({c.depth_completed})" for c in shallow
        )
    else:
        verdict = "clean" + (f" (known findings tolerated x{known})" if known else "")
    good = not bad and not skipped and not shallow
    trace = next((c.trace for c in bad if c.trace), None)
    return ("explore", report.target, verdict[:90], figure, report.seconds, good, trace)


__all__ = ["add_parser", "certificate_text", "run", "verify_row", "verify_verdict"]
