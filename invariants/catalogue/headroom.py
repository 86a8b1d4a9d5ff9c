"""Headroom: an admission the watermark binds leaves the watermark's blocks free."""

from __future__ import annotations

from invariants.catalogue.context import CheckContext
from model.contract.observation import StepResult
from model.policy.admission import watermark_blocks


def admission_keeps_watermark(ctx: CheckContext) -> list[str]:
    """An admission made while a request runs leaves at least `watermark_blocks` blocks
    free (`SchedulerConfig.watermark`: headroom kept for the running requests' next
    tokens; vLLM `KVCacheManager.allocate_slots` admits a WAITING or PREEMPTED request only
    if its blocks plus the watermark fit, while `has_scheduled_reqs`). A gate that counts
    fewer blocks than the admission takes hands the headroom out (finding
    vllm-mamba-external-state-uncounted-watermark: a Mamba external state left uncounted).

    Judged at a `Step` that admitted a request (scheduled tokens) while a request was
    running: one the step leaves running without having admitted it (it ran all through
    the step), or one the step reached before (a running one it did not preempt, or an
    earlier admission). The watermark bound that admission and every later one of the
    step, so the free queue when the operation ends (frees after the admissions only add
    to it) holds at least the watermark. Not judged: a `Schedule` (a one-request step:
    nothing else runs in it), a step whose queues are not observed and reached no running
    request first, a pinned tier."""
    wm = watermark_blocks(ctx.config.watermark, ctx.config.num_blocks)
    if not wm or ctx.config.pin_swa_on_drop:
        return []
    if isinstance(ctx.obs, StepResult):
        reached, preempted = ctx.obs.results, set(ctx.obs.preempted)
    else:  # a `Schedule`: nothing else runs in its step
        return []
    admitted = {rid for rid, res in reached if res.admitted}
    # One left running that this step did not admit ran all through it.
    queues = ctx.obs.queues
    running, bound = queues is not None and bool(set(queues.running) - admitted), None
    for rid, res in reached:
        if res.admitted and res.scheduled > 0 and res.new_blocks is not None:
            if running:
                bound = (rid, res)
            running = True
        elif not res.admitted and res.hit is None and rid not in preempted:
            running = True
    if bound is None:
        return []
    free = ctx.delta.free_len if ctx.delta is not None else len(ctx.after.free_queue)
    if free >= wm:
        return []
    rid, res = bound
    return [
        f"admission of {rid} ({res.external} external tokens) while a request ran left {free} free block(s), "
        f"below the watermark's {wm}"
    ]
