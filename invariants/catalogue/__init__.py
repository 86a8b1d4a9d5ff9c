"""The invariant catalogue: every property kvretain checks after each operation.

Each invariant is a named function `f(ctx: CheckContext) -> list[str]` (one
message per violation, empty when it holds) whose docstring says what it guards
and which seed or bug it comes from. Modules: `structure` (accounting),
`ordering` (eviction order, pinned tier), `retention` (masks and hits),
`promises` (kept hits, scratch), `events` (KV events), `liveness`, `steps`
(what one scheduler step's forward pass reads stays put).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from invariants.catalogue import events, liveness, ordering, promises, retention, steps, structure
from invariants.catalogue.context import CheckContext, History, RequestHistory
from invariants.catalogue.history import update_history


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
    *_family(retention, "masks", ["no_waste", "hit_backed_by_cache", "hit_blocks_hold_their_prefix"]),
    *_family(promises, "promises", ["promise_kept", "eagle_extra_block_kept", "scratch_never_flushes_cache"]),
    *_family(events, "events", ["events_match_hash_map", "stored_tokens_match_hashes"]),
    *_family(liveness, "liveness", ["fitting_request_admitted"]),
    *_family(steps, "steps", ["step_blocks_stay_held", "mamba_state_not_read_while_written"]),
]
BY_NAME = {inv.name: inv for inv in INVARIANTS}


def check_all(ctx: CheckContext) -> list[tuple[str, str]]:
    """Run every invariant; return (invariant name, message) for each violation."""
    return [(inv.name, msg) for inv in INVARIANTS for msg in inv.check(ctx)]


__all__ = [
    "BY_NAME",
    "INVARIANTS",
    "CheckContext",
    "History",
    "Invariant",
    "RequestHistory",
    "check_all",
    "update_history",
]
