"""The forward pass gpu_check attaches to the scheduler loop: the hybrid model over the target's block ids.

`ForwardPass` is both the loop's executor and one of its observers
(`invariants.simulate.loop`): the loop decides what runs, the target decides
every hit and block id, and this module only computes. Each step it reads the
block tables from `snapshot()`, runs every scheduled chunk in one batch, and
hands each request that computed all its known tokens its greedy token.

Poisoning, so that a stale read cannot hide: every block a `Schedule` hands
out is filled with NaN before it is written, and after every operation every
block with ref count 0 and no hash is filled with NaN (freed without a hash:
its content may never be read again). Null block 0 stays NaN forever.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from gpu_check.hybrid import EngineFault, HybridModel, PagedStorage, SeqChunk
from invariants.simulate.loop import LoopConfig, Observer, Request, ScheduledChunk
from invariants.targets.base import Target
from model.contract.observation import BlockRemoved, Observation, ScheduleResult, Snapshot
from model.contract.ops import AddRequest, Op, Sample

# gpu_check's scheduler: a small batch so steps mix prefill and decode of several requests.
GPU_CHECK_LOOP = LoopConfig(token_budget=48, max_running=4, max_steps=20_000)


class OutputObserver(Protocol):
    """Sees every layer's output and every sampled token (the equivalence runner's recorder)."""

    def on_tokens(self, step: int, chunks: list[SeqChunk], layer_out: torch.Tensor) -> None: ...

    def on_sample(self, step: int, rid: str, position: int, token: int) -> None: ...


@dataclass
class StorageFigures:
    """What the forward pass saw of the pool: evictions, blocks handed out, pinned tier size, batch sizes."""

    evictions: int = 0
    blocks_handed_out: int = 0
    max_pinned: int = 0
    batch_sizes: set[int] = field(default_factory=set)


class ForwardPass(Observer):
    """Runs `model` over paged storage indexed by `target`'s block ids; see the module docstring."""

    def __init__(self, target: Target, model: HybridModel, outputs: OutputObserver | None = None) -> None:
        self.target = target
        self.model = model
        self.outputs = outputs
        self.num_blocks = target.config.num_blocks
        self.storage: PagedStorage = model.new_storage(self.num_blocks)
        self.clean_poisoned: set[int] = set(range(self.num_blocks))  # NaN and not written since
        self.figures = StorageFigures()
        self.ops: list[Op] = []  # every operation, in order: the trace of this run
        self._step = 0
        self._next_tokens: dict[str, int] = {}

    # ----------------------------------------------------------- observer
    def before_op(self, op: Op) -> None:
        self.ops.append(op)

    def after_op(self, op: Op, obs: Observation) -> None:
        if isinstance(op, (AddRequest, Sample)):
            return  # neither frees nor hands out a block
        handed: list[int] = []
        if isinstance(obs, ScheduleResult) and obs.new_blocks:
            handed = [b for grp in obs.new_blocks for b in grp if b]
        self._poison(self.target.snapshot(), handed)

    def on_sample(self, req: Request, position: int, token: int) -> None:
        if self.outputs is not None:
            self.outputs.on_sample(self._step, req.rid, position, token)

    def _poison(self, snap: Snapshot, handed: list[int]) -> None:
        if handed:
            self.storage.poison(handed)
            self.clean_poisoned.update(handed)
            self.figures.blocks_handed_out += len(handed)
        stale = [
            b
            for b in range(1, self.num_blocks)
            if snap.ref_cnt[b] == 0 and b not in snap.block_hash and b not in self.clean_poisoned
        ]
        if stale:
            self.storage.poison(stale)
            self.clean_poisoned.update(stale)
        self.figures.evictions += sum(1 for e in snap.events if isinstance(e, BlockRemoved))
        self.figures.max_pinned = max(self.figures.max_pinned, len(snap.pinned_queue))

    # ----------------------------------------------------------- executor
    def compute(self, step: int, batch: Sequence[ScheduledChunk]) -> None:
        self._step = step
        snap_tables = self.target.snapshot().tables
        chunks = []
        for c in batch:
            tables = snap_tables.get(c.req.rid)
            if tables is None:
                raise EngineFault(f"request {c.req.rid} was scheduled but has no block table in the snapshot")
            tokens = c.req.all_tokens
            chunks.append(SeqChunk(c.req.rid, tokens, c.start, c.end, tables, c.end == len(tokens)))
        res = self.model.forward(chunks, self.storage)
        self.clean_poisoned.difference_update(res.written_blocks)
        self.figures.batch_sizes.add(int(res.layer_out.shape[0]))
        if self.outputs is not None:
            self.outputs.on_tokens(step, chunks, res.layer_out)
        self._next_tokens = res.next_tokens

    def sampled(self, req: Request) -> int | None:
        return self._next_tokens.get(req.rid)
