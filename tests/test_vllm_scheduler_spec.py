"""Speculative decoding through vLLM's real `Scheduler` ("vllm") against the model.

The model's contract (`model.policy.spec_decode`): drafts scheduled and verified,
one-token admissions padded with placeholder drafts, rejected drafts rolled
back, blocks cached at the sample; the operation's JSON form. Scripted traces of
engine steps (Eagle and draft model, drafts accepted in full, in part and not at all,
cut by the budget the engine was built with, padding, preemption under pool pressure)
must give the model's observation and snapshot after every operation; a short
generated run is clean. A Mamba group
keeps its draft state blocks (`model.contract.mamba`). Negative controls: the zoo's
speculative-decoding mutants of vLLM's scheduler are each
caught on a trace the unmutated scheduler passes; drafts the target cannot
take are refused; the scheduler built with Mamba specs
that lack their draft blocks disagrees. The vLLM parts are skipped, with the reason, when vLLM
cannot be imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from drive import Drive, check_contexts
from engine_drive_steps import draft_steps, engine_step

from invariants.catalogue import CheckContext
from invariants.harness.checker import Checker, InvalidOp, Violation
from invariants.harness.observer import ModelObserver
from invariants.harness.strategies import configs
from invariants.targets.model_target import ModelTarget
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, GroupSpec
from model.contract.observation import StepResult
from model.contract.ops import AddRequest, Finish, Op, Probe, Sample, Step, op_from_json, op_to_json
from model.machine.allocator import AllocatorModel
from model.policy.spec_decode import PLACEHOLDER, acceptable, padded_admission, verified_drafts

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")

FULL_SWA_EAGLE = Config(
    groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=5)),
    num_blocks=30,
    retention_interval=0,
    eagle=True,
    num_lookahead_tokens=2,
    max_model_len=4096,
)
FULL_DRAFT_MODEL = Config(
    groups=(GroupSpec("full", 4),), num_blocks=30, num_lookahead_tokens=3, max_model_len=4096
)
PROMPT = (1, 2, 3) * 6


# ---------------------------------------------------------------- the contract, on the model alone
def test_contract_functions() -> None:
    assert acceptable((2, 3, 1)) == 3
    assert acceptable((2, PLACEHOLDER, 1)) == 1
    assert acceptable((PLACEHOLDER,) * 3) == 0
    # A decode step of 1 + 2 tokens verifies both drafts; a budget of 2 only the first.
    assert verified_drafts((5, 6), num_computed=9, num_tokens=10, scheduled=3) == (5, 6)
    assert verified_drafts((5, 6), num_computed=9, num_tokens=10, scheduled=2) == (5,)
    assert verified_drafts((5, 6), num_computed=9, num_tokens=10, scheduled=1) == ()
    assert padded_admission(1, 3, hit=16, ran_running=False, ran_prefill=False) == 3
    assert padded_admission(1, 3, hit=0, ran_running=True, ran_prefill=False) == 3
    assert padded_admission(1, 3, hit=0, ran_running=False, ran_prefill=False) == 0  # nothing ran, no hit
    assert padded_admission(1, 3, hit=16, ran_running=True, ran_prefill=True) == 0  # a prefill chunk ran
    assert padded_admission(2, 3, hit=16, ran_running=True, ran_prefill=False) == 0
    assert padded_admission(1, 0, hit=16, ran_running=True, ran_prefill=False) == 0  # no speculation


def _model(cfg: Config, k: int, observer: ModelObserver | None = None) -> AllocatorModel:
    return AllocatorModel(cfg, num_spec_tokens=k, observer=observer)


def test_model_verifies_rolls_back_and_caches_at_the_sample() -> None:
    m = _model(FULL_DRAFT_MODEL, 3)
    m.apply(AddRequest("r0", PROMPT))
    m.apply(Step(("r0",), 64))
    m.apply(Sample("r0", 1, 0, (2, 3, 1)))
    r = m.requests["r0"]
    assert (r.num_computed, r.num_tokens, r.drafts) == (18, 19, (2, 3, 1))
    step = m.apply(Step(("r0",), 64))
    assert isinstance(step, StepResult) and step.results[0][1].scheduled == 4  # 1 + 3 drafts
    # Slots for 18 + 4 tokens and 3 lookahead: 25 tokens, 7 blocks of 4.
    assert len(m.groups[0].tables["r0"]) == 7
    assert (r.num_computed, r.verifying) == (22, (2, 3, 1))
    cached_before = len(m.pool.cached)
    m.apply(Sample("r0", 2, 2, ()))  # two drafts accepted, one rejected
    assert r.outputs == [1, 2, 3, 2] and (r.num_computed, r.num_tokens) == (21, 22)
    assert len(m.groups[0].tables["r0"]) == 7  # rejection frees nothing
    assert len(m.pool.cached) == cached_before + 1  # block [16, 20) cached at the sample


def test_model_pads_a_one_token_admission_and_a_small_budget_waits() -> None:
    m = _model(FULL_DRAFT_MODEL, 3)
    m.apply(AddRequest("r0", PROMPT))
    m.apply(Step(("r0",), 64))
    m.apply(Finish("r0"))
    m.apply(AddRequest("r1", PROMPT[:17]))  # 16 tokens hit: one token left
    small = m.apply(Step(("r1",), 3))
    assert isinstance(small, StepResult) and not small.results[0][1].admitted  # 1 + 3 > 3
    step = m.apply(Step(("r1",), 64))
    assert isinstance(step, StepResult) and step.results[0][1].scheduled == 4
    r = m.requests["r1"]
    assert r.verifying == (PLACEHOLDER,) * 3 and r.awaits_sample
    m.apply(Sample("r1", 1))
    assert (r.num_computed, r.num_tokens) == (17, 18)


def test_model_without_speculation_pads_nothing() -> None:
    m = _model(FULL_DRAFT_MODEL, 0)
    m.apply(AddRequest("r0", PROMPT))
    m.apply(Step(("r0",), 64))
    m.apply(Finish("r0"))
    m.apply(AddRequest("r1", PROMPT[:17]))
    step = m.apply(Step(("r1",), 64))
    assert isinstance(step, StepResult) and step.results[0][1].scheduled == 1


def test_sample_json_round_trip_and_old_form() -> None:
    spec = Sample("r0", 2, 1, (3, 1))
    assert op_from_json(op_to_json(spec)) == spec
    plain = Sample("r0", 2)
    assert op_to_json(plain) == {"op": "sample", "rid": "r0", "token": 2}  # traces without drafts unchanged
    assert op_from_json({"op": "sample", "rid": "r0", "token": 2}) == plain
    for bad in ({"accepted": -1}, {"accepted": True}, {"drafts": [1, "x"]}, {"extra": 1}):
        with pytest.raises(ValueError):
            op_from_json({"op": "sample", "rid": "r0", "token": 2, **bad})


def test_drafts_are_refused_where_nothing_speculates() -> None:
    """Negative control for the checker: a target whose scheduler does not speculate
    (here the model as a target) cannot be sent drafts, nor accept more than were verified."""
    c = Checker(ModelTarget(FULL_DRAFT_MODEL))
    c.step(AddRequest("r0", PROMPT))
    c.step(Step(("r0",), 64))
    with pytest.raises(InvalidOp, match="does not speculate"):
        c.step(Sample("r0", 1, 0, (2,)))
    with pytest.raises(InvalidOp, match="does not speculate"):
        c.step(Sample("r0", 1, 1))


# ---------------------------------------------------------------- through vLLM's real scheduler
# (accepted, drafts) of the samples in turn: none, all, part of the verified drafts accepted.
DRAFT_PLAN = ((0, (2, 3)), (2, (3, 3)), (1, (1, 2)), (0, (1, 2)), (1, (2, 2)), (1, (3, 1)), (0, (1, 1)))


def eagle_trace(factory: object = None) -> Drive:
    """Engine steps of 5 tokens (a decode is 1 + 2 drafts): r0 chunks its prompt, then its
    drafts are accepted in full, in part, not at all; r1 arrives and is admitted on r0's
    blocks behind r0's decode, and once it decodes, its drafts are cut by what r0 left of
    the budget; the 20-block pool then preempts r1, dropping its drafts."""
    cfg = FULL_SWA_EAGLE.with_(num_blocks=21, max_num_batched_tokens=5)
    plan = list(DRAFT_PLAN * 5)
    d = draft_steps(Drive(cfg, factory).do(AddRequest("r0", PROMPT)), 7, plan)
    draft_steps(d.do(AddRequest("r1", PROMPT + (1,))), 12, plan)
    return d.do(Finish("r0"), Finish("r1"), Probe(PROMPT))


def prefill(d: Drive, rid: str) -> Drive:
    """Engine steps until `rid`, alone, has computed its prompt."""
    r = d.checker.model.requests[rid]
    while r.num_computed < r.num_tokens:
        engine_step(d)
    return d


def padding_trace(factory: object = None) -> Drive:
    """Draft model, engine steps of 7 tokens: one-token admissions padded (a full hit alone,
    and behind a decode), the 3 tokens a decode of 1 + 3 drafts leaves too small for the
    padding (r2 waits), drafts then accepted."""
    cfg = FULL_DRAFT_MODEL.with_(max_num_batched_tokens=7)
    d = prefill(Drive(cfg, factory).do(AddRequest("r0", PROMPT)), "r0")
    engine_step(d.do(Finish("r0"), AddRequest("r1", PROMPT[:17])))
    engine_step(d.do(Sample("r1", 1, 0, (1, 2, 3)), AddRequest("r2", PROMPT[:13])))
    engine_step(d.do(Sample("r1", 1, 3, (2,))))
    engine_step(d.do(Sample("r1", 1, 0, ()), Sample("r2", 1, 0, (1, 1))))
    return d.do(Finish("r1"), Finish("r2"), Probe(PROMPT + (1, 2)))


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("trace", [eagle_trace, padding_trace])
def test_spec_traces_agree_with_the_model(trace) -> None:  # type: ignore[no-untyped-def]
    d = trace()
    assert d.found == []
    if trace is padding_trace:
        assert d.checker.observer.coverage["one-token admission padded with draft slots"] >= 2
        waited = [
            o
            for o in d.seen
            if isinstance(o, StepResult) and ("r2", False) in ((r, x.admitted) for r, x in o.results)
        ]
        assert waited, "r2 never waited for a budget that fits its padding"
    else:
        assert d.checker.observer.coverage["drafts cut by the step's budget"] > 0
        assert d.preempted == ["r1"], "the pool no longer preempts: the trace checks no preemption"


def behind_prefill_trace(factory: object = None) -> Drive:
    """A full hit admitted behind a running prefill chunk: one token, no padding (engine
    steps of 12 tokens: r2's last chunk of 8 leaves room for the padding's 4)."""
    cfg = FULL_DRAFT_MODEL.with_(max_num_batched_tokens=12)
    d = prefill(Drive(cfg, factory).do(AddRequest("r0", PROMPT)), "r0")
    engine_step(d.do(Finish("r0"), AddRequest("r2", PROMPT * 2)))
    return engine_step(d.do(AddRequest("r1", PROMPT[:17])))


SPEC_TRACE_FOR_MUTANT = {
    "admission_without_lookahead": padding_trace,
    "rejected_drafts_not_rolled_back": eagle_trace,
    "hit_admission_not_padded": padding_trace,
    "accepted_counts_sampled_token": eagle_trace,
    "scheduled_drafts_not_clipped": eagle_trace,
    "rollback_counts_configured_drafts": eagle_trace,
    "hit_admission_padded_behind_prefill": behind_prefill_trace,
}


@needs_vllm
@pytest.mark.vllm
def test_every_spec_mutant_has_a_trace() -> None:
    from invariants.zoo.mutants_scheduler import SCHEDULER_MUTANTS

    spec = {n for n, m in SCHEDULER_MUTANTS.items() if m.strategy == "scheduler-spec"}
    assert set(SPEC_TRACE_FOR_MUTANT) == spec


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(SPEC_TRACE_FOR_MUTANT))
def test_spec_mutant_is_caught(name: str) -> None:
    """Negative controls: each speculative-decoding mutant of vLLM's `Scheduler` is caught
    on a trace the unmutated scheduler passes."""
    from invariants.zoo.mutants_scheduler import activate

    assert SPEC_TRACE_FOR_MUTANT[name]().found == []
    with activate(name) as factory:
        assert SPEC_TRACE_FOR_MUTANT[name](factory).found != []


@needs_vllm
@pytest.mark.vllm
def test_generated_spec_run_is_clean(tmp_path: Path) -> None:
    from invariants.harness.fuzz import run_fuzz

    strategy = configs(
        allow_pinning=False, shapes=(("full",), ("full", "swa")), lookahead=True, eagle_drafts=True
    )
    report = run_fuzz("vllm", steps=250, seed=5, out_dir=tmp_path, progress=False, strategy=strategy)
    assert report.failure is None, report.failure
    assert report.stats.features["draft tokens accepted"] > 0
    assert report.stats.features["config: eagle"] > 0


@needs_vllm
@pytest.mark.vllm
def test_eagle_finding_reconfirmed_through_the_real_scheduler() -> None:
    """`eagle-swa-short-run-double-pop` (0.21.0 .. 0.33.0) reproduces through the real
    scheduler, with the one lookahead slot vLLM's Eagle needs (docs/semantics.md)."""
    from dataclasses import replace

    from invariants.harness.known_findings import explain, load_known_findings
    from invariants.harness.replay import replay

    f = next(f for f in load_known_findings() if f.id == "eagle-swa-short-run-double-pop")
    trace = replace(f.trace, config=f.trace.config.with_(num_lookahead_tokens=1))
    result = replay(trace, "vllm")
    assert result.clean, result.violations[:1]
    assert any(explain("vllm", v) is f for _, v in result.known)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("recorded", [True, False], ids=["as recorded", "directed steps"])
