"""Hunt a mutant by exhaustive search alone: its shortest counterexample over the explore grid.

Contract of `hunt(entry, grid, depth, budget_s)`: with the mutant active, the
grid is searched by iterative deepening: for d = 1, 2, ... up to `depth`, every
instance is searched breadth first (`invariants.explore.search`) to depth d,
smallest instance first; the first depth at which some instance reaches a
violation is the length of the shortest counterexample over the grid (every
instance was clean to d - 1). An instance whose states are exhausted below d
is not searched again. Each search costs about its last layer, so the repeated
shallow layers cost little next to the deepest one. The mutant's own tolerance (none, for most) decides which
violations count. Before any operation, every small configuration is built
(`invariants.explore.configs`): a mutant that builds one the model rejects dies
at depth 0. No fuzzing, no direct check: `killed` means a breadth-first
search reached the defect, and `length` is then the depth of its shortest
counterexample among the instances searched within the budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from invariants.explore.certificate import Certificate
from invariants.explore.configs import check_configurations
from invariants.explore.instances import Instance
from invariants.explore.search import Limits, explore
from invariants.report import table
from invariants.zoo.runner import ZooEntry


@dataclass
class ExploreKill:
    """One mutant's exhaustive hunt: the shortest counterexample found (if any) and
    what each instance covered."""

    name: str
    length: int | None = None
    instance: str | None = None
    trace: Path | None = None
    violation: str = ""
    seconds: float = 0.0
    covered: list[tuple[str, int, str]] = field(default_factory=list)  # (instance, depth, verdict)
    skipped: int = 0  # instances never searched: the budget ran out first

    @property
    def killed(self) -> bool:
        return self.length is not None


def hunt(
    entry: ZooEntry,
    grid: list[Instance],
    *,
    depth: int = 6,
    budget_s: float = 60.0,
    out_dir: Path | None = None,
) -> ExploreKill:
    """The mutant's shortest counterexample over `grid` (see the module docstring)."""
    start = time.monotonic()
    deadline = start + budget_s
    kill = ExploreKill(entry.name)
    tolerate = entry.tolerated or (lambda v: False)
    covered: dict[str, tuple[int, str]] = {}
    live = list(grid)  # instances not exhausted yet
    with entry.activate() as factory:
        configs = check_configurations(factory, keep=1)
        covered["configurations"] = (0, "clean" if configs.ok else "VIOLATION")
        if not configs.ok:
            cfg, v = configs.violations[0]
            kill.length, kill.instance, kill.violation = 0, "configurations", f"{v}: {cfg}"
        for d in range(1, depth + 1):
            if kill.killed:
                break
            exhausted: set[str] = set()
            for instance in live:
                if time.monotonic() >= deadline:
                    kill.skipped = sum(1 for inst in grid if inst.name not in covered)
                    break
                cert = explore(
                    instance,
                    factory,
                    entry.target,
                    Limits(d, deadline=deadline),
                    tolerate=tolerate,
                    out_dir=out_dir,
                )
                covered[instance.name] = (cert.depth_completed, cert.verdict)
                if cert.trace_length is not None:
                    _keep(kill, cert, instance, out_dir)
                    break
                if cert.stopped.startswith("exhausted"):
                    exhausted.add(instance.name)
            live = [inst for inst in live if inst.name not in exhausted]
            if kill.killed or time.monotonic() >= deadline or not live:
                break
    kill.covered = [(name, dc, verdict) for name, (dc, verdict) in covered.items()]
    kill.seconds = time.monotonic() - start
    return kill


def _keep(kill: ExploreKill, cert: Certificate, instance: Instance, out_dir: Path | None) -> None:
    kill.length, kill.instance = cert.trace_length, instance.name
    kill.violation, kill.trace = cert.violation or "", cert.trace
    if out_dir is not None and cert.trace is not None:
        kill.trace = cert.trace.rename(out_dir / f"zoo-explore-{kill.name}.json")


def format_kills(kills: list[ExploreKill]) -> str:
    """The table: per mutant, the shortest counterexample's depth and where; then a summary line."""
    rows = [
        (
            k.name,
            "killed" if k.killed else "SURVIVED",
            k.length if k.killed else "-",
            k.instance or "-",
            f"{k.seconds:.1f}",
            len(k.covered),
            k.skipped,
            (k.violation[:70] if k.killed else "no violation within the depths covered"),
        )
        for k in kills
    ]
    killed = [k for k in kills if k.killed]
    depths = sorted(k.length for k in killed if k.length is not None)
    summary = (
        f"zoo by explore: {len(killed)}/{len(kills)} killed by exhaustive search alone; "
        f"shortest counterexamples: {', '.join(map(str, depths)) or 'none'} operations"
    )
    return (
        table(
            ["mutant", "verdict", "depth", "instance", "time s", "instances", "not reached", "violation"],
            rows,
        )
        + "\n"
        + summary
    )
