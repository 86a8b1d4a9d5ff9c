"""vLLM's request hashes lent to a probe, and the fields of the KV events that carry them.

A probe is a throw-away request: hashing its whole prompt from scratch costs
O(prompt) sha256 work per probe, which dominates at production scale (a
1M-token resend). Most of a probe's prompt is a prefix some live request
already hashed, and vLLM's hashes chain (hash i depends only on blocks
[0, i]), so the probe takes those hashes as they are (`shared_hashes`) and
vLLM's own hasher hashes only the rest (`continuing`). The hashes stay
vLLM's: nothing here computes or assumes one.

KV events: every field of vLLM 0.33.0's `BlockStored` / `BlockRemoved`
(`STORED_FIELDS`, `REMOVED_FIELDS`) becomes the model's event field of the
same name (`event_fields`; the adapter names the hashes). A field a release
lacks takes the model's value, so it agrees without being compared, and
`EventGaps.uncompared` names it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from model.contract.config import Config
from model.contract.observation import BlockStored
from model.machine.pool import no_extra_keys, spec_metadata

# vLLM 0.33.0's KV event fields (`vllm/distributed/kv_events.py`). The first five of
# BlockStored (two of BlockRemoved) are the model's group, block_hashes, parent,
# token_ids, block_size (group, block_hash), named by the adapter; the rest are read
# by `event_fields`. tests/test_event_fields.py holds vLLM's classes to these lists.
STORED_FIELDS = (
    *("group_idx", "block_hashes", "parent_block_hash", "token_ids", "block_size"),
    *("kv_cache_spec_kind", "kv_cache_spec_sliding_window", "extra_keys", "medium", "lora_id"),
    *("lora_name", "lookahead_token_ids", "session_id", "locality", "ownership"),
)
REMOVED_FIELDS = ("group_idx", "block_hashes", "medium", "locality", "ownership")


@dataclass(frozen=True)
class EventGaps:
    """The fields of `STORED_FIELDS[5:]` / `REMOVED_FIELDS[2:]` a release's events
    lack, and the fields its events have that neither list names (untranslated).
    A release lacking one of the first fields cannot be driven (an adapter gap)."""

    stored: frozenset[str]
    removed: frozenset[str]
    unknown: frozenset[str]

    def uncompared(self) -> tuple[str, ...]:
        """Every event field no comparison sees on the release, by name."""
        return tuple(
            sorted(
                [f"BlockStored.{n}" for n in self.stored]
                + [f"BlockRemoved.{n}" for n in self.removed]
                + [f"untranslated {n}" for n in self.unknown]
            )
        )


def struct_fields(cls: Any) -> frozenset[str]:
    """A msgspec struct's fields (vLLM's KV events), else a dataclass's."""
    names = getattr(cls, "__struct_fields__", None)
    return frozenset(names if names is not None else (f.name for f in dataclasses.fields(cls)))


def event_gaps(stored: frozenset[str], removed_cls: Any) -> EventGaps:
    """The gaps of a release whose `BlockStored` has the fields `stored`
    (`Capabilities.event_fields`) and whose `BlockRemoved` is `removed_cls`."""
    removed = struct_fields(removed_cls)
    return EventGaps(
        frozenset(STORED_FIELDS[5:]) - stored,
        frozenset(REMOVED_FIELDS[2:]) - removed,
        (stored - frozenset(STORED_FIELDS)) | (removed - frozenset(REMOVED_FIELDS)),
    )


def event_fields(ev: Any, cls: type, gaps: EventGaps, config: Config, num_hashes: int) -> dict[str, Any]:
    """The fields of the model's `cls` (BlockStored or BlockRemoved) beyond the hashes,
    tokens and sizes, read from vLLM's event `ev` of `num_hashes` hashes; lists as
    tuples. A field the release lacks (`gaps`) takes the model's value for `config`:
    the group's spec (`spec_metadata`), no extra keys, else the default of `cls`."""
    names, lacks = (
        (STORED_FIELDS[5:], gaps.stored) if cls is BlockStored else (REMOVED_FIELDS[2:], gaps.removed)
    )
    out = {n: getattr(ev, n) for n in names if n not in lacks}
    if lacks:
        kind, window = spec_metadata(config.groups)[ev.group_idx]
        model = {"kv_cache_spec_kind": kind, "kv_cache_spec_sliding_window": window}
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        defaults.update(model, extra_keys=no_extra_keys(num_hashes))
        out.update((n, defaults[n]) for n in names if n in lacks)
    extra, ahead = out.get("extra_keys"), out.get("lookahead_token_ids")
    if extra is not None:
        extra = tuple(extra)  # one entry per hash: thousands at production scale, mostly None
        if extra.count(None) != len(extra):
            extra = tuple(None if k is None else tuple(k) for k in extra)
        out["extra_keys"] = extra
    if ahead is not None:
        out["lookahead_token_ids"] = tuple(map(tuple, ahead))
    return out


def continuing(hasher: Any, known: list[Any]) -> Any:
    """vLLM's request hasher for a request whose first block hashes are `known`.

    A hasher returns the hashes of the request's full blocks past
    `len(request.block_hashes)`, chained from the last one; on its first call
    this one fills the empty list with `known`, so vLLM hashes on from there."""
    pending = [list(known)]

    def hash_new_full_blocks(request: Any) -> Any:
        if pending:
            request.block_hashes.extend(pending.pop())
        return hasher(request)

    return hash_new_full_blocks


def shared_hashes(
    tokens: list[int], donors: Iterable[Any], hash_block_size: int, lookahead: int = 0
) -> list[Any]:
    """The hashes of the longest run of full blocks `tokens` shares with one of the
    `donors` (requests vLLM hashed), from their start; under `lookahead` L a block's hash
    also covers the L tokens after it, so those must agree too (`get_request_block_hasher`)."""
    best: list[Any] = []
    full = max(0, len(tokens) - lookahead) // hash_block_size
    for req in donors:
        n = min(full, len(req.block_hashes))
        if n <= len(best):
            continue
        ids = req.all_token_ids
        if ids[:hash_block_size] != tokens[:hash_block_size]:
            continue
        # Blocks [0, lo) agree, [0, hi) do not; each comparison reads only new tokens.
        lo, hi = 1, n + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            a, b = lo * hash_block_size, mid * hash_block_size
            if ids[a:b] == tokens[a:b]:
                lo = mid
            else:
                hi = mid
        end = lo * hash_block_size
        if lookahead and ids[end : end + lookahead] != tokens[end : end + lookahead]:
            lo -= 1  # the last agreeing block's lookahead differs (L <= a block: the rest agree)
        if lo > len(best):
            best = list(req.block_hashes[:lo])
    return best
