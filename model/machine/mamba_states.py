"""Where a Mamba group (align mode) puts a chunk's state, its draft blocks and its copies.

vLLM 0.33.0 `MambaManager.allocate_new_blocks` (align branch). A chunk ending
at `main` tokens keeps its state in block `cdiv(main, bs) - 1`; the blocks
before it that the request never held stay null. With speculative decoding
the group keeps `s = num_speculative_blocks` draft blocks past the state
(`model.contract.mamba`): the table is `cdiv(main, bs) + s` long, the running state is
`s` blocks before its end, and the draft blocks a later chunk's state passes
over move to the table's end, their positions nulled
(`_relocate_speculative_block`), so no draft block is ever lost or doubled.
The previous state's index is remembered (`last_state`) so that the next
allocation frees it (`model.contract.mamba`, stale state).

A copy-on-write copy (`model.contract.fine_mamba`) is queued when a hit or the
request's own key ends inside a block: a reader's private copy of a shared
block (`_consumer_copy`, also used by attention groups) or, for a running
request, its keys moved to a fresh block (`_producer_copy`).

`MambaStates` is one part of `AllocatorModel` (which inherits it): it writes
the group's table, `last_state`, `allocated`, `partial`, `copies` and
`cached_this_step`, and takes blocks from the pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from model.contract.kinds import rules_for
from model.contract.masks import cdiv
from model.machine.pool import Pool

if TYPE_CHECKING:
    from model.machine.seams import Observer
    from model.machine.state import GroupState


class MambaStates:
    """The Mamba align allocation of the allocator model (see the module docstring)."""

    pool: Pool
    num_spec_tokens: int
    observer: Observer

    def draft_blocks(self, g: GroupState) -> int:
        """A Mamba group's draft state blocks: one per speculative token, as vLLM's
        Mamba layers declare them (`MambaBase.get_kv_cache_spec`); 0 without drafts
        and for the other kinds."""
        return rules_for(g.spec).draft_blocks(self.num_spec_tokens)  # model.contract.kinds

    def _allocate_state(self, g: GroupState, rid: str, main: int) -> list[int]:
        """The blocks a chunk ending at `main` adds to `rid`'s table, in vLLM's order."""
        table = g.table(rid)
        s = self.draft_blocks(g)
        required = cdiv(main, g.bs) + s
        partial = g.partial.pop(rid, None)
        if required <= len(table) and partial is None:
            g.allocated.add(rid)
            return []
        prev = len(table)
        running = rid in g.allocated
        if running:
            g.last_state[rid] = prev - 1 - s
        elif prev > 0:
            g.last_state[rid] = prev - 1  # the hit's state
        skipped = required - s - 1
        if prev < skipped:
            table.extend([0] * (skipped - prev))
        # The first draft block the state does not pass stops the move.
        for i in range(prev - s, prev) if running else ():
            if i >= skipped:
                break
            table.append(table[i])
            table[i] = 0
            self.observer.fired("Mamba draft block moved past by its state")
        blocks = self.pool.get_new_blocks(max(required - len(table), 0) + (partial is not None))
        returned = table[prev:]
        if partial is not None:
            dst, blocks = blocks[0], blocks[1:]
            if running:
                self._producer_copy(g, partial[1], dst)
            else:
                self._consumer_copy(g, rid, dst, partial)
                returned = [dst] + returned
        table.extend(blocks)
        g.allocated.add(rid)
        return returned + blocks

    def _consumer_copy(
        self, g: GroupState, rid: str, dst: int, partial: tuple[int, int] | None = None
    ) -> None:
        """A hit read in part: the table points at the private `dst`, which the copy
        fills from the shared block (`_apply_cow`); `dst` holds one extra reference
        until the copy is taken, the source keeps the reference of the hit's touch."""
        idx, src = partial if partial is not None else g.partial.pop(rid)
        table = g.table(rid)
        assert table[idx] == src and self.pool.ref[src] > 0
        table[idx] = dst
        g.copies.append((src, dst))
        self.pool.ref[dst] += 1
        self.observer.fired("CoW copy of a hit read in part")

    def _producer_copy(self, g: GroupState, src: int, dst: int) -> None:
        """The request keyed its own state mid-block and goes on writing it: the
        keys move to `dst`, which the copy fills (`MambaManager.allocate_new_blocks`,
        `BlockPool.move_block_hashes`); `src` holds one extra reference until the
        copy is taken, and a hit on the moved key waits for the next step."""
        self.pool.move_keys(src, dst)
        g.copies.append((src, dst))
        self.pool.ref[src] += 1
        if dst in self.pool.primary:
            g.cached_this_step.add(self.pool.primary[dst])
        self.observer.fired("CoW copy of a request's own tail (move_block_hashes)")
