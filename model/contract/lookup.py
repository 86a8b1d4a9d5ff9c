"""Hit rules: how long a prefix-cache hit is, per group kind, from the cached set.

Each finder takes `cached(j)`: whether block j of the group (the block covering
tokens `[j*bs, (j+1)*bs)`) is in the hash map, and returns the hit *layout*: a
list whose length is the hit in blocks, holding j where block j is read and
None where the table holds the null block. Hit tokens = len(layout) * bs.
Written as definitions (the largest boundary that qualifies, met counting
down), not as the scans vLLM uses.

- Full attention (#43447): the longest run of cached blocks from block 0,
  floored to the alignment A; Eagle drops one block (min(A, bs) tokens) first.
- SWA (#42258): the largest A-aligned boundary e <= max_length whose `need`
  blocks below it are cached (only blocks from 0 when e < need: the prompt is
  shorter than the window). With Eagle, `need` includes the peek block at the
  boundary and the hit stops below it.
- Mamba (#45845): the largest A-aligned boundary whose state block is cached.

`alignment_quirk` notes: vLLM 0.33.0's SWA scan, with Eagle, when no run of
`need` blocks exists and bs != A, drops one aligned segment too many from the
short run that reaches block 0 (`find_longest_cache_hit`: the run is popped to
alignment, then the Eagle pop and a second re-alignment). The model follows
vLLM there (see docs/semantics.md); the hit is shorter than it could be,
never wrong.
"""

from __future__ import annotations

from collections.abc import Callable

Layout = list[int | None]
Cached = Callable[[int], bool]


def _aligned(e: int, block_size: int, alignment: int) -> bool:
    return block_size == alignment or (e * block_size) % alignment == 0


def full_hit(cached: Cached, max_length: int, block_size: int, alignment: int, drop_eagle: bool) -> Layout:
    n = 0
    while n < max_length // block_size and cached(n):
        n += 1
    hit = n * block_size
    if drop_eagle and hit > 0:
        hit -= min(alignment, block_size)
    hit -= hit % alignment
    return list(range(-(-hit // block_size)))


def swa_hit(
    cached: Cached, max_length: int, block_size: int, alignment: int, need: int, drop_eagle: bool
) -> Layout:
    """`need` already includes Eagle's extra block when `drop_eagle`.

    A hit always needs at least one cached block at its edge, even when the
    window needs none (window 1): vLLM counts a run only from a cached block.
    """
    need = max(need, 1)
    nb = max_length // block_size

    def run_cached(lo: int, hi: int) -> bool:
        return all(cached(j) for j in range(max(lo, 0), hi))

    # Each "largest x such that" below is the first x met counting down.
    if not drop_eagle:
        ends = (e for e in range(nb, 0, -1) if _aligned(e, block_size, alignment) and run_cached(e - need, e))
        e = next(ends, None)
        if e is None:
            return []
        return [j if j >= e - need else None for j in range(e)]
    # Eagle: the run's last block s is the peek block; the hit ends at s.
    peeks = (
        s
        for s in range(nb - 1, -1, -1)
        if _aligned(s, block_size, alignment) and s + 1 >= need and run_cached(s + 1 - need, s + 1)
    )
    s = next(peeks, None)
    if s is not None:
        return [j if j >= s + 1 - need else None for j in range(s)]
    short = (
        s
        for s in range(nb - 1, -1, -1)
        if _aligned(s, block_size, alignment) and s + 1 < need and run_cached(0, s + 1)
    )
    s = next(short, None)
    if s is None:
        return []
    if block_size != alignment:  # alignment_quirk (module docstring)
        s = max(s - alignment // block_size, 0)
    return list(range(s))


def mamba_hit(cached: Cached, max_length: int, block_size: int, alignment: int) -> Layout:
    ends = (
        i
        for i in range(max_length // block_size - 1, -1, -1)
        if _aligned(i + 1, block_size, alignment) and cached(i)
    )
    i = next(ends, None)
    if i is None:
        return []
    return [None] * i + [i]
