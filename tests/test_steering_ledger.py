"""No adapter writes vLLM's scheduler state after construction, but the directed driver,
whose every write is named in `vllm_scheduler_drive.STEERING`, with its reason.

The engine's contract asks that kvretain act only as the engine core and a client do:
"vllm" and "vllm-async-scheduler" write nothing of their scheduler (the KV-event
capture is handed to it at construction, `vllm_scheduler_build.capturing_events`).
The directed targets ("vllm-directed", "vllm-async-scheduler-directed") steer, and
every write sits in the `Steered` mixin (`STEERING_CLASSES`). This test holds the
adapters' source to that: a write (an attribute of a scheduler assigned, its queues
mutated, a private method of it called) outside `Steered` fails, a new write inside it
fails until it is named, and a named write that is gone fails until the entry is
dropped. The controls plant writes in a copy of the source.
"""

from __future__ import annotations

import ast
from pathlib import Path

from invariants.targets.vllm_scheduler_drive import STEERING, STEERING_CLASSES

TARGETS = Path(__file__).resolve().parents[1] / "invariants" / "targets"
SCHEDULER_NAMES = {"sched", "scheduler", "vllm_scheduler"}
QUEUES = {"running", "waiting", "kv_holding_waiting"}
MUTATORS = {
    "remove",
    "append",
    "extend",
    "add_request",
    "prepend_request",
    "pop",
    "clear",
    "insert",
    "remove_requests",
}


def _chain(node: ast.expr) -> list[str]:
    """`self.sched.running` -> ["self", "sched", "running"] (calls and subscripts cut the chain)."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def _on_scheduler(chain: list[str]) -> int | None:
    """The index just past the scheduler in `chain`, or None when it names none."""
    hits = [i for i, name in enumerate(chain[:-1]) if name in SCHEDULER_NAMES]
    return hits[-1] + 1 if hits else None


def scheduler_writes(source: str) -> dict[str, set[str]]:
    """function (Class.method) -> the scheduler attributes it writes, in `source`."""
    found: dict[str, set[str]] = {}

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name)
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{where}.{child.name}" if where else child.name)
                continue
            written: list[str] = []
            if isinstance(child, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                for t in targets:
                    chain = _chain(t) if isinstance(t, ast.Attribute) else []
                    at = _on_scheduler(chain)
                    if at is not None and at == len(chain) - 1:
                        written.append(chain[at])
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                chain = _chain(child.func)
                at = _on_scheduler(chain)
                if at is not None:
                    rest = chain[at:]
                    if (
                        len(rest) == 2
                        and rest[0] in QUEUES
                        and rest[1] in MUTATORS
                        or len(rest) == 1
                        and rest[0].startswith("_")
                    ):
                        written.append(rest[0])
            if written:
                found.setdefault(where, set()).update(written)
            visit(child, where)

    visit(ast.parse(source), "")
    return found


def adapters_writes() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in sorted(TARGETS.glob("*.py")):
        for where, attrs in scheduler_writes(path.read_text()).items():
            out.setdefault(where, set()).update(attrs)
    return out


def outside_steering(writes: dict[str, set[str]]) -> dict[str, set[str]]:
    """The writes of `writes` made outside the steering classes (`STEERING_CLASSES`)."""
    return {where: attrs for where, attrs in writes.items() if where.split(".")[0] not in STEERING_CLASSES}


def test_every_write_to_the_scheduler_is_in_the_ledger_and_the_ledger_is_current() -> None:
    ledger = {s.function: set(s.writes) for s in STEERING}
    assert adapters_writes() == ledger
    assert all(s.why for s in STEERING)


def test_no_adapter_but_the_directed_driver_writes_the_scheduler() -> None:
    """The engine's own targets write nothing of vLLM's scheduler after construction."""
    assert outside_steering(adapters_writes()) == {}
    assert {s.function.split(".")[0] for s in STEERING} <= STEERING_CLASSES


def test_the_engine_targets_do_not_steer() -> None:
    """The unsteered drivers are not `Steered`; the directed ones are."""
    from invariants.targets.vllm_async_scheduler_drive import AsyncStepScheduler, DirectedAsyncStepScheduler
    from invariants.targets.vllm_scheduler_drive import DirectedStepScheduler, RealStepScheduler, Steered
    from invariants.targets.vllm_scheduler_spec import DirectedSpecStepScheduler, SpecStepScheduler

    for cls in (RealStepScheduler, SpecStepScheduler, AsyncStepScheduler):
        assert not issubclass(cls, Steered)
    for cls in (DirectedStepScheduler, DirectedSpecStepScheduler, DirectedAsyncStepScheduler):
        assert issubclass(cls, Steered)


def test_a_planted_write_outside_the_directed_driver_is_found() -> None:
    """The control: a write in an engine driver (its event publisher assigned, a queue
    rebuilt) is outside the steering classes; the directed driver's are not."""
    planted = (
        "class RealStepScheduler:\n"
        "    def __init__(self, scheduler):\n"
        "        scheduler.kv_event_publisher = object()\n"
        "    def step(self):\n"
        "        self.sched.running = []\n"
        "class Steered:\n"
        "    def arrange(self):\n"
        "        self.sched.waiting = []\n"
    )
    assert outside_steering(scheduler_writes(planted)) == {
        "RealStepScheduler.__init__": {"kv_event_publisher"},
        "RealStepScheduler.step": {"running"},
    }


def test_a_planted_write_to_the_scheduler_is_found() -> None:
    """The control: a queue rebuilt, a budget set and a private call, each found."""
    planted = (
        "class Driver:\n"
        "    def step(self):\n"
        "        self.sched.waiting = []\n"
        "        sched = self.sched\n"
        "        sched.max_num_scheduled_tokens += 1\n"
        "    def nudge(self, scheduler):\n"
        "        scheduler.running.append(1)\n"
        "        scheduler._free_request(1)\n"
        "    def reads(self):\n"
        "        return self.sched.running, list(self.sched.waiting)\n"
    )
    assert scheduler_writes(planted) == {
        "Driver.step": {"waiting", "max_num_scheduled_tokens"},
        "Driver.nudge": {"running", "_free_request"},
    }
