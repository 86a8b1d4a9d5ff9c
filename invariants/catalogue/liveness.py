"""Liveness: nothing the pool can hold is refused."""

from __future__ import annotations

from invariants.catalogue.context import CheckContext
from model.contract.config import Config
from model.contract.fine_mamba import fine_hits_enabled
from model.contract.masks import cdiv
from model.contract.observation import ScheduleResult, StepResult
from model.contract.ops import Schedule, Step
from model.machine.connector import external_tokens
from model.policy.admission import admission_cap_blocks, full_sequence_tokens, watermark_blocks
from model.policy.scheduling import capped, long_prefill_cap, mamba_chunk
from model.policy.spec_decode import padded_admission


def fitting_request_admitted(ctx: CheckContext) -> list[str]:
    """A request that fits an empty pool is always admitted, by any correct
    scheduler: when no block is in use, an admission needing at most N-1
    blocks never fails (no stall from pinned blocks, retained scratch, a KV
    connector's reservations or a rolled-back load; #40676 admission demotion).

    Judged: the first admission decision of a `Schedule` or of a `Step` (a
    waiting request whose lookup ran, `hit` set, neither admitted nor sent to
    an async load), when the pool was idle at its turn: no block in use before
    the operation, nobody preempted, and no request the step reached before it
    scheduled a token, took a block or started a load, so the whole budget is
    its own. A request refused after others spent the budget or the pool is
    never judged; neither is a refusal a step's own rollback made room for.

    What the budget allows: a chunk of min(tokens past the hit and the
    connector's external tokens, budget, the long-prefill cap when the step
    queues more than one request), split at Mamba block boundaries like any
    chunk (`model.policy.scheduling`); with drafts a one-token admission after a hit
    is padded with k draft slots, and when 1+k exceeds the budget it allows
    nothing (`model.policy.spec_decode`); a chunk of 0 is not judged.

    What it needs (`_need`): per attention group the blocks covering the hit,
    the external tokens, the chunk and the lookahead slots, less the blocks an
    SWA window has left behind its first computed token (null entries); per
    align-mode Mamba group the new state block, the hit or external state it
    resumes from (one block for both when the chunk ends in the block holding
    the last external token, and for an async load: the admission takes only
    the external state), and its draft blocks; with fine-grained hits one private
    copy per group whose hit ends inside a block. An async load takes only
    the hit and external tokens' blocks now, and leaves one decode step's
    slots free with drafts (the connector's only reservation on an idle pool:
    an in-flight prefill holding nothing is a rolled-back load,
    `model.machine.connector`). The judge's history does not say whether an offer
    loads sync or async, so with external tokens both needs count (the
    larger), and a budget that allows a sync load nothing is not judged.

    The admission gates (`model.policy.admission`): with `Config.reserve_full_isl` a request
    fits only if its whole sequence does, so one is judged only where an upper bound
    of the gate's count (`_whole_sequence_bound`) fits the idle pool (a pool smaller
    than a request's whole sequence is one vLLM's start-up check refuses); with a
    watermark and another request in the step, the watermark's blocks count too."""
    turn = _first_admission(ctx)
    if turn is None:
        return []
    rid, obs, budget, queued = turn
    counted = _need(ctx, rid, obs, budget, queued)
    cfg = ctx.config
    if counted is None or counted[0] + _gated(ctx, rid, obs, queued) > cfg.num_blocks - 1:
        return []
    need, superseded = counted
    req = ctx.history.requests[rid]
    # Said apart: vLLM reserves a rolled-back load's whole sequence against every async admission.
    after = " after its failed load was rolled back" if req.rolled_back else ""
    # Said apart: vLLM counts the local Mamba hit block an external state supersedes (`model.machine.connector`).
    if superseded:
        after += " (a Mamba external state supersedes its local hit)"
    stale = sorted(r for r, h in ctx.history.requests.items() if h.rolled_back and r != rid)
    if stale:
        after += f" (rolled-back load(s) of {', '.join(stale)} still waiting)"
    return [f"admission of {rid} ({need} blocks) refused by an idle pool of {cfg.num_blocks - 1}{after}"]


