"""The model's fast structures agree with their definitions.

- `LinkedFreeQueue` (O(1) per block) against `FreeQueue` (the list
  definition) on random operation sequences, links both ways; a queue that
  prepends in the wrong order is caught.
- Interned prefix naming (`model.contract.prefix`) against naming by tuple: two names
  are the same object exactly when their tokens are equal; a naming that
  forgets the tail of a prefix is caught.
"""

from __future__ import annotations

import gc
import pickle
import random
from collections.abc import Callable, Sequence

import pytest

from model.contract import prefix as prefix_mod
from model.contract.free_queue import FreeQueue, LinkedFreeQueue, demote_n
from model.contract.observation import BlockKey, BlockStored, block_key
from model.contract.prefix import CHAIN, EMPTY, Prefix, extend, prefix

# ----------------------------------------------------------------------------- free queue


def first_disagreement(
    make: Callable[[Sequence[int]], LinkedFreeQueue], seed: int, steps: int = 200
) -> int | None:
    """Random valid operations (drawn from the list definition's state) on the
    definition and on `make`'s queue: the first step whose result, order, length
    or membership differs; None when they agree throughout."""
    rng = random.Random(seed)
    universe = range(1, 40)
    start = rng.sample(list(universe), 20)
    ref, fast = FreeQueue(start), make(start)
    for i in range(steps):
        outside = [b for b in universe if b not in ref.blocks]
        kind = rng.choice(["popleft", "popleft_n", "remove", "append_n", "prepend_n"])
        args: tuple[object, ...] = ()
        if kind == "popleft_n":
            args = (rng.randint(0, min(4, len(ref))),)
        elif kind == "remove" and len(ref):
            args = (rng.choice(ref.blocks),)
        elif kind in ("append_n", "prepend_n") and outside:
            args = (rng.sample(outside, rng.randint(1, min(4, len(outside)))),)
        elif kind != "popleft" or not len(ref):
            continue
        if getattr(ref, kind)(*args) != getattr(fast, kind)(*args):
            return i
        if fast.blocks != ref.blocks or len(fast) != len(ref):
            return i
        if any((b in fast) != (b in ref) for b in range(-2, 42)):
            return i
        order = [None, *ref.blocks, None]
        if any(fast.neighbours(b) != (order[j], order[j + 2]) for j, b in enumerate(ref.blocks)):
            return i  # the backward links too: a remove from the middle follows them
    return None


class PrependsBackwards(LinkedFreeQueue):
    """Broken: `prepend_n` puts the last block first (the order bug #43447 is about)."""

    def prepend_n(self, block_ids):  # type: ignore[no-untyped-def]
        super().prepend_n(list(block_ids)[::-1])


@pytest.mark.parametrize("seed", range(20))
def test_linked_free_queue_agrees_with_the_list_definition(seed):
    assert first_disagreement(LinkedFreeQueue, seed) is None


def test_a_queue_that_prepends_backwards_is_caught():
    assert all(first_disagreement(PrependsBackwards, seed) is not None for seed in range(5))


def test_linked_queue_neighbours_and_errors():
    q = LinkedFreeQueue([3, 1, 2])
    assert q.neighbours(3) == (None, 1) and q.neighbours(1) == (3, 2) and q.neighbours(2) == (1, None)
    with pytest.raises(ValueError):
        q.remove(7)
    with pytest.raises(ValueError):
        q.popleft_n(4)
    with pytest.raises(AssertionError):
        q.append_n([1])
    pinned = LinkedFreeQueue([5, 6])
    assert demote_n(pinned, q, 1) == [5] and q.blocks == [3, 1, 2, 5] and pinned.blocks == [6]
    assert LinkedFreeQueue().blocks == [] and 0 not in LinkedFreeQueue([1])


# ----------------------------------------------------------------------------- prefixes


def _samples(rng: random.Random) -> list[tuple[tuple[int, ...], int]]:
    """(tokens, n) pairs over a 2-token alphabet sharing long prefixes, so equal
    contents arise from different tuples and lengths on both sides of CHAIN."""
    base = tuple(rng.randrange(2) for _ in range(3 * CHAIN + 5))
    out = []
    for _ in range(60):
        cut = rng.randint(0, len(base))
        toks = base[:cut] + tuple(rng.randrange(2) for _ in range(rng.randint(0, 2 * CHAIN)))
        out.append((toks, rng.randint(0, len(toks))))
    return out


