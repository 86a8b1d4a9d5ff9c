"""Mutants of the installed SGLang (0.5.23) radix cache, and the hunt that kills them.

Each mutant is one plausible one-line defect applied to SGLang's real class by
a monkeypatch inside `activate(name)`, which restores the original on exit.
PROCESS-GLOBAL WHILE ACTIVE (SGLang's classes are shared). Each mutant names
the tree cores its hunt drives (`SglangMutant.cores`): the mutated core alone
(the Python core, or the Rust core's adapter for a Rust-only defect), so a kill
comes from judging that core against the model, never from disagreeing with
the other core.

| mutant | bug class it re-creates |
|---|---|
| `swa_evicted_seqlen_dropped` | #30845/#36909/#29350: a chunk's insert forgets the request's `swa_evicted_seqlen`, so freed SWA slots are cached as live KV |
| `mamba_slot_leaked_on_abort` | #12693/#16067/#21404: an aborted request's Mamba slot is never given back |
| `swa_window_off_by_one` | #17061/#29351: the SWA match needs one token more than the window, a valid hit is lost |
| `eviction_mru` | #12007/#31643: eviction order degraded (most recently used leaf first) |
| `block_removed_not_emitted` | #29750: a removed node emits no `BlockRemoved` |
| `lock_not_taken` | #29352: a running request's matched path is not locked and can be evicted under it |
| `swa_evicted_by_full_count` | #29662: pre-allocation evicts by the full-attention shortfall only; the SWA pool runs out while SWA is evictable |
| `swa_tombstone_stale_mapping_freed` | #27586: recovering an SWA tombstone on insert frees its old base through `free_swa`, trusting a stale full-to-SWA entry that names a live SWA slot |
| `tombstone_recovery_frees_locked_full` | #29352: tombstone recovery replaces and frees full-attention KV a running request holds locked |
| `mamba_hit_refreshes_path` | #31643/#31648: a hit moves every Mamba state on the matched path to most recent, not only the state it copies |
| `swa_finish_frees_window` | #29860/#34729 class: a finish frees the request's own SWA down to its last page before caching (a window of 0), so the finished prefix is cached with tombstones where its window should be live; pools balance, the tree is valid, the next turn's SWA hit is lost |
| `mamba_finish_drops_own_state` | #22935 class: a finish's insert evicts the Mamba state it has just committed at the finished prefix (freed properly: pools balance, the tree is valid), so the next turn's Mamba hit is lost |
| `namespace_dropped_on_chunk_insert` | issue #40 (isolation): one insert path, a chunked prefill's checkpoint (`cache_unfinished_req`), builds its `RadixKey` without the request's adapter / cache salt, so another tenant's (or the base model's) lookup hits KV this request wrote |
| `rust_full_eviction_in_swa_scope` | eviction scope, one core only: on the Rust tree core, a full-attention eviction walks the SWA component's LRU list; the Python core is untouched |

The stale entry of #27586 alone (`clear_full_to_swa_mapping` a no-op, no other
change) is an equivalent mutant on the paths kvretain drives: nothing reads an
entry of a freed slot before its next allocation overwrites it (30 s of fuzzing
on swa-p4, 15 s on swa-p1 and swa-small-p1 found nothing). The bug needs the
reader too, the pre-fix recovery that frees a tombstone's base through the
mapping; with both, the fuzz reaches it (a next-turn prompt over a tombstoned
path, generate_ops) in under a second.

Not in the zoo yet (not attempted): #29860 (an all-tombstone leaf when the page is
wider than the window; 0.5.23 keeps SWA-tombstone leaves by design, see
docs/sglang.md, so the old symptom is not a violation here), #22935 (a node split
without a Mamba state on the n-1 lookup), and #12007 as a mutant of its own (a
corrupted LRU list; SGLang's own sanity check walks the lists, and the eviction-order
mutants stand for the class).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from invariants.harness.radix_fuzz import fuzz_layout
from model.radix.config import LAYOUTS


@dataclass(frozen=True)
class SglangMutant:
    name: str
    doc: str
    layout: str
    install: Callable[[contextlib.ExitStack], None]
    # The tree cores the hunt drives: the mutated one alone, so a kill comes from judging
    # that core against the model, never from disagreeing with the other core.
    cores: tuple[str, ...] = ("python",)
    # The share of admissions with an identity (adapter / salt) in its hunt's histories: 0 for
    # the mutants whose kills were pinned on anonymous histories, >0 where namespaces matter.
    identities: float = 0.0


def _patch(stack: contextlib.ExitStack, owner: Any, attr: str, new: Any) -> None:
    old = owner.__dict__[attr]
    setattr(owner, attr, new)
    stack.callback(setattr, owner, attr, old)


def _swa_evicted_seqlen_dropped(stack: contextlib.ExitStack) -> None:
    from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent

    orig = SWAComponent.prepare_for_caching_req

    def mutant(self: Any, req: Any, insert_params: Any, token_ids_len: int, is_finished: bool) -> Any:
        result = orig(self, req, insert_params, token_ids_len, is_finished)
        insert_params.set_evicted_seqlen(self.component_type, 0)  # the defect: boundary forgotten
        return result

    _patch(stack, SWAComponent, "prepare_for_caching_req", mutant)


def _mamba_slot_leaked_on_abort(stack: contextlib.ExitStack) -> None:
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    def mutant(self: Any, req: Any, *, checkpointed: bool) -> None:
        return None  # the defect: components never clean up a released, uncached request

    _patch(stack, UnifiedRadixCache, "on_release", mutant)


def _swa_window_off_by_one(stack: contextlib.ExitStack) -> None:
    from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent

    orig = SWAComponent.create_match_validator

    def mutant(self: Any, match_device_only: bool = False) -> Any:
        inner = orig(self, match_device_only)
        window = self.sliding_window_size
        run = {"len": 0}

        def validator(node: Any) -> bool:
            ok = inner(node)
            cd = node.component_data[self.component_type]
            run["len"] = 0 if cd.value is None else run["len"] + len(node.key)
            return ok and (run["len"] > window or not ok)  # the defect: '>' for '>='

        return validator

    _patch(stack, SWAComponent, "create_match_validator", mutant)


def _eviction_mru(stack: contextlib.ExitStack) -> None:
    from sglang.srt.mem_cache.evict_policy import LRUStrategy

    _patch(stack, LRUStrategy, "get_priority", lambda self, node: -node.last_access_time)  # the defect: sign


def _block_removed_not_emitted(stack: contextlib.ExitStack) -> None:
    from sglang.srt.mem_cache.events import KVCacheEventRecorder

    _patch(stack, KVCacheEventRecorder, "record_remove", lambda self, node, medium=None: None)


def _lock_not_taken(stack: contextlib.ExitStack) -> None:
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    orig = UnifiedRadixCache.lock

    def mutant(self: Any, node_id: Any, skip_lock_components: Any = ()) -> Any:
        lock = orig(self, node_id, skip_lock_components)
        self.unlock(lock)  # the defect: the admission lock is dropped at once
        lock.swa_released = True
        return lock

    _patch(stack, UnifiedRadixCache, "lock", mutant)


def _swa_evicted_by_full_count(stack: contextlib.ExitStack) -> None:
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    def mutant(self: Any, tree_cache: Any, num_tokens: int) -> None:
        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return
        full_shortfall = max(0, num_tokens - self.full_available_size())
        if full_shortfall:  # the defect: the SWA shortfall is never asked for
            tree_cache.evict_for_alloc(EvictParams(num_tokens=full_shortfall))

    _patch(stack, SWATokenToKVPoolAllocator, "evict_to_free_tokens", mutant)


def _swa_tombstone_stale_mapping_freed(stack: contextlib.ExitStack) -> None:
    """#27586: recovering an SWA tombstone on insert frees the node's old base value through
    `free_swa`, trusting its full-to-SWA mapping entry; the entry is stale (a tombstone owns no
    SWA slot, but nothing cleared it) and names an SWA slot since reused, so a live slot is freed."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.unified_cache.cache_action import FreeDeviceKV, FreeDeviceKVFullOnly
    from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent

    orig = SWAComponent._recover_from_incoming

    def recover(self: Any, *, cache_actions: list[Any], **kw: Any) -> None:
        first = len(cache_actions)
        orig(self, cache_actions=cache_actions, **kw)
        for i in range(first, len(cache_actions)):
            if isinstance(cache_actions[i], FreeDeviceKVFullOnly):  # the defect: SWA freed too
                cache_actions[i] = FreeDeviceKV(list(cache_actions[i].indices))

    # The stale entry the old recovery trusted (HiCache left it in the original report).
    _patch(stack, SWATokenToKVPoolAllocator, "clear_full_to_swa_mapping", lambda self, full_indices: None)
    _patch(stack, SWAComponent, "_recover_from_incoming", recover)


