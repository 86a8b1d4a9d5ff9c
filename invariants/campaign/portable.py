"""A frozen checker that any worker can thaw: plain pickle, what has no importable name by value.

Contract: `Portable().freeze(checker)` is bytes that `pickle.loads` turns, in any
process that can import what the checker's classes and functions name, into a
copy of the checker (as `invariants.explore.fork.Freezer` copies one within a
process). A module held as a value (vLLM's manager holds `torch`) travels as
its name; a function or class with no importable name (vLLM's request block
hasher, a closure; a mutant defined in a function; what cloudpickle is told to
carry by value) travels by value, as cloudpickle writes it, once per process
and function: the loading process keeps one copy of each, shared by the
checkers it thaws, as `Freezer` shares them by reference within a process
(they hold no allocator state). Everything else is plain pickle. Should that
fail, the checker goes by cloudpickle whole; the first freeze decides.

Why not cloudpickle always: it costs 2.5 times this on vLLM's manager, and the
owner then keeps the bytes as its frozen state, where `Freezer` bytes (objects
shared by their id in the producing process) would need a thaw and a re-freeze.
"""

from __future__ import annotations

import importlib
import io
import pickle
import types
from typing import Any

from invariants.harness.checker import Checker

# What this process loaded by value, by its bytes: one copy per function or class.
_LOADED: dict[bytes, Any] = {}


def _load(data: bytes) -> Any:
    got = _LOADED.get(data)
    if got is None:
        got = _LOADED[data] = pickle.loads(data)
    return got


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, values: dict[int, tuple[Any, bytes | None]]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.values = values

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is types.ModuleType:
            return importlib.import_module, (obj.__name__,)
        if kind is types.FunctionType or isinstance(obj, type):
            known = self.values.get(id(obj))
            if known is None:
                known = self.values[id(obj)] = (obj, _by_value(obj))  # obj kept: its id stays its own
            if known[1] is not None:
                return _load, (known[1],)
        return NotImplemented


def _by_value(obj: Any) -> bytes | None:
    """cloudpickle's bytes of a function or class it would carry by value, else None."""
    from ray import cloudpickle

    if cloudpickle.cloudpickle._should_pickle_by_reference(obj):
        return None
    return bytes(cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class Portable:
    """Freezes checkers to bytes any worker loads (see the module docstring)."""

    def __init__(self) -> None:
        self.whole: bool | None = None  # decided on the first freeze: cloudpickle the whole checker
        self.values: dict[int, tuple[Any, bytes | None]] = {}

    def freeze(self, checker: Checker) -> bytes:
        if not self.whole:
            try:
                buf = io.BytesIO()
                _Pickler(buf, self.values).dump(checker)
                self.whole = False
                return buf.getvalue()
            except (pickle.PicklingError, TypeError, AttributeError):
                if self.whole is False:  # a target that pickled before must keep pickling
                    raise
                self.whole = True
        from ray import cloudpickle

        return bytes(cloudpickle.dumps(checker, protocol=pickle.HIGHEST_PROTOCOL))
