"""One sentence for a counterexample: the first observable on which the target and the model differ.

Contract of `first_difference(factory, config, ops, violation)`: `ops` is a
trace whose last operation raised `violation`. The trace is re-run from an
empty allocator; at the last operation the model's observation and the
target's are compared field by field, in declaration order, and the sentence
names the operation, the first field that differs (a path such as
`results[r01].hit`) and both values. A violation that is not an observation
mismatch is named by its own message, which already is one line: the first
snapshot line that differs, or the invariant and what it saw.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from invariants.harness.checker import Checker, Violation
from invariants.targets.base import Target
from model.contract.config import Config
from model.contract.ops import Op, op_to_json

_MISSING = "(absent)"


def describe_op(op: Op) -> str:
    """`schedule r01 budget 64`: the operation as a short phrase."""
    data = op_to_json(op)
    name = data.pop("op")
    parts = [name]
    for key, value in data.items():
        if key == "rid":
            parts.append(str(value))
        elif key == "rids":
            parts.append(",".join(value))
        else:
            shown = "".join(map(str, value)) if key in ("prompt", "tokens") else value
            parts.append(f"{key} {shown}")
    return " ".join(str(p) for p in parts)


def first_field_difference(expected: Any, actual: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first (path, expected, actual) where the two values differ; None when equal."""
    if expected == actual:
        return None
    if type(expected) is not type(actual):
        return path or "the result", expected, actual
    if dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            found = first_field_difference(
                getattr(expected, f.name), getattr(actual, f.name), f"{path}.{f.name}" if path else f.name
            )
            if found:
                return found
    if isinstance(expected, tuple) and _keyed(expected) and _keyed(actual):
        want, got = dict(expected), dict(actual)
        for key in [*want, *(k for k in got if k not in want)]:
            found = first_field_difference(want.get(key, _MISSING), got.get(key, _MISSING), f"{path}[{key}]")
            if found:
                return found
    elif isinstance(expected, tuple) and len(expected) == len(actual):
        for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
            found = first_field_difference(a, b, f"{path}[{i}]")
            if found:
                return found
    return path or "the result", expected, actual


def _keyed(items: tuple[Any, ...]) -> bool:
    """A tuple of (request id, result) pairs, as a step's results are."""
    return all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in items)


def first_difference(
    factory: Callable[[Config], Target], config: Config, ops: tuple[Op, ...], violation: Violation
) -> str:
    """The sentence (see the module docstring)."""
    if not ops:
        return f"on an empty allocator: {violation.check}: {violation.message}"
    where = f"op {len(ops) - 1} ({describe_op(ops[-1])})"
    if violation.check != "observation":
        return f"{where}: {violation.check}: {violation.message}"
    checker = Checker(factory(config), audit_every=1)
    for op in ops[:-1]:
        checker.step(op)
    expected = copy.deepcopy(checker.model).apply(ops[-1])
    checker.step(ops[-1])
    actual = checker.last_obs
    diff = first_field_difference(expected, actual)
    if diff is None:  # the replay no longer differs there: say what was recorded
        return f"{where}: {violation.check}: {violation.message}"
    field, want, got = diff
    return f"{where}: {field}: the model gives {want!r}, {checker.target.name} gives {got!r}"
