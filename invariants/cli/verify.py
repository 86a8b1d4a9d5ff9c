"""`kvretain verify`: the main job. Proofs, fuzzing of every installed target,
conformance, known findings, the zoo, the simulator and the GPU check, as one
table.

Exit codes: 0 "everything holds" (every row ran and held); 1 a row failed, or
a row of a target named by `--require` was skipped; 3 "holds, N row(s)
skipped": what ran held, but a target could not be imported, so its rows did
not run (each skipped row is in the table, the JSON and the JUnit XML with its
reason). A green that skipped something is never exit 0."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from invariants.report import table
from invariants.results import CaseResult, Outcome, write_results
from invariants.targets import available_targets

Record = Callable[[str, str, str, str, float, bool], None]


def import_row_module(module: str, record: Record) -> Any:
    """The module behind a row. One that fails to import is an ERROR row that
    fails the run: a broken build never reads as "everything holds"."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        record(
            module.rsplit(".", 1)[-1],
            "-",
            f"ERROR: cannot import {module}",
            f"{type(exc).__name__}: {exc}"[:70],
            0.0,
            False,
        )
        return None


def production_row(budget_s: float, seed: int, out: Path) -> tuple[str, str, str, str, float, bool, Any]:
    """vLLM's own presets at the sizes vLLM gives them (1M-token prompts, bursts, the
    fine-grained Mamba unit, caching off: what small configurations never reach),
    for `budget_s`, shrinking included."""
    from invariants.cli.fuzz import fuzz_production

    outcome = fuzz_production(
        "vllm",
        seed=seed,
        steps=None,
        budget_s=budget_s,
        shrink_s=budget_s / 4,
        out=out,
        say=lambda line: print(f"[verify] fuzz --scale production: {line}", file=sys.stderr, flush=True),
    )
    return (
        "fuzz (production scale)",
        "vllm",
        outcome.verdict if outcome.violation is None else f"VIOLATION: {outcome.violation}"[:70],
        f"{outcome.ops:,} ops, {outcome.ops_per_s:.0f} ops/s",
        outcome.seconds,
        outcome.violation is None,
        outcome.trace,
    )


