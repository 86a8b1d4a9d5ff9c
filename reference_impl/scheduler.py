"""A minimal vLLM-shaped scheduler: one operation of docs/semantics.md per call.

Contracts:
- every `schedule` call is one scheduler step (`new_step_starts` first) for one
  request, and every `schedule_step` call one step for a batch (running
  requests first, preempting the newest on an allocation failure; admissions
  only in a step without preemption, ending at the first refusal); a waiting request is admitted with a prefix-cache lookup, a running
  one gets its next prefill chunk or a decode token;
- with a Mamba group, prefill chunks are split so that states land where they
  can be cached (vLLM `Scheduler._mamba_block_aligned_split`, simplified: no
  fine-grained hits, no internal checkpoints);
- `sample` is valid only once every known token is computed; nothing is cached
  before the next allocation;
- `finish` and `preempt` free every block of the request; a preempted request
  keeps its tokens and is re-admitted through a fresh lookup.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .kv_cache_manager import KVCacheBlocks, KVCacheManager
from .request import BlockHashListener, Request, RequestStatus

BlockIdsPerGroup = tuple[tuple[int, ...], ...]

PROBE_REQUEST_ID = "__probe__"


@dataclass(frozen=True)
class ScheduleOutcome:
    """`admitted`: this step admitted a waiting request (False for a running one).
    Admission fields are None for a request that was already running;
    `new_blocks` is None when allocation failed."""

    scheduled: int
    admitted: bool
    hit: int | None = None
    shared_prefix_boundary: int | None = None
    hit_blocks: BlockIdsPerGroup | None = None
    new_blocks: BlockIdsPerGroup | None = None


@dataclass(frozen=True)
class StepOutcome:
    """Per request the step reached, in order, its outcome; then who was preempted;
    then the step's requests left running and left waiting, each front to back."""

    outcomes: tuple[tuple[str, ScheduleOutcome], ...]
    preempted: tuple[str, ...]
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProbeOutcome:
    hit: int
    shared_prefix_boundary: int
    hit_blocks: BlockIdsPerGroup


def _ids(blocks: KVCacheBlocks) -> BlockIdsPerGroup:
    return tuple(tuple(ids) for ids in blocks.get_block_ids())


