"""vLLM's real `Scheduler` driving its allocator ("vllm") against the model.

Scripted traces of engine steps (every request vLLM holds, in its order, with the budget
it was built with: `engine_drive_steps`): admission with a hit, chunked prefill, samples
delivered by `update_from_output`, preemption under pool pressure, finish, reset; each
must give, after every operation, the model's observation and snapshot; the fuzzer sends
real-scheduler targets whole steps; a short fuzz run is clean. Negative controls: every zoo mutant of vLLM's scheduler
(`invariants.zoo.mutants_scheduler`) is caught on a trace the unmutated
scheduler passes. Skipped, with the reason,
when vLLM cannot be imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from invariants.targets.vllm_env import vllm_available

_OK, _REASON = vllm_available()
if not _OK:
    pytest.skip(f"vllm target: {_REASON}", allow_module_level=True)

from drive import Drive  # noqa: E402
from engine_drive_steps import engine_step, engine_steps  # noqa: E402

from invariants.harness.fuzz import format_features, run_fuzz  # noqa: E402
from invariants.targets import target_factory  # noqa: E402
from invariants.targets.vllm_scheduler_build import SchedulerUnsupported  # noqa: E402
from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget  # noqa: E402
from invariants.zoo.mutants_scheduler import SCHEDULER_MUTANTS, activate  # noqa: E402
from model.contract.config import Config, GroupSpec  # noqa: E402
from model.contract.ops import (  # noqa: E402
    AddRequest,
    Finish,
    Loaded,
    Offer,
    Op,
    Probe,
    ResetPrefixCache,
    Sample,
    Schedule,
    Step,
)

pytestmark = pytest.mark.vllm

FULL_SWA = Config(
    groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=5)),
    num_blocks=20,
    retention_interval=0,
    max_model_len=4096,
)
FULL_MAMBA = Config(
    groups=(GroupSpec("full", 4), GroupSpec("mamba", 4)),
    num_blocks=24,
    retention_interval=0,
    max_model_len=4096,
)
PROMPT = (1, 2, 3) * 6
# Built with 8 tokens a step (chunked prefill) and a pool two growing requests outgrow.
LIFECYCLE = FULL_SWA.with_(num_blocks=12, max_num_batched_tokens=8)


def lifecycle(cfg: Config, factory: type[VllmSchedulerTarget] = VllmSchedulerTarget) -> Drive:
    """Engine steps of 8 tokens: r0 chunked, r1 admitted on r0's cached blocks beside it and
    preempted by r0's growth; r0 finishes, r2 arrives with a hit, r1 resumes, then r2 is
    preempted by the pool; all finish and the prefix cache is reset."""
    d = Drive(cfg, factory).do(AddRequest("r0", PROMPT), AddRequest("r1", (*PROMPT, 1)))
    engine_steps(d, 6).do(Finish("r0"), Probe(PROMPT), AddRequest("r2", PROMPT))
    return engine_steps(d, 4).do(Finish("r1"), Finish("r2"), ResetPrefixCache())


def test_lifecycle_agrees_with_the_model() -> None:
    d = lifecycle(LIFECYCLE)
    assert d.found == []
    assert d.preempted == ["r1", "r2"], "the pool no longer preempts: the trace checks no preemption"
    assert d.checker.target.vllm_scheduler.requests == {}  # type: ignore[attr-defined]


def test_samples_ride_on_update_from_output() -> None:
    """A sample is delivered by the next step's `update_from_output`, not before."""
    target = VllmSchedulerTarget(FULL_SWA)
    target.apply(AddRequest("r0", (1, 2, 3)))
    target.apply(Step(("r0",), 8))
    target.apply(Sample("r0", 7))
    assert target.requests["r0"].num_tokens == 3  # waits for the model runner's output
    target.apply(Step(("r0",), 8))
    assert list(target.requests["r0"].all_token_ids) == [1, 2, 3, 7]


