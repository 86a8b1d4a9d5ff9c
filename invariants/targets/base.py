"""The target protocol: one adapter shape over every allocator under test.

A target wraps one allocator (the executable model, `reference_impl`, vLLM, or a
user's fork) configured from a `model.contract.config.Config`. It applies operations
from `model.contract.ops` and reports, for each, an `Observation` and (on request) a
`Snapshot` of observable state. The state machine drives the model and a
target with the same operations and demands equal observations and snapshots.

Contract for implementers:
- `__init__(config)` raises `model.contract.config.ConfigError` for a configuration the
  allocator rejects, and `TargetUnavailable` when its allocator cannot be
  imported (one line saying what is missing).
- `apply(op)` never raises for a well-formed operation sequence (one where
  rids are added before they are scheduled, finish/preempt name known
  requests); an internal allocator error is re-raised as `TargetCrash`.
- `snapshot()` is cheap enough to call after every operation on a small pool,
  and drains the KV events emitted since the previous call.
- Optional capabilities are declared, never probed: `Target` lists them with
  their defaults (`features: TargetFeatures`, `event_profile`, `profile`,
  `version_note`, `partial`), and a target class states what differs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

from model.contract.config import Config
from model.contract.observation import (
    BlockIds,
    BlockKey,
    BlockRemoved,
    BlockStored,
    Event,
    Observation,
    Snapshot,
)
from model.contract.ops import Op
from model.contract.profile import MODELED, Profile


class TargetUnavailable(RuntimeError):
    """The allocator behind a target cannot be imported or started."""


class TargetCrash(RuntimeError):
    """The allocator raised while applying a well-formed operation."""


class TargetRefusal(TargetCrash):
    """kvretain's own refusal of an operation the target cannot run as its engine would
    (a step over other requests, or with a budget that binds otherwise, than the engine's own): a fault of the trace, never the allocator's.
    The checker judges it `refused`, apart from `crash`, so that shrinking and the
    explore hand-over never take a refused candidate for the crash they hunt."""


@dataclass(frozen=True)
class TargetFeatures:
    """What a target can do beyond the required members, stated by its class as
    `features = TargetFeatures(...)`. A target that states nothing has every
    default: no fast path, no pinned tier, no fine-grained Mamba hits."""

    # `partial(...)` reports what each operation touched: the checker's fast path
    # compares deltas and audits every K operations (without it, every operation is audited).
    partial: bool = False
    # The #40676 pinned tier: generated configurations include it.
    pinning: bool = False
    # vLLM's fine-grained Mamba hits (Mamba blocks wider than the hash block) and their
    # copy-on-write copies, reported as each step's `copies`: generated configurations include them.
    fine_mamba: bool = False
    # A real engine scheduler decides each step (vLLM's `Scheduler`): the fuzzer sends it
    # whole steps (`Step((rid,), budget)`, never the model's single-request `Schedule`,
    # whose failed allocation preempts nobody). With lookahead slots it speculates: the
    # model is judged with `num_spec_tokens = num_lookahead_tokens` (drafts, padding and
    # rollback, `model.policy.spec_decode`), and the fuzzer's samples carry drafts.
    real_scheduler: bool = False
    # The engine decides every step (`real_scheduler` without steering): a `Step` names every
    # request the engine holds, in the model's predicted queue order
    # (`AllocatorModel.engine_queues`), with the budget the engine was built with
    # (`model.policy.scheduling.build_budget`); a `Preempt` is never sent (no client can ask for one).
    # Every real scheduler states it (kvretain no longer steers one); the allocator-level
    # targets, whose caller kvretain is, do not: any requests, any budget.
    engine_steps: bool = False
    # The engine schedules one step ahead of the model runner (vLLM's `AsyncScheduler`, as
    # `EngineCore.step_with_batch_queue` drives it): the Checker builds its model with
    # `async_scheduling` (`model.machine.async_scheduling`: when a sampled token reaches the scheduler).
    async_scheduling: bool = False
    # A KV connector can be attached (`Config.kv_connector`, `model.machine.connector`): generated
    # configurations include one, and the fuzzer states its offers and load reports.
    connector: bool = False
    # Each `Step`'s observation states the order the step left the scheduler's queues in
    # (`StepResult.queues`, `model.policy.queues`); without it the Checker leaves that order
    # unjudged (the target keeps no scheduler queues), and `fuzz` says so.
    queues: bool = False


@runtime_checkable
class Target(Protocol):
    """An allocator under test (see the module docstring for the contract).

    Required: `name`, `config`, `apply`, `snapshot`. The optional members are
    declared here with the value a target has when it does not state them; a
    target class inherits these defaults by subclassing `Target` (every
    built-in target does, and the registry adopts a plug-in class that does
    not: `adopt`), so every target has them and nobody asks whether it does.
    """

    name: str
    config: Config
    # What the target can do beyond the required members (see `TargetFeatures`).
    features: ClassVar[TargetFeatures] = TargetFeatures()
    # The model's KV-event profile the target is judged against (`model.machine.pool.EVENT_PROFILES`):
    # "seed", or "vllm-0.33.0", which carries vLLM's known BlockStored token-range behaviour.
    event_profile: str = "seed"
    # The model's semantics profile the target is judged against (an older release's rules).
    profile: Profile = MODELED
    # One line for the CLI to print (e.g. a version-drift warning), or None.
    version_note: str | None = None
    # The request identities (`model.contract.extra_keys`: "salt", "lora", "mm") the target hands its
    # allocator; the fuzzer draws only these (`harness.identities`) and names the others.
    identities: frozenset[str] = frozenset()

    def apply(self, op: Op) -> Observation: ...

    def snapshot(self) -> Snapshot: ...

    def engine_problems(self) -> list[tuple[str, str]]:
        """What the engine's contract judges found since the last call, as (check,
        message): the shadow worker's reads and positions, the scheduler's queues
        (`invariants.shadow`). A target that follows no engine finds nothing."""
        return []

    def engine_settings(self) -> tuple[str, ...]:
        """The engine's settings in force where they are the user's choice, each with
        the engine's default beside it when it differs (the fuzz summary counts them)."""
        return ()

    def engine_figures(self) -> dict[str, int] | None:
        """What those judges checked so far (steps, slots read, ...), or None where
        the target follows no engine (the summary says so)."""
        return None

    def partial(
        self,
        blocks: Iterable[int],
        rids: Iterable[str],
        keys: Iterable[BlockKey],
        before: Tables | None = None,
    ) -> PartialState:
        """What an operation touched (`PartialState`); called only where `features.partial`."""
        raise NotImplementedError(f"{type(self).__name__} states no partial (features.partial is False)")


