"""Semantics profiles (model.contract.profile): one switch per capability an older release lacks.

Each switch has a small hand trace on which the modeled design (0.33.0) and
the older rule predict different things. Three checks per switch:

- the model alone: the two profiles differ on the trace (the switch matters),
  and the older profile predicts what the older release's rule says (written
  out here from that release's source);
- detection: the fake release with the mechanism gets the 0.33.0 rule, the
  one without it the older rule (the control);
- on the cached release that predates the mechanism: its detected profile
  agrees with it on the trace, while the 0.33.0 profile disagrees (the control).
  `make test` installs 0.23.0's environment (the Makefile's TEST_RELEASES);
  a release whose environment is absent is skipped with the reason, except
  a release `make test` installs under CI, which fails (conftest's
  `release_envs`).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from test_matrix import _fake_namespace

from invariants.harness.trace import Trace, write_trace
from invariants.targets.vllm_capabilities import detect_from
from model.contract.config import Config, GroupSpec
from model.contract.observation import BlockStored, Observation, ProbeResult, ScheduleResult, Snapshot
from model.contract.ops import AddRequest, Finish, Op, Probe, Schedule
from model.contract.profile import MODELED, Profile
from model.machine.allocator import AllocatorModel

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    switch: str  # the Profile field
    capability: str  # the Capabilities field that drives it
    release: str  # a release that predates the mechanism
    config: Config
    ops: tuple[Op, ...]
    old: object = False  # the switch's value in that release
    base: tuple[tuple[str, object], ...] = ()  # other switches of that release the trace needs


FULL4_SWA5 = (GroupSpec("full", 4), GroupSpec("swa", 4, 5))
SHARED = (2, 2, 1, 2, 2, 2, 2, 2, 1, 1, 2, 2)
# b shares 12 tokens with a and computes 8: its junction's blocks are kept.
CASES_JUNCTION_OPS: tuple[Op, ...] = (
    AddRequest("a", (*SHARED, 2, 1, 2, 1, 1)),
    Schedule("a", 64),
    AddRequest("b", (*SHARED, 1)),
    Schedule("b", 8),
)
MAMBA_PROMPT = (1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1)
CASES = {
    "eagle_junction_peek": Case(
        "eagle_junction_peek",
        "eagle_junction_peek",
        "0.32.0",
        Config(FULL4_SWA5, 16, retention_interval=0, eagle=True),
        CASES_JUNCTION_OPS,
    ),
    "partial_tail_excludes_last_token": Case(
        "partial_tail_excludes_last_token",
        "tail_excludes_last",
        "0.31.0",
        Config((GroupSpec("full", 8), GroupSpec("swa", 4, 9)), 16, retention_interval=0),
        (AddRequest("a", (2, 2, 2, 1, 1, 1, 1, 2)), Schedule("a", 64)),
    ),
    "eagle_margin_to_hashed": Case(
        "eagle_margin_to_hashed",
        "eagle_margin_hashed",
        "0.31.0",
        Config(FULL4_SWA5, 16, retention_interval=0, eagle=True),
        (
            AddRequest("b", (2, 1, 3, 1, 3, 1, 2, 1)),
            Schedule("b", 64),
            Probe((2, 1, 3, 1, 3, 1, 2, 1)),
        ),
    ),
    "eagle_replay_boundaries": Case(
        "eagle_replay_boundaries",
        "replay_boundaries",
        "0.29.0",
        Config(FULL4_SWA5, 16, retention_interval=0, eagle=True),
        (AddRequest("a", (2, 1, 1, 2, 1, 1, 1, 1, 2)), Schedule("a", 64)),
    ),
    "caching_off_free_to_head": Case(
        "caching_off_free_to_head",
        "caching_off_order",
        "0.27.0",
        Config((GroupSpec("full", 4),), 8, enable_caching=False),
        (AddRequest("a", (1, 2, 3, 4, 5, 6, 7, 8, 9)), Schedule("a", 64), Finish("a")),
    ),
    "block_mask": Case(
        "block_mask",
        "block_mask",
        "0.21.0",
        Config((GroupSpec("full", 8), GroupSpec("swa", 4, 5)), 16),
        (AddRequest("a", (1, 2, 2, 2, 2, 2, 1, 1)), Schedule("a", 64)),
    ),
    "eagle_aware_mask": Case(
        "eagle_aware_mask",
        "eagle_aware_mask",
        "0.22.0",
        Config((GroupSpec("full", 8), GroupSpec("swa", 4, 5)), 16, eagle=True),
        (AddRequest("a", (1, 2, 2, 2, 2, 2, 1, 1)), Schedule("a", 64)),
    ),
    "mamba_retention": Case(
        "mamba_retention",
        "mamba_retention",
        "0.23.0",
        Config(
            (GroupSpec("full", 4), GroupSpec("swa", 4, 5), GroupSpec("mamba", 4)), 24, retention_interval=0
        ),
        (AddRequest("a", (1, 2, 2, 2)), Schedule("a", 64)),
    ),
    "free_order_caller": Case(
        "free_order",
        "free_order",
        "0.23.0",
        Config((GroupSpec("full", 4),), 8),
        (AddRequest("a", (1, 2, 2, 1, 2)), Schedule("a", 64), Finish("a")),
        old="caller",
    ),
    "free_order_append": Case(
        "free_order",
        "free_order",
        "0.22.0",
        Config((GroupSpec("full", 4), GroupSpec("swa", 4, 5)), 12),
        (AddRequest("a", (1, 2, 2, 1, 2)), Schedule("a", 64), Finish("a")),
        old="append",
    ),
    "partial_tail": Case(
        "partial_tail",
        "partial_tail",
        "0.25.0",
        Config((GroupSpec("full", 8), GroupSpec("swa", 4, 9)), 16),
        (AddRequest("a", (2, 2, 2, 1, 1, 1, 1, 2)), Schedule("a", 64)),
    ),
    "shared_prefix_junction": Case(
        "shared_prefix_junction",
        "shared_prefix_junction",
        "0.25.0",
        Config(FULL4_SWA5, 16, retention_interval=0, eagle=True),
        CASES_JUNCTION_OPS,
    ),
    "eagle_margin_skips_mamba": Case(
        "eagle_margin_skips_mamba",
        "eagle_margin_skips_mamba",
        "0.25.0",
        Config((GroupSpec("full", 2), GroupSpec("mamba", 2)), 12, eagle=True, hash_block_size=2),
        (AddRequest("a", (1, 2, 1, 1)), Schedule("a", 64), Schedule("a", 64), Probe((1, 2, 3, 3, 3))),
    ),
    "mamba_checkpoint_in_block_drop": Case(
        "mamba_checkpoint",
        "mamba_checkpoint",
        "0.31.0",
        Config(
            (GroupSpec("full", 4), GroupSpec("mamba", 2)),
            16,
            retention_interval=0,
            eagle=True,
            hash_block_size=2,
            scheduler_block_size=4,
        ),
        (AddRequest("a", (1, 2, 1, 1, 2, 2, 1, 2, 2, 1)), Schedule("a", 4), Schedule("a", 4)),
        old="in_block_drop",
    ),
    "mamba_checkpoint_in_block": Case(
        "mamba_checkpoint",
        "mamba_checkpoint",
        "0.29.0",
        Config(
            (GroupSpec("full", 4), GroupSpec("mamba", 4)),
            16,
            eagle=True,
            hash_block_size=2,
            scheduler_block_size=4,
        ),
        (AddRequest("a", (1, 2, 1, 1, 2, 2)), Schedule("a", 64), Schedule("a", 64)),
        old="in_block",
    ),
    "mamba_count_capped": Case(
        "mamba_count_capped",
        "mamba_count_capped",
        "0.30.0",
        Config((GroupSpec("full", 4), GroupSpec("mamba", 8)), 7, hash_block_size=4, scheduler_block_size=8),
        (
            AddRequest("a", MAMBA_PROMPT),
            Schedule("a", 64),
            Schedule("a", 64),
            Finish("a"),
            AddRequest("b", (*MAMBA_PROMPT, 2, 2, 2)),
            Schedule("b", 64),
        ),
    ),
    "block_mask_alignment": Case(
        "block_mask",
        "block_mask",
        "0.21.0",
        Config((GroupSpec("full", 8), GroupSpec("swa", 2, 4)), 16, hash_block_size=2),
        (AddRequest("a", (1, 2, 2, 2, 2, 2, 1, 1, 2, 1)), Schedule("a", 2)),
    ),
    "eagle_aware_mask_peek_caching": Case(
        "eagle_aware_mask",
        "eagle_aware_mask",
        "0.22.0",
        Config((GroupSpec("full", 4), GroupSpec("swa", 8, 9)), 16, eagle=True),
        (AddRequest("a", (1, 2, 2, 2, 2, 2, 1, 1, 2, 1, 1, 2, 2)), Schedule("a", 64)),
    ),
    "masks_on_hit_grid": Case(
        "masks_on_hit_grid",
        "mask_hit_grid",
        "0.28.0",
        Config(
            (GroupSpec("full", 16), GroupSpec("swa", 4, 11), GroupSpec("mamba", 16)),
            13,
            retention_interval=0,
            hash_block_size=4,
            scheduler_block_size=16,
        ),
        (
            AddRequest("a", (2, 2, 2, 3, 2, 2, 1, 3, 1, 2, 3, 2, 3, 2, 3, 1, 1, 1, 3, 3, 2, 3)),
            Schedule("a", 64),
        ),
    ),
    "mamba_retire_past_nulls": Case(
        "mamba_retire_past_nulls",
        "mamba_retired_mark",
        "0.23.0",
        Config(
            (GroupSpec("full", 4), GroupSpec("swa", 2, 4), GroupSpec("mamba", 2)),
            18,
            hash_block_size=2,
            enable_caching=False,
        ),
        (AddRequest("a", (3, 3, 3, 1, 1, 3, 1, 2)), *(Schedule("a", 3),) * 4),
        base=(("free_order", "caller"),),
    ),
}
# The fake-namespace flag (tests/test_matrix.py fakes) that changes each capability.
FAKE_FLAG: dict[str, tuple[str, object, object]] = {
    # capability: (flag, the switch on the fake with the flag, on the fake without it)
    "eagle_junction_peek": ("junction_peek", True, False),
    "tail_excludes_last": ("tail_limit", True, False),
    "eagle_margin_hashed": ("margin_hashed", True, False),
    "replay_boundaries": ("replay", True, False),
    "caching_off_order": ("fifo_off", False, True),  # the flag gives the older rule
    "partial_tail": ("no_partial_tail", False, True),  # likewise
    "shared_prefix_junction": ("junction", True, False),
    "block_mask": ("block_mask", True, False),
    "eagle_aware_mask": ("eagle_mask", True, False),
    "mamba_retention": ("mamba_retention", True, False),
    "free_order": ("caller_order", "caller", "append"),
    "eagle_margin_skips_mamba": ("mamba_no_margin", True, False),
    "mamba_checkpoint": ("mamba_any_block", "any_block", "in_block"),
    "mamba_count_capped": ("mamba_capped", True, False),
    "mamba_retired_mark": ("mamba_retire", True, False),
    "mask_hit_grid": ("hit_grid_mask", True, False),
}


def _run(case: Case, profile: Profile) -> list[Observation | Snapshot]:
    model = AllocatorModel(case.config, events="vllm-0.33.0", profile=profile)
    out: list[Observation | Snapshot] = []
    for op in case.ops:
        out += [model.apply(op), model.snapshot()]
    return out


def _newer(case: Case) -> Profile:
    """The 0.33.0 rule for the case's switch (with the release's other switches the trace needs)."""
    return replace(MODELED, **dict(case.base))


def _older(case: Case) -> Profile:
    return replace(_newer(case), **{case.switch: case.old})


def test_the_default_profile_is_the_modeled_release() -> None:
    assert Profile() == MODELED and MODELED.differences() == []
    assert Profile(eagle_junction_peek=False).differences() == ["eagle_junction_peek"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_switch_changes_the_prediction_on_its_trace(name: str) -> None:
    case = CASES[name]
    assert _run(case, _newer(case)) != _run(case, _older(case))


def _stored(snaps: list[Observation | Snapshot], group: int) -> list[tuple[int, ...]]:
    return [
        h
        for s in snaps
        if isinstance(s, Snapshot)
        for e in s.events
        if isinstance(e, BlockStored) and e.group == group
        for h in e.block_hashes
    ]


def test_junction_peek_keeps_the_block_below_the_junction() -> None:
    # b's junction is 8 (a's full blocks, less Eagle's drop); under retention 0
    # 0.33.0 also keeps the SWA block ending at 4 (the peek a sibling diverging
    # at the junction drops); 0.32.0 keeps only the junction's own tail.
    case = CASES["eagle_junction_peek"]
    junction = [o for o in _run(case, MODELED) if isinstance(o, ScheduleResult)][-1].shared_prefix_boundary
    assert junction == 8
    swa_new, swa_old = (_stored(_run(case, p)[-1:], 1) for p in (MODELED, _older(case)))
    assert swa_new == [SHARED[:4], SHARED[:8]] and swa_old == [SHARED[:8]]


def test_partial_tail_before_the_limit_fix_keys_nothing_on_an_aligned_prompt() -> None:
    # 8-token prompt, full block 8, hash block 4: 0.32.0 keys its 4-token
    # boundary (prompt - 1 = 7 rounds to 4); 0.31.0 takes 8, a whole block: no partial key.
    case = CASES["partial_tail_excludes_last_token"]
    new, old = (_stored(_run(case, p), 0) for p in (MODELED, _older(case)))
    assert (2, 2, 2, 1) in new and (2, 2, 2, 1) not in old


def test_eagle_margin_capped_by_the_limit_loses_the_hit() -> None:
    # Probe of the whole computed prompt (limit 7, 8 hashed): 0.32.0 looks to
    # 8 and drops back to a 4-token hit; 0.31.0 looks only to 7 and its Eagle
    # drop leaves nothing.
    case = CASES["eagle_margin_to_hashed"]
    new, old = (_run(case, p)[-2] for p in (MODELED, _older(case)))
    assert isinstance(new, ProbeResult) and isinstance(old, ProbeResult)
    assert (new.hit, old.hit) == (4, 0)


def test_eagle_replay_boundaries_keep_the_block_below_the_last_aligned_one() -> None:
    # 9-token prompt, Eagle, block 4, retention 0: 0.30.0 resumes a replay at
    # 4 (one block below 8) and keeps the SWA tail ending there plus Eagle's
    # peek (blocks 0, 1); 0.29.0 keeps the tail of 8 = prompt - 1 floored,
    # whose only full block is block 1.
    case = CASES["eagle_replay_boundaries"]
    prompt = (2, 1, 1, 2, 1, 1, 1, 1, 2)
    new, old = (_stored(_run(case, p), 1) for p in (MODELED, _older(case)))
    assert new == [prompt[:4], prompt[:8]] and old == [prompt[:8]]


def test_caching_off_frees_to_the_head_only_after_the_lifo_change() -> None:
    # Caching off, 7 usable blocks, a request of 9 tokens holds blocks 1..3 and
    # frees them last block first: 0.29.0 puts them at the head, 0.27.0 at the tail.
    case = CASES["caching_off_free_to_head"]
    new, old = (_run(case, p)[-1] for p in (MODELED, _older(case)))
    assert isinstance(new, Snapshot) and isinstance(old, Snapshot)
    assert new.free_queue == (3, 2, 1, 4, 5, 6, 7)
    assert old.free_queue == (4, 5, 6, 7, 3, 2, 1)


def test_before_the_block_mask_every_full_swa_block_is_cached() -> None:
    # Full 8 + SWA 4 (window 5), dense: the mask keeps the one SWA block a hit at
    # each 8-token boundary needs; 0.21.0 caches both.
    case, p = CASES["block_mask"], (1, 2, 2, 2, 2, 2, 1, 1)
    new, old = (_stored(_run(case, pr), 1) for pr in (MODELED, _older(case)))
    assert new == [p[:8]] and old == [p[:4], p[:8]]


def test_the_eagle_aware_mask_keeps_the_peek_block() -> None:
    # The same with Eagle: #44082 shifts the kept tail up by Eagle's peek block and
    # lengthens it by one (blocks 0 and 1); 0.22.0's mask ignores Eagle (block 1 only).
    case, p = CASES["eagle_aware_mask"], (1, 2, 2, 2, 2, 2, 1, 1)
    new, old = (_stored(_run(case, pr), 1) for pr in (MODELED, _older(case)))
    assert new == [p[:4], p[:8]] and old == [p[:8]]


def test_before_mamba_retention_every_state_is_cached() -> None:
    # Retention 0, a 4-token prompt: its only state (at 4) is above the replay
    # boundary 3, so #45845 drops it; 0.23.0 caches it.
    case = CASES["mamba_retention"]
    new, old = (_stored(_run(case, pr), 2) for pr in (MODELED, _older(case)))
    assert new == [] and old == [(1, 2, 2, 2)]


def test_free_order_before_the_pool_rule() -> None:
    # A finished 5-token request holds cached block 1 and uncached block 2.
    # Pool rule: 2 to the head, 1 to the tail; 0.23.0 ("caller") appends both.
    case = CASES["free_order_caller"]
    new, old = (_run(case, pr)[-1] for pr in (MODELED, _older(case)))
    assert isinstance(new, Snapshot) and isinstance(old, Snapshot)
    assert new.free_queue == (2, 3, 4, 5, 6, 7, 1) and old.free_queue == (3, 4, 5, 6, 7, 2, 1)
    # 0.22.0 ("append") also appends SWA's uncached blocks, where "caller" lets SWA split them.
    case = CASES["free_order_append"]
    caller, append = (_run(case, replace(MODELED, free_order=o))[-1] for o in ("caller", "append"))
    assert isinstance(caller, Snapshot) and isinstance(append, Snapshot)
    assert append.free_queue == (5, 6, 7, 8, 9, 10, 11, 2, 1, 4, 3)
    assert caller.free_queue[0] == 4 and caller.free_queue != append.free_queue


def test_before_partial_entries_no_key_inside_a_block() -> None:
    # The 8-token prompt of the tail case: 0.26.0 keys its 4-token boundary inside
    # the 8-token full block; 0.25.0 keys whole blocks only.
    case = CASES["partial_tail"]
    new, old = (_stored(_run(case, pr), 0) for pr in (MODELED, _older(case)))
    assert new == [(2, 2, 2, 1, 1, 1, 1, 2), (2, 2, 2, 1)] and old == [(2, 2, 2, 1, 1, 1, 1, 2)]


def test_before_the_junction_a_lookup_reports_none() -> None:
    case = CASES["shared_prefix_junction"]
    new, old = (
        [o for o in _run(case, pr) if isinstance(o, ScheduleResult)][-1] for pr in (MODELED, _older(case))
    )
    assert (new.shared_prefix_boundary, old.shared_prefix_boundary) == (8, 0)


def test_mamba_margin_before_the_fix_gives_a_hit_without_full_blocks() -> None:
    # a's state at 2 is cached; a probe of (1, 2, 3, 3, 3): full attention finds
    # one block and drops it (Eagle). 0.25.0 then searches Mamba one block past
    # that empty candidate, finds the state at 2 and settles on a 2-token hit
    # whose full-attention layout is empty (the known finding
    # vllm-eagle-mamba-hit-without-full-blocks); #46384 gives Mamba no margin: 0.
    case = CASES["eagle_margin_skips_mamba"]
    new, old = (_run(case, p)[-2] for p in (MODELED, _older(case)))
    assert isinstance(new, ProbeResult) and isinstance(old, ProbeResult)
    assert (new.hit, new.hit_blocks[0]) == (0, ())
    assert old.hit == 2 and old.hit_blocks[0] == () and len(old.hit_blocks[1]) == 1


def _mamba_stored(case: Case, profile: Profile) -> list[tuple[int, ...]]:
    return _stored(_run(case, profile), 1)


def test_mamba_checkpoint_on_a_block_edge_is_keyed_only_from_0_32() -> None:
    # 10-token prompt, Eagle, Mamba block = hash block 2, computed to 8: the
    # checkpoint is 10 - 2 = 8, a Mamba block edge that retention 0 does not
    # keep (its replay boundary is 4). 0.32.0 keys it; 0.31.0 keys only a
    # checkpoint inside a block, so nothing at 8.
    case = CASES["mamba_checkpoint_in_block_drop"]
    p = (1, 2, 1, 1, 2, 2, 1, 2, 2, 1)
    new, old = (_mamba_stored(case, pr) for pr in (MODELED, _older(case)))
    assert p[:8] in new and p[:8] not in old


def test_mamba_checkpoint_before_the_eagle_drop_sits_at_the_prompt_end() -> None:
    # 6-token prompt, Eagle, Mamba block 4, hash block 2: 0.29.0 keys the state
    # at 6 (the prompt's last hash boundary, inside block 1); 0.30.0 lowers it
    # by Eagle's hash block to 4, a block edge it leaves to the mask.
    case = CASES["mamba_checkpoint_in_block"]
    p = (1, 2, 1, 1, 2, 2)
    drop, no_drop = (
        _mamba_stored(case, replace(MODELED, mamba_checkpoint=r)) for r in ("in_block_drop", "in_block")
    )
    assert p[:6] in no_drop and p[:6] not in drop


def test_an_uncapped_mamba_count_refuses_a_request_that_fits() -> None:
    # b hits 12 tokens of a's prompt; its Mamba hit ends inside an 8-token block,
    # so it needs one new block, the copy's destination. 0.31.0 asks for that
    # one and b fits the 6 usable blocks; 0.30.0 raises any positive need to
    # the cap (running state + copy = 2) and b waits.
    case = CASES["mamba_count_capped"]
    new, old = (_run(case, pr)[-2] for pr in (MODELED, _older(case)))
    assert isinstance(new, ScheduleResult) and isinstance(old, ScheduleResult)
    assert (new.admitted, new.hit, len(new.copies)) == (True, 12, 1)
    assert (old.admitted, old.hit) == (False, 12)


def test_the_mamba_checkpoint_rule_is_read_from_the_manager() -> None:
    caps = [
        detect_from(_fake_namespace(**{f: True}), "0.0.0").mamba_checkpoint for f in ("mamba_in_block_drop",)
    ]
    assert caps == ["in_block_drop"]
    assert detect_from(_fake_namespace(), "0.0.0").mamba_checkpoint == "in_block"  # control


def test_before_the_block_mask_caching_is_not_floored_to_the_hit_grid() -> None:
    # Full 8 + SWA 2 over hash blocks of 2, 2 tokens computed: #42258 floors the
    # cacheable length to the 8-token hit grid (nothing cached); 0.21.0 caches
    # the SWA block of the 2 computed tokens.
    case = CASES["block_mask_alignment"]
    new, old = (_stored(_run(case, pr), 1) for pr in (MODELED, _older(case)))
    assert new == [] and old == [(1, 2)]


def test_before_the_eagle_aware_mask_no_peek_block_past_the_grid() -> None:
    # Full 4 + SWA 8, Eagle, a 13-token prompt: #44082 lets each group cache one
    # block past the 8-token grid (Eagle's peek), so full attention keys 12
    # tokens; 0.22.0 stops at the grid (8).
    case = CASES["eagle_aware_mask_peek_caching"]
    new, old = (_stored(_run(case, pr), 0) for pr in (MODELED, _older(case)))
    assert [len(p) for p in new] == [4, 8, 12] and [len(p) for p in old] == [4, 8]


def test_before_the_retired_mark_a_state_below_a_null_leaves_as_the_stale_state() -> None:
    # Mamba 2 'align', caching off, "caller" free order: at 8 computed tokens the
    # skipped range holds state block 4 under a null gap. 0.30.0 frees it there
    # (caching off: to the head); 0.23.0's walk stops at the gap and block 4
    # leaves as the stale state, appended.
    case = CASES["mamba_retire_past_nulls"]
    new, old = (_run(case, pr)[-1] for pr in (_newer(case), _older(case)))
    assert isinstance(new, Snapshot) and isinstance(old, Snapshot)
    assert new.free_queue[0] == 4 and old.free_queue[-1] == 4


def test_before_the_hit_grid_masks_keep_the_tail_of_the_scheduler_block() -> None:
    # Full 16 + SWA 4 (window 11) + Mamba 16, hash block 4 (fine-grained hits),
    # retention 0, a 22-token prompt: the replay boundary 21 floored to the hit
    # grid is 20, whose SWA tail ends at 12, 16, 20 (20 is not computed yet in
    # the first 16-token chunk). 0.28.0 floors it to the scheduler block (16) and
    # keeps the tail ending at 8, 12, 16.
    case = CASES["masks_on_hit_grid"]
    new, old = (_stored(_run(case, pr), 1) for pr in (MODELED, _older(case)))
    assert [len(p) for p in new] == [12, 16] and [len(p) for p in old] == [8, 12, 16]


@pytest.mark.parametrize("capability", sorted(FAKE_FLAG))
def test_each_switch_follows_its_detected_capability(capability: str) -> None:
    switch = next(c.switch for c in CASES.values() if c.capability == capability)
    flag, value, control = FAKE_FLAG[capability]
    without = detect_from(_fake_namespace(), "0.0.0")
    with_it = detect_from(_fake_namespace(**{flag: True}), "0.0.0")
    assert getattr(with_it.profile(), switch) == value
    assert getattr(without.profile(), switch) == control  # control: the other release


# ----------------------------------------------------------------------------- on the releases
_CHECK = """
import json, sys
from invariants.harness.checker import Checker
from invariants.harness.trace import read_trace
from invariants.targets.vllm_target import VllmManagerTarget
from model.contract.profile import MODELED
def check(path):
    trace = read_trace(path)
    out = {}
    for label in ("detected", "modeled"):
        target = VllmManagerTarget(trace.config)
        if label == "modeled":
            target.profile = MODELED
        checker = Checker(target, check_invariants=False)
        out[label] = [str(v)[:200] for op in trace.ops for v in checker.step(op)
                      if v.check in ("observation", "snapshot")]
    return out
