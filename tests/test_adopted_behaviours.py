"""The three adopted behaviours issue #39 named, decided (docs/semantics.md, "Adopted
behaviours"): each decision held by a test, each test with its control.

- The Mamba external-state over-count (row 30): a defect, the finding
  `vllm-mamba-external-state-overcounted`. `fitting_request_admitted` counts what the
  admission takes (one Mamba block where the chunk's state shares the external state's
  block, or for an async load), so an idle pool holding exactly that refusing it is
  flagged, on the model (which predicts vLLM's refusal) and on vLLM. Controls: a pool one
  block larger admits it (clean); the claim takes neither another shortfall nor another
  cause; the judge's count is two blocks where the chunk's state is a block of its own.
- The rolled-back async load (row 29): a defect, `failed-load-rollback-reserves-against-
  itself`. The model predicts vLLM's bookkeeping: holding no block, the request stays
  in the holders' queue and among the in-flight prefills with its whole sequence.
  Control: before the rollback its reservation is what it still needs.
- The stale `is_prefill_chunk` after a cut (row 22): a policy. An engine that refreshes
  the flag pads differently and keeps every contract: the Checker reports only the
  differential (drift), no invariant. Control: the model as it is agrees, clean.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from invariants.catalogue import BY_NAME
from invariants.catalogue.liveness import _blocks
from invariants.harness.checker import Checker, Violation
from invariants.harness.known_findings import DEFAULT_PATH, KnownFinding, explain, load_known_findings
from invariants.harness.replay import replay
from invariants.harness.trace import Trace, trace_from_json
from invariants.targets.model_target import ModelTarget
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, GroupSpec
from model.contract.observation import Observation, StepResult
from model.contract.ops import AddRequest, Loaded, Offer, Op, Sample, Step
from model.machine.allocator import AllocatorModel
from model.machine.connector import in_flight_reserve, remaining_blocks

OVERCOUNT = "vllm-mamba-external-state-overcounted"
ROLLBACK = "failed-load-rollback-reserves-against-itself"
FULL_MAMBA = Config(
    groups=(GroupSpec("full", 4), GroupSpec("mamba", 4, mamba_cache_mode="align")),
    num_blocks=5,
    kv_connector=True,
)

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")


def finding(fid: str) -> KnownFinding:
    return next(f for f in load_known_findings() if f.id == fid)


def overcount_trace(num_blocks: int = 5, load: str = "sync") -> Trace:
    """The finding's trace, with another pool or the offer loaded `load` (a pool that
    admits r0 at its first step ends the trace there: r0 has nothing left to run)."""
    data = next(f for f in json.loads(DEFAULT_PATH.read_text())["findings"] if f["id"] == OVERCOUNT)["trace"]
    data = json.loads(json.dumps(data))
    data["config"]["num_blocks"] = num_blocks
    for op in data["ops"]:
        if op["op"] == "offer":
            op["load"] = load
    if num_blocks > 5:
        data["ops"] = data["ops"][:-1]
    return trace_from_json(data)


def violations(trace: Trace, target: str) -> tuple[list[Violation], list[Violation]]:
    """(new, known) violations of `trace` replayed on `target`."""
    result = replay(trace, target)
    return [v for _, v in result.violations], [v for _, v in result.known]


# ------------------------------------------------------------------ the Mamba over-count
def test_the_judge_counts_one_mamba_block_where_the_chunk_state_shares_the_external_one() -> None:
    """Full4 + Mamba4, hit 8, 3 external tokens (start 11): a chunk [11, 12) ends in the
    external state's block (Full 3 + Mamba 1); control: [11, 13) needs a state block of
    its own (Full 4 + Mamba 2). An async load (no chunk) takes the external state alone."""
    hits = ((1, 3), (0, 4))
    assert _blocks(FULL_MAMBA, hits, 11, 12, True, 0, 12) == 3 + 1
    assert _blocks(FULL_MAMBA, hits, 11, 13, True, 0, 13) == 4 + 2  # control
    assert _blocks(FULL_MAMBA, hits, 11, 11, True, 0, 11) == 3 + 1  # async: the external state
    assert _blocks(FULL_MAMBA, hits, 11, 12, True, 0) == 3 + 2  # no external tokens: as before


def test_the_overcount_is_flagged_on_the_model_and_known() -> None:
    new, known = violations(overcount_trace(), "model")
    assert new == []
    assert known and all(v.check == "fitting_request_admitted" for v in known)
    assert all(explain("model", v) is finding(OVERCOUNT) for v in known)
    assert known[0].message.endswith("(a Mamba external state supersedes its local hit)")


def test_an_async_offer_is_overcounted_too() -> None:
    new, known = violations(overcount_trace(load="async"), "model")
    assert new == [] and known
    assert all(explain("model", v) is finding(OVERCOUNT) for v in known)


def test_a_pool_one_block_larger_admits_it() -> None:
    """Control: the count is exactly one block over, so one more block admits r0."""
    trace = overcount_trace(num_blocks=6)
    new, known = violations(trace, "model")
    assert new == [] and known == []
    m = AllocatorModel(trace.config)
    obs = [m.apply(op) for op in trace.ops][-1]
    assert isinstance(obs, StepResult) and obs.results[0][1].admitted


def test_the_claim_takes_only_its_own_shortfall_and_cause() -> None:
    """Controls on the claim: a refusal needing less than the pool (a larger shortfall
    than one block) or one without the superseded hit is a new violation."""
    trace = overcount_trace()
    op = trace.ops[-1]
    own = "admission of r0 (4 blocks) refused by an idle pool of 4 (a Mamba external state supersedes its local hit)"
    assert explain("model", Violation("fitting_request_admitted", own, trace.config, op)) is finding(
        OVERCOUNT
    )
    short = own.replace("(4 blocks)", "(3 blocks)")
    assert explain("model", Violation("fitting_request_admitted", short, trace.config, op)) is None
    plain = "admission of r0 (4 blocks) refused by an idle pool of 4"
    assert explain("model", Violation("fitting_request_admitted", plain, trace.config, op)) is None
    no_connector = replace(trace.config, kv_connector=False)
    assert explain("model", Violation("fitting_request_admitted", own, no_connector, op)) is None


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("target", ["vllm", "vllm-async-scheduler"])
def test_vllm_refuses_the_exact_fit_and_admits_with_one_block_more(target: str) -> None:
    new, known = violations(overcount_trace(), target)
    assert new == [] and known
    assert all(explain(target, v) is finding(OVERCOUNT) for v in known)
    new, known = violations(overcount_trace(num_blocks=6), target)  # control
    assert new == [] and known == []


# ------------------------------------------------------------------ the rolled-back load
def test_a_rolled_back_load_stays_a_holder_with_its_whole_sequence_reserved() -> None:
    """The finding's own trace up to its rollback: r0's failed load freed every block and
    its fresh admission did not fit; it holds none, yet waits among the holders and
    reserves its whole sequence (vLLM's bookkeeping, predicted). Control: while its load
    was in flight it reserved only what it still needed past the blocks it held."""
    trace = finding(ROLLBACK).trace
    m = AllocatorModel(trace.config)
    ops = list(trace.ops)
    loaded = next(i for i, op in enumerate(ops) if isinstance(op, Loaded))
    for op in ops[:loaded]:
        m.apply(op)
    held_before = sum(len(g.tables.get("r0", ())) for g in m.groups)
    reserve_before = in_flight_reserve(m)
    assert held_before > 0 and reserve_before < in_flight_reserve_of_nothing(trace.config, "r0", m)
    obs = None
    for op in ops[loaded : loaded + 2]:
        obs = m.apply(op)
    assert isinstance(obs, StepResult) and obs.queues is not None
    assert sum(len(g.tables.get("r0", ())) for g in m.groups) == 0
    assert "r0" in obs.queues.holding
    assert in_flight_reserve(m) == in_flight_reserve_of_nothing(trace.config, "r0", m)


def in_flight_reserve_of_nothing(cfg: Config, rid: str, m: AllocatorModel) -> int:
    """What a request holding no block reserves: its whole sequence in every group."""
    r = m.requests[rid]
    return sum(remaining_blocks(r.num_tokens, [g.bs], [0]) for g in m.groups)


# ------------------------------------------------------------------ the stale prefill flag
K = 2
FULL_DRAFTS = Config(groups=(GroupSpec("full", 4),), num_blocks=16, kv_connector=True, num_lookahead_tokens=K)


class _Scheduler(ModelTarget):
    """The model as a real scheduler (drafts on), optionally refreshing the prefill flag
    of a request a failed-block report cut: an engine with the other padding policy."""

    features = replace(ModelTarget.features, real_scheduler=True)

    def __init__(self, config: Config, refresh: bool) -> None:
        super().__init__(config, num_spec_tokens=config.num_lookahead_tokens)
        self.refresh = refresh

    def apply(self, op: Op) -> Observation:
        obs = super().apply(op)
        if self.refresh and isinstance(op, Loaded):
            for r in self.model.requests.values():
                if r.running and r.num_computed < r.num_tokens:
                    r.prefill_chunk = True  # vLLM's definition, `_update_after_schedule`
        return obs


def cut_then_admit() -> list[Op]:
    """tests/test_vllm_connector_spec.py's cut: r0 decodes, r1's async load fails on r0's
    first block (r0 cut to 0, its flag left False), then r2's one-token admission."""
    r1 = tuple(range(1, 9)) + (20, 21, 22, 23, 24)
    head: list[Op] = [
        AddRequest("r0", tuple(range(1, 9))),
        Step(("r0",), 64),
        Sample("r0", 9),
        AddRequest("r1", r1),
        Offer("r1", 12, "async"),
        Step(("r1",), 64),
    ]
    m = AllocatorModel(FULL_DRAFTS, num_spec_tokens=K)
    for op in head:
        m.apply(op)
    first = m.snapshot().tables["r0"][0][0]
    return [*head, Loaded("r1", True, (first,)), AddRequest("r2", (5,)), Step(("r0", "r2"), 64)]


def judged(refresh: bool) -> list[Violation]:
    checker = Checker(_Scheduler(FULL_DRAFTS, refresh))
    found = [v for op in cut_then_admit() for v in checker.step(op)]
    return found + checker.audit()


def test_the_stale_flag_is_the_model_s_policy() -> None:
    """Control: the model as a scheduler agrees with itself; r2 is padded (1 + K)."""
    assert judged(refresh=False) == []
    m = AllocatorModel(FULL_DRAFTS, num_spec_tokens=K)
    obs = [m.apply(op) for op in cut_then_admit()][-1]
    assert isinstance(obs, StepResult) and dict(obs.results)["r2"].scheduled == 1 + K


def test_refreshing_the_flag_drifts_and_breaks_no_contract() -> None:
    """An engine that refreshes the flag at the cut leaves r2 unpadded (so it takes fewer
    slots): only the differential sees it (the step's observation and the pool's
    snapshot: drift), no invariant of the catalogue fires."""
    found = judged(refresh=True)
    assert found, "refreshing the flag changes no decision: the policy row is wrong"
    assert not {v.check for v in found} & set(BY_NAME), found
    assert {v.check for v in found} <= {"observation", "snapshot"}, found
    first = found[0]
    assert first.check == "observation" and "('r2', ScheduleResult(scheduled=1," in first.message
