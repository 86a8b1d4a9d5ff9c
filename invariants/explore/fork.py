"""Forking a checked state: a frozen copy of a `Checker` (model, target, history).

The search keeps one frozen copy per frontier state and thaws it when it
expands that state (once, restoring it in place between the operations it
tries: `invariants.explore.undo`; or once per operation: `restore="pickle"`).
A copy is a pickle (four to ten times faster than `copy.deepcopy` of the same
checker, and compact while it waits in the frontier). Objects pickle cannot
carry by value (modules, functions and closures such as vLLM's request block
hasher) are shared by reference, which is what `copy.deepcopy` does with them
too: they hold no allocator state. They are named by their id in this
process, so a frozen copy thaws only in the process that froze it (or a fork
of it made later).

A fork is checked against re-execution of the path that reached it
(`invariants.explore.search` does this once per instance): the thawed copy and
a checker that replayed the operations from scratch must show equal snapshots.
"""

from __future__ import annotations

import io
import pickle
import types
from typing import Any

from invariants.harness.checker import Checker

# Classes too: a mutant's class defined inside a function has no importable name.
SHARED_TYPES = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodWrapperType,
)


def _bound(func: Any, owner: Any) -> types.MethodType:
    return types.MethodType(func, owner)


# What forks share by reference, by id (kept alive here, so an id stays valid): process-wide,
# so a frozen fork thaws with plain `pickle.loads`.
_SHARED: dict[int, Any] = {}


def _shared(key: int) -> Any:
    return _SHARED[key]


class _SharingPickler(pickle.Pickler):
    """Shares `SHARED_TYPES` by reference. In `reducer_override`, not `persistent_id`:
    the pickler calls that for every object, ints and strings included, this one only
    for objects that are no atom and not already in the memo."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, SHARED_TYPES) and obj is not _shared:
            _SHARED[id(obj)] = obj
            return _shared, (id(obj),)
        # A method bound on one object (a mutant rebinding an instance attribute):
        # plain pickle saves it as getattr(owner, function name), which names another
        # attribute. Rebuild it from the shared function and the copied owner instead.
        if type(obj) is types.MethodType and not isinstance(obj.__self__, type):
            return _bound, (obj.__func__, obj.__self__)
        return NotImplemented


class Freezer:
    """Freezes checkers to bytes and thaws fresh copies. Plain pickle when the
    target allows it (decided on the first freeze), else sharing by reference."""

    def __init__(self) -> None:
        self.plain: bool | None = None

    def freeze(self, checker: Checker) -> bytes:
        if self.plain is not False:
            try:
                data = pickle.dumps(checker, protocol=pickle.HIGHEST_PROTOCOL)
                if self.plain is None:
                    pickle.loads(data)  # a pickle that does not load back is no copy
                self.plain = True
                return data
            except (pickle.PicklingError, TypeError, AttributeError):
                if self.plain:  # a target that pickled before must keep pickling
                    raise
                self.plain = False
        buf = io.BytesIO()
        _SharingPickler(buf).dump(checker)
        return buf.getvalue()

    def thaw(self, data: bytes) -> Checker:
        checker: Checker = pickle.loads(data)  # shared objects come back through `_shared`
        return checker
