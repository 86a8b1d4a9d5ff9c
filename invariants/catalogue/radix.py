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
from model.radix.match import child_on_page, expected_hit
from model.radix.tree import DEFAULT_NAMESPACE, Namespace, TreeView


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
    before: TreeView,
    tokens: tuple[int, ...],
    layout: RadixLayout,
    max_len: int,
    hit: int,
    namespace: Namespace = DEFAULT_NAMESPACE,
) -> list[str]:
    """A lookup reports exactly the hit the match rule allows on the tree it saw, in the
    request's namespace (full pages only; SWA: a window of live SWA since the last
    tombstone; Mamba: a state at the node). Guards #17061 (tombstone reset), #29351 (lost
    full hit), #22935."""
    want = expected_hit(before, tokens, layout, max_len, namespace)
    if want != hit:
        return [f"lookup of {len(tokens)} tokens hit {hit}, the match rule allows {want}"]
    return []


def radix_hit_same_identity(
    hit_slots: Iterable[int], writers: Mapping[int, Namespace], namespace: Namespace
) -> list[str]:
    """Isolation: every full-attention slot a lookup hands a request as its prefix was
    written by a request of the same identity (LoRA adapter and cache salt), whatever the
    tree says about it. `writers` maps each slot to the identity of the request that was
    allocated it last (the target's own provenance, not the model). A hit across
    identities lets one tenant read KV another tenant's prompt wrote (a timing side channel,
    why `cache_salt` exists) or run an adapter over another adapter's KV."""
    crossed = sorted({(s, writers.get(s)) for s in hit_slots if writers.get(s) != namespace}, key=str)
    if not crossed:
        return []
    slot, other = crossed[0]
    return [
        f"a request of identity {namespace} hit {len(crossed)} slot(s) written by another identity "
        f"(slot {slot}: {other})"
    ]


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


def radix_full_promise_kept(
    view: TreeView, tokens: tuple[int, ...], layout: RadixLayout, namespace: Namespace = DEFAULT_NAMESPACE
) -> list[str]:
    """Right after a request finished (full attention only), replaying its tokens hits every
    whole page of them (up to length - 1): finishing caches what it promised."""
    page = layout.page_size
    want = (len(tokens) - 1) // page * page
    got = expected_hit(view, tokens, layout, len(tokens) - 1, namespace)
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


def _page_floor(n: int, page: int) -> int:
    return n // page * page


