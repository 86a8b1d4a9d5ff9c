"""Driving a trace through the `Checker`: what the tests of the real schedulers and the KV
connector share (imported as `from drive import ...`; pytest puts tests/ on the path).

- `Drive`: a target and the model side by side under a Checker that audits after every
  operation; it keeps the violations no known finding explains (`found`) and the target's
  observations (`seen`), runs whole steps with the samples they need (`steps`), and ends
  with a last audit (`audited`). The target defaults to "vllm" (vLLM's real `Scheduler`).
- `async_drive`, `async_violations`: the same on "vllm-async-scheduler", judged as it.
- `check_contexts`: every context the Checker hands the catalogue, to run one invariant
  on it again (a planted corruption of that context is the invariant's negative control).
- `patched`: one name replaced until exit (a model rule reverted: a negative control).
- `own`: a request's result in a step's observation.

Nothing here imports vLLM: its targets are imported when a `Drive` first needs one, so
the model-only tests that use these helpers run without it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import invariants.harness.checker as checker_mod
from invariants.catalogue import CheckContext
from invariants.harness.checker import Checker, InvalidOp, Violation
from invariants.harness.known_findings import is_known_violation
from model.contract.config import Config
from model.contract.observation import ScheduleResult, StepResult
from model.contract.ops import Op, Sample, Step

Factory = Callable[[Config], Any]
ASYNC_SCHEDULER = "vllm-async-scheduler"


class Drive:
    """The model and a target side by side, audited after every operation.

    `found`: the violations no known finding of `known` (a target's name) explains, in
    order; `seen`: the target's observation of every operation applied. An operation the
    Checker refuses (`InvalidOp`) propagates from `do`; `attempt` ends the trace there and
    records it as an `invalid` violation (a mutant changed a request's state under it).
    """

    def __init__(self, cfg: Config, factory: Factory | None = None, known: str = "vllm") -> None:
        if factory is None:
            from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

            factory = VllmSchedulerTarget
        self.checker = Checker(factory(cfg), audit_every=1)
        self.known = known
        self.found: list[Violation] = []
        self.seen: list[object] = []
        self.token = 0  # the last token `steps` sampled (1, 2, 3 in turn)

    def do(self, *ops: Op) -> Drive:
        for op in ops:
            self.found += [v for v in self.checker.step(op) if not is_known_violation(self.known, v)]
            self.seen.append(self.checker.last_obs)
        return self

    def attempt(self, *ops: Op) -> Drive:
        """`do`, with an invalid operation found as a violation instead of raised."""
        try:
            self.do(*ops)
        except InvalidOp as exc:
            self.found.append(Violation("invalid", str(exc)))
        return self

    def audited(self) -> list[Violation]:
        """`found`, then what a last full audit finds that no known finding explains."""
        return self.found + [v for v in self.checker.audit() if not is_known_violation(self.known, v)]

    def steps(self, rids: tuple[str, ...], budget: int, n: int = 1) -> Drive:
        """`n` steps over `rids`, each after a sample for every request that computed all its tokens."""
        for _ in range(n):
            reqs = self.checker.model.requests
            for rid in rids:
                r = reqs[rid]
                if r.running and r.num_computed == r.num_tokens:
                    self.token = self.token % 3 + 1
                    self.do(Sample(rid, self.token))
            self.do(Step(rids, budget))
        return self

    @property
    def preempted(self) -> list[str]:
        return [r for obs in self.seen if isinstance(obs, StepResult) for r in obs.preempted]


def async_drive(cfg: Config, factory: Factory | None = None) -> Drive:
    """A `Drive` on vLLM's `AsyncScheduler` (or `factory`'s target), judged as
    "vllm-async-scheduler": its known findings are the ones explained."""
    if factory is None:
        from invariants.targets.vllm_async_scheduler_target import VllmAsyncSchedulerTarget

        factory = VllmAsyncSchedulerTarget
    return Drive(cfg, factory, ASYNC_SCHEDULER)


def async_violations(cfg: Config, ops: list[Op], factory: Factory | None = None) -> list[Violation]:
    """`ops` through `async_drive`: the violations no known finding explains."""
    return async_drive(cfg, factory).do(*ops).found


@contextlib.contextmanager
def check_contexts(*, copy_history: bool = False) -> Iterator[list[CheckContext]]:
    """Every context a Checker hands the catalogue (`check_all`) while open, in order.
    `copy_history`: each with its history as it stood then (the Checker updates one in place)."""
    seen: list[CheckContext] = []
    real = checker_mod.check_all

    def capture(ctx: CheckContext) -> list[tuple[str, str]]:
        seen.append(replace(ctx, history=copy.deepcopy(ctx.history)) if copy_history else ctx)
        return real(ctx)

    checker_mod.check_all = capture
    try:
        yield seen
    finally:
        checker_mod.check_all = real


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """`owner.name` is `value` until exit, then its original again."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def own(obs: object, rid: str) -> ScheduleResult:
    """`rid`'s result in the step observation `obs`."""
    assert isinstance(obs, StepResult)
    return next(r for r_id, r in obs.results if r_id == rid)
