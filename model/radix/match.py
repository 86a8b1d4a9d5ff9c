"""What a lookup may hit: SGLang 0.5.23's match rule over a `TreeView`.

Definition (`unified_tree_core._match_prefix_helper` with the per-component
validators of `components/{full,swa,mamba}.py`):

1. The key is the request's tokens cut to `max_len` (the scheduler passes
   input length - 1) and floored to whole pages; the root's empty key always hits.
2. Walk from the root along children of the request's namespace (its LoRA adapter and
   cache salt: `RadixKey.child_key` keys every child by them, so a match never crosses
   namespaces) whose key agrees page by page. A node
   matched only in part counts as its matched part (SGLang splits it there);
   that part keeps the node's SWA state but not its Mamba state (a state sits
   at a node's end).
3. Each node on the walk is a valid end when every component accepts it:
   - full: always (its KV is on the device);
   - SWA: a tombstone resets the count of live SWA tokens to 0 and is never a
     valid end; otherwise the count grows by the node's length, and the node is
     a valid end when the count (infinite while no tombstone was seen) reaches
     the sliding window;
   - Mamba: the node carries a state.
4. The hit is the prefix length up to the last valid end.
"""

from __future__ import annotations

import math

from model.radix.config import RadixLayout
from model.radix.tree import DEFAULT_NAMESPACE, Namespace, TreeView


def _agree(a: tuple[int, ...], b: tuple[int, ...], page_size: int) -> int:
    """Tokens of whole pages on which `a` and `b` agree from their start."""
    n = 0
    limit = min(len(a), len(b))
    while n + page_size <= limit and a[n : n + page_size] == b[n : n + page_size]:
        n += page_size
    return n


def child_on_page(view: TreeView, node_id: int, page: tuple[int, ...], namespace: Namespace) -> int | None:
    """The child of `node_id` in `namespace` whose key starts with `page`, or None."""
    n = len(page)
    return next(
        (
            c
            for c in view.children.get(node_id, [])
            if view.nodes[c].namespace == namespace and view.nodes[c].tokens[:n] == page
        ),
        None,
    )


def expected_hit(
    view: TreeView,
    tokens: tuple[int, ...],
    layout: RadixLayout,
    max_len: int,
    namespace: Namespace = DEFAULT_NAMESPACE,
) -> int:
    """The device prefix length SGLang must report for `tokens` looked up in `namespace`
    (see module docstring)."""
    page = layout.page_size
    key = tokens[: max(0, max_len)]
    key = key[: len(key) // page * page]
    node_id, offset, best = view.root, 0, 0
    swa_run = math.inf
    while offset < len(key):
        child_id = child_on_page(view, node_id, key[offset : offset + page], namespace)
        if child_id is None or not view.nodes[child_id].full:
            break
        child = view.nodes[child_id]
        matched = _agree(child.tokens, key[offset:], page)
        whole = matched == len(child.tokens)
        valid = True
        if layout.has_swa:
            if not child.swa:
                swa_run, valid = 0, False
            else:
                swa_run += matched
                valid = swa_run >= (layout.sliding_window or 0)
        if layout.has_mamba and not (whole and child.mamba):
            valid = False
        offset += matched
        if valid:
            best = offset
        if not whole:
            break
        node_id = child_id
    return best
