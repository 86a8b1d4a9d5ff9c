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

A target may name further objects no operation writes (`share`: by their
class; vLLM's configuration objects, `vllm_hidden_state.shared_by_reference`):
they are shared by reference too, which saves copying them at every fork. That
they were never written is checked, not assumed: each is pickled when first
shared and again at the end of the search (`changed_shared`), and a difference
is an error in the certificate.
"""

from __future__ import annotations

import io
import pickle
import types
from collections.abc import Callable
from typing import Any

from invariants.harness.checker import Checker

# Classes too: a mutant's class defined inside a function has no importable name.
_SHARED_TYPES = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodWrapperType,
)


def _bound(func: Any, owner: Any) -> types.MethodType:
    return types.MethodType(func, owner)


class _SharingPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, shared: dict[int, Any], freezer: Freezer | None = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.shared = shared
        self.freezer = freezer

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, _SHARED_TYPES):
            self.shared[id(obj)] = obj  # kept alive here, so the id stays valid
            return id(obj)
        if self.freezer is not None and self.freezer.shares(obj):
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
    target allows it (decided on the first freeze) and names nothing to `share`,
    else sharing by reference."""

    def __init__(self, share: Callable[[type], bool] | None = None) -> None:
        self.plain: bool | None = None if share is None else False
        self._shared: dict[int, Any] = {}
        self._share = share
        self._by_type: dict[type, bool] = {}
        # id -> (the object, its pickle when first shared): `changed_shared` compares.
        self._written: dict[int, tuple[Any, bytes]] = {}

    def shares(self, obj: Any) -> bool:
        """Is `obj` one of the objects the target names as never written (shared by reference)?"""
        if self._share is None:
            return False
        kind = type(obj)
        shared = self._by_type.get(kind)
        if shared is None:
            shared = self._by_type[kind] = self._share(kind)
        if shared and id(obj) not in self._written:
            self._shared[id(obj)] = obj
            self._written[id(obj)] = (obj, _image(obj))
        return shared

    def changed_shared(self) -> list[str]:
        """The objects shared by reference whose pickle changed since they were first shared."""
        return [type(obj).__qualname__ for obj, before in self._written.values() if _image(obj) != before]

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
        _SharingPickler(buf, self._shared, self).dump(checker)
        return buf.getvalue()

    def thaw(self, data: bytes) -> Checker:
        if self.plain:
            checker: Checker = pickle.loads(data)
        else:
            checker = _SharingUnpickler(io.BytesIO(data), self._shared).load()
        return checker


def _image(obj: Any) -> bytes:
    """A shared object's contents, for `Freezer.changed_shared` (its own shared members by reference)."""
    buf = io.BytesIO()
    _SharingPickler(buf, {}).dump(obj)
    return buf.getvalue()
