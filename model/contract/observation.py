"""The observable state of an allocator: what a differential check compares.

A hash is named by its content, never by its bytes: `BlockKey(group, tokens)`
stands for "the hash of the prefix `tokens` in KV-cache group `group`". Two
allocators agree on a hash exactly when they agree on the prefix it covers, so
targets that hash differently (sha256 in vLLM, anything in the model) compare
without sharing a hash function. The prefix is a `model.contract.prefix.Prefix`, an
interned trie node: naming is O(new tokens) and equality is identity, exact
(a tuple given to `BlockKey` or to an event is interned on construction).

Block ids are compared exactly: vLLM hands them out deterministically (null
block 0, a fresh free queue in id order), so the model predicts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import NamedTuple, Union

from model.contract.prefix import Prefix, Tokens, block_name, prefix

BlockIds = tuple[int, ...]


class _GroupPrefix(NamedTuple):
    group: int
    tokens: Prefix


class BlockKey(_GroupPrefix):
    """The hash of the token prefix `tokens` in group `group` (vLLM's BlockHashWithGroupId).

    A named pair: equality, order and hash are the pair's, so they run in C (a
    prefix is interned, so two keys compare by group and node identity). Keys
    are made and compared on every operation."""

    __slots__ = ()

    def __new__(cls, group: int, tokens: Prefix | Tokens) -> BlockKey:
        if not isinstance(tokens, Prefix):
            tokens = prefix(tuple(tokens))
        return tuple.__new__(cls, (group, tokens))

    def short(self) -> str:
        return f"g{self.group}:{len(self.tokens)}t"


def block_key(group: int, tokens: Tokens, num_tokens: int, lookahead: int = 0) -> BlockKey:
    """The key of the first `num_tokens` of `tokens` in `group`: the one way
    model, adapters and invariants name a prefix's hash (with `lookahead` L > 0, a
    lookahead hash also covering the L tokens after it: `model.contract.prefix.block_name`)."""
    name = block_name(tokens, num_tokens, lookahead) if lookahead else prefix(tokens, num_tokens)
    return tuple.__new__(BlockKey, (group, name))  # already interned: no check


def _interned(p: Prefix | Tokens) -> Prefix:
    return p if isinstance(p, Prefix) else prefix(tuple(p))


# vLLM's `kv_events.MEDIUM_GPU`: the medium `BlockPool` reports (its constructor's default;
# `KVCacheManager` builds its pool without one).
MEDIUM_GPU = "GPU"


@dataclass(frozen=True, repr=False)
class BlockStored:
    """Blocks entered the hash map. `block_hashes` are the keys' prefixes, in block order.

    The fields after `block_size` are vLLM 0.33.0's `kv_events.BlockStored`
    fields of the same names, and every target's event carries the values its
    allocator emitted, so events compare field by field. The spec kind, window
    and extra keys depend on the group and the hashes (the model sets them:
    `model.machine.pool`); the others default to what vLLM sets on a GPU pool's event
    for a request without LoRA, cache salt, multimodal inputs or session id.
    """

    group: int
    block_hashes: tuple[Prefix, ...]
    parent: Prefix | None
    token_ids: Tokens
    block_size: int
    # The group's spec, named by `KVCacheManager.take_events` (`get_kv_cache_spec_kind`,
    # `get_kv_cache_spec_sliding_window`); None where it knows no such group.
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # One entry per hash, None without extra keys (`to_event_extra_keys`); None: no hash.
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None
    medium: str | None = MEDIUM_GPU  # `BlockPool._build_block_stored_event`: `self.medium`
    lora_id: int | None = None  # `_build_block_stored_event`: the request's `lora_request`
    lora_name: str | None = None
    # Per hash, the tokens past its block that it covers; None while
    # `num_hash_lookahead_tokens` is 0 (`BlockPool.cache_full_blocks`).
    lookahead_token_ids: tuple[Tokens, ...] | None = None
    session_id: str | None = None  # `_build_block_stored_event`: `request.session_id`
    locality: str | None = None  # set by offloading connectors only, never by `BlockPool`
    ownership: str | None = None  # likewise

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_hashes", tuple(_interned(h) for h in self.block_hashes))
        if self.parent is not None:
            object.__setattr__(self, "parent", _interned(self.parent))

    def __repr__(self) -> str:
        return _event_repr(self, ("group", "block_size"), ("block_hashes", "parent", "token_ids"))


@dataclass(frozen=True, repr=False)
class BlockRemoved:
    """One key left the hash map (vLLM's `BlockRemoved` lists one hash per event from
    `BlockPool._emit_block_removed_events`; the rest as `BlockStored`)."""

    group: int
    block_hash: Prefix
    medium: str | None = MEDIUM_GPU  # `_emit_block_removed_events`: `self.medium`
    locality: str | None = None  # set by offloading connectors only
    ownership: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_hash", _interned(self.block_hash))

    def __repr__(self) -> str:
        return _event_repr(self, ("group",), ("block_hash",))


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


def _event_repr(ev: object, first: tuple[str, ...], last: tuple[str, ...]) -> str:
    """`first`, the other fields not at their defaults (vLLM's wire format omits
    those too), then `last`: a difference message is cut at a few hundred
    characters, so the short fields come before the token lists."""
    parts = [f"{name}={getattr(ev, name)!r}" for name in first]
    for f in fields(ev):  # type: ignore[arg-type]
        value = getattr(ev, f.name)
        if f.name in first or f.name in last or value == f.default:
            continue
        if isinstance(value, tuple) and len(value) > 1 and all(v is None for v in value):
            parts.append(f"{f.name}=(None,) * {len(value)}")
        else:
            parts.append(f"{f.name}={value!r}")
    parts += [f"{name}={getattr(ev, name)!r}" for name in last]
    return f"{type(ev).__name__}({', '.join(parts)})"


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class ScheduleResult:
    """Outcome of one `Schedule` step.

    `scheduled` is the number of new tokens the step computed (0 when the
    request was not scheduled: allocation failed or the chunk rounded to 0).
    `admitted` is True only on the step that admitted a waiting request (never
    for a request that was already running).
    Admission fields (`hit`, `shared_prefix_boundary`, `hit_blocks`) are None
    for a request that was already running. `new_blocks` is the per-group list
    `allocate_slots` returned (null padding included), None when it failed.
    `copies`: the copy-on-write copies (source block, destination block) the
    step queued, in vLLM's order (`take_kv_cache_block_copies`); a copy's
    endpoints are released when the step ends.
    `external`: the tokens past the hit a KV connector supplied at this
    admission (`model.machine.connector`; with an async load, `scheduled` is 0).
    """

    scheduled: int
    admitted: bool
    hit: int | None = None
    shared_prefix_boundary: int | None = None
    hit_blocks: tuple[BlockIds, ...] | None = None
    new_blocks: tuple[BlockIds, ...] | None = None
    copies: tuple[tuple[int, int], ...] = ()
    external: int = 0


class Queues(NamedTuple):
    """A scheduler's queues when a step ends, restricted to the requests the step
    names, each front to back (`model.policy.queues`): `running`, `holding` (vLLM's
    `kv_holding_waiting`: waiting requests that hold blocks) and `waiting`."""

    running: tuple[str, ...]
    holding: tuple[str, ...]
    waiting: tuple[str, ...]


@dataclass(frozen=True)
class StepResult:
    """Outcome of one `Step`: per request the step reached, in the order it was
    reached, its `ScheduleResult`; then the requests preempted to make room, in
    preemption order. A request the step never reached (budget spent, or the
    admissions ended) has no entry. `copies`: the step's copy-on-write copies
    (as `ScheduleResult.copies`), taken once for the whole step. `queues`: the
    order the step left its queues in (`model.policy.queues`); None where it is not
    observed (a target that keeps no scheduler queues: `TargetFeatures.queues`)."""

    results: tuple[tuple[str, ScheduleResult], ...]
    preempted: tuple[str, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    queues: Queues | None = None


@dataclass(frozen=True)
class ProbeResult:
    hit: int
    shared_prefix_boundary: int
    hit_blocks: tuple[BlockIds, ...]


@dataclass(frozen=True)
class ResetResult:
    ok: bool


@dataclass(frozen=True)
class Done:
    """Operations with no return value (add, finish, preempt, evict)."""


@dataclass(frozen=True)
class Saving:
    """A `Finish` of a request the KV connector saves (`model.contract.ops.Save`): the block
    ids per group it was handed to save (`request_finished_all_groups`), null
    padding included (`model.machine.connector`)."""

    block_ids: tuple[BlockIds, ...]


@dataclass(frozen=True)
class LoadCut:
    """A `Loaded` naming failed blocks (`model.contract.ops.Loaded.invalid`): the request's
    computed tokens once cut at its first failed block (`model.machine.connector`), and
    each other request whose computed tokens the failed blocks changed, with its
    computed tokens after, by request id; under "fail", the requests it ended with an
    error, in the order they were ended (any order of them is allowed: `model.machine.connector`);
    and, by id, the requests whose sample rode on the report's output and was skipped with
    it, its tokens taken back (`model.machine.failed_blocks`)."""

    num_computed: int
    others: tuple[tuple[str, int], ...] = ()
    ended: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()


Observation = Union[ScheduleResult, StepResult, ProbeResult, ResetResult, Done, Saving, LoadCut]


@dataclass(frozen=True)
class Snapshot:
    """Everything observable about an allocator between two operations.

    - `free_queue`: the regular free queue, head (reused first) to tail.
    - `pinned_queue`: the pinned tier (#40676), oldest first; empty when off.
    - `ref_cnt[i]`: ref count of block i (block 0 is the null block: 0).
    - `pinned`: ids of blocks whose pinned flag is set.
    - `cached`: hash map, key -> block ids in insertion order.
    - `block_hash`: each hashed block's primary key.
    - `tables`: per request id, per group, the block table (null = 0).
    - `events`: KV events emitted since the previous snapshot.
    """

    free_queue: BlockIds
    pinned_queue: BlockIds
    ref_cnt: tuple[int, ...]
    pinned: frozenset[int]
    cached: dict[BlockKey, BlockIds]
    block_hash: dict[int, BlockKey]
    tables: dict[str, tuple[BlockIds, ...]]
    events: tuple[Event, ...] = field(default=())

    @property
    def num_blocks(self) -> int:
        return len(self.ref_cnt)


def diff_snapshots(expected: Snapshot, actual: Snapshot) -> list[str]:
    """Human-readable differences, one line per differing field (empty when equal)."""
    lines: list[str] = []
    for name in ("free_queue", "pinned_queue", "pinned", "events"):
        a, b = getattr(expected, name), getattr(actual, name)
        if a != b:
            where = _first_event_difference(a, b) if name == "events" else ""
            lines.append(f"{name}: {where}expected {_fmt(a)}, got {_fmt(b)}")
    if expected.ref_cnt != actual.ref_cnt:
        bad = [
            f"block {i}: {x} != {y}"
            for i, (x, y) in enumerate(zip(expected.ref_cnt, actual.ref_cnt))
            if x != y
        ]
        if len(expected.ref_cnt) != len(actual.ref_cnt):
            bad.append(f"num blocks {len(expected.ref_cnt)} != {len(actual.ref_cnt)}")
        lines.append("ref_cnt: " + "; ".join(bad))
    for name in ("cached", "block_hash", "tables"):
        a, b = getattr(expected, name), getattr(actual, name)
        if a != b:
            keys = sorted(set(a) | set(b), key=repr)
            for k in keys:
                if a.get(k) != b.get(k):
                    label = k.short() if isinstance(k, BlockKey) else k
                    va, vb = a.get(k), b.get(k)
                    lines.append(f"{name}[{label}]: expected {_fmt(va)}, got {_fmt(vb)}")
    return lines


def _first_event_difference(expected: tuple[Event, ...], actual: tuple[Event, ...]) -> str:
    """For the first pair of events of one kind that differ, `event i (Kind) field:
    expected x, got y; `: a field at the end of a long event is cut from the whole tuples."""
    for i, (x, y) in enumerate(zip(expected, actual)):
        if x != y:
            if type(x) is not type(y):
                return ""
            names = [f.name for f in fields(x) if getattr(x, f.name) != getattr(y, f.name)]  # type: ignore[arg-type]
            parts = (f"{n}: expected {_fmt(getattr(x, n), 80)}, got {_fmt(getattr(y, n), 80)}" for n in names)
            return f"event {i} ({type(x).__name__}) " + "; ".join(parts) + "; "
    return ""


def _fmt(value: object, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
