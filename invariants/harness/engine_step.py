"""The engine's next step, as the model predicts it: what every driver that leaves each decision
to the engine runs (issue #38, "No steering": the Hypothesis machine, the production workload,
explore's alphabet and the tests' drives).

- `engine_rids(model)`: every request the engine holds, in the order its next step names them:
  `AllocatorModel.engine_queues`, running, then holding, then waiting, each queue front to back
  (FCFS; a preempted request at the waiting queue's front).
- `engine_step(model, budget)`: `Step(engine_rids(model), budget)`, or None where the engine
  runs no step: it holds no request, or a running request has computed all its tokens and has
  not had its sample yet (`awaiting_sample`; an engine samples from the step's output before
  its next step, so a driver samples, or finishes, such requests first).

The budget is the caller's: the one the engine was built with
(`model.policy.scheduling.build_budget`).
"""

from __future__ import annotations

from model.contract.ops import Step
from model.machine.allocator import AllocatorModel


def engine_rids(model: AllocatorModel) -> tuple[str, ...]:
    """Every request `model` holds, in the order the engine's next step names them."""
    q = model.engine_queues()
    return (*q.running, *q.holding, *q.waiting)


def awaiting_sample(model: AllocatorModel) -> bool:
    """Some running request has computed all its tokens and not had its sample yet."""
    return any(r.running and r.num_computed >= r.num_tokens for r in model.requests.values())


def engine_step(model: AllocatorModel, budget: int) -> Step | None:
    """The engine's next step with `budget` (see the module docstring); None where it runs none."""
    rids = engine_rids(model)
    if not rids or awaiting_sample(model):
        return None
    return Step(rids, budget)