def _tombstone_recovery_frees_locked_full(stack: contextlib.ExitStack) -> None:
    """#29352: recovering an SWA tombstone on insert replaces (and frees) the node's
    full-attention KV even while a running request holds it locked."""
    from sglang.srt.mem_cache.unified_cache.components import BASE_COMPONENT_TYPE
    from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent

    orig = SWAComponent._recover_from_incoming

    def recover(self: Any, *, node: Any, **kw: Any) -> None:
        full = node.component_data[BASE_COMPONENT_TYPE]
        saved, full.lock_ref = full.lock_ref, 0  # the defect: the lock is not consulted
        try:
            orig(self, node=node, **kw)
        finally:
            full.lock_ref = saved

    _patch(stack, SWAComponent, "_recover_from_incoming", recover)


def _mamba_hit_refreshes_path(stack: contextlib.ExitStack) -> None:
    """#31643/#31648: a hit refreshes every Mamba state on the matched path, not only the
    state it copies, so a session's old states stay hot and eviction order degrades."""
    from sglang.srt.mem_cache.unified_cache.components.base import LRURefreshPhase
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

    orig = MambaComponent.refresh_lru

    def refresh(self: Any, phase: Any, node: Any, root_node: Any) -> None:
        if phase != LRURefreshPhase.MATCH_END:
            return orig(self, phase, node, root_node)
        ct = self.component_type
        self.tree_core.lru_lists[ct].reset_node_and_parents_mru(  # the defect: the whole path
            node, root_node, lambda n: n.component_data[ct].value is not None
        )
        return None

    _patch(stack, MambaComponent, "refresh_lru", refresh)


