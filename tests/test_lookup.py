"""The hit rules' searches (`model.contract.lookup`: the largest qualifying boundary,
met counting down) against the rules as written: the maximum over every
boundary. A search that stops at the first boundary counting up is caught."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from model.contract.lookup import Layout, mamba_hit, swa_hit


def _aligned(e: int, bs: int, a: int) -> bool:
    return bs == a or (e * bs) % a == 0


def swa_by_maximum(
    cached: Callable[[int], bool], max_len: int, bs: int, a: int, need: int, eagle: bool
) -> Layout:
    need, nb = max(need, 1), max_len // bs

    def run(lo: int, hi: int) -> bool:
        return all(cached(j) for j in range(max(lo, 0), hi))

    if not eagle:
        ends = [e for e in range(1, nb + 1) if _aligned(e, bs, a) and run(e - need, e)]
        return [j if j >= max(ends) - need else None for j in range(max(ends))] if ends else []
    peeks = [s for s in range(nb) if _aligned(s, bs, a) and s + 1 >= need and run(s + 1 - need, s + 1)]
    if peeks:
        return [j if j >= max(peeks) + 1 - need else None for j in range(max(peeks))]
    short = [s for s in range(nb) if _aligned(s, bs, a) and s + 1 < need and run(0, s + 1)]
    if not short:
        return []
    s = max(short) if bs == a else max(max(short) - a // bs, 0)
    return list(range(s))


def mamba_by_maximum(cached: Callable[[int], bool], max_len: int, bs: int, a: int) -> Layout:
    ends = [i for i in range(max_len // bs) if _aligned(i + 1, bs, a) and cached(i)]
    return [None] * max(ends) + [max(ends)] if ends else []


cases = st.tuples(
    st.sets(st.integers(0, 40)),  # the cached blocks
    st.integers(0, 40 * 4),  # max length
    st.sampled_from([(4, 4), (4, 8), (4, 16), (8, 8), (2, 8)]),  # (block size, alignment)
    st.integers(0, 5),  # the window's blocks
    st.booleans(),  # Eagle
)


@settings(max_examples=400, deadline=None)
@given(cases)
def test_the_searches_find_the_largest_boundary(
    case: tuple[set[int], int, tuple[int, int], int, bool],
) -> None:
    blocks, max_len, (bs, a), need, eagle = case
    cached = blocks.__contains__
    assert swa_hit(cached, max_len, bs, a, need, eagle) == swa_by_maximum(cached, max_len, bs, a, need, eagle)
    assert mamba_hit(cached, max_len, bs, a) == mamba_by_maximum(cached, max_len, bs, a)


def test_control_the_smallest_boundary_is_not_the_largest() -> None:
    def mamba_first_up(cached: Callable[[int], bool], max_len: int, bs: int, a: int) -> Layout:
        i = next((i for i in range(max_len // bs) if _aligned(i + 1, bs, a) and cached(i)), None)
        return [] if i is None else [None] * i + [i]

    cached = {1, 5}.__contains__
    assert (
        mamba_first_up(cached, 32, 4, 4) != mamba_by_maximum(cached, 32, 4, 4) == mamba_hit(cached, 32, 4, 4)
    )