def test_cow_finding_replays_through_the_real_scheduler_as_recorded(recorded: bool) -> None:
    """`vllm-cow-copy-of-same-step-block` is recorded as the engine's own steps, so the real
    scheduler runs it as recorded and shows the finding (the matrix's scheduler replay). The
    control: the directed form it had (r1's prompt in two 3-token chunks, r1 left out of r7
    and r8's 64-token step) is refused by the engine, naming the step."""
    from dataclasses import replace

    from invariants.harness.checker import REFUSED
    from invariants.harness.known_findings import explain, load_known_findings
    from invariants.harness.replay import replay

    f = next(f for f in load_known_findings() if f.id == "vllm-cow-copy-of-same-step-block")
    trace = f.trace
    if not recorded:
        add_r1, _, _, add_r7, add_r8, _ = trace.ops
        r1 = Step(("r1",), 3)
        trace = replace(trace, ops=[add_r1, r1, r1, add_r7, add_r8, Step(("r7", "r8"), 64)])
    result = replay(trace, "vllm")
    if recorded:
        assert result.clean, result.violations[:1]
        assert any(explain("vllm", v) is f for _, v in result.known)
        return
    first = result.violations[0][1]
    assert first.check == REFUSED and "SteeredStep: step with budget 3" in first.message
    assert not any(explain("vllm", v) is f for _, v in result.known)


