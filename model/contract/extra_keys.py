"""A request's identity and which of it enters each block's hash key and KV event.

vLLM keeps requests apart in the prefix cache only through a block hash's *extra keys*
(`kv_cache_utils.generate_block_hash_extra_keys`). An `Identity` is what those read
besides the tokens: `salt` (the tenant's cache salt), `lora` (name, id, path), `mm`
(multimodal items `MMItem(identifier, offset, length)`) and the Eagle lookahead tokens.

A key of block [start, end) is kept iff (vLLM 0.33.0, `block_hash_keys`):
  lora:  identity.lora is set (every block; the int id is not hashed)
  mm:    an item overlaps [start, end) (offset < end and offset + length > start)
  salt:  start == 0 and identity.salt is non-empty
in the order lora, mm items, salt; no key: None. With L lookahead tokens a block's keys
cover [start, end + L) followed by tokens[end:end + L]. Events publish the untagged
shapes (`to_event_extra_keys`): the LoRA name, the (identifier, offset) pair, the salt.

Two prefixes are the same name (`model.contract.prefix`, `Keyed`) iff their tokens,
identity namespace and item marks agree, which is iff vLLM's hashes agree given that an
identifier fixes its item's length. The details, and prompt embeds (not expressed):
docs/semantics.md, "Request identity". Release table: `RELEASES`.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, order=True)
class MMItem:
    """A multimodal item over placeholder positions [offset, offset + length)."""

    identifier: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


Lora = tuple[str, int, str]  # (name, int id, path): vLLM's LoRARequest(lora_name, lora_int_id, lora_path)


@dataclass(frozen=True)
class Identity:
    """What besides its tokens vLLM hashes of a request (see the module docstring)."""

    salt: str | None = None
    lora: Lora | None = None
    mm: tuple[MMItem, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.salt) or self.lora is not None or bool(self.mm)

    def namespace(self) -> tuple[str | None, str | None, str | None] | None:
        """The part constant over the request's chain: (salt, LoRA name, LoRA path)."""
        if not self.salt and self.lora is None:
            return None
        return (self.salt or None, *((self.lora[0], self.lora[2]) if self.lora else (None, None)))

    def kinds(self) -> tuple[str, ...]:
        """Which identity fields are set, by name ("salt", "lora", "mm")."""
        return tuple(
            k
            for k, on in (("salt", bool(self.salt)), ("lora", self.lora is not None), ("mm", bool(self.mm)))
            if on
        )


NO_IDENTITY = Identity()


def validate(identity: Identity, prompt_len: int) -> str | None:
    """Why `identity` cannot be a request's of `prompt_len` tokens (None: it can)."""
    if identity.salt is not None and (not isinstance(identity.salt, str) or not identity.salt):
        return "salt must be a non-empty string"
    if identity.lora is not None:
        name, lid, path = identity.lora
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            return "lora needs a name and a path"
        if isinstance(lid, bool) or not isinstance(lid, int) or lid < 1:
            return "lora id must be a positive integer (vLLM's lora_int_id)"
    end = 0
    for item in identity.mm:
        if not isinstance(item.identifier, str) or not item.identifier:
            return "a multimodal item needs an identifier"
        if item.length < 1 or item.offset < end:
            return "multimodal items must be sorted, disjoint and non-empty"
        end = item.end
    if end > prompt_len:
        return f"a multimodal item ends at {end}, past the prompt's {prompt_len} tokens"
    return None


class Keyed(tuple):  # type: ignore[type-arg]
    """A token tuple with its request's identity: the prefixes it names carry it.

    Slicing gives a plain tuple (the tokens); `keyed(tokens + more, ...)` keeps the
    identity along a request's growth (`model.contract.prefix.joined`)."""

    identity: Identity

    def __new__(cls, tokens: Sequence[int] = (), identity: Identity = NO_IDENTITY) -> Keyed:
        out = super().__new__(cls, tokens)
        out.identity = identity
        return out

    def __getnewargs__(self) -> tuple[Any, ...]:
        return (tuple(self), self.identity)

    # Equal to a token tuple only with the same identity (a plain tuple has none): two
    # requests of one prompt and two tenants are two states (explore's fingerprints).
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, tuple):
            return NotImplemented
        return identity_of(other) == self.identity and tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = tuple.__hash__


def keyed(tokens: Sequence[int], identity: Identity | None) -> tuple[int, ...]:
    """`tokens` carrying `identity` (a plain tuple without one)."""
    if not identity:
        return tuple(tokens)
    return Keyed(tokens, identity)


