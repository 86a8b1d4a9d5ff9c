"""`kvretain fuzz --ray ADDRESS --seeds A-B`: a fuzz campaign over a Ray cluster.

Every (configuration, seed) pair is one `kvretain fuzz` run on a worker
(`invariants.campaign.fuzz`), with the same steps and budget each; the report
is a row per run, the totals (sums of the runs' counts) and the merged known
findings; `--json` / `--junit-xml` hold every run's row and the merged one.
Exit code: the worst run's (1 a violation, 4 undeclared policy drift, else 0).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from invariants.errors import UsageError
from invariants.results import write_results

MAX_RUNS = 10_000


def parse_seeds(text: str) -> list[int]:
    """`A-B` (inclusive) or `A,B,...` (or a mix: `0-3,9`) -> the seeds; bad input is a UsageError."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise UsageError(f"--seeds {text!r}: expected A-B or A,B,... (non-negative integers)") from None
        if a < 0 or b < a:
            raise UsageError(f"--seeds {text!r}: a range A-B needs 0 <= A <= B")
        seeds.extend(range(a, b + 1))
        if len(seeds) > MAX_RUNS:
            raise UsageError(f"--seeds {text!r}: more than {MAX_RUNS} seeds")
    return list(dict.fromkeys(seeds))


def cmd_fuzz_campaign(args: argparse.Namespace) -> int:
    """`fuzz --ray`: see the module docstring."""
    from invariants.layouts.presets import preset

    if not args.ray:
        raise UsageError("--seeds runs a campaign: give --ray ADDRESS too (local:2 on this machine)")
    if args.target == "sglang" or args.scale == "production":
        raise UsageError("--ray: a campaign runs the small-scale fuzz of a vLLM-shaped target")
    seeds = parse_seeds(args.seeds) if args.seeds else [args.seed]
    configs: list[str | None] = [c for c in (args.config or "").split(",") if c] or [None]
    for name in configs:
        if name:
            preset(name)  # an unknown name is the one line, before Ray starts
    from invariants.campaign import connect
    from invariants.campaign.fuzz import format_campaign, fuzz_campaign
    from invariants.cli.fuzz import _steps
    from invariants.harness.fuzz import DEFAULT_STEPS

    steps = _steps(args, DEFAULT_STEPS)
    session = connect(args.ray)
    try:
        print(
            f"kvretain fuzz: campaign on Ray ({args.ray}, {session.workers} worker(s)): target {args.target}, "
            f"{len(configs)} config(s), seeds {seeds[0]}..{seeds[-1]} ({len(seeds)}), "
            f"steps {steps or 'until the budget'}, budget {args.budget_s or 'none'} s per run",
            flush=True,
        )
        report = fuzz_campaign(
            session,
            args.target,
            seeds,
            configs,
            steps=steps,
            budget_s=args.budget_s,
            shrink_s=args.shrink_s,
            out_dir=Path(args.out),
            audit_every=args.audit_every,
            log=lambda line: print(f"kvretain fuzz: {line}", flush=True),
        )
    finally:
        session.close()
    print(format_campaign(report))
    write_results(args, "fuzz", report.cases(), report.exit_code)
    return report.exit_code
