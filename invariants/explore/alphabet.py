"""The operation alphabet of a state: every operation the search tries from it.

Generated from the model's own state, in a fixed order (so a search is
deterministic and its first counterexample is the same on every run):

1. `add` of a fresh request (`r0`, `r1`, ... in order of arrival) while fewer
   than `max_requests` are live, with each prompt of the instance: for each
   prompt length L, the first L tokens of a fixed 2-token sequence and the same
   with its last token flipped (a shared prefix that diverges at the end); on an
   instance with `tenants`, each prompt also under each of `IDENTITIES` (two
   tenants' salts, an adapter pair, an image, and a tenant with an image:
   `model.contract.extra_keys`), so the same tokens meet under other identities;
2. per live request, in arrival order: `schedule` with each budget (on a real
   scheduler, `real_scheduler`: the one-request `step` the checker sends it
   instead, so the same transition is not tried twice), `sample` of each token,
   `preempt`, `finish` (an abort, waiting or running);
   where the model speculates (`num_spec_tokens` k > 0: a real scheduler with
   lookahead slots), two more samples: one proposing k drafts, and one accepting
   every draft its step verified (when it verified any) and proposing k again;
   where the configuration has a KV connector (`model.machine.connector`), one offer
   size (the request's whole token count) loaded "sync" and "async" for a request
   waiting for admission, and `save` (its free deferred until `saved`);
3. a batched `step` over every live request that may run (arrival order: vLLM's
   FCFS queue) with each budget;
4. with a KV connector: per load in flight (finished ones held for it included)
   its report, ok and failed; right after a step that ran a sync load, its report
   failing on the first block it may fail on; per pending save its report;
5. `probe` of the two longest prompts, `reset`, and `evict` of each block that
   carries a hash (blocks without one: `evict` is a no-op there).

Every operation passes `Checker.validate`; those it rejects are dropped. An
instance with a `vocabulary` offers that, in its order, instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from invariants.explore.instances import Instance
from invariants.harness.engine_step import engine_step
from model.contract.ops import (
    LOAD_MODES,
    AddRequest,
    EvictBlocks,
    Finish,
    Loaded,
    Offer,
    Op,
    Preempt,
    Probe,
    ResetPrefixCache,
    Sample,
    Save,
    Saved,
    Schedule,
    Step,
)
from model.machine.allocator import AllocatorModel
from model.machine.failed_blocks import failable_blocks
from model.policy.scheduling import build_budget
from model.policy.spec_decode import acceptable

TOKENS = (1, 2)
# The identities an instance with `tenants` adds each prompt under: two tenants, one adapter
# pair, an image over the second and third tokens, and a tenant with that image.
IMAGE = (("img-a", 1, 2),)
IDENTITIES: tuple[dict[str, Any], ...] = (
    {"salt": "tenant-a"},
    {"salt": "tenant-b"},
    {"lora": ("adapter-x", 1, "/lora/x")},
    {"lora": ("adapter-y", 2, "/lora/y")},
    {"mm": IMAGE},
    {"salt": "tenant-a", "mm": IMAGE},
)
# The shared sequence prompts are cut from: both tokens early, repeats later.
_BASE = (1, 2, 1, 1, 2, 2, 1, 2, 2, 1, 1, 1, 2, 1, 2, 2)


def prompts(instance: Instance) -> list[tuple[int, ...]]:
    """The prompts `add` offers: per length, the shared cut and its flipped twin."""
    out: list[tuple[int, ...]] = []
    for n in instance.prompt_lengths:
        base = _BASE[:n] if n <= len(_BASE) else _BASE + (1,) * (n - len(_BASE))
        for p in (base, base[:-1] + (3 - base[-1],)):
            if p not in out:
                out.append(p)
    return out


def rid_name(n: int) -> str:
    """The name of the n-th request a path adds (zero-padded: arrival order is name order)."""
    return f"r{n:02d}"


def alphabet(
    instance: Instance,
    model: AllocatorModel,
    next_rid: int,
    valid: Callable[[Op], bool],
    real_scheduler: bool = False,
    engine: bool = False,
) -> list[Op]:
    """Every operation to try from this state, in the module docstring's order (`engine`:
    the target's engine decides every step, `engine_alphabet`)."""
    if instance.vocabulary:
        return [op for op in instance.vocabulary if valid(op)]
    if engine:
        return engine_alphabet(instance, model, next_rid, valid)
    reqs = model.requests
    connector = instance.config.kv_connector
    ops: list[Op] = []
    if len(reqs) < instance.max_requests:
        kinds = ({}, *IDENTITIES) if instance.tenants else ({},)
        ops += [AddRequest(rid_name(next_rid), p, **kw) for p in prompts(instance) for kw in kinds]
    ready = tuple(rid for rid, r in reqs.items() if not (r.running and r.num_computed >= r.num_tokens))
    for rid, r in reqs.items():
        if r.running and r.num_computed >= r.num_tokens:
            ops += _samples(model, rid)
        elif not real_scheduler:
            ops += [Schedule(rid, b) for b in instance.budgets]
        elif ready != (rid,):  # the batched step below is this very step
            ops += [Step((rid,), b) for b in instance.budgets]
        if r.running:
            ops.append(Preempt(rid))
        ops.append(Finish(rid))
        if connector:
            ops += [Offer(rid, r.num_tokens, mode) for mode in LOAD_MODES]
            ops.append(Save(rid))
    if ready:  # one request too: a step's failure path (preempt and retry) is its own
        ops += [Step(ready, b) for b in instance.budgets]
    if connector:
        ops += _reports(model)
    ops += [Probe(p) for p in sorted(prompts(instance), key=len)[-2:]]
    ops.append(ResetPrefixCache())
    ops += [EvictBlocks((b,)) for b in sorted(model.pool.primary)]
    return [op for op in ops if valid(op)]


