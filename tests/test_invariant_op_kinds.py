"""Which operation kinds each invariant judges, derived from the catalogue, against
the operation kinds each target is sent: no target's scheduling escapes an invariant.

What an invariant sees is derived by behaviour, not declared: it runs on a
synthetic context per operation kind whose operation, observation, snapshots,
history, delta and probe are poisoned (any read of them raises `Touched`; the
configuration is real). An invariant that returns without reading anything
past the operation's and observation's types ignores that kind; one that reads
(or reports) judges it. Both the audit's definitions and the fast path's forms
(`FAST_CHECKS`) are derived.

What a target is sent is derived by running the fuzzer's own state machine
(`build_machine`, the configurations `fuzz` generates for it) over a stand-in
with the target's registered features (the model, speculating and scheduling
one step ahead where the target does), and collecting the kinds of the
operations its `Checker` judged (a real scheduler's `Schedule` is run as a
`Step`).

The rule: `schedule` and `step` are one scheduler step (`model.contract.ops`: a
`Schedule` is a one-request `Step`; a real scheduler runs it as one), so an
invariant that judges one of them must judge every one of them the target is
sent. Exempt, by name and reason (`ONE_REQUEST_VACUOUS`, itself held to the
derivation): an invariant about two requests of one step judges no `Schedule`.
Controls: an invariant restricted to `Schedule` alone escapes on `vllm` (which
is sent steps only) and on `model` (sent both); the derivation tells a
finish-only invariant from the state invariants.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from invariants.catalogue import AUDIT_ONLY, BY_NAME, FAST_CHECKS, INVARIANTS, CheckContext
from invariants.harness.fuzz import _generated
from invariants.harness.machine import build_machine
from invariants.targets import (
    ASYNC_SCHEDULER_TARGETS,
    BUILTIN_TARGETS,
    CONNECTOR_TARGETS,
    FINE_MAMBA_TARGETS,
    PINNING_TARGETS,
    QUEUE_TARGETS,
    REAL_SCHEDULER_TARGETS,
)
from invariants.targets.base import Target, TargetFeatures
from invariants.targets.model_target import ModelTarget
from model.contract.config import Config, GroupSpec, validate
from model.contract.observation import (
    Done,
    LoadCut,
    ProbeResult,
    ResetResult,
    Saving,
    ScheduleResult,
    StepResult,
)
from model.contract.ops import OP_TYPES, Schedule

Check = Callable[[CheckContext], list[str]]

# The kinds that are one scheduler step (`model.contract.ops`); see the module docstring.
SCHEDULING = frozenset({"schedule", "step"})

# What a target observes for each operation kind (`model.contract.observation.Observation`).
OBSERVED: dict[str, tuple[type, ...]] = {
    "add": (Done,),
    "schedule": (ScheduleResult,),
    "step": (StepResult,),
    "sample": (Done,),
    "finish": (Done, Saving),
    "preempt": (Done,),
    "probe": (ProbeResult,),
    "reset": (ResetResult,),
    "evict": (Done,),
    "offer": (Done,),
    "loaded": (Done, LoadCut),
    "save": (Done,),
    "saved": (Done,),
}


class Touched(BaseException):
    """An invariant read a poisoned part of its context (a BaseException: no
    `except Exception` in a check can swallow it)."""


def _touch(self: object, *args: object, **kwargs: object) -> Any:
    raise Touched()


def _getattribute(self: object, name: str) -> Any:
    if name == "__class__":
        return object.__getattribute__(self, name)
    raise Touched(name)


_DUNDERS = {
    name: _touch
    for name in (
        "__bool__",
        "__len__",
        "__iter__",
        "__contains__",
        "__getitem__",
        "__call__",
        "__eq__",
        "__ne__",
        "__lt__",
        "__le__",
        "__gt__",
        "__ge__",
        "__hash__",
        "__int__",
        "__index__",
    )
}


def poisoned(cls: type = object) -> Any:
    """An instance of `cls` (isinstance holds) any read of which raises `Touched`."""
    sub = type(f"Poisoned{cls.__name__}", (cls,), {"__getattribute__": _getattribute, **_DUNDERS})
    return object.__new__(sub)


FULL_SWA_MAMBA = validate(
    Config(
        groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=6), GroupSpec("mamba", 8)),
        num_blocks=32,
        hash_block_size=4,
        kv_connector=True,
        num_lookahead_tokens=1,
        long_prefill_token_threshold=8,
    )
)
# Configuration gates an invariant may read first (Eagle, the pinned tier), both ways.
CONFIGS = (
    FULL_SWA_MAMBA,
    validate(FULL_SWA_MAMBA.with_(eagle=True)),
    validate(FULL_SWA_MAMBA.with_(watermark=0.1)),  # the watermark's gate
    validate(
        Config(
            groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=6)),
            num_blocks=32,
            retention_interval=0,
            pin_swa_on_drop=True,
        )
    ),
)


def _context(cfg: Config, kind: str, obs_type: type, fast: bool) -> CheckContext:
    op_type = OP_TYPES[kind]
    return CheckContext(
        cfg,
        poisoned(op_type),
        poisoned(obs_type),
        poisoned(),
        poisoned(),
        poisoned(),
        probe=poisoned(),
        finished_request=poisoned(),
        delta=poisoned() if fast else None,
        draft_blocks=cfg.num_lookahead_tokens,
    )


def judges(check: Check, kind: str, fast: bool = False) -> bool:
    """Does `check` look at an operation of `kind` (in some configuration and observation)?"""
    for cfg in CONFIGS:
        for obs_type in OBSERVED[kind]:
            try:
                if check(_context(cfg, kind, obs_type, fast)):
                    return True
            except Touched:
                return True
            except Exception:  # it went past its kind gate and tripped on a poisoned part
                return True
    return False


def seen_kinds(check: Check, fast: bool = False) -> frozenset[str]:
    """The operation kinds `check` judges (derived: see the module docstring)."""
    return frozenset(kind for kind in OP_TYPES if judges(check, kind, fast))


# Invariants whose subject is two requests of one step: a one-request `Schedule`
# gives them nothing to judge (they must judge `step`, and no other scheduling kind).
ONE_REQUEST_VACUOUS: dict[str, str] = {
    "mamba_state_not_read_while_written": "a Mamba state one request of a step writes and another reads",
    "admission_keeps_watermark": "an admission made while another request of its step runs",
}


def escapes(seen: frozenset[str], sent: frozenset[str], name: str = "") -> frozenset[str]:
    """The scheduling kinds a target is sent that an invariant judging scheduling misses."""
    if not seen & SCHEDULING:
        return frozenset()
    missed = (sent & SCHEDULING) - seen
    return missed - {"schedule"} if name.removesuffix(" (fast path)") in ONE_REQUEST_VACUOUS else missed


def catalogue_checks() -> list[tuple[str, Check, bool]]:
    """(name, check, fast path?) for every invariant's definition and fast-path form."""
    out: list[tuple[str, Check, bool]] = [(inv.name, inv.check, False) for inv in INVARIANTS]
    out += [(f"{name} (fast path)", check, True) for name, check in FAST_CHECKS if name not in AUDIT_ONLY]
    return out


