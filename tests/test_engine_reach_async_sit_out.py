"""Async scheduling's sit-out and preemption paths, reached (or not) on the engine's own steps.

Two scenarios lost their coverage when kvretain stopped steering vLLM (issue #38):

1. A decoding request sitting out a step while its drafts' sample is in flight
   (speculative decoding, `vllm-async-scheduler`). REACHED through real inputs, two ways:
   - the token budget: with `max_num_batched_tokens=6`, k = 2 and
     `long_prefill_token_threshold=3`, an older request's capped prefill chunk (3) and
     another's decode (1 + 2) use the whole budget, so the youngest, r1, gets nothing in the
     step after the one that verified its cut draft (FCFS: vLLM's running pass ends when
     `token_budget` is 0);
   - pool pressure under a KV connector: the allocation fails and the victim (the last
     running request) cannot be freed now (`_request_blocks_can_be_freed`: its step is
     in flight), so the running pass stops and the rest sit out with samples in flight.
   The model agrees with vLLM there; the control is a model that holds a sat-out request's
   sample in flight until its next scheduled step (the arrival's caching and the rejection's
   rollback one step late), and the zoo's `async_rejection_keeps_placeholders` on vLLM.
2. `InFlight.forget` on preemption: NOT REACHABLE on vLLM 0.33.0 with engine steps, and
   not observable: see `test_forget_on_preemption_decides_the_model_alone` (the model-level
   coverage, with its control) for which vLLM code rules it out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from drive import Drive, async_drive, patched
from engine_drive_steps import engine_rids

from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, GroupSpec
from model.contract.observation import BlockStored, StepResult
from model.contract.ops import AddRequest, Finish, Op, Preempt, Sample, Step
from model.machine.allocator import AllocatorModel
from model.machine.async_scheduling import InFlight
from model.policy.scheduling import build_budget

FULL = Config(groups=(GroupSpec("full", 2),), num_blocks=24, max_model_len=4096)
FULL_SWA = Config(
    groups=(GroupSpec("full", 2), GroupSpec("swa", 2, sliding_window=2)),
    num_blocks=32,
    retention_interval=0,
    max_model_len=4096,
)
BUDGET = 6
CAPS = {
    "num_lookahead_tokens": 2,
    "max_num_batched_tokens": BUDGET,
    "long_prefill_token_threshold": 3,
    "max_num_seqs": 3,
}
ABR = ("A", "B", "r1")
BR = ("B", "r1")
# A's 4-token prompt is capped at 3 tokens a step; B (2 tokens) and r1 (1) join in step 1.
# Step 2: A's last token, B's decode (1 + 2), r1's decode cut to its token and 1 draft (2).
# Step 3: A decodes (3) and B (3): r1 sits out with its step-2 sample (its draft rejected) in
# flight; the step's processing rolls it back. A is aborted, and r1 decodes from there. Only r1
# rejects drafts (A and B accept all theirs): the rollback processed in a step that left r1 out.
SAT_OUT: list[Op] = [
    AddRequest("A", (1, 2, 3, 4)),
    AddRequest("B", (8, 9)),
    AddRequest("r1", (11,)),
    Step(ABR, BUDGET),
    Sample("B", 5, 0, (6, 7)),
    Sample("r1", 12, 0, (13, 14)),
    Step(ABR, BUDGET),
    Sample("A", 5, 0, (6, 7)),
    Sample("B", 6, 2, (3, 3)),
    Sample("r1", 15, 0, (16, 17)),
    Step(ABR, BUDGET),  # index 10: r1 sits out
    Sample("A", 8, 2, (1, 1)),
    Sample("B", 4, 2, (2, 2)),
    Step(ABR, BUDGET),
    Finish("A"),
    Sample("B", 4, 2, (2, 2)),
    Step(BR, BUDGET),
    Sample("B", 4, 2, (2, 2)),
    Sample("r1", 4, 2, (2, 2)),
    Step(BR, BUDGET),
    Finish("B"),
    Sample("r1", 9, 2, (3, 3)),
    Step(("r1",), BUDGET),  # alone: r1's whole decode fits the budget
]
SIT_OUT_AT = 10


@contextlib.contextmanager
def held_until_scheduled() -> Iterator[None]:
    """The planted model defect: a request the new step did not schedule keeps its sample in
    flight until a step schedules it (its arrival, caching and rollback, come late)."""
    real = InFlight.scheduled

    def late(self: InFlight, step: dict[str, int] | None) -> Any:
        held = {rid: a for rid, a in self.tokens.items() if rid not in (step or {})}
        self.tokens = {rid: a for rid, a in self.tokens.items() if rid not in held}
        kept = {rid: n for rid, n in self.latest.items() if rid in held}
        result = real(self, step)
        self.tokens.update(held)
        self.latest.update(kept)
        return result

    InFlight.scheduled = late  # type: ignore[method-assign]
    try:
        yield
    finally:
        InFlight.scheduled = real  # type: ignore[method-assign]


def scheduled(obs: object, rid: str) -> int:
    """What the step observation `obs` scheduled for `rid` (0: a running pass that ended before it)."""
    assert isinstance(obs, StepResult)
    return next((r.scheduled for r_id, r in obs.results if r_id == rid), 0)


def fenced_sit_out(num_blocks: int, steps: int = 6) -> tuple[Drive, list[str], tuple[str, ...]]:
    """Two requests decoding with k = 2 under a consumer KV connector on a pool of
    `num_blocks`, on engine steps (each sample accepts 1 of its verified drafts): the drive,
    the requests that sat out a step with a sample in flight (the first such step), and whom
    that step preempted."""
    cfg = FULL.with_(num_lookahead_tokens=2, num_blocks=num_blocks, kv_connector=True)
    d = async_drive(cfg)
    m = d.checker.model
    d.do(AddRequest("A", (1, 2, 3)), AddRequest("r1", (4, 5, 6)))
    sat: list[str] = []
    preempted: tuple[str, ...] = ()
    for token in range(steps):
        for rid in engine_rids(d):
            if m.requests[rid].awaits_sample:
                d.do(Sample(rid, token, min(1, len(m.requests[rid].verifying)), (7, 8)))
        assert m.in_flight is not None
        flying = set(m.in_flight.tokens)
        d.do(Step(engine_rids(d), build_budget(cfg)))
        obs = d.checker.last_obs
        if not sat and isinstance(obs, StepResult):
            sat, preempted = [rid for rid in sorted(flying) if scheduled(obs, rid) == 0], obs.preempted
    return d, sat, preempted


vllm = pytest.mark.skipif(not vllm_available()[0], reason=f"vllm target: {vllm_available()[1]}")


@vllm
@pytest.mark.vllm
@pytest.mark.parametrize("cfg", [FULL.with_(**CAPS), FULL_SWA.with_(**CAPS)], ids=["full", "full+swa"])
def test_a_decoding_request_sits_out_a_step_with_its_drafts_sample_in_flight(cfg: Config) -> None:
    d = async_drive(cfg).do(*SAT_OUT[:SIT_OUT_AT])
    target: Any = d.checker.target
    m, sched = d.checker.model, target.vllm_scheduler  # vLLM's state, read only
    assert m.in_flight is not None and m.in_flight.unrolled("r1") == 1  # its cut draft, rejected, in flight
    assert sched.requests["r1"].num_output_placeholders == 2  # vLLM: token + draft still unprocessed
    d.do(SAT_OUT[SIT_OUT_AT])
    assert scheduled(d.checker.last_obs, "r1") == 0  # the budget went to A and B, in FCFS order
    r1 = sched.requests["r1"]
    assert (r1.num_computed_tokens, r1.num_output_placeholders) == (2, 0)  # the rejected draft rolled back
    assert m.requests["r1"].num_computed == 2
    assert d.do(*SAT_OUT[SIT_OUT_AT + 1 :]).audited() == []


@vllm
@pytest.mark.vllm
@pytest.mark.parametrize("num_blocks, sat", [(9, ["A", "r1"]), (11, ["r1"])])
def test_pool_pressure_under_a_connector_leaves_requests_out_with_samples_in_flight(
    num_blocks: int, sat: list[str]
) -> None:
    """The victim's free would be fenced, so the step stops where the allocation failed."""
    d, found, preempted = fenced_sit_out(num_blocks)
    assert found == sat and preempted == () and d.audited() == []


