"""The `reference` target adapter: protocol, translation to model types, errors, mutant hook."""

from __future__ import annotations

import dataclasses

import pytest

from invariants.targets.base import Target, TargetCrash
from invariants.targets.reference import ReferenceTarget
from model.contract.config import Config, ConfigError, GroupSpec
from model.contract.observation import (
    AllBlocksCleared,
    BlockKey,
    BlockRemoved,
    BlockStored,
    Done,
    ProbeResult,
    ResetResult,
    ScheduleResult,
)
from model.contract.ops import (
    AddRequest,
    EvictBlocks,
    Finish,
    Preempt,
    Probe,
    ResetPrefixCache,
    Sample,
    Schedule,
)
from reference_impl.block_pool import BlockPool

FULL_SWA = (GroupSpec("full", 16), GroupSpec("swa", 16, sliding_window=32))
PROMPT = tuple(range(1, 101))


def drive(t: ReferenceTarget, rid: str, prompt: tuple[int, ...], budget: int = 32) -> list[ScheduleResult]:
    assert t.apply(AddRequest(rid, prompt)) == Done()
    results = []
    while True:
        obs = t.apply(Schedule(rid, budget))
        assert isinstance(obs, ScheduleResult)
        results.append(obs)
        if sum(r.scheduled for r in results) >= len(prompt):
            return results


def test_protocol_and_observations() -> None:
    t = ReferenceTarget(Config(groups=FULL_SWA, num_blocks=64, retention_interval=0))
    assert isinstance(t, Target) and t.name == "reference"
    first, *rest = drive(t, "A", PROMPT)
    assert first == ScheduleResult(32, True, 0, 0, ((), ()), ((1, 2), (3, 4)))
    assert rest[0].hit is None and not rest[0].admitted and rest[-1].scheduled == 4
    assert t.apply(Sample("A", 7)) == Done()
    snap = t.snapshot()
    assert snap.tables["A"][1][:4] == (0, 0, 0, 0)
    swa_keys = sorted(len(k.tokens) for k in snap.cached if k.group == 1)
    assert swa_keys == [80, 96]
    assert all(k.tokens == PROMPT[: len(k.tokens)] for k in snap.cached)
    assert snap.block_hash[1] == BlockKey(0, PROMPT[:16])
    stored = [e for e in snap.events if isinstance(e, BlockStored)]
    for e in stored:  # seed profile: token ids are exactly the stored blocks' tokens
        assert e.token_ids == tuple(tok for h in e.block_hashes for tok in h[-e.block_size :])
    assert t.snapshot().events == ()
    assert t.apply(Finish("A")) == Done()
    assert t.apply(Probe(PROMPT)) == ProbeResult(96, 0, ((1, 2, 5, 6, 4, 3), (0, 0, 0, 0, 9, 10)))
    snap = t.snapshot()
    assert snap.ref_cnt == (0,) * 64 and snap.pinned_queue == () and snap.tables == {}
    assert len(snap.free_queue) == 63
    assert t.apply(EvictBlocks((9,))) == Done()
    assert t.snapshot().events == (BlockRemoved(1, PROMPT[:80]),)
    assert t.apply(ResetPrefixCache()) == ResetResult(True)
    assert t.snapshot().events == (AllBlocksCleared(),)


def test_preempt_and_readmit_through_adapter() -> None:
    t = ReferenceTarget(Config(groups=(GroupSpec("full", 16),), num_blocks=16))
    drive(t, "A", PROMPT, 128)
    t.apply(Preempt("A"))
    obs = t.apply(Schedule("A", 128))
    assert isinstance(obs, ScheduleResult) and obs.hit == 96 and obs.admitted


def test_config_errors_keep_the_message() -> None:
    with pytest.raises(ConfigError) as info:
        ReferenceTarget(Config(groups=FULL_SWA, num_blocks=64, retention_interval=40))
    assert str(info.value) == (
        "prefix_cache_retention_interval (40) must be non-negative and a multiple of scheduler_block_size (16)."
    )
    with pytest.raises(ConfigError, match="no sliding-window or Mamba KV cache group"):
        ReferenceTarget(Config(groups=(GroupSpec("full", 16),), num_blocks=8, retention_interval=16))


def test_malformed_sequence_is_a_crash() -> None:
    t = ReferenceTarget(Config(groups=FULL_SWA, num_blocks=64))
    t.apply(AddRequest("A", PROMPT))
    with pytest.raises(TargetCrash):
        t.apply(Sample("A", 1))  # not running yet
    with pytest.raises(TargetCrash):
        t.apply(EvictBlocks((999,)))


def test_pinned_tier_visible_in_snapshot() -> None:
    t = ReferenceTarget(Config(groups=FULL_SWA, num_blocks=64, pin_swa_on_drop=True, pin_min_drop_blocks=2))
    drive(t, "A", PROMPT)
    t.apply(Finish("A"))
    snap = t.snapshot()
    assert snap.pinned_queue and set(snap.pinned_queue) == snap.pinned
    assert not set(snap.pinned_queue) & set(snap.free_queue)
    assert all(b in snap.block_hash for b in snap.pinned)


def test_mutant_hook_is_per_instance() -> None:
    class CountingPool(BlockPool):
        frees = 0

        def free_blocks(self, ordered_blocks):  # type: ignore[no-untyped-def]
            type(self).frees += 1
            super().free_blocks(ordered_blocks)

    @ReferenceTarget.register_mutant("counting-pool")
    def _counting(components):  # type: ignore[no-untyped-def]
        return dataclasses.replace(components, block_pool_cls=CountingPool)

    try:
        cfg = Config(groups=FULL_SWA, num_blocks=64)
        mutated, plain = ReferenceTarget(cfg, mutant="counting-pool"), ReferenceTarget(cfg)
        assert isinstance(mutated.allocator.block_pool, CountingPool)
        assert type(plain.allocator.block_pool) is BlockPool
        drive(mutated, "A", PROMPT)
        mutated.apply(Finish("A"))
        assert CountingPool.frees > 0
        with pytest.raises(ValueError, match="unknown mutant"):
            ReferenceTarget(cfg, mutant="nope")
    finally:
        ReferenceTarget.MUTANTS.pop("counting-pool", None)
