"""Mutants of the installed vLLM (0.33.0): monkeypatches inside a context manager.

`activate(name)` patches vLLM's classes / module functions, yields the
`VllmManagerTarget` factory, and restores every original on exit (also on an
exception). PROCESS-GLOBAL WHILE ACTIVE: vLLM's `BlockPool`, managers and
coordinator are shared classes, so every vLLM allocator built in this process
while the context is open is mutated; run nothing else on vLLM meanwhile.
Nothing is patched at import time and no mutant is a default.

Names match the reference mutants of the same bug class. Bug classes whose
code vLLM 0.33.0 does not have (the #40676 pinned tier, the vllm-ascend
`is_null` trick) or already exhibits (BlockStored token ranges, a known
finding) are listed in `NOT_APPLICABLE` with the reason.

Three mutants sit where only the newer coverage reaches, and kvretain without
it survives them: `mamba_same_step_guard_off` (only a step over several
requests reaches the guard; with one request per step it survived 120 s of
fuzzing, seeds 0..75), `lookahead_slots_dropped` (without generated lookahead
every call already passes 0) and `mamba_none_state_freed_early` (without
Mamba 'none' configurations the patched branch never runs).
Three more need fine-grained Mamba hits (a Mamba block wider than the hash
block), which kvretain did not generate before it modeled them:
`cow_copy_reversed`, `mamba_fine_hit_floored_to_block` and
`producer_keys_not_moved` (each patched path runs only when a hit or a key
ends inside a Mamba block; with fine-grained configurations off each survived
60 s of generated fuzzing, seeds 0..19, 0..19 and 0..53, while the
`mamba-fine` strategy kills each within 2 s).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from invariants.targets.base import Target
from model.contract.config import Config

Factory = Callable[[Config], Target]


@dataclass(frozen=True)
class VllmMutant:
    name: str
    doc: str
    install: Callable[[contextlib.ExitStack], None]
    strategy: str = "generated"
    checks: tuple[str, ...] = ()

    @property
    def summary(self) -> str:
        return self.doc.strip().splitlines()[0]


VLLM_MUTANTS: dict[str, VllmMutant] = {}

NOT_APPLICABLE: dict[str, str] = {
    "blockstored_unmasked_tokens": "vLLM 0.33.0 already does this (known finding vllm-blockstored-token-range)",
    "pinned_tier_stale_deque": "no pinned tier in vLLM 0.33.0 (#40676 never merged)",
    "pin_by_refcount": "no pinned tier in vLLM 0.33.0 (#40676 never merged)",
    "pin_lost_on_hit": "no pinned tier in vLLM 0.33.0 (#40676 never merged)",
    "pinned_not_demoted": "no pinned tier in vLLM 0.33.0 (#40676 never merged)",
    "mask_flag_not_restored": "vLLM passes block_mask; the is_null trick is vllm-ascend's",
    "negative_block_count": (
        "vLLM clamps (#52707 fix); its negative source, rejected drafts, only the vllm target "
        "sends, and there the unclamped count changes an outcome only where it offsets another "
        "group's need under a full pool (dropping the clamp survived 70 s of scheduler-spec)"
    ),
}


def mutant(
    name: str, *, strategy: str = "generated", checks: tuple[str, ...] = ()
) -> Callable[[Callable[[contextlib.ExitStack], None]], Any]:
    def deco(fn: Callable[[contextlib.ExitStack], None]) -> Callable[[contextlib.ExitStack], None]:
        VLLM_MUTANTS[name] = VllmMutant(name, fn.__doc__ or "", fn, strategy, checks)
        return fn

    return deco


def _set(stack: contextlib.ExitStack, owner: Any, attr: str, value: Any) -> None:
    """Set `owner.attr` (a class or module) and register its exact restoration."""
    had = attr in vars(owner)
    old = vars(owner).get(attr)
    setattr(owner, attr, value)

    def restore() -> None:
        if had:
            setattr(owner, attr, old)
        else:
            delattr(owner, attr)

    stack.callback(restore)


def _core() -> dict[str, Any]:
    from vllm.v1.core import block_pool, kv_cache_coordinator, single_type_kv_cache_manager

    return {"bp": block_pool, "coord": kv_cache_coordinator, "stm": single_type_kv_cache_manager}


def _wrap_classmethod_args(
    stack: contextlib.ExitStack, cls: Any, attr: str, edit: Callable[[inspect.BoundArguments], None]
) -> None:
    """Replace classmethod `cls.attr` by one that edits its bound arguments first."""
    func = vars(cls)[attr].__func__
    sig = inspect.signature(func)

    def wrapper(klass: Any, *args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(klass, *args, **kwargs)
        edit(bound)
        return func(*bound.args, **bound.kwargs)

    _set(stack, cls, attr, classmethod(wrapper))


@contextlib.contextmanager
def activate(name: str, target: str = "vllm-manager") -> Iterator[Factory]:
    """Apply mutant `name` to vLLM until exit; yields the factory of `target` ("vllm-manager",
    or "vllm": the real scheduler over the same, mutated, allocator)."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget
    from invariants.targets.vllm_target import VllmManagerTarget

    m = VLLM_MUTANTS[name]
    with contextlib.ExitStack() as stack:
        m.install(stack)
        yield VllmSchedulerTarget if target == "vllm" else VllmManagerTarget