def _gated(ctx: CheckContext, rid: str, obs: ScheduleResult, queued: int) -> int:
    """Blocks the admission gates add to what must fit (`fitting_request_admitted`): the
    watermark where another request is in the step, and under `reserve_full_isl` the whole
    pool where the whole sequence's bound and the watermark exceed it (not judged)."""
    cfg = ctx.config
    wm = watermark_blocks(cfg.watermark, cfg.num_blocks) if queued > 1 else 0
    if cfg.reserve_full_isl and _whole_sequence_bound(ctx, rid, obs) + wm > cfg.num_blocks - 1:
        return cfg.num_blocks  # the whole sequence may not fit the pool: not judged
    return wm


def _whole_sequence_bound(ctx: CheckContext, rid: str, obs: ScheduleResult) -> int:
    """An upper bound of the blocks the full-sequence gate counts on an idle pool: per
    attention group every block of the sequence (a sliding-window group at most its
    admission cap) and a private copy, per Mamba (align) group its state, the one it
    resumes from, its draft blocks and its hit's block (vLLM 0.33.0 `allocate_slots`,
    `full_sequence_must_fit`)."""
    cfg = ctx.config
    full = full_sequence_tokens(len(ctx.history.requests[rid].tokens), cfg.max_model_len)
    hits = obs.hit_blocks or ()
    total = 0
    for g, spec in enumerate(cfg.groups):
        held = sum(1 for b in hits[g] if b) if g < len(hits) else 0
        if spec.kind == "mamba" and spec.mamba_cache_mode == "align":
            total += 2 + ctx.draft_blocks + held
            continue
        blocks = cdiv(full, spec.block_size) + (ctx.draft_blocks if spec.kind == "mamba" else 0)
        if spec.kind == "swa":
            assert spec.sliding_window is not None
            cap = admission_cap_blocks(
                spec.sliding_window, spec.block_size, cfg.max_model_len, cfg.max_model_len
            )
            blocks = min(blocks, cap)
        total += blocks + 1
    return total


def _first_admission(ctx: CheckContext) -> tuple[str, ScheduleResult, int, int] | None:
    """(request, its result, the budget left it, requests the step queues) of the
    operation's first admission decision, when the pool was idle at its turn; else None."""
    op, obs = ctx.op, ctx.obs
    if isinstance(op, Schedule) and isinstance(obs, ScheduleResult):
        results: tuple[tuple[str, ScheduleResult], ...] = ((op.rid, obs),)
        budget, queued = op.budget, 1
    elif isinstance(op, Step) and isinstance(obs, StepResult):
        if obs.preempted:
            return None
        results, budget, queued = obs.results, op.budget, len(op.rids)
    else:
        return None
    turn = None
    for rid, r in results:
        if r.hit is not None:
            if not (r.admitted or r.external):
                turn = (rid, r, budget, queued)
            break
        if r.scheduled or r.new_blocks or r.external:
            return None  # a request before it took tokens or blocks
    if turn is None:
        return None
    busy = not ctx.delta.idle_before if ctx.delta is not None else any(r > 0 for r in ctx.before.ref_cnt)
    return None if busy else turn


