"""vLLM's real `AsyncScheduler` driving its allocator one step ahead ("vllm-async-scheduler").

The target runs the engine core's async order (each step scheduled before the
previous step's output is processed) and the Checker judges it against the
model built with `async_scheduling` (`model.machine.async_scheduling`). Scripted traces
agree after every operation; each async rule of the model has a negative
control: the same trace with that rule replaced by its synchronous form
disagrees with vLLM. The zoo's async mutant is caught on a trace the unmutated
scheduler passes, and a short fuzz run is clean and reaches the placeholder and
arrival rules.
Speculative decoding runs one step ahead too (`model.machine.async_scheduling`, 5):
scripted draft traces agree, each draft rule's synchronous form disagrees, and
the draft mutant is caught.
Skipped, with the reason, when vLLM cannot be imported.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from drive import async_drive, async_violations, patched

from invariants.targets.vllm_env import vllm_available

_OK, _REASON = vllm_available()
if not _OK:
    pytest.skip(f"vllm target: {_REASON}", allow_module_level=True)

import model.machine.allocator as allocator  # noqa: E402
import model.machine.caching as caching  # noqa: E402
from invariants.harness.checker import Checker  # noqa: E402
from invariants.harness.fuzz import run_fuzz  # noqa: E402
from invariants.targets import REAL_SCHEDULER_TARGETS, SAME_ALLOCATOR, target_factory  # noqa: E402
from invariants.targets.vllm_async_scheduler_target import VllmAsyncSchedulerTarget  # noqa: E402
from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget  # noqa: E402
from invariants.zoo.mutants_scheduler import ASYNC_SCHEDULER_MUTANTS, activate_async  # noqa: E402
from model.contract.config import Config, GroupSpec  # noqa: E402
from model.contract.ops import AddRequest, Finish, Op, Sample, Save, Saved, Step  # noqa: E402

pytestmark = pytest.mark.vllm

FULL = Config(groups=(GroupSpec("full", 2),), num_blocks=16, max_model_len=4096)
FULL_SWA = Config(
    groups=(GroupSpec("full", 2), GroupSpec("swa", 2, sliding_window=2)),
    num_blocks=24,
    retention_interval=0,
    max_model_len=4096,
)

R1 = ("r1",)
R01 = ("r0", "r1")
# A connector's report processes the latest step's output with no step after it (the only
# point, on engine steps, where a decoding request's token arrives and no allocation of
# that request follows: a decoding request is scheduled in every step).
FULL_CONN = FULL.with_(kv_connector=True)
FULL_SWA_CONN = FULL_SWA.with_(kv_connector=True)
# r1 decodes its placeholder position (step 2); its step-2 output is processed by r0's
# save report, before any step: the token's arrival caches block [2, 4) (the model's own
# test, `test_async_scheduling_model.HELD`, holds it while r1 sits out a directed step).
HELD: list[Op] = [
    AddRequest("r0", (9, 9, 9)),
    AddRequest("r1", (1, 2, 3)),
    Step(R01, 8),
    Save("r0"),
    Finish("r0"),
    Sample("r1", 4),
    Step(R1, 8),
    Sample("r1", 5),
    Saved("r0"),
]
# r1's prompt, then two decodes: its token 5 is in flight after them.
R1_DECODING: list[Op] = [
    AddRequest("r1", (1, 2, 3)),
    Step(R1, 8),
    Sample("r1", 4),
    Step(R1, 8),
    Sample("r1", 5),
]
# r1 decodes ahead; r2 joins, and r1's token 5 arrives once the step with r2 is scheduled.
ASIDE: list[Op] = [
    *R1_DECODING,
    AddRequest("r2", (7,)),
    Step(("r1", "r2"), 8),
]
# A preemption with a token in flight (6): r0's decode finds the pool short (PREEMPT_FULL: 5
# usable blocks; PREEMPT_FULL_SWA: 10) and vLLM preempts r1, the last running request; r0
# is aborted and r1 resumes: its admission caches block [4, 6), which holds that token.
PREEMPT_FULL = FULL.with_(num_blocks=6)
# r1 aborted with its token 5 in flight; r2's step processes that output (r1's share ignored).
ABORT_IN_FLIGHT: list[Op] = [
    *R1_DECODING,
    Finish("r1"),
    AddRequest("r2", (7,)),
    Step(("r2",), 8),
]
PREEMPT_FULL_SWA = FULL_SWA.with_(num_blocks=11)
PREEMPT: list[Op] = [
    AddRequest("r0", (9, 8, 7)),
    AddRequest("r1", (1, 2, 3, 4)),
    Step(R01, 8),
    Sample("r0", 10),
    Sample("r1", 5),
    Step(R01, 8),
    Sample("r0", 11),
    Sample("r1", 6),
    Step(R01, 8),
    Finish("r0"),
    Step(R1, 8),
    Sample("r1", 7),
    Step(R1, 8),
    Finish("r1"),
]

# Speculative decoding one step ahead (k = 2) on engine steps with a 6-token budget: drafts
# accepted and rejected, a proposal shorter than k (its slot is a placeholder); r2 joins with a
# 5-token prompt, chunked, and the budget cuts the drafts of its last chunk (step 12); the pool
# runs short at step 18 and vLLM preempts r2 with its drafts in flight; r1 is aborted and r2
# resumes and decodes. Each configuration's pool is the one that runs short there. A request
# sitting out a step with its drafts' sample in flight: tests/test_engine_reach_async_sit_out.py.
SPEC_FULL = FULL.with_(num_lookahead_tokens=2, num_blocks=40)
SPEC_FULL_SWA = FULL_SWA.with_(num_lookahead_tokens=2, num_blocks=48)
DRAFT_BUDGET = 6
DRAFTS_FULL = SPEC_FULL.with_(max_num_batched_tokens=DRAFT_BUDGET, max_num_seqs=2, num_blocks=16)
DRAFTS_FULL_SWA = SPEC_FULL_SWA.with_(max_num_batched_tokens=DRAFT_BUDGET, max_num_seqs=2, num_blocks=24)
DRAFTS_EAGLE_SWA = DRAFTS_FULL_SWA.with_(eagle=True, num_blocks=26)
R12 = ("r1", "r2")
DRAFTS: list[Op] = [
    AddRequest("r1", (1, 2, 3)),
    Step(R1, DRAFT_BUDGET),
    Sample("r1", 4, 0, (10, 11)),
    Step(R1, DRAFT_BUDGET),
    Sample("r1", 5, 1, (12, 13)),
    Step(R1, DRAFT_BUDGET),
    Sample("r1", 6, 0, (14,)),
    Step(R1, DRAFT_BUDGET),
    Sample("r1", 7, 1, (15, 16)),
    AddRequest("r2", (9, 8, 7, 6, 5)),
    Step(R12, DRAFT_BUDGET),
    Sample("r1", 8, 1, ()),
    Step(R12, DRAFT_BUDGET),
    Sample("r1", 9, 0, (1, 2)),
    Sample("r2", 3, 0, (1, 1)),
    Step(R12, DRAFT_BUDGET),
    Sample("r1", 4, 2, (5, 6)),
    Sample("r2", 2, 1, (2, 3)),
    Step(R12, DRAFT_BUDGET),
    Sample("r1", 5, 1, (7, 8)),
    Finish("r1"),
    Step(("r2",), DRAFT_BUDGET),
    Sample("r2", 6, 0, (4,)),
    Step(("r2",), DRAFT_BUDGET),
    Sample("r2", 7, 1, (1, 2)),
    Step(("r2",), DRAFT_BUDGET),
    Finish("r2"),
]
# r1's sample accepts both drafts (tokens 10, 11 ride in flight with 5); r2, admitted in the
# step that decodes r1 ahead, must not hit the block [10, 11]: it is cached only on arrival.
ACCEPTED_AHEAD: list[Op] = [
    AddRequest("r1", (1, 2, 3)),
    Step(R1, 8),
    Sample("r1", 4, 0, (10, 11)),
    Step(R1, 8),
    Sample("r1", 5, 2, (12, 13)),
    AddRequest("r2", (1, 2, 3, 4, 10, 11, 5, 6)),
    Step(("r1", "r2"), 16),
    Sample("r1", 7, 1, ()),
    Sample("r2", 8, 0, (1, 2)),
    Step(("r1", "r2"), 16),
]

# Each async rule of the model replaced by its synchronous form (the negative controls).
SYNCHRONOUS_FORM: dict[str, tuple[str, Any]] = {
    "caching stops at the known tokens": (
        "caching_limit",
        lambda computed, new, tokens, _: min(computed + new, tokens),
    ),
    "a token's arrival caches": ("arrival_limit", lambda computed, since: 0),
    "windows free on processed tokens": ("processed_limit", lambda computed, unprocessed: computed),
    # With drafts (model.machine.async_scheduling, 5): the next step verifies only the proposal; the
    # rejection is rolled back at the sample; only the sampled token is unknown, not the accepted drafts.
    "drafts fill k slots": ("draft_slots", lambda drafts, k: drafts),
    "a rejection counts until it arrives": ("scheduler_position", lambda computed, unrolled: computed),
    "accepted drafts are in flight": (
        "caching_limit",
        lambda computed, new, tokens, unknown: min(computed + new, tokens - min(unknown, 1)),
    ),
}
# The configuration each rule's trace runs on.
CONFIG_FOR_RULE = {
    "a token's arrival caches": FULL_SWA_CONN,
    "drafts fill k slots": DRAFTS_FULL,
    "a rejection counts until it arrives": DRAFTS_FULL,
    "accepted drafts are in flight": SPEC_FULL,
}
# A trace on which each rule decides the verdict (FULL_SWA: a window of 2 tokens).
TRACE_FOR_RULE = {
    "caching stops at the known tokens": ASIDE,
    "a token's arrival caches": HELD,
    "windows free on processed tokens": ASIDE,
    "drafts fill k slots": DRAFTS,
    "a rejection counts until it arrives": DRAFTS,
    "accepted drafts are in flight": ACCEPTED_AHEAD,
}


def synchronous(rule: str) -> contextlib.AbstractContextManager[None]:
    """The model with `rule` in its synchronous form until exit."""
    name, sync_form = SYNCHRONOUS_FORM[rule]
    # The model module that uses the rule (the arrival's caching lives in model.machine.caching).
    (module,) = [m for m in (allocator, caching) if hasattr(m, name)]
    return patched(module, name, sync_form)


def test_the_target_is_registered_as_a_real_scheduler_over_vllms_allocator() -> None:
    assert target_factory("vllm-async-scheduler") is VllmAsyncSchedulerTarget
    assert "vllm-async-scheduler" in REAL_SCHEDULER_TARGETS
    assert SAME_ALLOCATOR["vllm-async-scheduler"] == "vllm-manager"
    target = VllmAsyncSchedulerTarget(FULL)
    assert type(target.vllm_scheduler).__name__ == "AsyncScheduler"
    # The Checker judges it with the async model, and the synchronous target without.
    assert Checker(target).model.in_flight is not None
    assert Checker(VllmSchedulerTarget(FULL)).model.in_flight is None


def test_speculative_decoding_schedules_placeholder_drafts_and_never_sees_the_drafters() -> None:
    """As the engine core under async scheduling: the scheduler is built with k = 2 drafts,
    a decoding request is given k placeholder drafts, and `update_draft_token_ids` is
    never called (the worker keeps the drafts)."""
    target = VllmAsyncSchedulerTarget(SPEC_FULL)
    sched = target.vllm_scheduler
    assert type(sched).__name__ == "AsyncScheduler" and sched.num_spec_tokens == 2
    told: list[Any] = []
    sched.update_draft_token_ids = told.append
    for op in DRAFTS[:4]:
        target.apply(op)
    req = sched.requests["r1"]
    assert req.spec_token_ids == [-1, -1] and told == []
    # Step 2 verified 2 placeholder drafts ahead of step 1's token: 1 + 2 output placeholders.
    assert target.steps.pending.scheduled_spec_decode_tokens == {"r1": [-1, -1]}
    assert (req.num_computed_tokens, req.num_tokens, req.num_output_placeholders) == (6, 4, 3)


def test_a_rejection_is_rolled_back_when_its_output_is_processed() -> None:
    """Step 2's sample accepts 1 of its 2 drafts; step 3 is scheduled from the optimistic
    position (6 + 3), and only then does vLLM roll the rejected draft back."""
    target = VllmAsyncSchedulerTarget(SPEC_FULL)
    req = None
    for op in DRAFTS[:6]:
        target.apply(op)
        req = target.vllm_scheduler.requests["r1"]
    assert req is not None
    # 3 prompt + 4, 10 (accepted), 5 = 6 tokens known; 6 + 3 scheduled - 1 rejected = 8 computed.
    assert (req.num_tokens, req.num_computed_tokens, req.num_output_placeholders) == (6, 8, 3)


def test_steps_run_in_the_engine_cores_async_order() -> None:
    """schedule() of step N+1 runs before update_from_output of step N, and a request
    decoding ahead of its token carries an output placeholder meanwhile."""
    target = VllmAsyncSchedulerTarget(FULL)
    sched, calls = target.vllm_scheduler, []
    for method in ("schedule", "update_from_output"):
        original = getattr(sched, method)

        def record(*args: Any, _m: str = method, _f: Any = original, **kwargs: Any) -> Any:
            calls.append(_m)
            return _f(*args, **kwargs)

        setattr(sched, method, record)
    for op in ASIDE[:2]:
        target.apply(op)
    req = sched.requests["r1"]
    assert (req.num_computed_tokens, req.num_tokens, req.num_output_placeholders) == (3, 3, 1)
    for op in ASIDE[2:4]:
        target.apply(op)
    # Step 2 scheduled position 3 before its token (4) was known; then step 1's output arrived.
    assert calls == ["schedule", "schedule", "update_from_output"]
    assert (req.num_computed_tokens, req.num_tokens, req.num_output_placeholders) == (4, 4, 1)


@pytest.mark.parametrize(
    "cfg, ops",
    [
        (FULL_CONN, HELD),
        (FULL, ASIDE),
        (FULL_SWA_CONN, HELD),
        (FULL_SWA, ASIDE),
        (PREEMPT_FULL_SWA, PREEMPT),
        (DRAFTS_FULL, DRAFTS),
        (DRAFTS_FULL_SWA, DRAFTS),
        (DRAFTS_EAGLE_SWA, DRAFTS),
        (SPEC_FULL, ACCEPTED_AHEAD),
        (SPEC_FULL_SWA, ACCEPTED_AHEAD),
    ],
)
def test_scripted_traces_agree_with_the_async_model(cfg: Config, ops: list[Op]) -> None:
    assert async_violations(cfg, ops) == []


@pytest.mark.parametrize("rule", list(SYNCHRONOUS_FORM))
def test_each_async_rule_of_the_model_is_needed(rule: str) -> None:
    """Negative controls: with one rule in its synchronous form the model disagrees with vLLM."""
    trace, cfg = TRACE_FOR_RULE[rule], CONFIG_FOR_RULE.get(rule, FULL_SWA)
    assert async_violations(cfg, trace) == []
    with synchronous(rule):
        assert async_violations(cfg, trace) != []


def test_a_preempted_requests_in_flight_token_is_no_longer_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under pool pressure vLLM preempts r1 with its token in flight (`PREEMPT`); the token
    is processed as stale and r1's resumed admission caches the block holding it: the model
    agrees. On engine steps a preemption happens inside a step, whose output brings the stale
    token at once, so no later step sees it in flight; an abort (`ABORT_IN_FLIGHT`) is the
    input that leaves one behind. Negative control: a model that kept a preempted or
    finished request's token in flight (no `InFlight.forget`) delivers it, at the next step,
    to a request it no longer holds. `forget`'s preemption path is unreachable on vLLM 0.33.0
    with engine steps (which vLLM code rules it out, and its model-level test with a control:
    tests/test_engine_reach_async_sit_out.py::test_forget_on_preemption_decides_the_model_alone)."""
    d = async_drive(PREEMPT_FULL).do(*PREEMPT)
    assert d.found == [] and d.preempted == ["r1"]
    monkeypatch.setattr(allocator.InFlight, "forget", lambda self, rid: None)
    assert async_violations(PREEMPT_FULL, PREEMPT) == []  # the preempting step's output took the token
    with pytest.raises(KeyError, match="r1"):
        async_violations(FULL, ABORT_IN_FLIGHT)


