"""The executable model as a target: the spec judged by its own invariants.

Fuzzing `--target model` checks the catalogue against the specification itself
(every invariant must hold of what the model allows); it is also the stand-in
allocator for `gpu_check` when no other target is wanted.
"""

from __future__ import annotations

from collections.abc import Iterable

from model.contract.config import Config
from model.contract.extra_keys import IDENTITY_FIELDS as IDENTITIES
from model.contract.observation import BlockKey, Observation, Snapshot
from model.contract.ops import Op
from model.contract.profile import MODELED, Profile
from model.machine.allocator import AllocatorModel
from model.machine.async_scheduling import fenced_tables
from model.machine.seams import Observer

from .base import END, NOT_FREE, PartialState, Tables, Target, TargetFeatures, closure, event_keys


class ModelTarget(Target):
    name = "model"
    features = TargetFeatures(partial=True, pinning=True, fine_mamba=True, connector=True, queues=True)
    identities = IDENTITIES  # every identity field (`model.contract.extra_keys`)

    def __init__(
        self,
        config: Config,
        events: str = "seed",
        profile: Profile = MODELED,
        num_spec_tokens: int = 0,
        *,
        async_scheduling: bool = False,
        observer: Observer | None = None,
    ) -> None:
        self.config = config
        self.event_profile, self.profile = events, profile
        self._model = AllocatorModel(
            config,
            events=events,
            profile=profile,
            num_spec_tokens=num_spec_tokens,
            async_scheduling=async_scheduling,
            observer=observer,
        )

    @property
    def model(self) -> AllocatorModel:
        """The executable model this target drives. The checker predicts with it,
        and the fuzzer reads its public seams (`AllocatorModel.requests`; what it
        fired, through the `observer` given here); drive it through `apply`, not
        behind the target's back."""
        return self._model

    def apply(self, op: Op) -> Observation:
        return self._model.apply(op)

    def snapshot(self) -> Snapshot:
        return self._model.snapshot()

    def partial(
        self,
        blocks: Iterable[int],
        rids: Iterable[str],
        keys: Iterable[BlockKey],
        before: Tables | None = None,
    ) -> PartialState:
        return model_partial(self._model, blocks, rids, keys, before)


def model_partial(
    model: AllocatorModel,
    blocks: Iterable[int],
    rids: Iterable[str],
    keys: Iterable[BlockKey],
    before: Tables | None = None,
) -> PartialState:
    """`partial` read straight from the model's pool (no full snapshot)."""
    pool = model.pool
    tables = {}
    fenced = fenced_tables(model.in_flight, len(model.groups))  # model.machine.async_scheduling, 6
    for rid in rids:
        table = fenced.get(rid) or tuple(tuple(g.tables.get(rid, ())) for g in model.groups)
        tables[rid] = table if any(table) else ()
    events = tuple(pool.events)
    pool.events.clear()
    primary, queue, ref, cached = pool.primary, pool.queue, pool.ref, pool.cached
    want, want_keys = closure(tables, blocks, keys, before)
    stored = event_keys(events)
    want_keys |= stored
    for k in stored:
        want.update(cached.get(k, ()))
    out: dict[int, tuple[int, BlockKey | None, int, int]] = {}
    for b in want:
        key = primary.get(b)
        if key is not None:
            want_keys.add(key)
        prev = nxt = NOT_FREE
        if b in queue:  # ref 0 and not in the pinned tier
            left, right = queue.neighbours(b)
            prev = END if left is None else left
            nxt = END if right is None else right
        out[b] = (ref[b], key, prev, nxt)
    holders = {k: tuple(cached.get(k, ())) for k in want_keys}
    return PartialState(out, holders, tables, len(pool.queue), events, pool.queue.ends() or (END, END))
