"""The engine's next step (`invariants.harness.engine_step`): every request the engine holds,
in the queue order the model predicts (running, holding, waiting; arrival order, a preempted
request at the waiting queue's front), none while a running request awaits its sample; and
every driver that leaves the engine its decisions (the Hypothesis machine, the production
workload, explore's alphabet, the tests' drives) takes that one step.

Controls: the order is the arrival order, not the requests' names; a step exists again once
the sample is taken; a planted defect in the shared order reaches every driver (so none
computes the step on its own)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from hypothesis import strategies as st

import invariants.harness.engine_step as shared
from invariants.harness.checker import Checker
from invariants.harness.engine_step import awaiting_sample, engine_rids, engine_step
from invariants.harness.machine import build_machine
from invariants.harness.production import engine_step as production_step
from invariants.targets import target_factory
from model.contract.config import Config, GroupSpec
from model.contract.ops import AddRequest, Op, Preempt, Sample, Step
from model.machine.allocator import AllocatorModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drive import Drive  # noqa: E402
from engine_drive_steps import engine_rids as drive_rids  # noqa: E402

FULL = Config(groups=(GroupSpec("full", 4),), num_blocks=24, max_model_len=256)


def three_held() -> AllocatorModel:
    """r9 and r5 admitted by one 8-token step (their 4-token prompts computed, awaiting their
    samples), then r1 arrives; names against arrival order: r9, r5, r1."""
    m = AllocatorModel(FULL)
    for i, rid in enumerate(("r9", "r5")):
        m.apply(AddRequest(rid, (i + 1,) * 4))
    m.apply(Step(("r9", "r5"), 8))
    m.apply(AddRequest("r1", (7, 7)))
    return m


def test_the_engine_names_its_queues_in_arrival_order() -> None:
    m = three_held()
    assert engine_rids(m) == ("r9", "r5", "r1") != tuple(sorted(engine_rids(m)))
    m.apply(Preempt("r5"))  # a preempted request goes to the waiting queue's front
    assert engine_rids(m) == ("r9", "r5", "r1")
    assert m.engine_queues() == (("r9",), (), ("r5", "r1"))


def test_no_step_while_a_running_request_awaits_its_sample() -> None:
    m = three_held()
    assert awaiting_sample(m) and engine_step(m, 8) is None
    m.apply(Sample("r9", 1))
    assert engine_step(m, 8) is None  # r5 still awaits its sample
    m.apply(Sample("r5", 1))
    assert engine_step(m, 8) == Step(("r9", "r5", "r1"), 8)  # the control: sampled, a step
    assert engine_step(AllocatorModel(FULL), 8) is None  # no request held


def _machine_step(cfg: Config) -> Op:
    """The step the Hypothesis machine (`AllocatorMachine._engine_step`) runs from `three_held`'s
    sampled state."""
    machine = build_machine(target_factory("model"), st.just(cfg))()
    machine.checker = Checker(target_factory("model")(cfg))
    for op in _sampled_ops():
        machine.checker.step(op)
    assert machine._engine_step(None) is not None  # type: ignore[arg-type]  # nothing to draw: all sampled
    return machine.checker.ops[-1]


def _sampled_ops() -> list[Op]:
    return [
        AddRequest("r9", (1, 1, 1, 1)),
        AddRequest("r5", (2, 2, 2, 2)),
        Step(("r9", "r5"), 8),
        AddRequest("r1", (7, 7)),
        Sample("r9", 1),
        Sample("r5", 1),
    ]


def _production_step(cfg: Config) -> Op:
    checker = Checker(target_factory("model")(cfg))
    for op in _sampled_ops():
        checker.step(op)
    (step,) = production_step(checker, {}, random.Random(0))
    return step


def _drive_rids(cfg: Config) -> tuple[str, ...]:
    d = Drive(cfg, target_factory("model"))
    for op in _sampled_ops():
        d.do(op)
    return drive_rids(d)


@pytest.mark.parametrize("planted", [False, True], ids=["as written", "planted: waiting first"])
def test_every_driver_takes_the_shared_step(planted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine, the production workload and the tests' drive name the shared order; with a
    defect planted in it (waiting before running), every one of them names the planted order."""
    expected = ("r9", "r5", "r1")
    if planted:
        monkeypatch.setattr(
            shared, "engine_rids", lambda m: (*m.engine_queues().waiting, *m.engine_queues().running)
        )
        expected = ("r1", "r9", "r5")
    cfg = FULL.with_(max_num_batched_tokens=8)
    machine = _machine_step(cfg)
    assert isinstance(machine, Step) and machine.rids == expected
    production = _production_step(cfg)
    assert isinstance(production, Step) and production.rids == expected
    assert _drive_rids(cfg) == expected