def test_a_late_sample_rides_on_its_own_steps_output() -> None:
    """The worker's report of r1's async load is processed between r0's last chunk and
    r0's sample (the engine then owes no step first): r0's share of its step's output
    waits (still in flight) and its sample delivers it. Then engine steps in a pool too
    small for both preempt r0, and r1 finishes."""
    cfg = FULL_SWA.with_(num_blocks=9, max_num_batched_tokens=8, kv_connector=True)
    d = Drive(cfg).do(AddRequest("r0", (1, 2, 3)), AddRequest("r1", PROMPT), Offer("r1", 16, "async"))
    engine_step(d).do(Loaded("r1", True))
    target = d.checker.target
    assert target.requests["r0"].num_in_flight_tokens == 3
    d.do(Sample("r0", 7))
    assert list(target.requests["r0"].all_token_ids) == [1, 2, 3, 7]
    assert target.requests["r0"].num_in_flight_tokens == 0
    engine_steps(d, 4).do(Finish("r1"))
    assert d.found == []
    assert d.preempted == ["r0"]


def test_a_reused_id_gets_none_of_the_finished_requests_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """r4 is sampled and finished before the step that would deliver its output, and a
    new r4 with the same prompt arrives: the finished request's share (and its token) is
    not delivered to the new one (vLLM delivers it before the finish). Negative control:
    with the stale share delivered, the new r4 gains the old token and the model disagrees.
    (The zoo's soundness check found this: a shrunk trace that failed unmutated vLLM too.)"""
    from invariants.targets.vllm_scheduler_drive import RealStepScheduler

    prompt = (2, 3, 3, 2, 2, 2, 3, 3, 2, 3, 2, 1, 1, 1, 1)
    ops = [
        AddRequest("r4", prompt),
        Step(("r4",), 64),
        Sample("r4", 1),
        Finish("r4"),
        AddRequest("r4", prompt),
    ]
    cfg = Config(groups=(GroupSpec("full", 4),), num_blocks=15, max_model_len=4096)
    assert Drive(cfg).do(*ops, Step(("r4",), 64)).found == []
    monkeypatch.setattr(RealStepScheduler, "add", lambda self, req: self.sched.add_request(req))
    assert Drive(cfg).do(*ops, Step(("r4",), 64)).found != []


def test_a_request_vllm_still_holds_cannot_be_added_again() -> None:
    """Finished while its async load is in flight, r1 stays in vLLM's requests until the
    load reports: adding r1 again is not a valid operation (vLLM raises), so no trace
    (shrunk, explored) may contain it."""
    from invariants.harness.checker import InvalidOp

    cfg = Config(groups=(GroupSpec("full", 4),), num_blocks=19, max_model_len=4096, kv_connector=True)
    prompt = (2, 2, 2, 1, 2, 3, 2, 1, 2, 2)
    d = Drive(cfg).do(AddRequest("r1", prompt), Offer("r1", 10, "async"), Step(("r1",), 64), Finish("r1"))
    with pytest.raises(InvalidOp, match="has not reported"):
        d.do(AddRequest("r1", prompt))
    d.do(Loaded("r1", True), AddRequest("r1", prompt), Step(("r1",), 64))
    assert d.found == []


def test_preemption_inside_a_step_agrees() -> None:
    """A pool too small for two growing requests: the real scheduler preempts the newest."""
    d = Drive(FULL_SWA.with_(num_blocks=9)).do(
        AddRequest("r0", PROMPT[:7]), AddRequest("r1", PROMPT[::-1][:7])
    )
    d.steps(("r0", "r1"), 64, 8)
    assert d.found == []
    assert d.preempted, "the trace never preempted: it checks nothing about preemption"


def test_unbuildable_speculative_configurations_are_refused_with_the_reason() -> None:
    """Eagle without lookahead slots (vLLM's Eagle always drafts) is refused with its
    reason; speculative decoding itself, with a Mamba group too, is judged
    (tests/test_vllm_scheduler_spec.py)."""
    with pytest.raises(SchedulerUnsupported, match="drafts at least one token"):
        VllmSchedulerTarget(FULL_SWA.with_(eagle=True))


