"""Within one scheduler step: what the step's forward pass reads stays put.

A step's forward pass runs after the whole batch was scheduled, so every
block a scheduled request reads or writes in it must survive every free and
allocation the rest of the batch performed. For each scheduled request with
chunk `[start, end)`, per group:

- full attention reads blocks `[0, cdiv(end, bs))` and writes those covering
  `[start, end)`;
- SWA reads from the window of its first new token, `start - window + 1`
  (`SlidingWindowManager.get_num_skipped_tokens` frees only below it);
- Mamba (align) reads the state of the block holding token `start - 1` and
  writes the state of the block holding token `end - 1`; Mamba 'none' keeps
  the plain layout and reads from the block holding token `start - 1`
  (`MambaManager.get_num_skipped_tokens` = computed - 1). With s draft state
  blocks (`model.contract.mamba`) a running request's state is not where token
  `start - 1` lies: the worker reads it from the previous step's state column
  plus the accepted drafts (`preprocess_mamba`, `num_accepted_tokens - 1`),
  at or past that block, where a chunk's state may have moved the draft
  blocks; so every non-null block of its table from there on must stay held
  (wherever it lies after the step), and the block holding token `end - 1`
  must be held where the allocator's table has one. Where that position is
  null in the allocator's table the worker's may still hold a block (its
  table only grows: `allocate_new_blocks` ships a moved draft block again at
  the end and nulls only the allocator's entry), so there the position is
  judged against the worker's table (`mamba_state_in_worker_table`).

The worker's table (`model.contract.worker_table`, rebuilt in the history from the
blocks each step ships) is what the forward pass indexes: a Mamba step reads
the previous state from one of its columns and writes the running state (and
each verified draft's state) into others, whatever the allocator's table now
says there.

Attention KV written by one request may be read by another in the same step
(each layer writes the batch's KV before its attention reads it: that is why
a same-step prefix hit on attention blocks is allowed). Mamba state is not:
the recurrence of every request starts from its initial state at once, so a
state another request of the step writes is not there yet (vLLM
`MambaManager.get_num_blocks_to_allocate`, the `cached_blocks_this_step`
guard).
"""

from __future__ import annotations

from collections.abc import Iterator

from invariants.catalogue.context import CheckContext
from model.contract.config import GroupSpec
from model.contract.masks import cdiv
from model.contract.observation import ScheduleResult, StepResult
from model.contract.ops import Schedule
from model.contract.worker_table import read_column, written_columns

Chunk = tuple[str, int, int]  # request, start, end


def _chunks(ctx: CheckContext) -> list[Chunk]:
    """The (request, start, end) each request of this step computes."""
    obs = ctx.obs
    pairs: list[tuple[str, ScheduleResult]] = []
    if isinstance(ctx.op, Schedule) and isinstance(obs, ScheduleResult):
        pairs = [(ctx.op.rid, obs)]
    elif isinstance(obs, StepResult):
        pairs = [(rid, r) for rid, r in obs.results if rid not in obs.preempted]
    out = []
    for rid, r in pairs:
        if r.scheduled <= 0 or rid not in ctx.history.requests:
            continue
        end = ctx.history.requests[rid].num_computed
        out.append((rid, end - r.scheduled, end))
    return out


