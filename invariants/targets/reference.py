"""The `reference` target: kvretain's own allocator (`reference_impl`) behind the Target protocol.

Translation only: `model.contract.config.Config` -> `reference_impl.AllocatorConfig`
(ValueError -> ConfigError, same message), `model.contract.ops` -> `Scheduler` calls,
and reference hash bytes -> `BlockKey(group, prefix_tokens)`. The prefix a
hash stands for is recorded when the hash is computed (requests report every
new hash through a listener), so no hash is ever inverted; the table
(`HashNames`) is pruned to the hashes the pool holds or a live request has
once the removal events were read.

`ReferenceTarget(cfg, track_prefixes=False)` (or a subclass setting
`TRACK_PREFIXES = False`) records nothing, and its snapshots name each hash by
a stand-in instead of its prefix: `BlockKey(group, tuple(hash_bytes))`. Such
snapshots are internally consistent (distinct hashes stay distinct) but do not
compare with another target's; use them for counting, never for differential
checks.

Variants ("mutants") are selected by name: `ReferenceTarget(cfg, mutant="x")`
applies the function registered under "x" to this instance's
`AllocatorComponents` (class-level swaps via subclasses; no module patching).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar

from model.contract.config import Config, ConfigError
from model.contract.fine_mamba import fine_hits_enabled
from model.contract.observation import (
    AllBlocksCleared,
    BlockKey,
    BlockRemoved,
    BlockStored,
    Done,
    Event,
    Observation,
    ProbeResult,
    Queues,
    ResetResult,
    ScheduleResult,
    Snapshot,
    StepResult,
)
from model.contract.ops import (
    AddRequest,
    EvictBlocks,
    Finish,
    Op,
    Preempt,
    Probe,
    ResetPrefixCache,
    Sample,
    Schedule,
    Step,
)
from model.contract.prefix import Prefix, prefix
from reference_impl import kv_events
from reference_impl.components import AllocatorComponents
from reference_impl.config import AllocatorConfig, KVCacheGroupConfig
from reference_impl.hashing import get_block_hash, get_group_id
from reference_impl.kv_cache_manager import KVCacheManager
from reference_impl.request import Request
from reference_impl.scheduler import ScheduleOutcome, Scheduler

from .base import PartialState, Tables, Target, TargetCrash, TargetFeatures, partial_from_snapshot
from .hash_names import HashNames

Mutant = Callable[[AllocatorComponents], AllocatorComponents]


# vLLM's `KVCacheSpecKind` value of the spec a reference group kind stands for.
_SPEC_KINDS = {"full": "full_attention", "swa": "sliding_window", "mamba": "mamba"}


def to_allocator_config(config: Config) -> AllocatorConfig:
    return AllocatorConfig(
        groups=tuple(
            KVCacheGroupConfig(g.kind, g.block_size, g.sliding_window, g.mamba_cache_mode)
            for g in config.groups
        ),
        num_blocks=config.num_blocks,
        retention_interval=config.retention_interval,
        use_eagle=config.eagle,
        enable_caching=config.enable_caching,
        pin_swa_on_drop=config.pin_swa_on_drop,
        pin_min_drop_blocks=config.pin_min_drop_blocks,
        hash_block_size=config.hash_block_size,
        scheduler_block_size=config.scheduler_block_size,
        max_model_len=config.max_model_len,
        num_lookahead_tokens=config.num_lookahead_tokens,
        enable_kv_cache_events=True,
        name=config.name,
    )


FINE_MAMBA_UNSUPPORTED = (
    "a Mamba block wider than the hash block turns on vLLM's fine-grained hits and CoW copies, "
    "which the seeds' allocator does not implement (use --target model or vllm)"
)


NO_KV_CONNECTOR = (
    "kv_connector: the seeds' allocator has no scheduler to ask a KV connector (use --target model or vllm)"
)
NO_LONG_PREFILL = (
    "long_prefill_token_threshold: the seeds' allocator has no scheduler to cap a chunk "
    "(use --target model or vllm)"
)

NO_ADMISSION_GATES = (
    "reserve_full_isl / watermark / scheduling_policy: the seeds' allocator has no scheduler "
    "to gate an admission or order its queues (use --target model or vllm)"
)


class ReferenceTarget(Target):
    name = "reference"
    # The seeds' allocator has the #40676 pinned tier, not vLLM's fine-grained Mamba hits.
    features = TargetFeatures(partial=True, pinning=True, queues=True)
    MUTANTS: ClassVar[dict[str, Mutant]] = {}
    # Default for `track_prefixes` when the constructor is not told (subclasses may flip it).
    TRACK_PREFIXES: ClassVar[bool] = True

    @classmethod
    def register_mutant(cls, name: str) -> Callable[[Mutant], Mutant]:
        """Decorator: register `fn(components) -> components` as mutant `name`."""

        def deco(fn: Mutant) -> Mutant:
            cls.MUTANTS[name] = fn
            return fn

        return deco

    def __init__(self, config: Config, mutant: str | None = None, track_prefixes: bool | None = None) -> None:
        if fine_hits_enabled(config):
            raise ConfigError(f"groups: {FINE_MAMBA_UNSUPPORTED}")
        if config.kv_connector:
            raise ConfigError(NO_KV_CONNECTOR)
        if config.long_prefill_token_threshold:
            raise ConfigError(NO_LONG_PREFILL)
        if config.reserve_full_isl or config.watermark or config.scheduling_policy != "fcfs":
            raise ConfigError(NO_ADMISSION_GATES)
        self.config = config
        self.track_prefixes = self.TRACK_PREFIXES if track_prefixes is None else track_prefixes
        self.mutant = mutant
        components = AllocatorComponents()
        if mutant is not None:
            if mutant not in self.MUTANTS:
                raise ValueError(f"unknown mutant {mutant!r} (known: {sorted(self.MUTANTS)})")
            components = self.MUTANTS[mutant](components)
        try:
            self.allocator = KVCacheManager(to_allocator_config(config), components)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self._names = HashNames()
        listener = self._record_hashes if self.track_prefixes else None
        self.scheduler = Scheduler(self.allocator, on_new_block_hashes=listener)

    # ------------------------------------------------------------- hashes
    def _record_hashes(self, request: Request, first_new: int) -> None:
        tokens = tuple(request.all_token_ids)
        self._names.learn(tokens, request.block_hashes, first_new, request.hash_block_size)

    def _prefix(self, block_hash: bytes) -> Prefix:
        if not self.track_prefixes:
            return prefix(tuple(block_hash))  # stand-in (see the module docstring)
        named = self._names.name(block_hash)
        if named is None:
            raise KeyError(f"hash {block_hash.hex()[:16]}... comes from no known request")
        return named

    def _prune_names(self) -> None:
        """Forget the prefixes of hashes the pool removed (after their events were read)."""
        if not self.track_prefixes or not self._names.should_prune():
            return
        keep = {h for r in self.scheduler.requests.values() for h in r.block_hashes}
        keep |= {get_block_hash(k) for k, _ in self.allocator.block_pool.cached_block_hash_to_block.items()}
        self._names.prune(keep)

    def _key(self, key: bytes) -> BlockKey:
        return BlockKey(get_group_id(key), self._prefix(get_block_hash(key)))

    # ---------------------------------------------------------- protocol
    def apply(self, op: Op) -> Observation:
        try:
            return self._apply(op)
        except (ValueError, KeyError, AssertionError, RuntimeError, IndexError) as exc:
            raise TargetCrash(f"reference allocator raised on {op!r}: {type(exc).__name__}: {exc}") from exc

    def _apply(self, op: Op) -> Observation:
        s = self.scheduler
        if isinstance(op, Schedule):
            out = s.schedule(op.rid, op.budget)
            return ScheduleResult(
                out.scheduled,
                out.admitted,
                out.hit,
                out.shared_prefix_boundary,
                out.hit_blocks,
                out.new_blocks,
            )
        if isinstance(op, Step):
            step = s.schedule_step(op.rids, op.budget)
            results = tuple((rid, _schedule_result(o)) for rid, o in step.outcomes)
            return StepResult(results, step.preempted, queues=Queues(step.running, (), step.waiting))
        if isinstance(op, AddRequest):
            s.add_request(op.rid, op.prompt)
        elif isinstance(op, Sample):
            s.sample(op.rid, op.token)
        elif isinstance(op, Finish):
            s.finish(op.rid)
        elif isinstance(op, Preempt):
            s.preempt(op.rid)
        elif isinstance(op, Probe):
            p = s.probe(op.tokens)
            return ProbeResult(p.hit, p.shared_prefix_boundary, p.hit_blocks)
        elif isinstance(op, ResetPrefixCache):
            return ResetResult(s.reset_prefix_cache())
        elif isinstance(op, EvictBlocks):
            # vLLM's evict_blocks takes a set[int]; iterate it the same way.
            s.evict_blocks(set(op.block_ids))
        else:
            raise ValueError(f"unsupported operation {op!r}")
        return Done()

    def partial(
        self,
        blocks: Iterable[int],
        rids: Iterable[str],
        keys: Iterable[BlockKey],
        before: Tables | None = None,
    ) -> PartialState:
        """Read off a full snapshot (correct, not fast: the reference is judged, not benchmarked)."""
        return partial_from_snapshot(self.snapshot(), blocks, rids, keys, before)

    def snapshot(self) -> Snapshot:
        pool = self.allocator.block_pool
        cached = {
            self._key(key): tuple(b.block_id for b in blocks)
            for key, blocks in pool.cached_block_hash_to_block.items()
        }
        block_hash = {b.block_id: self._key(b.block_hash) for b in pool.blocks if b.block_hash is not None}
        tables = {
            rid: tuple(tuple(ids) for ids in self.allocator.get_block_ids(rid))
            for rid in self.allocator.request_ids_with_blocks()
        }
        snap = Snapshot(
            free_queue=tuple(b.block_id for b in pool.free_block_queue.iter_blocks()),
            pinned_queue=tuple(b.block_id for b in pool.pinned_block_queue.iter_blocks()),
            ref_cnt=tuple(0 if b.is_null else b.ref_cnt for b in pool.blocks),
            pinned=frozenset(b.block_id for b in pool.blocks if b.is_pinned),
            cached=cached,
            block_hash=block_hash,
            tables=tables,
            events=tuple(self._event(e) for e in self.allocator.take_events()),
        )
        self._prune_names()
        return snap

    def _event(self, event: kv_events.KVCacheEvent) -> Event:
        """The reference's event as the model's. `reference_impl`'s events carry only
        hashes, parent, tokens, block size and group; the adapter fills vLLM's other
        fields as vLLM would for this allocator: the spec kind and window of the
        reference's own group config, one empty extra key per hash, and the event
        class's defaults (GPU medium, no LoRA, lookahead, session, locality, ownership)."""
        if isinstance(event, kv_events.BlockStored):
            parent = event.parent_block_hash
            group = self.allocator.config.groups[event.group_idx]
            return BlockStored(
                group=event.group_idx,
                block_hashes=tuple(self._prefix(h) for h in event.block_hashes),
                parent=self._prefix(parent) if parent is not None else None,
                token_ids=event.token_ids,
                block_size=event.block_size,
                kv_cache_spec_kind=_SPEC_KINDS[group.kind],
                kv_cache_spec_sliding_window=group.sliding_window if group.kind == "swa" else None,
                extra_keys=(None,) * len(event.block_hashes) or None,
            )
        if isinstance(event, kv_events.BlockRemoved):
            return BlockRemoved(group=event.group_idx, block_hash=self._prefix(event.block_hashes[0]))
        return AllBlocksCleared()


def _schedule_result(o: ScheduleOutcome) -> ScheduleResult:
    return ScheduleResult(
        o.scheduled, o.admitted, o.hit, o.shared_prefix_boundary, o.hit_blocks, o.new_blocks
    )