def adopt(factory: Callable[[Config], Any]) -> Callable[[Config], Target]:
    """A target factory whose targets have every optional member of `Target`: a
    class that subclasses `Target` as it is; another class as a subclass of it
    and `Target` (the protocol's defaults fill in what it does not state); a
    function as one that adopts each target it returns the same way."""
    if isinstance(factory, type):
        if Target in factory.__mro__:
            return factory
        namespace = {
            "__module__": factory.__module__,
            "__qualname__": factory.__qualname__,
            "__doc__": factory.__doc__,
        }
        adopted: Callable[[Config], Target] = type(factory.__name__, (factory, Target), namespace)
        return adopted

    @functools.wraps(factory)
    def build(config: Config) -> Target:
        target = factory(config)
        if Target not in type(target).__mro__:
            target.__class__ = adopt(type(target))
        return cast(Target, target)

    return build


# ----------------------------------------------------------------------------- deltas
NOT_FREE = -1
END = 0  # a free-queue link past the head or tail (block 0 is the null block, never free)


@dataclass(frozen=True)
class PartialState:
    """The observable state of what one operation touched: the delta a target reports.

    - `blocks[b]`: (ref count, primary key or None, previous and next block in
      the regular free queue, `NOT_FREE` when b is not in it, `END` past an end);
    - `holders[key]`: the blocks the hash map lists for key, () when absent;
    - `tables[rid]`: the request's per-group block table, () when it holds none;
    - `free_len`: length of the regular free queue; `events`: drained KV events;
    - `ends`: the regular free queue's (head, tail), (`END`, `END`) when empty;
      None from a target that does not report it. Read in O(1) on every
      operation, it catches a corruption of blocks the operation did not touch
      at either end of the queue (the next block to be reused and the last)
      on the next operation, not at the next audit.

    Contract (`partial(blocks, rids, keys, before=None)`): it reports every
    asked block, request and key; the blocks in the reported tables (given
    `before`, the requests' tables before the operation: only the blocks at the
    positions where a table changed, see `table_changes`); the blocks that hold
    a key the events name (a block that became cached where its table did not
    change); and the keys those blocks carry or the events name. It equals
    `partial_from_snapshot` of a full snapshot taken at the same moment (the
    tests hold every target to this); a target without `partial` is checked
    by full snapshots only.
    """

    blocks: dict[int, tuple[int, BlockKey | None, int, int]]
    holders: dict[BlockKey, BlockIds]
    tables: dict[str, tuple[BlockIds, ...]]
    free_len: int
    events: tuple[Event, ...] = field(default=())
    ends: tuple[int, int] | None = None


