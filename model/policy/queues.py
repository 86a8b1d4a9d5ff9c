"""The order a scheduler step leaves its queues in: vLLM 0.33.0 `Scheduler.schedule`, FCFS.

A step over the requests `rids` starts with three queues (`Queues`): `running`
(its running requests, in `rids` order), `holding` (vLLM's
`kv_holding_waiting`: waiting requests that hold blocks, a connector's async
load, in `rids` order) and `waiting` (the others). It leaves them as follows
(`vllm/v1/core/sched/scheduler.py`, `request_queue.py` `FCFSRequestQueue`):

- **Preemption** (running pass). A request whose allocation fails preempts
  the last running request (`preempted_req = self.running.pop()`), and
  `_preempt_request` puts it at the front of `waiting`
  (`self.waiting.prepend_request(request)`): the later a request was
  preempted, the earlier it waits. `running` keeps its order.
- **Admission** (waiting pass, only in a step that preempted nobody). The
  pass drains `holding` first, then `waiting`, front to back. An admitted
  request leaves its queue for the back of `running`
  (`request_queue.pop_request()`, `self.running.append(request)`).
- **Skip.** A request the pass passes over (its load has not reported, or it
  was just admitted to an async load) leaves its queue (`skip_request`) and
  comes back, when the pass ends, to the front of `holding` if it holds
  blocks (`_holds_kv_blocks`: computed tokens, or a load in flight) and of
  `waiting` otherwise, the skipped requests of each queue in the order they
  were skipped (`step_skipped_*.appendleft`, then `prepend_requests`, which
  reverses them back), ahead of the requests the pass never reached.
  The queue is the one the request holds blocks for *at skip time*: a
  request admitted to an async load moves from `waiting` to `holding`.
- **Stop.** The request the pass stops at (its allocation failed, its chunk
  rounds to nothing) stays where it was (`peek_request`, then `break`), and
  so does every request after it.

In kvretain's operations every request the pass skips holds blocks (a load in
flight), so the skipped requests it generates all come back to `holding`; the
rule for `waiting` (a grammar still compiling, a preempted request's stale
output in flight under async scheduling, a LoRA limit) is stated, not exercised.

Between steps (`QueueOrder`) vLLM's `running`, `kv_holding_waiting` and
`waiting` hold the requests of the latest step in the order it left them, then
the requests it left aside in their previous order (a directed step runs
`schedule()` on its requests and puts the others back behind them; an engine's
own step names every request, so nothing is aside): the order the connector's
failed-block cut scans (`model.machine.connector`). A request that arrives joins the back
of `waiting` (`Scheduler.add_request`: `self.waiting.add_request`); one preempted
between steps (`Preempt`: `reset_prefix_cache(reset_running_requests=True)`)
leaves `running` for the front of `waiting` (`_preempt_request`: `prepend_request`).
A request leaves every queue when it finishes. `QueueOrder.engine_order` is the
whole order, which an engine's next step starts from.

Before vLLM 0.31 there is no `kv_holding_waiting`: a target of such a release
reports every waiting request in `waiting` (no connector runs there: nothing
holds blocks while it waits). Priority scheduling is not stated (kvretain
never sets a priority).

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
