"""What an SGLang release offers the radix target, detected from its code, never from its version.

The release matrix (`kvretain matrix --engine sglang`) drives each release with
the adapter its API fits and judges only the cache families it ships:

| capability      | how it is detected                                              | seen in   |
|-----------------|-----------------------------------------------------------------|-----------|
| `unified`       | `sglang.srt.mem_cache.unified_radix_cache` exists               | 0.5.20 .. 0.5.23 |
| `legacy_swa`    | `sglang.srt.mem_cache.swa_radix_cache` exists (`SWARadixCache`) | 0.5.20 (removed in 0.5.21) |
| `legacy_mamba`  | `sglang.srt.mem_cache.mamba_radix_cache` exists (`MambaRadixCache`) | 0.5.20 (removed in 0.5.21) |
| `scheduler_api` | `checkpoint`: `common.checkpoint_kv_cache`, `release_kv_cache(..., checkpoint=)` and `on_release(..., checkpointed=)` (driven by `sglang_drive`); `cache_unfinished`: `common.maybe_cache_unfinished_req` and `release_kv_cache(..., is_insert=)`, with no `on_release` hook or one keyed `inserted=` (driven by `sglang_legacy`); else none | 0.5.22, 0.5.23; 0.5.20, 0.5.21 |
| `release_hook`  | the keyword of `UnifiedRadixCache.on_release(req, *, ...)`, the per-request hook `release_kv_cache` calls last and a driver calls itself when it undoes an admission: none, `inserted` or `checkpointed` | 0.5.20; 0.5.21; 0.5.22, 0.5.23 |
| `window_eviction` | how a decode step slides a request's SWA window: `cache` (`ScheduleBatch.maybe_evict_swa` -> `tree_cache.evict_sliding_windows`, gated by `_swa_eviction_trigger`) or `common` (0.5.20: `_evict_swa` calls `common.free_swa_out_of_window_slots`, gated inline) | 0.5.21 .. 0.5.23; 0.5.20 |
| `paged_cpu`     | a page-size-4 `PagedTokenToKVPoolAllocator` serves `alloc_extend` on this CPU (0.5.20's runs a Triton kernel only) | 0.5.23 |

`derive` is the pure part (facts in, capabilities out) so it is tested without
SGLang; `detect` gathers the facts from the imported release.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import asdict, dataclass
from typing import Any

from model.radix.config import RadixLayout

API_CHECKPOINT = "checkpoint"
API_CACHE_UNFINISHED = "cache_unfinished"
HOOK_INSERTED = "inserted"  # 0.5.21: on_release(req, *, inserted)
HOOK_CHECKPOINTED = "checkpointed"  # 0.5.22, 0.5.23: on_release(req, *, checkpointed)
WINDOW_CACHE = "cache"  # the scheduler's decode path reaches tree_cache.evict_sliding_windows
WINDOW_COMMON = "common"  # 0.5.20: ScheduleBatch._evict_swa calls common.free_swa_out_of_window_slots


@dataclass(frozen=True)
class Facts:
    """What was found in a release (names only)."""

    version: str
    modules: frozenset[str]  # of: unified, legacy_swa, legacy_mamba
    common_functions: frozenset[str]  # public names of sglang.srt.mem_cache.common
    release_params: frozenset[str]  # parameters of common.release_kv_cache
    release_hook: str | None  # keyword of UnifiedRadixCache.on_release, None without the hook
    window_eviction: str  # WINDOW_CACHE or WINDOW_COMMON
    paged_cpu: bool


@dataclass(frozen=True)
class Capabilities:
    version: str
    unified: bool
    legacy_swa: bool
    legacy_mamba: bool
    scheduler_api: str | None
    release_hook: str | None
    window_eviction: str
    paged_cpu: bool

    def families(self) -> tuple[str, ...]:
        """The cache families the adapter can drive on this release."""
        if self.scheduler_api is None:
            return ()
        out = ["unified"] if self.unified else []
        if self.scheduler_api == API_CACHE_UNFINISHED and (self.legacy_swa or self.legacy_mamba):
            out.append("legacy")
        return tuple(out)

    def serves(self, family: str, layout: RadixLayout) -> str | None:
        """None when `family` can be judged on `layout` here, else why not (one line)."""
        if family not in self.families():
            return f"{family} cache not driven on SGLang {self.version}"
        if layout.page_size > 1 and not self.paged_cpu:
            return f"page size {layout.page_size}: SGLang {self.version}'s paged allocator has no CPU path"
        if family == "legacy":
            if layout.components == ("full", "swa") and self.legacy_swa:
                return None
            if layout.components == ("full", "mamba") and self.legacy_mamba and layout.page_size == 1:
                return None
            return f"no legacy cache serves {'+'.join(layout.components)} at page {layout.page_size}"
        return None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "families": list(self.families())}


def derive(facts: Facts) -> Capabilities:
    """The capabilities a release's facts imply."""
    api: str | None = None
    if (
        "checkpoint_kv_cache" in facts.common_functions
        and "checkpoint" in facts.release_params
        and facts.release_hook == HOOK_CHECKPOINTED
    ):
        api = API_CHECKPOINT
    elif (
        "maybe_cache_unfinished_req" in facts.common_functions
        and "is_insert" in facts.release_params
        and facts.release_hook in (None, HOOK_INSERTED)
    ):
        api = API_CACHE_UNFINISHED
    return Capabilities(
        version=facts.version,
        unified="unified" in facts.modules,
        legacy_swa="legacy_swa" in facts.modules,
        legacy_mamba="legacy_mamba" in facts.modules,
        scheduler_api=api,
        release_hook=facts.release_hook,
        window_eviction=facts.window_eviction,
        paged_cpu=facts.paged_cpu,
    )


