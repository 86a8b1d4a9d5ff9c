"""A state's owner in an explore campaign: a hash of its fingerprint, the same in every process.

Contract of `route(obj)`: equal values get equal routes, in every process and on
every machine (`hash()` does not: it hashes None by address in Python 3.11 and
strings under a per-process seed). `route_kept(obj, memo)` is `route(obj)`,
faster where parts of `obj` were routed before.
"""

from __future__ import annotations

import dataclasses
import enum
import zlib
from typing import Any

from model.contract.prefix import Prefix

_MASK = (1 << 64) - 1
_NONE = 0x9E3779B97F4A7C15
_PLAIN = frozenset({int, bool, float})


def route(obj: Any, memo: dict[Any, int] | None = None) -> int:
    """A hash of a fingerprint that is the same in every process (it names the state's
    owner): equal values, equal routes. `hash()` is not: it hashes None by address in
    Python 3.11 and strings under a per-process seed. `memo` keeps the route of
    frozen dataclasses (configurations, group specs) within one process."""
    kind = type(obj)
    if kind is int or kind is bool:
        return obj & _MASK
    if obj is None:
        return _NONE
    if kind is str:
        return zlib.crc32(obj.encode())
    if kind is tuple and _PLAIN.issuperset(map(type, obj)):
        return hash(obj) & _MASK  # numbers only (block ids, ranks): C speed, no seed
    if kind is tuple or kind is list or isinstance(obj, tuple):
        h = 0x345678
        for x in obj:
            h = ((h ^ route(x, memo)) * 1000003) & _MASK
        return h ^ len(obj)
    if kind is frozenset and _PLAIN.issuperset(map(type, obj)):
        return hash(obj) & _MASK  # numbers only: C speed, no seed
    if kind is frozenset or kind is set:
        return (sum(route(x, memo) for x in obj) ^ 0xF5E7) & _MASK
    if kind is Prefix:
        return hash(obj.tokens()) & _MASK  # ints only: no per-process seed (its namespace aside)
    if kind is float:
        return hash(obj) & _MASK
    if kind is bytes:
        return zlib.crc32(obj)
    if isinstance(obj, enum.Enum):
        return route(obj.name, memo)
    if dataclasses.is_dataclass(obj):
        memo = {} if memo is None else memo
        got = memo.get(obj)
        if got is None:
            fields = tuple(getattr(obj, f.name) for f in dataclasses.fields(obj))
            got = memo[obj] = route((kind.__name__, fields), memo)
        return got
    raise TypeError(f"route: cannot route a {kind.__qualname__} (add it with a process-independent hash)")


def route_kept(obj: Any, memo: dict[Any, int], levels: int = 3) -> int:
    """`route(obj)`, keeping in `memo` (by value) the routes of its tuples and frozensets
    down to `levels` below it: states share most of their parts with states routed
    before (a request's history, the isolation ledger), and a lookup hashes at C speed."""
    kind = type(obj)
    if not levels or (kind is not tuple and kind is not frozenset):
        return route(obj, memo)
    got = memo.get(obj)
    if got is None:
        if _PLAIN.issuperset(map(type, obj)):
            got = hash(obj) & _MASK
        elif kind is tuple:
            got = 0x345678
            for x in obj:
                got = ((got ^ route_kept(x, memo, levels - 1)) * 1000003) & _MASK
            got ^= len(obj)
        else:
            got = (sum(route_kept(x, memo, levels - 1) for x in obj) ^ 0xF5E7) & _MASK
        memo[obj] = got
    return got