@vllm
@pytest.mark.vllm
def test_a_sample_held_until_the_next_scheduled_step_disagrees_with_vllm() -> None:
    """Negative control of the budget route: the planted model defect is caught."""
    cfg = FULL.with_(**CAPS)
    assert async_drive(cfg).do(*SAT_OUT).found == []
    with held_until_scheduled():
        assert async_drive(cfg).do(*SAT_OUT).found != []


@vllm
@pytest.mark.vllm
@pytest.mark.parametrize("num_blocks", [9, 11])
def test_a_model_that_preempts_the_fenced_victim_disagrees_at_the_sit_out(num_blocks: int) -> None:
    """Negative control of the pool route: a model whose step preempts the victim whose free
    would be fenced (no `fenced_victim`) has nobody sit out, and disagrees with vLLM there."""
    import model.machine.allocator as allocator

    with patched(allocator, "fenced_victim", lambda in_flight, rid: False):
        d, sat, _ = fenced_sit_out(num_blocks)
    assert sat and d.found != []  # vLLM's step (the observation) still leaves them out


@vllm
@pytest.mark.vllm
def test_the_zoos_async_rollback_mutant_is_caught_at_the_sit_out() -> None:
    """Negative control on vLLM's side: its rollback of the sat-out request's placeholders
    dropped (`async_rejection_keeps_placeholders`) disagrees with the model."""
    from invariants.zoo.mutants_scheduler import activate_async

    cfg = FULL.with_(**CAPS)
    with activate_async("async_rejection_keeps_placeholders") as factory:
        d = async_drive(cfg, factory).do(*SAT_OUT[: SIT_OUT_AT + 1])
        assert d.found == []  # nothing differs before the sat-out step is processed
        assert d.do(*SAT_OUT[SIT_OUT_AT + 1 :]).found != []


