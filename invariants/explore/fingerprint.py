"""The canonical fingerprint of a checked state: when two operation sequences may be merged.

Two paths are merged (the second is not expanded) only when their fingerprints
are equal, so the fingerprint must capture everything that decides what any
continuation does and what any check says about it:

- the model's whole object graph (`AllocatorModel`: pool, free queues, ref
  counts, hash map, per-group tables, request progress, and any field added
  later: the walk is generic and refuses a type it does not know rather than
  skip it). Dict insertion order is kept (the model iterates dicts, and an
  iteration order can decide an event order); sets are compared as sets (no rule may
  depend on a set's iteration order, which hash randomisation already varies);
  a free queue is its order head to tail, never its link dicts.
- the checker's history (`invariants.catalogue.History`), which the invariants
  read, field by field (`_HISTORY`, `_LEDGER`): each imaged (request facts, the
  hash map as events rebuilt it, every key ever cached, blocks evicted in place,
  blocks a failed load left unwritten, the isolation ledger, the free ticks as
  ranks: the checks only compare ticks with each other) or excluded by name with
  its reason; a field in neither is refused, as the model walk refuses a type.
- once the target has diverged from the model (a tolerated known finding on
  the path), the target's own snapshot.

Canonical under renaming of request ids, and only that: a live request is named
by its place in arrival order (`L0`, `L1`, ...), a finished one by its place in
finish order (`F0`, ...); any other string is kept as it is. Token values are
not renamed (a 2-token alphabet makes that symmetry worth little).

- for a target whose hidden state has an image (`HIDDEN_STATE`: vLLM's real
  schedulers, `invariants.targets.vllm_hidden_state`): that image, on every
  state (the scheduler's queues, each request's progress, drafts and
  placeholders, `num_cached_block`, the adapter's held step outputs, the
  connector's pending transfers).

What merging assumes (`merging`, quoted in each certificate): for a target with
an image, that what the image leaves out (`NOT_IN_IMAGE`) decides nothing; for
any other target, that its behaviour is decided by the model's state (and its
snapshot once it diverged): a defect that depends on hidden adapter state
reached only by a merged-away path is outside what the search covers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from invariants.catalogue import History
from invariants.catalogue.isolation import IsolationLedger
from invariants.targets import vllm_hidden_state
from model.contract.config import Config, GroupSpec
from model.contract.extra_keys import Keyed
from model.contract.free_queue import FreeQueue, LinkedFreeQueue
from model.contract.observation import BlockKey, Snapshot
from model.contract.prefix import Prefix
from model.machine.allocator import AllocatorModel

# Attributes that are fixed by the configuration (or caches, or who watches the model).
# `rules` and `hit_rules` are the release profile's rules, set once from `profile` and the
# configuration (skipping them is a fifth of the model's image: functions and flags).
_SKIP = frozenset({"cfg", "profile", "observer", "spec_meta", "_joined", "rules", "hit_rules"})
# Immutable and free of request ids: their own image. (A key is a group and an interned prefix.)
_ATOMS = frozenset({int, float, bool, type(None), bytes, Prefix, BlockKey, GroupSpec, Config})

Names = Mapping[str, str]
Hidden = Callable[[Names], Hashable]
"""Request names -> the image of the target's hidden state."""

# Targets whose hidden state joins every fingerprint (target name -> its image).
HIDDEN_STATE: dict[str, vllm_hidden_state.HiddenState] = {
    "vllm": vllm_hidden_state.hidden_state,
    "vllm-async-scheduler": vllm_hidden_state.hidden_state,
}


def merging(target: str) -> str:
    """What merging two states with equal fingerprints assumes on `target`, in words
    ("" or a target without an image: the model's state alone)."""
    if target in HIDDEN_STATE:
        return (
            "merged on the model, the checker's history and the target's hidden state "
            "(invariants.targets.vllm_hidden_state: scheduler queues in order, each request's "
            "progress, drafts and placeholders, num_cached_block, held step outputs, connector "
            f"transfers), its snapshot too after a tolerated finding; left out: {vllm_hidden_state.NOT_IN_IMAGE}"
        )
    return (
        "merged on the model and the checker's history (the target's snapshot joins after a "
        f"tolerated finding): assumes {target or 'the target'}'s behaviour is decided by the model's state; "
        "its hidden adapter state is not compared"
    )