def _need(
    ctx: CheckContext, rid: str, obs: ScheduleResult, budget: int, queued: int
) -> tuple[int, bool] | None:
    """Blocks `rid`'s admission needs on an idle pool (see `fitting_request_admitted`), and
    whether its external tokens supersede a local Mamba (align) hit; None when the budget
    allows it nothing."""
    cfg = ctx.config
    hit, hit_blocks = obs.hit or 0, obs.hit_blocks or ()
    req = ctx.history.requests[rid]
    num_tokens = len(req.tokens)
    ext = external_tokens(req.offered, num_tokens, hit) if req.offered else 0
    start = hit + ext
    todo = num_tokens - start
    k = ctx.draft_blocks  # the drafts a step verifies (num_spec_tokens)
    pad = padded_admission(todo, k, start, False, False)
    if pad and 1 + pad > budget:
        return None  # vLLM prefers not scheduling to scheduling unpadded
    n = min(capped(todo + pad, long_prefill_cap(cfg.long_prefill_token_threshold, queued)), budget)
    if cfg.has_mamba_align:
        threshold = cfg.long_prefill_token_threshold
        n = mamba_chunk(
            start=start,
            num_new=n,
            budget=min(budget, threshold) if threshold else budget,
            num_prompt_tokens=len(req.prompt),
            num_tokens=num_tokens,
            shared_prefix_boundary=obs.shared_prefix_boundary or 0,
            block_size=cfg.scheduler_block_size,
            eagle=cfg.eagle_drop,
            fine_hash_block_size=cfg.hash_block_size if fine_hits_enabled(cfg) else 0,
        )
    if pad and 0 < n != 1 + pad:
        n = 1  # a Mamba split clipped the padding: dropped
    if n <= 0:
        return None
    resumes = hit > 0 or ext > 0
    # After external tokens a Mamba chunk ending in the external state's block keeps one state.
    chunk_end = start + n if ext else None
    need = _blocks(cfg, hit_blocks, start, start + n + cfg.num_lookahead_tokens, resumes, k, chunk_end)
    if ext:
        # An async load: the computed tokens' blocks (a Mamba group's external state alone),
        # and one decode step's slots left free.
        step = 1 + k + cfg.num_lookahead_tokens if k else 0
        reserve = sum(cdiv(step, g.block_size) for g in cfg.groups if g.kind != "mamba") if step else 0
        need = max(need, _blocks(cfg, hit_blocks, start, start, resumes, k, start) + reserve)
    # The local Mamba hit an external state supersedes (vLLM counts it: `model.machine.connector`).
    superseded = bool(ext) and any(
        spec.kind == "mamba" and spec.mamba_cache_mode == "align" and any(hits)
        for spec, hits in zip(cfg.groups, hit_blocks)
    )
    # Fine-grained hits: a private copy per group whose hit ends inside a block.
    return need + sum(1 for g, hits in zip(cfg.groups, hit_blocks) if hits and hit % g.block_size), superseded


def _blocks(
    cfg: Config,
    hit_blocks: tuple[tuple[int, ...], ...],
    start: int,
    slots: int,
    resumes: bool,
    drafts: int,
    chunk_end: int | None = None,
) -> int:
    """Blocks a request computing from `start` holds for `slots` slots: Mamba (align) the
    new state and the state it resumes from (one block when the chunk ending at `chunk_end`
    ends in the block holding token `start - 1`, where that state is) and its draft blocks (in 'none' mode the slots'
    blocks and the draft blocks); an SWA group none wholly behind the window of its
    first computed token (nor under its hit's null entries)."""
    slots = min(slots, cfg.max_model_len)
    total = 0
    for g, spec in enumerate(cfg.groups):
        if spec.kind == "mamba" and spec.mamba_cache_mode == "align":
            one = (
                chunk_end is not None and (start - 1) // spec.block_size == (chunk_end - 1) // spec.block_size
            )
            total += 1 + (resumes and not one) + drafts
            continue
        first = 0
        if spec.kind == "swa":
            assert spec.sliding_window is not None
            first = max(0, start - spec.sliding_window + 1) // spec.block_size
            held = hit_blocks[g] if g < len(hit_blocks) else ()
            first = min(first, next((i for i, b in enumerate(held) if b), first))
        # A Mamba group in 'none' mode counts its draft state blocks as tokens (`model.machine.mamba_states`).
        drafted = drafts if spec.kind == "mamba" else 0
        total += max(cdiv(slots, spec.block_size) - first, 0) + drafted
    return total