def stored_and_tables(cfg: Config, ops: list[Op], num_spec_tokens: int = 0) -> list[tuple[int, object]]:
    """The model alone, one step ahead: blocks stored and r1's tables after each operation."""
    m = AllocatorModel(cfg, async_scheduling=True, num_spec_tokens=num_spec_tokens)
    seen: list[tuple[int, object]] = []
    for op in ops:
        m.apply(op)
        snap = m.snapshot()
        stored = sum(len(e.block_hashes) for e in snap.events if isinstance(e, BlockStored))
        seen.append((stored, snap.tables.get("r1")))
    return seen


R1 = ("r1",)
# r1's token 4 (which fills block [2, 4)) is in flight when r1 is preempted outside a step,
# and the next step resumes it: the admission caches [2, 4) only if the token is known.
PREEMPT_IN_FLIGHT: list[Op] = [
    AddRequest("r1", (1, 2)),
    Step(R1, 8),
    Sample("r1", 3),
    Step(R1, 8),
    Sample("r1", 4),
    Preempt("r1"),
    Step(R1, 8),
]
# The same with k = 2: the in-flight sample rejected both drafts, and the resumed admission
# must not count them (the position is the rolled-back one, not the optimistic one).
PREEMPT_DRAFTS_IN_FLIGHT: list[Op] = [
    AddRequest("r1", (1, 2, 3)),
    Step(R1, 8),
    Sample("r1", 4, 0, (5, 6)),
    Step(R1, 8),
    Sample("r1", 7, 0, (8, 9)),
    Preempt("r1"),
    Step(R1, 16),
]


def test_forget_on_preemption_decides_the_model_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """`InFlight.forget`'s preemption path, on the model alone (a `Preempt` between steps).

    Unreachable on vLLM 0.33.0 with engine steps (`vllm/v1/core/sched/scheduler.py`): under
    FCFS a request is preempted only inside `schedule()`'s running pass (or by
    `reset_prefix_cache(reset_running_requests=True)`, which kvretain's `ResetPrefixCache`
    does not ask for, and which drops the stale output); a step that preempted skips the
    waiting pass (`if not preempted_reqs`), so the victim stays PREEMPTED until the engine
    processes the previous step's output right after that `schedule()`, where the stale
    share drains (`num_stale_output_tokens`) with no `cache_blocks` and no rollback
    (`not output_is_stale and status_before_stop == RUNNING`). The model's arrival caches
    only for a running request (`_token_arrives`), so on engine steps `forget` on preemption
    changes nothing (tests/test_vllm_async_scheduler.py shows vLLM agreeing with it off).
    With kvretain's connector (a cache: `requires_kv_delivery` False, nothing dropped) a
    victim whose step is in flight is not preempted at all (`_request_blocks_can_be_freed`).
    vLLM 0.33.0 also refuses what this trace does next: its waiting pass skips a request
    whose deliverable stale output is still in flight ("resuming now could resample a
    position"). Control: with `forget` a no-op the model's prediction changes."""
    full, spec = FULL.with_(num_blocks=16), FULL.with_(num_lookahead_tokens=2, num_blocks=32)
    kept = stored_and_tables(full, PREEMPT_IN_FLIGHT)
    kept_spec = stored_and_tables(spec, PREEMPT_DRAFTS_IN_FLIGHT, 2)
    assert kept[-1][0] == 1  # block [2, 4), holding the delivered token, cached at the resume
    assert kept_spec[-1][1] == ((1, 4, 3, 2),)  # 5 tokens + 2 lookahead slots: 4 blocks
    monkeypatch.setattr(InFlight, "forget", lambda self, rid: None)
    assert stored_and_tables(full, PREEMPT_IN_FLIGHT)[-1][0] == 0  # the token still "unknown"
    assert stored_and_tables(spec, PREEMPT_DRAFTS_IN_FLIGHT, 2)[-1][1] == ((1, 4, 3, 2, 5),)  # 2 more slots
