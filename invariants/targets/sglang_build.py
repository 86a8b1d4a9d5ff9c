"""Building SGLang's real radix cache and pools from a `RadixLayout`.

Everything built here is SGLang's own class, constructed the way its model
runner does for a small model: `ReqToTokenPool` (or `HybridReqToTokenPool`
with a `MambaPool` when the layout has Mamba), a KV pool (`MHATokenToKVPool`,
`SWAKVPool`, `HybridLinearKVPool`), an allocator (`TokenToKVPoolAllocator`,
`PagedTokenToKVPoolAllocator` for page > 1, `SWATokenToKVPoolAllocator` for
SWA), and `UnifiedRadixCache` with the chosen tree core (`python` or `rust`,
SGLang's `tree_core_backend` override, which is
`SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND` per instance).

KV events are on, so the adapter can replay `BlockStored`/`BlockRemoved`.
Call only after `sglang_available()` answered True.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from model.radix.config import RadixLayout

CORES = ("python", "rust")
# Small tensors: the cache never reads KV values, only slot indices.
_HEAD_NUM, _HEAD_DIM, _LAYERS = 1, 8, 4
_FULL_LAYERS = (1, 3)


@dataclass
class SglangParts:
    """The real objects of one cache instance."""

    cache: Any
    allocator: Any
    req_to_token_pool: Any
    core: str
    # SGLang's KV-event LoRA name table (the scheduler registers each adapter request's
    # namespace in it, `Scheduler._record_kv_event_lora_name`); None on legacy releases.
    lora_names: Any = None


def _server_args(layout: RadixLayout) -> None:
    from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    args = ServerArgs(model_path="dummy", page_size=layout.page_size)
    # Otherwise read from a model config on the hub (offline here).
    args._mamba_cache_chunk_size = max(CHUNK_SIZE, layout.page_size)
    set_global_server_args_for_scheduler(args)


def _req_pool(layout: RadixLayout) -> Any:
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, ReqToTokenPool

    if not layout.has_mamba:
        return ReqToTokenPool(
            size=layout.max_reqs, max_context_len=layout.max_context, device="cpu", enable_memory_saver=False
        )
    mamba_layers = [i for i in range(_LAYERS) if i not in _FULL_LAYERS]
    with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
        shape = Mamba2StateShape.create(
            tp_world_size=1,
            intermediate_size=32,
            n_groups=1,
            num_heads=2,
            head_dim=16,
            state_size=4,
            conv_kernel=4,
        )
        params = Mamba2CacheParams(shape=shape, layers=mamba_layers)
    return HybridReqToTokenPool(
        size=layout.max_reqs,
        mamba_size=layout.mamba_size,
        mamba_spec_state_size=layout.max_reqs,
        max_context_len=layout.max_context,
        device="cpu",
        enable_memory_saver=False,
        cache_params=params,
        mamba_layer_ids=mamba_layers,
        enable_mamba_extra_buffer=layout.page_size > 1,
        speculative_num_draft_tokens=3,
    )


def _allocator(layout: RadixLayout, req_pool: Any) -> Any:
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MHATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    common = dict(dtype=torch.bfloat16, head_num=_HEAD_NUM, head_dim=_HEAD_DIM, device="cpu")
    swa_layers = [i for i in range(_LAYERS) if i not in _FULL_LAYERS]
    if layout.has_swa:
        kv = SWAKVPool(
            size=layout.kv_size,
            size_swa=layout.swa_pool_size,
            page_size=layout.page_size,
            swa_attention_layer_ids=swa_layers,
            full_attention_layer_ids=list(_FULL_LAYERS),
            **common,
        )
        return SWATokenToKVPoolAllocator(
            size=layout.kv_size,
            size_swa=layout.swa_pool_size,
            page_size=layout.page_size,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=kv,
            need_sort=False,
        )
    if layout.has_mamba:
        kv = HybridLinearKVPool(
            size=layout.kv_size,
            page_size=layout.page_size,
            full_attention_layer_ids=list(_FULL_LAYERS),
            enable_memory_saver=False,
            mamba_pool=req_pool.mamba_pool,
            **common,
        )
    else:
        kv = MHATokenToKVPool(
            size=layout.kv_size,
            page_size=layout.page_size,
            layer_num=_LAYERS,
            enable_memory_saver=False,
            **common,
        )
    if layout.page_size == 1:
        return TokenToKVPoolAllocator(
            size=layout.kv_size, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False
        )
    return PagedTokenToKVPoolAllocator(
        size=layout.kv_size,
        page_size=layout.page_size,
        dtype=torch.bfloat16,
        device="cpu",
        kvcache=kv,
        need_sort=False,
    )


def build_cache(layout: RadixLayout, core: str = "python") -> SglangParts:
    """SGLang's real cache, allocator and request pool for `layout`, on tree core `core`."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.events import KvEventLoraNames
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    if core not in CORES:
        raise ValueError(f"core: must be one of {CORES}, got {core!r}")
    layout.validate()
    _server_args(layout)
    req_pool = _req_pool(layout)
    allocator = _allocator(layout, req_pool)
    kinds = {"full": ComponentType.FULL, "swa": ComponentType.SWA, "mamba": ComponentType.MAMBA}
    lora_names = KvEventLoraNames()
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=layout.page_size,
        sliding_window_size=layout.sliding_window,
        tree_components=tuple(kinds[c] for c in layout.components),
        enable_mamba_extra_buffer=layout.has_mamba and layout.page_size > 1,
        enable_kv_cache_events=True,
        eviction_policy="lru",
        tree_core_backend=core,
        kv_event_lora_names=lora_names,
    )
    cache = UnifiedRadixCache(params=params)
    if cache._tree_core_backend != core:
        raise RuntimeError(f"SGLang chose tree core {cache._tree_core_backend!r}, not {core!r}")
    return SglangParts(
        cache=cache, allocator=allocator, req_to_token_pool=req_pool, core=core, lora_names=lora_names
    )