def test_the_synchronous_model_disagrees_with_the_async_scheduler() -> None:
    class JudgedSynchronously(VllmAsyncSchedulerTarget):
        features = VllmSchedulerTarget.features

    found = async_violations(FULL_CONN, HELD, JudgedSynchronously)
    assert found and not any(v.check == "refused" for v in found), found


# The trace (and configuration) on which each async mutant is caught.
MUTANT_TRACE: dict[str, tuple[Config, list[Op]]] = {
    "arrival_caches_in_flight_tokens": (FULL, ASIDE),
    "async_rejection_keeps_placeholders": (DRAFTS_FULL, DRAFTS),
    # Fenced frees (`model.machine.async_scheduling`, 6; `invariants.zoo.mutants_async_connector`).
    "fence_on_scheduled_step": (
        FULL_SWA_CONN,
        [AddRequest("r1", (1, 2, 3, 4, 5)), Step(R1, 8), Finish("r1")],
    ),
    # r1 aborted with its step in flight: its fenced blocks are due once r2's step is scheduled.
    "fenced_frees_one_step_late": (
        FULL_SWA_CONN,
        [
            AddRequest("r1", (1, 2, 3, 4)),
            Step(R1, 8),
            Finish("r1"),
            AddRequest("r2", (9, 8)),
            Step(("r2",), 8),
        ],
    ),
}


