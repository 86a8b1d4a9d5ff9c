"""Token prefixes named by interned trie nodes: equal content <=> the same object.

A hash in vLLM stands for a token prefix; the project names it by that prefix
(see `model.contract.observation`). Holding each prefix as a tuple costs O(n) per name
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

from model.contract.extra_keys import Identity, Keyed, Marks, chunk_marks, clip_marks, stable_hash

Tokens = tuple[int, ...]

CHAIN = 32  # tokens per full node: a node per 32 tokens, a tail rebuilt in O(32)
_MEMO_TUPLES = 128  # token tuples whose chains `prefix` remembers (LRU) ...
# ... costing at most this many nodes in all (`_cost`: 16M tokens of tuples, enough
# for the live requests of a production run, whose chains a lookup walks again and again)
_MEMO_NODES = 1 << 19


class Prefix:
    """The interned name of a token prefix (see the module docstring)."""

    __slots__ = ("parent", "chunk", "length", "_hash", "marks", "ns", "ahead", "__weakref__")

    parent: Prefix | None
    chunk: Tokens
    length: int
    _hash: int
    # The multimodal items over `chunk` (`model.contract.extra_keys.chunk_marks`); None: none.
    marks: Marks | None
    # A root's namespace (salt, LoRA name, path: `Identity.namespace`); None elsewhere.
    ns: tuple[str | None, ...] | None
    # A block hash's lookahead (`looked`): (the tokens past the prefix, their marks, the
    # plain prefix); None on every chain node.
    ahead: tuple[Tokens, Marks | None, Prefix] | None

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
        if self.ahead is not None:
            return (_relooked, (self.ahead[2], self.ahead[0], self.ahead[1]))
        nodes = self._path()
        if nodes[0].ns is None and all(n.marks is None for n in nodes):
            return (prefix, (self.tokens(),))
        return (_rebuilt, (nodes[0].ns, tuple((n.chunk, n.marks) for n in nodes[1:])))

    def _path(self) -> list[Prefix]:
        """The nodes from the root (EMPTY or a namespace's) to this one."""
        path: list[Prefix] = []
        node: Prefix | None = self
        while node is not None:
            path.append(node)
            node = node.parent
        if path[-1].length or path[-1].chunk:  # (never: every chain starts at a root)
            path.append(EMPTY)
        return path[::-1]

    def namespace(self) -> tuple[str | None, ...] | None:
        """The namespace of the chain this prefix lies on (None: no salt or LoRA)."""
        return self._path()[0].ns

    def items(self) -> tuple[tuple[str, int, int], ...]:
        """The multimodal marks along the prefix, as (identifier, first, end) in
        absolute positions (an item over several nodes is listed once per node)."""
        out: list[tuple[str, int, int]] = []
        base = 0
        for node in self._path():
            for ident, a, b in node.marks or ():
                out.append((ident, base + a, base + b))
            base += len(node.chunk)
        return tuple(out)

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

    @property
    def plain(self) -> Prefix:
        """This prefix without a lookahead (itself on a chain node)."""
        return self if self.ahead is None else self.ahead[2]

    def head(self, n: int) -> Prefix:
        """The prefix of the first n tokens (0 <= n <= length; n == length keeps a lookahead)."""
        if n >= self.length:
            return self
        base = n - n % CHAIN
        node = self
        while node.length - len(node.chunk) > base:  # the node starting at `base`
            assert node.parent is not None
            node = node.parent
        if n == base:
            return node.parent if node.length > base and node.parent is not None else node
        return _node(node.parent, node.chunk[: n - base], clip_marks(node.marks, n - base))


def _root(ns: tuple[str | None, ...] | None = None) -> Prefix:
    root = Prefix.__new__(Prefix)
    root.parent, root.chunk, root.length = None, (), 0
    root._hash = hash(()) if ns is None else hash(("ns", stable_hash(ns)))
    root.marks, root.ns, root.ahead = None, ns, None
    return root


EMPTY = _root()  # the prefix of no tokens (never collected)
# A namespace's root (`model.contract.extra_keys`): its empty prefix, kept for the process.
_ROOTS: dict[tuple[str | None, ...], Prefix] = {}


def root_of(identity: Identity) -> Prefix:
    """The empty prefix of `identity`'s namespace (EMPTY without salt or LoRA)."""
    ns = identity.namespace()
    if ns is None:
        return EMPTY
    root = _ROOTS.get(ns)
    if root is None:
        root = _ROOTS[ns] = _root(ns)
    return root


def _rebuilt(ns: tuple[str | None, ...] | None, nodes: tuple[tuple[Tokens, Marks | None], ...]) -> Prefix:
    """A prefix from its namespace and its nodes' (chunk, marks) (`Prefix.__reduce__`)."""
    node = EMPTY if ns is None else _ROOTS.setdefault(ns, _root(ns))
    for chunk, marks in nodes:
        node = _node(node, chunk, marks)
    return node


# (parent, chunk[, marks]) -> the node, held weakly: the entry goes when the node does.
# (A WeakValueDictionary's get is Python code; naming a 1M-token prompt asks 32k times.)
_NODES: dict[tuple[Any, ...], weakref.KeyedRef] = {}


def _collected(ref: weakref.KeyedRef) -> None:
    if _NODES.get(ref.key) is ref:  # not a newer node interned under the same key
        del _NODES[ref.key]


# id(tuple) -> (the tuple, its chain of full nodes, every prefix of it named so far by length)
_CHAINS: OrderedDict[int, tuple[Tokens, list[Prefix], dict[int, Prefix]]] = OrderedDict()
_memo_size = 0  # the remembered tuples' `_cost`, in all
# id(a remembered tuple) -> the last tuple `joined` made from it (while it is remembered)
_JOINED: dict[int, Tokens] = {}


def _node(parent: Prefix | None, chunk: Tokens, marks: Marks | None = None) -> Prefix:
    base = EMPTY if parent is None else parent
    if not chunk:
        return base
    key: tuple[Any, ...] = (base, chunk) if marks is None else (base, chunk, marks)
    ref = _NODES.get(key)
    node = None if ref is None else ref()
    if node is None:
        node = Prefix.__new__(Prefix)
        node.parent, node.chunk, node.length = base, chunk, base.length + len(chunk)
        node.marks, node.ns, node.ahead = marks, None, None
        node._hash = (
            hash((base._hash, chunk)) if marks is None else hash((base._hash, chunk, stable_hash(marks)))
        )
        _NODES[key] = weakref.KeyedRef(node, _collected, key)
    return node


def looked(p: Prefix, ahead: Tokens, marks: Marks | None = None) -> Prefix:
    """The name of a block hash over the prefix `p` that also covers the `ahead` tokens past it
    (and the items over them, `marks` relative to `len(p)`): vLLM's lookahead block hashes
    (`get_request_block_hasher` with `num_hash_lookahead_tokens`). A leaf beside `p`: its
    length and tokens are p's; it equals another name iff both the prefix and the lookahead
    agree, as vLLM's chained hash does; no chain goes on from it (`extend` from its `plain`)."""
    plain = p.plain
    if not ahead:
        return plain
    key: tuple[Any, ...] = (plain, "ahead", tuple(ahead), marks)
    ref = _NODES.get(key)
    node = None if ref is None else ref()
    if node is None:
        node = Prefix.__new__(Prefix)
        node.parent, node.chunk, node.length = plain.parent, plain.chunk, plain.length
        node.marks, node.ns = plain.marks, plain.ns
        node.ahead = (tuple(ahead), marks, plain)
        node._hash = hash((plain._hash, "ahead", tuple(ahead), stable_hash(marks)))
        _NODES[key] = weakref.KeyedRef(node, _collected, key)
    return node


def _relooked(plain: Prefix, ahead: Tokens, marks: Marks | None) -> Prefix:
    return looked(plain, ahead, marks)


def block_name(tokens: Sequence[int], n: int, lookahead: int = 0) -> Prefix:
    """The name of the hash of the block ending at token `n` of `tokens`: the prefix
    `tokens[:n]`, with `lookahead` L > 0 also the L tokens after it (`looked`; they must exist)."""
    p = prefix(tokens, n)
    if not lookahead:
        return p
    assert len(tokens) >= n + lookahead, "a lookahead block hash needs its lookahead tokens"
    identity = tokens.identity if isinstance(tokens, Keyed) else None
    marks = None if identity is None else chunk_marks(identity, n, n + lookahead)
    return looked(p, tuple(tokens[n : n + lookahead]), marks)


def lookahead_of(p: Prefix) -> int:
    """How many tokens past its prefix a name covers (0 but for a `looked` name)."""
    return 0 if p.ahead is None else len(p.ahead[0])


def names_head(q: Prefix, p: Prefix) -> bool:
    """`q` names the first len(q) tokens of `p` (a shorter hash of the same block's content):
    their tokens agree and q's lookahead, if any, is the tokens after them in p (p's own
    lookahead included)."""
    n = len(q)
    if n > len(p) or p.plain.head(n) is not q.plain:
        return False
    if q.ahead is None:
        return p.ahead is None or n < len(p)
    want = q.ahead[0]
    after = (p.plain.tokens() + (p.ahead[0] if p.ahead is not None else ()))[n : n + len(want)]
    return after == want


def extend(p: Prefix | None, tokens: Sequence[int]) -> Prefix:
    """The prefix `p + tokens`, in O(len(tokens) + CHAIN)."""
    base = EMPTY if p is None else p.plain
    if not tokens:
        return base
    toks = tuple(tokens)
    marks = None  # a tail's marks stay with its tokens (the new tokens carry none)
    if base.length % CHAIN:  # a tail: rebuild it with the new tokens
        toks, marks = base.chunk + toks, base.marks
        base = base.parent if base.parent is not None else EMPTY
    i = 0
    while len(toks) - i >= CHAIN:
        base = _node(base, toks[i : i + CHAIN], marks if i == 0 else None)
        i += CHAIN
    return _node(base, toks[i:], marks if i == 0 else None)


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
    identity = tokens.identity if isinstance(tokens, Keyed) else None
    if entry is None:  # (a remembered tuple is held, so its id is never reused)
        entry = _remember(tokens, [EMPTY if identity is None else root_of(identity)])
    else:
        _CHAINS.move_to_end(id(tokens))
    full = n // CHAIN
    chain, named = entry[1], entry[2]
    while len(chain) <= full:
        k = len(chain) - 1
        lo, hi = k * CHAIN, (k + 1) * CHAIN
        if identity is None:
            chain.append(_node(chain[-1], tokens[lo:hi]))
        else:
            chain.append(_node(chain[-1], tokens[lo:hi], chunk_marks(identity, lo, hi)))
    node = chain[full]
    if n > full * CHAIN:
        lo = full * CHAIN
        if identity is None:
            node = _node(node, tokens[lo:n])
        else:
            node = _node(node, tokens[lo:n], chunk_marks(identity, lo, n))
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
    if isinstance(tokens, Keyed):
        out = Keyed(out, tokens.identity)
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
