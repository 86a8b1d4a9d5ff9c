"""Fingerprints sent between two shards: each part sent once, then named by its number.

Contract: for one channel (a `Sender` in one process, a `Receiver` in another),
`receiver.decode(sender.encode(x))` equals `x` (`==`, hence the same hash) for
every value, provided every encoded batch is decoded once, in the order it was
encoded. A tuple or frozenset within `levels` of the top that was sent before on
the channel travels as its number; a new one travels as its parts (numbered, in
the same order on both sides); what lies deeper, and any other value, travels
as it is. The encoding is built of plain ints, lists and tuples, which pickle
writes and reads in C. Equal values share one number, so a decoded value may hold an equal
value sent earlier in place of its own (`1` for `True`): equal, as a
fingerprint must be.

Why: the states a shard reaches share most of their parts (a request's history,
the isolation ledger, the pool) with states it sent before, and pickling a
fingerprint whole costs more than applying the operation that reached it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

LEVELS = 8
"""How deep below a fingerprint parts are numbered (measured: 4 sends twice the bytes of 8,
and 8 as many as 12; each level costs a dict lookup per part)."""


class Sender:
    """The encoding end of one channel: every part it numbered."""

    def __init__(self, levels: int = LEVELS) -> None:
        self.levels = levels
        self.numbers: dict[Any, int] = {}

    def encode(self, batch: list[tuple[Any, Hashable]]) -> list[tuple[Any, Any]]:
        """A batch of (key, fingerprint): the fingerprints encoded, the keys as they are."""
        return [(key, self._part(state, self.levels)) for key, state in batch]

    def _part(self, obj: Any, levels: int) -> Any:
        # Encoded, a part is a number (sent before), a list (new: whether a frozenset, then
        # its parts encoded) or a 1-tuple holding the value as it is: plain types, which
        # pickle writes and reads in C.
        kind = type(obj)
        if not levels or (kind is not tuple and kind is not frozenset):
            return (obj,)
        number = self.numbers.get(obj)
        if number is not None:
            return number
        parts = [kind is frozenset]
        parts += [self._part(x, levels - 1) for x in obj]
        self.numbers[obj] = len(self.numbers)  # after its parts: the receiver's order
        return parts


class Receiver:
    """The decoding end of one channel: every part received, by number."""

    def __init__(self) -> None:
        self.parts: list[Any] = []

    def decode(self, batch: list[tuple[Any, Any]]) -> list[tuple[Any, Hashable]]:
        return [(key, self._part(state)) for key, state in batch]

    def _part(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is tuple:
            return obj[0]
        if kind is int:
            return self.parts[obj]
        items = [self._part(x) for x in obj[1:]]
        value = frozenset(items) if obj[0] else tuple(items)
        self.parts.append(value)
        return value
