"""A fuzz campaign on Ray: one `run_fuzz` per (configuration, seed), merged into one report.

Contract of `fuzz_campaign(session, target, seeds, configs, ...)`: each run is
exactly `kvretain fuzz --target T --config C --seed S` with the same steps and
budget (no example database, so a run is its seed's alone), executed as a Ray
task on any worker; the merged report holds every run's row as that run
reports it, and totals that are the sums of the runs' counts (steps, examples,
batches, prompt and hit tokens, features, tolerated violations per known
finding, policy-drift examples, violations). Every file a run writes (its
shrunk trace, its drift trace, each known finding's example trace) comes back
to the driver's `out_dir` under the name the run gave it (names carry the
seed), so traces are kept per seed; the rows' trace paths point there. The
verdict is the worst run's: VIOLATION (exit 1), then undeclared POLICY DRIFT
(exit 4), else clean with the merged known findings.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from invariants.campaign import Session
from invariants.report import table
from invariants.results import CaseResult, fuzz_case

TOTAL_COUNTS = ("batches", "examples", "steps", "prompt_tokens", "hit_tokens", "drifts", "violations")


@dataclass
class RunResult:
    """One run, as plain data (what comes back from a worker)."""

    config: str
    seed: int
    case: CaseResult
    counts: dict[str, int]
    states: int
    seconds: float
    verdict: str
    exit_code: int
    features: Counter[str] = field(default_factory=Counter)
    known: list[dict[str, Any]] = field(default_factory=list)
    failure_text: str = ""
    files: dict[str, bytes] = field(default_factory=dict)  # relative path -> content


def run_one(
    target: str,
    config: str | None,
    seed: int,
    steps: int | None,
    budget_s: float | None,
    shrink_s: float | None,
    audit_every: int | None,
) -> RunResult:
    """One fuzz run in a scratch directory; its figures and every file it wrote."""
    from invariants.harness.fuzz import format_failure, run_fuzz

    with tempfile.TemporaryDirectory(prefix="kvretain-campaign-") as tmp:
        out = Path(tmp)
        report = run_fuzz(
            target,
            config_name=config,
            steps=steps,
            seed=seed,
            budget_s=budget_s,
            shrink_s=shrink_s,
            out_dir=out,
            progress=False,
            database=None,
            audit_every=audit_every,
        )
        s = report.stats
        counts = {
            "batches": report.batches,
            "examples": s.examples,
            "steps": s.steps,
            "prompt_tokens": s.prompt_tokens,
            "hit_tokens": s.hit_tokens,
            "drifts": report.drifts,
            "violations": int(report.failure is not None),
        }
        case = fuzz_case(report)
        case.name = f"{report.target}/{report.config}/seed{seed}"
        files = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
        text = format_failure(report) if report.failure is not None else ""
        return RunResult(
            report.config,
            seed,
            _relocated(case, tmp),
            counts,
            len(s.states),
            report.seconds,
            report.verdict,
            report.exit_code,
            Counter(s.features),
            [_relocated_row(row, tmp) for row in s.known.to_json()],
            text.replace(tmp, "{out}"),
            files,
        )


def _relocated_row(row: dict[str, Any], tmp: str) -> dict[str, Any]:
    if row.get("example"):
        row["example"] = row["example"].replace(tmp, "{out}")
    return row


def _relocated(case: CaseResult, tmp: str) -> CaseResult:
    """A row whose paths name `{out}` instead of the run's scratch directory."""
    if case.trace:
        case.trace = case.trace.replace(tmp, "{out}")
    for row in case.figures.get("known", []):
        _relocated_row(row, tmp)
    if case.policy_drift and case.policy_drift.get("trace"):
        case.policy_drift["trace"] = case.policy_drift["trace"].replace(tmp, "{out}")
    return case


