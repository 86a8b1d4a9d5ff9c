"""The engine decides every step: "vllm" and "vllm-async-scheduler" run only the engine's
own steps (every request vLLM holds, in the model's predicted queue order, with the budget
the engine was built with), and the model states the queue order and the `max_num_seqs`
cap those steps run under (`model.policy.queues.QueueOrder.engine_order`, `model.policy.scheduling`).

Each check has its control: the model without the cap; against a step naming a subset,
another budget or order, or a `Preempt` (refused on the engine target, naming it), the
engine's own step from the same state."""

from __future__ import annotations

from pathlib import Path

import pytest

import model.machine.connector as connector_mod
from invariants.harness.checker import REFUSED, Checker
from invariants.harness.engine_step import engine_rids
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, ConfigError, GroupSpec, validate
from model.contract.observation import StepResult
from model.contract.ops import AddRequest, Finish, Preempt, Sample, Step
from model.machine.allocator import AllocatorModel
from model.policy.scheduling import build_budget, seq_cap

FULL = Config(groups=(GroupSpec("full", 4),), num_blocks=24, max_model_len=256)
CAPPED = FULL.with_(max_num_batched_tokens=8, max_num_seqs=2)

_OK, _REASON = vllm_available()
vllm_only = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")


def engine_step(m: AllocatorModel, budget: int) -> Step:
    """Every held request in the engine's order (`engine_rids`), whether or not one awaits a sample."""
    return Step(engine_rids(m), budget)


# ---------------------------------------------------------------------- the model


def test_arrivals_join_waitings_back_and_a_preempted_request_its_front() -> None:
    m = AllocatorModel(FULL)
    for i, rid in enumerate(("a", "b", "c")):
        m.apply(AddRequest(rid, (i + 1,) * 5))  # no hits between them
    assert m.engine_queues().waiting == ("a", "b", "c")
    m.apply(engine_step(m, 10))  # a and b admitted, c waits
    assert m.engine_queues().running == ("a", "b")
    m.apply(AddRequest("d", (7, 7)))
    m.apply(Preempt("a"))
    assert m.engine_queues().waiting == ("a", "c", "d")
    m.apply(Finish("c"))
    m.apply(AddRequest("c", (9,)))  # a reused id arrives at the back
    assert m.engine_queues() == (("b",), (), ("a", "d", "c"))


def test_max_num_seqs_stops_the_waiting_pass() -> None:
    """Two running requests fill `max_num_seqs=2`: the third waits with budget to spare."""
    m = AllocatorModel(CAPPED)
    for rid in ("a", "b", "c"):
        m.apply(AddRequest(rid, (1, 2)))
    step = m.apply(engine_step(m, build_budget(CAPPED)))
    assert isinstance(step, StepResult)
    assert [rid for rid, r in step.results if r.admitted] == ["a", "b"]
    assert step.queues is not None and step.queues.waiting == ("c",)


def test_control_without_the_cap_the_third_request_is_admitted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connector_mod, "seq_cap_reached", lambda running, cap: False)
    m = AllocatorModel(CAPPED)
    for rid in ("a", "b", "c"):
        m.apply(AddRequest(rid, (1, 2)))
    step = m.apply(engine_step(m, build_budget(CAPPED)))
    assert isinstance(step, StepResult)
    assert [rid for rid, r in step.results if r.admitted] == ["a", "b", "c"]


def test_the_batch_caps_are_validated_as_vllm_takes_them() -> None:
    assert build_budget(FULL) == FULL.max_model_len and seq_cap(FULL) == FULL.max_model_len
    assert seq_cap(FULL.with_(max_num_batched_tokens=3)) == 3  # vLLM: max_num_seqs <= the budget
    with pytest.raises(ConfigError, match="max_num_seqs"):
        validate(FULL.with_(max_num_batched_tokens=2, max_num_seqs=3))
    with pytest.raises(ConfigError, match="num_lookahead_tokens"):
        validate(FULL.with_(max_num_batched_tokens=2, num_lookahead_tokens=2))
    with pytest.raises(ConfigError, match="non-negative"):
        validate(FULL.with_(max_num_seqs=-1))


def test_a_trace_without_the_caps_reads_the_same() -> None:
    from invariants.harness.trace import config_from_json, config_to_json

    assert "max_num_seqs" not in config_to_json(FULL)
    assert config_from_json(config_to_json(CAPPED)) == CAPPED


# ---------------------------------------------------------------------- on vLLM's real scheduler


def drive(name: str, cfg: Config) -> Checker:
    from invariants.targets import target_factory

    checker = Checker(target_factory(name)(cfg), audit_every=1)
    for i, rid in enumerate(("a", "b", "c")):
        assert checker.step(AddRequest(rid, (i + 1,) * 5)) == []  # no hits between them
    return checker


@vllm_only
@pytest.mark.vllm
@pytest.mark.parametrize("name", ["vllm", "vllm-async-scheduler"])
def test_the_engines_steps_agree_with_the_model_under_binding_caps(name: str) -> None:
    """`max_num_seqs=2` and an 8-token budget bind on vLLM as the model states them; nothing
    is steered."""
    checker = drive(name, CAPPED)
    for _ in range(5):
        for rid, r in list(checker.model.requests.items()):
            if r.awaits_sample:
                assert checker.step(Sample(rid, 1)) == []
        assert checker.step(engine_step(checker.model, 8)) == []
    assert checker.model.engine_queues().waiting == ("c",)
    figures = checker.target.engine_figures() or {}
    assert figures["steps whose queue order vLLM held otherwise"] == 0 and figures["queue checks"] > 0
    settings = " ".join(checker.target.engine_settings())
    assert "max_num_batched_tokens=8 max_num_seqs=2" in settings
    assert "steps: vLLM's own, nothing written to the scheduler" in settings