# ------------------------------------------------------------------ free queue
@mutant("swa_slide_appends_uncached", strategy="swa")
def swa_slide_appends_uncached(stack: contextlib.ExitStack) -> None:
    """SWA blocks freed as the window slides go to the back of the free queue (pre-#43447).

    Patch: `SlidingWindowManager.remove_skipped_blocks` runs with the pool's
    `prepend_n` aliased to `append_n`.
    """
    stm = _core()["stm"]
    orig = stm.SlidingWindowManager.remove_skipped_blocks

    def remove_skipped_blocks(self: Any, *args: Any, **kwargs: Any) -> Any:
        q = self.block_pool.free_block_queue
        q.prepend_n = q.append_n
        try:
            return orig(self, *args, **kwargs)
        finally:
            del q.prepend_n

    _set(stack, stm.SlidingWindowManager, "remove_skipped_blocks", remove_skipped_blocks)


@mutant("cached_blocks_prepended")
def cached_blocks_prepended(stack: contextlib.ExitStack) -> None:
    """Freed cached blocks are prepended (reused first). Patch: `BlockPool.free_blocks` with `append_n` = `prepend_n`."""
    bp = _core()["bp"]
    orig = bp.BlockPool.free_blocks

    def free_blocks(self: Any, ordered_blocks: Any) -> None:
        q = self.free_block_queue
        q.append_n = q.prepend_n
        try:
            orig(self, ordered_blocks)
        finally:
            del q.append_n

    _set(stack, bp.BlockPool, "free_blocks", free_blocks)


@mutant("free_order_not_reversed")
def free_order_not_reversed(stack: contextlib.ExitStack) -> None:
    """A finished request's blocks are freed head first. Patch: `SingleTypeKVCacheManager.free` without `reversed`."""
    stm = _core()["stm"]

    def free(self: Any, request_id: str) -> None:
        self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))

    _set(stack, stm.SingleTypeKVCacheManager, "free", free)


# ----------------------------------------------------------------------- masks
@mutant("swa_mask_floor", strategy="swa-sparse")
def swa_mask_floor(stack: contextlib.ExitStack) -> None:
    """The SWA reachable mask keeps floor((w-1)/bs) blocks (#42258 wants ceil).

    Patch: `SlidingWindowManager.reachable_block_mask` runs on a subclass whose
    `_contiguous_blocks_for_hit` floors (the lookup keeps ceil).
    """
    stm = _core()["stm"]
    swa = stm.SlidingWindowManager
    func = vars(swa)["reachable_block_mask"].__func__

    class _Floor(swa):  # type: ignore[misc,valid-type]
        @classmethod
        def _contiguous_blocks_for_hit(cls, window_size: int, block_size: int, use_eagle: bool) -> int:
            return (window_size - 1) // block_size + (1 if use_eagle else 0)

    def reachable_block_mask(klass: Any, *args: Any, **kwargs: Any) -> Any:
        return func(_Floor, *args, **kwargs)

    _set(stack, swa, "reachable_block_mask", classmethod(reachable_block_mask))


@mutant("latest_boundary_dropped", strategy="retention0")
def latest_boundary_dropped(stack: contextlib.ExitStack) -> None:
    """Retention masks get no reachable boundaries (interval 0 keeps nothing).

    Patch: SWA and Mamba `reachable_block_mask` with `reachable_boundaries=()`.
    """
    stm = _core()["stm"]

    def edit(b: inspect.BoundArguments) -> None:
        b.arguments["reachable_boundaries"] = ()

    _wrap_classmethod_args(stack, stm.SlidingWindowManager, "reachable_block_mask", edit)
    _wrap_classmethod_args(stack, stm.MambaManager, "reachable_block_mask", edit)


