"""The shadow worker: the engine's contract, judged where the engine acts on it.

What a GPU model runner and a KV connector are told is the scheduler's
output; whatever the scheduler's policy, it is correct only if every read
the forward pass makes returns the reading request's own KV. This room holds
that judge, independent of the model: `prefixes` (the exact identity of a
token prefix, the provenance a KV slot carries), `worker` (a model runner's
bookkeeping over real `SchedulerOutput`s, writing and reading provenance),
`connector` (a KV connector's loads and saves, and what it is told, judged
against what the request holds) and `queues` (the scheduler's queues
consistent after every operation). A target
feeds it what the engine is told and hands its problems to the checker
(`Target.engine_problems`); docs/shadow-worker.md says what it follows of
vLLM's runners and what it leaves out.
"""

from invariants.shadow.connector import CONNECTOR_CHECKS, LOADS, SAVES, TOLD, ShadowConnector
from invariants.shadow.prefixes import EMPTY, PrefixIds
from invariants.shadow.queues import QUEUES, queue_problems
from invariants.shadow.worker import (
    CHECKS,
    FAILED,
    POSITIONS,
    READS,
    ZEROED,
    ShadowWorker,
    WorkerFigures,
    WorkerGroup,
)

__all__ = [
    "CHECKS",
    "CONNECTOR_CHECKS",
    "EMPTY",
    "FAILED",
    "LOADS",
    "POSITIONS",
    "QUEUES",
    "READS",
    "SAVES",
    "TOLD",
    "ZEROED",
    "PrefixIds",
    "ShadowConnector",
    "ShadowWorker",
    "WorkerFigures",
    "WorkerGroup",
    "queue_problems",
]
