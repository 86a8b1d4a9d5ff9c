"""Searching a grid of instances under one time budget.

The budget is a promise: the run ends within it. It is shared as slot-time
(`jobs` instances at once): at the start and after each instance finishes,
every instance not yet finished may run until an equal share of the
slot-time left, `t + jobs * (end - t) / unfinished`, never past the end
(`Shares`). So time an instance does not use passes to every instance still
to finish, those already running included, and no deadline ever moves
earlier; a budget too small for the requested depth lowers the depth reached
rather than skipping instances; an instance that no time is left for is
listed as skipped, never dropped.

Why running instances too: a share fixed when an instance starts cut the
large instances that started early while the small ones after them left the
end of the budget unused (2026-12-06, `--target vllm-manager --depth 7 --jobs
2 --budget-s 3600`: four instances stopped 78-99% into depth 7 and the run
ended 12 minutes early).
"""

from __future__ import annotations

import contextlib
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


class Shares:
    """The grid's budget: the deadline of every unfinished instance (module docstring).

    `cell` holds (the time of the last start of the budget or finish, the instances not
    yet finished); a `multiprocessing` array shares it between forked workers, `lock`
    guards it. Contract: `deadline()` is never past `end` and never earlier than what it
    returned before; `finish()` is called once per instance, searched or skipped."""

    def __init__(
        self,
        end: float,
        instances: int,
        jobs: int,
        cell: Any = None,
        lock: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.end, self.jobs, self.clock = end, max(1, jobs), clock
        self.cell = cell if cell is not None else [0.0, 0.0]
        self.lock = lock if lock is not None else contextlib.nullcontext()
        with self.lock:
            self.cell[0], self.cell[1] = clock(), float(instances)

    def deadline(self) -> float:
        """Until when an unfinished instance may run."""
        with self.lock:
            t, unfinished = self.cell[0], self.cell[1]
        return min(self.end, t + self.jobs * (self.end - t) / max(unfinished, 1.0))

    def finish(self) -> None:
        """An instance is done (searched, stopped or skipped): its unused time passes on."""
        with self.lock:
            self.cell[0], self.cell[1] = self.clock(), self.cell[1] - 1


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
    shares = Shares(end, len(instances), 1) if end is not None else None
    for instance in instances:
        cert = _one_instance(
            instance, shares, tolerate, progress, factory, target, depth, max_states, out_dir, restore
        )
        report.certificates.append(cert)
        if on_certificate is not None:
            on_certificate(cert)
    report.seconds = time.monotonic() - start
    return report


# In a worker: the grid's shared budget (set by the forked pool's initializer).
_SHARES: Shares | None = None


def _init_worker(shares: Shares | None) -> None:
    global _SHARES
    _SHARES = shares


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
    jobs = min(jobs, len(instances))
    shares = None
    if end is not None:
        cell = ctx.Array("d", 2, lock=False)
        shares = Shares(end, len(instances), jobs, cell, ctx.Lock())
    run = functools.partial(
        _one,
        factory=factory,
        target=target,
        depth=depth,
        max_states=max_states,
        out_dir=out_dir,
        restore=restore,
    )
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker, initargs=(shares,)) as pool:
        futures = [pool.submit(run, inst, tolerate, progress) for inst in instances]
        return [f.result() for f in futures]


def _one(
    instance: Instance,
    tolerate: Tolerate | None,
    progress: Progress | None,
    *,
    factory: Callable[[Config], Target],
    target: str,
    depth: int,
    max_states: int,
    out_dir: Path | None,
    restore: str = "live",
) -> Certificate:
    """One instance in a worker, under the pool's shared budget."""
    return _one_instance(
        instance, _SHARES, tolerate, progress, factory, target, depth, max_states, out_dir, restore
    )


def _one_instance(
    instance: Instance,
    shares: Shares | None,
    tolerate: Tolerate | None,
    progress: Progress | None,
    factory: Callable[[Config], Target],
    target: str,
    depth: int,
    max_states: int,
    out_dir: Path | None,
    restore: str,
) -> Certificate:
    """Search one instance until its share of the budget ends (skipped when none is left)."""
    if shares is None:
        limits = Limits(depth, max_states)
    else:
        deadline = shares.deadline()
        if deadline - time.monotonic() < MIN_SHARE_S:
            shares.finish()
            cert = Certificate(instance.name, target, depth, depth_completed=0, states=0, new_states=[])
            cert.skipped = "the time budget was spent"
            return cert
        limits = Limits(depth, max_states, deadline, moved=shares.deadline)
    try:
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
    finally:
        if shares is not None:
            shares.finish()
