"""Forking a checked state: a frozen copy of a `Checker` (model, target, history).

The search keeps one frozen copy per frontier state and thaws a fresh one for
each operation it tries from there. A copy is a pickle (four to ten times
faster than `copy.deepcopy` of the same checker, and compact while it waits
in the frontier). Objects pickle cannot carry by value (modules, functions and
closures such as vLLM's request block hasher) are shared by reference, which
is what `copy.deepcopy` does with them too: they hold no allocator state.

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


class _SharingPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, shared: dict[int, Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.shared = shared

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, SHARED_TYPES):
            self.shared[id(obj)] = obj  # kept alive here, so the id stays valid
            return id(obj)
        return None

    def reducer_override(self, obj: Any) -> Any:
        # A method bound on one object (a mutant rebinding an instance attribute):
        # plain pickle saves it as getattr(owner, function name), which names another
        # attribute. Rebuild it from the shared function and the copied owner instead.
        if type(obj) is types.MethodType and not isinstance(obj.__self__, type):
            return _bound, (obj.__func__, obj.__self__)
        return NotImplemented


class _SharingUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, shared: dict[int, Any]) -> None:
        super().__init__(file)
        self.shared = shared

    def persistent_load(self, pid: Any) -> Any:
        return self.shared[pid]


class Freezer:
    """Freezes checkers to bytes and thaws fresh copies. Plain pickle when the
    target allows it (decided on the first freeze), else sharing by reference."""

    def __init__(self) -> None:
        self.plain: bool | None = None
        self._shared: dict[int, Any] = {}

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
        _SharingPickler(buf, self._shared).dump(checker)
        return buf.getvalue()

    def thaw(self, data: bytes) -> Checker:
        if self.plain:
            checker: Checker = pickle.loads(data)
        else:
            checker = _SharingUnpickler(io.BytesIO(data), self._shared).load()
        return checker
