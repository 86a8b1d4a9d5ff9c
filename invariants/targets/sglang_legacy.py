"""Driving SGLang 0.5.20's caches (the legacy `SWARadixCache` / `MambaRadixCache` and that
release's `UnifiedRadixCache`) and 0.5.21's `UnifiedRadixCache`, through their scheduler API.

0.5.20 ships both cache families (the unified cache is its default; the two
legacy classes are still in the wheel and are removed in 0.5.21). 0.5.20 and
0.5.21 speak the same scheduler-side calls, which differ from 0.5.22's and
0.5.23's (`sglang_drive`):

| scheduler step        | 0.5.20, 0.5.21 (here)                           | 0.5.22, 0.5.23 (`sglang_drive`)      |
|-----------------------|-------------------------------------------------|--------------------------------------|
| lock after a match    | `inc_lock_ref(last_node).to_dec_params()` -> `req.lock_receipt` | `cache.lock(node)`  |
| publish a chunk       | `cache_unfinished_req(req, chunked=True)`      | `checkpoint_kv_cache(req, cache)`     |
| finish / abort        | `release_kv_cache(req, cache, is_insert=...)`  | `release_kv_cache(req, cache, checkpoint=...)` |
| tree core choice      | `SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND` (env) | `CacheInitParams.tree_core_backend`  |

Two steps differ between 0.5.20 and 0.5.21, each switched on a capability read
from the release (`sglang_capabilities`), not on its version:

- `release_hook`: 0.5.21's unified cache has `on_release(req, *, inserted)`,
  the last step of `release_kv_cache`; an admission undone before any
  release (its first chunk found no room) calls it itself, as `sglang_drive`
  calls 0.5.23's `on_release(req, *, checkpointed)`. 0.5.20 has no hook.
- `window_eviction`: a decode step. 0.5.20 (`common`): one slot per sampled
  token, then `free_swa_out_of_window_slots` (the body of 0.5.20's
  `ScheduleBatch._evict_swa`) behind `maybe_evict_swa`'s gate. 0.5.21
  (`cache`): `SglangDriver`'s decode step, unchanged: `check_decode_mem`, then
  the release's decode allocation, whose `maybe_evict_swa` slides the window
  through `tree_cache.evict_sliding_windows`.

Both slide a window at every due step (`swa_eviction_interval` 1, as
`SglangDriver`). `LegacyDriver` keeps `SglangDriver`'s contract (one
`RadixOp` in, one `OpResult` out, rejections rolled back) and reuses its
allocation path (`alloc_token_slots` / `alloc_paged_token_slots_extend`,
evicting under pressure), so the same checker and invariants judge every
family. A "core" names what is driven: `python` / `rust` (the release's
unified cache on that tree core) or `legacy` (0.5.20's `SWARadixCache` for
full + SWA, `MambaRadixCache` for full + Mamba; neither serves all three
components, nor full attention alone).
"""

from __future__ import annotations

from array import array
from typing import Any

import torch

from invariants.targets.sglang_build import SglangParts, _allocator, _req_pool, _server_args
from invariants.targets.sglang_capabilities import HOOK_INSERTED, WINDOW_CACHE, release_hook, window_eviction
from invariants.targets.sglang_drive import OpResult, RunningReq, SglangDriver
from model.radix.config import RadixLayout
from model.radix.ops import Admit

LEGACY = "legacy"
UNIFIED_CORES = ("python", "rust")


def legacy_serves(layout: RadixLayout) -> bool:
    """Whether a legacy class exists for `layout`: full + SWA, or full + Mamba at page 1."""
    if layout.components == ("full", "swa"):
        return True
    return layout.components == ("full", "mamba") and layout.page_size == 1


