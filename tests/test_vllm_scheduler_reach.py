"""The vllm target's reach: the scheduler mutants of each scheduler decision
(chunking under the budget and the Mamba split, admission with a hit, preemption and
replay, the block tables a step ships), the shipped-table observation that catches the last, the
export of a vllm finding, the production bench and the release matrix's
scheduler capability.

Negative controls: each mutant below is caught on a trace the unmutated scheduler
passes; the shipped-table reading flags a table that is not the allocation; a
source mutant whose line vLLM no longer has fails loudly. Skipped, with the reason,
when vLLM cannot be imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from invariants.targets.vllm_env import vllm_available

if not vllm_available():  # pragma: no cover - depends on the environment
    pytest.skip("vLLM is not importable", allow_module_level=True)

from drive import Drive  # noqa: E402
from engine_drive_steps import engine_step, engine_steps  # noqa: E402

from invariants.targets.vllm_scheduler_drive import shipped_admission  # noqa: E402
from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget  # noqa: E402
from invariants.zoo.mutants_scheduler import SCHEDULER_MUTANTS, StaleMutant, _rewrite, activate  # noqa: E402
from model.contract.config import Config, GroupSpec  # noqa: E402
from model.contract.ops import AddRequest, Finish, Sample, Step  # noqa: E402

pytestmark = pytest.mark.vllm

Factory = type[VllmSchedulerTarget]
FULL_SWA_SWA = Config(
    groups=(
        GroupSpec("full", 4),
        GroupSpec("swa", 8, sliding_window=18),
        GroupSpec("swa", 2, sliding_window=3),
    ),
    num_blocks=22,
    retention_interval=None,
    max_model_len=4096,
)
FULL2 = Config(groups=(GroupSpec("full", 2),), num_blocks=12, enable_caching=False, max_model_len=4096)
PROMPT8 = (1, 2, 2, 3, 1, 1, 1, 3)


def budget_trace(f: Factory) -> Drive:
    """Chunking under the budget: an engine built with 64 tokens a step, over three Mamba
    prompts; the last one is left less than a Mamba block of it, so it must wait for an
    aligned chunk."""
    cfg = Config(
        groups=(GroupSpec("full", 16), GroupSpec("mamba", 8)),
        num_blocks=20,
        retention_interval=48,
        max_model_len=4096,
        max_num_batched_tokens=64,
    )
    long = (*PROMPT8, *(i % 3 + 1 for i in range(41)))
    d = Drive(cfg, f).do(AddRequest("r3", PROMPT8), AddRequest("r5", long), AddRequest("r6", (*PROMPT8, 1)))
    return engine_step(d)


def hit_trace(f: Factory) -> Drive:
    """Admission with a hit: one request caches 8 tokens, the next arrives and is admitted
    on them (beside the first's decode) and computes its last token; then a second step."""
    d = engine_step(Drive(FULL_SWA_SWA, f).do(AddRequest("r1", PROMPT8)))
    return engine_steps(d.do(Sample("r1", 1), AddRequest("r3", (*PROMPT8, 2))), 2)


def replay_trace(f: Factory) -> Drive:
    """Preemption and replay: two requests outgrow a 6-block pool, so the later one (r1),
    having generated two tokens, is preempted; once r0 finishes it is re-admitted (caching
    off: no hit), so its replay chunk spans prompt and outputs."""
    d = Drive(FULL2.with_(num_blocks=7), f).do(
        AddRequest("r0", (1, 2, 3, 1, 2)), AddRequest("r1", (3, 2, 1, 3, 2))
    )
    return engine_steps(engine_steps(d, 3).do(Finish("r0")), 2)


def table_trace(f: Factory) -> Drive:
    """The tables a step ships: an admission on a hit (its whole table), then decodes."""
    return engine_steps(hit_trace(f), 2)


def mamba_config(*, caching: bool) -> Config:
    return Config(
        groups=(GroupSpec("full", 4), GroupSpec("mamba", 8)),
        num_blocks=30,
        retention_interval=8 if caching else None,
        enable_caching=caching,
        max_model_len=4096,
    )


PROMPT12 = (*PROMPT8, 2, 1, 3, 3)


def mamba_replay_trace(f: Factory) -> Drive:
    """Chunking a replay: in an engine built with 14 tokens a step, two Mamba requests
    outgrow a 12-block pool; the later one (r1), having generated 5 tokens, is preempted and,
    once r0 finishes, replays 17 tokens, so its first chunk must end on the block boundary 8."""
    cfg = mamba_config(caching=False).with_(num_blocks=13, max_num_batched_tokens=14)
    d = Drive(cfg, f).do(AddRequest("r0", PROMPT12), AddRequest("r1", PROMPT12[::-1]))
    return engine_steps(engine_steps(d, 8).do(Finish("r0")), 2)


def mamba_chunk_trace(f: Factory) -> Drive:
    """Chunking: a 20-token Mamba prompt in one budget runs to its last cacheable block
    boundary (16), passing the boundary at 8 without a stop."""
    return Drive(mamba_config(caching=True), f).do(AddRequest("r0", (*PROMPT12, *PROMPT8)), Step(("r0",), 64))


def preempted_hit_trace(f: Factory) -> Drive:
    """Replay after preemption: two requests outgrow a 6-block pool, the later one (r1) is
    preempted; once r0 finishes, r1's re-admission looks up the blocks its own prefill cached."""
    d = Drive(Config(groups=(GroupSpec("full", 2),), num_blocks=7, max_model_len=4096), f)
    d.do(AddRequest("r0", (1, 2, 3, 1, 2)), AddRequest("r1", (3, 1, 2, 2, 1)))
    return engine_steps(engine_steps(d, 3).do(Finish("r0")), 2)


def self_preemption_trace(f: Factory) -> Drive:
    """Preemption: a request outgrowing a 5-block pool preempts itself; that step admits
    nobody, not even the request it just preempted."""
    d = Drive(Config(groups=(GroupSpec("full", 2),), num_blocks=6, max_model_len=4096), f)
    return d.do(AddRequest("r0", (1, 1, 1, 2, 2, 1, 2, 1, 2))).steps(("r0",), 64, 3)


REACH_TRACES: dict[str, Callable[[Factory], Drive]] = {
    "mamba_split_budget_is_chunk": budget_trace,
    "admission_drops_hit_tokens": hit_trace,
    "resume_chunk_stops_at_prompt": replay_trace,
    "admission_ships_new_blocks_only": table_trace,
    "running_ships_whole_table": table_trace,
    "replay_chunk_not_split": mamba_replay_trace,
    "chunk_runs_past_block_boundary": mamba_chunk_trace,
    "resumed_request_skips_lookup": preempted_hit_trace,
    "admission_beside_preemption": self_preemption_trace,
}


@pytest.mark.parametrize("name", sorted(REACH_TRACES))
def test_reach_mutant_is_caught(name: str) -> None:
    """Negative controls: each mutant of a scheduler decision is caught on a trace the
    unmutated scheduler passes."""
    assert name in SCHEDULER_MUTANTS
    assert REACH_TRACES[name](VllmSchedulerTarget).found == []
    with activate(name) as factory:
        assert REACH_TRACES[name](factory).found != []


def test_shipped_admission_reads_the_table_the_worker_gets() -> None:
    """A whole table = the hit (nulled where a window left it, or copied on write) then
    the new blocks; a table without the hit reads as a different hit."""
    hit, new = ((1, 2, 4), (5, 6)), ((7,), (8,))
    assert shipped_admission(((1, 2, 4, 7), (0, 6, 8)), hit, new, set()) == (hit, new)
    assert shipped_admission(((1, 2, 7), (5, 6, 8)), hit, ((7,), (8,)), {(4, 7)}) == (hit, ((7,), (8,)))
    got_hit, got_new = shipped_admission(((7,), (8,)), hit, new, set())
    assert got_hit != hit and got_new != new
    # A connector's external blocks (9; 0 in the windowed group) sit between hit and chunk.
    assert shipped_admission(((1, 2, 4, 9, 7), (5, 6, 0, 8)), hit, new, set(), external=True) == (hit, new)
    assert shipped_admission(((1, 2, 4, 9, 7), (5, 6, 0, 8)), hit, new, set()) != (hit, new)
    assert shipped_admission(((1, 2, 9, 7), (5, 6, 0, 8)), hit, new, set(), external=True) != (hit, new)
    # External tokens that superseded the hit's sub-block tail (`model.machine.connector`): blocks 9 10 stand
    # where the hit's tail was (from its first entry not the hit's on); the hit reads as the lookup's.
    tail = ((1, 2, 9, 10, 7), (5, 0, 8))
    assert shipped_admission(tail, hit, new, set(), external=True, superseded=True) == (hit, new)
    assert shipped_admission(tail, hit, new, set(), external=True)[0] == ((1, 2, 9), (5, 6))


def test_a_source_mutant_whose_line_is_gone_fails_loudly() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    with contextlib.ExitStack() as stack, pytest.raises(StaleMutant, match="found 0 times"):
        _rewrite(stack, Scheduler, "schedule", "no_such_line = 1", "pass")
    original: Any = Scheduler.schedule
    with contextlib.ExitStack() as stack:
        _rewrite(
            stack, Scheduler, "schedule", "token_budget = self.max_num_scheduled_tokens", "token_budget = 1"
        )
        assert Scheduler.schedule is not original
    assert Scheduler.schedule is original


def test_a_source_mutant_reads_as_its_source() -> None:
    """A release's capability probe reads `Scheduler.schedule`'s source: under a source
    mutant it reads the mutated method, so a scheduler built first under a mutant is
    accepted (it was refused as lacking the API)."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    with activate("resumed_request_skips_lookup"):
        source = inspect.getsource(Scheduler.schedule)
        assert "request.num_preemptions == 0:" in source and "self.max_num_scheduled_tokens" in source
        assert preempted_hit_trace(VllmSchedulerTarget).found != []


# ------------------------------------------------------------------ export of a vllm finding
EXPORTED_IMPORTS = {"json", "os", "tempfile", "time", "dataclasses", "torch", "vllm"}


def test_a_planted_scheduler_finding_exports_as_a_standalone_real_scheduler_test(tmp_path: Any) -> None:
    """A finding on vllm (planted: the shipped-table mutant; engine steps: r3 arrives once
    r1's step cached its prompt and is admitted beside r1's decode) exports as a pytest
    file that imports only vLLM and torch, builds vLLM's `Scheduler`, passes on vLLM and
    fails with an assertion (not a setup divergence) under the mutant."""
    import ast
    import importlib.util

    from invariants.export.plan import plan_export
    from invariants.export.pytest_file import render_test
    from invariants.harness.trace import Trace

    name = "admission_ships_new_blocks_only"
    ops = [
        AddRequest("r1", PROMPT8),
        Step(("r1",), 32),
        Sample("r1", 1),
        AddRequest("r3", (*PROMPT8, 2)),
        Step(("r1", "r3"), 16),
    ]
    with activate(name) as factory:
        found = Drive(FULL_SWA_SWA, factory).do(*ops).found
    assert found and found[0].check == "observation" and found[0].op == ops[-1]
    trace = Trace(FULL_SWA_SWA, ops, seed=0, target="vllm", violation=f"mutant {name}: {found[0]}")
    source = render_test(plan_export(trace))
    roots = {
        (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
        for n in ast.parse(source).body
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert roots <= EXPORTED_IMPORTS and "vllm" in roots, roots
    assert "Scheduler(" in source and "driver.step(('r1', 'r3'), 16)" in source
    path = tmp_path / "test_exported_scheduler_finding.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("exported_scheduler_finding", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    test = next(getattr(module, n) for n in dir(module) if n.startswith("test_"))
    test()  # vLLM 0.33.0 ships what the specification says
    with activate(name), pytest.raises(AssertionError):
        test()


# ------------------------------------------------------------------ bench --scale production
def test_the_production_bench_clock_counts_nested_vllm_calls_once() -> None:
    """The scheduler's calls into the manager are inside its own time: counted once."""
    import time as _time

    from invariants.harness.bench import _VllmClock

    clock = _VllmClock()

    def inner() -> None:
        _time.sleep(0.02)

    timed_inner = clock.timed(inner)

    def outer() -> None:
        timed_inner()
        _time.sleep(0.02)

    clock.timed(outer)()
    assert 0.04 <= clock.seconds < 0.06, clock.seconds
    timed_inner()
    assert clock.seconds >= 0.06


def test_the_production_workload_sends_an_engine_its_own_steps() -> None:
    """With `engine`, every step is the engine's: over every request the model says it holds,
    in the predicted queue order, with the built budget; no single-request chunk, no directed
    preemption. Control: without it, the allocator's caller sends chunks of one request."""
    import random

    from invariants.harness.bench import scheduled_tokens
    from invariants.harness.checker import Checker
    from invariants.harness.production import CHUNK, engine_config, workload
    from invariants.targets.model_target import ModelTarget
    from model.contract.config import Config, GroupSpec
    from model.contract.observation import ScheduleResult, StepResult
    from model.contract.ops import Preempt, Schedule

    def ops_of(engine: bool) -> list[Any]:
        cfg = Config((GroupSpec("full", 16),), 512, max_model_len=4096)
        checker = Checker(ModelTarget(engine_config(cfg) if engine else cfg))
        gen, seen = workload(cfg, random.Random(0), checker, 300, engine=engine), []
        while len(seen) < 300:
            op = next(gen)
            if isinstance(op, Step):
                q = checker.model.engine_queues()
                seen.append((op, (*q.running, *q.holding, *q.waiting)))
            else:
                seen.append((op, None))
            checker.step(op)
        return seen

    engine = ops_of(True)
    steps = [(op, held) for op, held in engine if isinstance(op, Step)]
    assert steps and all(op.rids == held and op.budget == CHUNK for op, held in steps)
    assert not [op for op, _ in engine if isinstance(op, (Schedule, Preempt))]
    assert any(isinstance(op, Schedule) for op, _ in ops_of(False))
    step = StepResult((("a", ScheduleResult(3, True)), ("b", ScheduleResult(0, False))))
    assert scheduled_tokens(step) == 3 and scheduled_tokens(ScheduleResult(5, False)) == 5


# ------------------------------------------------------------------ the release matrix's scheduler API
def _fake_schedule(self: Any) -> int:
    return int(self.max_num_scheduled_tokens)  # the budget the scheduler was built with


def _fake_scheduler_namespace(drop: str = "") -> dict[str, Any]:
    """Classes shaped like vLLM's, with everything `SCHEDULER_API` names (less `drop`)."""
    from invariants.targets.vllm_capabilities import SCHEDULER_API

    ns: dict[str, Any] = {}
    for owner, names in SCHEDULER_API.items():
        cls_name, _, method = owner.partition(".")
        if method:
            continue
        body: dict[str, Any] = {n: None for n in names if f"{cls_name}.{n}" != drop}
        if cls_name == "Scheduler":
            params = ", ".join(
                n for n in SCHEDULER_API["Scheduler.__init__"] if f"Scheduler.__init__({n})" != drop
            )
            exec(f"def __init__(self, {params}): pass", body)  # noqa: S102 - a fake's signature
            body["schedule"] = _fake_schedule
        ns[cls_name] = type(cls_name, (), body)
    return ns


@pytest.mark.parametrize(
    "drop",
    [
        "Scheduler.__init__(hash_block_size)",
        "SchedulerOutput.kv_cache_block_copies",
        "CachedRequestData.new_block_ids",
    ],
)
def test_the_scheduler_api_detection_names_what_a_release_lacks(drop: str) -> None:
    from invariants.targets.vllm_capabilities import scheduler_api_missing

    assert scheduler_api_missing(_fake_scheduler_namespace()) == ()
    assert scheduler_api_missing(_fake_scheduler_namespace(drop)) == (drop,)


def test_this_vllm_has_the_scheduler_api_and_a_release_without_it_is_refused(monkeypatch: Any) -> None:
    """vLLM 0.33.0 has everything; a release that lacks a piece makes the target
    unavailable with the reason (and the matrix report says it)."""
    import dataclasses

    import invariants.targets.vllm_capabilities as capabilities
    from invariants.matrix.markdown import scheduler_line
    from invariants.targets import TargetUnavailable, target_factory

    caps = capabilities.detect()
    assert caps.scheduler_missing == ()
    assert capabilities.Capabilities.from_json(caps.to_json()) == caps
    assert scheduler_line(caps) == "vllm: can drive this release's Scheduler"
    old = dataclasses.replace(caps, version="0.21.0", scheduler_missing=("SchedulerConfig.watermark",))
    monkeypatch.setattr(capabilities, "detect", lambda: old)
    with pytest.raises(
        TargetUnavailable, match=r"vLLM 0\.21\.0's Scheduler lacks .*SchedulerConfig\.watermark"
    ):
        target_factory("vllm")
    assert "cannot" in scheduler_line(old)


@pytest.mark.parametrize("real_scheduler", [True, False])
def test_production_fuzz_sends_a_real_scheduler_steps_not_schedules(real_scheduler: bool) -> None:
    """`fuzz --scale production` on a real scheduler sends a `Schedule` as the one-request
    step it is (vLLM may preempt the request itself, which the model states for a `Step`
    only: the first production run through the real scheduler disagreed there). Control:
    a target without a real scheduler still gets `Schedule`s."""
    import dataclasses

    from invariants.harness.production import run_production
    from invariants.targets.model_target import ModelTarget
    from model.contract.ops import Schedule

    seen: list[type] = []

    class Recording(ModelTarget):
        features = dataclasses.replace(ModelTarget.features, real_scheduler=real_scheduler)

        def apply(self, op: Any) -> Any:
            seen.append(type(op))
            return super().apply(op)

    run_production(Recording, seed=0, steps=300, budget_s=None, tolerated=lambda v: True)
    assert Step in seen and (Schedule in seen) is not real_scheduler
