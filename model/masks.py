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
"""

from __future__ import annotations

from collections.abc import Iterable


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


def replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int, eagle: bool) -> tuple[int, ...]:
    """Where a later request replaying this prompt can resume (vLLM `replay_boundaries`).

    A resend is capped at P-1 tokens. With Eagle the hit lands one block below
    the last aligned boundary, for the resend and for a longer sibling; the two
    differ only when P is block-aligned.
    """
    if not eagle:
        return (num_prompt_tokens - 1,)
    sbs = scheduler_block_size
    resend = (num_prompt_tokens - 1) // sbs * sbs
    extension = num_prompt_tokens // sbs * sbs
    return tuple(sorted({max(resend - sbs, 0), max(extension - sbs, 0)}))