_MODULES = {
    "unified": "sglang.srt.mem_cache.unified_radix_cache",
    "legacy_swa": "sglang.srt.mem_cache.swa_radix_cache",
    "legacy_mamba": "sglang.srt.mem_cache.mamba_radix_cache",
}


def _paged_cpu() -> bool:
    import torch
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    kv = MHATokenToKVPool(
        size=16,
        page_size=4,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=8,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    alloc = PagedTokenToKVPoolAllocator(
        size=16, page_size=4, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False
    )
    one = torch.tensor([0], dtype=torch.int64)
    four = torch.tensor([4], dtype=torch.int64)
    try:
        out = alloc.alloc_extend(one * 0, one * 0, four, four, torch.tensor([-1]), 4)
    except RuntimeError:  # "0 active drivers": a Triton kernel with no CPU backend
        return False
    return out is not None


def release_hook(cache_cls: Any) -> str | None:
    """The keyword-only parameter of `cache_cls.on_release` (`inserted`, `checkpointed`), or
    None when the class has no such hook (0.5.20's base class has none)."""
    hook = getattr(cache_cls, "on_release", None)
    if hook is None:
        return None
    params = inspect.signature(hook).parameters.values()
    keywords = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return keywords[0] if keywords else None


def window_eviction() -> str:
    """How the imported release's decode step slides a request's SWA window."""
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

    return WINDOW_CACHE if hasattr(BasePrefixCache, "evict_sliding_windows") else WINDOW_COMMON


def detect() -> Capabilities:
    """The imported release's capabilities (call after `sglang_available()`)."""
    from sglang.srt.mem_cache import common

    from invariants.targets.sglang_env import sglang_version

    modules = frozenset(k for k, m in _MODULES.items() if importlib.util.find_spec(m) is not None)
    hook = None
    if "unified" in modules:
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        hook = release_hook(UnifiedRadixCache)
    facts = Facts(
        version=sglang_version() or "?",
        modules=modules,
        common_functions=frozenset(n for n in vars(common) if not n.startswith("_")),
        release_params=frozenset(inspect.signature(common.release_kv_cache).parameters),
        release_hook=hook,
        window_eviction=window_eviction(),
        paged_cpu=_paged_cpu(),
    )
    return derive(facts)