@dataclass
class CampaignReport:
    """Every run's result in (configuration, seed) order, and their merge."""

    target: str
    runs: list[RunResult]
    workers: int
    seconds: float = 0.0

    def total(self, name: str) -> int:
        return sum(r.counts[name] for r in self.runs)

    @property
    def exit_code(self) -> int:
        codes = {r.exit_code for r in self.runs}
        return 1 if 1 in codes else 4 if 4 in codes else 0

    def known(self) -> dict[str, dict[str, Any]]:
        """Per known finding: violations tolerated over every run, the runs that met it,
        the first message and example trace of the first run (in order) that did."""
        out: dict[str, dict[str, Any]] = {}
        for r in self.runs:
            for row in r.known:
                entry = out.setdefault(
                    row["finding"],
                    {"count": 0, "runs": 0, "first": row["first"], "example": row["example"]},
                )
                entry["count"] += row["count"]
                entry["runs"] += 1
        return out

    @property
    def verdict(self) -> str:
        if self.exit_code == 1:
            return "VIOLATION"
        if any(r.counts["drifts"] for r in self.runs):
            return "POLICY DRIFT" if self.exit_code == 4 else "POLICY DRIFT (declared)"
        known = self.known()
        if not known:
            return "clean"
        return "clean (known: " + ", ".join(f"{k} x{v['count']}" for k, v in sorted(known.items())) + ")"

    def features(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for r in self.runs:
            total.update(r.features)
        return total

    def summary_case(self) -> CaseResult:
        """The merged row: the summed counts, the merged ledger, the worst verdict."""
        prompt, hit = self.total("prompt_tokens"), self.total("hit_tokens")
        figures: dict[str, Any] = {name: self.total(name) for name in TOTAL_COUNTS}
        figures.update(
            runs=len(self.runs),
            workers=self.workers,
            seeds=[r.seed for r in self.runs],
            configs=sorted({r.config for r in self.runs}),
            hit_rate=round(hit / prompt, 4) if prompt else 0.0,
            known=[{"finding": k, **v} for k, v in sorted(self.known().items())],
            traces=[r.case.trace for r in self.runs if r.case.trace],
        )
        return CaseResult(
            name=f"{self.target}/campaign",
            group="fuzz-campaign",
            outcome="failed" if self.exit_code else "passed",
            seconds=self.seconds,
            message=self.verdict,
            figures=figures,
        )

    def cases(self) -> list[CaseResult]:
        """Every run's row, then the merged one (the JSON's and JUnit's cases)."""
        return [r.case for r in self.runs] + [self.summary_case()]


def fuzz_campaign(
    session: Session,
    target: str,
    seeds: list[int],
    configs: list[str | None],
    *,
    steps: int | None,
    budget_s: float | None,
    shrink_s: float | None = None,
    out_dir: Path = Path("kvretain-traces"),
    audit_every: int | None = None,
    log: Callable[[str], None] | None = None,
) -> CampaignReport:
    """Run every (configuration, seed) as a Ray task on `session`; the merged report
    (see the module docstring). Each run's files are written under `out_dir`."""
    import time

    import ray

    start = time.monotonic()
    task = ray.remote(num_cpus=1)(run_one)
    pending = {
        task.remote(target, c, seed, steps, budget_s, shrink_s, audit_every): i  # type: ignore[attr-defined]
        for i, (c, seed) in enumerate((c, s) for c in configs for s in seeds)
    }
    results: dict[int, RunResult] = {}
    refs = list(pending)
    while refs:
        done, refs = ray.wait(refs, num_returns=1)
        r: RunResult = ray.get(done[0])
        results[pending[done[0]]] = r
        _write_files(r, out_dir)
        if log is not None:
            log(
                f"seed {r.seed} ({r.config}): {r.verdict}, {r.counts['steps']} steps ({len(results)} of {len(pending)})"
            )
    report = CampaignReport(target, [results[i] for i in sorted(results)], session.workers)
    report.seconds = time.monotonic() - start
    return report


def _write_files(r: RunResult, out_dir: Path) -> None:
    """The run's files under `out_dir`, and its row's paths pointing there."""
    for rel, data in r.files.items():
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    r.files = {}
    where = str(out_dir)
    c = r.case
    c.trace = c.trace.replace("{out}", where) if c.trace else c.trace
    for row in [*c.figures.get("known", []), *r.known]:
        if row.get("example"):
            row["example"] = row["example"].replace("{out}", where)
    if c.policy_drift and c.policy_drift.get("trace"):
        c.policy_drift["trace"] = c.policy_drift["trace"].replace("{out}", where)
    r.failure_text = r.failure_text.replace("{out}", where)


def format_campaign(report: CampaignReport) -> str:
    """A row per run, the totals, the merged known findings and features."""
    rows: list[list[object]] = [
        [
            r.config,
            r.seed,
            r.counts["batches"],
            r.counts["examples"],
            r.counts["steps"],
            r.states,
            f"{r.counts['hit_tokens'] / r.counts['prompt_tokens']:.1%}" if r.counts["prompt_tokens"] else "-",
            r.verdict[:60],
            f"{r.seconds:.1f}",
        ]
        for r in report.runs
    ]
    prompt = report.total("prompt_tokens")
    rows.append(
        [
            f"all {len(report.runs)} runs",
            "",
            report.total("batches"),
            report.total("examples"),
            report.total("steps"),
            "",
            f"{report.total('hit_tokens') / prompt:.1%}" if prompt else "-",
            report.verdict[:60],
            f"{report.seconds:.1f}",
        ]
    )
    headers = ["config", "seed", "batches", "examples", "steps", "states", "hit rate", "verdict", "seconds"]
    lines = [table(headers, rows, right=(2, 3, 4, 5))]
    for r in report.runs:
        if r.failure_text:
            lines.append(f"\nseed {r.seed} ({r.config}):\n{r.failure_text}")
    known = report.known()
    if known:
        lines.append(
            f"\nknown findings tolerated over the campaign ({sum(v['count'] for v in known.values())}):"
        )
        lines.append(
            table(
                ["finding", "tolerated", "runs", "first message", "example trace"],
                [
                    [k, v["count"], v["runs"], str(v["first"])[:70], v["example"] or "-"]
                    for k, v in sorted(known.items())
                ],
            )
        )
    features = report.features()
    if features:
        lines.append(
            "\nfeatures exercised (summed):\n" + table(["feature", "count"], sorted(features.items()))
        )
    lines.append(
        f"\nfuzz campaign on {report.workers} Ray worker(s): {len(report.runs)} runs, "
        f"{report.total('steps')} steps in {report.seconds:.1f}s: {report.verdict}"[:120]
    )
    return "\n".join(lines)


__all__ = ["CampaignReport", "RunResult", "format_campaign", "fuzz_campaign", "run_one"]
