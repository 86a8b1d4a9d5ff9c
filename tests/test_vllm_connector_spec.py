"""KV connectors with speculative decoding: the model's contract (`model.machine.connector`,
"With speculative decoding") and vLLM's real `Scheduler` judged against it.

Model tests need no vLLM: an async load's admission reserves no lookahead and
leaves one decode step's slots free, the in-flight prefills' reserve counts that
step, the chunk after a load is padded (and, padded past the budget, ends the
step unseen), external tokens count as a hit for the padding, a sample delivers
its output, a cut request keeps its prefill flag. Each rule has a control: the
same trace without drafts, or a pool one block larger. The vLLM tests drive the
same traces (every observation and snapshot must agree, known findings aside),
replay a regression trace for `step_blocks_stay_held`, and run the zoo's mutants
of this combination as negative controls.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from drive import Drive, Factory, check_contexts, own, patched

from invariants.harness.checker import Checker, Violation
from invariants.harness.observer import ModelObserver
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, GroupSpec
from model.contract.observation import LoadCut, Queues, ScheduleResult, StepResult
from model.contract.ops import AddRequest, Finish, Loaded, Offer, Op, Sample, Save, Step
from model.machine.allocator import AllocatorModel
from model.machine.connector import remaining_blocks, spec_step_blocks
from model.policy.spec_decode import PLACEHOLDER

K = 2  # drafts per step (a draft model: num_speculative_tokens = num_lookahead_tokens = 2)
FULL = Config(
    groups=(GroupSpec("full", 4),),
    num_blocks=16,
    max_model_len=4096,
    kv_connector=True,
    num_lookahead_tokens=K,
)
NO_DRAFTS = FULL.with_(num_lookahead_tokens=0)
PROMPT = tuple(range(1, 14))  # 13 tokens
DATA = Path(__file__).parent / "data"

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")


def model(cfg: Config, observer: ModelObserver | None = None) -> AllocatorModel:
    """The model as the checker builds it for a real scheduler (drafts = lookahead)."""
    return AllocatorModel(cfg, num_spec_tokens=cfg.num_lookahead_tokens, observer=observer)


# ------------------------------------------------------------------ traces (model and vLLM)
def promoted_ops(budget: int = 64) -> list[Op]:
    """r0 (13 tokens) loads its first 12 async, then takes its last token."""
    return [AddRequest("r0", PROMPT), Offer("r0", 13, "async"), Step(("r0",), 64), Loaded("r0", True)] + [
        Step(("r0",), budget)
    ]


def reserve_ops() -> list[Op]:
    """An async load of 3 blocks (12 external tokens) with nothing in flight."""
    return [AddRequest("r0", PROMPT), Offer("r0", 13, "async"), Step(("r0",), 64)]


def sync_pad_ops() -> list[Op]:
    """A 2-token prompt whose first token a sync load supplies: one token to compute."""
    return [AddRequest("r0", (3, 3)), Offer("r0", 14, "sync"), Step(("r0",), 8)]


UNSEEN = FULL.with_(max_num_batched_tokens=3)  # an engine built with 3 tokens a step


def unseen_ops() -> list[Op]:
    """On `UNSEEN`: r4's async load starts, then r5 (one token) is admitted beside it; the
    promoted r4 needs 1 + K tokens padded: the step has 2 left after r5's decode, then 3
    once r5 is finished."""
    return [
        AddRequest("r4", (2, 2)),
        Offer("r4", 5, "async"),
        Step(("r4",), 3),
        AddRequest("r5", (7,)),
        Step(("r4", "r5"), 3),
        Loaded("r4", True),
        Sample("r5", 8),
        Step(("r5", "r4"), 3),
        Finish("r5"),
        Step(("r4",), 3),
    ]


def cut_flag_ops() -> list[Op]:
    """r0 computes its 8 prompt tokens and, after it in the step, r1 hits r0's two blocks
    and loads one more async; r0 is sampled. r1's load fails on the first shared block,
    which cuts r0 to 0 while its prefill flag stays as its last step set it (False);
    r2's one-token admission after r0's recompute chunk is then padded."""
    r1 = tuple(range(1, 9)) + (20, 21, 22, 23, 24)
    return [
        AddRequest("r0", tuple(range(1, 9))),
        AddRequest("r1", r1),
        Offer("r1", 12, "async"),
        Step(("r0", "r1"), 64),
        Sample("r0", 9),
    ]


SWA_FINISH = Config(
    groups=(
        GroupSpec("full", 8),
        GroupSpec("swa", 2, sliding_window=5),
        GroupSpec("swa", 2, sliding_window=3),
    ),
    num_blocks=26,
    enable_caching=False,
    max_model_len=4096,
    max_num_batched_tokens=8,
    num_lookahead_tokens=1,
    kv_connector=True,
)
SWA_FINISH_OPS: list[Op] = [
    AddRequest("r2", (3, 1, 2, 2, 1, 1, 2, 3, 1, 2, 3, 2, 2, 1, 1, 2, 3, 1, 3, 3, 3, 1, 2, 1, 1, 1)),
    *[Step(("r2",), 8)] * 4,
    Sample("r2", 1),
    Save("r2"),
    Finish("r2"),
]


# ------------------------------------------------------------------ the contract, on the model
def test_the_spec_step_reserve_counts_every_group_but_mamba() -> None:
    cfg = Config(
        groups=(GroupSpec("full", 4), GroupSpec("swa", 8, sliding_window=5), GroupSpec("mamba", 4)),
        num_blocks=30,
        kv_connector=True,
        num_lookahead_tokens=K,
    )
    # cdiv(1 + 2 + 2, 4) + cdiv(5, 8); the Mamba group counts its draft blocks itself.
    assert spec_step_blocks(model(cfg)) == 2 + 1
    assert spec_step_blocks(AllocatorModel(cfg)) == 0  # no drafts: no reserve


def test_remaining_blocks_count_a_decode_step_past_the_sequence() -> None:
    assert remaining_blocks(13, [4], [1]) == 3
    assert remaining_blocks(13, [4], [1], spec_tokens=5) == 4  # cdiv(18, 4) - 1
    # A Mamba group (align) ignores the tokens and counts its draft blocks past its state.
    assert remaining_blocks(13, [4], [4], [True]) == 0
    assert remaining_blocks(13, [4], [4], [True], [], 5, [2]) == 1


def test_an_async_load_reserves_no_lookahead_and_its_chunk_is_padded() -> None:
    m = model(FULL, observer=(m_seen := ModelObserver()))
    obs = [m.apply(op) for op in promoted_ops()]
    assert own(obs[2], "r0").external == 12
    # At admission: the 12 external tokens' 3 blocks, no lookahead (it would be 4).
    m2 = model(FULL)
    for op in promoted_ops()[:3]:
        m2.apply(op)
    assert len(m2.snapshot().tables["r0"][0]) == 3
    # Promoted: its last token padded with K placeholders, the lookahead reserved.
    r = own(obs[-1], "r0")
    assert (r.scheduled, r.admitted, r.hit) == (1 + K, True, None)
    assert m.requests["r0"].verifying == (PLACEHOLDER,) * K
    assert len(m.snapshot().tables["r0"][0]) == 5  # cdiv(12 + 3 + 2, 4)
    assert m_seen.coverage["connector: promoted one-token chunk padded with draft slots"] == 1
    # Control: without drafts the chunk is its one token.
    m3 = AllocatorModel(NO_DRAFTS)
    assert own([m3.apply(op) for op in promoted_ops()][-1], "r0").scheduled == 1


def test_an_async_load_leaves_one_decode_step_free() -> None:
    """3 blocks to take, 2 reserved for the decode step (cdiv(5, 4)): 4 free refuse it, 5 admit it;
    without drafts 4 admit it."""
    for cfg, num_blocks, admitted in ((FULL, 5, False), (FULL, 6, True), (NO_DRAFTS, 5, True)):
        m = model(cfg.with_(num_blocks=num_blocks))
        obs = [m.apply(op) for op in reserve_ops()]
        assert (own(obs[-1], "r0").external == 12) is admitted, (cfg.num_lookahead_tokens, num_blocks)


def test_a_sync_loads_external_tokens_count_as_a_hit_for_the_padding() -> None:
    m = model(FULL)
    r = own([m.apply(op) for op in sync_pad_ops()][-1], "r0")
    assert (r.hit, r.external, r.scheduled) == (0, 1, 1 + K)
    # Control: without the offer the two tokens are a plain prefill.
    m2 = model(FULL)
    r2 = own([m2.apply(op) for op in (sync_pad_ops()[0], sync_pad_ops()[2])][-1], "r0")
    assert r2.scheduled == 2


def test_a_padded_chunk_past_the_budget_ends_the_step_unseen() -> None:
    m = model(UNSEEN)
    obs = [m.apply(op) for op in unseen_ops()[:8]]
    # No lookup, no allocation for r4: nothing of it to observe but the queues, r4 staying where it was.
    assert obs[7] == StepResult(
        (("r5", ScheduleResult(1, False, new_blocks=((),))),), (), queues=Queues(("r5",), ("r4",), ())
    )
    assert not m.requests["r4"].running and m.requests["r4"].holding
    assert own([m.apply(op) for op in unseen_ops()[8:]][-1], "r4").scheduled == 1 + K


def test_a_sample_delivers_its_output() -> None:
    m = model(SWA_FINISH)
    for op in SWA_FINISH_OPS[:5]:
        m.apply(op)
    assert m.undelivered == {"r2": 2}
    m.apply(SWA_FINISH_OPS[5])
    assert m.undelivered == {}
    # Control: without drafts the output waits for the next step.
    m2 = AllocatorModel(SWA_FINISH)
    for op in SWA_FINISH_OPS[:6]:
        m2.apply(op)
    assert m2.undelivered == {"r2": 2}


def riding_samples_ops(drafts: bool = True, accepted: int = 1, policy: str = "fail") -> list[Op]:
    """r2 decodes (verifying two drafts with `drafts`); a step runs it with r0's sync load
    (12 external tokens) and r1 hitting r0's blocks; r2 and r1 are sampled (r2 accepting
    `accepted` drafts of two), their tokens riding on the step's output, which reports
    r0's second block failed: r0 is cut to 4, r1 back to its hit (12), both end under
    "fail"; r2 goes on, its rejected drafts rolled back as the output is processed. The
    engine's steps after the report run every request left: under `policy` "recompute"
    r0 and r1 too (the operations up to the report are the same under both policies)."""
    second = 6 if drafts else 5  # r0's blocks follow r2's (4 with drafts, 3 without)
    ops: list[Op] = [
        AddRequest("r2", tuple(range(60, 69))),
        Step(("r2",), 64),
        Sample("r2", 70, 0, (71, 72)) if drafts else Sample("r2", 70),
        AddRequest("r0", PROMPT),
        AddRequest("r1", (*PROMPT[:12], 99)),
        Offer("r0", 12, "sync"),
        Step(("r2", "r0", "r1"), 64),
        Sample("r2", 73, accepted, (74,)) if drafts else Sample("r2", 73),
        Sample("r1", 5),
        Loaded("r0", True, (second,)),
    ]
    if policy == "fail":
        return [
            *ops,
            Step(("r2",), 64),
            Sample("r2", 75),
            AddRequest("r3", tuple(range(100, 140))),
            Step(("r2", "r3"), 64),
        ]
    ops += [Step(("r2", "r0", "r1"), 64), Sample("r2", 75), Sample("r0", 76), Sample("r1", 77)]
    return [*ops, AddRequest("r3", tuple(range(100, 140))), Step(("r2", "r0", "r1", "r3"), 64)]


def test_a_sample_riding_on_a_sync_loads_report_waits_for_it() -> None:
    """With drafts a sample's output is processed at once (`test_a_sample_delivers_its_output`),
    but after a step that ran a sync load it rides on that step's output with the load's
    report: its blocks are cached once the report's turn is over, after the cut."""
    ops = riding_samples_ops(accepted=2)
    m = model(FULL.with_(num_blocks=40))
    for op in ops[:7]:
        m.apply(op)
    m.snapshot()  # the step's events
    m.apply(ops[7])
    assert m.undelivered["r2"] == 1 + K and m.sync_report is not None
    assert m.sync_report.waiting == (("r2", 3, 0),)
    assert not m.snapshot().events  # r2's third block, full now, waits to be cached
    m.apply(AddRequest("r9", (1,)))  # the report's turn is over: the output is processed
    assert "r2" not in m.undelivered and len(m.snapshot().events) == 1
    # Control: the report itself processes it, after the cut.
    c = model(FULL.with_(num_blocks=40))
    for op in ops[:9]:
        c.apply(op)
    c.apply(ops[9])
    assert "r2" not in c.undelivered and c.snapshot().events


