"""The hybrid hit: the longest prefix every group can serve, as a fixed point.

vLLM `kv_cache_coordinator.py` `HybridKVCacheCoordinator.find_longest_cache_hit`.
Groups sharing one spec are looked up together (`spec_groups`), full
attention first: its hit is downward closed, so it is the tightest first
bound and later rounds only trim it. Each spec group either accepts the
candidate hit or lowers it; a lowered candidate restarts the round, since a
group that accepted the longer one may not serve the shorter (SWA and Mamba
hits are not downward closed). With full attention and one other spec the
other group's answer is final (one round).

Under Eagle each group drops its last block once per candidate; a lower
candidate voids the drops already made, and a group's look past the
candidate is its margin (`model.contract.eagle`).

The junction (shared-prefix boundary): the longest hit any group reached
alone, when it exceeds the reconciled hit: a shared prefix that a
sparse-retention group has not cached yet (caching keeps its tail).

Release variants (keyed by `model.contract.profile.Profile` switches):
- `FULL_BOUNDS` (`eagle_margin_skips_mamba`): how full attention bounds a
  later round's candidate;
- `JUNCTIONS` (`shared_prefix_junction`): whether a junction is reported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from model.contract.config import Config, GroupSpec
from model.contract.eagle import LooksPast, MarginReach
from model.contract.fine_mamba import KeyLayout, eagle_margin

Finder = Callable[[GroupSpec, list[int], int, bool], tuple[KeyLayout, int]]
"""(spec, group ids, limit, drop Eagle's block) -> the spec group's layout and hit in tokens."""


def spec_groups(specs: Sequence[GroupSpec]) -> list[list[int]]:
    """Group ids sharing one spec (looked up together), full attention first."""
    by_spec: dict[tuple[object, ...], list[int]] = {}
    for gid, spec in enumerate(specs):
        by_spec.setdefault((spec.kind, spec.block_size, spec.sliding_window), []).append(gid)
    return sorted(by_spec.values(), key=lambda gids: specs[gids[0]].kind != "full")


# ------------------------------------------------------------------ variants
def cap_at_full_hit(candidate: int, full_hit: int, block_size: int) -> int:
    """0.26.0 on (#46384): a later round caps the candidate at full attention's own hit."""
    return min(candidate, full_hit)


def realign_to_full_block(candidate: int, full_hit: int, block_size: int) -> int:
    """0.25.x and older: a later round only re-aligns the candidate to full
    attention's block, so the fixed point could settle above the full hit."""
    return candidate // block_size * block_size


FullBound = Callable[[int, int, int], int]
FULL_BOUNDS: dict[bool, FullBound] = {True: cap_at_full_hit, False: realign_to_full_block}


def longest_group_hit(longest: int, hit: int) -> int:
    """0.26.0 on: the junction is the longest hit a group reached alone, if above the hit."""
    return longest if longest > hit else 0


def no_junction(longest: int, hit: int) -> int:
    """0.25.x and older: `get_computed_blocks` reports no junction."""
    return 0


Junction = Callable[[int, int], int]
JUNCTIONS: dict[bool, Junction] = {True: longest_group_hit, False: no_junction}


@dataclass(frozen=True)
class HitRules:
    """What the fixed point needs of a configuration and a release (`model.contract.profile.Rules`)."""

    cfg: Config
    looks_past: LooksPast
    margin_reach: MarginReach
    full_bound: FullBound
    junction: Junction


# ---------------------------------------------------------------- the fixed point
def reconcile(
    specs: Sequence[GroupSpec], find: Finder, max_len: int, hashed_len: int, rules: HitRules
) -> tuple[dict[int, KeyLayout], int, int]:
    """Lower the candidate hit until every spec group serves it: (per-group
    layouts, the hit, the junction or 0)."""
    groups = spec_groups(specs)
    # Full attention plus one other spec: the other group's answer is final.
    single_round = len(groups) == 2 and specs[groups[0][0]].kind == "full"
    layouts: dict[int, KeyLayout] = {}
    group_hit: dict[int, int] = {}
    hit = max_len
    longest = 0
    # Spec groups whose Eagle block was already dropped at the current candidate:
    # dropping it again would lower the hit twice.
    eagle_dropped: set[int] = set()
    while True:
        candidate = hit
        for idx, gids in enumerate(groups):
            spec = specs[gids[0]]
            if spec.kind == "full" and gids[0] in layouts:
                # Downward closed: a shorter candidate only trims the layout found first.
                candidate = rules.full_bound(candidate, group_hit[gids[0]], spec.block_size)
                continue
            drop_eagle = rules.cfg.eagle_drop and idx not in eagle_dropped
            limit = candidate
            if drop_eagle and rules.looks_past(spec.kind):
                # Look one drop unit past the candidate so the Eagle drop lands back on it.
                reach = rules.margin_reach(hashed_len, max_len)
                limit = min(candidate + eagle_margin(rules.cfg, spec.kind, spec.block_size), reach)
            layout, this_hit = find(spec, gids, limit, drop_eagle)
            if drop_eagle:
                eagle_dropped.add(idx)
            elif this_hit < candidate:
                # A lower candidate voids the earlier groups' Eagle drops.
                eagle_dropped.clear()
            candidate = this_hit
            for gid in gids:
                layouts[gid], group_hit[gid] = layout, this_hit
            longest = max(longest, candidate)
        if candidate >= hit:
            break  # nobody lowered it: every group serves `hit`
        hit = candidate
        if single_round:
            break
    for gid, spec in enumerate(specs):
        if spec.kind == "full":
            layouts[gid] = layouts[gid][: -(-hit // spec.block_size)]
    return layouts, hit, rules.junction(longest, hit)
