"""`--target sglang` of `kvretain fuzz`, `zoo` and `bench`, and SGLang's `verify` row.

SGLang's radix cache has its own ops, observations and model (`model/radix/`),
so its commands live here and the generic commands hand over to them when
`--target sglang` is given. When SGLang cannot be imported each command says
why in one line and exits 2 (`verify` instead counts the row as skipped).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from invariants.report import table


def _unavailable() -> str | None:
    from invariants.targets.sglang_env import sglang_available

    ok, why = sglang_available()
    return None if ok else why


def _layouts(names: str | None) -> dict[str, Any]:
    from model.radix.config import LAYOUTS

    if not names:
        return dict(LAYOUTS)
    picked = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in picked if n not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown radix layout {', '.join(unknown)} (known: {', '.join(LAYOUTS)})")
    return {n: LAYOUTS[n] for n in picked}


def fuzz_sglang(
    budget_s: float, seed: int, out: Path, layouts: str | None = None, shrink_s: float = 20.0
) -> tuple[int, list[dict[str, Any]]]:
    """Fuzz every layout (both tree cores in lockstep) for budget_s / len(layouts) each;
    a failing history is shrunk for up to `shrink_s` seconds before its trace is written."""
    from invariants.harness.radix_fuzz import fuzz_layout, write_trace

    chosen = _layouts(layouts)
    rows, runs = [], []
    for name, layout in chosen.items():
        run = fuzz_layout(name, layout, budget_s / len(chosen), seed, shrink_s=shrink_s)
        runs.append(run.to_json())
        verdict = "clean" if run.violation is None else f"VIOLATION {run.violation[0]}"
        if run.violation is not None:
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"kvretain-sglang-{name}-seed{run.seed}.json"
            write_trace(run, layout, path)
            verdict += f" (trace {path}): {run.violation[1]}"
        cov = run.coverage
        reached = f"{cov['hit']}/{cov['rejected']}/{cov['evicted']}/{cov['tombstone']}/{cov['recovered']}"
        identities = f"{cov['identity_admits']}/{cov['identity_hits']}"
        rows.append(
            [
                name,
                str(run.seeds),
                str(run.ops),
                f"{run.ops / max(run.seconds, 1e-9):.0f}",
                reached,
                identities,
                verdict,
            ]
        )
    print(
        table(
            [
                "layout",
                "seeds",
                "ops",
                "ops/s",
                "hits/rejected/evictions/tombstoned/recovered",
                "identity admits/hits",
                "verdict",
            ],
            rows,
        )
    )
    return (1 if any(r["violation"] for r in runs) else 0), runs


def _unsupported(args: argparse.Namespace) -> str | None:
    """Options of `kvretain fuzz` that mean nothing for the radix target."""
    if args.scale != "small":
        return "--scale production: not available for --target sglang"
    if args.steps is not None:
        return "--steps: --target sglang runs for --budget-s seconds"
    return None


def cmd_fuzz_sglang(args: argparse.Namespace) -> int:
    """`kvretain fuzz --target sglang [--config LAYOUT[,LAYOUT]] [--budget-s T] [--seed N]`."""
    why = _unavailable()
    if why is not None:
        print(f"kvretain fuzz: target sglang: {why}")
        return 2
    bad = _unsupported(args)
    if bad is not None:
        print(f"kvretain fuzz: {bad}")
        return 2
    try:
        _layouts(args.config)
    except ValueError as exc:
        print(f"kvretain fuzz: --config: {exc}")
        return 2
    budget = args.budget_s or 60.0
    print(
        f"kvretain fuzz: target sglang (Python and Rust tree cores in lockstep), seed {args.seed}, budget {budget} s"
    )
    shrink = 20.0 if args.shrink_s is None else args.shrink_s
    rc, runs = fuzz_sglang(budget, args.seed, Path(args.out), args.config, shrink)
    if getattr(args, "json", None):
        Path(args.json).write_text(
            json.dumps({"target": "sglang", "seed": args.seed, "layouts": runs}, indent=1)
        )
    return rc


def cmd_zoo_sglang(args: argparse.Namespace) -> int:
    why = _unavailable()
    if why is not None:
        print(f"kvretain zoo: target sglang: {why}")
        return 2
    from invariants.zoo.mutants_sglang import SGLANG_MUTANTS, hunt, warm_up

    only = list(args.only or SGLANG_MUTANTS)
    unknown = [n for n in only if n not in SGLANG_MUTANTS]
    if unknown:
        print(
            f"kvretain zoo: --only: unknown mutant(s) {', '.join(unknown)} (known: {', '.join(SGLANG_MUTANTS)})"
        )
        return 2
    budget = args.budget_s or 30.0
    print(
        f"kvretain zoo: SGLang's first cache build took {warm_up():.1f} s (one-time, not in the kill times)"
    )
    rows, survivors = [], 0
    for name in only:
        row = hunt(name, budget, args.seed)
        survivors += row.killed_by is None
        rows.append(
            [
                name,
                SGLANG_MUTANTS[name].doc,
                row.layout,
                row.killed_by or "SURVIVED",
                f"{row.seconds:.2f}",
                str(row.ops),
            ]
        )
    print(table(["mutant", "bug class", "layout", "killed by", "seconds", "ops"], rows))
    print(
        f"{len(only) - survivors}/{len(only)} SGLang mutants killed (seed {args.seed}, budget {budget} s each)"
    )
    return 1 if survivors else 0


def bench_sglang(seed: int, ops: int) -> dict[str, float]:
    """ops/s of the same history: raw (no checks) per core, and checked (both cores, every check)."""
    from invariants.harness.radix_check import RadixChecker
    from invariants.harness.radix_fuzz import generate_ops
    from invariants.targets.sglang_drive import SglangDriver
    from model.radix.config import LAYOUTS

    layout = LAYOUTS["swa-p1"]
    history = generate_ops(seed, layout, ops)
    figures: dict[str, float] = {}
    for core in ("python", "rust"):
        SglangDriver(layout, core)  # the process's first build initializes SGLang: not timed
    for core in ("python", "rust"):
        driver = SglangDriver(layout, core)
        start = time.perf_counter()
        for op in history:
            driver.apply(op)
        figures[f"raw {core}"] = len(history) / (time.perf_counter() - start)
    for cores in (("python",), ("python", "rust")):
        checker = RadixChecker(layout, cores)
        start = time.perf_counter()
        for op in history:
            checker.step(op)
        figures[f"checked {'+'.join(cores)}"] = len(history) / (time.perf_counter() - start)
    return figures


def cmd_bench_sglang(args: argparse.Namespace) -> int:
    why = _unavailable()
    if why is not None:
        print(f"kvretain bench: target sglang: {why}")
        return 2
    figures = bench_sglang(args.seed, args.requests * 3)
    rows = [[name, f"{value:.0f}"] for name, value in figures.items()]
    print(table(["SGLang swa-p1 history", "ops/s"], rows))
    ratio = figures["checked python"] / figures["raw python"]
    # The lockstep run does both cores' work: compare it with both cores' raw time.
    raw_both = 1.0 / (1.0 / figures["raw python"] + 1.0 / figures["raw rust"])
    lockstep = figures["checked python+rust"] / raw_both
    print(
        f"checked/raw, Python core: {ratio:.2f}; both cores in lockstep / both cores raw: {lockstep:.2f} (goal >= 0.33)"
    )
    return 0


def is_radix_trace(path: Path) -> bool:
    """Whether `path` is a trace written by `fuzz --target sglang` (it names its radix layout)."""
    try:
        return "layout_fields" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False  # the generic reader reports the problem


def cmd_replay_sglang(path: Path) -> int:
    """Re-run a radix trace on both tree cores with every check; exit 1 if it still fails."""
    why = _unavailable()
    if why is not None:
        print(f"kvretain replay: target sglang: {why}")
        return 2
    from invariants.harness.radix_check import RadixChecker
    from invariants.harness.radix_fuzz import read_trace, run_history

    try:
        layout, ops = read_trace(path)
        layout.validate()
    except (KeyError, ValueError) as exc:
        print(f"kvretain replay: {path}: not a valid radix trace: {exc}")
        return 2
    violation, done = run_history(RadixChecker(layout), ops)
    if violation is None:
        print(f"kvretain replay: {path}: {len(ops)} ops on SGLang ({layout.name}): clean")
        return 0
    print(f"kvretain replay: {path}: op {len(done) - 1}: {violation[0]}: {violation[1]}")
    return 1


def verify_row(budget_s: float, seed: int, out: Path) -> tuple[str, str, int]:
    """(verdict, detail, rc) of SGLang's `verify` row; verdict 'skipped' when SGLang is absent."""
    why = _unavailable()
    if why is not None:
        return "skipped", why, 0
    rc, runs = fuzz_sglang(budget_s, seed, out)
    ops = sum(r["ops"] for r in runs)
    bad = [r["layout"] for r in runs if r["violation"]]
    if bad:
        return "FAIL", f"violations on {', '.join(bad)} ({ops} ops)", 1
    return "pass", f"{len(runs)} layouts x 2 tree cores, {ops} ops, clean", 0
