"""The admission gates (`model.policy.admission`; `Config.reserve_full_isl`, `Config.watermark`):
vLLM 0.33.0's `scheduler_reserve_full_isl` (its default) admits a waiting request only if
its whole sequence fits the free pool, and a watermark keeps a fraction of the pool free
from admissions while a request of the step runs.

The rules on their own, then one scripted trace where each gate decides, on the model
and on vLLM's `KVCacheManager` (vllm-manager) and real `Scheduler` (vllm), audited after
every operation. Negative controls: each gate reverted in the model (planted) makes the
same trace a violation on both targets; a short fuzz of each target with both gates on
finds the reverted full-sequence gate. Generation draws each value. The vLLM parts are
skipped, with the reason, when vLLM cannot be imported.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import replace

import pytest
from drive import Drive, check_contexts, patched
from hypothesis import HealthCheck, given, settings

import model.policy.admission as adm
from invariants.catalogue import INVARIANTS
from invariants.harness.checker import Checker
from invariants.harness.strategies import configs
from invariants.harness.trace import config_from_json, config_to_json
from invariants.targets.model_target import ModelTarget
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, ConfigError, GroupSpec, validate
from model.contract.observation import ScheduleResult, StepResult
from model.contract.ops import AddRequest, Finish, Offer, Schedule, Step

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")

A = tuple(range(1, 7))  # 3 blocks of 2
B = tuple(range(20, 36))  # 8 blocks of 2: more than the pool has free beside A


def cfg(**kw: object) -> Config:
    return Config(groups=(GroupSpec("full", 2),), num_blocks=12, max_model_len=4096, **kw)  # type: ignore[arg-type]


def _admitted(obs: object) -> dict[str, int]:
    assert isinstance(obs, StepResult)
    return {rid: r.scheduled for rid, r in obs.results if r.admitted}


# ---------------------------------------------------------------- the rules
def test_rules() -> None:
    assert adm.watermark_blocks(0.3, 12) == 3 and adm.watermark_blocks(0.0, 12) == 0
    assert adm.watermark_applies(True, True) and not adm.watermark_applies(True, False)
    assert not adm.watermark_applies(False, True)
    assert adm.full_sequence_fits(5, 2, 7) and not adm.full_sequence_fits(6, 2, 7)
    assert adm.chunk_fits(2, 3, 7, 2) and not adm.chunk_fits(3, 3, 7, 2)
    assert adm.full_sequence_tokens(10, 8) == 8
    assert adm.admission_cap_blocks(5, 2, 4, 4096) == 5  # (5 - 1 + 4) / 2, + 1


def test_configuration_rules_and_json() -> None:
    gated = cfg(reserve_full_isl=True, watermark=0.25)
    assert config_from_json(config_to_json(gated)) == gated
    absent = config_to_json(cfg())
    assert not {"reserve_full_isl", "watermark", "scheduling_policy", "lookahead_block_hashes"} & set(absent)
    for bad in ({"watermark": 1.0}, {"watermark": -0.1}, {"scheduling_policy": "lifo"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            validate(cfg(**bad))


def manager_trace(drive: Drive) -> list[dict[str, int]]:
    """Directed steps (vllm-manager): A runs; B arrives (a 4-token budget: its first chunk
    fits, its whole sequence does not); a step of both, then B alone. The admissions of
    the last two steps."""
    drive.do(AddRequest("a", A), Step(("a",), 6), AddRequest("b", B))
    drive.steps(("a", "b"), 4)
    drive.do(Step(("b",), 4))
    return [_admitted(obs) for obs in drive.seen[-2:]]


def engine_trace(drive: Drive) -> list[dict[str, int]]:
    """Whole steps at the build's budget (vllm): the long-prefill threshold (4) cuts B's
    first chunk beside A; then A finishes and B is alone (no cap, no watermark)."""
    budget = drive.checker.config.max_model_len
    drive.do(AddRequest("a", A), Step(("a",), budget), AddRequest("b", B))
    drive.steps(("a", "b"), budget)
    drive.do(Finish("a"), Step(("b",), budget))
    return [_admitted(obs) for obs in drive.seen[-3::2]]


# What each configuration admits in a trace's last two steps (the same on the model and the target).
EXPECTED = [
    ({}, [{"b": 3}, {}], [{"b": 4}, {}]),  # first chunk fits: admitted at once
    ({"reserve_full_isl": True}, [{}, {}], [{}, {"b": 16}]),  # 8 blocks never fit the 7 free beside A
    ({"watermark": 0.5}, [{}, {"b": 4}], [{}, {"b": 16}]),  # 6 kept free while A runs; B alone: none
    ({"watermark": 0.3}, [{"b": 3}, {}], [{"b": 4}, {}]),  # 3 kept free: the chunk's 2 still fit
]
TRACES = {"vllm-manager": (manager_trace, {}), "vllm": (engine_trace, {"long_prefill_token_threshold": 4})}


def _factory(target: str) -> object:
    if target == "model":
        from invariants.targets.model_target import ModelTarget

        return ModelTarget
    if target == "vllm":
        from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

        return VllmSchedulerTarget
    from invariants.targets.vllm_target import VllmManagerTarget

    return VllmManagerTarget


@pytest.mark.parametrize("shape", ["vllm-manager", "vllm"])
@pytest.mark.parametrize(("kw", "manager", "engine"), EXPECTED)
def test_model_gates(shape: str, kw: dict[str, object], manager: list, engine: list) -> None:  # type: ignore[type-arg]
    trace, extra = TRACES[shape]
    d = Drive(cfg(**kw, **extra), _factory("model"))  # type: ignore[arg-type]
    assert trace(d) == (manager if shape == "vllm-manager" else engine)
    assert d.audited() == []


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("target", ["vllm-manager", "vllm"])
@pytest.mark.parametrize(("kw", "manager", "engine"), EXPECTED)
def test_vllm_agrees_with_the_model(target: str, kw: dict[str, object], manager: list, engine: list) -> None:  # type: ignore[type-arg]
    trace, extra = TRACES[target]
    d = Drive(cfg(**kw, **extra), _factory(target))  # type: ignore[arg-type]
    assert trace(d) == (manager if target == "vllm-manager" else engine)
    assert d.audited() == []


# A gate reverted in the model: the trace where it decides is a violation on both targets.
PLANTS = [
    ("full_sequence_fits", lambda full, wm, free: True, {"reserve_full_isl": True}),
    ("watermark_applies", lambda admission, running: False, {"watermark": 0.5}),
    ("watermark_applies", lambda admission, running: admission, {"watermark": 0.5}),
]


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("target", ["vllm-manager", "vllm"])
@pytest.mark.parametrize(("name", "plant", "kw"), PLANTS)
def test_reverted_gate_is_caught(target: str, name: str, plant: object, kw: dict[str, object]) -> None:
    trace, extra = TRACES[target]
    with patched(adm, name, plant):
        d = Drive(cfg(**kw, **extra), _factory(target))  # type: ignore[arg-type]
        with contextlib.suppress(AssertionError):  # the planted model went its own way: the trace too
            trace(d)
        assert d.audited(), f"{name} reverted: the {target} trace passed"


# ---------------------------------------------------------------- generation
def _drawn(gates: bool | None) -> Counter[tuple[bool, bool]]:
    """(reserve_full_isl, watermark > 0) of 200 generated configurations."""
    seen: Counter[tuple[bool, bool]] = Counter()

    @settings(max_examples=200, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(configs(allow_pinning=False, gates=gates))
    def draw(c: Config) -> None:
        seen[(c.reserve_full_isl, c.watermark > 0)] += 1

    draw()
    return seen


def test_generation_draws_each_value() -> None:
    seen = _drawn(None)
    assert {reserve for reserve, _ in seen} == {True, False}, seen
    assert {wm for _, wm in seen} == {True, False}, seen
    assert set(_drawn(False)) == {(False, False)}  # the control: no gates, the field defaults
    assert set(_drawn(True)) == {(True, True)}


# ---------------------------------------------------------------- the liveness judge under the gates
def _refused_on_idle_pool(c: Config, prompt: tuple[int, ...]) -> list[str]:
    """`fitting_request_admitted` on a lone admission of `prompt` planted as refused by an
    idle pool (the model's own run admits it or not; the refusal is the corruption)."""
    with check_contexts(copy_history=True) as contexts:
        chk = Checker(ModelTarget(c))
        chk.step(AddRequest("r", prompt))
        chk.step(Schedule("r", 4))
    ctx = next(x for x in reversed(contexts) if isinstance(x.op, Schedule))
    refused = ScheduleResult(0, False, 0, 0, tuple(() for _ in c.groups), None)
    check = next(i for i in INVARIANTS if i.name == "fitting_request_admitted")
    return list(check.check(replace(ctx, obs=refused)))


def test_liveness_judges_only_what_the_whole_sequence_gate_lets_fit() -> None:
    """A short request refused by an idle pool is flagged with the gate on too (the
    control); one whose whole sequence exceeds the pool is not (vLLM refuses it by design
    under `scheduler_reserve_full_isl`); without the gate it is flagged (its chunk fits)."""
    short, long = tuple(range(1, 6)), tuple(range(1, 40))  # 3 blocks; 20 blocks > the 11 free
    assert _refused_on_idle_pool(cfg(reserve_full_isl=True), short)
    assert not _refused_on_idle_pool(cfg(reserve_full_isl=True), long)
    assert _refused_on_idle_pool(cfg(), long)


# ---------------------------------------------------------------- the gate counts as vLLM counts
MAMBA_CONNECTOR = Config(
    groups=(GroupSpec("full", 2), GroupSpec("mamba", 4)),
    num_blocks=11,
    eagle=True,
    enable_caching=False,
    max_model_len=4096,
    num_lookahead_tokens=2,
    kv_connector=True,
    reserve_full_isl=True,
    watermark=0.3,
)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("planted", [False, True])
def test_full_sequence_gate_counts_mamba_external_state_as_vllm(planted: bool) -> None:
    """Found by `fuzz --target vllm` (seed 1): a 13-token request with 2 external tokens on
    a full + Mamba pool of 10 free blocks; vLLM's whole-sequence count is exactly 10 (the
    Mamba group's own count, not the model's larger external-state count, which decides a
    chunk). Control: the gate counting one block more refuses it, a difference."""
    fits = adm.full_sequence_fits
    plant = (lambda full, wm, free: fits(full + 1, wm, free)) if planted else fits
    with patched(adm, "full_sequence_fits", plant):
        d = Drive(MAMBA_CONNECTOR, _factory("vllm"))  # type: ignore[arg-type]
        d.do(AddRequest("r2", (3, 3, 3, 3, 2, 3, 3, 3, 3, 2, 1, 3, 2)), Offer("r2", 2, "sync"))
        d.do(Step(("r2",), 64))
        assert bool(d.audited()) == planted


# ---------------------------------------------------------------- the sliding-window cap on the gate
SWA_CAPPED = Config(
    groups=(GroupSpec("full", 2), GroupSpec("swa", 2, sliding_window=3)),
    num_blocks=14,
    max_model_len=4096,
    reserve_full_isl=True,
    max_num_batched_tokens=4,
)


def test_in_flight_tokens_as_built() -> None:
    """`model.policy.admission.in_flight_tokens` is the `max_in_flight_tokens` of the engine built
    for the configuration (budget, a draft model's slots, async scheduling's two batches)."""
    from invariants.targets.vllm_scheduler_build import MAX_NUM_SEQS

    assert adm.BUILD_MAX_NUM_SEQS == MAX_NUM_SEQS
    cases = [
        (SWA_CAPPED, False),
        (SWA_CAPPED, True),
        (SWA_CAPPED.with_(num_lookahead_tokens=2, max_num_seqs=2), False),
        (SWA_CAPPED.with_(eagle=True, num_lookahead_tokens=1), True),
        (cfg(), False),
    ]
    if not _OK:
        assert adm.in_flight_tokens(SWA_CAPPED, True) == 8
        return
    from invariants.targets.vllm_scheduler_build import vllm_config

    for c, async_scheduling in cases:
        built = vllm_config(c, async_scheduling=async_scheduling).max_in_flight_tokens
        assert adm.in_flight_tokens(c, async_scheduling) == built, (c, async_scheduling)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("planted", [False, True])
def test_full_sequence_gate_caps_sliding_window_groups(planted: bool) -> None:
    """20 tokens on 13 free blocks: the whole sequence takes 9 full-attention blocks and, capped
    at the window plus the 4 tokens in flight (and one), 4 sliding-window ones: admitted. Control:
    the cap read over max_model_len (10 blocks) refuses it, a difference from vLLM."""
    in_flight = adm.in_flight_tokens
    plant = (lambda c, a: c.max_model_len) if planted else in_flight
    with patched(adm, "in_flight_tokens", plant):
        d = Drive(SWA_CAPPED, _factory("vllm"))  # type: ignore[arg-type]
        d.do(AddRequest("r", tuple(range(1, 19))), Step(("r",), 4))
        assert bool(d.audited()) == planted
        assert _admitted(d.seen[-1]) == {"r": 4}  # vLLM's decision; the planted model refuses
