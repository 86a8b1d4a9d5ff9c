"""`kvretain replay`: re-run a trace file against one or more targets.

Each target gets its own Checker (the model alongside it), so a trace found
on vLLM can be shown next to the reference target: per operation, what each
target reports and which checks fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from invariants.harness.checker import Checker, InvalidOp, Violation
from invariants.harness.trace import Trace, TraceError
from invariants.targets import target_factory
from model.ops import op_to_json


@dataclass
class ReplayResult:
    target: str
    violations: list[tuple[int, Violation]] = field(default_factory=list)
    known: list[tuple[int, Violation]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.violations

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
            (result.known if is_known_violation(target, v) else result.violations).append((i, v))
        if stop_at_first and result.violations:
            break
    return result