class UnknownStateType(TypeError):
    """The model holds an object the fingerprint does not know how to canonicalise."""


def canonical(obj: Any, names: Names) -> Hashable:
    """A hashable, rid-renamed image of `obj` (see the module docstring)."""
    kind = type(obj)
    if kind in _ATOMS:
        return obj
    if kind is str:
        return names.get(obj, obj)
    if kind is list or kind is tuple:
        # Most sequences are block ids: no call per element.
        return tuple([x if type(x) in _ATOMS else canonical(x, names) for x in obj])
    if kind is dict:
        return (
            "{",
            tuple(
                [
                    (
                        k if type(k) in _ATOMS else canonical(k, names),
                        v if type(v) in _ATOMS else canonical(v, names),
                    )
                    for k, v in obj.items()
                ]
            ),
        )
    if kind is set or kind is frozenset:
        return frozenset([x if type(x) in _ATOMS else canonical(x, names) for x in obj])
    if kind is LinkedFreeQueue or kind is FreeQueue:
        return ("queue", tuple(obj.blocks))
    if kind is Keyed:  # a prompt and its identity (`model.contract.extra_keys`): two tenants, two states
        return ("Keyed", obj.identity, tuple(obj))
    if isinstance(obj, dict):  # a Counter or another dict subclass: its items, never its (empty) __dict__
        return (kind.__name__, canonical(dict(obj), names))
    if isinstance(obj, list):
        return (kind.__name__, canonical(list(obj), names))
    if isinstance(obj, (set, frozenset)):
        return (kind.__name__, canonical(set(obj), names))
    if isinstance(obj, tuple):  # a named tuple or another tuple subclass
        return (kind.__name__, tuple([x if type(x) in _ATOMS else canonical(x, names) for x in obj]))
    attrs = getattr(obj, "__dict__", None)
    if attrs is None:
        raise UnknownStateType(f"fingerprint: cannot canonicalise a {kind.__qualname__}")
    return (
        kind.__name__,
        # In the order the attributes were set (a constructor's order): sound, and no sort.
        # Most attributes are atoms (counts, flags): no call for them.
        tuple(
            [(k, v if type(v) in _ATOMS else canonical(v, names)) for k, v in attrs.items() if k not in _SKIP]
        ),
    )


def request_names(model: AllocatorModel, history: History) -> dict[str, str]:
    """Live requests by arrival order, finished ones by finish order."""
    names = {rid: f"L{i}" for i, rid in enumerate(model.requests)}
    for i, rid in enumerate(history.finished):
        names.setdefault(rid, f"F{i}")
    return names


def _free_ranks(history: History, free: tuple[int, ...], names: Names) -> Hashable:
    """`free_tick` as ranks over the free queue: written whenever a block enters the
    regular free queue and read only for blocks in it, so only those entries count;
    ranks keep every comparison between them (a missing entry reads as 0, the lowest)."""
    ticks = history.free_tick
    values = sorted({0, *(ticks.get(b, 0) for b in free)})
    rank = {v: i for i, v in enumerate(values)}
    return tuple([rank[ticks.get(b, 0)] for b in free])


def _unwritten_image(history: History, free: tuple[int, ...], names: Names) -> Hashable:
    """Blocks holding no valid KV, each with the tokens written into it since (`why`: report text)."""
    return frozenset([(b, u.written) for b, u in history.unwritten.items()]) if history.unwritten else ()


def _isolation_image(history: History, free: tuple[int, ...], names: Names) -> Hashable:
    """The isolation ledger, field by field (`_LEDGER`); refuses a field it does not know."""
    ledger = history.isolation
    owner = {id(r): names.get(rid, rid) for rid, r in (*history.requests.items(), *history.finished.items())}
    return _by_table(ledger, _LEDGER, "IsolationLedger", names, owner)


def _by_table(
    obj: object, table: Mapping[str, Callable[..., Hashable] | str], label: str, *args: Any
) -> Hashable:
    """`obj`'s fields, each imaged as `table` says (a string: why it is left out); a field
    the table does not name is refused, so a field added later cannot be merged away unseen."""
    out: list[Hashable] = []
    for k in vars(obj):
        how = table.get(k)
        if how is None:
            raise UnknownStateType(f"fingerprint: {label}.{k} is neither imaged nor excluded")
        if not isinstance(how, str):
            out.append(how(obj, *args))
    return tuple(out)


