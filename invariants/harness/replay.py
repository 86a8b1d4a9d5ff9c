"""`kvretain replay`: re-run a trace file against one or more targets.

Each target gets its own Checker (the model alongside it), so a trace found
on vLLM can be shown next to the reference target: per operation, what each
target reports and which checks fail. A policy drift is kept apart from the
violations (`ReplayResult.drift`), with what was judged after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from invariants.harness.checker import Checker, InvalidOp, Violation
from invariants.harness.trace import Trace, TraceError
from invariants.targets import target_factory
from model.contract.ops import op_to_json


@dataclass
class ReplayResult:
    target: str
    violations: list[tuple[int, Violation]] = field(default_factory=list)
    known: list[tuple[int, Violation]] = field(default_factory=list)
    # Policy drift, apart from the violations (at most one: the checker says it once), and
    # the operations after it judged by the model-independent checks alone / not judged.
    drift: list[tuple[int, Violation]] = field(default_factory=list)
    after_drift: int = 0
    unjudged: int = 0

    @property
    def clean(self) -> bool:
        """No defect (a drift is not one: `verdict` says it)."""
        return not self.violations

    @property
    def verdict(self) -> str:
        if self.violations:
            return "VIOLATION"
        if self.drift:
            return "POLICY DRIFT (declared)" if all(v.declared for _, v in self.drift) else "POLICY DRIFT"
        return "clean"

    @property
    def crashes(self) -> dict[str, int]:
        """Tolerated crashes (known crash findings), crashes raised by kvretain's adapter
        (never tolerated), other new crashes."""
        from invariants.harness.known_findings import crash_counts

        tolerated = sum(1 for _, v in self.known if v.check == "crash")
        return crash_counts(tolerated, (v for _, v in self.violations))


def replay(trace: Trace, target: str, stop_at_first: bool = False) -> ReplayResult:
    try:
        from invariants.harness.known_findings import is_known_violation
    except ImportError:  # pragma: no cover

        def is_known_violation(target: str, v: Violation) -> bool:  # type: ignore[misc]
            return False

    checker = Checker(target_factory(target)(trace.config))
    result = ReplayResult(target)
    for i, op in enumerate(trace.ops):
        try:
            found = checker.step(op)
        except InvalidOp as exc:
            raise TraceError(f"trace.ops[{i}] {op_to_json(op)}: {exc}") from None
        for v in found:
            if v.is_drift:
                result.drift.append((i, v))
                continue
            (result.known if is_known_violation(target, v) else result.violations).append((i, v))
        if stop_at_first and result.violations:
            break
    result.after_drift, result.unjudged = checker.after_drift, checker.unjudged
    return result
