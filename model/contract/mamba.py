"""Mamba in 'align' mode: one state block per chunk, and what becomes of the old ones.

vLLM `single_type_kv_cache_manager.py` `MambaManager`. A Mamba group keeps
only the state where the request's last chunk ended: its table is null up to
the block holding that position. When the next chunk is allocated:

- retirement (`_remove_blocks_in_range`): every state block wholly behind
  the computed tokens is freed, most recent first, and nulled in the table; a
  retired-block mark remembers how far the walk has gone, so the walk passes
  the null gaps prefill leaves between states (`retire_from_mark`);
- the stale state: the previous chunk's state block, if it is no longer the
  last, is freed on its own;
- admission count (`get_num_blocks_to_allocate`): a chunk needs one new
  state block at most, plus the destination of a copy-on-write copy when a
  hit or its own key ends inside a block (`model.contract.fine_mamba`); a smaller need
  (0, or negative when the table is already long enough) is kept as it is
  (`capped`);
- draft state blocks (`MambaSpec.num_speculative_blocks`, s): with
  speculative decoding a Mamba layer keeps s more blocks past its state, one
  per draft token (`MambaBase.get_kv_cache_spec`: s = num_speculative_tokens,
  0 only under ReplaySSM). The table is `cdiv(main, bs) + s` long, the
  running state sits s blocks before its end, a request's first allocation
  may take s more blocks than the cap, and when a later chunk moves the state
  forward the draft blocks it passes over move to the table's end, their
  positions nulled (`allocate_new_blocks`, `_relocate_speculative_block`).
  In `none` mode the table is `s` blocks longer (`s * bs` more tokens).

Release variants, keyed by the `model.contract.profile.Profile` switches that select
them (each rule's docstring names its releases):
- `RETIREMENTS[mamba_retire_past_nulls]`: where the walk stops;
- `COUNTS[mamba_count_capped]`: the admission count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def retire_from_mark(table: Sequence[int], retired: int, last: int) -> int:
    """0.30.0 on (PR not identified): the first block to retire is the mark, past any null gap."""
    return retired


def retire_down_to_null(table: Sequence[int], retired: int, last: int) -> int:
    """0.29.0 and older: the walk down from the last skipped block stops at the
    first null, so a state below one is freed only as the stale state, in the
    order of that path."""
    return next((i + 1 for i in range(last - 1, -1, -1) if not table[i]), 0)


Retirement = Callable[[Sequence[int], int, int], int]
"""(the table, the retired-block mark, the block past the last skipped one) ->
the first table index to retire."""

RETIREMENTS: dict[bool, Retirement] = {True: retire_from_mark, False: retire_down_to_null}


def capped(new: int, cap: int) -> int:
    """0.31.0 on (PR not identified): `min(num_new_blocks, physical_block_cap)`,
    the cap one running state plus a copy's destination (plus the draft blocks
    on a first allocation, `cap_of`)."""
    return min(new, cap)


def raised_to_cap(new: int, cap: int) -> int:
    """0.26.0 .. 0.30.0: any positive need is raised to the cap, so a partial hit
    needing only its copy block asks for two."""
    return cap if new > 0 else min(new, cap)


def cap_of(copy: bool, draft_blocks: int, allocated: bool) -> int:
    """The most new blocks one allocation takes: the state, a copy's destination,
    and on the request's first allocation its draft blocks (vLLM 0.33.0
    `physical_block_cap`; the draft blocks are only non-zero with drafts)."""
    return 1 + copy + (0 if allocated else draft_blocks)


Count = Callable[[int, int], int]
"""(new state blocks the chunk needs, the cap of `cap_of`) -> the blocks asked."""

COUNTS: dict[bool, Count] = {True: capped, False: raised_to_cap}
