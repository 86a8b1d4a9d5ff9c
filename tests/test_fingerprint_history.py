"""The fingerprint's history image is total (`invariants.explore.fingerprint`).

- every field of `History` and of its `IsolationLedger` is imaged or excluded by
  name with a reason; an unknown field is refused (control: an instance or a
  subclass with an extra field);
- states that differ only in KV validity (`unwritten`) or in the isolation
  ledger's writers get different fingerprints (the image before this fix, kept
  here as `_old_image`, merged them: the hole);
- `finished_tokens` is derived from `finished` (the reason it is excluded);
- a judged operation's pending events count by their effect on the router;
- a dict subclass (a Counter) is imaged by its items.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Hashable

import pytest

from invariants.catalogue import History
from invariants.catalogue.context import Unwritten
from invariants.catalogue.isolation import IsolationLedger
from invariants.explore.fingerprint import (
    _HISTORY,
    _LEDGER,
    UnknownStateType,
    canonical,
    fingerprint,
    history_image,
)
from invariants.explore.search import new_checker
from invariants.harness.checker import Checker
from invariants.targets.model_target import ModelTarget
from model.contract.config import Config, GroupSpec, validate
from model.contract.extra_keys import Identity
from model.contract.observation import AllBlocksCleared
from model.contract.ops import AddRequest, Finish, Op, ResetPrefixCache, Step

CONFIG = validate(Config(groups=(GroupSpec("full", 2),), num_blocks=5, max_model_len=24))
RAN: list[Op] = [AddRequest("r00", (1, 2, 1)), Step(("r00",), 64)]


def _checker(ops: list[Op]) -> Checker:
    checker = new_checker(ModelTarget, CONFIG)
    for op in ops:
        assert checker.step(op) == []
    return checker


def _fp(checker: Checker) -> Hashable:
    return fingerprint(checker.model, checker.history)


def _old_image(history: History, free: tuple[int, ...], names: dict[str, str]) -> Hashable:
    """The hand-picked image before the fix: it left out `unwritten` and `isolation`."""
    ticks = history.free_tick
    values = sorted({0, *(ticks.get(b, 0) for b in free)})
    rank = {v: i for i, v in enumerate(values)}
    return (
        tuple([rank[ticks.get(b, 0)] for b in free]),
        frozenset(history.evicted_in_place),
        frozenset(history.ever_cached),
        frozenset(history.shadow.items()),
        canonical(history.requests, names),
        canonical(history.finished, names),
        history.forget_at,
    )


def test_every_history_field_is_imaged_or_excluded() -> None:
    fields = {f.name for f in dataclasses.fields(History)} | set(vars(History()))
    assert fields == set(_HISTORY)
    ledger = {f.name for f in dataclasses.fields(IsolationLedger)} | set(vars(IsolationLedger()))
    assert ledger == set(_LEDGER)
    for table in (_HISTORY, _LEDGER):
        assert all(callable(how) or (isinstance(how, str) and how.strip()) for how in table.values())
    history_image(History(), (), {})  # a fresh one is imaged without complaint


def test_an_unknown_field_is_refused() -> None:
    """Control: a field neither imaged nor excluded is refused, never skipped."""
    history = History()
    history.later = 1  # type: ignore[attr-defined]
    with pytest.raises(UnknownStateType, match="History.later"):
        history_image(history, (), {})

    @dataclasses.dataclass
    class Grown(History):
        extra: int = 0

    with pytest.raises(UnknownStateType, match="History.extra"):
        history_image(Grown(), (), {})
    history = History()
    history.isolation.later = 1  # type: ignore[attr-defined]
    with pytest.raises(UnknownStateType, match="IsolationLedger.later"):
        history_image(history, (), {})


def test_states_differing_only_in_unwritten_are_not_merged() -> None:
    """The hole: a block a failed load left unwritten (a later hit on it is a violation)."""
    a = _checker(RAN)
    b = copy.deepcopy(a)
    assert _fp(a) == _fp(b)
    block = next(iter(b.history.isolation.writer))  # a block the step wrote
    b.history.unwritten[block] = Unwritten("r00's failed sync load never wrote it")
    free = tuple(a.model.pool.queue.blocks)
    assert _old_image(a.history, free, {}) == _old_image(b.history, free, {})  # merged before the fix
    assert _fp(a) != _fp(b)
    # The tokens written since count; the report text (`why`) does not.
    c = copy.deepcopy(b)
    c.history.unwritten[block].written = 1
    assert _fp(c) != _fp(b)
    c.history.unwritten[block] = Unwritten("another text", 1)
    d = copy.deepcopy(b)
    d.history.unwritten[block].written = 1
    assert _fp(c) == _fp(d)


def test_states_differing_only_in_isolation_are_not_merged() -> None:
    """The hole: who wrote a block (a hit on it by another tenant is a violation)."""
    a = _checker(RAN)
    b = copy.deepcopy(a)
    block = next(iter(b.history.isolation.writer))
    b.history.isolation.writer[block] = Identity(salt="tenant-b")
    free = tuple(a.model.pool.queue.blocks)
    assert _old_image(a.history, free, {}) == _old_image(b.history, free, {})  # merged before the fix
    assert _fp(a) != _fp(b)
    # The tally of what was not judged is read by no check: it splits nothing.
    c = copy.deepcopy(a)
    c.history.isolation.unjudged["hit block of unknown writer"] += 1
    assert _fp(c) == _fp(a)


def test_finished_tokens_is_derived_from_finished() -> None:
    """Why `finished_tokens` is excluded: it is the tokens of `finished`, summed."""
    checker = _checker([*RAN, AddRequest("r01", (2, 1)), Finish("r00"), Finish("r01")])
    history = checker.history
    assert len(history.finished) == 2
    assert history.finished_tokens == sum(len(r.prompt) + len(r.outputs) for r in history.finished.values())


def test_pending_events_count_by_their_effect_on_the_router() -> None:
    """A reset of an empty cache leaves the router as it was: the same state as the
    empty allocator's; a step's stores not yet applied do count (control)."""
    empty = _checker([])
    reset = _checker([ResetPrefixCache()])
    assert reset.history.isolation.pending == (AllBlocksCleared(),)
    assert _fp(reset) == _fp(empty)
    ran = _checker(RAN)
    assert ran.history.isolation.pending  # the step's stores, applied by the next operation
    dropped = copy.deepcopy(ran)
    dropped.history.isolation.pending = ()
    assert _fp(dropped) != _fp(ran)


def test_a_counter_is_imaged_by_its_items() -> None:
    """Control for dict subclasses: a Counter's (empty) `__dict__` is not its content."""
    assert canonical(Counter({1: 2}), {}) != canonical(Counter({1: 3}), {})
    assert canonical(Counter({"r00": 1}), {"r00": "L0"}) == canonical(Counter({"x": 1}), {"x": "L0"})
