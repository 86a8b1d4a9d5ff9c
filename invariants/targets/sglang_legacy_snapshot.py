"""Reading SGLang 0.5.20's and 0.5.21's caches in kvretain's terms (the `LegacyDriver`'s
snapshot reader).

Same observations as `sglang_snapshot` (pool accounts, slot sets, free lists,
tree view), for what differs in 0.5.20: a running request's freed SWA prefix is
`req.kv.swa_evicted_seqlen` (0.5.21, 0.5.23: `get_evicted_seqlen(SWA)`), a request's
last node is a node object rather than a node id, and the legacy caches keep
their own node class (`value`, `swa_tombstone`, `mamba_value`, per-component
lock refs) instead of the unified tree core's `component_data`.
"""

from __future__ import annotations

from typing import Any

from invariants.targets.sglang_drive import SglangDriver
from invariants.targets.sglang_legacy import LEGACY
from invariants.targets.sglang_snapshot import (
    PoolAccount,
    free_lists,
    mamba_slot_sets,
    prefix_slots,
    slot_sets,
)
from invariants.targets.sglang_snapshot import tree_view as unified_tree_view
from model.radix.tree import NodeView, TreeView


def _ceil(n: int, page: int) -> int:
    return (n + page - 1) // page * page


def pool_accounts(driver: SglangDriver) -> list[PoolAccount]:
    """Every pool's account: available + evictable + protected + held == size."""
    cache, alloc, page = driver.cache, driver.parts.allocator, driver.layout.page_size
    reqs = [run.req for run in driver.running.values() if run.req.kv.holds_kv]
    held_full = sum(_ceil(r.kv.kv_allocated_len, page) - r.kv.cache_protected_len for r in reqs)
    swa = driver.layout.has_swa
    out = [
        PoolAccount(
            "full",
            alloc.full_available_size() if swa else alloc.available_size(),
            cache.full_evictable_size(),
            cache.full_protected_size(),
            held_full,
            alloc.size_full if swa else alloc.size,
        )
    ]
    if swa:
        held_swa = 0
        for r in reqs:
            freed = max(0, swa_evicted_seqlen(r.kv) - r.kv.swa_dead_lo(page))
            held_swa += _ceil(r.kv.kv_allocated_len, page) - r.kv.cache_protected_len - freed
        out.append(
            PoolAccount(
                "swa",
                alloc.swa_available_size(),
                cache.swa_evictable_size(),
                cache.swa_protected_size(),
                held_swa,
                alloc.size_swa,
            )
        )
    if driver.layout.has_mamba:
        pool = driver.parts.req_to_token_pool
        held = sum(
            int(run.req.kv.mamba_pool_idx.numel())
            for run in driver.running.values()
            if run.req.kv.holds_mamba
        )
        out.append(
            PoolAccount(
                "mamba",
                pool.mamba_allocator.available_size(),
                cache.mamba_evictable_size(),
                cache.mamba_protected_size(),
                held,
                pool.mamba_pool.size,
            )
        )
    return out


def swa_evicted_seqlen(kv: Any) -> int:
    """The end of a running request's freed SWA prefix: a field in 0.5.20, read per
    component in 0.5.21 (as in 0.5.23)."""
    if hasattr(kv, "get_evicted_seqlen"):
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        return int(kv.get_evicted_seqlen(ComponentType.SWA))
    return int(kv.swa_evicted_seqlen)


def node_id(node: Any) -> int:
    """A request's last node as a node id (the legacy caches hand out node objects,
    the unified cache node ids)."""
    return node if isinstance(node, int) else int(node.id)


def _legacy_tree_view(driver: SglangDriver) -> TreeView:
    root = driver.cache.root_node
    swa, mamba = driver.layout.has_swa, driver.layout.has_mamba
    nodes: dict[int, NodeView] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        is_root = node is root
        nodes[node.id] = NodeView(
            node_id=node.id,
            parent=None if node.parent is None else node.parent.id,
            tokens=() if is_root or node.key is None else tuple(node.key.token_ids),
            full=node.value is not None,
            swa=(not node.swa_tombstone) if swa else None,
            mamba=(node.mamba_value is not None) if mamba else None,
            full_lock=node.full_lock_ref,
            swa_lock=node.swa_lock_ref if swa else 0,
            mamba_lock=node.mamba_lock_ref if mamba else 0,
            last_access=float(node.last_access_time),
        )
        stack.extend(reversed(list(node.children.values())))
    return TreeView(root=root.id, nodes=nodes)


def tree_view(driver: SglangDriver) -> TreeView | None:
    """The tree as a `TreeView`: legacy nodes, or the unified Python core's; None on Rust."""
    if driver.parts.core == LEGACY:
        return _legacy_tree_view(driver)
    return unified_tree_view(driver)


def sanity_check(driver: SglangDriver) -> str | None:
    """SGLang's own `sanity_check()`, where it applies: None when it holds.

    The legacy caches' check is written for an idle scheduler (it asserts that
    no LRU node is locked), so it runs only when no request is running; the
    unified cache's runs always. The legacy Mamba check re-raises through a
    tensor-parallel lookup that fails on one process, so the original
    assertion (the exception's context) is reported."""
    if driver.parts.core == LEGACY and driver.running:
        return None
    try:
        driver.cache.sanity_check()
    except Exception as exc:  # the legacy checks raise Exception, the unified one AssertionError
        cause = exc.__context__ if isinstance(exc.__context__, AssertionError) else exc
        return str(cause).splitlines()[0][:300] if str(cause) else type(cause).__name__
    return None


def legacy_slot_sets(driver: SglangDriver) -> dict[str, set[int]]:
    """`sglang_snapshot.slot_sets`, with the cached set read node by node on the legacy
    caches (their `all_values_flatten` fails on an empty tree)."""
    if driver.parts.core != LEGACY:
        return slot_sets(driver)
    cached: set[int] = set()
    stack = [driver.cache.root_node]
    while stack:
        node = stack.pop()
        if node is not driver.cache.root_node and node.value is not None:
            cached.update(int(x) for x in node.value.tolist())
        stack.extend(node.children.values())
    alloc, page = driver.parts.allocator, driver.layout.page_size
    full_alloc = alloc.full_attn_allocator if driver.layout.has_swa else alloc
    free = {int(p) * page + i for p in full_alloc.get_all_free_pages().tolist() for i in range(page)}
    held: set[int] = set()
    rows = driver.parts.req_to_token_pool.req_to_token
    for run in driver.running.values():
        kv = run.req.kv
        if kv.holds_kv:
            held.update(
                int(x) for x in rows[kv.req_pool_idx, kv.cache_protected_len : kv.kv_allocated_len].tolist()
            )
    return {"free": free, "cached": cached, "held": held}


class LegacyReader:
    """The snapshot reader `RadixChecker` uses for 0.5.20's caches. Per-core views and the
    model's recency are 0.5.23's (`UnifiedReader`); legacy caches are judged on the Python
    core's own view, its access times included."""

    per_core_views = False
    pool_accounts = staticmethod(pool_accounts)
    slot_sets = staticmethod(legacy_slot_sets)
    free_lists = staticmethod(free_lists)
    mamba_slot_sets = staticmethod(mamba_slot_sets)
    prefix_slots = staticmethod(prefix_slots)
    tree_view = staticmethod(tree_view)
    node_id = staticmethod(node_id)
    sanity_check = staticmethod(sanity_check)
