"""The order a scheduler step leaves its queues in: vLLM 0.33.0 `Scheduler.schedule`, FCFS.

A step starts from three queues (`Queues`): `running`, `holding` (vLLM's
`kv_holding_waiting`: waiting requests that hold blocks) and `waiting`. It leaves them so:

- **Preemption**: a failed allocation preempts the last running request, which goes to
  the front of `waiting` (the later preempted, the earlier it waits).
- **Admission** (only in a step that preempted nobody): `holding` first, then `waiting`,
  front to back; an admitted request goes to the back of `running`.
- **Skip**: a request the pass passes over comes back, in skip order, to the front of
  `holding` if it holds blocks at skip time and of `waiting` otherwise.
- **Stop**: the request the pass stops at, and every one after it, stays where it was.

Between steps (`QueueOrder`) the queues hold the latest step's requests as it left
them, then the requests it left aside; an arrival joins the back of `waiting`, a
preemption between steps moves a request to its front, a finish removes it. The
narrative, with the vLLM lines each rule reads, is docs/semantics.md, "The queue order".

vLLM's policy, read from `Scheduler.schedule` and `FCFSRequestQueue` in vLLM 0.33.0;
predicted, no claim to be correct: a target that orders otherwise and keeps every
contract is POLICY DRIFT (docs/semantics.md, "Verdicts").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from model.contract.observation import Queues


class StepQueues:
    """The queues of one step as its passes change them (see the module docstring)."""

    def __init__(self, running: list[str], holding: list[str], waiting: list[str]) -> None:
        self.running = list(running)
        self.holding = list(holding)
        self.waiting = list(waiting)
        self._skipped_holding: list[str] = []
        self._skipped_waiting: list[str] = []

    def preempted(self, rid: str) -> None:
        """`rid` (the last running request) was preempted: to the front of `waiting`."""
        assert self.running and self.running[-1] == rid, f"{rid} is not the last running request"
        self.running.pop()
        self.waiting.insert(0, rid)

    def admitted(self, rid: str) -> None:
        """The waiting pass admitted `rid`: from its queue to the back of `running`."""
        self._leave(rid)
        self.running.append(rid)

    def skipped(self, rid: str, holds_blocks: bool) -> None:
        """The waiting pass passed `rid` over; it comes back when the pass ends."""
        self._leave(rid)
        (self._skipped_holding if holds_blocks else self._skipped_waiting).append(rid)

    def _leave(self, rid: str) -> None:
        queue = self.holding or self.waiting  # `holding` is drained first
        assert queue and queue[0] == rid, f"{rid} is not at the front of the queue the pass drains"
        queue.pop(0)

    def left(self) -> Queues:
        """The queues when the step ends: the skipped requests ahead of the unreached ones."""
        return Queues(
            tuple(self.running),
            (*self._skipped_holding, *self.holding),
            (*self._skipped_waiting, *self.waiting),
        )


class QueueOrder:
    """The order of `running` and `holding` between steps, as vLLM keeps them for the
    requests a step leaves aside (`model.machine.connector`'s failed-block cut scans them in it).

    A step (or a `Schedule`, a step of one request) over `rids` leaves its own
    requests as `StepQueues.left()` says, then the requests it left aside in their
    previous order (the harness runs `schedule()` on the step's requests and puts
    the others back behind them: `running.extend`, `kv_holding_waiting.add_request`).
    A request leaves a queue when it is preempted, finishes or is promoted to run;
    it enters one only in a step. So the order is kept lazily: `running` and
    `holding` list every request a step left there, and a reader keeps those still
    there (`live`)."""

    def __init__(self) -> None:
        self.running: list[str] = []
        self.holding: list[str] = []
        self.waiting: list[str] = []

    def arrived(self, rid: str) -> None:
        """A new request joins the back of `waiting` (a reused id's old places are gone)."""
        self.running, self.holding = self._without(self.running, rid), self._without(self.holding, rid)
        self.waiting = [*self._without(self.waiting, rid), rid]

    def preempted(self, rid: str) -> None:
        """A running request preempted between steps: from `running` to the front of `waiting`."""
        self.running = self._without(self.running, rid)
        self.waiting = [rid, *self._without(self.waiting, rid)]

    @staticmethod
    def _without(order: list[str], rid: str) -> list[str]:
        return [r for r in order if r != rid]

    def stepped(self, rids: Iterable[str], left: Queues | None) -> None:
        """A step over `rids` left its requests in the queues `left`."""
        assert left is not None, "the model's steps state their queues"
        named = set(rids)
        self.running = [*left.running, *(r for r in self.running if r not in named)]
        self.holding = [*left.holding, *(r for r in self.holding if r not in named)]
        self.waiting = [*left.waiting, *(r for r in self.waiting if r not in named)]

    def scheduled(self, rid: str, running: bool, holding: bool) -> None:
        """A `Schedule` of `rid` left it running, holding blocks, or waiting (neither)."""
        self.stepped((rid,), Queues((rid,) * running, (rid,) * holding, ()))

    @staticmethod
    def live(order: list[str], there: Callable[[str], bool]) -> list[str]:
        """The requests of `order` still in that queue (`there`), in order."""
        return [r for r in order if there(r)]

    def engine_order(self, live: Iterable[str], state: Callable[[str], str]) -> Queues:
        """Every request of `live` (in arrival order) in the queues an engine's next step
        starts from, front to back: `running`, `holding`, then `waiting` (see the module
        docstring). `state` says which queue a live request is in now ("running",
        "holding" or "waiting"); it is listed there at its place in that queue's order,
        and one the order has not placed (none, when every change went through this
        class) at that queue's back."""
        live = list(live)
        where = {rid: state(rid) for rid in live}
        queues: dict[str, list[str]] = {"running": [], "holding": [], "waiting": []}
        for name, order in (("running", self.running), ("holding", self.holding), ("waiting", self.waiting)):
            for rid in order:
                if where.get(rid) == name and rid not in queues[name]:
                    queues[name].append(rid)
        for rid in live:
            if rid not in queues[where[rid]]:
                queues[where[rid]].append(rid)
        return Queues(tuple(queues["running"]), tuple(queues["holding"]), tuple(queues["waiting"]))
