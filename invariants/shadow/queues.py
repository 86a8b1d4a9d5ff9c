"""The scheduler's queues, consistent after every operation.

A request the engine holds is in exactly one place: `running` (status
RUNNING), a waiting queue (`waiting`, or `kv_holding_waiting` from the
release that has it; a waiting status), or none because it finished and a KV
connector's transfer still defers its free. A finished request is in no
queue (it would be scheduled again, or hold its blocks for ever: the
leaked-request class); a queued request is one the scheduler still holds
(`requests`); no request is queued twice; a preempted request waits with
nothing computed (vLLM recomputes it from its prefix hit), unless it holds
the blocks of a connector's load (`kv_holding_waiting`: an async load
promotes a preempted request as PREEMPTED with the loaded tokens computed,
`Scheduler._handle_blocked_waiting_request`). These hold for any
scheduling policy, so they are judged on every target that exposes queues,
whatever order the policy keeps them in.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

QUEUES = "scheduler_queues_consistent"


def queue_problems(
    scheduler: Any, finished_status: Any, running_status: Any, preempted_status: Any
) -> list[str]:
    """What breaks the queue contract in `scheduler` (duck-typed: `running`,
    `waiting`, optional `kv_holding_waiting`, `requests`), one line each."""
    queues: dict[str, Iterable[Any]] = {"running": scheduler.running, "waiting": scheduler.waiting}
    holding = getattr(scheduler, "kv_holding_waiting", None)
    if holding is not None:
        queues["kv_holding_waiting"] = holding
    held = scheduler.requests
    problems: list[str] = []
    where: dict[str, str] = {}
    for name, queue in queues.items():
        for req in queue:
            rid = req.request_id
            if rid in where:
                problems.append(f"{rid} is in {where[rid]} and in {name}")
                continue
            where[rid] = name
            if finished_status(req.status):
                problems.append(f"{rid} is in {name} though it finished ({req.status.name})")
            elif held.get(rid) is not req:
                problems.append(f"{rid} is in {name} but not among the requests the scheduler holds")
            elif (name == "running") != (req.status == running_status):
                problems.append(f"{rid} is in {name} with status {req.status.name}")
            elif req.status == preempted_status and req.num_computed_tokens and name != "kv_holding_waiting":
                problems.append(
                    f"{rid} waits preempted in {name} with {req.num_computed_tokens} tokens still computed "
                    "and no blocks held for them"
                )
    for rid, req in held.items():
        if rid not in where and not finished_status(req.status):
            problems.append(f"{rid} ({req.status.name}) is held by the scheduler but in no queue")
    return problems
