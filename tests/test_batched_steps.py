"""Scheduler steps over a batch (`Step`): the model's prediction, and every
target agreeing with it on the traces that reach each rule of the step
(running first, preempt the newest and retry, admissions only without a
preemption, the Mamba same-step guard). vLLM rows are skipped, with the
reason, when vLLM cannot be imported."""

from __future__ import annotations

import pytest

from invariants.harness.checker import Checker, InvalidOp
from invariants.targets import target_factory
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, GroupSpec
from model.contract.observation import ScheduleResult, StepResult
from model.contract.ops import AddRequest, Op, Sample, Step, op_from_json, op_to_json
from model.machine.allocator import AllocatorModel

SYS = tuple([1, 2, 3, 1] * 5)
FULL_MAMBA = Config(groups=(GroupSpec("full", 4), GroupSpec("mamba", 4)), num_blocks=32)
TIGHT = Config(groups=(GroupSpec("full", 4),), num_blocks=8)

GUARD_TRACE: list[Op] = [
    AddRequest("a", SYS + (2, 2)),
    AddRequest("b", SYS + (3, 3)),
    Step(("a", "b"), 64),
    Step(("a", "b"), 64),
]
PREEMPT_TRACE: list[Op] = [
    AddRequest("a", (1,) * 12),
    AddRequest("b", (2,) * 8),
    AddRequest("c", (3,) * 8),
    Step(("a", "b", "c"), 64),
    Sample("a", 1),
    Sample("b", 2),
    Sample("c", 3),
    Step(("a", "b", "c"), 64),
]


def model_run(cfg: Config, ops: list[Op]) -> list[object]:
    m = AllocatorModel(cfg)
    return [m.apply(op) for op in ops]


def test_mamba_same_step_guard_defers_the_second_admission():
    obs = model_run(FULL_MAMBA, GUARD_TRACE)
    first = obs[2]
    assert isinstance(first, StepResult)
    (a_id, a), (b_id, b) = first.results
    assert (a_id, a.admitted, a.scheduled) == ("a", True, 20)  # split at the replay checkpoint
    # b hits a's 20 tokens, but a's Mamba state there is computed by this very step.
    assert (b_id, b.admitted, b.hit) == ("b", False, 20)
    second = obs[3]
    assert isinstance(second, StepResult)
    assert dict(second.results)["b"].admitted  # the next step admits it


def test_running_first_then_preempt_the_newest():
    obs = model_run(TIGHT, PREEMPT_TRACE)
    step = obs[-1]
    assert isinstance(step, StepResult)
    assert step.preempted == ("c",)
    assert [(rid, r.scheduled) for rid, r in step.results] == [("a", 1), ("b", 1)]


def test_no_admission_in_a_step_that_preempted():
    cfg = Config(groups=(GroupSpec("full", 4),), num_blocks=8)
    ops = [*PREEMPT_TRACE[:-1], AddRequest("d", (4,) * 3), PREEMPT_TRACE[-1]]
    ops[-1] = Step(("a", "b", "c", "d"), 64)
    step = model_run(cfg, ops)[-1]
    assert isinstance(step, StepResult) and step.preempted
    assert "d" not in dict(step.results)


def test_budget_is_shared_and_ends_the_step():
    cfg = Config(groups=(GroupSpec("full", 4),), num_blocks=32)
    ops: list[Op] = [AddRequest("a", (1,) * 10), AddRequest("b", (2,) * 10), Step(("a", "b"), 12)]
    step = model_run(cfg, ops)[-1]
    assert isinstance(step, StepResult)
    assert [(rid, r.scheduled) for rid, r in step.results] == [("a", 10), ("b", 2)]


@pytest.mark.parametrize("target", ["model", "reference", "vllm-manager"])
@pytest.mark.parametrize(
    "cfg,ops", [(FULL_MAMBA, GUARD_TRACE), (TIGHT, PREEMPT_TRACE)], ids=["mamba-guard", "preemption"]
)
def test_targets_agree_with_the_model(target, cfg, ops):
    if target == "vllm-manager" and not vllm_available()[0]:
        pytest.skip(f"vllm target: {vllm_available()[1]}")
    chk = Checker(target_factory(target)(cfg))
    for op in ops:
        found = [v for v in chk.step(op) if v.check != "stored_tokens_match_hashes"]
        assert found == [], (op, found)


def test_step_json_round_trip_and_bad_rids():
    op = Step(("r0", "r1"), 8)
    assert op_from_json(op_to_json(op)) == op
    for bad in ([], ["r0", "r0"], [1]):
        with pytest.raises(ValueError, match="rids"):
            op_from_json({"op": "step", "rids": bad, "budget": 8})


def test_checker_rejects_a_step_naming_a_request_owing_a_sample():
    chk = Checker(target_factory("model")(TIGHT))
    chk.step(AddRequest("a", (1,) * 4))
    chk.step(Step(("a",), 64))
    with pytest.raises(InvalidOp, match="needs a sample"):
        chk.step(Step(("a",), 64))
    assert isinstance(chk.last_obs, StepResult)
    assert chk.last_obs.results == (("a", ScheduleResult(4, True, 0, 0, ((),), ((1,),))),)


def test_vllm_without_the_same_step_guard_is_caught():
    """Negative control on real vLLM: the zoo mutant that drops the guard admits b
    in the same step; the differential and the step invariant both say so."""
    if not vllm_available()[0]:
        pytest.skip(f"vllm target: {vllm_available()[1]}")
    from invariants.zoo.mutants_vllm import activate

    with activate("mamba_same_step_guard_off") as factory:
        chk = Checker(factory(FULL_MAMBA))
        found = [v.check for op in GUARD_TRACE[:3] for v in chk.step(op)]
    assert "observation" in found and "mamba_state_not_read_while_written" in found
