"""Mutants of `reference_impl`: small, realistic edits selected by name at run time.

Every mutant is applied to ONE `ZooReferenceTarget` instance, either through
the allocator's component seam (`AllocatorComponents`: a subclass used by this
allocator only) or by rebinding methods on that instance's own objects (its
`BlockPool`, its managers, its `KVCacheManager`). Nothing is patched at module
or class level, so other targets in the same process are untouched, and no
mutant is ever a default.

Each mutant's docstring names the bug class and where it was seen. `strategy`
names the configuration strategy (`invariants.zoo.configs`) that makes the bug
class reachable; `checks` names direct checks (`invariants.zoo.checks`) run
before the stateful fuzzer, for bug classes the fuzzer cannot reach by
construction (invalid configurations, exception paths).
"""

from __future__ import annotations

import types
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from invariants.targets.reference import Mutant, ReferenceTarget
from model.contract.config import Config, ConfigError
from reference_impl.block import KVCacheBlock
from reference_impl.components import AllocatorComponents
from reference_impl.coordinator import HybridKVCacheCoordinator
from reference_impl.kv_events import BlockStored
from reference_impl.managers import (
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    cdiv,
)

ComponentsEdit = Callable[[AllocatorComponents], AllocatorComponents]
InstanceEdit = Callable[["ZooReferenceTarget"], None]


@dataclass(frozen=True)
class ReferenceMutant:
    name: str
    doc: str
    strategy: str = "generated"
    checks: tuple[str, ...] = ()
    components: ComponentsEdit | None = None
    patch: InstanceEdit | None = None
    # Replaces the target's construction (used to mutate config validation).
    construct: Callable[[ZooReferenceTarget, Config], None] | None = None

    @property
    def summary(self) -> str:
        return self.doc.strip().splitlines()[0]


REFERENCE_MUTANTS: dict[str, ReferenceMutant] = {}