def test_a_cut_request_keeps_its_prefill_flag() -> None:
    m = model(FULL)
    for op in cut_flag_ops():
        m.apply(op)
    first = m.snapshot().tables["r0"][0][0]
    m.apply(Loaded("r1", True, (first,)))
    assert m.requests["r0"].num_computed == 0 and not m.requests["r0"].prefill_chunk
    m.apply(AddRequest("r2", (5,)))
    obs = m.apply(Step(("r0", "r1", "r2"), 64))  # r1, cut too, re-admitted between them
    assert own(obs, "r0").scheduled == 9 and own(obs, "r2").scheduled == 1 + K


# ------------------------------------------------------------------ vLLM's Scheduler agrees
def judged(cfg: Config, ops: list[Op], factory: Factory | None = None) -> list[Violation]:
    """Every operation of `ops` through the vllm target (or `factory`) against the model,
    then a last audit (all it finds counts)."""
    d = Drive(cfg, factory).attempt(*ops)  # a mutant may change a request's state under the trace
    return d.found + d.checker.audit()


def with_cut(cfg: Config) -> list[Op]:
    m = model(cfg)
    for op in cut_flag_ops():
        m.apply(op)
    first = m.snapshot().tables["r0"][0][0]
    return [
        *cut_flag_ops(),
        Loaded("r1", True, (first,)),
        AddRequest("r2", (5,)),
        Step(("r0", "r1", "r2"), 64),
    ]


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize(
    "case",
    [
        "promoted",
        "promoted-eagle",
        "reserve-refused",
        "reserve-admitted",
        "sync-pad",
        "unseen",
        "finish",
        "cut",
    ],
)
def test_vllm_agrees(case: str) -> None:
    cfg, ops = {
        "promoted": (FULL, promoted_ops()),
        "promoted-eagle": (FULL.with_(eagle=True), promoted_ops()),
        "reserve-refused": (FULL.with_(num_blocks=5), reserve_ops()),
        "reserve-admitted": (FULL.with_(num_blocks=6), reserve_ops()),
        "sync-pad": (FULL, sync_pad_ops()),
        "unseen": (UNSEEN, unseen_ops()),
        "finish": (SWA_FINISH, SWA_FINISH_OPS),
        "cut": (FULL, with_cut(FULL)),
    }[case]
    assert judged(cfg, ops) == []


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("accepted", [1, 2])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_vllm_agrees_on_samples_with_drafts_riding_on_a_sync_loads_report(policy: str, accepted: int) -> None:
    cfg = FULL.with_(num_blocks=40, kv_load_failure_policy=policy)  # type: ignore[arg-type]
    d = Drive(cfg).do(*riding_samples_ops(accepted=accepted, policy=policy))
    assert d.audited() == []
    cut = d.seen[9]
    assert isinstance(cut, LoadCut) and cut.num_computed == 4
    assert cut.others == ((("r1", 12),) + ((("r2", 11),) if accepted == 1 else ()))  # r2's rollback
    assert sorted(cut.ended) == (["r0", "r1"] if policy == "fail" else [])


