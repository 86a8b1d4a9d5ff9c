"""Invariants of a radix prefix cache (SGLang's `UnifiedRadixCache` and any like it).

Each function takes plain observations (pool accounts, slot sets, `TreeView`s
from `model/radix/tree.py`, op results) and returns the violations it finds,
one line each (empty = holds). Names starting `radix_` carry over from the
block-pool invariants of vLLM (conservation, no slot in two places, locked
hits kept, promises, events, eviction order); names starting `sglang_` are
specific to SGLang. (SGLang 0.5.23 keeps SWA-tombstone leaves: only full
attention decides whether a node survives, `_iteratively_delete_tombstone_leaf`;
the older "a leaf is never a tombstone" rule is therefore not checked.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from model.radix.config import RadixLayout
from model.radix.evict import evict_full
from model.radix.match import expected_hit
from model.radix.tree import TreeView


class Account(Protocol):
    """One pool's four parts and its size (read-only)."""

    @property
    def pool(self) -> str: ...
    @property
    def available(self) -> int: ...
    @property
    def evictable(self) -> int: ...
    @property
    def protected(self) -> int: ...
    @property
    def held(self) -> int: ...
    @property
    def size(self) -> int: ...


def radix_pool_conservation(accounts: Iterable[Account]) -> list[str]:
    """Every pool: free + evictable + protected + held by running requests == size.

    Guards leaks and double frees (SGLang #27586 "SWA Pool Mem Leak Detected",
    #12693/#16067 Mamba slot leaked on abort; vLLM's free-count invariant)."""
    out = []
    for a in accounts:
        total = a.available + a.evictable + a.protected + a.held
        if total != a.size:
            out.append(
                f"{a.pool} pool: available {a.available} + evictable {a.evictable} + protected {a.protected}"
                f" + held {a.held} = {total} != size {a.size}"
            )
    return out


def radix_slots_disjoint(sets: Mapping[str, set[int]]) -> list[str]:
    """No full-attention slot is both free and in the tree, or free and held by a request,
    or in the tree and held by a request (a slot in two places is a double free waiting)."""
    out = []
    names = sorted(sets)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            both = sets[a] & sets[b]
            if both:
                out.append(f"slots both {a} and {b}: {sorted(both)[:8]}")
    return out


def radix_running_prefix_backed(
    prefixes: Mapping[int, set[int]], free: set[int], cached: set[int]
) -> list[str]:
    """A running request's matched prefix (its row's slots before `cache_protected_len`, which
    it reads and never wrote) stays cached in the tree and is never free: the KV it attends to
    cannot be handed to another request (#29352: tombstone recovery on insert freed
    full-attention KV a running request still held)."""
    out = []
    for rid, slots in sorted(prefixes.items()):
        if slots & free:
            out.append(f"request {rid}'s prefix slots {sorted(slots & free)[:8]} are free")
        elif slots - cached:
            out.append(f"request {rid}'s prefix slots {sorted(slots - cached)[:8]} are not in the tree")
    return out


def radix_free_list_unique(free_lists: Mapping[str, list[int]]) -> list[str]:
    """No free list holds a slot (page) twice: a double free (#12693/#16067 class for Mamba)."""
    out = []
    for pool, ids in free_lists.items():
        if len(ids) != len(set(ids)):
            dups = sorted({i for i in ids if ids.count(i) > 1})
            out.append(f"{pool} free list holds {dups[:8]} more than once")
    return out


def radix_hit_matches_model(
    before: TreeView, tokens: tuple[int, ...], layout: RadixLayout, max_len: int, hit: int
) -> list[str]:
    """A lookup reports exactly the hit the match rule allows on the tree it saw
    (full pages only; SWA: a window of live SWA since the last tombstone; Mamba: a
    state at the node). Guards #17061 (tombstone reset), #29351 (lost full hit), #22935."""
    want = expected_hit(before, tokens, layout, max_len)
    if want != hit:
        return [f"lookup of {len(tokens)} tokens hit {hit}, the match rule allows {want}"]
    return []


def radix_locked_paths_kept(view: TreeView, locked: Mapping[int, int]) -> list[str]:
    """A node a running request locked (rid -> node id) is still in the tree with full KV
    along its whole path: a locked match is never evicted."""
    out = []
    for rid, node_id in locked.items():
        if node_id == view.root:
            continue
        if node_id not in view.nodes:
            out.append(f"request {rid}'s locked node {node_id} was removed")
            continue
        gone = [n for n in view.path(node_id) if not view.nodes[n].full or view.nodes[n].full_lock <= 0]
        if gone:
            out.append(f"request {rid}'s locked path lost full KV or its lock at nodes {gone}")
    return out


