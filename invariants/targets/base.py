"""The target protocol: one adapter shape over every allocator under test.

A target wraps one allocator (the executable model, `reference_impl`, vLLM, or a
user's fork) configured from a `model.config.Config`. It applies operations
from `model.ops` and reports, for each, an `Observation` and (on request) a
`Snapshot` of observable state. The state machine drives the model and a
target with the same operations and demands equal observations and snapshots.

Contract for implementers:
- `__init__(config)` raises `model.config.ConfigError` for a configuration the
  allocator rejects, and `TargetUnavailable` when its allocator cannot be
  imported (one line saying what is missing).
- `apply(op)` never raises for a well-formed operation sequence (one where
  rids are added before they are scheduled, finish/preempt name known
  requests); an internal allocator error is re-raised as `TargetCrash`.
- `snapshot()` is cheap enough to call after every operation on a small pool,
  and drains the KV events emitted since the previous call.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from model.config import Config
from model.observation import Observation, Snapshot
from model.ops import Op


class TargetUnavailable(RuntimeError):
    """The allocator behind a target cannot be imported or started."""


class TargetCrash(RuntimeError):
    """The allocator raised while applying a well-formed operation."""


@runtime_checkable
class Target(Protocol):
    name: str
    config: Config

    def apply(self, op: Op) -> Observation: ...

    def snapshot(self) -> Snapshot: ...
