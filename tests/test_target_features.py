"""Optional target capabilities are declared by the protocol and stated by each
target class (`invariants.targets.base.Target`, `TargetFeatures`), never probed."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest

import invariants.targets as registry
from invariants.harness.checker import DEFAULT_AUDIT_EVERY, Checker
from invariants.targets.base import Target, TargetFeatures, adopt
from invariants.targets.model_target import ModelTarget
from invariants.targets.reference import ReferenceTarget
from invariants.targets.vllm_async_scheduler_target import VllmAsyncSchedulerTarget
from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget
from invariants.targets.vllm_target import VllmManagerTarget
from model.contract.config import Config, GroupSpec
from model.contract.observation import Done, Observation, Snapshot
from model.contract.ops import Op
from model.contract.profile import MODELED

CFG = Config(groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=6)), num_blocks=12)


def test_the_registry_sets_are_what_the_builtin_classes_state() -> None:
    builtins: dict[str, type[Target]] = {
        "model": ModelTarget,
        "reference": ReferenceTarget,
        "vllm-manager": VllmManagerTarget,
        "vllm": VllmSchedulerTarget,
        "vllm-async-scheduler": VllmAsyncSchedulerTarget,
    }
    assert set(builtins) == set(registry.BUILTIN_TARGETS)
    assert {n for n, cls in builtins.items() if cls.features.pinning} <= registry.PINNING_TARGETS
    assert {n for n in registry.BUILTIN_TARGETS if n in registry.PINNING_TARGETS} == {
        n for n, cls in builtins.items() if cls.features.pinning
    }
    assert {n for n in registry.BUILTIN_TARGETS if n in registry.FINE_MAMBA_TARGETS} == {
        n for n, cls in builtins.items() if cls.features.fine_mamba
    }
    assert {n for n in registry.BUILTIN_TARGETS if n in registry.REAL_SCHEDULER_TARGETS} == {
        n for n, cls in builtins.items() if cls.features.real_scheduler
    }
    assert {n for n in registry.BUILTIN_TARGETS if n in registry.QUEUE_TARGETS} == {
        n for n, cls in builtins.items() if cls.features.queues
    }
    assert {n for n in registry.BUILTIN_TARGETS if n in registry.ENGINE_STEP_TARGETS} == {
        n for n, cls in builtins.items() if cls.features.engine_steps
    }
    assert all(cls.features.partial for cls in builtins.values())


class NoDeltas(ModelTarget):
    """A model target that states no `partial` (it still has the method: stating decides)."""

    features = TargetFeatures(pinning=True, fine_mamba=True)


def test_the_fast_path_follows_the_stated_feature() -> None:
    assert Checker(ModelTarget(CFG), audit_every=DEFAULT_AUDIT_EVERY).audit_every == DEFAULT_AUDIT_EVERY
    # Control: the same target stating no deltas is audited on every operation.
    assert Checker(NoDeltas(CFG), audit_every=DEFAULT_AUDIT_EVERY).audit_every == 1


def test_the_checker_judges_with_the_stated_profiles() -> None:
    checker = Checker(ModelTarget(CFG, events="vllm-0.33.0"))
    assert checker.model_target.event_profile == "vllm-0.33.0" and checker.model_target.profile == MODELED
    assert Checker(ModelTarget(CFG)).model_target.event_profile == "seed"  # control: the default


class Plain:
    """A plug-in written to the structural contract only (it does not subclass Target)."""

    name = "plain"

    def __init__(self, config: Config) -> None:
        self.config = config
        self.event_profile = "vllm-0.33.0"  # stated per instance

    def apply(self, op: Op) -> Observation:
        return Done()

    def snapshot(self) -> Snapshot:
        return ModelTarget(self.config).snapshot()


def plain_factory(config: Config) -> Any:
    return Plain(config)


def test_adopt_gives_an_undeclared_plugin_the_protocol_defaults() -> None:
    cls = adopt(Plain)
    target = cls(CFG)
    assert isinstance(target, Plain) and isinstance(cls, type) and cls.__name__ == "Plain"
    assert target.features == TargetFeatures() and target.profile == MODELED and target.version_note is None
    assert target.event_profile == "vllm-0.33.0"  # what it states wins over the default
    assert adopt(ModelTarget) is ModelTarget  # a Target subclass is left as it is
    built = adopt(plain_factory)(CFG)  # a function factory: each target it returns is adopted
    assert isinstance(built, Plain) and built.features == TargetFeatures()
    assert Checker(built).audit_every == 1  # no deltas stated: every operation is audited
    with pytest.raises(NotImplementedError, match="features.partial"):
        target.partial([], [], [])


class PinningPlugin(Plain):
    features = TargetFeatures(pinning=True)


@pytest.mark.parametrize(("attr", "pinning"), [("PinningPlugin", True), ("Plain", False)])
def test_a_plugin_class_states_its_features(
    monkeypatch: pytest.MonkeyPatch, attr: str, pinning: bool
) -> None:
    ep = importlib.metadata.EntryPoint("declared", f"{__name__}:{attr}", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "plugin_targets", lambda: {"declared": ep})
    monkeypatch.setattr(registry, "PINNING_TARGETS", set(registry.PINNING_TARGETS))
    factory = registry.target_factory("declared")
    assert ("declared" in registry.PINNING_TARGETS) is pinning
    assert factory(CFG).features.pinning is pinning