def _reads(spec: GroupSpec, start: int, end: int) -> Iterator[int]:
    bs = spec.block_size
    if spec.kind == "mamba" and spec.mamba_cache_mode != "align":
        yield from range(max(start - 1, 0) // bs, cdiv(end, bs))
        return
    if spec.kind == "mamba":
        if start > 0:
            yield cdiv(start, bs) - 1
        yield cdiv(end, bs) - 1
        return
    lo = 0
    if spec.kind == "swa":
        assert spec.sliding_window is not None
        lo = max(0, start - spec.sliding_window + 1)
    yield from range(lo // bs, cdiv(end, bs))


def _new_blocks(obs: object) -> dict[int, str]:
    """Block -> the request a step handed it to as a new block."""
    pairs: list[tuple[str, ScheduleResult]] = []
    if isinstance(obs, StepResult):
        pairs = list(obs.results)
    out: dict[int, str] = {}
    for rid, r in pairs:
        for group in r.new_blocks or ():
            for b in group:
                if b:
                    out[b] = rid
    return out


def step_blocks_stay_held(ctx: CheckContext) -> list[str]:
    """Every block a request reads or writes in this step is still in its block
    table after the step (held, not freed), and none it held before the step
    was handed to another request as a new block in the same step: a block
    freed by one request in a step is never reused by another while the step
    still reads it. (A block another request of the step allocated and cached
    may be hit and read: attention KV is written before it is read.)"""
    handed = _new_blocks(ctx.obs)
    held: dict[str, set[int]] = {}

    def held_before(rid: str) -> set[int]:  # a whole table: read only when a block was handed on
        if rid not in held:
            held[rid] = {b for group in ctx.before.tables.get(rid, ()) for b in group if b}
        return held[rid]

    problems = []
    looked_up = _looked_up(ctx)
    for rid, start, end in _chunks(ctx):
        tables = ctx.after.tables.get(rid, ())
        for g, spec in enumerate(ctx.config.groups):
            table = tables[g] if g < len(tables) else ()
            drafts = None if rid in looked_up else _draft_states(ctx, rid, g, spec, start)
            if drafts is not None:
                problems += _moved_states_held(ctx, rid, g, drafts, table)
            for idx in _reads(spec, start, end) if drafts is None else (cdiv(end, spec.block_size) - 1,):
                b = table[idx] if idx < len(table) else 0
                if drafts is not None and b == 0:
                    continue  # judged against the worker's table (mamba_state_in_worker_table)
                if b == 0 or ctx.after.ref_cnt[b] <= 0:
                    problems.append(
                        f"{rid} computes tokens [{start}, {end}) but group {g} block index {idx} "
                        f"is {'the null block' if b == 0 else f'block {b}, freed'} after the step"
                    )
                elif handed.get(b, rid) != rid and b in held_before(rid):
                    problems.append(
                        f"block {b}, which {rid} reads in this step (group {g} index {idx}), "
                        f"was handed to {handed[b]} as a new block in the same step"
                    )
    return problems[:3]


def _looked_up(ctx: CheckContext) -> set[str]:
    """The requests this step admitted with a lookup: a waiting request holding blocks
    from a failed async load was freed first (`model.machine.connector`), so it resumes from its
    hit's state, not from the blocks it held before the step."""
    obs = ctx.obs
    if isinstance(ctx.op, Schedule) and isinstance(obs, ScheduleResult):
        return {ctx.op.rid} if obs.hit is not None else set()
    if isinstance(obs, StepResult):
        return {rid for rid, r in obs.results if r.hit is not None}
    return set()


def _draft_states(ctx: CheckContext, rid: str, g: int, spec: GroupSpec, start: int) -> tuple[int, ...] | None:
    """The blocks a running request's previous state and draft states may lie in
    (Mamba align with draft blocks, see the module docstring); None otherwise."""
    before = ctx.before.tables.get(rid, ())
    if not (ctx.draft_blocks and spec.kind == "mamba" and spec.mamba_cache_mode == "align") or g >= len(
        before
    ):
        return None
    if not before[g] or start <= 0:
        return None  # admitted this step: it reads its hit's state, by position
    return tuple(b for b in before[g][max(cdiv(start, spec.block_size) - 1, 0) :] if b)


def _moved_states_held(
    ctx: CheckContext, rid: str, g: int, blocks: tuple[int, ...], table: tuple[int, ...]
) -> list[str]:
    return [
        f"{rid} resumes from a state or draft state in block {b} (group {g}), which is "
        f"{'freed' if b in table else 'out of its table'} after the step"
        for b in blocks
        if b not in table or ctx.after.ref_cnt[b] <= 0
    ]


def mamba_state_not_read_while_written(ctx: CheckContext) -> list[str]:
    """No request of a step resumes from a Mamba state block another request
    of the same step writes: that state is computed by the very forward pass
    that reads it (vLLM's same-step guard, `cached_blocks_this_step`)."""
    if not isinstance(ctx.obs, StepResult):
        return []
    chunks = _chunks(ctx)
    writes: dict[tuple[int, int], str] = {}
    for rid, _start, end in chunks:
        tables = ctx.after.tables.get(rid, ())
        for g, spec in enumerate(ctx.config.groups):
            idx = cdiv(end, spec.block_size) - 1
            if (
                spec.kind == "mamba"
                and spec.mamba_cache_mode == "align"
                and g < len(tables)
                and idx < len(tables[g])
                and tables[g][idx]
            ):
                writes[(g, tables[g][idx])] = rid
    problems = []
    for rid, start, _end in chunks:
        if start == 0:
            continue
        tables = ctx.after.tables.get(rid, ())
        for g, spec in enumerate(ctx.config.groups):
            idx = cdiv(start, spec.block_size) - 1
            if spec.kind != "mamba" or spec.mamba_cache_mode != "align":
                continue
            if g >= len(tables) or idx >= len(tables[g]):
                continue
            writer = writes.get((g, tables[g][idx]))
            if writer is not None and writer != rid:
                problems.append(
                    f"{rid} resumes from Mamba state block {tables[g][idx]} (group {g}), "
                    f"which {writer} writes in the same step"
                )
    return problems


def mamba_state_in_worker_table(ctx: CheckContext) -> list[str]:
    """Every Mamba ('align') state a step reads or writes lies in a block the
    request holds, at the column of the worker's block table where the model
    runner looks for it (`model.contract.worker_table`: the state column
    `cdiv(end, bs) - 1` and one column per verified draft after it; the
    previous state at the previous step's state column plus the drafts accepted
    since, or at `(num_computed - 1) // bs` right after an admission). Never the
    null block, which every request's table shares, never past the worker's
    table, never a block freed or held by another request. From the drafting
    case the allocator's own table cannot show (docs/semantics.md, speculative
    decoding: a draft block moved past is nulled in the allocator's table only;
    a re-admitted request's shipped table carries such a null)."""
    problems = []
    for rid, _start, end in _chunks(ctx):
        r = ctx.history.requests[rid]
        if r.worker is None:
            continue  # not rebuilt (an admission with a connector's external tokens)
        tables = ctx.after.tables.get(rid, ())
        for g, spec in enumerate(ctx.config.groups):
            if spec.kind != "mamba" or spec.mamba_cache_mode != "align" or g >= len(r.worker):
                continue
            held = set(tables[g]) - {0} if g < len(tables) else set()
            bs = spec.block_size
            read = read_column(*r.read_from, bs)
            roles = [] if read is None else [("reads its previous state from", read)]
            roles += [("writes its state into", c) for c in written_columns(end, len(r.verifying), bs)]
            for role, col in roles:
                problem = _worker_block_problem(ctx, r.worker[g], col, held)
                if problem:
                    problems.append(f"{rid} {role} column {col} of its worker table (group {g}): {problem}")
    return problems[:3]


def _worker_block_problem(ctx: CheckContext, table: tuple[int, ...], col: int, held: set[int]) -> str:
    if col >= len(table):
        return f"past the table's {len(table)} entries"
    b = table[col]
    if b == 0:
        return "the null block"
    if b not in held or ctx.after.ref_cnt[b] <= 0:
        return f"block {b}, {'freed' if ctx.after.ref_cnt[b] <= 0 else 'not in its table'} after the step"
    return ""


def step_reads_written_kv(ctx: CheckContext) -> list[str]:
    """A step reads only KV that was written (computed by a step or loaded): no
    block a scheduled request reads below its first new token (`_reads`: the
    prefix its attention reads, an SWA window, the Mamba state it resumes from)
    is one a KV connector's load failed on that no step has computed whole
    since (`History.unwritten`, after this step's own writes: each layer writes
    the batch's KV before attention reads it). The running request's side of
    `hit_serves_written_kv`: vLLM lets a request sharing a failed block keep it
    as computed when another request marked it for recomputation
    (`Scheduler._update_requests_with_invalid_blocks`), sound only if that one
    recomputes it by the step this one reads it in. (An admission's hit is
    judged by `hit_serves_written_kv`.)"""
    unwritten = ctx.history.unwritten
    if not unwritten:
        return []
    obs = ctx.obs
    results = obs.results if isinstance(obs, StepResult) else ((getattr(ctx.op, "rid", ""), obs),)
    admitted = {rid for rid, r in results if isinstance(r, ScheduleResult) and r.hit is not None}
    problems = []
    for rid, start, end in _chunks(ctx):
        if rid in admitted:
            continue
        tables = ctx.after.tables.get(rid, ())
        for g, spec in enumerate(ctx.config.groups):
            table, bs = tables[g] if g < len(tables) else (), spec.block_size
            for idx in _reads(spec, start, end):
                u = unwritten.get(table[idx]) if idx < len(table) and table[idx] else None
                # The cache holds the tokens below `start` (a Mamba state: the whole block).
                read = min(start - idx * bs, bs) if spec.kind != "mamba" or idx * bs < start else 0
                if u is not None and u.written < read:
                    problems.append(
                        f"{rid} computes tokens [{start}, {end}) reading group {g} block {table[idx]} "
                        f"(index {idx}): {u.why} and no step has written it since"
                    )
    return problems[:3]