@needs_vllm
@pytest.mark.vllm
def test_a_speculating_scheduler_forks_for_the_search() -> None:
    """The explore search (and the fuzz -> explore hand-over) freezes checkers by pickle.
    A real scheduler holds what pickle refuses (the control: vLLM's request block hasher,
    a closure); the freezer shares those, and its thawed copy goes on exactly as the
    original would and independently of it (the step recorder is copied, not shared)."""
    import pickle

    from invariants.explore.fork import Freezer

    d = Drive(FULL_SWA_EAGLE).do(AddRequest("r0", PROMPT), Step(("r0",), 64))
    with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
        pickle.dumps(d.checker.target)
    freezer = Freezer()
    thawed = freezer.thaw(freezer.freeze(d.checker))
    before = d.checker.target.snapshot()
    assert thawed.target.snapshot() == before
    rest = (Sample("r0", 1, 0, (2, 3)), Step(("r0",), 64))
    for op in rest:
        assert thawed.step(op) == []
    assert d.checker.target.snapshot() == before
    d.do(*rest)
    assert d.found == [] and d.checker.target.snapshot() == thawed.target.snapshot() != before


# ---------------------------------------------------------------- Mamba draft state blocks
FULL_MAMBA_DRAFTS = Config(
    groups=(GroupSpec("full", 4), GroupSpec("mamba", 4)),
    num_blocks=30,
    num_lookahead_tokens=2,
    max_model_len=4096,
)