@pytest.mark.parametrize("name", list(ASYNC_SCHEDULER_MUTANTS))
def test_async_scheduler_mutants_are_caught(name: str) -> None:
    cfg, trace = MUTANT_TRACE[name]
    assert async_violations(cfg, trace) == []
    with activate_async(name) as factory:
        assert async_violations(cfg, trace, factory) != []
    assert async_violations(cfg, trace) == []  # restored


def test_a_short_fuzz_run_is_clean_and_reaches_the_async_rules(tmp_path: Path) -> None:
    report = run_fuzz("vllm-async-scheduler", steps=400, seed=1, out_dir=tmp_path, progress=False)
    assert report.failure is None, report.failure
    assert report.stats.features["async: a step scheduled a sampled token's position ahead of it"] > 0
    assert report.stats.features["async: a sampled token's arrival cached blocks"] > 0
    assert report.stats.features["draft tokens accepted"] > 0
    assert report.stats.features["async: a step allocated past drafts still to be rolled back"] > 0


def test_the_history_follows_draft_slots_one_step_ahead() -> None:
    """The checks' own bookkeeping (`catalogue.history`) reads a step's verified draft
    positions from what it scheduled: k slots under async scheduling, however many drafts
    were proposed, so its computed tokens stay the model's (a shorter count once made
    step_blocks_stay_held report blocks past the request's real position)."""
    d = async_drive(DRAFTS_FULL)
    checker = d.checker
    for op in DRAFTS[:-1]:
        assert d.do(op).found == []
        for rid, r in checker.model.requests.items():
            assert checker.history.requests[rid].num_computed == r.num_computed, (op, rid)


