"""Liveness: nothing the pool can hold is refused."""

from __future__ import annotations

from invariants.catalogue.context import CheckContext
from model.connector import external_tokens
from model.fine_mamba import fine_hits_enabled
from model.masks import cdiv
from model.observation import ScheduleResult
from model.ops import Schedule
from model.scheduling import mamba_chunk


def fitting_request_admitted(ctx: CheckContext) -> list[str]:
    """A request that fits an empty pool is always admitted: when no block is
    in use, an admission needing at most N-1 blocks never fails (no stall from
    pinned blocks or retained scratch; #40676 admission demotion). The
    blocks an admission needs include what its hit costs: the Mamba state it
    resumes from, and with fine-grained hits one private copy per group whose
    hit ends inside a block. A KV connector's standing offer moves the chunk
    past its external tokens (`model.connector`), whose blocks count too (a Mamba
    group's external state block among them); an async load's admission
    (`external`, nothing scheduled) is an admission."""
    obs, op, cfg = ctx.obs, ctx.op, ctx.config
    if not (isinstance(op, Schedule) and isinstance(obs, ScheduleResult)) or obs.hit is None or obs.admitted:
        return []
    if obs.external:
        return []
    busy = not ctx.delta.idle_before if ctx.delta is not None else any(r > 0 for r in ctx.before.ref_cnt)
    if busy:
        return []
    req = ctx.history.requests[op.rid]
    ext = external_tokens(req.offered, len(req.tokens), obs.hit) if req.offered else 0
    n = min(len(req.tokens) - obs.hit - ext, op.budget)
    if cfg.has_mamba_align:
        n = mamba_chunk(
            start=obs.hit + ext,
            num_new=n,
            budget=op.budget,
            num_prompt_tokens=len(req.prompt),
            num_tokens=len(req.tokens),
            shared_prefix_boundary=obs.shared_prefix_boundary or 0,
            block_size=cfg.scheduler_block_size,
            eagle=cfg.eagle,
            fine_hash_block_size=cfg.hash_block_size if fine_hits_enabled(cfg) else 0,
        )
    if n <= 0:
        return []
    # Mamba: the new state block, plus the hit state it resumes from or the external
    # tokens' state block, plus its draft blocks (on a request's first allocation);
    # attention groups also reserve the lookahead slots.
    slots = min(obs.hit + ext + n + cfg.num_lookahead_tokens, cfg.max_model_len)
    need = sum(
        (1 + (obs.hit > 0 or ext > 0) + ctx.draft_blocks)
        if g.kind == "mamba" and g.mamba_cache_mode == "align"
        else cdiv(slots, g.block_size)
        for g in cfg.groups
    )
    hit_blocks = obs.hit_blocks or ()
    need += sum(1 for g, hits in zip(cfg.groups, hit_blocks) if hits and obs.hit % g.block_size)
    if need <= cfg.num_blocks - 1:
        # Said apart: vLLM reserves a rolled-back load's whole sequence against its own admission.
        after = " after its failed load was rolled back" if req.rolled_back else ""
        return [
            f"admission of {op.rid} ({need} blocks) refused by an idle pool of {cfg.num_blocks - 1}{after}"
        ]
    return []