def naming_disagreement(name: Callable[[tuple[int, ...], int], object], samples) -> str | None:  # type: ignore[no-untyped-def]
    """Names must be identical exactly when the named token tuples are equal."""
    for a, n in samples:
        for b, m in samples:
            same_content = a[:n] == b[:m]
            if (name(a, n) is name(b, m)) != same_content:
                return f"{a[:n]} vs {b[:m]}: content equal {same_content}"
    return None


@pytest.mark.parametrize("seed", range(6))
def test_interned_naming_is_tuple_naming(seed):
    samples = _samples(random.Random(seed))
    assert naming_disagreement(prefix, samples) is None
    for toks, n in samples:
        p = prefix(toks, n)
        assert p.tokens() == toks[:n] and len(p) == n and p == toks[:n]
        # the same content from a fresh tuple (no memo), by extension, and by head()
        assert prefix(tuple(list(toks)), n) is p
        assert extend(prefix(toks, n // 2), toks[n // 2 : n]) is p
        assert prefix(toks).head(n) is p and prefix(toks)[:n] is p
        assert hash(p) == hash(prefix(tuple(list(toks[:n]))))
        assert pickle.loads(pickle.dumps(p)) is p
        assert (block_key(1, toks, n) == block_key(1, toks[:n], n)) and block_key(0, toks, n) != block_key(
            1, toks, n
        )
        assert BlockKey(1, toks[:n]) == block_key(1, toks, n)  # type: ignore[arg-type]  # a tuple is interned


def test_a_naming_that_forgets_the_tail_is_caught():
    def chain_only(toks: tuple[int, ...], n: int) -> Prefix:
        return prefix(toks, n - n % CHAIN)

    assert naming_disagreement(chain_only, _samples(random.Random(0))) is not None


def test_events_given_tuples_are_interned():
    toks = tuple(range(1, 9))
    ev = BlockStored(0, (toks[:8],), toks[:4], toks[4:8], 4)  # type: ignore[arg-type]  # tuples are interned
    assert ev.block_hashes[0] is prefix(toks) and ev.parent is prefix(toks, 4) and prefix(()) is EMPTY


def test_unreferenced_prefixes_are_collected():
    prefix_mod.clear_memo()
    gc.collect()
    before = prefix_mod.live_nodes()
    toks = tuple(range(10_000, 10_000 + 40 * CHAIN + 7))
    p = prefix(toks)
    assert prefix_mod.live_nodes() >= before + 40
    del p
    prefix_mod.clear_memo()
    gc.collect()
    assert prefix_mod.live_nodes() <= before


def test_a_joined_tuple_names_its_old_prefixes_without_rebuilding(monkeypatch):
    # A sampled token makes a new tuple; naming its blocks must cost O(new tokens),
    # not a fresh chain of the whole request (counted in nodes looked up).
    toks = tuple(range(20_000, 20_000 + 200 * CHAIN))
    for n in range(0, len(toks) + 1, 4 * CHAIN):
        prefix(toks, n)
    grown = prefix_mod.joined(toks, (7, 8))
    assert grown == toks + (7, 8)
    calls = []
    real = prefix_mod._node
    monkeypatch.setattr(prefix_mod, "_node", lambda p, c: calls.append(c) or real(p, c))
    assert prefix(grown, len(toks)) is prefix(toks, len(toks))
    assert prefix(grown).tokens() == grown
    assert len(calls) <= 2
    # Control: the same content in a fresh tuple walks the whole chain again.
    calls.clear()
    assert prefix(tuple(list(grown))) is prefix(grown)
    assert len(calls) >= 200


def test_the_memo_is_bounded_by_what_its_tuples_hold(monkeypatch):
    monkeypatch.setattr(prefix_mod, "_MEMO_NODES", 50 * 4)
    prefix_mod.clear_memo()
    for i in range(20):  # 20 tuples of 50 chain nodes each: no more than 4 stay remembered
        prefix(tuple(range(i * 10_000, i * 10_000 + 50 * CHAIN)), 10)
    assert len(prefix_mod._CHAINS) <= 4
    assert prefix_mod._memo_size == sum(prefix_mod._cost(e) for e in prefix_mod._CHAINS.values())
    prefix_mod.clear_memo()


def test_joining_the_same_tokens_twice_gives_one_tuple():
    toks = tuple(range(30_000, 30_000 + 10 * CHAIN))
    prefix(toks, CHAIN)
    a = prefix_mod.joined(toks, [5, 6])
    assert prefix_mod.joined(toks, (5, 6)) is a
    assert prefix_mod.joined(toks, (5, 7)) == toks + (5, 7) and prefix_mod.joined(toks, (5, 7)) is not a
