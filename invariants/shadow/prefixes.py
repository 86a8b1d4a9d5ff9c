"""Provenance: the exact identity of a token prefix.

The KV of position `p` of a request is a function of its tokens `t[0..p]`
(and of nothing else the allocator decides), so two requests may share a
block exactly where their prefixes are equal. `PrefixIds` names every prefix
it has seen by a small integer, interned in a trie: equal prefixes get equal
ids and different prefixes different ids, with no hash to collide. The empty
prefix is `EMPTY`.
"""

from __future__ import annotations

from collections.abc import Iterable

EMPTY = 0


class PrefixIds:
    """Interned token prefixes: `extend(parent, token)` is the id of the parent
    prefix followed by `token`, the same id every time it is asked."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, int], int] = {}

    def extend(self, parent: int, token: int) -> int:
        """The id of prefix `parent` followed by `token`."""
        key = (parent, token)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = len(self._children) + 1
        return found

    def chain(self, parent: int, tokens: Iterable[int]) -> list[int]:
        """The ids of `parent` extended by each prefix of `tokens`, in order."""
        out = []
        for t in tokens:
            parent = self.extend(parent, t)
            out.append(parent)
        return out

    def __len__(self) -> int:
        return len(self._children)