def radix_full_promise_kept(view: TreeView, tokens: tuple[int, ...], layout: RadixLayout) -> list[str]:
    """Right after a request finished (full attention only), replaying its tokens hits every
    whole page of them (up to length - 1): finishing caches what it promised."""
    page = layout.page_size
    want = (len(tokens) - 1) // page * page
    got = expected_hit(view, tokens, layout, len(tokens) - 1)
    if got < want:
        return [f"after finish, replaying its {len(tokens)} tokens hits {got} < {want}"]
    return []


def radix_events_replay(replayed: set[tuple[int, ...]], view: TreeView, page_size: int) -> list[str]:
    """BlockStored/BlockRemoved events replay to exactly the cached full-attention pages
    (SGLang #29750: a release that emitted no BlockRemoved)."""
    cached = view.cached_pages(page_size)
    out = []
    if replayed - cached:
        out.append(f"events name {len(replayed - cached)} pages the tree does not hold")
    if cached - replayed:
        out.append(f"the tree holds {len(cached - replayed)} pages no event announced")
    return out


def radix_eviction_lru(before: TreeView, after: TreeView) -> list[str]:
    """A full-attention eviction removes least-recently-used unlocked leaves first: every
    node it removed was used no later than every unlocked leaf it kept (#12007, #31643)."""
    removed = [n for n in before.nodes.values() if n.node_id != before.root and n.node_id not in after.nodes]
    if not removed:
        return []
    kept = [
        n
        for n in before.nodes.values()
        if before.is_leaf(n.node_id)
        and n.full_lock == 0
        and n.node_id in after.nodes
        and after.nodes[n.node_id].full
    ]
    newest_removed = max(n.last_access for n in removed)
    older = [n.node_id for n in kept if n.last_access < newest_removed]
    if older:
        return [f"eviction removed a node used at {newest_removed} but kept older unlocked leaves {older}"]
    return []


def radix_full_eviction_matches_model(
    before: TreeView, after: TreeView, num_tokens: int, evicted: int
) -> list[str]:
    """Full-attention layouts: `evict(num_tokens)` removes exactly the nodes, and reports
    exactly the token count, that LRU over unlocked leaves predicts (`model/radix/evict.py`)."""
    want_nodes, want_tokens = evict_full(before, num_tokens)
    gone = sorted(n for n in before.nodes if n not in after.nodes)
    out = []
    if gone != sorted(want_nodes):
        out.append(f"evict({num_tokens}) removed nodes {gone}, LRU predicts {sorted(want_nodes)}")
    if evicted != want_tokens:
        out.append(f"evict({num_tokens}) reported {evicted} tokens, LRU predicts {want_tokens}")
    return out


def radix_refusal_justified(pools: Mapping[str, tuple[int, int, int]]) -> list[str]:
    """An allocation is refused only when some pool cannot serve it even after evicting all
    it may: for some pool, tokens needed > available + evictable, measured right after the
    refusal (SGLang #29662: decode pre-allocation evicted by full-token count only, so the
    SWA pool ran out while SWA was still evictable)."""
    if any(need > available + evictable for need, available, evictable in pools.values()):
        return []
    shown = ", ".join(f"{p}: need {n}, available {a}, evictable {e}" for p, (n, a, e) in pools.items())
    return [f"allocation refused although every pool could serve it ({shown})"]


def radix_mamba_eviction_lru(before: TreeView, after: TreeView, last_use: Mapping[int, int]) -> list[str]:
    """A Mamba-only eviction removes the least recently *used* unlocked Mamba states first:
    a state is used when a lookup ends on it (the state is copied) or an insert ends on it,
    not when a lookup merely passes through its node (#31643/#31648: a hit that refreshed
    the whole Mamba path degraded eviction order). `last_use`: node id -> logical time."""
    removed = [
        n.node_id
        for n in before.nodes.values()
        if n.mamba and (n.node_id not in after.nodes or not after.nodes[n.node_id].mamba)
    ]
    if not removed:
        return []
    kept = [
        n.node_id
        for n in before.nodes.values()
        if n.mamba and n.mamba_lock == 0 and n.node_id in after.nodes and after.nodes[n.node_id].mamba
    ]
    newest = max(last_use.get(r, 0) for r in removed)
    older = sorted(k for k in kept if last_use.get(k, 0) < newest)
    if older:
        return [
            f"Mamba eviction removed a state used at {newest} but kept older unlocked states at nodes {older}"
        ]
    return []
