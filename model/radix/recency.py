"""Which cached node was used last: SGLang 0.5.23's full-attention recency, from what happened.

Full-attention eviction takes the least recently used evictable leaf
(`model/radix/evict.py`). SGLang orders leaves by `last_access_time`, a counter
the tree core stamps; the Rust core keeps its own and exposes none. This module
defines the same order from what a scheduler can see: the op sequence, where
each lookup and insert of an op ended (node ids) and the tree before and after.
A recency is `(op clock, step within the op)`; larger is more recent.

Definition (`unified_tree_core`: `_match_post_processor`, `_insert_walk_step` /
`_touch_node`, `_split_node`, `_add_new_node`; Mamba's
`commit_insert_component_data`), applied per call in call order:

1. A split (a node new in this call whose child existed before: the new node is
   the head, the old node keeps its id as the tail) stamps the head at its
   creation, then the tail (`_split_node` refreshes the tail after creating the
   head). Where one call made a chain of heads (an insert that split a node at
   its overlap and again at an SWA tombstone boundary), the lowest split came
   first and each higher one split the head below it (stamping the new head,
   then the one below); a new leaf at the end of an insert is made last.
2. A lookup ending at node B (`best_match_node`) stamps the splits of its walk,
   then every node from the root's child down to B, deeper more recent (the
   post-processor walks up from B with decreasing times). A lookup that
   validates nothing (B = root) stamps nothing but its split.
3. An insert ending at node T walks the root's child down to T, stamping each
   node it passes (deeper more recent) and its splits and new leaf as in 1.
   With Mamba, committing the state stamps T last.
4. Nothing else changes recency: locks, SWA window slides, SWA/Mamba tombstoning
   and evictions leave the survivors' recency as it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from model.radix.tree import TreeView

Recency = tuple[int, int]


Call = tuple[str, Sequence[int], Sequence[int]]  # (kind, path to its end, path walked)


def advance(
    recency: Mapping[int, Recency],
    before_ids: set[int],
    after: TreeView,
    calls: Sequence[Call],
    clock: int,
    has_mamba: bool,
) -> dict[int, Recency]:
    """The recency of every node of `after` once the op numbered `clock` made `calls`
    on a tree that held `before_ids` (see the module docstring). A call is ("match" or
    "insert", the node ids from the root's child to where it ended, the ids it walked),
    as they stood right after the call. Nodes gone from `after` are dropped."""
    out = {n: r for n, r in recency.items() if n in after.nodes and n != after.root}
    known = set(before_ids)
    step = 0

    def stamp(nid: int) -> None:
        nonlocal step
        if nid in after.nodes and nid != after.root:
            out[nid] = (clock, step)
        step += 1

    def made(run: list[int]) -> None:
        """Consecutive nodes this call created, top down. Those with an old tail below them
        are split heads: the lowest split came first (head, then its tail), each higher
        split after it (the new head, then the head below it, now a tail); a new leaf at
        the end was made last."""
        split = [i for i, nid in enumerate(run) if any(c in known for c in after.children.get(nid, []))]
        cut = split[-1] + 1 if split else 0
        below = next((c for c in after.children.get(run[cut - 1], []) if c in known), None) if cut else None
        for head in reversed(run[:cut]):
            stamp(head)
            if below is not None:
                stamp(below)
            below = head
        for leaf in run[cut:]:
            stamp(leaf)

    def walk(ids: Sequence[int], touch: bool) -> None:
        run: list[int] = []
        for nid in ids:
            if nid in known:
                if run:
                    made(run)
                    run = []
                if touch:
                    stamp(nid)
            else:
                run.append(nid)
        if run:
            made(run)

    for kind, path, walked in calls:
        if kind == "match":
            walk(walked, touch=False)
            for nid in path:
                stamp(nid)
        else:
            walk(path, touch=True)
            if has_mamba and path:
                stamp(path[-1])
        known.update(path)
        known.update(walked)
    for nid in sorted(after.nodes):  # a node no call explains: stamped as made, last
        if nid != after.root and nid not in out:
            stamp(nid)
    return out


def as_time(r: Recency) -> float:
    """A recency as one number that orders as the pair does (for `TreeView.last_access`)."""
    return float(r[0] * 1_000_000 + r[1])