print(json.dumps([check(path) for path in json.loads(sys.argv[1])]))
"""


def _run_release(python: Path, script: str, traces: list[Path], *extra: str) -> list[dict[str, Any]]:
    """`script`'s findings on each trace, in one process of the release's interpreter
    (vLLM imported once per release, not once per case: the costly part)."""
    proc = subprocess.run(
        [str(python), "-c", script, json.dumps([str(t) for t in traces]), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    found: list[dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(found) == len(traces)
    return found


@pytest.fixture(scope="module")
def on_release(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The `_CHECK` findings of every case run on one release, computed once per release:
    `on_release(python, release)[name]`."""
    done: dict[str, dict[str, dict[str, Any]]] = {}

    def run(python: Path, release: str) -> dict[str, dict[str, Any]]:
        if release not in done:
            names = sorted(n for n, c in CASES.items() if c.release == release)
            d = tmp_path_factory.mktemp(f"release-{release}")
            traces = [
                write_trace(
                    Trace(CASES[n].config, list(CASES[n].ops), 0, "vllm-manager", ""), d / f"{n}.json"
                )
                for n in names
            ]
            done[release] = dict(zip(names, _run_release(python, _CHECK, traces), strict=True))
        return done[release]

    return run


def test_make_test_installs_a_release_the_cases_run_on(release_envs: Any) -> None:
    # Under CI a run outside `make test` (no required release) would skip every
    # case below unseen; so would a TEST_RELEASES that no case names.
    releases = sorted({c.release for c in CASES.values()})
    if not release_envs.required:
        if not release_envs.ci:
            pytest.skip("no release environment is required (KVRETAIN_TEST_RELEASES unset: not `make test`)")
        pytest.fail("KVRETAIN_TEST_RELEASES is unset: under CI the suite must run through `make test`")
    assert release_envs.required & set(releases), (
        f"`make test` installs {sorted(release_envs.required)}, none of the releases the cases run on {releases}"
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_release_before_the_mechanism_agrees_with_its_profile_only(
    name: str, release_envs: Any, on_release: Any
) -> None:
    case = CASES[name]
    python = release_envs.python(case.release)
    found = on_release(python, case.release)[name]
    assert found["detected"] == []
    assert found["modeled"], "control: the 0.33.0 profile should disagree with this release"


_CHECK_OLDER = (
    _CHECK.replace('for label in ("detected", "modeled"):', 'for label in ("detected", "older"):')
    .replace(
        'if label == "modeled":\n            target.profile = MODELED',
        'if label == "older":\n            target.profile = replace(target.profile, **json.loads(sys.argv[2]))',
    )
    .replace("from model.contract.profile import MODELED", "from dataclasses import replace")
)


@pytest.mark.parametrize(("name", "release"), [("masks_on_hit_grid", "0.29.0")])
def test_the_release_with_the_mechanism_disagrees_with_the_older_rule(
    name: str, release: str, tmp_path: Path, release_envs: Any
) -> None:
    """The other direction: on the first release with the mechanism, its detected
    profile agrees and the same profile with the older rule disagrees."""
    case = CASES[name]
    assert "older" in _CHECK_OLDER and "MODELED" not in _CHECK_OLDER  # the script was rewritten
    python = release_envs.python(release)
    trace = write_trace(Trace(case.config, list(case.ops), 0, "vllm-manager", ""), tmp_path / "t.json")
    [found] = _run_release(python, _CHECK_OLDER, [trace], json.dumps({case.switch: case.old}))
    assert found["detected"] == []
    assert found["older"], f"control: the older rule of {case.switch} should disagree with {release}"
