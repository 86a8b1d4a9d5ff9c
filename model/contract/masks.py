"""Which blocks of a group are kept in the prefix cache (the retention masks).

Each function returns the set of kept block indices in `[start, end)`, or None
for "every block" (dense). They are written from the definitions in the seeds:

SWA (#42258, #43447, vLLM `SlidingWindowManager.reachable_block_mask`): a hit
at an aligned boundary needs the `need = ceil((window-1)/bs)` blocks just below
it (+1 with Eagle, whose tail is shifted up one block: the peek block right
after the boundary). A block is kept iff it lies in the tail of some retained
boundary:
- retention None (dense): every alignment boundary;
- retention 0: only the reachable boundaries (latest replayable prompt
  boundary, shared-prefix junction), floored to the alignment;
- retention k > 0: every k-token segment end, plus the reachable boundaries.
If a segment holds no more than `need` blocks, every block is kept. If the
alignment is not a whole number of blocks, the mask cannot express it: dense.

Mamba (#45845, vLLM `MambaManager.reachable_block_mask`): one state block per
retained boundary, no Eagle shift. Dense keeps all; retention k keeps the last
block of every k-token segment (dense when a segment is one block); the
reachable boundaries are kept for 0 and k.

Cacheable length (#42258, the hybrid coordinator's `cache_blocks`): in a
hybrid model no group caches past the hit grid (the scheduler block), since no
hit can end there; with Eagle (#44082) each group may cache its peek block
past the grid (`floor_with_peek`). Fine-grained hits (`model.contract.fine_mamba`) put
the grid at every hash block: nothing is floored.

Release variants, keyed by the `model.contract.profile.Profile` switches that select
them (each rule's docstring names its releases):
- `CACHEABLE[block_mask, eagle_aware_mask]`: the cacheable length;
- `SWA_MASKS[block_mask, eagle_aware_mask]`: the SWA mask;
- `MAMBA_MASKS[block_mask, mamba_retention]`: the Mamba mask;
- `MASK_GRIDS[masks_on_hit_grid]`: the grid both masks floor a boundary to
  (`MaskGrid`): the lookup's hit grid (the hash block under fine-grained hits)
  or the scheduler block.
Before the mask (0.21.0) every full block of every group is cached
(`every_block`), whatever the other two switches say.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

# The boundaries a replay resumes at are an Eagle rule; their home is `model.contract.eagle`.
from model.contract.eagle import replay_boundaries as replay_boundaries


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def swa_tail_blocks(window: int, block_size: int, eagle: bool) -> int:
    """Contiguous SWA blocks a hit needs below its boundary (incl. Eagle's peek)."""
    return cdiv(window - 1, block_size) + (1 if eagle else 0)


def boundary_edge(boundary: int, alignment: int, block_size: int) -> int:
    """Block index just past the aligned boundary at or below `boundary` tokens."""
    return (boundary // alignment * alignment) // block_size


def swa_kept_blocks(
    start: int,
    end: int,
    *,
    block_size: int,
    window: int,
    alignment: int,
    eagle: bool,
    retention: int | None,
    boundaries: Iterable[int] = (),
) -> set[int] | None:
    """The SWA mask (module docstring): 0.23.0 on (#42258, Eagle-aware since #44082)."""
    if alignment % block_size:
        return None
    need = swa_tail_blocks(window, block_size, eagle)
    shift = 1 if eagle else 0
    edges: set[int] = set()
    segment = alignment if retention is None else (retention or None)
    if segment is not None:
        per_segment = segment // block_size
        if need >= per_segment:
            return None
        # Segment edges at or below `start` have their whole tail below it: skipped.
        first = max(1, (start - shift) // per_segment)
        edges |= {k * per_segment + shift for k in range(first, (end + need) // per_segment + 2)}
    if retention is not None:
        edges |= {boundary_edge(b, alignment, block_size) + shift for b in boundaries}
    # Block i is kept iff e - need <= i < e for some edge e: the union of the tails.
    return {i for e in edges for i in range(max(start, e - need), min(end, e))}


def mamba_kept_blocks(
    start: int,
    end: int,
    *,
    block_size: int,
    alignment: int,
    retention: int | None,
    boundaries: Iterable[int] = (),
) -> set[int] | None:
    """The Mamba mask (module docstring): 0.24.0 on (#45845)."""
    if retention is None:
        return None
    kept: set[int] = set()
    if retention > 0:
        per_segment = retention // block_size
        if per_segment <= 1:
            return None
        kept |= {k for k in range(start, end) if (k + 1) % per_segment == 0}
    for b in boundaries:
        k = boundary_edge(b, alignment, block_size) - 1
        if start <= k < end:
            kept.add(k)
    return kept


# ------------------------------------------------------------------ variants
def every_block(start: int, end: int, **_: object) -> set[int] | None:
    """0.21.0 (before #42258) for every group; 0.22.0, 0.23.0 (before #45845) for
    Mamba: no mask, every full block is cached (dense)."""
    return None


def swa_kept_blocks_eagle_blind(
    start: int,
    end: int,
    *,
    block_size: int,
    window: int,
    alignment: int,
    eagle: bool,
    retention: int | None,
    boundaries: Iterable[int] = (),
) -> set[int] | None:
    """0.22.0 (#42258, before #44082): the SWA mask ignores Eagle: no peek block,
    no shift (the known finding `vllm-swa-mask-drops-eagle-peek`)."""
    return swa_kept_blocks(
        start,
        end,
        block_size=block_size,
        window=window,
        alignment=alignment,
        eagle=False,
        retention=retention,
        boundaries=boundaries,
    )


Mask = Callable[..., "set[int] | None"]
"""(start, end, *, block_size, [window,] alignment, [eagle,] retention, boundaries) -> kept or None."""

SWA_MASKS: dict[tuple[bool, bool], Mask] = {
    (True, True): swa_kept_blocks,  # 0.23.0 on (#44082)
    (True, False): swa_kept_blocks_eagle_blind,
    (False, True): every_block,
    (False, False): every_block,
}
MAMBA_MASKS: dict[tuple[bool, bool], Mask] = {
    (True, True): mamba_kept_blocks,  # 0.24.0 on (#45845)
    (True, False): every_block,
    (False, True): every_block,
    (False, False): every_block,
}


def floor_with_peek(n: int, scheduler_block_size: int, block_size: int, eagle: bool) -> int:
    """0.23.0 on (#44082): floored to the hit grid, and under Eagle up to one of
    the group's blocks past it (the peek block)."""
    aligned = n // scheduler_block_size * scheduler_block_size
    return min(n, aligned + block_size) if eagle and aligned > 0 else aligned


def floor_to_grid(n: int, scheduler_block_size: int, block_size: int, eagle: bool) -> int:
    """0.22.0 (#42258, before #44082): floored to the hit grid, whatever Eagle."""
    return n // scheduler_block_size * scheduler_block_size


def all_tokens(n: int, scheduler_block_size: int, block_size: int, eagle: bool) -> int:
    """0.21.0 (before #42258): no group floors to the hit grid."""
    return n


@dataclass(frozen=True)
class MaskGrid:
    """The grid the SWA and Mamba masks floor a boundary to (their `alignment`).

    Without fine-grained hits both grids are the scheduler block, so the
    variants differ only where a Mamba block is wider than the hash block.
    """

    since: str
    on_hit_grid: bool

    def alignment(self, hit_grid: int, scheduler_block_size: int) -> int:
        """`hit_grid`: the lookup's grid (hash block under fine-grained hits, else the scheduler block)."""
        return hit_grid if self.on_hit_grid else scheduler_block_size


HIT_GRID = MaskGrid(
    "0.29.0 on (`cache_blocks` passes the coordinator's `cache_hit_alignment_tokens`, lowered to the"
    " hash block under fine-grained hits): a mask keeps the tail a hit at the boundary can use",
    on_hit_grid=True,
)
SCHEDULER_GRID = MaskGrid(
    "0.26.0 .. 0.28.0 (fine-grained hits of #46384, masks still on `scheduler_block_size`): the"
    " boundary is floored to the scheduler block while lookups land on the hash block, so the kept"
    " tail sits below the hit that needs it (known finding `vllm-fine-grained-mask-on-scheduler-grid`)",
    on_hit_grid=False,
)
MASK_GRIDS: dict[bool, MaskGrid] = {True: HIT_GRID, False: SCHEDULER_GRID}


Cacheable = Callable[[int, int, int, bool], int]
CACHEABLE: dict[tuple[bool, bool], Cacheable] = {
    (True, True): floor_with_peek,
    (True, False): floor_to_grid,
    (False, True): all_tokens,
    (False, False): all_tokens,
}
