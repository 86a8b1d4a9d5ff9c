"""Shrinking a failing trace under a deadline we own.

Contract: `shrink(ops, fails, deadline)` returns an operation list that
`fails` (the predicate replays it and says whether the same finding comes
back), no longer than `ops`, and returns by `deadline` plus the time of one
replay. A candidate that is not a well-formed trace (an operation naming a
request that no longer exists) is simply one that does not fail.

Why not Hypothesis's own shrinker: it has no wall-clock bound (a vLLM target
with a broken free path kept it busy for minutes after a 60 s budget), and
the user sees nothing meanwhile. Here every pass is one idea, tried from the
coarsest to the finest so that the early passes do most of the work:

1. drop whole requests (every operation naming them, and their places in the
   batch steps they shared), half of them, then quarters, ... one at a time;
2. drop runs of operations (halves, quarters, ... single operations);
3. shorten prompts and probes, lower budgets, set sampled tokens to 1. A shortened
   prompt keeps its multimodal items within it: an item past the new end is dropped,
   one across it is clipped to end there (a trace whose item ends past its prompt does
   not load: `model.contract.extra_keys.validate`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from model.contract.ops import AddRequest, Op, Probe, Sample, Schedule, Step

Replay = Callable[[list[Op]], int | None]
"""Replays a candidate; the index of the failing operation, or None when clean/invalid."""


class _Budget:
    def __init__(self, deadline: float, log: Callable[[str], None] | None) -> None:
        self.deadline, self.log = deadline, log
        self.tries = 0
        self.start = self.last_log = time.monotonic()

    def left(self) -> bool:
        return time.monotonic() < self.deadline

    def note(self, ops: list[Op], best: int) -> None:
        now = time.monotonic()
        if self.log and now - self.last_log >= 1.0:
            self.last_log = now
            self.log(f"shrinking: {best} operations after {self.tries} replays ({now - self.start:.1f}s)")


def shrink(
    ops: list[Op], fails: Replay, deadline: float, log: Callable[[str], None] | None = None
) -> tuple[list[Op], int]:
    """The smallest failing trace found by `deadline`, and how many replays it took."""
    budget = _Budget(deadline, log)
    best = list(ops)

    def attempt(candidate: list[Op]) -> bool:
        nonlocal best
        if len(candidate) > len(best) or candidate == best or not budget.left():
            return False
        budget.tries += 1
        at = fails(candidate)
        if at is None:
            return False
        best = candidate[: at + 1]  # everything after the failing step is noise
        budget.note(best, len(best))
        return True

    changed = True
    while changed and budget.left():
        changed = False
        rids = _rids(best)
        size = max(len(rids) // 2, 1)
        while size >= 1 and budget.left():
            i = 0
            while i < len(rids) and budget.left():
                if attempt(_without(best, set(rids[i : i + size]))):
                    changed = True
                    left = set(_rids(best))
                    rids = [r for r in rids if r in left]
                else:
                    i += size
            size //= 2
        size = max(len(best) // 2, 1)
        while size >= 1 and budget.left():
            i = 0
            while i < len(best) and budget.left():
                if attempt(best[:i] + best[i + size :]):
                    changed = True
                else:
                    i += size
            size //= 2
        for i in range(len(best)):
            if not budget.left() or i >= len(best):
                break
            for simpler in _simpler(best[i]):
                if attempt(best[:i] + [simpler] + best[i + 1 :]):
                    changed = True
                    break
    return best, budget.tries


def _rids(ops: list[Op]) -> list[str]:
    return list(dict.fromkeys(op.rid for op in ops if isinstance(op, AddRequest)))


def _without(ops: list[Op], rids: set[str]) -> list[Op]:
    """The trace with these requests never arriving: their operations dropped, and
    they are taken out of the batch steps they shared (a step left empty goes)."""
    out: list[Op] = []
    for op in ops:
        if isinstance(op, Step):
            rest = tuple(r for r in op.rids if r not in rids)
            if rest:
                out.append(op if len(rest) == len(op.rids) else replace(op, rids=rest))
        elif getattr(op, "rid", None) not in rids:
            out.append(op)
    return out


def _cut_prompt(op: AddRequest, k: int) -> AddRequest:
    """`op` with its first `k` prompt tokens and the multimodal items wholly within them: an
    item is never cut short (its identifier, a content hash, fixes its length; a shorter
    item under the same identifier is an input no engine gets, which vLLM's encoder cache
    treats as the same content)."""
    mm = tuple((ident, off, length) for ident, off, length in op.mm if off + length <= k)
    return replace(op, prompt=op.prompt[:k], mm=mm)


def _simpler(op: Op) -> list[Op]:
    """Smaller variants of one operation, most aggressive first (same length list never grows)."""
    if isinstance(op, AddRequest) and len(op.prompt) > 1:
        n = len(op.prompt)
        return [_cut_prompt(op, k) for k in sorted({1, n // 2, n - 1}) if 0 < k < n]
    if isinstance(op, Probe) and len(op.tokens) > 1:
        return [replace(op, tokens=op.tokens[: len(op.tokens) // 2])]
    if isinstance(op, Schedule) and op.budget > 1:
        return [replace(op, budget=b) for b in sorted({1, op.budget // 2}) if b < op.budget]
    if isinstance(op, Sample) and op.token != 1:
        return [replace(op, token=1)]
    return []