def test_model_keeps_mamba_draft_blocks_and_moves_them_past() -> None:
    """vLLM 0.33.0 `MambaManager.allocate_new_blocks` with `num_speculative_blocks = 2`:
    the table is `cdiv(main, bs) + 2` long, the state 2 blocks before its end; a chunk
    that moves the state past a draft block moves that block to the table's end."""
    m = _model(FULL_MAMBA_DRAFTS, 2, observer=(m_seen := ModelObserver()))
    m.apply(AddRequest("r0", PROMPT))
    m.apply(Step(("r0",), 4))
    state, d1, d2 = m.groups[1].tables["r0"]  # the state at block 0, then 2 draft blocks
    m.apply(Step(("r0",), 8))  # 12 tokens: the state moves to block 2, past d1 (moved to the end)
    table = m.groups[1].tables["r0"]
    assert table[:4] == [state, 0, d2, d1] and len(table) == 3 + 2
    assert m_seen.coverage["Mamba draft block moved past by its state"] == 1
    m.apply(Step(("r0",), 64))  # 16 tokens: the state is d1's place (block 3); nothing moves
    table = m.groups[1].tables["r0"]
    assert table[:5] == [0, 0, d2, d1, table[4]] and len(table) == 4 + 2
    assert m_seen.coverage["Mamba draft block moved past by its state"] == 1
    # Without drafts the same chunks keep no draft blocks.
    plain = _model(FULL_MAMBA_DRAFTS, 0)
    plain.apply(AddRequest("r0", PROMPT))
    plain.apply(Step(("r0",), 4))
    assert len(plain.groups[1].tables["r0"]) == 1


