"""The invariant catalogue: every property kvretain checks after each operation.

Each invariant is a named function `f(ctx: CheckContext) -> list[str]` (one
message per violation, empty when it holds) whose docstring says what it guards
and which seed or bug it comes from. Modules: `structure` (accounting),
`ordering` (eviction order, pinned tier), `retention` (masks and hits),
`promises` (kept hits, scratch), `events` (KV events), `liveness`, `headroom`
(the watermark an admission leaves), `steps`
(what one scheduler step's forward pass reads stays put), `cow` (copy-on-write
copies of fine-grained Mamba hits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from invariants.catalogue import (
    cow,
    events,
    headroom,
    isolation,
    liveness,
    ordering,
    promises,
    retention,
    steps,
    structure,
)
from invariants.catalogue.context import (
    CachedView,
    CheckContext,
    Delta,
    History,
    RefCounts,
    RequestHistory,
    StateView,
)
from invariants.catalogue.history import advance_requests, forget, update_history, update_history_delta
from invariants.catalogue.incremental import DELTA_CHECKS


@dataclass(frozen=True)
class Invariant:
    name: str
    family: str
    check: Callable[[CheckContext], list[str]]

    @property
    def doc(self) -> str:
        return " ".join((self.check.__doc__ or "").split())


def _family(module: object, family: str, names: list[str]) -> list[Invariant]:
    return [Invariant(n, family, getattr(module, n)) for n in names]


INVARIANTS: list[Invariant] = [
    *_family(
        structure,
        "structure",
        [
            "block_in_exactly_one_place",
            "no_negative_ref_count",
            "free_queue_has_no_duplicates",
            "ref_count_matches_tables",
            "hash_map_points_at_holders",
        ],
    ),
    *_family(
        ordering,
        "ordering",
        [
            "uncached_reused_before_cached",
            "cached_reused_lru_first",
            "pinned_reused_only_under_pressure",
            "pinned_demoted_oldest_first",
            "pinned_blocks_are_cached",
        ],
    ),
    *_family(
        retention,
        "masks",
        ["no_waste", "hit_backed_by_cache", "hit_blocks_hold_their_prefix", "hit_serves_written_kv"],
    ),
    *_family(promises, "promises", ["promise_kept", "eagle_extra_block_kept", "scratch_never_flushes_cache"]),
    *_family(events, "events", ["events_match_hash_map", "stored_tokens_match_hashes"]),
    *_family(liveness, "liveness", ["fitting_request_admitted"]),
    *_family(headroom, "headroom", ["admission_keeps_watermark"]),
    *_family(
        steps,
        "steps",
        [
            "step_blocks_stay_held",
            "mamba_state_not_read_while_written",
            "mamba_state_in_worker_table",
            "step_reads_written_kv",
        ],
    ),
    *_family(cow, "copies", ["copies_sound"]),
    *_family(
        isolation,
        "isolation",
        ["hit_written_by_same_identity", "events_carry_block_keys", "router_sees_target_hits"],
    ),
]
BY_NAME = {inv.name: inv for inv in INVARIANTS}


def check_all(ctx: CheckContext) -> list[tuple[str, str]]:
    """Run every invariant; return (invariant name, message) for each violation."""
    return [(inv.name, msg) for inv in INVARIANTS for msg in inv.check(ctx)]


# Invariants about the whole state: they need only `after` and the history, so
# an audit between operations can run them. The others judge one operation.
STATE_INVARIANTS: tuple[str, ...] = (
    "block_in_exactly_one_place",
    "no_negative_ref_count",
    "free_queue_has_no_duplicates",
    "ref_count_matches_tables",
    "hash_map_points_at_holders",
    "uncached_reused_before_cached",
    "cached_reused_lru_first",
    "pinned_blocks_are_cached",
    "events_match_hash_map",
)
# Left to the audit on the fast path: duplicates in a linked list are a
# corruption only a walk shows (a state invariant: every audit runs it), and
# the pinned tier's rules, whose configurations are audited on every operation.
# (The step and copy invariants read only the tables of the requests a step
# names, their blocks' ref counts and the copy endpoints, which the delta holds.)
AUDIT_ONLY = frozenset(
    {
        "free_queue_has_no_duplicates",
        "pinned_reused_only_under_pressure",
        "pinned_demoted_oldest_first",
        "pinned_blocks_are_cached",
    }
)
# The pinned tier's invariants: a configuration with a pinned tier has no fast
# path (its demotions move blocks pool-wide), so every operation is audited.
PINNED_TIER = frozenset(
    {"pinned_reused_only_under_pressure", "pinned_demoted_oldest_first", "pinned_blocks_are_cached"}
)


def check_state(ctx: CheckContext) -> list[tuple[str, str]]:
    """The state invariants only (an audit between operations)."""
    return [(name, msg) for name in STATE_INVARIANTS for msg in BY_NAME[name].check(ctx)]


# The fast path's checks, in catalogue order: each invariant's delta form where it has one.
FAST_CHECKS: tuple[tuple[str, Callable[[CheckContext], list[str]]], ...] = tuple(
    (inv.name, DELTA_CHECKS.get(inv.name, inv.check)) for inv in INVARIANTS if inv.name not in AUDIT_ONLY
)


# Checks that read only the touched blocks and keys (the delta forms, and
# `no_waste`, which reads the keys that gained holders): an operation that
# touched neither (an add, a probe, a sample) gives them nothing to report.
_ON_TOUCHED = frozenset(DELTA_CHECKS) | {"no_waste"}
_UNTOUCHED_CHECKS = tuple((name, check) for name, check in FAST_CHECKS if name not in _ON_TOUCHED)


def coverage_gaps(
    audit_only: frozenset[str] | None = None, state: tuple[str, ...] | None = None
) -> list[str]:
    """The invariants some operation escapes: neither the fast path runs them on
    it nor every audit. The fast path runs every invariant outside `AUDIT_ONLY`
    (an operation that touched no block or key skips only the checks that
    report on touched ones); every audit runs `STATE_INVARIANTS`; an audited
    operation runs all; a pinned-tier configuration audits every operation.
    Empty is the guarantee docs/reading-a-failure.md states."""
    audit_only = AUDIT_ONLY if audit_only is None else audit_only
    state = STATE_INVARIANTS if state is None else state
    return [
        inv.name
        for inv in INVARIANTS
        if inv.name in audit_only and inv.name not in state and inv.name not in PINNED_TIER
    ]


def check_delta(ctx: CheckContext) -> list[tuple[str, str]]:
    """Every invariant on the fast path: state invariants on the touched part, the rest as defined."""
    d = ctx.delta
    assert d is not None
    checks = FAST_CHECKS if d.blocks or d.holders else _UNTOUCHED_CHECKS
    return [(name, msg) for name, check in checks for msg in check(ctx)]


__all__ = [
    "AUDIT_ONLY",
    "BY_NAME",
    "INVARIANTS",
    "PINNED_TIER",
    "STATE_INVARIANTS",
    "CachedView",
    "CheckContext",
    "Delta",
    "History",
    "Invariant",
    "RefCounts",
    "RequestHistory",
    "StateView",
    "advance_requests",
    "check_all",
    "check_delta",
    "check_state",
    "coverage_gaps",
    "forget",
    "update_history",
    "update_history_delta",
]