def engine_alphabet(
    instance: Instance, model: AllocatorModel, next_rid: int, valid: Callable[[Op], bool]
) -> list[Op]:
    """What an engine core and its clients may do next, where the engine decides every
    step (`TargetFeatures.engine_steps`: kvretain writes nothing of the scheduler): an
    arrival (each prompt, as `alphabet`'s adds); per live request its samples once it
    computed all its tokens (with drafts where the model speculates), its abort, and with
    a KV connector an offer (sync, async) and a save; the engine's one step, over every
    live request in the queue order the model predicts (`AllocatorModel.engine_queues`)
    with the budget it was built with (`build_budget`), offered only while no request
    awaits its sample (the engine delivers a step's output before its next step); the
    connector's reports; a probe of the two longest prompts, `reset` and `evict`, as
    `alphabet` (read-outs and cache resets a client may ask). No per-request step, no
    budget per step, no `Preempt` (vLLM preempts under pool pressure only)."""
    reqs = model.requests
    connector = instance.config.kv_connector
    ops: list[Op] = []
    if len(reqs) < instance.max_requests:
        kinds = ({}, *IDENTITIES) if instance.tenants else ({},)
        ops += [AddRequest(rid_name(next_rid), p, **kw) for p in prompts(instance) for kw in kinds]
    for rid, r in reqs.items():
        if r.running and r.num_computed >= r.num_tokens:
            ops += _samples(model, rid)
        ops.append(Finish(rid))
        if connector:
            ops += [Offer(rid, r.num_tokens, mode) for mode in LOAD_MODES]
            ops.append(Save(rid))
    step = engine_step(model, build_budget(instance.config))
    if step is not None:
        ops.append(step)
    if connector:
        ops += _reports(model)
    ops += [Probe(p) for p in sorted(prompts(instance), key=len)[-2:]]
    ops.append(ResetPrefixCache())
    ops += [EvictBlocks((b,)) for b in sorted(model.pool.primary)]
    return [op for op in ops if valid(op)]


def _samples(model: AllocatorModel, rid: str) -> list[Op]:
    """`rid`'s samples: each token; where the model speculates, with k drafts proposed,
    and with every verified draft accepted."""
    ops: list[Op] = [Sample(rid, t) for t in TOKENS]
    k = model.num_spec_tokens
    if k:
        drafts = (TOKENS[-1],) * k
        ops.append(Sample(rid, TOKENS[0], 0, drafts))
        verified = acceptable(model.requests[rid].verifying)
        if verified:
            ops.append(Sample(rid, TOKENS[0], verified, drafts))
    return ops


def _reports(model: AllocatorModel) -> list[Op]:
    """A KV connector's reports: each load in flight ok and failed, a sync load failing
    on its first failable block, each pending save done."""
    ops: list[Op] = []
    loading = [rid for rid, r in model.requests.items() if r.load == "loading"] + sorted(model.held)
    for rid in loading:
        ops += [Loaded(rid, True), Loaded(rid, False)]
    report = model.sync_report
    for rid in report.loads if report is not None else ():
        req = model.requests.get(rid)
        blocks = failable_blocks(model, req) if req is not None else []
        if blocks:
            ops.append(Loaded(rid, True, (blocks[0],)))
    ops += [Saved(rid) for rid in sorted(model.sending)]
    return ops


def op_kind(op: Op) -> str:
    """The certificate's name for `op`'s kind: its class, with drafts, a load mode or a
    failure named (what the alphabet exercised, `Certificate.op_kinds`)."""
    kind = type(op).__name__
    if isinstance(op, Sample) and (op.drafts or op.accepted):
        return f"{kind}+drafts"
    if isinstance(op, Offer):
        return f"{kind}({op.load})"
    if isinstance(op, Loaded):
        return f"{kind}({'failed' if not op.ok else 'failed blocks' if op.invalid else 'ok'})"
    return kind
