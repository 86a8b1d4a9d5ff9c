"""No adapter writes vLLM's scheduler state after construction.

The engine's contract asks that kvretain act only as the engine core and a client do:
"vllm" and "vllm-async-scheduler" write nothing of their scheduler (the KV-event
capture is handed to it at construction, `vllm_scheduler_build.capturing_events`).
This test reads every adapter's source in invariants/targets/ (AST) and finds each write
to a `Scheduler` after construction: an attribute assigned, augmented or deleted, an
item of one assigned, one changed in place by a mutating call (`.append`, `.remove`,
`.extend`, `.add_request`, `.pop`, ...), `setattr`, or a private method of the scheduler
called (`_preempt_request`), directly or through a local bound to the scheduler or to one
of its attributes. Any write found fails (the directed targets that steered vLLM's queues
and budget are gone). The controls plant writes (and non-writes) in source of their own,
and in a copy of a real adapter's source.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TARGETS = Path(__file__).resolve().parents[1] / "invariants" / "targets"
# How the adapters name a vLLM `Scheduler` (an attribute or a local); a local bound to one
# (`sched = self.sched`) or to one of its attributes (`queue = sched.waiting`) is followed.
SCHEDULER_NAMES = {"sched", "scheduler", "vllm_scheduler"}
# Calls that change the object they are called on (a queue, a dict, a set, a list).
MUTATORS = {
    "remove",
    "append",
    "appendleft",
    "extend",
    "add",
    "add_request",
    "prepend_request",
    "prepend_requests",
    "pop",
    "popleft",
    "popitem",
    "clear",
    "insert",
    "update",
    "discard",
    "setdefault",
    "remove_requests",
    "sort",
    "reverse",
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


class _Scope:
    """The locals of one function that stand for the scheduler or one of its attributes."""

    def __init__(self) -> None:
        self.schedulers: set[str] = set()
        self.attributes: dict[str, str] = {}

    def resolve(self, chain: list[str]) -> tuple[str, ...] | None:
        """The scheduler attributes `chain` names past the scheduler (() for the scheduler
        itself), or None when it names no scheduler."""
        hits = [
            i
            for i, name in enumerate(chain)
            if name in SCHEDULER_NAMES or (i == 0 and name in self.schedulers)
        ]
        if hits:
            return tuple(chain[hits[-1] + 1 :])
        if chain and chain[0] in self.attributes:
            return (self.attributes[chain[0]], *chain[1:])
        return None

    def bind(self, node: ast.Assign) -> None:
        """`name = <scheduler>` or `name = <scheduler>.attr`: followed from here on."""
        value = node.value
        chain = _chain(value) if isinstance(value, (ast.Attribute, ast.Name)) else []
        rest = self.resolve(chain) if chain else None
        for t in node.targets:
            if not isinstance(t, ast.Name):
                continue
            self.schedulers.discard(t.id)
            self.attributes.pop(t.id, None)
            if rest == ():
                self.schedulers.add(t.id)
            elif rest:
                self.attributes[t.id] = rest[0]


def _written(target: ast.expr, scope: _Scope) -> str | None:
    """The scheduler attribute an assignment (or `del`) to `target` writes: the attribute
    itself (`sched.x = ...`), or an item of it (`sched.requests[rid] = ...`)."""
    if isinstance(target, ast.Subscript):
        node = target.value
        rest = scope.resolve(_chain(node)) if isinstance(node, (ast.Attribute, ast.Name)) else None
        return rest[0] if rest else None
    if isinstance(target, ast.Attribute):
        rest = scope.resolve(_chain(target))
        return rest[0] if rest and len(rest) == 1 else None
    return None


def _called(call: ast.Call, scope: _Scope) -> str | None:
    """The scheduler attribute a call writes: a mutating method of one of its attributes
    (`sched.waiting.add_request(r)`), one of its private methods (`sched._preempt_request`),
    or `setattr` / `delattr` on it."""
    func = call.func
    if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and call.args:
        first = call.args[0]
        on = scope.resolve(_chain(first)) if isinstance(first, (ast.Attribute, ast.Name)) else None
        if on == ():
            name = call.args[1] if len(call.args) > 1 else None
            return name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else "?"
        return None
    if not isinstance(func, ast.Attribute):
        return None
    rest = scope.resolve(_chain(func))
    if not rest:
        return None
    if len(rest) == 1 and rest[0].startswith("_") and not rest[0].startswith("__"):
        return rest[0]  # a private method of the scheduler
    if len(rest) == 2 and rest[1] in MUTATORS:
        return rest[0]  # one of its attributes changed in place
    return None


def scheduler_writes(source: str) -> dict[str, set[str]]:
    """function (Class.method) -> the scheduler attributes it writes after construction, in
    `source`: assigned, augmented, deleted, an item of one assigned, changed in place by a
    mutating call, set by `setattr`, or a private method of the scheduler called."""
    found: dict[str, set[str]] = {}

    def visit(node: ast.AST, where: str, scope: _Scope) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name, _Scope())
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                name = getattr(child, "name", "<lambda>")
                visit(child, f"{where}.{name}" if where else name, _Scope())
                continue
            targets: list[ast.expr] = []
            if isinstance(child, ast.Assign):
                targets = list(child.targets)
            elif isinstance(child, (ast.AugAssign, ast.AnnAssign)):
                targets = [child.target]
            elif isinstance(child, ast.Delete):
                targets = list(child.targets)
            written = [w for w in (_written(t, scope) for t in targets) if w]
            if isinstance(child, ast.Call):
                called = _called(child, scope)
                written += [called] if called else []
            if written:
                found.setdefault(where, set()).update(written)
            visit(child, where, scope)
            if isinstance(child, ast.Assign):
                scope.bind(child)

    visit(ast.parse(source), "", _Scope())
    return found


def adapters_writes() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in sorted(TARGETS.glob("*.py")):
        for where, attrs in scheduler_writes(path.read_text()).items():
            out.setdefault(where, set()).update(attrs)
    return out


def test_no_adapter_writes_the_scheduler() -> None:
    """The done-when: no line of invariants/targets/ writes a `Scheduler` after construction."""
    assert adapters_writes() == {}


def test_no_directed_target_is_left() -> None:
    """The targets that steered vLLM are gone, and a command naming one is told what replaced it."""
    from invariants.targets import RENAMED, TARGET_NAMES, TargetUnavailable, target_factory

    assert not [name for name in TARGET_NAMES if name.endswith("-directed")]
    for name in ("vllm-directed", "vllm-async-scheduler-directed"):
        assert "no longer steers" in RENAMED[name]
        with pytest.raises(TargetUnavailable, match="is now called"):
            target_factory(name)


def test_a_write_planted_in_a_real_adapter_is_found() -> None:
    """The control on the adapters' own source: one line that rebuilds vLLM's running
    queue, added to the real step driver, is found there (and only there)."""
    source = (TARGETS / "vllm_scheduler_drive.py").read_text()
    anchor = "        self.flush()\n        sched, named = self.sched, set(rids)\n"
    assert anchor in source
    planted = source.replace(anchor, anchor + "        sched.running = list(sched.running)\n", 1)
    assert scheduler_writes(source) == {}
    assert scheduler_writes(planted) == {"RealStepScheduler.step": {"running"}}


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


def test_a_planted_running_queue_reset_is_found() -> None:
    """The done-when control: `sched.running = []` in any adapter is a write."""
    assert scheduler_writes("def step(sched):\n    sched.running = []\n") == {"step": {"running"}}


def test_writes_through_a_local_an_item_setattr_and_del_are_found() -> None:
    """Controls for the forms a write can take: through a local bound to the scheduler or
    to one of its attributes, an item of an attribute, `setattr`, `del`, an augmented
    assignment, a mutating call on any attribute (not only the queues)."""
    planted = (
        "class Driver:\n"
        "    def alias(self):\n"
        "        s = self.vllm_scheduler\n"
        "        s.policy = None\n"
        "        queue = s.waiting\n"
        "        queue.prepend_request(1)\n"
        "    def item(self, rid):\n"
        "        self.sched.requests[rid] = None\n"
        "        del self.sched.kv_holding_waiting\n"
        "    def other(self):\n"
        "        setattr(self.scheduler, 'max_num_running_reqs', 1)\n"
        "        self.sched.finished_req_ids.add('r0')\n"
        "        self.sched.num_waiting -= 1\n"
    )
    assert scheduler_writes(planted) == {
        "Driver.alias": {"policy", "waiting"},
        "Driver.item": {"requests", "kv_holding_waiting"},
        "Driver.other": {"max_num_running_reqs", "finished_req_ids", "num_waiting"},
    }


def test_what_an_engine_core_and_a_client_do_is_no_write() -> None:
    """Control the other way: the scheduler's public calls, reads of its queues, a local
    rebound to something else, and writes to another object are not writes."""
    clean = (
        "class Driver:\n"
        "    def step(self, req):\n"
        "        self.sched.add_request(req)\n"
        "        out = self.sched.schedule()\n"
        "        self.sched.update_from_output(out, None)\n"
        "        self.sched.finish_requests('r0', None)\n"
        "        ids = [r.request_id for r in self.sched.running]\n"
        "        queue = self.sched.waiting\n"
        "        queue = list(queue)\n"
        "        queue.append(1)\n"
        "        self.sched.connector.watch = None\n"
        "        self.recorder.calls.append(ids)\n"
    )
    assert scheduler_writes(clean) == {}


@pytest.mark.vllm
def test_a_step_the_engine_would_not_take_is_refused_not_steered() -> None:
    """Without steering, a trace's step must be the engine's own: over every request it
    holds, with a budget that gives the same step (`RealStepScheduler.budget_unbound`).
    A step over fewer requests, or whose budget would have cut it otherwise, is refused
    (`refused`, kvretain's refusal of the trace); the controls, the built budget and a
    budget that does not bind, run."""
    from invariants.harness.checker import Checker
    from invariants.targets.vllm_env import vllm_available
    from model.contract.config import Config, GroupSpec
    from model.contract.ops import AddRequest, Step

    if not vllm_available()[0]:
        pytest.skip(f"vllm target: {vllm_available()[1]}")
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    def checks(*ops: object) -> list[str]:
        checker = Checker(VllmSchedulerTarget(Config((GroupSpec("full", 4),), 16, max_num_batched_tokens=4)))
        return [v.check for op in ops for v in checker.step(op)]  # type: ignore[arg-type]

    add = AddRequest("a", tuple(range(1, 10)))
    assert checks(add, Step(("a",), 4), Step(("a",), 4), Step(("a",), 3)) == []  # 4, 4, then 1 of 3
    assert checks(add, Step(("a",), 64)) == ["refused"]  # 64 would have scheduled all 9
    assert checks(add, Step(("a",), 2)) == ["refused"]  # 2 would have cut the chunk of 4
    assert checks(add, AddRequest("b", (1, 2)), Step(("a",), 4)) == ["refused"]  # b held, not named


@pytest.mark.vllm
def test_a_budget_on_the_other_side_of_a_mamba_block_is_refused() -> None:
    """vLLM's Mamba split compares the aligned block with the step budget itself when a
    prefill chunk stops short of its prompt: built with 4096 tokens it aligns r0's 3-token
    prompt to its 2-token checkpoint, where a 3-token budget (narrower than the 4-token
    block) would not, so a trace's budget of 3 is refused though 2 tokens fit it. Controls:
    a budget as wide as the block runs, and so does the narrow one for a chunk that reaches
    its prompt's end (the split is not consulted)."""
    from invariants.harness.checker import Checker
    from invariants.targets.vllm_env import vllm_available
    from model.contract.config import Config, GroupSpec
    from model.contract.ops import AddRequest, Step

    if not vllm_available()[0]:
        pytest.skip(f"vllm target: {vllm_available()[1]}")
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    groups = (GroupSpec("full", 4), GroupSpec("mamba", 4, mamba_cache_mode="align"))
    cfg = Config(
        groups, 14, retention_interval=0, hash_block_size=2, scheduler_block_size=4, max_model_len=4096
    )

    def checks(prompt: tuple[int, ...], budget: int) -> list[str]:
        checker = Checker(VllmSchedulerTarget(cfg))
        return [v.check for op in (AddRequest("a", prompt), Step(("a",), budget)) for v in checker.step(op)]

    assert checks((2, 3, 1), 3) == ["refused"]
    assert checks((2, 3, 1), 4) == []
    assert checks((2, 3), 3) == []


def _exported_writes(source: str) -> dict[str, set[str]]:
    """`scheduler_writes` of an exported test, whose driver names vLLM's scheduler `self.s`."""
    return scheduler_writes(source.replace("self.s.", "self.sched.").replace("= self.s\n", "= self.sched\n"))


@pytest.mark.vllm
def test_an_exported_scheduler_test_never_writes_the_scheduler() -> None:
    """The tests kvretain hands upstream drive vLLM as its engine targets do: an exported
    scheduler test checks the queues each step starts from and writes nothing; a trace
    with a `Preempt` (no engine's client can ask one) is not exported. Control: a write
    planted in the exported source is found."""
    from invariants.export.plan import ExportError, plan_export
    from invariants.export.pytest_file import render_test
    from invariants.harness.trace import Trace
    from model.contract.config import Config, GroupSpec
    from model.contract.ops import AddRequest, Preempt, Step

    cfg = Config((GroupSpec("full", 4),), 16, max_num_batched_tokens=8)
    ops = [AddRequest("a", tuple(range(1, 11))), Step(("a",), 8), Step(("a",), 8)]
    source = render_test(
        plan_export(Trace(cfg, ops, 0, "vllm", "observation: results[a].scheduled: planted"))
    )
    assert "the requests schedule() starts from" in source and _exported_writes(source) == {}
    planted = source.replace(
        "        out = s.schedule()\n", "        s.running = []\n        out = s.schedule()\n", 1
    )
    assert planted != source and _exported_writes(planted) == {"Driver.step": {"running"}}
    with pytest.raises(ExportError, match="Preempt"):
        render_test(
            plan_export(Trace(cfg, [*ops[:2], Preempt("a"), ops[2]], 0, "vllm", "observation: planted"))
        )