@vllm_only
@pytest.mark.vllm
@pytest.mark.parametrize(
    ("op", "named"),
    [
        (Step(("a",), 8), "held but not named: ['b', 'c']"),
        (Step(("a", "b", "c"), 4), "step with budget 4"),
        (Step(("c", "b", "a"), 8), "step over ['c', 'b', 'a']"),
        (Preempt("a"), "preempt a"),
    ],
    ids=["a subset", "another budget", "another order", "a preemption"],
)
def test_a_steered_operation_is_refused_by_the_engine_naming_it(op: object, named: str) -> None:
    """The engine target refuses a step it cannot run (one line: kvretain's refusal, naming
    the step, not vLLM's defect), and vLLM is left as it was: the control, the engine's own
    step from the same state, runs clean."""
    checker = drive("vllm", CAPPED)
    if isinstance(op, Preempt):
        assert checker.step(engine_step(checker.model, 8)) == []
    found = checker.step(op)  # type: ignore[arg-type]
    assert [v.check for v in found] == [REFUSED]  # kvretain's refusal, not a crash of vLLM's
    assert "SteeredStep" in found[0].message and named in found[0].message
    control = drive("vllm", CAPPED)
    if isinstance(op, Preempt):  # a computed its prompt: it runs on with a sampled token
        assert control.step(engine_step(control.model, 8)) == [] and control.step(Sample("a", 1)) == []
    assert control.step(engine_step(control.model, 8)) == []
    assert "steps: vLLM's own, nothing written to the scheduler" in control.target.engine_settings()


@vllm_only
@pytest.mark.vllm
def test_the_event_publisher_is_the_capture_from_construction() -> None:
    """The scheduler's publisher is kvretain's capture as built; vLLM's factory is itself again after."""
    from vllm.distributed.kv_events import EventPublisherFactory

    from invariants.targets.vllm_scheduler_build import EventCapture

    checker = drive("vllm", FULL)
    assert isinstance(checker.target.vllm_scheduler.kv_event_publisher, EventCapture)  # type: ignore[attr-defined]
    assert not isinstance(EventPublisherFactory.create(None), EventCapture)


@vllm_only
@pytest.mark.vllm
@pytest.mark.parametrize("planted", [False, True], ids=["as released", "finished left in running"])
def test_a_finished_request_left_in_running_is_read_from_vllms_own_queue(planted: bool) -> None:
    """A scheduler that leaves a finished request in `running` (planted in
    `Scheduler.finish_requests`) is reported from vLLM's own queue, which no step rewrites:
    the queue check after the finish, and the next engine step finds vLLM holding a request
    the client finished. The control: as released, the same trace is clean."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.finish_requests

    def keep_running(
        self: Scheduler, request_ids: object, status: object, *args: object, **kw: object
    ) -> object:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)  # type: ignore[call-overload]
        running = [r for r in self.running if r.request_id in ids]
        result = original(self, request_ids, status, *args, **kw)  # type: ignore[arg-type]
        self.running.extend(r for r in running if r not in self.running)
        return result

    with pytest.MonkeyPatch.context() as mp:
        if planted:
            mp.setattr(Scheduler, "finish_requests", keep_running)
        checker = drive("vllm", CAPPED)
        assert checker.step(engine_step(checker.model, 8)) == []
        found = checker.step(Finish("a"))
        nxt = [v.check for v in checker.step(engine_step(checker.model, 8))]
    if not planted:
        assert found == [] and nxt == []
        return
    assert "scheduler_queues_consistent" in [v.check for v in found]
    assert any("a is in running though it finished" in v.message for v in found)
    assert nxt  # the engine's next step holds a request the client finished


@vllm_only
@pytest.mark.vllm
def test_replay_runs_a_trace_without_a_budget_on_the_engines_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trace stating no budget runs on "vllm" as the engine's own steps, built with
    `build_budget`: a step over every held request, with the built budget or one that does
    not bind, replays clean. Control: a step over a subset (what a directed driver ran) is
    refused as `SteeredStep`, naming the request left out, and `kvretain replay` prints it
    in one line and exits 1."""
    from invariants.cli.main import main
    from invariants.harness.replay import replay
    from invariants.harness.trace import Trace, write_trace

    adds = [AddRequest(rid, (i + 1,) * 5) for i, rid in enumerate(("a", "b"))]
    for budget in (build_budget(FULL), 16):  # 10 tokens scheduled: 16 does not bind
        assert replay(Trace(FULL, [*adds, Step(("a", "b"), budget)], 0, "vllm"), "vllm").clean
    subset = Trace(FULL, [*adds, Step(("b",), 8)], 0, "vllm")
    result = replay(subset, "vllm")
    assert [(i, v.check) for i, v in result.violations] == [(2, REFUSED)]
    assert "SteeredStep" in result.violations[0][1].message
    assert "held but not named: ['a']" in result.violations[0][1].message
    path = write_trace(subset, tmp_path / "subset.json")
    assert main(["replay", str(path), "--target", "vllm"]) == 1
    assert "op 2: refused: SteeredStep: step over ['b']" in capsys.readouterr().out