def _swa_finish_frees_window(stack: contextlib.ExitStack) -> None:
    """A finish frees the request's own SWA down to its last page before caching (the window
    slide run with a window of 0), so the finished prefix is cached with SWA tombstones where
    its window should be live: pools balance and the tree is valid, but the next turn's SWA
    hit is lost (the class of #29860/#34729: the window kept at a finish is too short)."""
    from sglang.srt.mem_cache.common import free_swa_out_of_window_slots
    from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent

    orig = SWAComponent.prepare_for_caching_req

    def mutant(self: Any, req: Any, insert_params: Any, token_ids_len: int, is_finished: bool) -> Any:
        if is_finished:
            free_swa_out_of_window_slots(  # the defect: a window of 0 at the finish
                req,
                token_ids_len,
                sliding_window_size=0,
                page_size=self.cache.page_size,
                req_to_token_pool=self.cache.req_to_token_pool,
                token_to_kv_pool_allocator=self.cache.token_to_kv_pool_allocator,
            )
        return orig(self, req, insert_params, token_ids_len, is_finished)

    _patch(stack, SWAComponent, "prepare_for_caching_req", mutant)


def _mamba_finish_drops_own_state(stack: contextlib.ExitStack) -> None:
    """A finish's insert evicts the Mamba state it has just committed at the end of the
    finished prefix (a path-cap eviction that does not spare the tail), freeing the slot
    the proper way: pools balance and the tree is valid, but the next turn's Mamba hit at
    the finished prefix is lost (the class of #22935: identical prompts hit 0)."""
    from collections import defaultdict

    from sglang.srt.mem_cache.unified_cache.cache_action import FreeComponentDeviceSlot
    from sglang.srt.mem_cache.unified_cache.components import EvictLayer
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

    prepare, commit = MambaComponent.prepare_for_caching_req, MambaComponent.commit_insert_component_data
    finishing = {"now": False}

    def mark(self: Any, req: Any, insert_params: Any, token_ids_len: int, is_finished: bool) -> Any:
        finishing["now"] = is_finished
        return prepare(self, req, insert_params, token_ids_len, is_finished)

    def mutant(self: Any, node: Any, is_new_leaf: bool, params: Any, result: Any, cache_actions: Any) -> None:
        commit(self, node, is_new_leaf, params, result, cache_actions)
        cd = node.component_data[self.component_type]
        if finishing["now"] and cd.value is not None and cd.lock_ref == 0:  # the defect: the tail too
            frees: dict[Any, list[Any]] = defaultdict(list)
            self.tree_core._evict_component_and_detach_lru(
                node, self, frees, defaultdict(list), cache_actions, target=EvictLayer.DEVICE
            )
            cache_actions.append(
                FreeComponentDeviceSlot(
                    indices=frees[self.component_type], component_type=self.component_type
                )
            )
        finishing["now"] = False

    _patch(stack, MambaComponent, "prepare_for_caching_req", mark)
    _patch(stack, MambaComponent, "commit_insert_component_data", mutant)


