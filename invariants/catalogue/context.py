"""What an invariant sees: the operation, the target's observation, the
snapshots before and after it, and a history the state machine keeps from the
target's own observations (never from the model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from model.config import Config
from model.observation import BlockKey, Observation, ProbeResult, Snapshot, Tokens
from model.ops import Op


@dataclass
class RequestHistory:
    prompt: Tokens
    outputs: list[int] = field(default_factory=list)
    num_computed: int = 0
    running: bool = False
    ever_preempted: bool = False
    boundaries: set[int] = field(default_factory=set)

    @property
    def tokens(self) -> Tokens:
        return self.prompt + tuple(self.outputs)


@dataclass
class History:
    """Facts accumulated over the trace, for properties that need the past.

    - `free_tick[b]`: the step at which block b last entered the regular queue;
    - `evicted_in_place`: free blocks whose hashes `evict_blocks` dropped where
      they stood (vLLM leaves them in place; they are exempt from ordering);
    - `ever_cached`: every key seen in any snapshot;
    - `shadow`: the hash map as an event consumer rebuilds it (key -> holders);
    - `requests`: every request ever added (finished ones too).
    """

    tick: int = 0
    free_tick: dict[int, int] = field(default_factory=dict)
    evicted_in_place: set[int] = field(default_factory=set)
    ever_cached: set[BlockKey] = field(default_factory=set)
    shadow: dict[BlockKey, int] = field(default_factory=dict)
    requests: dict[str, RequestHistory] = field(default_factory=dict)
    finished: dict[str, RequestHistory] = field(default_factory=dict)

    def all_requests(self) -> list[RequestHistory]:
        return list(self.requests.values()) + list(self.finished.values())


@dataclass
class CheckContext:
    config: Config
    op: Op
    obs: Observation
    before: Snapshot
    after: Snapshot
    history: History
    probe: Callable[[Tokens], ProbeResult] | None = None
    finished_request: RequestHistory | None = None

    @property
    def alignment(self) -> int:
        return self.config.scheduler_block_size
