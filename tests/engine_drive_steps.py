"""Engine steps through a `Drive` (imported as `from engine_drive_steps import ...`).

A real scheduler decides every step (issue #38, "No steering"): a step names every request
vLLM holds, in the queue order the model predicts (`AllocatorModel.engine_queues`: running,
holding, then waiting), with the budget the engine was built with
(`model.policy.scheduling.build_budget`). A test reaches its scenario through real inputs
only: the configuration's `max_num_batched_tokens` is the chunk it wants, a request is added
when it should join, a `Finish` ends one instead of leaving it out of a step, and a small
pool preempts instead of a `Preempt`.

- `engine_rids`: the requests an engine's next step names, in its order.
- `engine_step`: that step, with the built budget.
- `engine_steps`: `n` of them, each after a sample for every request awaiting one (the
  tokens 1, 2, 3 in turn, as `Drive.steps` samples).
- `draft_steps`: the same on a speculating engine, each sample accepting and proposing
  drafts as a plan states.
"""

from __future__ import annotations

from drive import Drive

import invariants.harness.engine_step as shared
from model.contract.ops import Sample, Step
from model.policy.scheduling import build_budget
from model.policy.spec_decode import acceptable


def engine_rids(d: Drive) -> tuple[str, ...]:
    """Every request the model holds, in the order an engine's next step names them
    (`invariants.harness.engine_step.engine_rids`)."""
    return shared.engine_rids(d.checker.model)


def engine_step(d: Drive) -> Drive:
    """One engine step: every held request, the engine's order, the built budget."""
    return d.do(Step(engine_rids(d), build_budget(d.checker.model.cfg)))


def engine_steps(d: Drive, n: int = 1) -> Drive:
    """`n` engine steps, each after a sample for every request that awaits one."""
    for _ in range(n):
        model = d.checker.model
        for rid in engine_rids(d):
            if model.requests[rid].awaits_sample:
                d.token = d.token % 3 + 1
                d.do(Sample(rid, d.token))
        engine_step(d)
    return d


def draft_steps(d: Drive, n: int, plan: list[tuple[int, tuple[int, ...]]]) -> Drive:
    """`n` engine steps of a speculating engine; before each, every request that awaits a
    sample takes the next `(accepted, drafts)` of `plan` (consumed from the front; none left:
    no drafts), accepting at most the acceptable drafts its step verified."""
    for _ in range(n):
        model = d.checker.model
        for rid in engine_rids(d):
            r = model.requests[rid]
            if r.awaits_sample:
                accepted, drafts = plan.pop(0) if plan else (0, ())
                d.token = d.token % 3 + 1
                d.do(Sample(rid, d.token, min(accepted, acceptable(r.verifying)), drafts))
        engine_step(d)
    return d