@mutant("eagle_extra_block_dropped", strategy="eagle-swa")
def eagle_extra_block_dropped(stack: contextlib.ExitStack) -> None:
    """With Eagle the SWA mask does not keep the peek block (#42784, #44082: 0% hits).

    Patch: `SlidingWindowManager.reachable_block_mask` with `use_eagle=False`.
    """
    stm = _core()["stm"]

    def edit(b: inspect.BoundArguments) -> None:
        b.arguments["use_eagle"] = False

    _wrap_classmethod_args(stack, stm.SlidingWindowManager, "reachable_block_mask", edit)


@mutant("eagle_drop_every_pass", strategy="eagle-multi")
def eagle_drop_every_pass(stack: contextlib.ExitStack) -> None:
    """The fixed point re-applies the Eagle drop on every pass (#33270: hits spiral to 0).

    Patch: `SlidingWindowManager.find_longest_cache_hit` with
    `drop_eagle_block=True` always; run with Eagle configs only (every SWA
    group is an Eagle group there), so it equals ignoring `eagle_verified`.
    """
    stm = _core()["stm"]

    def edit(b: inspect.BoundArguments) -> None:
        b.arguments["drop_eagle_block"] = True

    _wrap_classmethod_args(stack, stm.SlidingWindowManager, "find_longest_cache_hit", edit)


# ------------------------------------------------------------------ validation
@mutant("retention_validation_lax", checks=("config_rejection",))
def retention_validation_lax(stack: contextlib.ExitStack) -> None:
    """Retention validation accepts negative / off-grid intervals (`r % hash_block_size` only).

    Patch: `kv_cache_coordinator._validate_prefix_cache_retention_interval`.
    """
    coord = _core()["coord"]
    orig = coord._validate_prefix_cache_retention_interval

    def lax(retention_interval: Any, scheduler_block_size: int, kv_cache_config: Any) -> None:
        if retention_interval is None or retention_interval == 0:
            return orig(retention_interval, scheduler_block_size, kv_cache_config)
        hbs = min(g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups)
        if retention_interval % hbs:
            raise ValueError(
                f"prefix_cache_retention_interval ({retention_interval}) must be a multiple of {hbs}"
            )
        return None

    _set(stack, coord, "_validate_prefix_cache_retention_interval", lax)


