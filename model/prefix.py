"""Token prefixes named by interned trie nodes: equal content <=> the same object.

A hash in vLLM stands for a token prefix; the project names it by that prefix
(see `model.observation`). Holding each prefix as a tuple costs O(n) per name
and O(n^2) per prompt of n tokens, which a 1M-token prompt cannot afford. A
`Prefix` is instead a node of one process-wide trie:

- a node is `parent + chunk`; a node whose length is a multiple of `CHAIN` is
  *full* (its chunk is `CHAIN` tokens) and only full nodes have children, so a
  prefix of n tokens is the unique chain of n // CHAIN full nodes plus, when
  n % CHAIN != 0, one *tail* node of the remaining tokens;
- nodes are interned on (parent, chunk), so two live prefixes with the same
  tokens are the same object: equality is identity, exactly, with no
  assumption that some hash is collision-free;
- the table holds nodes weakly: a prefix no allocator state, event or request
  refers to any more is collected, so memory follows the live state;
- `hash()` is computed from the content once (deterministic across runs), and
  `tokens()` recovers the content for display and traces.

Naming a prefix of a tuple costs O(new tokens): `prefix(tokens, n)` remembers
the chain built along the last few tuples it saw, and `extend(p, tokens)`
appends to an existing prefix.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, overload

Tokens = tuple[int, ...]

CHAIN = 32  # tokens per full node: a node per 32 tokens, a tail rebuilt in O(32)
_MEMO_TUPLES = 128  # token tuples whose chains `prefix` remembers (LRU) ...
# ... costing at most this many nodes in all (`_cost`: 16M tokens of tuples, enough
# for the live requests of a production run, whose chains a lookup walks again and again)
_MEMO_NODES = 1 << 19


class Prefix:
    """The interned name of a token prefix (see the module docstring)."""

    __slots__ = ("parent", "chunk", "length", "_hash", "__weakref__")

    parent: Prefix | None
    chunk: Tokens
    length: int
    _hash: int

    def __len__(self) -> int:
        return self.length

    @property
    def last(self) -> int | None:
        """The last token (None for the empty prefix), O(1)."""
        return self.chunk[-1] if self.chunk else None

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        # Interned: identity is content equality. A plain tuple compares by content (O(n)).
        if isinstance(other, Prefix):
            return self is other
        if isinstance(other, tuple):
            return len(other) == self.length and self.tokens() == other
        return NotImplemented

    def __lt__(self, other: Prefix) -> bool:
        return self.tokens() < other.tokens()

    def __copy__(self) -> Prefix:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Prefix:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (prefix, (self.tokens(),))

    def __repr__(self) -> str:
        toks = self.tokens() if self.length <= 8 else None
        return f"Prefix({toks!r})" if toks is not None else f"Prefix(<{self.length} tokens>)"

    def tokens(self) -> Tokens:
        """The content, O(length)."""
        chunks: list[Tokens] = []
        node: Prefix | None = self
        while node is not None:
            chunks.append(node.chunk)
            node = node.parent
        return tuple(t for c in reversed(chunks) for t in c)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Prefix | Tokens: ...
    def __getitem__(self, index: int | slice) -> int | Prefix | Tokens:
        """`p[:n]` (n >= 0) is the interned prefix of p's first n tokens, in
        O(distance / CHAIN); any other index reads the content (a tuple, O(length))."""
        if (
            isinstance(index, slice)
            and index.start in (None, 0)
            and index.step in (None, 1)
            and (index.stop is None or index.stop >= 0)
        ):
            return self.head(self.length if index.stop is None else min(self.length, index.stop))
        return self.tokens()[index]

    def head(self, n: int) -> Prefix:
        """The prefix of the first n tokens (0 <= n <= length)."""
        if n >= self.length:
            return self
        base = n - n % CHAIN
        node = self
        while node.length - len(node.chunk) > base:  # the node starting at `base`
            assert node.parent is not None
            node = node.parent
        if n == base:
            return node.parent if node.length > base and node.parent is not None else node
        return _node(node.parent, node.chunk[: n - base])


def _root() -> Prefix:
    root = Prefix.__new__(Prefix)
    root.parent, root.chunk, root.length, root._hash = None, (), 0, hash(())
    return root


EMPTY = _root()  # the prefix of no tokens (never collected)
# (parent, chunk) -> the node, held weakly: the entry goes when the node does.
# (A WeakValueDictionary's get is Python code; naming a 1M-token prompt asks 32k times.)
_NODES: dict[tuple[Prefix, Tokens], weakref.KeyedRef] = {}


def _collected(ref: weakref.KeyedRef) -> None:
    if _NODES.get(ref.key) is ref:  # not a newer node interned under the same key
        del _NODES[ref.key]


# id(tuple) -> (the tuple, its chain of full nodes, every prefix of it named so far by length)
_CHAINS: OrderedDict[int, tuple[Tokens, list[Prefix], dict[int, Prefix]]] = OrderedDict()
_memo_size = 0  # the remembered tuples' `_cost`, in all
# id(a remembered tuple) -> the last tuple `joined` made from it (while it is remembered)
_JOINED: dict[int, Tokens] = {}


def _node(parent: Prefix | None, chunk: Tokens) -> Prefix:
    base = EMPTY if parent is None else parent
    if not chunk:
        return base
    key = (base, chunk)
    ref = _NODES.get(key)
    node = None if ref is None else ref()
    if node is None:
        node = Prefix.__new__(Prefix)
        node.parent, node.chunk, node.length = base, chunk, base.length + len(chunk)
        node._hash = hash((base._hash, chunk))
        _NODES[key] = weakref.KeyedRef(node, _collected, key)
    return node


def extend(p: Prefix | None, tokens: Sequence[int]) -> Prefix:
    """The prefix `p + tokens`, in O(len(tokens) + CHAIN)."""
    base = EMPTY if p is None else p
    if not tokens:
        return base
    toks = tuple(tokens)
    if base.length % CHAIN:  # a tail: rebuild it with the new tokens
        toks = base.chunk + toks
        base = base.parent if base.parent is not None else EMPTY
    i = 0
    while len(toks) - i >= CHAIN:
        base = _node(base, toks[i : i + CHAIN])
        i += CHAIN
    return _node(base, toks[i:])


def prefix(tokens: Sequence[int], n: int | None = None) -> Prefix:
    """The prefix `tokens[:n]` (all of `tokens` when n is None).

    O(new tokens) amortised over calls on the same tuple: the chain built along
    a tuple is remembered (for the last few tuples), so naming every block of a
    prompt in turn costs O(prompt length) in all.
    """
    entry = _CHAINS.get(id(tokens))
    if entry is not None and n is not None:
        known = entry[2].get(n)
        if known is not None:
            return known
    global _memo_size
    size = len(tokens)
    n = size if n is None else max(0, min(n, size))
    if not isinstance(tokens, tuple):  # mutable: never remembered
        return extend(EMPTY, tokens[:n])
    if entry is None:  # (a remembered tuple is held, so its id is never reused)
        entry = _remember(tokens, [EMPTY])
    else:
        _CHAINS.move_to_end(id(tokens))
    full = n // CHAIN
    chain, named = entry[1], entry[2]
    while len(chain) <= full:
        k = len(chain) - 1
        chain.append(_node(chain[-1], tokens[k * CHAIN : (k + 1) * CHAIN]))
    node = chain[full]
    if n > full * CHAIN:
        node = _node(node, tokens[full * CHAIN : n])
    if n not in named:
        named[n] = node
        _memo_size += 1
        _evict()
    return node


def joined(tokens: Tokens, more: Sequence[int]) -> Tokens:
    """`tokens + more`; its prefixes within `tokens` are named without rebuilding
    the chain (a request's tokens grow by one sampled token at a time: naming
    its blocks after each sample stays O(new tokens), not O(prompt))."""
    more = tuple(more)
    entry = _CHAINS.get(id(tokens))
    if entry is not None:
        last = _JOINED.get(id(tokens))  # the model and the judge grow the same request alike:
        if last is not None and len(last) == len(tokens) + len(more) and last[len(tokens) :] == more:
            return last  # one tuple (and one chain) serves both
    out = tokens + more
    if entry is not None and out is not tokens:
        # The same content up to len(tokens): the full nodes named along `tokens` serve `out`.
        _remember(out, entry[1][: len(tokens) // CHAIN + 1])
        _JOINED[id(tokens)] = out
        _evict()
    return out


def _remember(tokens: Tokens, chain: list[Prefix]) -> tuple[Tokens, list[Prefix], dict[int, Prefix]]:
    global _memo_size
    entry: tuple[Tokens, list[Prefix], dict[int, Prefix]] = (tokens, chain, {})
    _CHAINS[id(tokens)] = entry
    _memo_size += _cost(entry)
    return entry


def _cost(entry: tuple[Tokens, list[Prefix], dict[int, Prefix]]) -> int:
    """What a remembered tuple holds, in chain nodes: the tuple itself (it is kept
    alive, a CHAIN-th of a node a token) and the prefixes named along it."""
    return len(entry[0]) // CHAIN + 1 + len(entry[2])


def _evict() -> None:
    global _memo_size
    while len(_CHAINS) > _MEMO_TUPLES or (_memo_size > _MEMO_NODES and len(_CHAINS) > 1):
        old, dropped = _CHAINS.popitem(last=False)
        _JOINED.pop(old, None)
        _memo_size -= _cost(dropped)


def live_nodes() -> int:
    """How many prefix nodes are alive (memory checks)."""
    return len(_NODES)


def clear_memo() -> None:
    """Forget the remembered chains (their nodes become collectable if nothing else holds them)."""
    global _memo_size
    _CHAINS.clear()
    _JOINED.clear()
    _memo_size = 0


def grown(prompt: Tokens, outputs: Sequence[int], known: Tokens) -> Tokens:
    """`prompt` then `outputs`, as `joined` names it, reusing `known`: the same request's
    tokens joined before (or ()), a prefix of these while its outputs only grew (a caller
    taking outputs back forgets it)."""
    if not outputs:
        return prompt
    if len(known) == len(prompt) + len(outputs):
        return known
    base = known or prompt
    return joined(base, outputs[len(base) - len(prompt) :])