def _page_ceil(n: int, page: int) -> int:
    return -(-n // page) * page


def radix_finished_prefix_promise(
    view: TreeView,
    seq: tuple[int, ...],
    cached: int,
    own_from: int,
    swa_freed: int,
    layout: RadixLayout,
    namespace: Namespace = DEFAULT_NAMESPACE,
) -> list[str]:
    """Right after a request finished (in its namespace), a next turn that extends its sequence hits the whole
    prefix the finish caches (page-floored), on every layout, as the tree's retention rules
    promise:

    - full attention: the finish caches every whole page of `seq[:cached]`;
    - SWA: the request freed its own SWA only below `swa_freed` (its window slides keep at
      least a window plus a page: `free_swa_out_of_window_slots`); what it held from
      `max(own_from, swa_freed)` on is cached live, so when that span covers the window the
      window-reachable tail ends at the cached prefix (the match rule: a window of live SWA
      since the last tombstone). When the request's own live span is shorter than the
      window the hit rests on tree state it did not write: no promise
      (`finished_prefix_promised` returns None);
    - Mamba: the finish donates its state to the node that ends the cached prefix (page 1),
      so the hit reaches that checkpoint.

    `cached` is what the finish inserts: the committed length, or SGLang's SWA branch point
    when the request's lookup set one (`swa.py` `prepare_for_caching_req`: a request whose
    full-attention match ran past its SWA hit publishes up to that point only). `own_from`
    is the request's `cache_protected_len` before the finish (below it, the tree's KV, not
    the request's). Nothing can be evicted between the finish and this check, so a shorter
    hit is a promise broken on a valid tree (an SWA or Mamba hit lost at the finish, or a
    page not cached)."""
    promised = finished_prefix_promised(cached, own_from, swa_freed, layout)
    if not promised:
        return []
    key = seq[:cached] + (-1,)  # a next turn: one more token after the cached prefix
    got = expected_hit(view, key, layout, cached, namespace)
    if got >= promised:
        return []
    why = _promise_gap(view, key, layout, got, promised, namespace)
    return [f"after finish (caching {cached} tokens), a next turn hits {got} < promised {promised}: {why}"]


def finished_prefix_promised(cached: int, own_from: int, swa_freed: int, layout: RadixLayout) -> int | None:
    """The hit a finish promises a next turn (see `radix_finished_prefix_promise`), or None
    when the layout's rule makes no promise for this request (SWA: its own live span is
    shorter than the window)."""
    page = layout.page_size
    end = _page_floor(cached, page)
    if layout.has_swa:
        live_from = _page_ceil(max(own_from, swa_freed), page)
        if end - live_from < (layout.sliding_window or 0):
            return None
    return end


def _promise_gap(
    view: TreeView, key: tuple[int, ...], layout: RadixLayout, got: int, promised: int, namespace: Namespace
) -> str:
    """Which retained part is missing on the path of `key` up to `promised` (one phrase)."""
    page = layout.page_size
    node_id, offset = view.root, 0
    while offset < promised:
        child_id = child_on_page(view, node_id, key[offset : offset + page], namespace)
        if child_id is None or not view.nodes[child_id].full:
            return f"no full-attention page at token {offset}"
        child = view.nodes[child_id]
        if layout.has_swa and child.swa is False and offset + len(child.tokens) > got:
            return f"SWA tombstone on tokens [{offset}, {offset + len(child.tokens)})"
        offset += len(child.tokens)
        node_id = child_id
    if layout.has_mamba and (offset != promised or not view.nodes[node_id].mamba):
        return f"no Mamba state at token {promised}"
    return "the match rule stops short"


def radix_eviction_scope(before: TreeView, after: TreeView, request: tuple[int, int, int]) -> list[str]:
    """An eviction asked of one component takes its victims from that component's own
    candidates, on each tree core (SGLang 0.5.23: `components/{full,swa,mamba}.py`, each
    walk over its own list, cascading only to lower-priority data of the same node):

    - full attention: removes whole unlocked nodes and changes no node it keeps (no SWA
      tombstone, no Mamba state dropped);
    - SWA: tombstones or removes only nodes that held live SWA, unlocked; every kept node
      keeps its full KV, and a kept node loses its Mamba state only with its SWA;
    - Mamba: drops or removes only nodes that held a state, unlocked; every kept node
      keeps its full KV and SWA.

    `request` = (full tokens, SWA tokens, Mamba states) asked, with exactly one non-zero
    (the caller passes only such requests). Guards an eviction that walks another
    component's LRU scope (a full request tombstoning SWA, an SWA request deleting
    leaves it never held)."""
    full, swa, mamba = request
    scope = "full" if full else "swa" if swa else "mamba"
    out: list[str] = []
    for nid, old in before.nodes.items():
        if nid == before.root:
            continue
        new = after.nodes.get(nid)
        if new is None:
            held = {"full": old.full, "swa": bool(old.swa), "mamba": bool(old.mamba)}[scope]
            if not held or old.full_lock > 0:
                why = "locked" if old.full_lock > 0 else f"held no {scope} value"
                out.append(f"{scope} eviction removed node {nid} ({len(old.tokens)} tokens), which {why}")
            continue
        lost = {c for c in ("full", "swa", "mamba") if getattr(old, c) and not getattr(new, c)}
        if scope == "full":
            allowed: set[str] = set()
        elif scope == "swa":
            allowed = {"swa", "mamba"} if "swa" in lost else set()
        else:
            allowed = {"mamba"}
        if lost - allowed:
            out.append(f"{scope} eviction took {sorted(lost - allowed)} from node {nid}, which it keeps")
    return out[:4]
