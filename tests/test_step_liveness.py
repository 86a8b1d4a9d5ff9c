"""Liveness inside a `Step` (`fitting_request_admitted`): the first admission a step
decides on an idle pool is judged as a `Schedule`'s, on every target, vLLM's real
scheduler included; the known hang (`failed-load-rollback-reserves-against-itself`)
replays on `vllm` and is reported there.

Controls: a planted refusal of a fitting request in a step is reported (on the
model's contexts, and by a vLLM `Scheduler` whose allocation refuses every fresh
admission); a request refused after the step spent the pool or budget on another,
on a busy pool, after a preemption, when it does not fit, or when the budget cannot
hold its draft padding is not; the hang's violation is no finding without its entry,
and a refusal without a rollback is not that finding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from drive import check_contexts, patched

from invariants.catalogue import BY_NAME, CheckContext
from invariants.harness.checker import Checker, Violation
from invariants.harness.known_findings import KnownFinding, explain, known_finding, load_known_findings
from invariants.harness.replay import replay
from invariants.harness.trace import write_trace
from invariants.targets.model_target import ModelTarget
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, GroupSpec
from model.contract.observation import ScheduleResult, StepResult
from model.contract.ops import AddRequest, Op, Schedule, Step

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")

HANG = "failed-load-rollback-reserves-against-itself"
CFG = Config(
    groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=6)), num_blocks=24, max_model_len=4096
)
A, B = tuple(range(1, 14)), tuple(range(20, 29))  # 13 and 9 tokens


def check(ctx: CheckContext) -> list[str]:
    return BY_NAME["fitting_request_admitted"].check(ctx)


def step_context(cfg: Config = CFG, ops: list[Op] | None = None) -> CheckContext:
    """The model's context of a step admitting a then b on an idle pool (both fit)."""
    ops = ops or [AddRequest("a", A), AddRequest("b", B), Step(("a", "b"), 64)]
    with check_contexts(copy_history=True) as contexts:
        checker = Checker(ModelTarget(cfg))
        for op in ops:
            assert checker.step(op) == [], op
    ctx = contexts[-1]
    assert isinstance(ctx.obs, StepResult) and all(r.admitted for _, r in ctx.obs.results)
    return ctx


def refused(result: ScheduleResult) -> ScheduleResult:
    """The admission refused as a failed allocation reports it: looked up, nothing scheduled."""
    return ScheduleResult(0, False, result.hit, result.shared_prefix_boundary, result.hit_blocks, None)


def first_refused(ctx: CheckContext) -> CheckContext:
    """Planted: the step's first admission refused (the pass ends there)."""
    assert isinstance(ctx.obs, StepResult)
    rid, first = ctx.obs.results[0]
    return replace(ctx, obs=replace(ctx.obs, results=((rid, refused(first)),)))


def test_a_step_refusing_a_fitting_admission_on_an_idle_pool_is_reported() -> None:
    ctx = step_context()
    assert check(ctx) == []
    found = check(first_refused(ctx))
    assert len(found) == 1 and found[0].startswith("admission of a (") and "idle pool of 23" in found[0]


def test_a_refusal_after_the_step_spent_the_pool_on_another_is_not_judged() -> None:
    """b refused after a was admitted in the same step: a liveness property cannot ask
    any policy to admit b then."""
    ctx = step_context()
    assert isinstance(ctx.obs, StepResult)
    (ra, a), (rb, b) = ctx.obs.results
    assert check(replace(ctx, obs=replace(ctx.obs, results=((ra, a), (rb, refused(b)))))) == []


def test_a_refusal_on_a_busy_pool_or_after_a_preemption_is_not_judged() -> None:
    ctx = first_refused(step_context())
    busy = replace(ctx.before, ref_cnt=(0, 1) + tuple(ctx.before.ref_cnt[2:]))
    assert check(replace(ctx, before=busy)) == []
    assert isinstance(ctx.obs, StepResult)
    assert check(replace(ctx, obs=replace(ctx.obs, preempted=("b",)))) == []


def test_a_request_that_does_not_fit_may_be_refused() -> None:
    ctx = first_refused(step_context())
    need = int(check(ctx)[0].split("(")[1].split()[0])
    assert check(replace(ctx, config=ctx.config.with_(num_blocks=need + 1))) != []  # fits N-1 exactly
    assert check(replace(ctx, config=ctx.config.with_(num_blocks=need))) == []


def test_a_budget_that_cannot_hold_the_draft_padding_allows_nothing() -> None:
    """With k drafts a one-token admission after a hit is padded to 1+k tokens; vLLM
    prefers not scheduling to scheduling unpadded, so a budget under 1+k allows it
    nothing (not judged), and a budget of 1+k must admit it."""
    cfg = Config(groups=(GroupSpec("full", 4),), num_blocks=16, max_model_len=4096)
    ctx = step_context(cfg, [AddRequest("a", A), AddRequest("b", A[:8] + (99,)), Step(("a", "b"), 64)])
    assert isinstance(ctx.obs, StepResult)
    rid, first = ctx.obs.results[0]
    # Planted: a's lookup hit all but its last token (1 to compute), refused; k = 2 drafts.
    hit = replace(refused(first), hit=len(A) - 1, hit_blocks=((1, 2, 3),))
    planted = replace(ctx, obs=replace(ctx.obs, results=((rid, hit),)), draft_blocks=2)
    assert check(replace(planted, op=Step(("a", "b"), 2))) == []
    assert check(replace(planted, op=Step(("a", "b"), 3))) != []
    # Without drafts the same budget of 2 must admit it: the padding made the difference.
    assert check(replace(planted, op=Step(("a", "b"), 2), draft_blocks=0)) != []


