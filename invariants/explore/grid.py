"""Searching a grid of instances under one time budget.

The budget is a promise: the run ends within it. Each instance in turn gets an
equal share of what is left (time an instance does not use passes to the
next), so a budget too small for the requested depth lowers the depth reached
rather than skipping instances; an instance that no time is left for is
listed as skipped, never dropped.
"""

from __future__ import annotations

import functools
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from invariants.explore.certificate import Certificate
from invariants.explore.instances import Instance
from invariants.explore.search import Limits, Tolerate, explore
from invariants.report import Progress
from invariants.targets.base import Target
from model.contract.config import Config

# Below this a share cannot build a target and check a layer: the instance is skipped.
MIN_SHARE_S = 0.05


@dataclass
class GridReport:
    """Every instance's certificate, in grid order (skipped ones included)."""

    target: str
    certificates: list[Certificate] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def violations(self) -> list[Certificate]:
        return [c for c in self.certificates if c.violation or c.error]

    @property
    def skipped(self) -> list[Certificate]:
        return [c for c in self.certificates if c.skipped]

    @property
    def states(self) -> int:
        return sum(c.states for c in self.certificates)

    @property
    def transitions(self) -> int:
        return sum(c.transitions for c in self.certificates)

    def min_depth(self) -> int:
        """The depth every searched instance completed (0 when none was searched)."""
        done = [c.depth_completed for c in self.certificates if not c.skipped]
        return min(done) if done else 0


def explore_grid(
    instances: list[Instance],
    factory: Callable[[Config], Target],
    target: str,
    *,
    depth: int,
    max_states: int,
    budget_s: float | None,
    out_dir: Path | None = None,
    tolerate: Tolerate | None = None,
    progress: Progress | None = None,
    on_certificate: Callable[[Certificate], None] | None = None,
    jobs: int = 1,
    restore: str = "live",
) -> GridReport:
    """Search each instance in order (see the module docstring for the budget);
    `jobs` > 1: that many instances at once, in forked processes. `restore`: how each
    search returns to a state (`search.RESTORES`; the certificates are the same)."""
    report = GridReport(target)
    start = time.monotonic()
    end = start + budget_s if budget_s is not None else None
    if jobs > 1 and len(instances) > 1:
        report.certificates = _parallel(
            instances, factory, target, depth, max_states, end, out_dir, tolerate, progress, jobs, restore
        )
        if on_certificate is not None:
            for cert in report.certificates:
                on_certificate(cert)
        report.seconds = time.monotonic() - start
        return report
    for i, instance in enumerate(instances):
        deadline = None
        if end is not None:
            share = (end - time.monotonic()) / (len(instances) - i)
            if share < MIN_SHARE_S:
                cert = Certificate(instance.name, target, depth, depth_completed=0, states=0, new_states=[])
                cert.skipped = "the time budget was spent"
                report.certificates.append(cert)
                if on_certificate is not None:
                    on_certificate(cert)
                continue
            deadline = time.monotonic() + share
        limits = Limits(depth, max_states, deadline)
        cert = explore(
            instance,
            factory,
            target,
            limits,
            tolerate=tolerate,
            out_dir=out_dir,
            progress=progress,
            restore=restore,
        )
        report.certificates.append(cert)
        if on_certificate is not None:
            on_certificate(cert)
    report.seconds = time.monotonic() - start
    return report


# In a worker: how many instances have started (shared by the forked pool).
_STARTED: Any = None


def _init_worker(started: Any) -> None:
    global _STARTED
    _STARTED = started


def _parallel(
    instances: list[Instance],
    factory: Callable[[Config], Target],
    target: str,
    depth: int,
    max_states: int,
    end: float | None,
    out_dir: Path | None,
    tolerate: Tolerate | None,
    progress: Progress | None,
    jobs: int,
    restore: str = "live",
) -> list[Certificate]:
    """The instances on `jobs` forked processes, certificates in grid order."""
    ctx = multiprocessing.get_context("fork")
    started = ctx.Value("i", 0)
    run = functools.partial(
        _one,
        factory=factory,
        target=target,
        depth=depth,
        max_states=max_states,
        out_dir=out_dir,
        total=len(instances),
        jobs=min(jobs, len(instances)),
        restore=restore,
    )
    with ProcessPoolExecutor(
        min(jobs, len(instances)), mp_context=ctx, initializer=_init_worker, initargs=(started,)
    ) as pool:
        futures = [pool.submit(run, inst, end, tolerate, progress) for inst in instances]
        return [f.result() for f in futures]


def _one(
    instance: Instance,
    end: float | None,
    tolerate: Tolerate | None,
    progress: Progress | None,
    *,
    factory: Callable[[Config], Target],
    target: str,
    depth: int,
    max_states: int,
    out_dir: Path | None,
    total: int,
    jobs: int,
    restore: str = "live",
) -> Certificate:
    """One instance in a worker. Its share: what is left until `end` over the rounds of
    `jobs` instances still to run, this one included (time an earlier instance left
    passes on; a monotonic clock is system-wide, so the parent's `end` holds here)."""
    deadline = None
    if end is not None:
        with _STARTED.get_lock():
            before = _STARTED.value
            _STARTED.value += 1
        now = time.monotonic()
        rounds = -(-(total - before) // jobs)
        deadline = min(end, now + (end - now) / rounds)
        if deadline - now < MIN_SHARE_S:
            cert = Certificate(instance.name, target, depth, depth_completed=0, states=0, new_states=[])
            cert.skipped = "the time budget was spent"
            return cert
    limits = Limits(depth, max_states, deadline)
    return explore(
        instance,
        factory,
        target,
        limits,
        tolerate=tolerate,
        out_dir=out_dir,
        progress=progress,
        restore=restore,
    )
