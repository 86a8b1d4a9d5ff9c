"""`kvretain explore --bench`: the search's states/s with each restore, on one instance, in one run.

Contract of `bench_restore(instance, factory, target, depth, rounds)`: the
same instance is searched to the same depth `rounds` times with each restore
of `search.RESTORES`, alternating (`pickle`, then `live`, then again), so a
machine that slows down mid-run slows both; each restore's figure is its best
round (states per second of the whole search, thawing, checking,
fingerprinting and freezing included), in wall-clock time and in this
process's CPU time (on a shared machine the second is the steadier figure). The certificates of every round must be
equal but for their time and restore (`same`): a faster restore that searched
something else would be no figure at all, and the CLI exits 1 then.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from invariants.explore.certificate import Certificate
from invariants.explore.instances import Instance
from invariants.explore.search import RESTORES, Limits, explore
from invariants.report import table
from invariants.targets.base import Target
from model.contract.config import Config

# The instance and depth `kvretain explore --bench` runs unless told otherwise.
BENCH_INSTANCE = "full+swa-p7-dense"
BENCH_DEPTH = 5
BASELINE = "pickle"


def _comparable(cert: Certificate) -> dict[str, Any]:
    """A certificate as JSON without what may differ between restores (time, restore)."""
    out = cert.to_json()
    out.pop("seconds")
    out.pop("restore")
    out["path"] = [repr(op) for op in cert.path]
    return out


@dataclass
class RestoreBench:
    """Per restore, its best round's certificate; `same`: every round's certificate agreed."""

    instance: str
    target: str
    depth: int
    rounds: int
    best: dict[str, Certificate] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)  # the best round's CPU seconds
    same: bool = True

    def rate(self, restore: str) -> float:
        return self.best[restore].states_per_s()

    def cpu_rate(self, restore: str) -> float:
        cpu = self.cpu_s[restore]
        return self.best[restore].states / cpu if cpu > 0 else 0.0

    def ratio(self, restore: str = "live") -> float:
        """`restore`'s states/s over the baseline's (`pickle`, thawing per transition)."""
        base = self.rate(BASELINE)
        return self.rate(restore) / base if base > 0 else 0.0

    def cpu_ratio(self, restore: str = "live") -> float:
        """The same in states per CPU second."""
        base = self.cpu_rate(BASELINE)
        return self.cpu_rate(restore) / base if base > 0 else 0.0

    def text(self) -> str:
        rows = []
        for name, cert in self.best.items():
            rows.append(
                [
                    name,
                    cert.states,
                    cert.transitions,
                    f"{cert.seconds:.2f}",
                    f"{cert.states_per_s():.0f}",
                    f"{self.ratio(name):.2f}x",
                    f"{self.cpu_s[name]:.2f}",
                    f"{self.cpu_rate(name):.0f}",
                    f"{self.cpu_ratio(name):.2f}x",
                ]
            )
        head = (
            f"kvretain explore --bench: target {self.target}, instance {self.instance}, depth {self.depth}, "
            f"best of {self.rounds} round(s) each, alternating"
        )
        verdict = (
            "the certificates are identical (states per depth, transitions, verdict, counterexample)"
            if self.same
            else "CERTIFICATES DIFFER between restores: the figures compare different searches"
        )
        headers = [
            "restore",
            "states",
            "transitions",
            "time s",
            "states/s",
            "ratio",
            "CPU s",
            "states/CPU s",
            "ratio",
        ]
        return "\n".join([head, table(headers, rows, right=(1, 2, 3, 4, 5, 6, 7, 8)), verdict])

    def to_json(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "target": self.target,
            "depth": self.depth,
            "rounds": self.rounds,
            "states_per_s": {name: round(self.rate(name), 1) for name in self.best},
            "states_per_cpu_s": {name: round(self.cpu_rate(name), 1) for name in self.best},
            "ratio": round(self.ratio(), 3),
            "cpu_ratio": round(self.cpu_ratio(), 3),
            "same_certificate": self.same,
        }


def bench_restore(
    instance: Instance,
    factory: Callable[[Config], Target],
    target: str,
    depth: int = BENCH_DEPTH,
    rounds: int = 1,
) -> RestoreBench:
    """Search `instance` with each restore, alternating, `rounds` times (module docstring)."""
    bench = RestoreBench(instance.name, target, depth, rounds)
    reference: dict[str, Any] | None = None
    order = (BASELINE, *(r for r in RESTORES if r != BASELINE))
    for _ in range(rounds):
        for restore in order:
            cpu = time.process_time()
            cert = explore(instance, factory, target, Limits(depth, max_states=10**7), restore=restore)
            cpu = time.process_time() - cpu
            seen = _comparable(cert)
            reference = reference or seen
            bench.same = bench.same and seen == reference
            best = bench.best.get(restore)
            if best is None or cert.states_per_s() > best.states_per_s():
                bench.best[restore] = cert
            if restore not in bench.cpu_s or cpu < bench.cpu_s[restore]:
                bench.cpu_s[restore] = cpu
    return bench
