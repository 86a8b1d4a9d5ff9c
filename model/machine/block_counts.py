"""How many free blocks an allocation takes, per group.

A group takes its new blocks plus the hit blocks it adopts from a free queue
(touching a cached block at ref count 0 removes it from there), plus one block
for a reader's private copy where a hit ends inside a block. An align-mode Mamba
group keeps one state per chunk: its count is capped (`model.contract.mamba`),
and with a KV connector's external tokens the admission takes their state block
too. Where vLLM 0.33.0 counts otherwise, the gates decide on vLLM's count and the
catalogue flags the consequence (the findings named in
`BlockCounts._mamba_blocks_to_allocate`).

`BlockCounts` is one part of `AllocatorModel` (which inherits it): it reads the
model's configuration, rules, pool and groups, and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from model.contract.config import Config
from model.contract.fine_mamba import ends_inside_block
from model.contract.kinds import rules_for
from model.contract.mamba import cap_of
from model.contract.masks import cdiv
from model.contract.profile import Rules
from model.machine import connector as conn
from model.machine.pool import Pool

if TYPE_CHECKING:
    from model.machine.seams import Observer
    from model.machine.state import GroupState

Ids = tuple[int, ...]


class BlockCounts:
    """The allocation's block counts (see the module docstring)."""

    cfg: Config
    rules: Rules
    pool: Pool
    observer: Observer

    # Provided by the other parts of `AllocatorModel`.
    draft_blocks: Callable[[GroupState], int]
    skipped_tokens: Callable[[GroupState, int], int]

    def _blocks_to_allocate(
        self,
        g: GroupState,
        rid: str,
        num_tokens: int,
        hits: Ids,
        local: int,
        main: int,
        computed: int,
        cap: int | None = None,
        whole: bool = False,
        taken: bool = False,
    ) -> int:
        """Free blocks group `g` takes for this step: its new blocks plus the hit
        blocks it adopts from the free queue (touching one removes it from there).
        `computed`: `local` plus a connector's external tokens; `cap`: the admission
        cap on the blocks the tokens require (`model.policy.admission`), None: none; `whole`: the
        full-sequence gate's count (a Mamba group's is vLLM's own, `by_vllm`); `taken`:
        what the allocation takes where it differs from the gates' count (a Mamba group's).

        vLLM `single_type_kv_cache_manager.py` `get_num_blocks_to_allocate`.
        """
        held = len(g.tables.get(rid, ()))
        if one_state(g):
            return self._mamba_blocks_to_allocate(g, held, hits, main, local, rid, computed, whole, taken)
        required = cdiv(num_tokens + g.bs * self.draft_blocks(g), g.bs)
        required = required if cap is None else min(required, cap)
        if rid in g.num_cached:
            # Running: no new hit, and a table already longer than needed is fine.
            return max(required - held, 0)
        # Blocks wholly before the window stay null: neither allocated nor, as hit blocks, adopted.
        out_of_window = self.skipped_tokens(g, computed) // g.bs
        new = max(required - max(out_of_window, len(hits) + held), 0)
        adopted_hits = hits[max(0, out_of_window - held) :]
        # A hit ending inside a block takes one more block: the reader's private copy.
        return new + ends_inside_block(len(hits), local, g.bs) + self._num_evictable(adopted_hits)

    def _mamba_blocks_to_allocate(
        self,
        g: GroupState,
        held: int,
        hits: tuple[int, ...],
        main: int,
        local: int,
        rid: str,
        computed: int,
        whole: bool = False,
        physical: bool = False,
    ) -> int:
        """MambaManager in align mode (same function). With external tokens the admission
        takes `taken`: their state block, the chunk's where it ends in a later block, and
        the hit blocks past the external tokens (the contract, `model.machine.connector`). vLLM
        0.33.0 counts its one-state cap and every free hit block: fewer where the chunk's
        state is a second block (where the pool holds fewer than it takes it raises: finding
        vllm-mamba-external-state-uncounted; else it takes a watermark's headroom: finding
        vllm-mamba-external-state-uncounted-watermark, flagged by `admission_keeps_watermark`),
        more where a free hit block is superseded and one state block serves (it refuses
        though fewer would do: finding vllm-mamba-external-state-overcounted, flagged by
        `fitting_request_admitted`). The gates decide on vLLM's count; `physical`: return
        what the admission takes (`_allocate` refuses where the pool holds less: vLLM raises)."""
        if hits and self.pool.primary.get(hits[-1]) in g.cached_this_step:
            # The hit state was keyed by another request this step, not computed yet: ask for
            # more than the pool holds so the request waits for the next step.
            self.observer.fired("Mamba same-step guard")
            return self.cfg.num_blocks + 1
        s = self.draft_blocks(g)
        # A state to copy (a hit ending inside a block, or this request's own
        # mid-block key) takes one more block: the copy's destination.
        copy = ends_inside_block(len(hits), local, g.bs) or rid in g.partial
        cap = cap_of(copy, s, rid in g.allocated)

        def counted(new: int) -> int:
            # Only the chunk's last state is kept: one new block at most, whatever the chunk
            # length (vLLM caps only a positive count, and min() leaves the rest alone).
            return self.rules.count(max(new, 0) + 1 if copy else new, cap)  # model.contract.mamba

        by_vllm = counted(cdiv(main, g.bs) + s - len(hits) - held) + self._num_evictable(hits)
        external = conn.external_state_blocks(local, computed, held)
        if not external or whole:  # the full-sequence gate too decides on vLLM's count
            return by_vllm
        # After external tokens the chunk's state counts from the table they leave; the hit
        # blocks their state supersedes are never touched, so they stay free.
        kept = hits[self.skipped_tokens(g, computed) // g.bs :]
        taken = external + counted(cdiv(main, g.bs) + s - cdiv(computed, g.bs)) + self._num_evictable(kept)
        return taken if physical else by_vllm

    def _num_evictable(self, blocks: tuple[int, ...]) -> int:
        """Hit blocks still in a free queue (ref 0); the null block is not one."""
        return sum(1 for b in blocks if b and self.pool.ref[b] == 0)


def one_state(g: GroupState) -> bool:
    """One state block per chunk (Mamba in 'align' mode, `model.contract.kinds`)."""
    return rules_for(g.spec).one_state(g.spec)
