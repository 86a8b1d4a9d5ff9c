"""The executable model as a target: the spec judged by its own invariants.

Fuzzing `--target model` checks the catalogue against the specification itself
(every invariant must hold of what the model allows); it is also the stand-in
allocator for `gpu_check` when no other target is wanted.
"""

from __future__ import annotations

from model.allocator import AllocatorModel
from model.config import Config
from model.observation import Observation, Snapshot
from model.ops import Op


class ModelTarget:
    name = "model"

    def __init__(self, config: Config, events: str = "seed") -> None:
        self.config = config
        self._model = AllocatorModel(config, events=events)

    def apply(self, op: Op) -> Observation:
        return self._model.apply(op)

    def snapshot(self) -> Snapshot:
        return self._model.snapshot()
