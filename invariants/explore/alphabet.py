"""The operation alphabet of a state: every operation the search tries from it.

Generated from the model's own state, in a fixed order (so a search is
deterministic and its first counterexample is the same on every run):

1. `add` of a fresh request (`r0`, `r1`, ... in order of arrival) while fewer
   than `max_requests` are live, with each prompt of the instance: for each
   prompt length L, the first L tokens of a fixed 2-token sequence and the same
   with its last token flipped (a shared prefix that diverges at the end);
2. per live request, in arrival order: `schedule` with each budget, `sample`
   of each token, `preempt`, `finish`;
3. a batched `step` over every live request that may run (arrival order: vLLM's
   FCFS queue) with each budget;
4. `probe` of the two longest prompts, `reset`, and `evict` of each block that
   carries a hash (blocks without one: `evict` is a no-op there).

Every operation passes `Checker.validate`; those it rejects are dropped. An
instance with a `vocabulary` offers that, in its order, instead.
"""

from __future__ import annotations

from collections.abc import Callable

from invariants.explore.instances import Instance
from model.allocator import AllocatorModel
from model.ops import (
    AddRequest,
    EvictBlocks,
    Finish,
    Op,
    Preempt,
    Probe,
    ResetPrefixCache,
    Sample,
    Schedule,
    Step,
)

TOKENS = (1, 2)
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
    instance: Instance, model: AllocatorModel, next_rid: int, valid: Callable[[Op], bool]
) -> list[Op]:
    """Every operation to try from this state, in the module docstring's order."""
    if instance.vocabulary:
        return [op for op in instance.vocabulary if valid(op)]
    reqs = model.requests
    ops: list[Op] = []
    if len(reqs) < instance.max_requests:
        ops += [AddRequest(rid_name(next_rid), p) for p in prompts(instance)]
    for rid, r in reqs.items():
        if r.running and r.num_computed >= r.num_tokens:
            ops += [Sample(rid, t) for t in TOKENS]
        else:
            ops += [Schedule(rid, b) for b in instance.budgets]
        if r.running:
            ops.append(Preempt(rid))
        ops.append(Finish(rid))
    ready = tuple(rid for rid, r in reqs.items() if not (r.running and r.num_computed >= r.num_tokens))
    if ready:  # one request too: a step's failure path (preempt and retry) is its own
        ops += [Step(ready, b) for b in instance.budgets]
    ops += [Probe(p) for p in sorted(prompts(instance), key=len)[-2:]]
    ops.append(ResetPrefixCache())
    ops += [EvictBlocks((b,)) for b in sorted(model.pool.primary)]
    return [op for op in ops if valid(op)]
