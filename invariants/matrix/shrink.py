"""A failing operation list made short, within a time limit.

The matrix fuzzes without Hypothesis's shrinker (which has no time bound) and
shrinks here instead: delta debugging over the operations, keeping a smaller
list only when replaying it still fails with the same check and the same class
(`classify`). Removing an operation can make a later one invalid (a sample for
a request that was never added); such a candidate simply does not reproduce.
Deterministic: candidates are tried in a fixed order.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from invariants.harness.checker import Checker, InvalidOp, Violation
from invariants.targets.base import Target
from model.contract.config import Config
from model.contract.ops import Op

# violation -> (class, tolerated); a tolerated violation does not stop a run
Judge = Callable[[Violation], tuple[str, bool]]


def first_failure(
    factory: Callable[[Config], Target], config: Config, ops: list[Op], judge: Judge
) -> tuple[int, Violation, str] | None:
    """Replay `ops`; the first violation that `judge` does not tolerate, with its index and class."""
    try:
        checker = Checker(factory(config))
    except Exception:  # the configuration itself cannot be built: not this failure
        return None
    for i, op in enumerate(ops):
        try:
            found = checker.step(op)
        except (InvalidOp, AssertionError, KeyError):
            return None
        for v in found:
            kind, tolerated = judge(v)
            if not tolerated:
                return i, v, kind
    return None


def shrink(
    factory: Callable[[Config], Target],
    config: Config,
    ops: list[Op],
    judge: Judge,
    target: tuple[str, str],
    deadline: float,
) -> list[Op]:
    """The shortest prefix-closed sublist of `ops` found before `deadline`
    (time.monotonic()) that still fails with `target` = (check, class)."""

    def fails(candidate: list[Op]) -> list[Op] | None:
        hit = first_failure(factory, config, candidate, judge)
        if hit is None or (hit[1].check, hit[2]) != target:
            return None
        return candidate[: hit[0] + 1]

    best = fails(ops) or ops
    chunk = max(len(best) // 2, 1)
    while chunk >= 1 and time.monotonic() < deadline:
        i, shrunk = 0, False
        while i < len(best) and time.monotonic() < deadline:
            smaller = fails(best[:i] + best[i + chunk :])
            if smaller is not None:
                best, shrunk = smaller, True
            else:
                i += chunk
        if not shrunk:
            chunk //= 2
    return best
