"""The live state the model keeps per request and per KV cache group.

A request (`RequestState`) is its prompt and sampled tokens, how many of them
are computed, where it runs, its drafts (`model.policy.spec_decode`) and its KV
connector load (`model.machine.connector`). A group (`GroupState`) mirrors one of
vLLM's single-type managers: its block tables (null = 0), how many leading
blocks of each have been through caching, for Mamba the previous state block
and the blocks retired, and the copies a step queues (`model.contract.fine_mamba`).
`model.machine.allocator.AllocatorModel` owns and changes both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from model.contract.config import GroupSpec
from model.contract.fine_mamba import Copy
from model.contract.observation import BlockKey
from model.contract.prefix import Tokens, grown


@dataclass
class RequestState:
    rid: str
    prompt: Tokens
    outputs: list[int] = field(default_factory=list)
    num_computed: int = 0
    running: bool = False
    shared_prefix_boundary: int = 0
    # `model.policy.spec_decode`: drafts for the next step, drafts the last step verified, vLLM `is_prefill_chunk`.
    drafts: tuple[int, ...] = ()
    verifying: tuple[int, ...] = ()
    prefill_chunk: bool = False
    # `model.machine.connector`: the offer (tokens, async), the load ("" none, LOADING, LOADED, FAILED),
    # whether its prefill is in flight, whether it waits among the requests holding blocks.
    offer: tuple[int, bool] | None = None
    load: str = ""
    prefilling: bool = False
    holding: bool = False

    # The joined tuple is kept (outputs grow, but for a dropped sample: `drop_outputs`), so
    # naming its prefixes is memoised.
    _joined: Tokens = field(default=(), init=False, repr=False, compare=False)

    def drop_outputs(self, n: int) -> None:
        """The last `n` sampled tokens taken back (a sample vLLM skipped: `model.machine.failed_blocks`)."""
        del self.outputs[len(self.outputs) - n :]
        self._joined = ()

    @property
    def tokens(self) -> Tokens:
        self._joined = grown(self.prompt, self.outputs, self._joined)
        return self._joined

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)

    @property
    def awaits_sample(self) -> bool:
        """Running with every known token and every verified draft computed."""
        return self.running and self.num_computed >= self.num_tokens + len(self.verifying)


@dataclass
class GroupState:
    gid: int
    spec: GroupSpec
    tables: dict[str, list[int]] = field(default_factory=dict)
    num_cached: dict[str, int] = field(default_factory=dict)
    last_state: dict[str, int] = field(default_factory=dict)
    retired: dict[str, int] = field(default_factory=dict)
    allocated: set[str] = field(default_factory=set)
    cached_this_step: set[BlockKey] = field(default_factory=set)
    # rid -> (table index, shared block) read only in part: the next allocation copies it.
    partial: dict[str, tuple[int, int]] = field(default_factory=dict)
    copies: list[Copy] = field(default_factory=list)  # queued this step, taken when it ends

    @property
    def bs(self) -> int:
        return self.spec.block_size

    def table(self, rid: str) -> list[int]:
        return self.tables.setdefault(rid, [])


class SyncReport(NamedTuple):
    """What the latest step's output may still report about its sync loads, until the
    next operation but the samples riding on it (`AllocatorModel.sync_report`,
    `model.machine.failed_blocks.sample_rides`): the step's admissions in order (async loads included), per sync
    load its (hit, external tokens), the requests of the step sampled since, and, with
    drafts under synchronous scheduling, their (rid, tokens appended, drafts rejected),
    whose output waits (`output_waits`)."""

    admitted: tuple[str, ...]
    loads: dict[str, tuple[int, int]]
    sampled: frozenset[str] = frozenset()
    waiting: tuple[tuple[str, int, int], ...] = ()