# ------------------------------------------------------------------ the known hang
def hang() -> KnownFinding:
    return next(f for f in load_known_findings() if f.id == HANG)


def test_the_hang_as_steps_is_reported_on_the_model() -> None:
    """The finding's trace is the engine's own steps (a stated budget, every step naming
    what the engine holds): the model reports the hang at its last step, as the finding;
    control: not without its entry."""
    f = hang()
    assert f.trace.config.max_num_batched_tokens and all(not isinstance(op, Schedule) for op in f.trace.ops)
    last = f.trace.ops[-1]
    assert isinstance(last, Step) and last.budget == f.trace.config.max_num_batched_tokens
    checker = Checker(ModelTarget(f.trace.config))
    found: list[Violation] = []
    for op in f.trace.ops:
        found += checker.step(op)
    assert [v.check for v in found] == ["fitting_request_admitted"]
    assert found[0].message.endswith("after its failed load was rolled back")
    assert explain("model", found[0]) is f
    others = [g for g in load_known_findings() if g.id != HANG]
    assert known_finding("model", None, found[0], others) is None


@needs_vllm
@pytest.mark.vllm
def test_the_hang_replays_on_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvretain replay TRACE --target vllm` reports the hang (as its known finding);
    control: without the finding's entry it is a new violation."""
    from invariants.cli.main import main

    f = hang()
    result = replay(f.trace, "vllm")
    assert result.violations == []
    assert [(i, v.check) for i, v in result.known] == [(len(f.trace.ops) - 1, "fitting_request_admitted")]
    v = result.known[0][1]
    assert v.message.endswith("after its failed load was rolled back") and explain("vllm", v) is f
    others = [g for g in load_known_findings() if g.id != HANG]
    assert known_finding("vllm-manager", "0.33.0", v, others) is None
    path = write_trace(f.trace, tmp_path / "hang.json")
    assert main(["replay", str(path), "--target", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "known finding: fitting_request_admitted: admission of r0" in out


# ------------------------------------------------------------------ a planted scheduler mutant on vllm
@contextlib.contextmanager
def fresh_admissions_refused() -> Iterator[None]:
    """Planted: vLLM's `KVCacheManager.allocate_slots` refuses every waiting request that
    computed nothing (as if the pool were full), whatever the pool holds."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import RequestStatus

    original = KVCacheManager.allocate_slots

    def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if request.status == RequestStatus.WAITING and request.num_computed_tokens == 0:
            return None
        return original(self, request, *args, **kwargs)

    with patched(KVCacheManager, "allocate_slots", allocate_slots):
        yield


def vllm_step_violations() -> list[Violation]:
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    checker = Checker(VllmSchedulerTarget(CFG), audit_every=1)
    found: list[Violation] = []
    for op in (AddRequest("a", A), AddRequest("b", B), Step(("a", "b"), 64)):
        found += checker.step(op)
    return found


@needs_vllm
@pytest.mark.vllm
def test_vllm_refusing_a_fitting_request_in_a_step_is_reported() -> None:
    assert vllm_step_violations() == []
    with fresh_admissions_refused():
        found = vllm_step_violations()
    live = [v for v in found if v.check == "fitting_request_admitted"]
    assert len(live) == 1 and live[0].message.startswith("admission of a ("), found
    assert explain("vllm", live[0]) is None  # no rollback: not the known hang


@needs_vllm
@pytest.mark.vllm
def test_a_mamba_none_group_counts_its_draft_blocks() -> None:
    """Regression (the vllm fuzz, seed 5): with 3 drafts a Mamba group in 'none' mode
    takes its chunk's blocks and 3 draft blocks: r1 needs 11 of an idle pool of 9 and is
    refused (the check had counted 8). Control: the same refusal against a pool of 11 is
    flagged, against a pool of 10 not."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    cfg = Config(
        groups=(
            GroupSpec("full", 4),
            GroupSpec("swa", 4, sliding_window=5),
            GroupSpec("mamba", 8, mamba_cache_mode="none"),
        ),
        num_blocks=10,
        retention_interval=0,
        enable_caching=False,
        hash_block_size=2,
        max_model_len=4096,
        num_lookahead_tokens=3,
        long_prefill_token_threshold=19,
    )
    with check_contexts() as contexts:
        checker = Checker(VllmSchedulerTarget(cfg), audit_every=1)
        for op in (AddRequest("r1", (3, 3, 3, 1, 2, 1)), Step(("r1",), 8)):
            assert checker.step(op) == [], op
    ctx = contexts[-1]
    assert isinstance(ctx.obs, StepResult) and not ctx.obs.results[0][1].admitted
    assert check(ctx) == []
    assert check(replace(ctx, config=cfg.with_(num_blocks=12))) == [
        "admission of r1 (11 blocks) refused by an idle pool of 11"
    ]
    assert check(replace(ctx, config=cfg.with_(num_blocks=11))) == []
