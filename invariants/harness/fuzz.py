"""`kvretain fuzz`: run the stateful machine against one target.

Determinism: batch i of a run is Hypothesis run with seed `seed + i`, so the
same (target, config, seed, steps) gives the same operations and verdict. A
time budget only decides after which batch to stop (the summary says how many
ran). On a violation Hypothesis shrinks the trace; the shrunk trace is printed
and written as JSON for `kvretain replay`.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.stateful import get_state_machine_test

from invariants.harness.checker import Violation
from invariants.harness.machine import FuzzStats, ViolationFound, build_machine
from invariants.harness.strategies import configs
from invariants.harness.trace import Trace, write_trace
from invariants.layouts.presets import preset
from invariants.report import Progress, table
from invariants.targets import PINNING_TARGETS, target_factory
from model.config import Config
from model.ops import op_to_json

EXAMPLES_PER_BATCH = 8
STEPS_PER_EXAMPLE = 40


@dataclass
class FuzzReport:
    target: str
    config: str
    seed: int
    batches: int
    stats: FuzzStats
    seconds: float
    failure: ViolationFound | None = None
    trace_path: Path | None = None

    @property
    def ops_per_s(self) -> float:
        return self.stats.steps / self.seconds if self.seconds else 0.0

    @property
    def verdict(self) -> str:
        if self.failure is not None:
            return "VIOLATION"
        return "clean (known: " + ", ".join(sorted(self.stats.known)) + ")" if self.stats.known else "clean"


def _tolerance(target: str):  # type: ignore[no-untyped-def]
    try:
        from invariants.harness.known_findings import is_known_violation
    except ImportError:
        return None
    return lambda v: is_known_violation(target, v)


def run_fuzz(
    target: str,
    *,
    config_name: str | None = None,
    steps: int = 2000,
    seed: int = 0,
    budget_s: float | None = None,
    out_dir: Path = Path("kvretain-traces"),
    progress: bool = True,
    strategy: st.SearchStrategy[Config] | None = None,
) -> FuzzReport:
    factory = target_factory(target)
    if strategy is None:
        strategy = (
            st.just(preset(config_name)) if config_name else configs(allow_pinning=target in PINNING_TARGETS)
        )
    stats = FuzzStats()
    machine = build_machine(factory, strategy, stats, tolerated=_tolerance(target))
    prog = Progress(f"fuzz {target}", enabled=progress)
    start = time.monotonic()
    batch = 0
    failure: ViolationFound | None = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while stats.steps < steps and (budget_s is None or time.monotonic() - start < budget_s):
            s = settings(
                max_examples=EXAMPLES_PER_BATCH,
                stateful_step_count=STEPS_PER_EXAMPLE,
                deadline=None,
                database=None,
                derandomize=False,
                print_blob=False,
                suppress_health_check=list(HealthCheck),
            )
            test = hypothesis_seed(seed + batch)(get_state_machine_test(machine, settings=s))
            batch += 1
            try:
                test()
            except ViolationFound:
                failure = stats.last_failure
                break
            prog.tick(
                f"batch {batch}: {stats.steps} steps, {stats.steps / max(prog.elapsed(), 1e-9):.0f} ops/s, "
                f"hit rate {stats.hit_rate:.1%}"
            )
    report = FuzzReport(
        target, config_name or "generated", seed, batch, stats, time.monotonic() - start, failure
    )
    if failure is not None:
        trace = Trace(failure.config, failure.ops, seed + batch - 1, target, str(failure.violations[0]))
        report.trace_path = write_trace(trace, out_dir / f"kvretain-{target}-seed{seed + batch - 1}.json")
    return report


def format_failure(report: FuzzReport) -> str:
    assert report.failure is not None
    f = report.failure
    lines = [
        f"VIOLATION on target {report.target} (seed {report.seed}, batch seed {report.seed + report.batches - 1})"
    ]
    lines += [f"  {v}" for v in f.violations[:10]]
    lines.append(f"config: {f.config}")
    lines.append(f"shrunk trace ({len(f.ops)} operations):")
    lines += [f"  {i:3d}  {op_to_json(op)}" for i, op in enumerate(f.ops)]
    lines.append(f"written to {report.trace_path}; re-run with: kvretain replay {report.trace_path}")
    return "\n".join(lines)


def format_summary(reports: list[FuzzReport]) -> str:
    rows = [
        (
            r.target,
            r.config,
            r.seed,
            r.batches,
            r.stats.examples,
            r.stats.steps,
            f"{r.ops_per_s:.0f}",
            len(r.stats.states),
            f"{r.stats.hit_rate:.1%}",
            r.verdict,
            f"{r.seconds:.1f}",
        )
        for r in reports
    ]
    return table(
        [
            "target",
            "config",
            "seed",
            "batches",
            "examples",
            "steps",
            "ops/s",
            "states",
            "hit rate",
            "verdict",
            "seconds",
        ],
        rows,
    )


def format_features(reports: list[FuzzReport]) -> str:
    """How often each feature was exercised: configuration features per example,
    model rules per firing, summed over the reports."""
    total: Counter[str] = Counter()
    for r in reports:
        total.update(r.stats.features)
    rows = [(name, count) for name, count in sorted(total.items())]
    return "features exercised:\n" + table(["feature", "count"], rows)


def first_violation(report: FuzzReport) -> Violation | None:
    return report.failure.violations[0] if report.failure else None
