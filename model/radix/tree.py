"""What a radix tree holds, as plain data: nodes, per-component values, locks, recency.

A `TreeView` is the observable state of one radix cache (SGLang's
`UnifiedTreeCore`, or any radix cache) translated into tokens and flags. The
root has an empty key. Every other node carries:

- `tokens`: its edge key (a whole number of pages);
- `full`: whether full-attention KV is on the device (a node without it is gone);
- `swa`: SWA KV present (False = a *tombstone*: full KV kept, SWA freed),
  None when the layout has no SWA;
- `mamba`: a Mamba state at the node's end, None when the layout has no Mamba;
- lock refs per component and `last_access` (a logical clock: larger = more recent);
- `namespace`: the (LoRA adapter, cache salt) pair its key belongs to (SGLang's
  `RadixKey.extra_key` / `cache_salt`); `DEFAULT_NAMESPACE` for requests with neither.
  A node's children share its namespace: a lookup walks its own namespace only.

Structural facts that any radix cache keeps (checked in `invariants/catalogue/radix.py`):
a child's first page differs from its siblings'; an auxiliary value needs full KV;
a leaf is never an SWA tombstone (tombstoned leaves are deleted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

Namespace = tuple[str | None, str | None]  # (LoRA adapter name, cache salt)
DEFAULT_NAMESPACE: Namespace = (None, None)


@dataclass(frozen=True)
class NodeView:
    node_id: int
    parent: int | None
    tokens: tuple[int, ...]
    full: bool
    swa: bool | None = None
    mamba: bool | None = None
    full_lock: int = 0
    swa_lock: int = 0
    mamba_lock: int = 0
    last_access: float = 0.0
    namespace: Namespace = DEFAULT_NAMESPACE


@dataclass
class TreeView:
    """All nodes by id; `children` is derived (parent -> child ids, in insertion order)."""

    root: int
    nodes: dict[int, NodeView]
    children: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.children:
            for node in self.nodes.values():
                self.children.setdefault(node.node_id, [])
                if node.parent is not None:
                    self.children.setdefault(node.parent, []).append(node.node_id)

    def path(self, node_id: int) -> list[int]:
        """Node ids from the root's first child down to `node_id`."""
        out: list[int] = []
        cur: int | None = node_id
        while cur is not None and cur != self.root:
            out.append(cur)
            cur = self.nodes[cur].parent
        return out[::-1]

    def prefix(self, node_id: int) -> tuple[int, ...]:
        """The tokens from the root to the end of `node_id`."""
        out: list[int] = []
        for nid in self.path(node_id):
            out.extend(self.nodes[nid].tokens)
        return tuple(out)

    def is_leaf(self, node_id: int) -> bool:
        return node_id != self.root and not self.children.get(node_id)

    def cached_pages(self, page_size: int) -> set[tuple[int, ...]]:
        """Every cached full-attention page, named by the token prefix that ends it."""
        pages: set[tuple[int, ...]] = set()
        for nid, node in self.nodes.items():
            if nid == self.root or not node.full:
                continue
            base = self.prefix(nid)[: -len(node.tokens)] if node.tokens else self.prefix(nid)
            for end in range(page_size, len(node.tokens) + 1, page_size):
                pages.add(base + node.tokens[:end])
        return pages