def build_v20(layout: RadixLayout, core: str) -> SglangParts:
    """0.5.20's real pools and the cache `core` names (`python`, `rust` or `legacy`)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    layout.validate()
    _server_args(layout)
    req_pool = _req_pool(layout)
    allocator = _allocator(layout, req_pool)
    common: dict[str, Any] = dict(
        disable=False,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=layout.page_size,
        sliding_window_size=layout.sliding_window,
        enable_mamba_extra_buffer=layout.has_mamba and layout.page_size > 1,
        enable_kv_cache_events=True,
        eviction_policy="lru",
    )
    if core == LEGACY:
        if not legacy_serves(layout):
            raise ValueError(f"no legacy cache serves layout {layout.name}")
        if layout.has_swa:
            from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache

            cache = SWARadixCache(params=CacheInitParams(**common))
        else:
            from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache

            cache = MambaRadixCache(params=CacheInitParams(**common))
        return SglangParts(cache=cache, allocator=allocator, req_to_token_pool=req_pool, core=core)
    if core not in UNIFIED_CORES:
        raise ValueError(f"core: must be one of {(*UNIFIED_CORES, LEGACY)}, got {core!r}")
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    kinds = {"full": ComponentType.FULL, "swa": ComponentType.SWA, "mamba": ComponentType.MAMBA}
    params = CacheInitParams(**common, tree_components=tuple(kinds[c] for c in layout.components))
    with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override(core):
        cache = UnifiedRadixCache(params=params)
    if cache._tree_core_backend != core:
        raise RuntimeError(f"SGLang chose tree core {cache._tree_core_backend!r}, not {core!r}")
    return SglangParts(cache=cache, allocator=allocator, req_to_token_pool=req_pool, core=core)


class LegacyDriver(SglangDriver):
    """`SglangDriver` over 0.5.20's and 0.5.21's scheduler API (see the module table)."""

    passes_identity = False  # requests run without their adapter / salt on these releases

    def __init__(self, layout: RadixLayout, core: str = "python") -> None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
        from sglang.srt.mem_cache import allocation, common
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.layout = layout
        self.parts = build_v20(layout, core)
        self.cache = self.parts.cache
        self.running = {}
        self._req_cls, self._sampling = Req, SamplingParams
        self._finish_length, self._finish_abort = FINISH_LENGTH, FINISH_ABORT
        self._alloc, self._common = allocation, common
        self.events = []
        self.last_refusal = None
        # As in SglangDriver: slide a window at every due step (SGLang's default, 128, never
        # slides these short histories).
        self.swa_eviction_interval = 1
        self._release_hook = release_hook(type(self.cache))
        self._window = window_eviction()
        # Per-core views and the model's recency are 0.5.23's (LegacyReader.per_core_views).
        self.tree_calls = []
        self.slot_tokens = {}
        self.slot_writer = {}
        self.lora_by_id = {}
        self.observes_tree = False

    def _note_slot_tokens(self) -> None:
        """Not needed: legacy caches are judged on the Python core's own tree view."""

    def _admit(self, op: Admit) -> OpResult:
        if op.rid in self.running or len(op.tokens) < 1:
            return OpResult(skipped=True)
        if self.parts.req_to_token_pool.available_size() < 1:
            return OpResult(rejected="no request slot")
        req = self._req_cls(
            rid=str(op.rid),
            origin_input_text="",
            origin_input_ids=array("q", op.tokens),
            sampling_params=self._sampling(temperature=0, max_new_tokens=1 << 20),
        )
        req.init_next_round_input(self.cache)
        prefix = req.prefix_indices
        hit = len(prefix)
        # PrefillAdder._req_inc_lock_ref
        req.lock_receipt = self.cache.inc_lock_ref(req.last_node).to_dec_params()
        req.lock = req.lock_receipt  # the checker's "holds a lock" flag
        run = RunningReq(req=req, tokens=op.tokens, prefilled=hit)
        try:
            self._alloc.alloc_req_slots(self.parts.req_to_token_pool, [req], self.cache)
        except RuntimeError as exc:
            self._drop_unbound(req)
            return OpResult(hit=hit, max_len=len(op.tokens) - 1, rejected=str(exc).splitlines()[0])
        if hit:
            self.parts.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, hit)), prefix.to(torch.int32))
        req.kv.cache_protected_len = hit
        self.running[op.rid] = run
        result = self._extend(run, max(1, op.chunk), first=True)
        result.hit, result.max_len, result.locked_node = hit, len(op.tokens) - 1, req.last_node
        return result

    def _unlock(self, req: Any) -> None:
        self.cache.dec_lock_ref(req.last_node, req.lock_receipt)
        req.lock = None

    def _drop_unbound(self, req: Any) -> None:
        self._unlock(req)
        self._drop_mamba(req)

    def _drop_mamba(self, req: Any) -> None:
        if req.kv.holds_mamba:
            self.parts.req_to_token_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
            req.kv.mamba_pool_idx = None

    def _extend(self, run: RunningReq, chunk: int, first: bool = False) -> OpResult:
        req = run.req
        remaining = len(run.tokens) - run.prefilled
        if remaining <= 0:
            return OpResult(skipped=not first)
        if not first:
            # The previous chunk is published before the next one runs.
            req.set_extend_range(0, run.prefilled)
            self._common.maybe_cache_unfinished_req(req, self.cache, chunked=True)
        count = min(chunk, remaining)
        if req.kv.kv_allocated_len == 0:
            req.kv.kv_allocated_len = req.kv.kv_committed_len = run.prefilled
        if not self._grow(run, count):
            if first:
                return self._undo_admission(run)
            return self._reject(run, "out of memory (extend)")
        run.prefilled += count
        return OpResult()

    def _decode(self, run: RunningReq, tokens: tuple[int, ...]) -> OpResult:
        if self._window == WINDOW_CACHE:
            # 0.5.21: the scheduler's decode path is 0.5.23's (check_decode_mem, then
            # alloc_for_decode sliding the window through tree_cache.evict_sliding_windows).
            return SglangDriver._decode(self, run, tokens)
        req = run.req
        if run.prefilled < len(run.tokens):
            return OpResult(skipped=True)
        for token in tokens:
            if not self._grow(run, 1):
                return self._reject(run, "out of memory (decode)")
            req.output_ids.append(token)
            run.decoded.append(token)
            req.decode_batch_idx += 1
            if self.layout.has_swa:
                self._evict_window(req)
        return OpResult()

    def _evict_window(self, req: Any) -> None:
        """`ScheduleBatch.maybe_evict_swa` for one decoding request (its gate, then `_evict_swa`)."""
        window = self.layout.sliding_window or 0
        pos = req.seqlen - 1
        if req.decode_batch_idx < 1 or pos - window < req.kv.swa_evicted_seqlen + self.swa_eviction_interval:
            return
        self._common.free_swa_out_of_window_slots(
            req,
            pos,
            sliding_window_size=window,
            page_size=self.layout.page_size,
            req_to_token_pool=self.parts.req_to_token_pool,
            token_to_kv_pool_allocator=self.parts.allocator,
            is_chunk_cache=False,
            retain_floor=self.cache.swa_retain_floor(req),
        )

    def _undo_admission(self, run: RunningReq) -> OpResult:
        req = run.req
        self.running.pop(int(req.rid))
        self._unlock(req)
        if self._release_hook == HOOK_INSERTED:
            # 0.5.21: release_kv_cache ends with this hook; an undone admission skips
            # release_kv_cache, so it is called here (0.5.23's driver calls its own).
            self.cache.on_release(req, inserted=False)
        self._drop_mamba(req)
        self.parts.req_to_token_pool.free(req)
        return OpResult(rejected="out of memory (admission)")

    def _release(self, rid: int, checkpoint: bool) -> OpResult:
        run = self.running.pop(rid)
        req = run.req
        if checkpoint and run.prefilled < len(run.tokens):
            checkpoint = False
        req.finished_reason = self._finish_length(length=0) if checkpoint else self._finish_abort()
        if not checkpoint and not req.kv.holds_kv:
            self._drop_unbound(req)
            return OpResult()
        self._common.release_kv_cache(req, self.cache, is_insert=checkpoint)
        req.lock = None
        return OpResult()