@needs_vllm
@pytest.mark.vllm
def test_control_a_riding_sample_processed_at_once_disagrees_with_vllm() -> None:
    import model.machine.failed_blocks as fb

    cfg = FULL.with_(num_blocks=40)
    with patched(fb, "output_waits", lambda m, req, accepted, rejected: False):
        found = Drive(cfg).attempt(*riding_samples_ops(accepted=2)).found
    assert any(v.check == "snapshot" for v in found), found


@needs_vllm
@pytest.mark.vllm
def test_control_a_cut_on_the_rolled_back_count_disagrees_with_vllm() -> None:
    import model.machine.connector as connector

    original = connector._sync_cut

    def rolled_back(m: AllocatorModel, rid: str, invalid: Any, report: Any, riders: Any) -> Any:
        return original(m, rid, invalid, report, {})

    cfg = FULL.with_(num_blocks=40)
    with patched(connector, "_sync_cut", rolled_back):
        found = Drive(cfg).attempt(*riding_samples_ops(accepted=1)).found
    assert any("LoadCut" in v.message for v in found), found


@needs_vllm
@pytest.mark.vllm
def test_a_request_readmitted_after_a_failed_load_resumes_from_its_hit() -> None:
    """Regression (the conformance row flagged unmutated vLLM): r1's async load fails
    ('recompute'), its blocks (a Mamba external state and its draft blocks) are freed and it
    is admitted afresh on r0's hit; `step_blocks_stay_held` had judged it by the draft
    states it held before the step. Control: the same step judged as a promoted chunk
    (no lookup) is flagged."""
    from invariants.catalogue import BY_NAME
    from invariants.harness.replay import replay
    from invariants.harness.trace import read_trace
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    trace = read_trace(DATA / "connector_spec_failed_load_readmitted_mamba.json")
    assert replay(trace, "vllm").violations == []
    with check_contexts(copy_history=True) as contexts:
        checker = Checker(VllmSchedulerTarget(trace.config))
        for op in trace.ops:
            checker.step(op)
    ctx = contexts[-1]
    assert isinstance(ctx.obs, StepResult) and ctx.draft_blocks
    check = BY_NAME["step_blocks_stay_held"].check
    assert check(ctx) == []
    promoted = StepResult(tuple((rid, replace(r, hit=None)) for rid, r in ctx.obs.results))
    assert check(replace(ctx, obs=promoted)) != []