def mamba_drafts_trace(factory: object = None) -> Drive:
    """Full + Mamba (align) with 2 drafts a step, engine steps of 8 tokens: prefill chunks
    move the state past a draft block; drafts accepted in full, in part, not at all roll
    the state back; a second request hits the first's cached states; the 20-block pool
    preempts it; then both finish."""
    cfg = FULL_MAMBA_DRAFTS.with_(num_blocks=21, max_num_batched_tokens=8)
    plan = list(DRAFT_PLAN * 5)
    d = draft_steps(Drive(cfg, factory).do(AddRequest("r0", PROMPT)), 7, plan)
    draft_steps(d.do(AddRequest("r1", PROMPT + (1, 5))), 4, plan)
    return d.do(Finish("r0"), Finish("r1"), Probe(PROMPT))


@needs_vllm
@pytest.mark.vllm
def test_mamba_drafts_trace_agrees_with_the_model() -> None:
    d = mamba_drafts_trace()
    assert d.found == []
    assert d.checker.observer.coverage["Mamba draft block moved past by its state"] > 0
    assert d.preempted == ["r1"], "the pool no longer preempts: the trace checks no preemption"
    manager = d.checker.target.vllm_scheduler.kv_cache_manager.coordinator.single_type_managers[1]
    assert manager.num_speculative_blocks == 2  # what a real Mamba layer declares


@needs_vllm
@pytest.mark.vllm
def test_mamba_specs_without_draft_blocks_disagree() -> None:
    """Negative control: the real scheduler built with Mamba specs that lack
    `num_speculative_blocks` (what kvretain built before) is caught on the same trace."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    class WithoutDraftBlocks(VllmSchedulerTarget):
        speculative_blocks = False

    assert mamba_drafts_trace(WithoutDraftBlocks).found != []


# ---------------------------------------------------------------- where a drafting Mamba request's state lies
NARROW_MAMBA_DRAFTS = Config(
    groups=(GroupSpec("full", 8), GroupSpec("mamba", 2)),
    num_blocks=28,
    retention_interval=0,
    eagle=True,
    hash_block_size=2,
    num_lookahead_tokens=2,
    max_model_len=4096,
)
NARROW_PROMPT = (1, 1, 2, 1, 1, 3, 3, 2, 3, 2, 1, 3, 1, 1, 2, 2, 1, 1)


def narrow_rejection(last_drafts: tuple[int, ...]) -> list[Op]:
    """Three tokens a step over 2-token Mamba blocks: the state jumps a block and
    moves a draft block; every draft rejected; then a step with `last_drafts`."""
    return [
        AddRequest("r0", NARROW_PROMPT),
        Step(("r0",), 32),
        Step(("r0",), 32),
        Sample("r0", 1, 0, (1, 3)),
        Step(("r0",), 32),
        Sample("r0", 1, 0, last_drafts),
        Step(("r0",), 32),
    ]


def _captured(ops: list[Op]) -> tuple[list[Violation], list[CheckContext]]:
    """The violations no known finding explains, and every step's check context."""
    with check_contexts() as contexts:
        found = Drive(NARROW_MAMBA_DRAFTS).do(*ops).found
    return found, contexts