# Built with 6 tokens a step: a prefill chunk the Mamba split cuts to a block boundary (4).
FULL_MAMBA6 = FULL_MAMBA.with_(max_num_batched_tokens=6)


def test_schedule_is_a_step_of_one() -> None:
    """A `Schedule` of the one request vLLM holds is that engine's step (with the built budget,
    or one that does not bind: 64 over a one-token decode)."""
    d = Drive(FULL_MAMBA6).do(AddRequest("r0", PROMPT), *[Schedule("r0", 6)] * 5)
    d.do(Sample("r0", 1), Schedule("r0", 64))
    assert d.found == []
    assert d.checker.ops[1:] == [*[Step(("r0",), 6)] * 5, Sample("r0", 1), Step(("r0",), 64)]


def mamba_trace(factory: type[VllmSchedulerTarget] = VllmSchedulerTarget) -> Drive:
    """A Mamba prompt chunked under a budget of 6 (each chunk cut to a block boundary), decodes."""
    d = engine_steps(Drive(FULL_MAMBA6, factory).do(AddRequest("r0", PROMPT)), 7)
    return d.do(Finish("r0"), Probe(PROMPT))


def preemption_trace(factory: type[VllmSchedulerTarget] = VllmSchedulerTarget) -> Drive:
    d = Drive(FULL_SWA.with_(num_blocks=9), factory)
    d.do(AddRequest("r0", PROMPT[:7]), AddRequest("r1", PROMPT[::-1][:7]))
    return d.steps(("r0", "r1"), 64, 8)


def mamba_hit_trace(factory: type[VllmSchedulerTarget] = VllmSchedulerTarget) -> Drive:
    """A prompt cached by one request, then re-admitted with a hit and chunked past it."""
    d = Drive(FULL_MAMBA, factory).do(AddRequest("r0", PROMPT)).steps(("r0",), 64, 2).do(Finish("r0"))
    return d.do(AddRequest("r1", PROMPT + PROMPT[::-1])).steps(("r1",), 64, 3)


TRACE_FOR_MUTANT = {
    "mamba_split_ignores_hit": lambda f: mamba_hit_trace(f),
    "mamba_split_skipped": lambda f: mamba_trace(f),
    "preempt_keeps_computed_tokens": lambda f: lifecycle(LIFECYCLE, f),
    "preempt_oldest": lambda f: preemption_trace(f),
    "in_flight_tokens_not_settled": lambda f: lifecycle(LIFECYCLE, f),
}


def test_every_scheduler_mutant_has_a_trace() -> None:
    from test_vllm_scheduler_queues import QUEUE_TRACES  # the queue order a step leaves
    from test_vllm_scheduler_reach import REACH_TRACES  # the mutants of the scheduler's decisions

    # The speculative-decoding, KV-connector and long-prefill mutants have theirs in
    # tests/test_vllm_scheduler_spec.py, tests/test_vllm_connector.py (with a Mamba group:
    # tests/test_vllm_connector_mamba.py; with drafts: tests/test_vllm_connector_spec.py) and
    # tests/test_long_prefill.py.
    elsewhere = (
        "scheduler-spec",
        "scheduler-connector",
        "scheduler-connector-one-group",
        "scheduler-connector-mamba",
        "scheduler-connector-fine",
        "scheduler-connector-spec",
        "scheduler-long-prefill",
    )
    assert set(TRACE_FOR_MUTANT) | set(REACH_TRACES) | set(QUEUE_TRACES) >= {
        n for n, m in SCHEDULER_MUTANTS.items() if m.strategy not in elsewhere
    }
    assert set(TRACE_FOR_MUTANT) | set(REACH_TRACES) <= set(SCHEDULER_MUTANTS)
    assert set(QUEUE_TRACES) <= set(SCHEDULER_MUTANTS)


