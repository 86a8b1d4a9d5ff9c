"""What each of vLLM's hashes stands for, and vLLM's keys as the model's.

vLLM names a block hash by its bytes; the adapter names it by content: hash i
of a request stands for `all_token_ids[:(i+1)*hash_block_size]`. `HashLearner`
fills a `HashNames` table from every request's `block_hashes` as far as vLLM
may cache its blocks (its computed tokens and lookahead slots), re-hashes a
prefix the table no longer holds with a throw-away request, and prunes the
table to the hashes vLLM still holds or a live request has, once vLLM's removal
events were read. KV events carry a hash as the low 64 bits of its bytes by
default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`,
`kv_cache_utils.maybe_convert_block_hash`); the table maps those ints too, so
no environment variable is changed.

`KeyTranslator` turns vLLM's `BlockHashWithGroupId` (hash bytes and a 4-byte
big-endian group id) into the model's `BlockKey(group, prefix)` and back. A
release that keys a block wider than the hash block by the fine hashes it
spans, joined ("concat", 0.21.0-0.23.0), is named by the last of them (which
chains over the whole prefix) and looked up by the joined hashes.

With `track_prefixes=False` nothing is learnt, and a hash is named by a
stand-in instead of its prefix, as the reference adapter does:
`BlockKey(group, tuple(hash_bytes))`, and an event's int hash as the 1-tuple
`(h,)`. Such names are internally consistent (distinct hashes stay distinct)
but do not compare with another target's: use them for counting, never for
differential checks.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from model.contract.extra_keys import NO_IDENTITY, Identity, identity_of, keyed
from model.contract.observation import BlockKey, Tokens
from model.contract.prefix import Prefix, extend, looked, prefix

from .base import TargetCrash
from .hash_names import HashNames
from .vllm_identity import identity_of_prefix, request_identity
from .vllm_session import VllmSession


class HashLearner:
    """The table of hash -> token prefix, learnt from the live requests."""

    def __init__(self, session: VllmSession, track_prefixes: bool = True) -> None:
        self.s = session
        # False: learn nothing, name hashes by stand-ins (see the module docstring).
        self.track_prefixes = track_prefixes
        # hash bytes (and the low 64 bits events use) <-> the token prefix it stands for
        self.table = HashNames(self.rehash)
        # rid -> (its prompt tuple, how many of its hashes are learnt): see `learn_computed`.
        self.pending: dict[str, tuple[Tokens | None, int]] = {}
        # rid -> its identity (`model.contract.extra_keys`): its hashes are named in its namespace.
        self.identity: dict[str, Identity] = {}

    def register(self, rid: str, tokens: Any) -> None:
        """A new request: nothing of it learnt yet (its prompt kept where it is a tuple)."""
        self.pending[rid] = (tokens if isinstance(tokens, tuple) else None, 0)
        if identity_of(tokens):
            self.identity[rid] = identity_of(tokens)

    def forget(self, rid: str) -> None:
        self.pending.pop(rid, None)
        self.identity.pop(rid, None)

    def tokens_of(self, req: Any) -> Tokens:
        """The request's tokens, carrying its identity (a plain tuple without one)."""
        return keyed(req.all_token_ids, self.identity.get(req.request_id))

    def learn_computed(self, req: Any) -> None:
        """Learn a request's hashes as far as vLLM may cache its blocks (its computed
        tokens and lookahead slots), not all at admission: the blocks of a 1M-token
        prompt no one computed yet cost no table entry. A hash met before it was
        learnt sends every live request's in (`learn_pending`)."""
        ahead = req.num_computed_tokens + self.s.config.num_lookahead_tokens
        self.learn_upto(req, -(-ahead // self.s.hbs) + 1)

    def learn_pending(self) -> None:
        for req in self.s.requests.values():
            self.learn_upto(req, len(req.block_hashes))

    def learn_upto(self, req: Any, upto: int) -> None:
        """The request's first `upto` hashes are in the table."""
        entry = self.pending.get(req.request_id)
        if entry is None or not self.track_prefixes:
            return
        tokens, done = entry
        upto = min(upto, len(req.block_hashes))
        if upto <= done:
            return
        hbs = self.s.hbs
        if tokens is None or upto * hbs + self.s.hash_lookahead > len(tokens):
            tokens = self.tokens_of(req)
        self.table.learn(tokens, req.block_hashes, done, hbs, stop=upto, lookahead=self.s.hash_lookahead)
        self.pending[req.request_id] = (tokens, upto)

    def before_sample(self, req: Any) -> int:
        """A sampled request computed every token before it: all its hashes are
        learnt. Returns where the sample's new hashes will start."""
        start = len(req.block_hashes)
        self.learn_upto(req, start)
        return start

    def after_sample(self, req: Any, start: int) -> None:
        """The sampled blocks, named on from the last (O(new tokens))."""
        self.learn_hashes(req, start)
        rid = req.request_id
        if rid in self.pending:
            self.pending[rid] = (self.pending[rid][0], len(req.block_hashes))

    def learn_hashes(self, req: Any, start: int, tokens: Tokens | None = None) -> None:
        if not self.track_prefixes or start >= len(req.block_hashes):
            return
        hbs = self.s.hbs
        # An item may run on past the named prefix: its marks are named from the whole tuple.
        items = self.identity.get(req.request_id, NO_IDENTITY).mm
        before = (
            None
            if tokens is not None or not start or items
            else self.table.name(bytes(req.block_hashes[start - 1]))
        )
        lookahead = self.s.hash_lookahead
        if before is not None:
            # A sampled token's new blocks: the request's last named prefix, extended by
            # their tokens (O(new tokens); no copy of a 1M-token request kept per hash),
            # under lookahead hashes named with the tokens past each (`model.contract.prefix.looked`).
            before = before.plain
            for i in range(start, len(req.block_hashes)):
                before = extend(before, req.all_token_ids[i * hbs : (i + 1) * hbs])
                end = (i + 1) * hbs
                name = (
                    looked(before, tuple(req.all_token_ids[end : end + lookahead])) if lookahead else before
                )
                self.table.adopt(bytes(req.block_hashes[i]), name)
            return
        # The operation's own tuple where it is the request's tokens: prefixes named along it are shared.
        toks = tokens if tokens is not None else self.tokens_of(req)
        self.table.learn(toks, req.block_hashes, start, hbs, lookahead=lookahead)

    def rehash(self, p: Prefix) -> bytes | None:
        """vLLM's hash of a prefix the table does not hold (a throw-away request hashes it)."""
        hbs = self.s.hbs
        if not self.s.config.enable_caching or len(p) == 0 or len(p) % hbs:
            return None
        v = self.s.v
        kwargs: dict[str, Any] = {"mm_features": None, **request_identity(identity_of_prefix(p))}
        # A lookahead hash's name carries the tokens past its block (`model.contract.prefix.looked`).
        ahead = list(p.ahead[0]) if p.ahead is not None else []
        if len(ahead) != self.s.hash_lookahead:
            return None  # a name of another hashing: vLLM holds no such hash
        req = v["Request"](
            request_id="__rehash",
            prompt_token_ids=list(p.tokens()) + ahead,
            sampling_params=v["SamplingParams"](max_tokens=1),
            pooling_params=None,
            block_hasher=self.s.block_hasher(),
            **kwargs,
        )
        return bytes(req.block_hashes[-1])

    def live_hashes(self) -> set[bytes]:
        """The hashes the live requests hold, as far as they are learnt."""
        keep: set[bytes] = set()
        for rid, r in self.s.requests.items():
            learnt = self.pending[rid][1] if rid in self.pending else len(r.block_hashes)
            keep.update(map(bytes, r.block_hashes[:learnt]))  # C loops: 1M-token requests hold 250k
        return keep


class KeyTranslator:
    """vLLM's hash-map keys and event hashes as the model's names, and back."""

    def __init__(self, session: VllmSession, names: HashLearner) -> None:
        self.s = session
        self.names = names
        self._keys: dict[bytes, BlockKey] = {}
        # `map_key`'s answers other than None, until the next prune or a change of the
        # session's capabilities: a prefix's hash is a function of its tokens and identity
        # (vLLM's hasher), so a found one never changes.
        self._raw: dict[BlockKey, bytes] = {}
        self._raw_caps: object = None

    def key(self, key: bytes) -> BlockKey:
        """BlockHashWithGroupId (hash bytes + 4-byte big-endian group) -> BlockKey, memoised."""
        out = self._keys.get(key)
        if out is None:
            out = self._keys[key] = BlockKey(int.from_bytes(key[-4:], "big"), self.prefix(key[:-4]))
        return out

    def map_key(self, k: BlockKey) -> bytes | None:
        """The key vLLM files `k` under in its hash map (the inverse of `key`); None
        when the prefix has no hash. A "concat" release keys a block wider than the
        hash block by the fine hashes it spans, joined in order; those hashes are
        the release's own (the learnt table, else a throw-away request's)."""
        if self._raw_caps is not self.s.caps:
            self._raw, self._raw_caps = {}, self.s.caps
        raw = self._raw.get(k)
        if raw is None:
            raw = self._map_key(k)
            if raw is not None:
                self._raw[k] = raw
        return raw

    def _map_key(self, k: BlockKey) -> bytes | None:
        group = k.group.to_bytes(4, "big")
        if not self.names.track_prefixes:
            return bytes(k.tokens.tokens()) + group  # the stand-in is the key's bytes
        table, n, hbs = self.names.table, len(k.tokens), self.s.hbs
        width = self.s.config.groups[k.group].block_size if self.s.caps.coarse_hash == "concat" else hbs
        if width == hbs or n < width or n % width:
            h = table.hash_of(k.tokens)
            return None if h is None else h + group
        parts = [table.hash_of(k.tokens.head(end)) for end in range(n - width + hbs, n + 1, hbs)]
        if any(h is None for h in parts):
            return None
        return b"".join(h for h in parts if h is not None) + group

    def prefix(self, h: bytes) -> Prefix:
        """The token prefix hash bytes `h` stand for (learning every live request's hashes if need be)."""
        if not self.names.track_prefixes:
            return prefix(tuple(bytes(h)))  # stand-in (see the module docstring)
        h = bytes(h)
        named = self._name(h)
        if named is None:
            self.names.learn_pending()
            named = self._name(h)
        if named is None:
            raise TargetCrash(f"hash {bytes(h).hex()[:16]}... comes from no known request")
        return named

    def _name(self, h: bytes) -> Prefix | None:
        table = self.names.table
        if self.s.caps.coarse_hash == "concat" and h not in table:
            # Releases that key a wide block by its fine hashes joined: the last
            # one already chains over the whole prefix.
            h = h[-len(table.any_hash() or h) :]
        return table.name(h)

    def event_prefix(self, h: bytes | int) -> Prefix:
        """An event's hash (bytes, or the int of its low 64 bits) as its prefix."""
        if isinstance(h, int):
            if not self.names.track_prefixes:
                return prefix((h,))  # stand-in (see the module docstring)
            table = self.names.table
            named = table.name_int(h)
            if named is None:
                self.names.learn_pending()
                named = table.name_int(h)
            if named is None:
                raise TargetCrash(f"event hash {h:#x} comes from no known request")
            return named
        return self.prefix(h)

    def prune(self) -> None:
        """Forget the prefixes of hashes vLLM removed (after their events were read)."""
        table = self.names.table
        if not self.names.track_prefixes or not table.should_prune():
            return
        keep = self.names.live_hashes()
        width = len(table.any_hash() or b"")
        cache = self.s.pool.cached_block_hash_to_block._cache
        keep.update(map(bytes, map(itemgetter(slice(None, -4)), cache)))  # the group id is 4 bytes
        if self.s.caps.coarse_hash == "concat":  # and the last fine hash of a joined key
            keep.update(map(bytes, map(itemgetter(slice(-4 - width, -4)), cache)))
        if not table.prune(keep):
            return
        self._raw = {}
        self._keys = {
            k: v for k, v in self._keys.items() if bytes(k[:-4]) in keep or bytes(k[:-4][-width:]) in keep
        }
