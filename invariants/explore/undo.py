"""Restoring a live checker in place: a checkpoint of every mutable object it reaches.

`Checkpoint.take(root)` walks the object graph under `root` (a `Checker`: the
model, the history, the target and the allocator it drives) and records, per
mutable object, a shallow copy of its contents: an instance's `__dict__` and
slots, a list's items, a dict's items in order, a set's members, a deque's
items. `restore()` writes those contents back into the same objects, so
everything the graph held at `take` holds it again: objects an operation
created since are dropped with the references to them, and objects it changed
get their old contents back. Restoring costs a pass over the recorded objects
(on vLLM's manager about 150), where thawing a pickled fork rebuilds every
object (`invariants.explore.fork`): the search restores a parent this way
once per operation it tries and thaws it only once.

What is shared rather than restored is what a fork shares too
(`fork.Freezer`): classes, modules, functions (and what their closures hold),
enum members and objects whose `copy.deepcopy` is themselves (interned
prefixes). An object of a type the walk cannot record (a C type that is not a
known immutable) raises `Unrestorable`, and the caller thaws instead; a
restore never guesses.

The contract a search relies on: after `restore()`, the root is observably the
state it was at `take` (snapshot and fingerprint, hidden state included);
`tests/test_explore_restore.py` compares whole searches against thawing.
`Revisit` is how both searches (one process, and each shard of a campaign)
return to a state between the operations they try from it.
"""

from __future__ import annotations

import collections
import enum
import functools
import types
from typing import Any

from invariants.explore.fork import SHARED_TYPES, Freezer
from invariants.harness.checker import Checker

# Immutable values with no mutable parts: neither recorded nor walked.
_ATOMS = frozenset({int, float, complex, str, bytes, bool, type(None), range, slice, type(Ellipsis)})
# C types with no __dict__ and no slots that are immutable values (by qualified name:
# torch is imported only where a target brings it).
_IMMUTABLE_C = frozenset({"torch.dtype", "torch.device", "re.Pattern", "decimal.Decimal"})

# The C layouts an instance may sit on whose contents a checkpoint records in full (a
# pure Python class sits on `object`; msgspec's structs keep their fields in slots).
_C_BASES = frozenset(
    {
        "builtins.object",
        "builtins.dict",
        "builtins.list",
        "builtins.set",
        "builtins.tuple",
        "builtins.frozenset",
        "collections.deque",
        "collections.OrderedDict",
        "collections.defaultdict",
        "msgspec._core._StructMixin",
    }
)
# Tensors (vLLM's scheduler holds a constant mask): their data recorded as a clone.
_TENSORS = frozenset({"torch.Tensor", "torch.nn.parameter.Parameter"})
_HEAPTYPE = 1 << 9
_MISSING = object()


class Unrestorable(TypeError):
    """The graph holds an object whose contents a checkpoint cannot record."""


def _slots_of(kind: type) -> tuple[str, ...]:
    """Every slot name a class and its bases declare (`__dict__`/`__weakref__` aside)."""
    names: list[str] = []
    for base in kind.__mro__:
        slots = base.__dict__.get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        names += [s for s in slots if s not in ("__dict__", "__weakref__") and s not in names]
    # A private slot `__x` is stored mangled as `_Class__x`: getattr needs the stored name.
    return tuple(names)


class _Kinds:
    """Per type: how a checkpoint treats it (cached: one decision per type)."""

    def __init__(self) -> None:
        self.slots: dict[type, tuple[str, ...]] = {}
        self.shared: dict[type, bool] = {}
        self.layout: dict[type, bool] = {}

    def recordable(self, kind: type) -> bool:
        """Whether every instance of `kind` keeps its contents where a checkpoint reads
        them: its first C base (the layout CPython allocates) is one `_C_BASES` names."""
        known = self.layout.get(kind)
        if known is None:
            base = next(c for c in kind.__mro__ if not c.__flags__ & _HEAPTYPE)
            known = self.layout[kind] = f"{base.__module__}.{base.__qualname__}" in _C_BASES
        return known

    def is_shared(self, obj: Any, kind: type) -> bool:
        known = self.shared.get(kind)
        if known is not None:
            return known
        shared = (
            isinstance(obj, (*SHARED_TYPES, enum.Enum))
            or f"{kind.__module__}.{kind.__qualname__}" in _IMMUTABLE_C
        )
        if not shared and "__deepcopy__" in dir(kind):
            try:
                shared = obj.__deepcopy__({}) is obj
            except Exception:  # a __deepcopy__ that needs more than a memo: not a value type
                shared = False
        self.shared[kind] = shared
        return shared

    def slots_of(self, kind: type) -> tuple[str, ...]:
        names = self.slots.get(kind)
        if names is None:
            names = self.slots[kind] = _slots_of(kind)
        return names


_KINDS = _Kinds()