def cmd_verify(args: argparse.Namespace) -> int:
    """The main job: proofs, fuzzing against every installed target, GPU check on CPU."""
    rows: list[tuple[object, ...]] = []
    cases: list[CaseResult] = []  # the same rows, for --junit-xml / --json
    ok = True

    def record(
        check: str, target: str, verdict: str, figure: str, seconds: float, good: bool, trace: Any = None
    ) -> None:
        nonlocal ok
        ok &= good
        rows.append((check, target, verdict, figure, f"{seconds:.1f}"))
        outcome: Outcome = "passed" if good else ("error" if verdict.startswith("ERROR") else "failed")
        cases.append(
            CaseResult(
                f"{check} [{target}]",
                check,
                outcome,
                seconds,
                verdict,
                trace and str(trace),
                {"figure": figure},
            )
        )
        print(f"[verify] {check} {target}: {verdict} ({figure})", file=sys.stderr, flush=True)

    skips: list[str] = []

    def skipped(check: str, target: str, reason: str) -> None:
        nonlocal ok
        required = target in (args.require or ())
        ok &= not required
        verdict = "FAILED: required but skipped" if required else "skipped"
        rows.append((check, target, verdict, reason[:70], "0.0"))
        cases.append(
            CaseResult(f"{check} [{target}]", check, "failed" if required else "skipped", 0.0, reason)
        )
        skips.append(f"{check} [{target}]")
        print(f"[verify] {check} {target}: skipped: {reason}", file=sys.stderr, flush=True)

    def imported(module: str) -> Any:
        return import_row_module(module, record)

    theorems = imported("invariants.proofs.runner")
    if theorems is not None:
        t = time.monotonic()
        results = theorems.run_theorems(progress=None)  # type: ignore[attr-defined]
        proved = sum(r.expected_ok for r in results)
        bad = [r.name for r in results if not r.expected_ok]
        record(
            "prove",
            "model",
            "holds" if not bad else "FAILED: " + ", ".join(bad[:3]),
            f"{proved}/{len(results)} as expected",
            time.monotonic() - t,
            not bad,
        )
        if available_targets().get("vllm") is not None:
            skipped("production link", "vllm", str(available_targets()["vllm"]))
        else:
            from invariants.proofs.production_link import run_production_link

            t = time.monotonic()
            link = run_production_link(quick=args.quick)
            bad = [r.name for r in link if not r.expected_ok]
            record(
                "production link",
                "vllm",
                "holds" if not bad else "FAILED: " + ", ".join(bad),
                f"{len(link)} vLLM formulas = model, exhaustive",
                time.monotonic() - t,
                not bad,
            )

    from invariants.harness.fuzz import format_failure, run_fuzz

    budget = 20.0 if args.quick else args.budget_s
    steps = 400 if args.quick else args.steps
    for name, reason in available_targets().items():
        if name == "model":
            continue
        if reason is not None:
            skipped("fuzz", name, reason)
            continue
        report = run_fuzz(
            name, steps=steps, seed=args.seed, budget_s=budget, out_dir=Path(args.out), progress=True
        )
        if report.failure is not None:
            print(format_failure(report))
        record(
            "fuzz",
            name,
            report.verdict,
            f"{report.stats.steps} steps, {report.ops_per_s:.0f} ops/s, hit {report.stats.hit_rate:.0%}",
            report.seconds,
            report.failure is None,
            report.trace_path,
        )

    vllm_missing = available_targets().get("vllm")
    if vllm_missing is None:
        record(*production_row(20.0 if args.quick else args.budget_s, args.seed, Path(args.out)))

        from invariants.harness.conformance import run_conformance

        t = time.monotonic()
        conf_rows: list[Any] = []
        rc = run_conformance(
            steps=300 if args.quick else 1500,
            budget_s=10.0 if args.quick else 30.0,
            seed=args.seed,
            out=Path(args.out),
            sink=conf_rows,
        )
        record(
            "conformance",
            "vllm",
            "agrees with the model" if rc == 0 else "FINDING (see above)",
            f"{len(conf_rows)} feature rows",
            time.monotonic() - t,
            rc == 0,
            next((r.trace for r in conf_rows if r.trace), None),
        )
    else:
        skipped("fuzz (production scale)", "vllm", vllm_missing)
        skipped("conformance", "vllm", vllm_missing)

    from invariants.harness.known_findings import recheck_known_findings

    t = time.monotonic()
    usable = {n for n, why in available_targets().items() if why is None}
    rechecked = recheck_known_findings(usable)
    gone = [f"{fid} on {tgt}" for fid, tgt, still in rechecked if not still]
    record(
        "known findings",
        ",".join(sorted(usable)),
        "all reproduce" if not gone else "NO LONGER REPRODUCE: " + "; ".join(gone),
        f"{len(rechecked)} finding/target pairs replayed",
        time.monotonic() - t,
        not gone,
    )

    zoo = imported("invariants.cli.zoo")
    if zoo is not None:
        record(*zoo.verify_row(quick=args.quick))

    explore = imported("invariants.cli.explore")
    if explore is not None and vllm_missing is not None:
        skipped("explore", "vllm", vllm_missing)
    elif explore is not None:  # every sequence of the small grid, model against vLLM
        record(*explore.verify_row("vllm", quick=args.quick, out=Path(args.out) / "explore"))

    sim = imported("invariants.cli.simulate")
    if sim is not None:
        # Small scale keeps verify fast; `kvretain simulate all --scale full` gives the real sizes.
        check, target, verdict, figure, seconds, good = sim.verify_row(
            quick=True, out=Path(args.out) / "simulate"
        )
        record(check, target, verdict, f"report in {Path(args.out) / 'simulate'}", seconds, good)

    # The GPU check's row comes through the kvretain.commands entry point (gpu_check
    # imports invariants, never the reverse); a group without verify_row adds no row.
    from invariants.cli.main import command_plugins

    for plugin in command_plugins().values():
        verify_row = getattr(imported(plugin.module), "verify_row", None)
        if verify_row is not None:
            check, target, verdict, figure, seconds, good = verify_row(quick=args.quick)
            record(check, target, verdict, figure, seconds, good)

    print(table(["check", "target", "verdict", "figure", "seconds"], rows))
    rc = 1 if not ok else 3 if skips else 0
    if rc == 0:
        print("kvretain verify: everything holds")
    elif rc == 3:
        print(f"kvretain verify: holds, {len(skips)} row(s) skipped (not checked): {', '.join(skips)}")
    else:
        print("kvretain verify: FAILED")
    write_results(args, "verify", cases, rc)
    return rc