def _wrote_image(ledger: IsolationLedger, names: Names, owner: Mapping[int, str]) -> Hashable:
    """Each block's writer history: a live or finished request's by its name (its tokens are
    in its own image and grow with it), any other (ended, forgotten) by its tokens."""
    return frozenset([(b, owner.get(id(r)) or tuple(r.tokens)) for b, r in ledger.wrote.items()])


def _router_image(ledger: IsolationLedger, names: Names, owner: Mapping[int, str]) -> Hashable:
    """The router as the next operation finds it: `pending` (the last operation's events,
    already judged) is applied to it before any check reads either. Walked generically:
    its interned numbers follow the order keys were first seen, so states differing only
    there are split, never merged."""
    router = ledger.router
    if ledger.pending:
        router = copy.deepcopy(router)
        router.apply(ledger.pending)
    return canonical(router, names)


_Ledger = Callable[[IsolationLedger, Names, Mapping[int, str]], Hashable]
# Every field of `IsolationLedger`: how it is imaged, or why it is not.
_LEDGER: dict[str, _Ledger | str] = {
    "writer": lambda led, names, owner: frozenset(led.writer.items()),  # block -> Identity (no request id)
    "wrote": _wrote_image,
    "read": lambda led, names, owner: frozenset(
        [(names.get(rid, rid), frozenset(blocks.items())) for rid, blocks in led.read.items()]
    ),
    "router": _router_image,
    "pending": "imaged in `router`: the next operation applies it there before any check reads it",
    "unjudged": "a tally of what the isolation checks could not judge: reported, read by no check",
}

_Imager = Callable[[History, tuple[int, ...], Names], Hashable]
# Every field of `History`: how it is imaged (renamed, ticks as ranks), or why it is not.
# `history_image` refuses a field in neither, as `canonical` refuses a type it does not know.
_HISTORY: dict[str, _Imager | str] = {
    "tick": "the clock: read only through `free_tick`, whose entries are imaged as ranks",
    "free_tick": _free_ranks,
    "evicted_in_place": lambda h, free, names: frozenset(h.evicted_in_place),
    "ever_cached": lambda h, free, names: frozenset(h.ever_cached),
    "shadow": lambda h, free, names: frozenset(h.shadow.items()),
    "requests": lambda h, free, names: canonical(h.requests, names),
    "finished": lambda h, free, names: canonical(h.finished, names),
    "finished_tokens": "derived: the prompt and output tokens of `finished` (imaged), summed",
    "forget_at": lambda h, free, names: h.forget_at,
    "failed_load_ends": lambda h, free, names: h.failed_load_ends,
    "unwritten": _unwritten_image,
    "block_sizes": lambda h, free, names: h.block_sizes,
    "isolation": _isolation_image,
}


def history_image(history: History, free_blocks: tuple[int, ...], names: Names) -> Hashable:
    """What of the history a later check can read: every field of `History` imaged or
    excluded by name with its reason (`_HISTORY`); a field in neither is refused
    (`UnknownStateType`), so a field added later cannot be merged away unseen."""
    return _by_table(history, _HISTORY, "History", free_blocks, names)


def fingerprint(
    model: AllocatorModel,
    history: History,
    target_snapshot: Snapshot | None = None,
    *,
    image: Callable[[Any, Names], Hashable] = canonical,
    rename: bool = True,
    hidden: Hidden | None = None,
) -> Hashable:
    """The state's fingerprint: model, history, the target's hidden state (when `hidden`
    is given) and (when given: the target diverged) its snapshot.

    `rename` False keeps request ids as they are: for a search whose operations
    name fixed requests (a vocabulary), renaming would merge states whose
    continuations differ."""
    names = request_names(model, history) if rename else {}
    free = tuple(model.pool.queue.blocks)
    state = image(model, names)
    seen = history_image(history, free, names)
    behind = hidden(names) if hidden is not None else None
    if target_snapshot is None:
        return (state, seen, behind)
    return (state, seen, behind, _snapshot_image(target_snapshot, names))


def _snapshot_image(snap: Snapshot, names: Names) -> Hashable:
    """A target snapshot without its drained events (they belong to the last step)."""
    return (
        snap.free_queue,
        snap.pinned_queue,
        snap.ref_cnt,
        snap.pinned,
        frozenset(snap.cached.items()),
        frozenset(snap.block_hash.items()),
        frozenset((names.get(r, r), t) for r, t in snap.tables.items()),
    )
