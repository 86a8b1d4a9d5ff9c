"""The judge's loop: apply one operation to the model and to a target, compare
what they observed, then run every invariant on the target's state.

A `Violation` is either a differential finding (`observation`, `snapshot`,
`crash`: the target disagrees with the model) or a named invariant from the
catalogue that the target's state breaks.
"""

from __future__ import annotations

from dataclasses import dataclass

from invariants.catalogue import CheckContext, History, check_all, update_history
from invariants.targets.base import Target
from model.allocator import AllocatorModel
from model.observation import ProbeResult, diff_snapshots
from model.ops import AddRequest, EvictBlocks, Finish, Op, Preempt, Probe, Sample, Schedule


@dataclass(frozen=True)
class Violation:
    check: str
    message: str

    def __str__(self) -> str:
        return f"{self.check}: {self.message}"


class InvalidOp(ValueError):
    """An operation that a well-formed trace never contains at this point."""


class Checker:
    def __init__(
        self, target: Target, *, check_invariants: bool = True, audit_every: int | None = None
    ) -> None:
        self.target = target
        self.config = target.config
        self.model = AllocatorModel(target.config, events=getattr(target, "event_profile", "seed"))
        self.history = History()
        self.check_invariants = check_invariants
        self.audit_every = audit_every
        self.last = self.target.snapshot()
        self.model.snapshot()
        self.ops: list[Op] = []
        self.last_obs: object = None

    def validate(self, op: Op) -> None:
        reqs = self.model.requests
        rid = getattr(op, "rid", None)
        if isinstance(op, AddRequest):
            if op.rid in reqs:
                raise InvalidOp(f"add: request {op.rid!r} already exists")
            if not op.prompt:
                raise InvalidOp(f"add: request {op.rid!r} has an empty prompt")
        elif isinstance(op, (Schedule, Sample, Finish, Preempt)) and rid not in reqs:
            raise InvalidOp(f"{type(op).__name__.lower()}: unknown request {rid!r}")
        if isinstance(op, Schedule):
            r = reqs[op.rid]
            if r.running and r.num_computed >= r.num_tokens:
                raise InvalidOp(f"schedule: {op.rid!r} computed every known token; it needs a sample first")
            if r.num_tokens >= self.config.max_model_len:
                raise InvalidOp(f"schedule: {op.rid!r} reached max_model_len")
        elif isinstance(op, Sample):
            r = reqs[op.rid]
            if not r.running or r.num_computed != r.num_tokens:
                raise InvalidOp(f"sample: {op.rid!r} is not waiting for a sampled token")
        elif isinstance(op, Preempt) and not reqs[op.rid].running:
            raise InvalidOp(f"preempt: {op.rid!r} is not running")
        elif isinstance(op, Probe) and not op.tokens:
            raise InvalidOp("probe: empty token list")
        elif isinstance(op, EvictBlocks) and any(not 0 < b < self.config.num_blocks for b in op.block_ids):
            raise InvalidOp(f"evict: block ids must be in 1..{self.config.num_blocks - 1}")

    def step(self, op: Op) -> list[Violation]:
        self.validate(op)
        self.ops.append(op)
        expected_obs = self.model.apply(op)
        expected = self.model.snapshot()
        try:
            obs = self.target.apply(op)
            snap = self.target.snapshot()
        except Exception as exc:  # the target crashing is itself a finding
            return [Violation("crash", f"{type(exc).__name__}: {exc}")]
        self.last_obs = obs
        found: list[Violation] = []
        if obs != expected_obs:
            found.append(Violation("observation", f"model {expected_obs}, {self.target.name} {obs}"))
        found += [Violation("snapshot", line) for line in diff_snapshots(expected, snap)]
        finished = self.history.requests.get(op.rid) if isinstance(op, Finish) else None
        before = self.last
        anomalies = update_history(self.history, op, obs, before, snap)
        found += [Violation("events_match_hash_map", a) for a in anomalies]
        if self.check_invariants:
            ctx = CheckContext(self.config, op, obs, before, snap, self.history, self._probe, finished)
            found += [Violation(name, msg) for name, msg in check_all(ctx)]
        self.last = snap
        return found

    def _probe(self, tokens: tuple[int, ...]) -> ProbeResult:
        result = self.target.apply(Probe(tokens))
        assert isinstance(result, ProbeResult)
        return result
