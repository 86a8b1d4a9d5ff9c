"""Lookahead slots and Mamba 'none' mode: the model's prediction, every target
agreeing with it, and the zoo mutants that only these features reach. vLLM
rows are skipped, with the reason, when vLLM cannot be imported."""

from __future__ import annotations

import pytest

from invariants.harness.checker import Checker
from invariants.targets import target_factory
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, ConfigError, GroupSpec, validate
from model.contract.observation import ScheduleResult
from model.contract.ops import AddRequest, Op, Sample, Schedule, Step
from model.machine.allocator import AllocatorModel

LOOKAHEAD = Config(
    groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=6), GroupSpec("mamba", 4)),
    num_blocks=40,
    num_lookahead_tokens=3,
)
MAMBA_NONE = Config(
    groups=(GroupSpec("full", 4), GroupSpec("mamba", 4, mamba_cache_mode="none")),
    num_blocks=24,
    enable_caching=False,
)


def drive(chk: Checker) -> list[str]:
    """a's prompt in 8-token chunks, a sample, then a step that admits b beside it."""
    found = []

    def do(op: Op) -> None:
        found.extend(v.check for v in chk.step(op) if v.check != "stored_tokens_match_hashes")

    do(AddRequest("a", (1, 2, 3) * 5))
    a = chk.model.requests["a"]
    while not (a.running and a.num_computed == a.num_tokens):
        do(Schedule("a", 8))
    do(Sample("a", 1))
    do(AddRequest("b", (1, 2, 3) * 3))
    for token in (2, 3):
        do(Step(("a", "b"), 16))
        for rid, r in chk.model.requests.items():
            if r.running and r.num_computed == r.num_tokens:
                do(Sample(rid, token))
    return found


def test_lookahead_reserves_attention_slots_only():
    m = AllocatorModel(LOOKAHEAD)
    m.apply(AddRequest("a", (1, 2) * 4))
    obs = m.apply(Schedule("a", 4))
    assert isinstance(obs, ScheduleResult) and obs.scheduled == 4
    full, swa, mamba = obs.new_blocks
    # 4 tokens + 3 slots: two attention blocks each; the Mamba state block only.
    assert (len(full), len(swa), len(mamba)) == (2, 2, 1)


def test_mamba_none_keeps_the_plain_layout_and_frees_below_the_last_token():
    m = AllocatorModel(MAMBA_NONE)
    m.apply(AddRequest("a", (1,) * 10))
    m.apply(Schedule("a", 9))
    obs = m.apply(Schedule("a", 1))
    assert isinstance(obs, ScheduleResult) and obs.scheduled == 1
    full, mamba = m.snapshot().tables["a"]
    assert len(full) == 3 and len(mamba) == 3
    # Token 8 (computed - 1) is in block 2: blocks 0 and 1 are freed, no split at 8.
    assert mamba[:2] == (0, 0) and mamba[2]


def test_mamba_none_needs_caching_off():
    with pytest.raises(ConfigError, match="Mamba prefix caching requires mamba_cache_mode='align'"):
        validate(MAMBA_NONE.with_(enable_caching=True))


@pytest.mark.parametrize("target", ["model", "reference", "vllm-manager"])
@pytest.mark.parametrize("cfg", [LOOKAHEAD, MAMBA_NONE], ids=["lookahead", "mamba-none"])
def test_targets_agree_with_the_model(target, cfg):
    if target == "vllm-manager" and not vllm_available()[0]:
        pytest.skip(f"vllm target: {vllm_available()[1]}")
    assert drive(Checker(target_factory(target)(cfg))) == []


def test_vllm_rejects_mamba_none_with_caching_like_the_model():
    if not vllm_available()[0]:
        pytest.skip(f"vllm target: {vllm_available()[1]}")
    with pytest.raises(ConfigError, match="Mamba prefix caching requires mamba_cache_mode='align'"):
        target_factory("vllm-manager")(MAMBA_NONE.with_(enable_caching=True))


@pytest.mark.parametrize(
    "mutant,cfg",
    [("lookahead_slots_dropped", LOOKAHEAD), ("mamba_none_state_freed_early", MAMBA_NONE)],
)
def test_vllm_mutants_of_the_new_features_are_caught(mutant, cfg):
    """Negative controls on real vLLM: the differential sees each mutant on TRACE."""
    if not vllm_available()[0]:
        pytest.skip(f"vllm target: {vllm_available()[1]}")
    from invariants.zoo.mutants_vllm import activate

    with activate(mutant) as factory:
        found = drive(Checker(factory(cfg)))
    assert "observation" in found or "snapshot" in found