def mutant(
    name: str, *, strategy: str = "generated", checks: tuple[str, ...] = (), kind: str = "patch"
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register `fn` as mutant `name`: kind 'patch' (fn(target)), 'components' (fn(c) -> c), 'construct'."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        hooks: dict[str, Any] = {kind: fn}
        REFERENCE_MUTANTS[name] = ReferenceMutant(name, fn.__doc__ or "", strategy, checks, **hooks)
        return fn

    return deco


class ZooReferenceTarget(ReferenceTarget):
    """The reference target with one zoo mutant applied to this instance only.

    Component swaps go through an instance-level mutant table (the class-level
    `ReferenceTarget.MUTANTS` registry is never written).
    """

    MUTANTS: ClassVar[dict[str, Mutant]] = {}

    def __init__(self, config: Config, zoo_mutant: ReferenceMutant) -> None:
        self.zoo_mutant = zoo_mutant
        if zoo_mutant.construct is not None:
            zoo_mutant.construct(self, config)
        elif zoo_mutant.components is not None:
            edit = zoo_mutant.components
            self.MUTANTS = {zoo_mutant.name: edit}  # type: ignore[misc]  # instance attribute shadows the ClassVar
            super().__init__(config, mutant=zoo_mutant.name)
        else:
            super().__init__(config)
        self.name = f"reference+{zoo_mutant.name}"  # type: ignore[misc]
        if zoo_mutant.patch is not None:
            zoo_mutant.patch(self)

    # -- helpers for instance edits ---------------------------------------
    @property
    def pool(self) -> Any:
        return self.allocator.block_pool

    def managers(self, kind: str | None = None) -> list[SingleTypeKVCacheManager]:
        ms = list(self.allocator.coordinator.single_type_managers)
        return [m for m in ms if kind is None or m.kind == kind]


def _bind(obj: object, name: str, fn: Callable[..., Any]) -> None:
    """Rebind method `name` on this one object (instance attribute; the class is untouched)."""
    setattr(obj, name, types.MethodType(fn, obj))


def factory(name: str) -> Callable[[Config], ZooReferenceTarget]:
    """A target factory applying mutant `name` (KeyError naming the known ones)."""
    if name not in REFERENCE_MUTANTS:
        raise KeyError(f"unknown reference mutant {name!r} (known: {', '.join(REFERENCE_MUTANTS)})")
    m = REFERENCE_MUTANTS[name]
    return lambda config: ZooReferenceTarget(config, m)


# =============================================================== free-queue order
@mutant("swa_slide_appends_uncached", strategy="swa")
def swa_slide_appends_uncached(t: ZooReferenceTarget) -> None:
    """SWA blocks freed as the window slides go to the BACK of the free queue, uncached.

    Bug class: scratch routed like a cached prefix, so concurrent SWA scratch
    flushes older requests' cached prefixes before it is itself reused. Seen
    in: vLLM before #43447 (its motivation: every freed block was appended);
    fixed there by `prepend_n` for blocks without a hash.
    Edit: during `_remove_blocks_in_range` of the SWA managers the pool's
    `prepend_n` is `append_n`.
    """
    queue = t.pool.free_block_queue
    for m in t.managers("swa"):
        orig = m._remove_blocks_in_range

        def slide(self: Any, rid: str, first: int, last: int, _orig: Any = orig) -> None:
            queue.prepend_n = queue.append_n
            try:
                _orig(rid, first, last)
            finally:
                del queue.prepend_n

        _bind(m, "_remove_blocks_in_range", slide)


@mutant("cached_blocks_prepended")
def cached_blocks_prepended(t: ZooReferenceTarget) -> None:
    """Freed CACHED blocks are prepended (reused first) instead of appended.

    Bug class: LRU eviction inverted: the freshest cached prefix is the first
    block reused, uncached scratch waits behind it. Seen in: the #43447 review
    (which queue end each kind of freed block goes to), vLLM
    `BlockPool.free_blocks`.
    Edit: inside `free_blocks` the pool's `append_n` is `prepend_n`.
    """
    pool = t.pool
    queue = pool.free_block_queue
    orig = pool.free_blocks

    def free_blocks(self: Any, blocks: Any) -> None:
        queue.append_n = queue.prepend_n
        try:
            orig(blocks)
        finally:
            del queue.append_n

    _bind(pool, "free_blocks", free_blocks)


@mutant("free_order_not_reversed")
def free_order_not_reversed(t: ZooReferenceTarget) -> None:
    """A finished request's blocks are freed head first instead of tail first.

    Bug class: free order within a request reversed: the shared prefix (head)
    becomes the least recently freed block and is evicted before the request's
    private tail. Seen in: vLLM `SingleTypeKVCacheManager.free`
    (`reversed(...)`, "tail blocks are freed first"); #43447 review.
    Edit: every manager's `free` drops the `reversed`.
    """
    for m in t.managers():

        def free(self: Any, rid: str) -> None:
            self.block_pool.free_blocks(self.pop_blocks_for_free(rid))

        _bind(m, "free", free)


# =================================================================== masks
class _FloorNeed(SlidingWindowManager):
    @staticmethod
    def contiguous_blocks_for_hit(window: int, block_size: int, use_eagle: bool) -> int:
        return (window - 1) // block_size + (1 if use_eagle else 0)


class FloorMaskSlidingWindowManager(SlidingWindowManager):
    """`reachable_block_mask` keeps floor((w-1)/bs) blocks per boundary (instead of ceil)."""

    @classmethod
    def reachable_block_mask(cls, *args: Any, **kwargs: Any) -> list[bool] | None:
        return SlidingWindowManager.reachable_block_mask.__func__(_FloorNeed, *args, **kwargs)  # type: ignore[attr-defined,no-any-return]


@mutant("swa_mask_floor", strategy="swa-sparse", kind="components")
def swa_mask_floor(c: AllocatorComponents) -> AllocatorComponents:
    """The reachable-mask tail is floor((window-1)/block_size) blocks instead of ceil.

    Bug class: mask off by one: the oldest block of the window before each
    retained boundary is not cached, so the promised hit never comes (and the
    lookup, which needs ceil, misses). Seen in: #42258 (skip unreachable SWA
    blocks: `ceil((window-1)/block)` blocks before each LCM boundary).
    Edit: the SWA manager's `reachable_block_mask` uses floor division.
    """
    return c.with_manager("swa", FloorMaskSlidingWindowManager)


@mutant("latest_boundary_dropped", strategy="retention0")
def latest_boundary_dropped(t: ZooReferenceTarget) -> None:
    """Retention masks ignore the replay boundaries (P-1 / the Eagle resume points).

    Bug class: the latest replayable prompt boundary is not retained, so with
    retention_interval 0 a finished prompt's replay never hits. Seen in:
    #43447 (interval 0 = "only the latest replayable prompt boundary").
    Edit: every manager's `cache_blocks` is called with no replay boundaries.
    """
    for m in t.managers():
        orig = m.cache_blocks

        def cache_blocks(
            self: Any, request: Any, n: int, r: Any, boundaries: Sequence[int], _o: Any = orig
        ) -> None:
            _o(request, n, r, ())

        _bind(m, "cache_blocks", cache_blocks)


class NoEagleMaskSlidingWindowManager(SlidingWindowManager):
    """`reachable_block_mask` ignores Eagle: no peek block, no shift."""

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        spec: Any,
        use_eagle: bool,
        retention_interval: int | None = None,
        reachable_boundaries: Sequence[int] = (),
    ) -> list[bool] | None:
        return super().reachable_block_mask(
            start_block, end_block, alignment_tokens, spec, False, retention_interval, reachable_boundaries
        )