# ----------------------------------------------------------------------- Mamba
@mutant("mamba_sparse_unhashed_crash", strategy="mamba-sparse")
def mamba_sparse_unhashed_crash(stack: contextlib.ExitStack) -> None:
    """Mamba `cache_blocks` asserts every non-null block it walked was hashed (#45845).

    Patch: `MambaManager.cache_blocks` followed by that assertion.
    """
    stm = _core()["stm"]
    orig = stm.MambaManager.cache_blocks

    def cache_blocks(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        out = orig(self, request, *args, **kwargs)
        after = self.num_cached_block.get(rid, 0)
        blocks = self.req_to_blocks.get(rid, [])
        for idx in range(before, min(after, len(blocks))):
            b = blocks[idx]
            if not b.is_null:
                assert b.block_hash is not None, f"Mamba block {b.block_id} at {idx} was not cached"
        return out

    _set(stack, stm.MambaManager, "cache_blocks", cache_blocks)


@mutant("mamba_mask_no_replay_boundary", strategy="mamba-coarse")
def mamba_mask_no_replay_boundary(stack: contextlib.ExitStack) -> None:
    """The Mamba mask ignores the replay boundary (#53504 class). Patch: `reachable_boundaries=()`."""
    stm = _core()["stm"]

    def edit(b: inspect.BoundArguments) -> None:
        b.arguments["reachable_boundaries"] = ()

    _wrap_classmethod_args(stack, stm.MambaManager, "reachable_block_mask", edit)


# -------------------------------------------------------------------- hash map
@mutant("reuse_without_evict")
def reuse_without_evict(stack: contextlib.ExitStack) -> None:
    """A reused block forgets its hash but the map keeps pointing at it (a wrong hit).

    Patch: during `BlockPool.get_new_blocks`, `_maybe_evict_cached_block`
    resets the block's hash without popping the map entries.
    """
    bp = _core()["bp"]
    orig_get = bp.BlockPool.get_new_blocks
    orig_evict = bp.BlockPool._maybe_evict_cached_block
    flag = {"on": False}

    def get_new_blocks(self: Any, num_blocks: int) -> Any:
        flag["on"] = True
        try:
            return orig_get(self, num_blocks)
        finally:
            flag["on"] = False

    def evict(self: Any, block: Any) -> bool:
        if flag["on"]:
            block.reset_hash()
            self.cached_block_hashes_by_block.pop(block.block_id, None)
            return False
        return bool(orig_evict(self, block))

    _set(stack, bp.BlockPool, "get_new_blocks", get_new_blocks)
    _set(stack, bp.BlockPool, "_maybe_evict_cached_block", evict)


@mutant("hit_block_not_unlinked")
def hit_block_not_unlinked(stack: contextlib.ExitStack) -> None:
    """A free hit block stays in the free queue: handed to two requests (#33775 / #44409 class).

    Patch: `BlockPool.touch` without `free_block_queue.remove`.
    """
    bp = _core()["bp"]

    def touch(self: Any, blocks: Any) -> None:
        for b in blocks:
            if not b.is_null:
                b.ref_cnt += 1

    _set(stack, bp.BlockPool, "touch", touch)


@mutant("blockremoved_while_resident")
def blockremoved_while_resident(stack: contextlib.ExitStack) -> None:
    """A second copy of a resident hash is not announced; evicting either emits BlockRemoved (#55092).

    Patch: `BlockPool.cache_full_blocks` drops from its BlockStored the hashes
    already in the map before the call.
    """
    bp = _core()["bp"]
    orig = bp.BlockPool.cache_full_blocks
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    def cache_full_blocks(self: Any, *args: Any, **kwargs: Any) -> None:
        gid = kwargs.get("kv_cache_group_id", args[5] if len(args) > 5 else None)
        resident = {
            maybe_convert_block_hash(k[:-4])
            for k in self.cached_block_hash_to_block._cache
            if int.from_bytes(k[-4:], "big") == gid
        }
        before = len(self.kv_event_queue)
        orig(self, *args, **kwargs)
        if len(self.kv_event_queue) > before and isinstance(self.kv_event_queue[-1], BlockStored):
            ev = self.kv_event_queue[-1]
            kept = [h for h in ev.block_hashes if h not in resident]
            if not kept:
                self.kv_event_queue.pop()
            elif len(kept) < len(ev.block_hashes):
                ev.block_hashes[:] = kept

    _set(stack, bp.BlockPool, "cache_full_blocks", cache_full_blocks)


# ------------------------------------------------------------- token accounting
@mutant("compress_ratio_not_divided")
def compress_ratio_not_divided(stack: contextlib.ExitStack) -> None:
    """Token counts not divided by the compress ratio (DSv4 compressor; modeled, ratio 2).

    Patch: `FullAttentionManager.get_num_blocks_to_allocate` / `allocate_new_blocks`
    see twice the tokens (see the reference mutant for why this models it).
    """
    stm = _core()["stm"]
    full = stm.FullAttentionManager
    get_n = full.get_num_blocks_to_allocate
    alloc = full.allocate_new_blocks

    def get_num_blocks_to_allocate(self: Any, request_id: str, num_tokens: int, *a: Any, **k: Any) -> Any:
        return get_n(self, request_id, num_tokens * 2, *a, **k)

    def allocate_new_blocks(self: Any, request_id: str, num_tokens: int, *a: Any, **k: Any) -> Any:
        return alloc(self, request_id, num_tokens * 2, *a, **k)

    _set(stack, full, "get_num_blocks_to_allocate", get_num_blocks_to_allocate)
    _set(stack, full, "allocate_new_blocks", allocate_new_blocks)


# ------------------------------------------------------------ batched steps
@mutant("mamba_same_step_guard_off", strategy="mamba-sparse")
def mamba_same_step_guard_off(stack: contextlib.ExitStack) -> None:
    """A request may resume from a Mamba state another request keyed in the same step.

    Patch: `MambaManager.get_num_blocks_to_allocate` runs with an empty
    `cached_blocks_this_step`, so the same-step guard never refuses. Only a
    step over several requests reaches the guard: kvretain before batched
    steps (each Schedule its own step) never kills this mutant.
    """
    stm = _core()["stm"]
    orig = stm.MambaManager.get_num_blocks_to_allocate

    def get_num_blocks_to_allocate(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = self.cached_blocks_this_step
        self.cached_blocks_this_step = set()
        try:
            return orig(self, *args, **kwargs)
        finally:
            self.cached_blocks_this_step = saved

    _set(stack, stm.MambaManager, "get_num_blocks_to_allocate", get_num_blocks_to_allocate)


# ------------------------------------------------------------------ lookahead
@mutant("lookahead_slots_dropped", strategy="generated")
def lookahead_slots_dropped(stack: contextlib.ExitStack) -> None:
    """No speculative slots are reserved (spec-decode tokens overrun the block table).

    Patch: `KVCacheCoordinator.get_num_blocks_to_allocate` / `allocate_new_blocks`
    size every group by `num_tokens_main_model` (the lookahead dropped). Only
    configurations with lookahead slots reach it: kvretain before it generated
    them never passed any, so it never kills this mutant.
    """
    coord = _core()["coord"].KVCacheCoordinator
    orig_count = coord.get_num_blocks_to_allocate
    orig_alloc = coord.allocate_new_blocks
    count_sig = inspect.signature(orig_count)
    alloc_sig = inspect.signature(orig_alloc)

    def get_num_blocks_to_allocate(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = count_sig.bind(self, *args, **kwargs)
        bound.arguments["num_tokens"] = bound.arguments["num_tokens_main_model"]
        return orig_count(*bound.args, **bound.kwargs)

    def allocate_new_blocks(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = alloc_sig.bind(self, *args, **kwargs)
        bound.arguments["num_tokens"] = bound.arguments["num_tokens_main_model"]
        return orig_alloc(*bound.args, **bound.kwargs)

    _set(stack, coord, "get_num_blocks_to_allocate", get_num_blocks_to_allocate)
    _set(stack, coord, "allocate_new_blocks", allocate_new_blocks)


# -------------------------------------------------------------- Mamba 'none'
@mutant("mamba_none_state_freed_early", strategy="generated")
def mamba_none_state_freed_early(stack: contextlib.ExitStack) -> None:
    """Mamba 'none' mode frees the block holding the last computed token's state.

    Patch: `MambaManager.get_num_skipped_tokens` returns `num_computed_tokens`
    (one too many) outside 'align' mode. Only 'none' configurations (caching
    off) reach it: kvretain before it rejected them, so it never kills this
    mutant.
    """
    stm = _core()["stm"]
    orig = stm.MambaManager.get_num_skipped_tokens

    def get_num_skipped_tokens(self: Any, num_computed_tokens: int) -> int:
        if self.mamba_cache_mode != "align":
            return num_computed_tokens
        return int(orig(self, num_computed_tokens))

    _set(stack, stm.MambaManager, "get_num_skipped_tokens", get_num_skipped_tokens)


# ------------------------------------------------- fine-grained Mamba hits, CoW copies
@mutant("cow_copy_reversed", strategy="mamba-fine")
def cow_copy_reversed(stack: contextlib.ExitStack) -> None:
    """A hit read in part queues its copy backwards: the private block over the shared state.

    Patch: `SingleTypeKVCacheManager._apply_cow` queues `(cow_block,
    source_block)` instead of `(source_block, cow_block)`. Only a hit that ends
    inside a block makes a consumer copy, i.e. only fine-grained Mamba hits:
    with Mamba blocks no wider than the hash block the patched path never runs.
    """
    stm = _core()["stm"]
    orig = stm.SingleTypeKVCacheManager._apply_cow

    def _apply_cow(self: Any, request_id: str, block_idx: int, source_block: Any, cow_block: Any) -> None:
        orig(self, request_id, block_idx, source_block, cow_block)
        src, dst = self._pending_cow_copies.pop()
        self._pending_cow_copies.append((dst, src))

    _set(stack, stm.SingleTypeKVCacheManager, "_apply_cow", _apply_cow)


@mutant("mamba_fine_hit_floored_to_block", strategy="mamba-fine")
def mamba_fine_hit_floored_to_block(stack: contextlib.ExitStack) -> None:
    """Mamba ignores the hash-block alignment: its hits stop at whole Mamba blocks.

    Patch: `MambaManager.find_longest_cache_hit` runs with `alignment_tokens`
    raised to the Mamba block size whenever it is finer (fine-grained hits on):
    the states keyed inside a block are never found, so the prompt-tail
    checkpoint and its copy are wasted. Without fine-grained hits the alignment
    is never finer than the Mamba block and nothing changes.
    """
    stm = _core()["stm"]

    def edit(bound: inspect.BoundArguments) -> None:
        bs = bound.arguments["kv_cache_spec"].block_size
        if bound.arguments["alignment_tokens"] < bs:
            bound.arguments["alignment_tokens"] = bs

    _wrap_classmethod_args(stack, stm.MambaManager, "find_longest_cache_hit", edit)


@mutant("producer_keys_not_moved", strategy="mamba-fine")
def producer_keys_not_moved(stack: contextlib.ExitStack) -> None:
    """A request that keyed its own state mid-block leaves the key on the block it overwrites.

    Patch: `BlockPool.move_block_hashes` does nothing, so the prompt-tail key
    stays on the running state block (which the next chunk advances) instead of
    moving to the copy. Only fine-grained hits key a state inside its block;
    without them `move_block_hashes` is never called.
    """
    bp = _core()["bp"]

    def move_block_hashes(self: Any, src_block: Any, dst_block: Any) -> None:
        return None

    _set(stack, bp.BlockPool, "move_block_hashes", move_block_hashes)