def identity_of(tokens: object) -> Identity:
    """The identity a token tuple carries (none for a plain tuple)."""
    return tokens.identity if isinstance(tokens, Keyed) else NO_IDENTITY


# -- the keys, as vLLM 0.33.0 computes them -------------------------------------


def overlapping(identity: Identity, start: int, end: int) -> tuple[MMItem, ...]:
    """The items that overlap tokens [start, end), in order."""
    return tuple(m for m in identity.mm if m.offset < end and m.end > start)


def block_hash_keys(identity: Identity, start: int, end: int) -> tuple[Any, ...] | None:
    """vLLM's `generate_block_hash_extra_keys` for block [start, end) (kept iff: see above)."""
    keys: list[Any] = []
    if identity.lora is not None:
        keys.append(("lora", identity.lora[0], identity.lora[2]))
    keys += [("mm", m.identifier, m.offset - start) for m in overlapping(identity, start, end)]
    if start == 0 and identity.salt:
        keys.append(("cache_salt", identity.salt))
    return tuple(keys) or None


def lookahead_hash_keys(
    identity: Identity, tokens: Sequence[int], start: int, end: int, lookahead: int
) -> tuple[Any, ...] | None:
    """A block's extra keys under `lookahead` L > 0 (`get_request_block_hasher`): the
    keys over [start, end + L) and the L tokens after the block; defined once
    `len(tokens) >= end + L` (vLLM emits the hash only then)."""
    assert lookahead > 0 and len(tokens) >= end + lookahead
    ahead = tuple(tokens[end : end + lookahead])
    return (block_hash_keys(identity, start, end + lookahead), *ahead)


def event_keys(identity: Identity, start: int, end: int, lookahead: int = 0) -> tuple[Any, ...] | None:
    """One entry of a BlockStored's `extra_keys` (`to_event_extra_keys`): the block's
    keys untagged (LoRA name, (identifier, offset), salt); the window is the hash's
    (`BlockPool._generate_event_extra_keys`: [start, end + L) under lookahead)."""
    keys = block_hash_keys(identity, start, end + lookahead)
    if keys is None:
        return None
    return tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)


def event_lora(identity: Identity) -> tuple[int | None, str | None]:
    """A BlockStored's (lora_id, lora_name) for a request of `identity`."""
    return (identity.lora[1], identity.lora[0]) if identity.lora is not None else (None, None)


def lookahead_token_ids(tokens: Sequence[int], end: int, lookahead: int) -> tuple[int, ...]:
    """A block's entry of `lookahead_token_ids` (`BlockPool._lookahead_token_ids`)."""
    return tuple(tokens[end : end + lookahead])


# -- naming: the marks a trie node carries (`model.contract.prefix`) -----------------------


Marks = tuple[tuple[str, int, int], ...]


def chunk_marks(identity: Identity, start: int, end: int) -> Marks | None:
    """The items over tokens [start, end) as (identifier, first, last) relative to
    `start`, clipped to the span: two spans at the same position name the same
    content iff their tokens and marks agree."""
    if not identity.mm:
        return None
    marks = tuple(
        (m.identifier, max(m.offset, start) - start, min(m.end, end) - start)
        for m in overlapping(identity, start, end)
    )
    return marks or None


def clip_marks(marks: Marks | None, n: int) -> Marks | None:
    """`marks` of a span cut to its first n tokens."""
    if not marks:
        return None
    out = tuple((i, a, min(b, n)) for i, a, b in marks if a < n)
    return out or None


def stable_hash(value: object) -> int:
    """A hash of strings and ints that does not change across runs (`PYTHONHASHSEED`)."""
    return zlib.crc32(repr(value).encode())


# -- releases ---------------------------------------------------------------------

# field -> (releases, rule): how each release hashed it. Earlier releases are not
# yet researched (named as such, never assumed to agree).
RELEASES: dict[str, tuple[tuple[str, str], ...]] = {
    "salt": (("0.33.0", "first block only, chain-carried (`generate_block_hash_extra_keys`)"),),
    "lora": (("0.33.0", "every block, (name, path); id unhashed (`_gen_lora_extra_hash_keys`)"),),
    "mm": (("0.33.0", "every overlapped block, offset relative to the block (`_gen_mm_extra_hash_keys`)"),),
    "lookahead": (("0.33.0", "keys over [start, end+L) and the L tokens (`get_request_block_hasher`)"),),
}

# The identity fields an `AddRequest` carries (a target states those it hands its allocator).
IDENTITY_FIELDS = frozenset({"salt", "lora", "mm"})
