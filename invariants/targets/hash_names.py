"""Hash bytes -> the token prefix they stand for, learnt when hashes are made.

An allocator names a hash by bytes; kvretain names it by content (a
`model.contract.prefix.Prefix`), so that targets hashing differently compare exactly.
`HashNames` is the adapters' table between the two:

- `learn` records, for every new hash of a request, the token tuple it came
  from and the prefix length (O(1) per hash: nothing is copied or named yet);
  `adopt` records a hash already named (a sampled token's new block: the
  previous block's prefix extended, so no copy of the whole request is kept);
- `name(h)` interns the prefix on first use (O(new tokens) amortised along one
  tuple, see `model.contract.prefix.prefix`), and remembers the way back (`hash_of`);
- `prune(keep)` forgets every hash outside `keep` (the hashes the allocator
  still holds in its map and those of live requests): run after the removal
  events were read, so the table tracks the allocator's state instead of
  growing with every request ever seen.

No hash is ever inverted or assumed collision-free: a prefix not in the table
goes back to its hash through `rehash` (the allocator's own hasher), exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from model.contract.prefix import Prefix, Tokens, block_name

_LOW_64 = 8  # KV events carry a hash as the low 64 bits of its bytes


class HashNames:
    def __init__(self, rehash: Callable[[Prefix], bytes | None] | None = None, slack: int = 4096) -> None:
        self._source: dict[bytes, tuple[Tokens, int, int] | Prefix] = {}
        self._by_int: dict[int, bytes] = {}
        self._named: dict[bytes, Prefix] = {}
        self._hash_of: dict[Prefix, bytes] = {}
        self._rehash = rehash
        self._kept = 0
        self._slack = slack  # entries allowed beyond twice the last kept count (< 0: prune at every read)

    def __len__(self) -> int:
        return len(self._source)

    def __contains__(self, h: bytes) -> bool:
        return h in self._source

    def learn(
        self,
        tokens: Tokens,
        hashes: Sequence[bytes],
        start: int,
        hash_block_size: int,
        stop: int | None = None,
        lookahead: int = 0,
    ) -> None:
        """Hash i of `hashes` (from `start` to `stop`) stands for `tokens[:(i+1)*hash_block_size]`
        (with `lookahead` L, and the L tokens after it: `model.contract.prefix.block_name`)."""
        for i in range(start, len(hashes) if stop is None else min(stop, len(hashes))):
            h = bytes(hashes[i])
            if h not in self._source:
                self._source[h] = (tokens, (i + 1) * hash_block_size, lookahead)
                self._by_int[int.from_bytes(h[-_LOW_64:], "big")] = h

    def adopt(self, h: bytes, named: Prefix) -> None:
        """Hash `h` stands for `named` (unless a request made it first)."""
        if h not in self._source:
            self._source[h] = self._named[h] = named
            self._hash_of[named] = h
            self._by_int[int.from_bytes(h[-_LOW_64:], "big")] = h

    def any_hash(self) -> bytes | None:
        return next(iter(self._source), None)

    def name(self, h: bytes) -> Prefix | None:
        """The prefix `h` stands for; None when no request made `h`."""
        named = self._named.get(h)
        if named is None:
            src = self._source.get(h)
            if src is None:
                return None
            named = self._named[h] = src if isinstance(src, Prefix) else block_name(*src)
            self._hash_of[named] = h
        return named

    def name_int(self, value: int) -> Prefix | None:
        h = self._by_int.get(value)
        return None if h is None else self.name(h)

    def hash_of(self, p: Prefix) -> bytes | None:
        h = self._hash_of.get(p)
        if h is None and self._rehash is not None:
            h = self._rehash(p)
        return h

    def should_prune(self) -> bool:
        """Amortised: prune when the table doubled since the last prune."""
        return len(self._source) > 2 * self._kept + self._slack

    def prune(self, keep: Iterable[bytes]) -> int:
        """Forget every hash outside `keep`, at the cost of what is forgotten (the
        live requests' hashes, most of the table while long prompts run, stay put);
        return how many were forgotten."""
        gone = self._source.keys() - (keep if isinstance(keep, (set, frozenset)) else set(keep))
        for h in gone:
            del self._source[h]
            named = self._named.pop(h, None)
            if named is not None and self._hash_of.get(named) == h:
                del self._hash_of[named]
            low = int.from_bytes(h[-_LOW_64:], "big")
            if self._by_int.get(low) == h:
                del self._by_int[low]
        self._kept = len(self._source)
        return len(gone)