def _namespace_dropped_on_chunk_insert(stack: contextlib.ExitStack) -> None:
    """The checkpoint of an unfinished request (a chunked prefill's insert) keys its
    `RadixKey` without the request's `extra_key` (adapter) and `cache_salt`: the chunk lands
    in the default namespace. The finish's insert (the other path) keeps both."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    orig = UnifiedRadixCache.checkpoint_into_tree

    def mutant(self: Any, req: Any, *, up_to: int, **kwargs: Any) -> None:
        if req.finished():
            return orig(self, req, up_to=up_to, **kwargs)
        saved = req.extra_key, req.cache_salt
        req.extra_key, req.cache_salt = None, None  # the defect: this path forgets the namespace
        try:
            return orig(self, req, up_to=up_to, **kwargs)
        finally:
            req.extra_key, req.cache_salt = saved

    _patch(stack, UnifiedRadixCache, "checkpoint_into_tree", mutant)


def _rust_full_eviction_in_swa_scope(stack: contextlib.ExitStack) -> None:
    """The Rust tree core only: a full-attention eviction walks the SWA component's LRU list
    (another component's scope), tombstoning interior SWA and deleting leaves in SWA order,
    instead of taking the least recently used evictable full-attention leaves. The Python
    core is untouched."""
    from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    def scoped(self: Any, ct: Any) -> Any:
        if ct == ComponentType.FULL and ComponentType.SWA in self.tree_components:
            return ComponentType.SWA  # the defect: the wrong component's walk
        return ct

    start, step, end = (
        RustUnifiedTreeCore.evict_device_start,
        RustUnifiedTreeCore.evict_device_next_node,
        RustUnifiedTreeCore.evict_device_end,
    )
    _patch(
        stack, RustUnifiedTreeCore, "evict_device_start", lambda self, ct, n: start(self, scoped(self, ct), n)
    )
    _patch(
        stack,
        RustUnifiedTreeCore,
        "evict_device_next_node",
        lambda self, ct, tracker: step(self, scoped(self, ct), tracker),
    )
    _patch(stack, RustUnifiedTreeCore, "evict_device_end", lambda self, ct: end(self, scoped(self, ct)))


SGLANG_MUTANTS: dict[str, SglangMutant] = {
    m.name: m
    for m in (
        SglangMutant(
            "namespace_dropped_on_chunk_insert",
            "#40 a chunk's insert drops the adapter / salt namespace",
            "full-p1",
            _namespace_dropped_on_chunk_insert,
            identities=0.3,
        ),
        SglangMutant(
            "swa_evicted_seqlen_dropped",
            "#30845 chunk insert forgets swa_evicted_seqlen",
            "swa-p1",
            _swa_evicted_seqlen_dropped,
        ),
        SglangMutant(
            "mamba_slot_leaked_on_abort",
            "#12693 aborted request's Mamba slot leaked",
            "mamba-p1",
            _mamba_slot_leaked_on_abort,
        ),
        SglangMutant(
            "swa_window_off_by_one", "#17061/#29351 SWA hit needs window+1", "swa-p1", _swa_window_off_by_one
        ),
        SglangMutant(
            "eviction_mru", "#12007/#31643 eviction evicts most recent first", "full-p1", _eviction_mru
        ),
        SglangMutant(
            "block_removed_not_emitted",
            "#29750 no BlockRemoved on removal",
            "full-p1",
            _block_removed_not_emitted,
        ),
        SglangMutant(
            "lock_not_taken", "#29352 matched path not locked while running", "full-p1", _lock_not_taken
        ),
        SglangMutant(
            "swa_evicted_by_full_count",
            "#29662 pre-allocation ignores the SWA shortfall",
            "swa-small-p1",
            _swa_evicted_by_full_count,
        ),
        SglangMutant(
            "swa_tombstone_stale_mapping_freed",
            "#27586 tombstone recovery frees a live SWA slot via a stale mapping",
            "swa-small-p1",
            _swa_tombstone_stale_mapping_freed,
        ),
        SglangMutant(
            "tombstone_recovery_frees_locked_full",
            "#29352 tombstone recovery frees full KV a running request holds",
            "swa-small-p1",
            _tombstone_recovery_frees_locked_full,
        ),
        SglangMutant(
            "mamba_hit_refreshes_path",
            "#31643 a hit refreshes the whole Mamba path",
            "mamba-p1",
            _mamba_hit_refreshes_path,
        ),
        SglangMutant(
            "swa_finish_frees_window",
            "#29860/#34729 a finish keeps no SWA window: the next turn's SWA hit is lost",
            "swa-p1",
            _swa_finish_frees_window,
        ),
        SglangMutant(
            "mamba_finish_drops_own_state",
            "#22935 class: a finish evicts the Mamba state it committed; the next turn's Mamba hit is lost",
            "mamba-p1",
            _mamba_finish_drops_own_state,
        ),
        SglangMutant(
            "rust_full_eviction_in_swa_scope",
            "full-attention eviction walks the SWA LRU scope, Rust core only",
            "swa-p1",
            _rust_full_eviction_in_swa_scope,
            cores=("rust",),
        ),
    )
}


@contextlib.contextmanager
def activate(name: str) -> Iterator[SglangMutant]:
    """Patch SGLang with mutant `name` for the block; originals restored on exit."""
    mutant = SGLANG_MUTANTS[name]
    with contextlib.ExitStack() as stack:
        mutant.install(stack)
        yield mutant


@dataclass
class KillRow:
    mutant: str
    layout: str
    killed_by: str | None
    seconds: float
    seed: int | None
    ops: int


def warm_up() -> float:
    """Build one cache before the hunts and return the seconds it took: SGLang's first build
    in a process imports and initializes kernels' CPU fallbacks (tens of seconds on a loaded
    machine), a one-time cost that would otherwise be charged to the first mutant's kill time."""
    from invariants.targets.sglang_drive import SglangDriver

    start = time.perf_counter()
    SglangDriver(LAYOUTS["swa-mamba-p1"], "python")
    return time.perf_counter() - start


def hunt(name: str, budget_s: float, seed: int = 0, cores: tuple[str, ...] | None = None) -> KillRow:
    """Fuzz the mutant's layout on its tree cores (`SglangMutant.cores`, or `cores`) until a
    violation or the budget ends."""
    mutant = SGLANG_MUTANTS[name]
    start = time.perf_counter()
    with activate(name):
        run = fuzz_layout(
            mutant.layout,
            LAYOUTS[mutant.layout],
            budget_s,
            seed,
            cores=cores or mutant.cores,
            identities=mutant.identities,
        )
    killed = None if run.violation is None else run.violation[0]
    return KillRow(name, mutant.layout, killed, time.perf_counter() - start, run.seed, run.ops)