PADDED = "vllm-mamba-padded-admission-null-state"
COW = "vllm-cow-copy-of-same-step-block"


def test_known_findings_reproduce_through_the_async_scheduler() -> None:
    """Every known vLLM finding of the installed release reproduces on vllm-async-scheduler
    too; an Eagle trace without lookahead slots runs with the one slot vLLM's Eagle needs
    (as through the synchronous scheduler: docs/semantics.md). With a KV connector (the
    async target attaches one): a sync load's failed blocks first show the async finding
    (the cut request keeps its output placeholders, "async-load-cut-keeps-placeholders"),
    and a trace whose failed block another request awaiting its sample holds there is not
    a well-formed trace one step ahead (the model does not state that cut). The padded
    admission's null Mamba column (`PADDED`) is recorded as the synchronous engine's own
    steps: one step ahead, the AsyncScheduler schedules the placeholder drafts again after
    the sample (no one-token step follows it), so that trace runs clean there (a directed
    one-token budget reached it). The same-step CoW copy (`COW`) is recorded as the engine's
    own steps, so it replays here as recorded."""
    from dataclasses import replace

    from invariants.harness.known_findings import explain, load_known_findings, target_version
    from invariants.harness.replay import replay
    from invariants.harness.trace import TraceError

    version = target_version("vllm")
    placeholders_first = {"sync-load-failed-block-hash-kept", "sync-load-failed-block-read-before-recompute"}
    ran, connector, unreached = [], [], []
    for f in load_known_findings():
        if "vllm-manager" not in f.targets or ("*" not in f.versions and version not in f.versions):
            continue
        trace = f.trace
        if trace.config.eagle and not trace.config.num_lookahead_tokens:
            trace = replace(trace, config=trace.config.with_(num_lookahead_tokens=1))
        if f.id == "swa-load-cut-reads-skipped-window":
            with pytest.raises(TraceError, match="awaiting its sample|no other request holds"):
                replay(trace, "vllm-async-scheduler")
            connector.append(f.id)
            continue
        result = replay(trace, "vllm-async-scheduler")
        if f.id == PADDED:  # the engine's own steps do not reach it one step ahead (see below)
            assert result.clean and not any(explain("vllm-async-scheduler", v) is f for _, v in result.known)
            unreached.append(f.id)
            continue
        if f.id in placeholders_first:
            first = min(result.known, key=lambda k: k[0])
            assert explain("vllm-async-scheduler", first[1]).id == "async-load-cut-keeps-placeholders", f.id
            connector.append(f.id)
            continue
        assert any(explain("vllm-async-scheduler", v) is f for _, v in result.known), f.id
        assert result.clean, (f.id, result.violations[:1])
        (connector if f.trace.config.kv_connector else ran).append(f.id)
    assert {"vllm-blockstored-token-range", "eagle-swa-short-run-double-pop", COW} <= set(ran)
    assert set(connector) == {
        "swa-load-cut-reads-skipped-window",
        "vllm-mamba-external-state-uncounted",
        "vllm-mamba-external-state-uncounted-watermark",
        "vllm-mamba-external-state-overcounted",
        "failed-load-rollback-reserves-against-itself",
        "save-during-load-freed-at-first-report",
        "sync-load-failed-block-hash-kept",
        "sync-load-failed-block-read-before-recompute",
        "async-load-cut-keeps-placeholders",
    }
    assert unreached == [PADDED]