# ------------------------------------------------------------------ what a target is sent
def features_of(target: str) -> TargetFeatures:
    """A built-in target's features, as the registry states them (a test holds the
    registry's sets to the classes' own `features`)."""
    return TargetFeatures(
        partial=True,
        pinning=target in PINNING_TARGETS,
        fine_mamba=target in FINE_MAMBA_TARGETS,
        real_scheduler=target in REAL_SCHEDULER_TARGETS,
        async_scheduling=target in ASYNC_SCHEDULER_TARGETS,
        connector=target in CONNECTOR_TARGETS,
        queues=target in QUEUE_TARGETS,
    )


_SENT: dict[str, frozenset[str]] = {}


def sent_kinds(target: str, examples: int = 12) -> frozenset[str]:
    """The operation kinds the fuzzer's machine has `target`'s Checker judge (over a
    model stand-in with its features; every violation tolerated: only kinds count)."""
    if target in _SENT:
        return _SENT[target]
    feats = features_of(target)

    class StandIn(ModelTarget):
        name = f"stand-in for {target}"
        features = feats

    def factory(cfg: Config) -> Target:
        spec = cfg.num_lookahead_tokens if feats.real_scheduler else 0
        return StandIn(cfg, num_spec_tokens=spec, async_scheduling=feats.async_scheduling)

    kinds: set[str] = set()
    names = {cls: name for name, cls in OP_TYPES.items()}
    machine = build_machine(
        factory, _generated(target), tolerated=lambda v: True, connector=target in CONNECTOR_TARGETS
    )

    class Collecting(machine):  # type: ignore[valid-type, misc]
        def teardown(self) -> None:
            if self.checker is not None:
                kinds.update(names[type(op)] for op in self.checker.ops)
            super().teardown()

    run_state_machine_as_test(
        Collecting,
        settings=settings(
            max_examples=examples,
            stateful_step_count=25,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    _SENT[target] = frozenset(kinds)
    return _SENT[target]


# ------------------------------------------------------------------ the derivation itself
def test_the_derivation_tells_kinds_apart() -> None:
    """Control of the probe: a finish-only invariant judges finish alone; a state
    invariant judges every kind; both admission invariants judge both scheduling kinds."""
    assert seen_kinds(BY_NAME["promise_kept"].check) == {"finish"}
    assert seen_kinds(BY_NAME["block_in_exactly_one_place"].check) == set(OP_TYPES)
    for name in ("fitting_request_admitted", "scratch_never_flushes_cache"):
        assert seen_kinds(BY_NAME[name].check) >= SCHEDULING, name
        assert "finish" not in seen_kinds(BY_NAME[name].check), name


def test_one_request_exemptions_hold() -> None:
    """Each exemption names an invariant that judges steps and no `Schedule` (else stale)."""
    for name in ONE_REQUEST_VACUOUS:
        assert seen_kinds(BY_NAME[name].check) & SCHEDULING == {"step"}, name
    # The exemption is for `schedule` only: missing `step` is an escape all the same.
    assert escapes(frozenset({"finish", "schedule"}), SCHEDULING, next(iter(ONE_REQUEST_VACUOUS))) == {"step"}


def test_targets_are_sent_what_their_features_say() -> None:
    """The machine sends a real scheduler steps only, and the model both kinds."""
    assert "step" in sent_kinds("vllm") and "schedule" not in sent_kinds("vllm")
    assert sent_kinds("model") >= SCHEDULING


@pytest.mark.parametrize("target", BUILTIN_TARGETS)
def test_no_target_scheduling_escapes_an_invariant(target: str) -> None:
    sent = sent_kinds(target)
    escaped = {
        name: sorted(missed)
        for name, check, fast in catalogue_checks()
        if (missed := escapes(seen_kinds(check, fast), sent, name))
    }
    assert escaped == {}, f"{target} is sent {sorted(sent)}; these invariants miss: {escaped}"


def test_an_invariant_restricted_to_schedule_escapes() -> None:
    """Planted: `fitting_request_admitted` as it was, judging `Schedule` alone. It
    escapes on vllm (sent steps only) and on the model (sent both)."""
    full = BY_NAME["fitting_request_admitted"].check

    def schedule_only(ctx: CheckContext) -> list[str]:
        return full(ctx) if isinstance(ctx.op, Schedule) else []

    seen = seen_kinds(schedule_only)
    assert seen == {"schedule"}
    assert escapes(seen, sent_kinds("vllm")) == {"step"}
    assert escapes(seen, sent_kinds("model")) == {"step"}
    assert escapes(seen_kinds(full), sent_kinds("vllm")) == frozenset()