SPEC_CONNECTOR_MUTANTS = ("async_load_ignores_spec_step_reserve", "async_load_reserves_lookahead")


@needs_vllm
@pytest.mark.vllm
def test_every_connector_spec_mutant_is_here() -> None:
    from invariants.zoo.mutants_scheduler import SCHEDULER_MUTANTS

    assert {n for n, m in SCHEDULER_MUTANTS.items() if m.strategy == "scheduler-connector-spec"} == set(
        SPEC_CONNECTOR_MUTANTS
    )


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("name", SPEC_CONNECTOR_MUTANTS)
def test_connector_spec_mutant_is_caught(name: str) -> None:
    """Negative controls: each mutant is caught on a trace the unmutated scheduler passes."""
    from invariants.zoo.mutants_scheduler import activate

    cases = {
        "async_load_ignores_spec_step_reserve": (FULL.with_(num_blocks=5), reserve_ops()),
        "async_load_reserves_lookahead": (FULL, promoted_ops()),
    }
    cfg, ops = cases[name]
    assert judged(cfg, ops) == []
    with activate(name) as factory:
        assert judged(cfg, ops, factory) != []


# ------------------------------------------------------------------ fitting_request_admitted with external tokens
def test_a_mamba_external_state_block_counts_for_liveness() -> None:
    """Regression (the model target's fuzz, a connector with lookahead slots): r2's sync
    load needs a Mamba external state block besides its chunk's state, 11 blocks in all,
    so an idle pool of 10 refuses it; `fitting_request_admitted` had counted 10. Control:
    the same refusal judged against an idle pool of 11 is flagged."""
    from invariants.catalogue import BY_NAME
    from invariants.harness.replay import replay
    from invariants.harness.trace import read_trace
    from invariants.targets.model_target import ModelTarget

    trace = read_trace(DATA / "connector_lookahead_mamba_sync_admission.json")
    assert replay(trace, "model").violations == []
    with check_contexts() as contexts:
        checker = Checker(ModelTarget(trace.config))
        for op in trace.ops:
            assert checker.step(op) == [], op
    ctx = contexts[-1]
    assert isinstance(ctx.obs, ScheduleResult) and not ctx.obs.admitted and ctx.obs.hit is not None
    check = BY_NAME["fitting_request_admitted"].check
    assert check(ctx) == []
    assert check(replace(ctx, config=ctx.config.with_(num_blocks=12))) != []


