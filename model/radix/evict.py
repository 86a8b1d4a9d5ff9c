"""What an eviction request removes from a full-attention radix tree (SGLang 0.5.23, LRU).

Definition (`components/full.py` `_evict_device_start` / `_evict_device_next_node`
with `evict_policy.LRUStrategy`): the candidates are the *evictable leaves*
(leaves with no full-attention lock). Repeatedly take the least recently used
candidate (smallest `last_access`), delete it and count its tokens, until at
least `num_tokens` tokens were evicted or no candidate is left; a parent that
the deletion turned into an unlocked leaf becomes a candidate. Whole nodes go:
the count may overshoot `num_tokens`.

Only the full-attention component is defined here; SWA and Mamba eviction
(tombstones, per-component LRU lists, cascades) are checked by invariants, not
predicted.
"""

from __future__ import annotations

import heapq

from model.radix.tree import TreeView


def evict_full(view: TreeView, num_tokens: int) -> tuple[list[int], int]:
    """(node ids removed, in order; tokens evicted) for `evict(num_tokens)` on `view`."""
    children = {nid: set(kids) for nid, kids in view.children.items()}

    def evictable(nid: int) -> bool:
        node = view.nodes[nid]
        return nid != view.root and not children.get(nid) and node.full and node.full_lock == 0

    heap = [(view.nodes[n].last_access, n) for n in view.nodes if evictable(n)]
    heapq.heapify(heap)
    removed: list[int] = []
    evicted = 0
    while evicted < num_tokens and heap:
        _, nid = heapq.heappop(heap)
        removed.append(nid)
        evicted += len(view.nodes[nid].tokens)
        parent = view.nodes[nid].parent
        if parent is not None:
            children[parent].discard(nid)
            if evictable(parent):
                heapq.heappush(heap, (view.nodes[parent].last_access, parent))
    return removed, evicted
