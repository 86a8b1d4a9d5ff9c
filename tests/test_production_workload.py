"""The production workload reaches same-step interactions: requests arriving in
a burst share a step, and a later one in that step looks up (and hits) blocks
an earlier one cached in it, the path vLLM's Mamba same-step guard protects."""

from __future__ import annotations

import random

from invariants.harness.checker import Checker, InvalidOp
from invariants.harness.production import PRODUCTION_AUDIT_EVERY, settings_for, workload
from invariants.targets.model_target import ModelTarget
from model.contract.observation import ScheduleResult, StepResult
from model.contract.ops import AddRequest, Step

OPS = 1500


def same_step_hits(result: StepResult) -> int:
    """Blocks a request hit that an earlier request of the same step was handed in that step."""
    handed: set[int] = set()
    found = 0
    for _, r in result.results:
        if r.hit_blocks:
            found += len({b for ids in r.hit_blocks for b in ids if b} & handed)
        handed.update(b for ids in r.new_blocks or () for b in ids if b)
    return found


def test_a_burst_shares_a_step_and_hits_what_it_cached_there() -> None:
    setting = next(s for s in settings_for(0) if s.name == "gemma-like" and s.squeezed)
    checker = Checker(ModelTarget(setting.config), audit_every=PRODUCTION_AUDIT_EVERY)
    stream = workload(setting.config, random.Random(1), checker, setting.longest)
    added: list[str] = []
    bursts = hits = 0
    for _ in range(OPS):
        op = next(stream)
        try:
            assert not checker.step(op)
        except InvalidOp:
            continue
        if isinstance(op, Step) and len(op.rids) > 1 and list(op.rids) == added[-len(op.rids) :]:
            bursts += 1
            assert isinstance(checker.last_obs, StepResult)
            hits += same_step_hits(checker.last_obs)
        added = added + [op.rid] if isinstance(op, AddRequest) else []
    assert bursts >= 3 and hits > 0


def test_control_hits_on_blocks_cached_in_an_earlier_step_are_not_same_step_hits() -> None:
    first = ScheduleResult(64, True, hit=0, hit_blocks=((),), new_blocks=((5, 6, 7, 8),))
    later = ScheduleResult(32, True, hit=64, hit_blocks=((1, 2, 3, 4),), new_blocks=((9, 10),))
    assert same_step_hits(StepResult((("a", first), ("b", later)))) == 0
    reuse = ScheduleResult(32, True, hit=64, hit_blocks=((5, 6, 0, 0),), new_blocks=((9,),))
    assert same_step_hits(StepResult((("a", first), ("b", reuse)))) == 2
