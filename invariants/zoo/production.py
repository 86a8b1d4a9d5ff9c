"""The vLLM zoo at production scale: which mutants the serving workload meets.

`kvretain zoo --target vllm-manager --scale production` runs each vLLM mutant as a
user runs `kvretain fuzz --target vllm-manager --scale production --budget-s T`: the
real presets at vLLM's pool sizes, every invariant and the model
differential on, stopping at the first violation. A mutant is caught when a
violation beyond the known findings shows up within the budget. One that is
not caught lives in a path the production plan does not take (config
validation: its configurations are vLLM's own, always valid) or one the
workload did not reach in time: the small-scale zoo is where every mutant must
die; this one measures what production-scale fuzzing meets, and how fast.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from invariants.harness.fuzz import _tolerance
from invariants.harness.production import run_production
from invariants.report import table


@dataclass(frozen=True)
class ProductionHunt:
    name: str
    caught: bool
    ops: int  # operations checked before the violation (or in all)
    episodes: int
    seconds: float
    violation: str  # the first one, "" when none

    @property
    def check(self) -> str:
        return self.violation.split(":", 1)[0] if self.violation else "-"


def hunt(
    names: Iterable[str],
    *,
    seed: int,
    budget_s: float,
    on_result: Callable[[ProductionHunt], None] = lambda h: None,
) -> list[ProductionHunt]:
    """Each named vLLM mutant through one production run of `budget_s`."""
    from invariants.zoo.mutants_vllm import activate

    tolerated = _tolerance("vllm-manager")
    out = []
    for name in names:
        start = time.monotonic()
        with activate(name) as factory:
            stats, failures, _ = run_production(
                factory, seed=seed, steps=None, budget_s=budget_s, tolerated=tolerated, log=lambda line: None
            )
        found = str(failures[0][2][0]) if failures else ""
        h = ProductionHunt(name, bool(failures), stats.ops, stats.episodes, time.monotonic() - start, found)
        on_result(h)
        out.append(h)
    return out


def control(*, seed: int, budget_s: float) -> ProductionHunt:
    """The unmutated vLLM through the same run: it must come out clean."""
    from invariants.targets.vllm_target import VllmManagerTarget

    start = time.monotonic()
    stats, failures, _ = run_production(
        VllmManagerTarget,
        seed=seed,
        steps=None,
        budget_s=budget_s,
        tolerated=_tolerance("vllm-manager"),
        log=lambda line: None,
    )
    found = str(failures[0][2][0]) if failures else ""
    return ProductionHunt(
        "(unmutated)", bool(failures), stats.ops, stats.episodes, time.monotonic() - start, found
    )


def report(hunts: list[ProductionHunt]) -> str:
    rows = [
        (
            h.name,
            "caught" if h.caught else "not caught",
            h.check,
            f"{h.ops:,}",
            h.episodes,
            f"{h.seconds:.1f}",
            h.violation[:90],
        )
        for h in hunts
    ]
    caught = [h for h in hunts if h.caught]
    times = sorted(h.seconds for h in caught)
    summary = (
        f"caught {len(caught)}/{len(hunts)} at production scale"
        + (f", median {times[len(times) // 2]:.1f} s, max {times[-1]:.1f} s" if times else "")
        + (
            f"; not caught: {', '.join(h.name for h in hunts if not h.caught)}"
            if len(caught) < len(hunts)
            else ""
        )
    )
    head = ["mutant", "verdict", "check", "ops", "episodes", "seconds", "first violation"]
    return table(head, rows) + "\n" + summary