class Scheduler:
    def __init__(
        self, kv_cache_manager: KVCacheManager, on_new_block_hashes: BlockHashListener | None = None
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.config = kv_cache_manager.config
        self.requests: dict[str, Request] = {}
        self._on_new_block_hashes = on_new_block_hashes

    def _new_request(self, request_id: str, tokens: Sequence[int]) -> Request:
        return Request(request_id, tokens, self.config.hash_block_size, self._on_new_block_hashes)

    def _get(self, request_id: str) -> Request:
        try:
            return self.requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    # ------------------------------------------------------------- operations
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already exists")
        req = self._new_request(request_id, prompt_token_ids)
        self.requests[request_id] = req
        return req

    def schedule(self, request_id: str, budget: int) -> ScheduleOutcome:
        req = self._get(request_id)
        kvm = self.kv_cache_manager
        kvm.new_step_starts()
        if req.status == RequestStatus.RUNNING:
            return self._schedule_running(req, budget)
        return self._admit(req, budget, budget)

    def _admit(self, req: Request, left: int, budget: int) -> ScheduleOutcome:
        """Lookup, then the first chunk (at most `left` tokens of the step's `budget`)."""
        kvm = self.kv_cache_manager
        blocks, hit, spb = kvm.get_computed_blocks(req)
        req.shared_prefix_boundary = spb
        hit_ids = _ids(blocks)
        n = min(req.num_tokens - hit, left)
        if self.config.has_mamba:
            n = self.mamba_block_aligned_split(req, req.num_computed_tokens + hit, n, budget)
        if n <= 0:
            return ScheduleOutcome(0, False, hit, spb, hit_ids, None)
        out = kvm.allocate_slots(req, n, hit, blocks, self.config.num_lookahead_tokens)
        if out is None:
            return ScheduleOutcome(0, False, hit, spb, hit_ids, None)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = hit + n
        return ScheduleOutcome(n, True, hit, spb, hit_ids, _ids(out))

    def _schedule_running(self, req: Request, budget: int) -> ScheduleOutcome:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.config.has_mamba:
            n = self.mamba_block_aligned_split(req, req.num_computed_tokens, n, budget)
        if n <= 0:
            return ScheduleOutcome(0, False)
        out = self.kv_cache_manager.allocate_slots(
            req, n, num_lookahead_tokens=self.config.num_lookahead_tokens
        )
        if out is None:
            return ScheduleOutcome(0, False)
        req.num_computed_tokens += n
        return ScheduleOutcome(n, False, new_blocks=_ids(out))

    def schedule_step(self, request_ids: Sequence[str], budget: int) -> StepOutcome:
        """One step over a batch, FCFS: running requests first, then admissions.

        A running request that cannot get its blocks preempts the newest
        running request and retries; preempting itself ends the running pass.
        Admissions happen only in a step with no preemption, and the first
        refused admission ends them. A preempted request waits at the front of the
        waiting queue (the latest preempted first), an admitted one runs last.
        """
        kvm = self.kv_cache_manager
        kvm.new_step_starts()
        queue = [self._get(rid) for rid in request_ids]
        running = [r for r in queue if r.status == RequestStatus.RUNNING]
        waiting = deque(r for r in queue if r.status != RequestStatus.RUNNING)
        outcomes: list[tuple[str, ScheduleOutcome]] = []
        preempted: list[str] = []
        left = budget
        position = 0
        while position < len(running) and left > 0:
            req = running[position]
            n = min(req.num_tokens - req.num_computed_tokens, left)
            if self.config.has_mamba:
                n = self.mamba_block_aligned_split(req, req.num_computed_tokens, n, budget)
            if n <= 0:
                outcomes.append((req.request_id, ScheduleOutcome(0, False)))
                position += 1
                continue
            out = kvm.allocate_slots(req, n, num_lookahead_tokens=self.config.num_lookahead_tokens)
            while out is None:
                victim = running.pop()
                self.preempt(victim.request_id)
                waiting.appendleft(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
                out = kvm.allocate_slots(req, n, num_lookahead_tokens=self.config.num_lookahead_tokens)
            if out is None:
                outcomes.append((req.request_id, ScheduleOutcome(0, False)))
                break
            req.num_computed_tokens += n
            left -= n
            outcomes.append((req.request_id, ScheduleOutcome(n, False, new_blocks=_ids(out))))
            position += 1
        while not preempted and waiting and left > 0:
            req = waiting[0]
            outcome = self._admit(req, left, budget)
            outcomes.append((req.request_id, outcome))
            if not outcome.admitted:
                break
            running.append(waiting.popleft())
            left -= outcome.scheduled
        ids = tuple(r.request_id for r in running), tuple(r.request_id for r in waiting)
        return StepOutcome(tuple(outcomes), tuple(preempted), *ids)

    def sample(self, request_id: str, token_id: int) -> None:
        req = self._get(request_id)
        if req.status != RequestStatus.RUNNING or req.num_computed_tokens != req.num_tokens:
            raise ValueError(f"cannot sample for {req!r}: it must be running with every token computed")
        req.append_output_token_ids(token_id)

    def finish(self, request_id: str) -> None:
        req = self._get(request_id)
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.FINISHED
        del self.requests[request_id]

    def preempt(self, request_id: str) -> None:
        req = self._get(request_id)
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1

    def probe(self, token_ids: Sequence[int]) -> ProbeOutcome:
        req = self._new_request(PROBE_REQUEST_ID, token_ids)
        blocks, hit, spb = self.kv_cache_manager.get_computed_blocks(req)
        return ProbeOutcome(hit, spb, _ids(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.kv_cache_manager.evict_blocks(block_ids)

    # ------------------------------------------------------------ chunking
    def mamba_block_aligned_split(self, req: Request, start: int, num_new_tokens: int, budget: int) -> int:
        """Clip a prefill chunk so it ends where a Mamba state can be cached."""
        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
        if start >= prefill_end or num_new_tokens <= 0:
            return num_new_tokens
        cbs = self.config.scheduler_block_size
        end = start + num_new_tokens
        if end < prefill_end:
            aligned = end // cbs * cbs
            if aligned > start or cbs <= budget:
                end = aligned
        if self.config.use_eagle:
            last_cache_position = max(req.num_tokens // cbs * cbs - cbs, 0)
        else:
            last_cache_position = max((req.num_tokens - 1) // cbs * cbs, 0)
        junction = req.shared_prefix_boundary
        stops = (
            (start // cbs + 1) * cbs if start % cbs else 0,
            last_cache_position,
            start + (junction - start) // cbs * cbs if start < junction < end else 0,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)