@needs_vllm
@pytest.mark.vllm
def test_a_drafting_mamba_request_resumes_from_its_draft_state_blocks() -> None:
    """After a rejection the state sits in the previous step's state column, past the
    block holding token `start - 1` (null here): `step_blocks_stay_held` reads it
    there. Negative controls: read by position (no draft blocks) it flags the step;
    a state block dropped from the table after the step is flagged. A step without
    drafts then ends in the position a moved draft block left null in the
    allocator's table: the worker's append-only table still holds the moved block
    there, so `mamba_state_in_worker_table` judges the step clean, and catches the
    same step with that worker entry planted null."""
    import copy
    from dataclasses import replace

    from invariants.catalogue import BY_NAME

    found, contexts = _captured(narrow_rejection((1, 2)))
    assert found == []
    ctx = contexts[-1]
    check = BY_NAME["step_blocks_stay_held"].check
    assert check(ctx) == []
    assert any("block index 9 is the null block" in p for p in check(replace(ctx, draft_blocks=0)))
    full, mamba = ctx.after.tables["r0"]
    state = ctx.before.tables["r0"][1][10]
    dropped = tuple(0 if b == state else b for b in mamba)
    after = replace(ctx.after, tables={**ctx.after.tables, "r0": (full, dropped)})
    assert any(f"block {state}" in p for p in check(replace(ctx, after=after)))
    found, contexts = _captured(narrow_rejection(()))
    assert found == []
    ctx = contexts[-1]
    assert ctx.after.tables["r0"][1][9] == 0  # the step's end position, nulled by the move
    worker = ctx.history.requests["r0"].worker
    moved = worker[1][9]
    assert moved != 0 and moved in ctx.after.tables["r0"][1]  # ... kept there by the worker
    in_worker = BY_NAME["mamba_state_in_worker_table"].check
    assert in_worker(ctx) == []
    history = copy.deepcopy(ctx.history)
    history.requests["r0"].worker = (worker[0], (*worker[1][:9], 0, *worker[1][10:]))
    assert any("column 9" in p and "the null block" in p for p in in_worker(replace(ctx, history=history)))


DATA = Path(__file__).parent / "data"
NULL_STATE = "of its worker table (group 1): the null block"


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("target", ["vllm", "vllm-async-scheduler"])
def test_a_padded_admission_puts_the_next_state_in_the_null_block(target: str) -> None:
    """Full2 + Mamba2, a draft model with k = 2 (docs/semantics.md, speculative
    decoding): r2 hits r1's state at token 2 and its one remaining token is padded
    with two placeholder drafts, so its shipped Mamba table is [hit, null, state,
    draft, draft]; the sample rejects the placeholders and the next one-token step
    ends at token 4, whose state column (1) is that null entry in the worker's
    table too. vLLM 0.33.0 writes r2's running state into the null block; with a
    second request in the same case (r3) the two write it in one step and each then
    reads the state the other wrote there (the traces are engine steps: a stated budget). Without a hit: a one-token prompt (r1) padded beside a
    running request ships [null, state, draft, draft] and its next step writes
    column 0. Registered as the known finding `vllm-mamba-padded-admission-null-state`:
    every such violation is explained by it, and nothing else is found."""
    from invariants.harness.known_findings import explain
    from invariants.harness.replay import replay
    from invariants.harness.trace import read_trace

    cases = {
        "mamba_state_in_null_block": [(6, "r2 writes its state into column 1")],
        "mamba_state_in_null_block_two_requests": [
            (8, "r2 writes its state into column 1"),
            (8, "r3 writes its state into column 1"),
            (11, "r2 reads its previous state from column 1"),
            (11, "r3 reads its previous state from column 1"),
        ],
        "mamba_state_in_null_block_no_hit": [(8, "r1 writes its state into column 0")],
    }
    if target == "vllm-async-scheduler":
        # The AsyncScheduler's own steps schedule the placeholder drafts again after the
        # sample (no one-token step follows it), so these engine-step traces do not reach
        # the null column there; a directed one-token budget did. Judged clean there.
        cases = {name: [] for name in cases if name != "mamba_state_in_null_block_no_hit"}
    for name, expected in cases.items():
        result = replay(read_trace(DATA / f"{name}.json"), target)
        assert result.violations == [], name
        null_state = [(i, v) for i, v in result.known if v.check == "mamba_state_in_worker_table"]
        if not expected:
            assert null_state == [], name
            continue
        assert [(i, v.message) for i, v in null_state] == [
            (i, f"{what} {NULL_STATE}") for i, what in expected
        ], name
        assert {explain(target, v).id for _, v in null_state} == {  # type: ignore[union-attr]
            "vllm-mamba-padded-admission-null-state"
        }