@mutant("eagle_extra_block_dropped", strategy="eagle-swa", kind="components")
def eagle_extra_block_dropped(c: AllocatorComponents) -> AllocatorComponents:
    """With Eagle/MTP the SWA mask does not keep the extra (peek) block.

    Bug class: Eagle drops the last matched block, so a hit needs one more
    contiguous SWA block than without Eagle; a mask that forgets it caches a
    tail no Eagle lookup can use: 0% hit rate. Seen in: vLLM #42784, #44082
    (and #42258: "Eagle needs one more block").
    Edit: the SWA manager's `reachable_block_mask` is called with use_eagle=False.
    """
    return c.with_manager("swa", NoEagleMaskSlidingWindowManager)


class AlwaysDropEagleCoordinator(HybridKVCacheCoordinator):
    """The fixed point re-applies the Eagle drop on every pass."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for sg in self.spec_groups:
            if sg.use_eagle:
                base = sg.manager_cls
                finder = base.find_longest_cache_hit.__func__  # type: ignore[attr-defined]

                def always_drop(
                    cls: Any,
                    hashes: Any,
                    max_length: int,
                    gids: Any,
                    pool: Any,
                    spec: Any,
                    drop: bool,
                    align: int,
                    _f: Any = finder,
                    _b: Any = base,
                ) -> Any:
                    return _f(_b, hashes, max_length, gids, pool, spec, True, align)

                sg.manager_cls = type(
                    f"AlwaysDrop{base.__name__}",
                    (base,),
                    {"find_longest_cache_hit": classmethod(always_drop)},
                )


@mutant("eagle_drop_every_pass", strategy="eagle-multi", kind="components")
def eagle_drop_every_pass(c: AllocatorComponents) -> AllocatorComponents:
    """The hybrid coordinator's fixed point drops the Eagle block on every pass.

    Bug class: the Eagle drop must be applied once per verified hit length;
    re-applied on each fixed-point pass, every pass shrinks the hit by a block
    and the hit spirals to 0. Seen in: vLLM #33270 (`eagle_verified`).
    Edit: the coordinator calls the SWA finder with drop_eagle_block=True on
    every pass (needs 3+ spec groups: "simple hybrid" runs a single pass).
    """
    return c.with_coordinator("hybrid", AlwaysDropEagleCoordinator)


# =================================================================== events
@mutant("blockstored_unmasked_tokens", strategy="swa-sparse")
def blockstored_unmasked_tokens(t: ZooReferenceTarget) -> None:
    """BlockStored carries the token ids of the whole range, masked blocks included.

    Bug class: KV event inconsistent with the mask: the hashes name only the
    stored blocks but token_ids span every block considered, so a consumer
    cannot tell which chunk a hash stands for. Seen in: #42258 review; vLLM
    0.33.0 still does it (known finding vllm-blockstored-token-range, #44451).
    Edit: after `cache_full_blocks`, the event's token_ids are replaced by
    `all_token_ids[num_cached*bs : num_full*bs]`.
    """
    pool = t.pool
    orig = pool.cache_full_blocks

    def cache_full_blocks(
        self: Any,
        request: Any,
        blocks: Any,
        num_cached: int,
        num_full: int,
        bs: int,
        gid: int,
        block_mask: Any = None,
    ) -> None:
        before = len(self.kv_event_queue)
        orig(request, blocks, num_cached, num_full, bs, gid, block_mask)
        if len(self.kv_event_queue) > before and isinstance(self.kv_event_queue[-1], BlockStored):
            ev = self.kv_event_queue[-1]
            tokens = tuple(request.all_token_ids[num_cached * bs : num_full * bs])
            self.kv_event_queue[-1] = replace(ev, token_ids=tokens)

    _bind(pool, "cache_full_blocks", cache_full_blocks)


@mutant("blockremoved_while_resident")
def blockremoved_while_resident(t: ZooReferenceTarget) -> None:
    """A second copy of a resident hash is not announced; evicting either copy emits BlockRemoved.

    Bug class: KV events out of step with the hash map when two blocks hold
    the same prefix: the consumer is told the hash is gone (BlockRemoved)
    while another copy is still resident. Seen in: vLLM #55092.
    Edit: `cache_full_blocks` drops from its BlockStored the hashes that were
    already in the map before the call ("announce new hashes only").
    """
    pool = t.pool
    orig = pool.cache_full_blocks

    def cache_full_blocks(
        self: Any,
        request: Any,
        blocks: Any,
        num_cached: int,
        num_full: int,
        bs: int,
        gid: int,
        block_mask: Any = None,
    ) -> None:
        resident = {k for k, blks in self.cached_block_hash_to_block.items() if blks}
        before = len(self.kv_event_queue)
        orig(request, blocks, num_cached, num_full, bs, gid, block_mask)
        if len(self.kv_event_queue) > before and isinstance(self.kv_event_queue[-1], BlockStored):
            ev = self.kv_event_queue[-1]
            keep = [i for i, h in enumerate(ev.block_hashes) if h + gid.to_bytes(4, "big") not in resident]
            if len(keep) == len(ev.block_hashes):
                return
            if not keep:
                self.kv_event_queue.pop()
                return
            tokens = tuple(tok for i in keep for tok in ev.token_ids[i * bs : (i + 1) * bs])
            self.kv_event_queue[-1] = replace(
                ev, block_hashes=tuple(ev.block_hashes[i] for i in keep), token_ids=tokens
            )

    _bind(pool, "cache_full_blocks", cache_full_blocks)


# ============================================================== pinned tier
class StaleDequeTier:
    """The pinned tier as a deque with lazy deletion (a touched block's entry stays).

    `remove` only decrements the count; `popleft_n` and iteration skip entries
    whose block is no longer a free pinned block. A block pinned, hit and
    released again has two entries, both "valid": the tier lists it twice,
    and the deque grows without bound.
    """

    def __init__(self) -> None:
        self._dq: deque[KVCacheBlock] = deque()
        self.num_free_blocks = 0

    @staticmethod
    def _live(b: KVCacheBlock) -> bool:
        return b.ref_cnt == 0 and b.is_pinned

    def __len__(self) -> int:
        return self.num_free_blocks

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._dq.extend(blocks)
        self.num_free_blocks += len(blocks)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n((block,))

    def remove(self, block: KVCacheBlock) -> None:
        self.num_free_blocks -= 1  # the entry stays: deleted lazily

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        out: list[KVCacheBlock] = []
        while len(out) < n and self._dq:
            b = self._dq.popleft()
            if self._live(b):
                out.append(b)
        self.num_free_blocks -= len(out)
        return out

    def iter_blocks(self) -> Iterator[KVCacheBlock]:
        return (b for b in list(self._dq) if self._live(b))

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self.iter_blocks())


@mutant("pinned_tier_stale_deque", strategy="pinning")
def pinned_tier_stale_deque(t: ZooReferenceTarget) -> None:
    """The pinned tier is a deque with stale entries (lazy deletion on touch).

    Bug class: a second free tier that cannot unlink in O(1): touched blocks
    leave stale entries, memory grows, and a block pinned again is listed
    twice (and can be demoted twice). Seen in: #40676 review ("use a second
    FreeKVCacheBlockQueue, not a deque").
    Edit: the pool's `pinned_block_queue` is a `StaleDequeTier`.
    """
    t.pool.pinned_block_queue = StaleDequeTier()


@mutant("pin_by_refcount", strategy="pinning")
def pin_by_refcount(t: ZooReferenceTarget) -> None:
    """Pinning by holding an extra reference (ref_cnt=2) instead of a flag and a tier.

    Bug class: a pin that is a reference nobody owns: the block never reaches
    a free tier (leak), admission stalls when pins fill the pool, and an
    "unpin" that decrements again drives ref counts negative. Seen in: #40676
    (first version, rejected in review).
    Edit: SWA managers' `_on_blocks_dropped` increments ref_cnt of the blocks
    it would pin.
    """
    for m in t.managers("swa"):

        def on_dropped(self: Any, dropped: list[KVCacheBlock]) -> None:
            if not self.pin_swa_on_drop or len(dropped) < self.pin_min_drop_blocks:
                return
            for block in self._select_blocks_to_pin(dropped):
                block.ref_cnt += 1

        _bind(m, "_on_blocks_dropped", on_dropped)


@mutant("pin_lost_on_hit", strategy="pinning")
def pin_lost_on_hit(t: ZooReferenceTarget) -> None:
    """`touch` clears the pinned flag: a pinned block that serves a hit loses its pin.

    Bug class: pin not surviving hit-then-release: after the hit the block is
    released to the regular queue and evicted like any cached block. Seen in:
    #40676 review ("pins survive hit-then-release").
    Edit: the pool's `touch` resets `is_pinned` on every touched block.
    """
    pool = t.pool
    orig = pool.touch

    def touch(self: Any, blocks: Any) -> None:
        blocks = list(blocks)
        orig(blocks)
        for b in blocks:
            b.is_pinned = False

    _bind(pool, "touch", touch)


@mutant("pinned_not_demoted", strategy="pinning")
def pinned_not_demoted(t: ZooReferenceTarget) -> None:
    """Admission counts only the regular free queue; pinned blocks are never demoted.

    Bug class: scheduler stall: with the pool's free blocks all pinned, a
    request that fits the pool is refused forever. Seen in: #40676 review
    (admission must demote the shortfall, `demote_n`).
    Edit: `KVCacheManager._make_room` is `need <= get_num_free_blocks()`.
    """
    alloc = t.allocator

    def make_room(self: Any, need: int) -> bool:
        return bool(need <= self.block_pool.get_num_free_blocks())

    _bind(alloc, "_make_room", make_room)


# ================================================================ validation
def _lax_retention_check(config: Config) -> None:
    r = config.retention_interval
    if r is None:
        return
    if not config.has_retention_group and r != 0:
        raise ConfigError(
            "prefix_cache_retention_interval is set but this model has no sliding-window or Mamba group"
        )
    if r % config.hash_block_size:  # the bug: no `r < 0`, and the wrong divisor
        raise ConfigError(f"prefix_cache_retention_interval ({r}) must be a multiple of hash_block_size")


@mutant("retention_validation_lax", strategy="generated", checks=("config_rejection",), kind="construct")
def retention_validation_lax(t: ZooReferenceTarget, config: Config) -> None:
    """Retention validation accepts a negative interval or one that is not a multiple of the scheduler block size.

    Bug class: validation gap: `r % hash_block_size` instead of `r >= 0 and r
    % scheduler_block_size == 0` (a negative multiple passes `%` in Python).
    A negative interval or an off-grid segment silently changes which blocks
    are retained. Seen in: #43447 (validation: non-negative, multiple of the
    scheduler block size; vLLM `_validate_prefix_cache_retention_interval`).
    Edit: the target validates with the lax rule, then builds the allocator
    with the interval set after the allocator's own validation.
    """
    _lax_retention_check(config)
    ReferenceTarget.__init__(
        t, config.with_(retention_interval=None if config.retention_interval is None else 0)
    )
    t.config = config
    coord = t.allocator.coordinator
    coord.retention_interval = config.retention_interval


# ===================================================================== Mamba
class StrictMambaManager(MambaManager):
    """`cache_blocks` insists every non-null block it walked got a hash."""

    def cache_blocks(
        self, request: Any, num_tokens: int, retention_interval: int | None, replay_boundaries: Sequence[int]
    ) -> None:
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        super().cache_blocks(request, num_tokens, retention_interval, replay_boundaries)
        after = self.num_cached_block.get(rid, 0)
        for idx in range(before, after):
            block = self.req_to_blocks[rid][idx]
            if not block.is_null:
                assert block.block_hash is not None, f"Mamba block {block.block_id} at {idx} was not cached"


@mutant("mamba_sparse_unhashed_crash", strategy="mamba-sparse", kind="components")
def mamba_sparse_unhashed_crash(c: AllocatorComponents) -> AllocatorComponents:
    """Mamba `cache_blocks` asserts every block it walked was hashed; sparse retention leaves some unhashed.

    Bug class: code that assumed dense caching breaks under sparse retention:
    a masked (unhashed, non-null) state block trips an assertion, crashing
    the engine. Seen in: #45845 (Mamba retention: "sparse (unhashed) blocks
    tolerated").
    Edit: `MambaManager.cache_blocks` asserts `block_hash is not None` for
    every non-null block in the cached range.
    """
    return c.with_manager("mamba", StrictMambaManager)


class NoBoundaryMambaManager(MambaManager):
    """`reachable_block_mask` keeps the per-segment states only."""

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        spec: Any,
        use_eagle: bool,
        retention_interval: int | None = None,
        reachable_boundaries: Sequence[int] = (),
    ) -> list[bool] | None:
        return super().reachable_block_mask(
            start_block, end_block, alignment_tokens, spec, use_eagle, retention_interval, ()
        )


@mutant("mamba_mask_no_replay_boundary", strategy="mamba-coarse", kind="components")
def mamba_mask_no_replay_boundary(c: AllocatorComponents) -> AllocatorComponents:
    """The Mamba mask forgets the replay boundary: the first repeat of a prompt misses.

    Bug class: the state at the latest replayable boundary (P-1 floored to the
    scheduler block) is not retained; only periodic segment states are (the
    prompt-tail checkpoint at hash granularity still is, so it shows when the
    scheduler block is wider than the Mamba block). Seen in: vLLM #53504
    class; #45845 ("one per interval segment plus the replay boundary").
    Edit: `MambaManager.reachable_block_mask` ignores `reachable_boundaries`.
    """
    return c.with_manager("mamba", NoBoundaryMambaManager)


# ================================================================ hash map
@mutant("reuse_without_evict")
def reuse_without_evict(t: ZooReferenceTarget) -> None:
    """A reused block forgets its hash but the hash map still points at it.

    Bug class: stale hash-map entry: a later lookup hits a block whose KV now
    belongs to another request: a silently corrupted output. Seen in: the
    eviction path of vLLM `BlockPool.get_new_blocks` /
    `_maybe_evict_cached_block` (gpu_check runs this mutant under its paged
    model, where the stale hit shows as a wrong output).
    Edit: during `get_new_blocks`, `_maybe_evict_cached_block` resets the
    block's hash without popping the map entries.
    """
    pool = t.pool
    orig_get = pool.get_new_blocks
    orig_evict = pool._maybe_evict_cached_block
    state = {"allocating": False}

    def get_new_blocks(self: Any, n: int) -> list[KVCacheBlock]:
        state["allocating"] = True
        try:
            return orig_get(n)  # type: ignore[no-any-return]
        finally:
            state["allocating"] = False

    def evict(self: Any, block: KVCacheBlock) -> bool:
        if state["allocating"]:
            block.reset_hash()
            self.cached_block_hashes_by_block.pop(block.block_id, None)
            return False
        return bool(orig_evict(block))

    _bind(pool, "get_new_blocks", get_new_blocks)
    _bind(pool, "_maybe_evict_cached_block", evict)


@mutant("hit_block_not_unlinked")
def hit_block_not_unlinked(t: ZooReferenceTarget) -> None:
    """A free block taken by a hit stays in the free queue: the same block goes to two requests.

    Bug class: double hand-out: `touch` raises the ref count of a free hit
    block without unlinking it, so `get_new_blocks` later hands the same
    physical block to another request (two writers, corrupted KV). Seen in:
    vLLM #33775 / #44409 class (hit blocks evicted or reused by a concurrent
    allocation).
    Edit: the pool's `touch` never calls `free_block_queue.remove`.
    """
    pool = t.pool

    def touch(self: Any, blocks: Any) -> None:
        for b in blocks:
            if not b.is_null:
                b.ref_cnt += 1

    _bind(pool, "touch", touch)


# ========================================================== token accounting
COMPRESS_RATIO = 2


class UncompressedFullAttentionManager(FullAttentionManager):
    """Counts blocks per compressed entry instead of per token (ratio not divided)."""

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args: Any) -> int:
        return super().get_num_blocks_to_allocate(request_id, num_tokens * COMPRESS_RATIO, *args)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        return super().allocate_new_blocks(request_id, num_tokens * COMPRESS_RATIO, num_tokens_main_model)


@mutant("compress_ratio_not_divided", kind="components")
def compress_ratio_not_divided(c: AllocatorComponents) -> AllocatorComponents:
    """Token counts are not divided by the compress ratio before counting blocks.

    Bug class: DSv4's compressor path: a compressed group stores one entry
    per `compress_ratio` tokens, so its block count is cdiv(tokens / ratio,
    entries per block); forgetting the division over-allocates by the ratio
    (pool exhaustion, admission refusals, tables longer than the request).
    Seen in: the vllm-ascend backport discussed in #43447's thread.
    Modeled, not literal: kvretain's config has no compressor group. At the
    allocator's interface a group with ratio r and pages of p entries is a
    group of token block size r*p, so the mutant is the full-attention group
    counting blocks of p = block_size / 2 tokens (ratio 2 not divided).
    Edit: the full-attention manager's block counts see num_tokens * 2.
    """
    return c.with_manager("full", UncompressedFullAttentionManager)


# ======================================================== exception safety
@mutant("mask_flag_not_restored", strategy="swa-sparse", checks=("exception_safety",))
def mask_flag_not_restored(t: ZooReferenceTarget) -> None:
    """Masks applied with a temporary `is_null` flag that is not restored on an exception path.

    Bug class: temporary state without `finally`: the vllm-ascend backport
    hides masked blocks from `cache_full_blocks` by setting `is_null` and
    resets it afterwards; if the call raises, the flag stays and the block is
    never freed again (a leak that looks like the null block). Seen in: the
    vllm-ascend backport in #43447's thread (restored in `finally` there).
    Edit: `cache_full_blocks` with a mask flags masked blocks `is_null`,
    calls the unmasked path, then clears the flags (no try/finally).
    Reachable only when the call raises: the stateful fuzzer never sees it,
    the `exception_safety` fault-injection check does.
    """
    pool = t.pool
    orig = pool.cache_full_blocks

    def cache_full_blocks(
        self: Any,
        request: Any,
        blocks: Any,
        num_cached: int,
        num_full: int,
        bs: int,
        gid: int,
        block_mask: Any = None,
    ) -> None:
        if block_mask is None:
            orig(request, blocks, num_cached, num_full, bs, gid, None)
            return
        flagged = [
            blocks[num_cached + i]
            for i, keep in enumerate(block_mask)
            if not keep and not blocks[num_cached + i].is_null
        ]
        for b in flagged:
            b.is_null = True
        orig(request, blocks, num_cached, num_full, bs, gid, None)
        for b in flagged:  # the bug: not in a `finally`
            b.is_null = False

    _bind(pool, "cache_full_blocks", cache_full_blocks)


# ============================================================ negative count
class NetOfFreedSlidingWindowManager(SlidingWindowManager):
    """Counts a running request's new blocks net of the blocks this step's slide freed."""

    def _init_kind_state(self) -> None:
        super()._init_kind_state()
        self._freed_now: dict[str, int] = {}

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        before = sum(1 for b in self.req_to_blocks.get(request_id, ()) if not b.is_null)
        super().remove_skipped_blocks(request_id, num_computed_tokens)
        after = sum(1 for b in self.req_to_blocks.get(request_id, ()) if not b.is_null)
        self._freed_now[request_id] = before - after

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args: Any) -> int:
        if request_id in self.num_cached_block:
            blocks = self.req_to_blocks.get(request_id, ())
            return cdiv(num_tokens, self.block_size) - len(blocks) - self._freed_now.get(request_id, 0)
        return super().get_num_blocks_to_allocate(request_id, num_tokens, *args)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks) - self._freed_now.pop(request_id, 0)
        if num_new == 0:  # the bug: `== 0`, not `<= 0`; a negative count reaches popleft_n
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks


@mutant("negative_block_count", strategy="swa", kind="components")
def negative_block_count(c: AllocatorComponents) -> AllocatorComponents:
    """A negative block count reaches `popleft_n` and inflates the free count.

    Bug class: unclamped block arithmetic: a count that can go negative (here:
    new blocks "net of the blocks this step's window slide freed"; in vLLM,
    rejected draft tokens) is passed to `get_new_blocks`, whose
    `n > num_free` guard lets negatives through; `popleft_n(-k)` pops nothing
    and adds k to `num_free_blocks`. Seen in: vLLM #52707 (the `max(..., 0)`
    in `get_num_blocks_to_allocate`'s running fast path).
    Edit: the SWA manager subtracts the blocks freed by this step's slide and
    guards `allocate_new_blocks` with `== 0` instead of `<= 0`.
    """
    return c.with_manager("swa", NetOfFreedSlidingWindowManager)