@needs_vllm
def test_a_sync_loads_own_sample_rides_on_its_report_and_vllm_drops_it() -> None:
    """A request sampled after the step that ran its sync load, then the load's report
    naming a failed block: the sample rides on the report's output and vLLM skips it,
    as the model states (`LoadCut.dropped`). `kvretain explore --target vllm` found the
    adapter withholding that token from vLLM (so the drop was never observed); the
    control withholds it again and the two sides disagree."""
    from invariants.harness.replay import replay
    from invariants.harness.trace import read_trace
    from invariants.targets.vllm_scheduler_drive import RealStepScheduler

    trace = read_trace(Path(__file__).parent / "data" / "sync_load_own_sample_dropped.json")
    assert replay(trace, "vllm").clean
    deliver = RealStepScheduler.report_step

    def withholding(self: RealStepScheduler, rid: str, connector_output: object) -> None:
        self.samples.pop(rid, None)
        deliver(self, rid, connector_output)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RealStepScheduler, "report_step", withholding)
        assert not replay(trace, "vllm").clean


@needs_vllm
def test_only_the_scripted_load_failure_report_is_silenced() -> None:
    """The scheduler's error line for a failure kvretain scripted is dropped; any other
    record of the scheduler's logger passes."""
    import logging

    from invariants.targets.vllm_connector import ScriptedFailureLog

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("vllm.v1.core.sched.scheduler", logging.ERROR, __file__, 1, msg, (), None)

    drop = ScriptedFailureLog()
    assert not drop.filter(record("Failing %d request(s) due to KV load failure (failure_policy=fail)"))
    assert drop.filter(record("Unexpected: grammar rejected tokens %s for request %s."))
