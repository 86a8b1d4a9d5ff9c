"""The engine's own steps in a scripted trace (imported as `from held_steps import
held_steps`; helper E's, for the tests migrated off directed steps).

`held_steps` runs whole steps as an engine core does: every request awaiting its sample
is sampled first, then one `Step` names every request the model predicts vLLM holds, in
the order it predicts (`AllocatorModel.engine_queues`: running, holding, then waiting),
as `invariants.harness.machine`'s engine steps do. Which requests run, with which chunk,
is then the scheduler's decision under the budget it was built with.
"""

from __future__ import annotations

from drive import Drive

from model.contract.ops import Sample, Step


def held_rids(d: Drive) -> tuple[str, ...]:
    """Every request the model predicts the engine holds, in its queue order."""
    q = d.checker.model.engine_queues()
    return (*q.running, *q.holding, *q.waiting)


def held_steps(d: Drive, budget: int, n: int = 1) -> Drive:
    """`n` engine steps over every held request, each after a sample (1, 2, 3 in turn)
    for every request that awaits one; `budget` is the step's (the built one, or one
    that does not bind)."""
    for _ in range(n):
        for rid, r in list(d.checker.model.requests.items()):
            if r.awaits_sample:
                d.token = d.token % 3 + 1
                d.do(Sample(rid, d.token))
        d.do(Step(held_rids(d), budget))
    return d