def event_keys(events: Iterable[Event]) -> set[BlockKey]:
    """The hash-map keys KV events name."""
    out: set[BlockKey] = set()
    for ev in events:
        if isinstance(ev, BlockStored):
            out.update(BlockKey(ev.group, h) for h in ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            out.add(BlockKey(ev.group, ev.block_hash))
    return out


Tables = dict[str, tuple[BlockIds, ...]]


def table_changes(before: tuple[BlockIds, ...], after: tuple[BlockIds, ...]) -> tuple[list[int], list[int]]:
    """(left, joined): a request's blocks at the table positions from the first
    one that differs, before and after (null blocks left out).

    A block table changes at its end (a chunk's new blocks, a free) and in its
    window (blocks leaving a sliding window or a Mamba state become the null
    block); positions before the first difference hold the same blocks. So
    the delta of a 1M-token request costs its window and chunk, not its table
    (the prefix comparison runs in C)."""
    left: list[int] = []
    joined: list[int] = []
    for g in range(max(len(before), len(after))):
        a = before[g] if g < len(before) else ()
        b = after[g] if g < len(after) else ()
        n = min(len(a), len(b))
        if a[:n] == b[:n]:
            start = n
        else:
            lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if a[lo:mid] == b[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            start = lo
        left += [x for x in a[start:] if x]
        joined += [x for x in b[start:] if x]
    return left, joined


def closure(
    tables: Tables, blocks: Iterable[int], keys: Iterable[BlockKey], before: Tables | None = None
) -> tuple[set[int], set[BlockKey]]:
    """The blocks and keys a partial state must report, before primary keys and
    the holders of event keys are added."""
    out = set(blocks)
    for rid, table in tables.items():
        if before is None:
            for group in table:
                out.update(group)
        else:
            left, joined = table_changes(before.get(rid, ()), table)
            out.update(left)
            out.update(joined)
    out.discard(0)  # the null block
    return out, set(keys)


def partial_from_snapshot(
    snap: Snapshot,
    blocks: Iterable[int],
    rids: Iterable[str],
    keys: Iterable[BlockKey],
    before: Tables | None = None,
) -> PartialState:
    """The reference definition of `partial`: read off a full snapshot."""
    tables = {rid: snap.tables.get(rid, ()) for rid in rids}
    want, want_keys = closure(tables, blocks, keys, before)
    stored = event_keys(snap.events)
    want_keys |= stored
    for k in stored:
        want.update(snap.cached.get(k, ()))
    pos = {b: i for i, b in enumerate(snap.free_queue)}
    q = snap.free_queue
    out: dict[int, tuple[int, BlockKey | None, int, int]] = {}
    for b in want:
        key = snap.block_hash.get(b)
        if key is not None:
            want_keys.add(key)
        i = pos.get(b)
        if i is None:
            prev = nxt = NOT_FREE
        else:
            prev = q[i - 1] if i > 0 else END
            nxt = q[i + 1] if i + 1 < len(q) else END
        out[b] = (snap.ref_cnt[b], key, prev, nxt)
    holders = {k: snap.cached.get(k, ()) for k in want_keys}
    ends = (q[0], q[-1]) if q else (END, END)
    return PartialState(out, holders, tables, len(q), snap.events, ends)