@pytest.mark.parametrize("name", sorted(TRACE_FOR_MUTANT))
def test_scheduler_mutant_is_caught(name: str) -> None:
    """Negative controls: each zoo mutant of vLLM's `Scheduler` (a one-line defect of
    `scheduler.py`) is caught on a trace the unmutated scheduler passes."""
    assert TRACE_FOR_MUTANT[name](VllmSchedulerTarget).found == []
    with activate(name) as factory:
        assert TRACE_FOR_MUTANT[name](factory).found != []


def test_fuzzer_sends_real_schedulers_whole_steps(tmp_path: Path) -> None:
    """A short generated run is clean, and every scheduling operation it sent was a `Step`."""
    sent: list[Op] = []
    factory = target_factory("vllm")

    def recording(cfg: Config) -> VllmSchedulerTarget:
        target = factory(cfg)
        apply = target.apply

        def apply_and_record(op: Op):  # type: ignore[no-untyped-def]
            sent.append(op)
            return apply(op)

        target.apply = apply_and_record  # type: ignore[method-assign]
        return target  # type: ignore[return-value]

    report = run_fuzz("vllm", steps=300, seed=3, out_dir=tmp_path, progress=False, factory=recording)
    assert report.failure is None, report.failure
    # What the run left out is stated with its count (0 examples) and reason.
    assert "not generated (0 examples)" in format_features([report])
    assert "Eagle / MTP without lookahead slots" in format_features([report])
    assert any(isinstance(op, Step) for op in sent)
    assert not any(isinstance(op, Schedule) for op in sent)


def test_known_findings_reproduce_through_the_real_scheduler() -> None:
    """Every known vLLM finding of the installed release whose trace the real scheduler can
    run (no speculative decoding) reproduces on vllm; the others are named."""
    from invariants.harness.known_findings import explain, load_known_findings, target_version
    from invariants.harness.replay import replay

    version = target_version("vllm")
    ran, refused, async_only = [], [], []
    for f in load_known_findings():
        if "vllm-manager" not in f.targets or ("*" not in f.versions and version not in f.versions):
            continue
        if f.trace.target == "vllm-async-scheduler":
            async_only.append(f.id)  # tests/test_vllm_async_connector.py: clean here, found there
            continue
        if f.trace.config.eagle or f.trace.config.num_lookahead_tokens:
            refused.append(f.id)  # tests/test_vllm_scheduler_spec.py replays these
            continue
        result = replay(f.trace, "vllm")
        assert any(explain("vllm", v) is f for _, v in result.known), f.id
        assert result.clean, (f.id, result.violations[:1])
        ran.append(f.id)
    assert "vllm-blockstored-token-range" in ran
    assert "eagle-swa-short-run-double-pop" in refused
    assert async_only == ["async-load-cut-keeps-placeholders"]


def test_a_schedule_is_judged_as_the_step_a_real_scheduler_runs() -> None:
    """A `Schedule` (explore's alphabet writes them) reaches a real scheduler as a
    one-request step, which may preempt the request itself; the Checker sends the model
    that step too. Control: the model's own `Schedule` (no preemption) disagrees with
    vLLM there, which once made explore's shorter traces fail on unmutated vLLM."""
    from model.machine.allocator import AllocatorModel

    cfg = Config(
        groups=(GroupSpec("full", 4), GroupSpec("mamba", 8)),
        num_blocks=7,
        retention_interval=24,
        hash_block_size=2,
        max_model_len=4096,
        kv_connector=True,
    )
    prompt = (1, 2, 1, 1, 2, 2, 1, 2, 2, 1, 1, 1, 2, 1, 2, 2, 1)
    ops = [AddRequest("r00", prompt), Schedule("r00", 64), Schedule("r00", 8)]
    d = Drive(cfg).do(*ops)
    assert d.found == [] and d.checker.ops[1:] == [Step(("r00",), 64), Step(("r00",), 8)]
    from invariants.harness.checker import diff_snapshots

    model, target = AllocatorModel(cfg), VllmSchedulerTarget(cfg)
    for op in ops:
        model.apply(op), target.apply(op)
    assert any("tables[r00]" in line for line in diff_snapshots(model.snapshot(), target.snapshot()))
