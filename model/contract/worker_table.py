"""The worker's block table and where a Mamba step reads and writes its state (vLLM 0.33.0).

The scheduler's allocator keeps one table per request and group; the worker
(model runner) keeps its own, rebuilt from what each step ships
(`SchedulerOutput`), and the forward pass indexes the worker's. The two
differ: the allocator nulls entries in place (a window's blocks left behind,
a Mamba state retired, a draft block moved to the table's end by
`MambaManager._relocate_speculative_block`), while the worker's table only
grows between admissions. Both model runners agree on how it is rebuilt
(V2, the default: `v1/worker/gpu/model_runner.py` `add_requests` /
`update_requests`, `BlockTables.append_block_ids`; V1:
`gpu_model_runner.py` `_update_states`):

- an admission (a new request, or a preempted one resumed) ships the whole
  table (`NewRequestData.block_ids`, or a resumed request's
  `CachedRequestData.new_block_ids`), which replaces the worker's
  (`overwrite=True`): the hit's blocks, then the new ones (`shipped_table`);
- a running request's `new_block_ids` are appended per group (`appended`);
- a preempted or finished request's table is dropped.

Mamba in 'align' mode (`mamba_utils.preprocess_mamba` in V1,
`MambaHybridModelState.preprocess_state` and
`preprocess_mamba_align_fused_kernel` in V2; the kernels' state indices,
`mamba_get_block_table_tensor`): a step that ends at token `end` keeps the
running state in column `cdiv(end, bs) - 1` of the worker's table
(`state_column`) and, when it verifies d drafts, the draft states in the d
columns after it (`written_columns`). Before the forward it copies the
previous state there from column `prev + accepted` (`read_column`): `prev`
is the column the request's previous step wrote (`mamba_state_idx`), or
`(num_computed - 1) // bs` for a request just admitted (nothing to read at
0), and `accepted` the drafts its last sample accepted (`num_accepted_tokens
- 1`). Nothing in either runner treats a null (block 0) entry specially: a
null column is read and written like any other.
"""

from __future__ import annotations

from collections.abc import Collection

from model.contract.masks import cdiv

Table = tuple[tuple[int, ...], ...]  # per group


def shipped_table(hit: Table, new: Table, copies: Collection[tuple[int, int]] = ()) -> Table:
    """An admission's whole table per group as the worker receives it, from the
    observation's hit and new blocks: the hit's entries, then the new blocks. A
    copy-on-write destination stands in the table where its source was hit (the
    observation lists it first among the new blocks, `copies` pairs it)."""
    out = []
    for hg, ng in zip(hit, new):
        table, used = [], 0
        for h in hg:
            if used < len(ng) and (h, ng[used]) in copies:
                table.append(ng[used])
                used += 1
            else:
                table.append(h)
        out.append((*table, *ng[used:]))
    return tuple(out)


def appended(table: Table, new: Table) -> Table:
    """A running request's table after a step shipped `new` (empty groups: nothing new)."""
    return tuple((*t, *n) for t, n in zip(table, new))


def state_column(end: int, block_size: int) -> int:
    """The column holding the running state of a step that ends at token `end`."""
    return cdiv(end, block_size) - 1


def written_columns(end: int, verified: int, block_size: int) -> range:
    """The columns a step ending at `end` writes: its state, then one per verified draft."""
    first = state_column(end, block_size)
    return range(first, first + verified + 1)


def read_column(state_end: int, accepted: int, block_size: int) -> int | None:
    """The column a step copies the previous state from: that of the step that
    ended at `state_end` (for an admission, its computed tokens) shifted by the
    drafts accepted since; None when there is no state yet (`state_end` 0)."""
    if state_end <= 0:
        return None
    return state_column(state_end, block_size) + accepted