class Checkpoint:
    """The contents of every mutable object under a root, restorable in place."""

    __slots__ = ("dicts", "subdicts", "lists", "sets", "deques", "slotted", "tensors", "objects")

    def __init__(self) -> None:
        self.dicts: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
        self.subdicts: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
        self.lists: list[tuple[list[Any], list[Any]]] = []
        self.sets: list[tuple[set[Any], set[Any]]] = []
        self.deques: list[tuple[collections.deque[Any], list[Any]]] = []
        self.slotted: list[tuple[Any, tuple[str, ...], tuple[Any, ...]]] = []
        self.tensors: list[tuple[Any, Any]] = []
        self.objects = 0

    @classmethod
    def take(cls, root: Any) -> Checkpoint:
        """Record every mutable object reachable from `root` (`Unrestorable` when one
        cannot be recorded)."""
        cp = cls()
        kinds = _KINDS
        seen: set[int] = set()
        stack: list[Any] = [root]
        push = stack.append
        while stack:
            obj = stack.pop()
            kind = type(obj)
            if kind in _ATOMS or id(obj) in seen:
                continue
            seen.add(id(obj))
            if kind is tuple or kind is frozenset:
                stack.extend(obj)
                continue
            if kind is list:
                cp.lists.append((obj, obj[:]))
                stack.extend(obj)
                continue
            if kind is dict:
                cp.dicts.append((obj, obj.copy()))
                stack.extend(obj.keys())
                stack.extend(obj.values())
                continue
            if kind is set:
                cp.sets.append((obj, obj.copy()))
                stack.extend(obj)
                continue
            if kinds.is_shared(obj, kind):
                continue
            cp._record(obj, kind, push, stack)
        cp.objects = len(seen)
        return cp

    def _record(self, obj: Any, kind: type, push: Any, stack: list[Any]) -> None:
        """An object that is no plain container: its contents by what it is built of."""
        if isinstance(obj, types.MethodType):  # a bound method: its owner holds the state
            push(obj.__self__)
            return
        if type(obj) is functools.partial:  # pickled by value: its arguments are state
            push(obj.func)
            stack.extend(obj.args)
            stack.extend(obj.keywords.values())
            return
        if f"{kind.__module__}.{kind.__qualname__}" in _TENSORS:
            self.tensors.append((obj, obj.detach().clone()))
            attrs = getattr(obj, "__dict__", None)
            if type(attrs) is dict:
                self.dicts.append((attrs, attrs.copy()))
                stack.extend(attrs.values())
            return
        if not _KINDS.recordable(kind):
            raise Unrestorable(
                f"cannot checkpoint a {kind.__module__}.{kind.__qualname__} (a C type's hidden contents)"
            )
        handled = False
        if isinstance(obj, dict):  # OrderedDict, defaultdict, Counter, a user's dict subclass
            self.subdicts.append((obj, dict(obj)))
            stack.extend(obj.keys())
            stack.extend(obj.values())
            handled = True
        elif isinstance(obj, list):
            self.lists.append((obj, list(obj)))
            stack.extend(obj)
            handled = True
        elif isinstance(obj, set):
            self.sets.append((obj, set(obj)))
            stack.extend(obj)
            handled = True
        elif isinstance(obj, collections.deque):
            self.deques.append((obj, list(obj)))
            stack.extend(obj)
            handled = True
        elif isinstance(obj, (tuple, frozenset)):  # a named tuple: immutable, its parts may not be
            stack.extend(obj)
            handled = True
        attrs = getattr(obj, "__dict__", None)
        if type(attrs) is dict:
            self.dicts.append((attrs, attrs.copy()))
            stack.extend(attrs.values())
            handled = True
        names = _KINDS.slots_of(kind)
        if names:
            values = tuple(getattr(obj, n, _MISSING) for n in names)
            self.slotted.append((obj, names, values))
            stack.extend(values)
            handled = True
        if not handled:
            raise Unrestorable(
                f"cannot checkpoint a {kind.__module__}.{kind.__qualname__} (no __dict__, slots or known contents)"
            )

    def restore(self) -> None:
        """Write every recorded object's contents back (instances before containers,
        so a key hashed by its contents hashes as it did)."""
        for obj, names, values in self.slotted:
            for name, value in zip(names, values):
                now = getattr(obj, name, _MISSING)
                if now is value:
                    continue
                if value is _MISSING:
                    object.__delattr__(obj, name)
                else:
                    object.__setattr__(obj, name, value)
        for d, saved in self.dicts:
            d.clear()
            d.update(saved)
        for d, saved in self.subdicts:  # their own methods (an OrderedDict keeps its links)
            d.clear()
            if isinstance(d, collections.Counter):
                dict.update(d, saved)  # Counter.update adds counts
            else:
                d.update(saved)
        for lst, items in self.lists:
            lst[:] = items
        for st, members in self.sets:
            st.clear()
            st.update(members)
        for dq, items in self.deques:
            dq.clear()
            dq.extend(items)
        for tensor, data in self.tensors:
            if tensor.shape == data.shape and tensor.dtype == data.dtype:
                tensor.detach().copy_(data)
            else:
                tensor.detach().set_(data.clone())


class Revisit:
    """One expanded state, handed out once per operation tried from it: thawed once from
    its frozen fork, then, after an operation moved it on, restored in place from a
    checkpoint taken before the first (`arm`), or thawed afresh where no checkpoint was
    taken (`restore="pickle"`, or `Unrestorable`). Either way each operation starts from
    the state the fork holds; a search says which way it went (`explore.search.RESTORES`)."""

    __slots__ = ("freezer", "frozen", "base", "checkpoint", "current")

    def __init__(self, freezer: Freezer, frozen: bytes) -> None:
        self.freezer, self.frozen = freezer, frozen
        self.base: Checker = freezer.thaw(frozen)
        self.checkpoint: Checkpoint | None = None
        self.current: Checker | None = self.base

    def arm(self) -> str | None:
        """Checkpoint the thawed state; why it cannot be (the search thaws instead), or None."""
        try:
            self.checkpoint = Checkpoint.take(self.base)
        except Unrestorable as exc:
            return str(exc)
        return None

    def checker(self) -> Checker:
        """The state as frozen: the live copy, restored or thawed if an operation moved it."""
        if self.current is None:
            if self.checkpoint is not None:
                self.checkpoint.restore()
                self.current = self.base
            else:
                self.current = self.freezer.thaw(self.frozen)
        return self.current

    def moved(self) -> None:
        """The last operation changed the copy (a self-loop, a probe, leaves it reusable)."""
        self.current = None
