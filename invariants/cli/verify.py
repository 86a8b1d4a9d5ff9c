"""`kvretain verify`: the main job. Proofs, fuzzing of every installed target,
conformance, known findings, the zoo, the simulator and the GPU check, as one
table.

The table is `ROWS`: each entry a small function that runs one check (or one
check per target) and records its row(s) on the `VerifyRun`; they run in the
listed order. A row that cannot run says why as a skipped row, never by
disappearing.

Exit codes: 0 "everything holds" (every row ran and held); 1 a row failed, or
a row of a target named by `--require` was skipped; 3 "holds, N row(s)
skipped": what ran held, but a target could not be imported, so its rows did
not run (each skipped row is in the table, the JSON and the JUnit XML with its
reason). A green that skipped something is never exit 0. 4 "POLICY DRIFT, no
defect": every contract held, but a fuzz row's target made one of vLLM's policy
decisions otherwise than the model predicts (not declared in
`KVRETAIN_DECLARED_POLICIES`; docs/semantics.md, "Verdicts"); a defect wins
(1), drift outranks skips. The last lines state both counts."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from invariants.report import fitted_table, wrap
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
    through vLLM's real `Scheduler`, for `budget_s`, shrinking included."""
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


@dataclass
class VerifyRun:
    """One `kvretain verify`: its arguments and the rows recorded so far (the
    table, the JUnit/JSON cases, the skipped rows, whether everything held)."""

    args: argparse.Namespace
    rows: list[tuple[object, ...]] = field(default_factory=list)
    cases: list[CaseResult] = field(default_factory=list)  # the same rows, for --junit-xml / --json
    skips: list[str] = field(default_factory=list)
    drifts: list[str] = field(default_factory=list)  # rows with undeclared policy drift alone (exit 4)
    defects: list[str] = field(default_factory=list)  # rows that failed
    ok: bool = True
    modules: dict[str, Any] = field(default_factory=dict)

    @property
    def out(self) -> Path:
        return Path(self.args.out)

    def record(
        self,
        check: str,
        target: str,
        verdict: str,
        figure: str,
        seconds: float,
        good: bool,
        trace: Any = None,
    ) -> None:
        """A row that ran: held (`good`), failed, or an ERROR (a verdict starting so)."""
        self.ok &= good
        if not good:
            self.defects.append(f"{check} [{target}]")
        self.rows.append((check, target, verdict, figure, f"{seconds:.1f}"))
        outcome: Outcome = "passed" if good else ("error" if verdict.startswith("ERROR") else "failed")
        self.cases.append(
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

    def skipped(self, check: str, target: str, reason: str) -> None:
        """A row that did not run; a failure when `--require` names its target."""
        # `--require vllm` covers every vLLM target (vllm-manager, vllm-async-scheduler).
        required = any(target == r or target.startswith(f"{r}-") for r in self.args.require or ())
        self.ok &= not required
        verdict = "FAILED: required but skipped" if required else "skipped"
        self.rows.append((check, target, verdict, reason[:70], "0.0"))
        self.cases.append(
            CaseResult(f"{check} [{target}]", check, "failed" if required else "skipped", 0.0, reason)
        )
        self.skips.append(f"{check} [{target}]")
        print(f"[verify] {check} {target}: skipped: {reason}", file=sys.stderr, flush=True)

    def imported(self, module: str) -> Any:
        """The module behind a row, imported once (a failure is one ERROR row, then None)."""
        if module not in self.modules:
            self.modules[module] = import_row_module(module, self.record)
        return self.modules[module]

    def missing(self, target: str) -> str | None:
        """Why `target` cannot run here, or None when it can."""
        return available_targets().get(target)

    def finish(self) -> int:
        """Print the table and the verdict line, write JUnit/JSON; the exit code."""
        print(fitted_table(["check", "target", "verdict", "figure", "seconds"], self.rows))
        rc = 1 if not self.ok else 4 if self.drifts else 3 if self.skips else 0
        print(
            wrap(
                f"kvretain verify: {len(self.defects)} row(s) failed (a defect or an ERROR), {len(self.drifts)} "
                "row(s) with policy drift alone (every contract kept; a declared drift is not counted: "
                "KVRETAIN_DECLARED_POLICIES)"
            )
        )
        if rc == 4:
            print(wrap(f"kvretain verify: POLICY DRIFT, no defect: {', '.join(self.drifts)}"))
        elif rc == 0:
            print("kvretain verify: everything holds")
        elif rc == 3:
            print(f"kvretain verify: holds, {len(self.skips)} row(s) skipped (not checked):")
            print("\n".join(f"  - {row}" for row in self.skips))
        else:
            print("kvretain verify: FAILED")
        write_results(self.args, "verify", self.cases, rc)
        return rc


# -- the rows -----------------------------------------------------------------


def row_prove(run: VerifyRun) -> None:
    """Every Z3 theorem, as expected (proved, or refuted where a refutation is the point)."""
    theorems = run.imported("invariants.proofs.runner")
    if theorems is None:
        return
    t = time.monotonic()
    results = theorems.run_theorems(progress=None)
    proved = sum(r.expected_ok for r in results)
    bad = [r.name for r in results if not r.expected_ok]
    run.record(
        "prove",
        "model",
        "holds" if not bad else "FAILED: " + ", ".join(bad[:3]),
        f"{proved}/{len(results)} as expected",
        time.monotonic() - t,
        not bad,
    )


def row_production_link(run: VerifyRun) -> None:
    """vLLM's own formulas equal the model's, exhaustively (with the proofs only)."""
    if run.imported("invariants.proofs.runner") is None:
        return
    missing = run.missing("vllm")
    if missing is not None:
        run.skipped("production link", "vllm", str(missing))
        return
    from invariants.proofs.production_link import run_production_link

    t = time.monotonic()
    link = run_production_link(quick=run.args.quick)
    bad = [r.name for r in link if not r.expected_ok]
    run.record(
        "production link",
        "vllm",
        "holds" if not bad else "FAILED: " + ", ".join(bad),
        f"{len(link)} vLLM formulas = model, exhaustive",
        time.monotonic() - t,
        not bad,
    )


def row_fuzz(run: VerifyRun) -> None:
    """One fuzz row per target but the model (skipped where it cannot be imported)."""
    from invariants.harness.fuzz import format_failure, run_fuzz

    budget = 20.0 if run.args.quick else run.args.budget_s
    steps = 400 if run.args.quick else run.args.steps
    for name, reason in available_targets().items():
        if name == "model":
            continue
        if reason is not None:
            run.skipped("fuzz", name, reason)
            continue
        report = run_fuzz(
            name, steps=steps, seed=run.args.seed, budget_s=budget, out_dir=run.out, progress=True
        )
        if report.failure is not None:
            print(format_failure(report))
        if report.drifts:
            print(f"{name}: {report.drift_line()}")
        run.record(
            "fuzz",
            name,
            report.verdict,
            f"{report.stats.steps} steps, {report.ops_per_s:.0f} ops/s, hit {report.stats.hit_rate:.0%}"
            + (f", {report.drifts} drifting example(s)" if report.drifts else "")
            + "".join(f"; not generated: {why.split(' (')[0]}" for why in report.not_generated),
            report.seconds,
            report.failure is None,
            report.trace_path or report.drift_trace_path,
        )
        if report.exit_code == 4:  # drift alone: not a defect, counted apart (exit 4)
            run.drifts.append(f"fuzz [{name}]")
            run.cases[-1].outcome = "failed"  # the JSON's `ok` and the JUnit XML say it too
        run.cases[-1].policy_drift = report.drift_json()


def row_sglang(run: VerifyRun) -> None:
    """SGLang's radix cache, every layout, both tree cores (skipped where SGLang cannot be imported)."""
    sglang = run.imported("invariants.cli.sglang")
    if sglang is None:
        return
    budget = 20.0 if run.args.quick else run.args.budget_s
    start = time.perf_counter()
    verdict, detail, rc = sglang.verify_row(budget, run.args.seed, run.out / "sglang")
    if verdict == "skipped":
        run.skipped("fuzz", "sglang", detail)
    else:
        run.record("fuzz", "sglang", verdict, detail, time.perf_counter() - start, rc == 0)


def row_production_scale(run: VerifyRun) -> None:
    """vLLM at its own presets' sizes (`production_row`)."""
    missing = run.missing("vllm")
    if missing is not None:
        run.skipped("fuzz (production scale)", "vllm", missing)
        return
    run.record(*production_row(20.0 if run.args.quick else run.args.budget_s, run.args.seed, run.out))


def row_conformance(run: VerifyRun) -> None:
    """vLLM against the model, feature by feature."""
    missing = run.missing("vllm")
    if missing is not None:
        run.skipped("conformance", "vllm", missing)
        return
    from invariants.harness.conformance import run_conformance

    t = time.monotonic()
    conf_rows: list[Any] = []
    steps = 300 if run.args.quick else 1500
    rc = run_conformance(
        steps=steps,
        budget_s=10.0 if run.args.quick else 30.0,
        seed=run.args.seed,
        out=run.out,
        sink=conf_rows,
    )
    # A row whose required rules the run did not reach checked less than it names: not green,
    # and not a finding either.
    unreached = sum(r.verdict.startswith("NOT EXERCISED") for r in conf_rows)
    verdict = "agrees with the model"
    if rc != 0:
        verdict = (
            f"NOT EXERCISED: {unreached} rows' required rules not reached in {steps} steps"
            if unreached and not any(r.verdict.startswith("FINDING") for r in conf_rows)
            else "FINDING (see above)"
        )
    run.record(
        "conformance",
        "vllm",
        verdict,
        f"{len(conf_rows)} feature rows",
        time.monotonic() - t,
        rc == 0,
        next((r.trace for r in conf_rows if r.trace), None),
    )


def row_known_findings(run: VerifyRun) -> None:
    """Every known finding still reproduces on every usable target (a fixed one must be retired)."""
    from invariants.harness.known_findings import recheck_known_findings

    t = time.monotonic()
    usable = {n for n, why in available_targets().items() if why is None}
    rechecked = recheck_known_findings(usable)
    gone = [f"{fid} on {tgt}" for fid, tgt, still in rechecked if not still]
    run.record(
        "known findings",
        ",".join(sorted(usable)),
        "all reproduce" if not gone else "NO LONGER REPRODUCE: " + "; ".join(gone),
        f"{len(rechecked)} finding/target pairs replayed",
        time.monotonic() - t,
        not gone,
    )


def row_zoo(run: VerifyRun) -> None:
    """Every mutant of the zoo killed."""
    zoo = run.imported("invariants.cli.zoo")
    if zoo is not None:
        run.record(*zoo.verify_row(quick=run.args.quick))


def row_explore(run: VerifyRun) -> None:
    """Every sequence of the real scheduler's small grid, model against vLLM's `Scheduler`
    ("vllm"): fails on a skipped instance or one below the stated minimum depth."""
    explore = run.imported("invariants.cli.explore")
    if explore is None:
        return
    target = explore.VERIFY_TARGET
    missing = run.missing(target)
    if missing is not None:
        run.skipped("explore", target, missing)
    else:
        run.record(*explore.verify_row(target, quick=run.args.quick, out=run.out / "explore"))


def row_simulate(run: VerifyRun) -> None:
    """The seed scenarios at small scale (`kvretain simulate all --scale full` gives the real sizes)."""
    sim = run.imported("invariants.cli.simulate")
    if sim is None:
        return
    check, target, verdict, figure, seconds, good = sim.verify_row(quick=True, out=run.out / "simulate")
    run.record(check, target, verdict, f"report in {run.out / 'simulate'}", seconds, good)


def row_plugins(run: VerifyRun) -> None:
    """The GPU check's row comes through the kvretain.commands entry point (gpu_check
    imports invariants, never the reverse); a group without verify_row adds no row."""
    from invariants.cli.main import command_plugins

    for plugin in command_plugins().values():
        verify_row = getattr(run.imported(plugin.module), "verify_row", None)
        if verify_row is not None:
            check, target, verdict, figure, seconds, good = verify_row(quick=run.args.quick)
            run.record(check, target, verdict, figure, seconds, good)


ROWS: list[Callable[[VerifyRun], None]] = [
    row_prove,
    row_production_link,
    row_fuzz,
    row_sglang,
    row_production_scale,
    row_conformance,
    row_known_findings,
    row_zoo,
    row_explore,
    row_simulate,
    row_plugins,
]
"""The verify table, in order: each function records its row(s) on the run."""


def cmd_verify(args: argparse.Namespace) -> int:
    """The main job: proofs, fuzzing against every installed target, GPU check on CPU."""
    from invariants.cli.fuzz import _declared_or_exit

    _declared_or_exit()  # a bad KVRETAIN_DECLARED_POLICIES is one line, exit 2, before any row
    run = VerifyRun(args)
    for row in ROWS:
        row(run)
    return run.finish()
