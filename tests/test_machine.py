"""The stateful machine under the active Hypothesis profile (ci in `make test`)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from invariants.harness.known_findings import is_known_violation
from invariants.harness.machine import build_machine
from invariants.harness.run_stats import FuzzStats, ViolationFound
from invariants.harness.strategies import configs
from invariants.targets import target_factory
from invariants.targets.model_target import ModelTarget
from model.machine.allocator import AllocatorModel
from model.machine.pool import Pool


def _known(target: str):
    """Known findings (understood, shared by model, reference and vLLM) are not failures here."""
    return lambda v: is_known_violation(target, v)


def test_model_satisfies_its_own_invariants():
    stats = FuzzStats()
    run_state_machine_as_test(build_machine(ModelTarget, configs(), stats, tolerated=_known("model")))
    assert stats.steps > 0


def test_reference_agrees_with_model():
    stats = FuzzStats()
    machine = build_machine(
        target_factory("reference"), configs(allow_fine=False), stats, tolerated=_known("reference")
    )
    run_state_machine_as_test(machine)
    assert stats.steps > 0


class AppendUncached(ModelTarget):
    """Mutant: freed blocks without a hash go to the tail (pre-#43447 order)."""

    def __init__(self, config):
        super().__init__(config)
        pool = self._model.pool
        original = Pool.free

        def free(ordered, append_all=False):
            blocks = list(ordered)
            uncached = [b for b in blocks if b and pool.ref[b] == 1 and b not in pool.primary]
            original(pool, blocks, append_all)
            for b in uncached:
                if b in pool.queue:
                    pool.queue.remove(b)
                    pool.queue.append_n([b])

        pool.free = free  # type: ignore[method-assign]


def test_machine_catches_a_mutant_and_shrinks_it():
    stats = FuzzStats()
    from hypothesis import strategies as st

    from model.contract.config import Config, GroupSpec

    cfg = Config(
        groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=6)),
        num_blocks=12,
        retention_interval=0,
    )
    machine = build_machine(AppendUncached, st.just(cfg), stats)
    with pytest.raises(ViolationFound) as err:
        run_state_machine_as_test(machine, settings=settings(max_examples=50, stateful_step_count=25))
    checks = {v.check for v in err.value.violations}
    assert checks & {"snapshot", "uncached_reused_before_cached"}
    assert len(err.value.ops) < 20  # shrunk


def test_model_is_deterministic():
    from model.contract.config import Config, GroupSpec
    from model.contract.ops import AddRequest, Schedule

    cfg = Config(groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=5)), num_blocks=12)
    snaps = []
    for _ in range(2):
        m = AllocatorModel(cfg)
        m.apply(AddRequest("x", (1, 2, 3) * 5))
        m.apply(Schedule("x", 8))
        snaps.append(m.snapshot())
    assert snaps[0] == snaps[1]


def test_vllm_agrees_with_model_apart_from_known_findings():
    """The bounded vLLM fuzz run of `make test` (skipped only when vLLM cannot be imported)."""
    from invariants.harness.known_findings import is_known_violation
    from invariants.targets import available_targets

    reason = available_targets().get("vllm-manager")
    if reason is not None:
        pytest.skip(f"vllm target unavailable: {reason}")
    stats = FuzzStats()
    machine = build_machine(
        target_factory("vllm-manager"),
        configs(allow_pinning=False),
        stats,
        tolerated=lambda v: is_known_violation("vllm-manager", v),
    )
    run_state_machine_as_test(machine)
    assert stats.steps > 0


class RaisesOnFirstSchedule(ModelTarget):
    """A target that raises on its first Schedule (as vLLM does on a known
    assertion) and, having skipped it, disagrees with the model from then on."""

    def apply(self, op):  # type: ignore[no-untyped-def]
        from model.contract.ops import Schedule

        if isinstance(op, Schedule) and not getattr(self, "raised", False):
            self.raised = True
            raise RuntimeError("planted: the release asserts here")
        return super().apply(op)


def _run_tolerating(check: str) -> FuzzStats:
    from hypothesis import HealthCheck
    from hypothesis import strategies as st

    stats = FuzzStats()
    machine = build_machine(
        RaisesOnFirstSchedule,
        st.just(configs_example()),
        stats,
        tolerated=lambda v: v.check == check,
    )
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=20, stateful_step_count=12, database=None, suppress_health_check=list(HealthCheck)
        ),
    )
    return stats


def configs_example():  # type: ignore[no-untyped-def]
    from model.contract.config import Config, GroupSpec

    return Config((GroupSpec("full", 4),), 16)


def test_a_tolerated_crash_ends_the_examples_checking(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the target raised (a tolerated known crash) its state is undefined:
    the example checks nothing more, so no difference that follows is reported.
    Controls: the crash itself is not tolerated unless listed; a machine that
    keeps checking after it reports the divergence that follows."""
    from invariants.harness.machine import AllocatorMachine

    stats = _run_tolerating("crash")
    assert stats.features["example ended by a tolerated crash"] > 0
    with pytest.raises(ViolationFound):
        _run_tolerating("snapshot")
    monkeypatch.setattr(
        AllocatorMachine, "halted", property(lambda self: False, lambda self, v: None), raising=False
    )
    with pytest.raises(ViolationFound) as err:
        _run_tolerating("crash")
    assert all(v.check != "crash" for v in err.value.violations)
