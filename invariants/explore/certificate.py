"""What one exhaustive search covered, and its verdict.

A certificate says, for one instance and target: the depth every operation
sequence was checked to (`depth_completed`: every sequence of at most that
many operations, up to merging by fingerprint), how many distinct states and
transitions that took, the distinct states first reached at each depth, the
known findings tolerated on the way (by id, with counts), why the search
stopped, and the verdict: `clean`, `known findings` (clean but for tolerated
findings, listed) or `VIOLATION` (with the shortest trace's path).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from invariants.harness.checker import Violation
from invariants.harness.known_findings import KnownLedger, known_summary
from model.contract.ops import Op

CLEAN = "clean"
KNOWN = "known findings"
VIOLATION = "VIOLATION"
ERROR = "ERROR"
SKIPPED = "skipped"


@dataclass
class Certificate:
    """One instance's result. `new_states[d]`: distinct states first reached at depth d
    (index 0 is the initial state). `stopped`: why the search ended."""

    instance: str
    target: str
    depth_requested: int
    depth_completed: int = 0
    states: int = 1
    transitions: int = 0
    seconds: float = 0.0
    new_states: list[int] = field(default_factory=lambda: [1])
    known: KnownLedger = field(default_factory=lambda: KnownLedger(keep_examples=False))
    stopped: str = ""
    violation: str | None = None
    trace: Path | None = None
    trace_length: int | None = None
    reproduced: bool | None = None
    fork_checks: int = 0
    error: str | None = None
    skipped: str | None = None  # why the instance was not searched at all
    other_violations: int = 0  # paths pruned by a violation the search was not after
    path: tuple[Op, ...] = ()  # the counterexample's operations
    found: list[Violation] = field(default_factory=list)  # and what its last operation raised
    # Transitions by operation kind ("Offer", "Sample+drafts", ...): what the alphabet exercised.
    op_kinds: Counter[str] = field(default_factory=Counter)
    # What a merge of two states assumed (`invariants.explore.fingerprint`), in words.
    merging: str = ""
    # How states were returned to between operations (`search.RESTORES`; why not `live`).
    restore: str = "live"
    # Who chose the steps: the engine (its own step, its built budget) or kvretain (`search.steps_text`).
    steps: str = ""

    @property
    def verdict(self) -> str:
        if self.skipped:
            return SKIPPED
        if self.error:
            return ERROR
        if self.violation:
            return VIOLATION
        return KNOWN if self.known else CLEAN

    @property
    def ok(self) -> bool:
        return self.verdict in (CLEAN, KNOWN)

    def states_per_s(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else 0.0

    def verdict_text(self) -> str:
        """The verdict cell: counts for known findings, the trace for a violation."""
        if self.skipped:
            return f"skipped: {self.skipped}"
        if self.error:
            return f"ERROR: {self.error}"
        if self.violation:
            where = f" -> {self.trace}" if self.trace else ""
            return f"VIOLATION at depth {self.trace_length}{where}"
        if self.known:
            return f"known findings ({known_summary(self.known)})"
        return CLEAN

    def row(self) -> list[object]:
        return [
            self.instance,
            f"{self.depth_completed}/{self.depth_requested}",
            self.states,
            self.transitions,
            f"{self.seconds:.1f}",
            f"{self.states_per_s():.0f}",
            _clip(self.verdict_text()),
            self.stopped,
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "target": self.target,
            "depth_requested": self.depth_requested,
            "depth_completed": self.depth_completed,
            "states": self.states,
            "transitions": self.transitions,
            "seconds": round(self.seconds, 3),
            "new_states_by_depth": list(self.new_states),
            "verdict": self.verdict,
            "known_findings": self.known.to_json(),
            "known_total": self.known.total,
            "stopped": self.stopped,
            "violation": self.violation,
            "trace": str(self.trace) if self.trace else None,
            "trace_length": self.trace_length,
            "reproduced_on_replay": self.reproduced,
            "fork_checks": self.fork_checks,
            "error": self.error,
            "skipped": self.skipped,
            "other_violations": self.other_violations,
            "transitions_by_kind": dict(sorted(self.op_kinds.items())),
            "merging": self.merging,
            "restore": self.restore,
            "steps": self.steps,
        }


def _clip(text: str, limit: int = 90) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


HEADERS = ["instance", "depth", "states", "transitions", "time s", "states/s", "verdict", "stopped"]
