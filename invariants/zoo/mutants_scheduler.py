"""Mutants of vLLM 0.33.0's `Scheduler` (`vllm/v1/core/sched/scheduler.py`), for the
"vllm" target: monkeypatches inside a context manager, as
`mutants_vllm` patches the allocator.

Each re-creates a plausible one-line defect of the scheduler loop that only a
target driven by the real scheduler can meet (the "vllm-manager" target re-creates the
scheduler's calls itself, so a defect in `scheduler.py` is invisible to it).
`activate(name)` patches `Scheduler`, yields the `VllmSchedulerTarget` factory
and restores every original on exit. PROCESS-GLOBAL WHILE ACTIVE: every vLLM
scheduler built in this process meanwhile is mutated.

Strategies: "scheduler" (the configurations the fuzzer generates for a real
scheduler), "scheduler-mamba" (Full+Mamba shapes only), "scheduler-spec"
(speculative decoding: drafts, accepted counts, one-token admission padding),
"scheduler-connector" (kvretain's KV connector, Full/SWA shapes),
"scheduler-connector-one-group" (the connector on one Full or SWA group: the queue order),
"scheduler-connector-mamba" (the connector with a Mamba group) and
"scheduler-connector-spec" (the connector with drafts, all shapes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from invariants.targets.base import Target
from model.contract.config import Config

from .mutants_vllm import _set

Factory = Callable[[Config], Target]


@dataclass(frozen=True)
class SchedulerMutant:
    name: str
    doc: str
    install: Callable[[contextlib.ExitStack, Any], None]
    strategy: str = "scheduler"

    @property
    def summary(self) -> str:
        return self.doc.strip().splitlines()[0]


SCHEDULER_MUTANTS: dict[str, SchedulerMutant] = {}


def mutant(
    name: str, *, strategy: str = "scheduler"
) -> Callable[[Callable[[contextlib.ExitStack, Any], None]], Any]:
    def deco(fn: Callable[[contextlib.ExitStack, Any], None]) -> Callable[[contextlib.ExitStack, Any], None]:
        SCHEDULER_MUTANTS[name] = SchedulerMutant(name, fn.__doc__ or "", fn, strategy)
        return fn

    return deco


@contextlib.contextmanager
def activate(name: str) -> Iterator[Factory]:
    """Apply scheduler mutant `name` until exit; yields the vllm target factory."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    m = SCHEDULER_MUTANTS[name]
    with contextlib.ExitStack() as stack:
        m.install(stack, Scheduler)
        yield VllmSchedulerTarget


@mutant("mamba_split_skipped", strategy="scheduler-mamba")
def mamba_split_skipped(stack: contextlib.ExitStack, sched: Any) -> None:
    """Prefill chunks are not split at Mamba block boundaries (`_mamba_block_aligned_split`
    returns the chunk unchanged, as if `need_mamba_block_aligned_split` were False)."""
    _set(stack, sched, "_mamba_block_aligned_split", lambda self, request, n, *a, **k: n)


@mutant("preempt_keeps_computed_tokens")
def preempt_keeps_computed_tokens(stack: contextlib.ExitStack, sched: Any) -> None:
    """`_preempt_request` frees the blocks but forgets `request.num_computed_tokens = 0`."""
    original = vars(sched)["_preempt_request"]

    def keeps(self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        computed = request.num_computed_tokens
        original(self, request, *args, **kwargs)
        request.num_computed_tokens = computed

    _set(stack, sched, "_preempt_request", keeps)


@mutant("preempt_oldest")
def preempt_oldest(stack: contextlib.ExitStack, sched: Any) -> None:
    """FCFS preemption pops the oldest running request (`self.running.pop(0)`) instead of
    the newest (`self.running.pop()`)."""
    original = vars(sched)["schedule"]

    class OldestFirst(list):  # type: ignore[type-arg]
        def pop(self, index: int = 0) -> Any:  # type: ignore[override]
            return super().pop(index)

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.running = OldestFirst(self.running)
        try:
            return original(self, *args, **kwargs)
        finally:
            self.running = list(self.running)

    _set(stack, sched, "schedule", schedule)


@mutant("in_flight_tokens_not_settled")
def in_flight_tokens_not_settled(stack: contextlib.ExitStack, sched: Any) -> None:
    """`update_from_output` forgets `request.num_in_flight_tokens -= num_tokens_scheduled`:
    sliding-window blocks are freed on a processed-token count that never advances."""
    original = vars(sched)["update_from_output"]

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        before = {
            rid: self.requests[rid].num_in_flight_tokens
            for rid in scheduler_output.num_scheduled_tokens
            if rid in self.requests
        }
        out = original(self, scheduler_output, model_runner_output)
        for rid, n in before.items():
            if rid in self.requests:
                self.requests[rid].num_in_flight_tokens = n
        return out

    _set(stack, sched, "update_from_output", update_from_output)


@mutant("mamba_split_ignores_hit", strategy="scheduler-mamba")
def mamba_split_ignores_hit(stack: contextlib.ExitStack, sched: Any) -> None:
    """The waiting pass's Mamba split starts at 0 instead of after the prefix-cache hit
    (`num_new_local_computed_tokens` not passed to `_mamba_block_aligned_split`)."""
    original = vars(sched)["_mamba_block_aligned_split"]

    def split(
        self: Any, request: Any, n: int, num_new_local_computed_tokens: int = 0, *a: Any, **k: Any
    ) -> int:
        return int(original(self, request, n, 0, *a, **k))

    _set(stack, sched, "_mamba_block_aligned_split", split)


# Speculative decoding (`model.policy.spec_decode`): strategy "scheduler-spec", Full/SWA shapes with drafts.


@mutant("admission_without_lookahead", strategy="scheduler-spec")
def admission_without_lookahead(stack: contextlib.ExitStack, sched: Any) -> None:
    """The waiting pass reserves no lookahead slots for drafts: `limit_lookahead_tokens =
    self.num_lookahead_tokens > 0` (the `load_kv_async and` dropped), so every admission's
    `allocate_slots` gets `num_lookahead_tokens=0`."""
    original = vars(sched)["schedule"]

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        manager = self.kv_cache_manager
        allocate = manager.allocate_slots

        def admission_without(request: Any, *a: Any, **k: Any) -> Any:
            if "new_computed_blocks" in k:  # only the waiting pass passes its hit
                k["num_lookahead_tokens"] = 0
            return allocate(request, *a, **k)

        manager.allocate_slots = admission_without
        try:
            return original(self, *args, **kwargs)
        finally:
            manager.allocate_slots = allocate

    _set(stack, sched, "schedule", schedule)


@mutant("rejected_drafts_not_rolled_back", strategy="scheduler-spec")
def rejected_drafts_not_rolled_back(stack: contextlib.ExitStack, sched: Any) -> None:
    """`update_from_output` forgets `request.num_computed_tokens -= num_rejected`: a rejected
    draft's position counts as computed, so the next step starts one draft too far."""
    original = vars(sched)["update_from_output"]

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        from dataclasses import replace

        # Without the verified drafts the rejection branch, the rollback's only home, never runs.
        blind = replace(scheduler_output, scheduled_spec_decode_tokens={})
        return original(self, blind, model_runner_output)

    _set(stack, sched, "update_from_output", update_from_output)


# ------------------------------------------------------------------ AsyncScheduler (vllm-async-scheduler)
# Mutants of the async path, run on the "vllm-async-scheduler" target: each patches
# `AsyncScheduler` (vLLM's subclass; the synchronous `Scheduler` is untouched) and
# `activate_async` yields that target's factory.
ASYNC_SCHEDULER_MUTANTS: dict[str, SchedulerMutant] = {}


def async_mutant(
    name: str, *, strategy: str = "scheduler"
) -> Callable[[Callable[[contextlib.ExitStack, Any], None]], Any]:
    def deco(fn: Callable[[contextlib.ExitStack, Any], None]) -> Callable[[contextlib.ExitStack, Any], None]:
        ASYNC_SCHEDULER_MUTANTS[name] = SchedulerMutant(name, fn.__doc__ or "", fn, strategy)
        return fn

    return deco


@contextlib.contextmanager
def activate_async(name: str) -> Iterator[Factory]:
    """Apply async-scheduler mutant `name` until exit; yields the vllm-async-scheduler target factory."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from invariants.targets.vllm_async_scheduler_target import VllmAsyncSchedulerTarget

    m = ASYNC_SCHEDULER_MUTANTS[name]
    with contextlib.ExitStack() as stack:
        m.install(stack, AsyncScheduler)
        yield VllmAsyncSchedulerTarget


@async_mutant("arrival_caches_in_flight_tokens")
def arrival_caches_in_flight_tokens(stack: contextlib.ExitStack, sched: Any) -> None:
    """`update_from_output` caches a request with output placeholders up to
    `request.num_computed_tokens` instead of `num_computed_tokens - num_in_flight_tokens`:
    a block is cached while the step that writes its last token is still in flight."""
    original = sched.update_from_output

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        manager = self.kv_cache_manager
        own = vars(manager).get("cache_blocks")
        cache_blocks = manager.cache_blocks
        manager.cache_blocks = lambda request, n: cache_blocks(request, request.num_computed_tokens)
        try:
            return original(self, scheduler_output, model_runner_output)
        finally:
            if own is None:
                del manager.cache_blocks  # the class's method again
            else:
                manager.cache_blocks = own

    _set(stack, sched, "update_from_output", update_from_output)


# ---------------------------------------------------------------------------------------------
# One-line source mutants: vLLM's own method with one line changed. `_rewrite` recompiles the
# installed method's source with `old` replaced by `new` (in the method's module, so its names
# resolve as before) and patches it in; `old` must occur exactly once, so a release that
# rewrote the line makes the mutant fail loudly instead of silently mutating nothing.


class StaleMutant(RuntimeError):
    """The line a source mutant changes is not in the installed vLLM (exactly once)."""


def _rewrite(
    stack: contextlib.ExitStack, owner: Any, method: str, old: str, new: str, source: Any = None
) -> None:
    """`owner.method` := `source.method` (default: `owner`'s own) with `old` replaced by `new`."""
    import inspect
    import linecache
    import sys
    import textwrap

    fn = vars(source or owner)[method]
    source = textwrap.dedent(inspect.getsource(fn))
    old, new = textwrap.dedent(old).strip("\n"), textwrap.dedent(new).strip("\n")
    # Match at the method's own indentation: `old` is given dedented to its first line.
    lines = [ln for ln in source.splitlines() if ln.strip()]
    found = [i for i in range(len(lines)) if _matches(lines, i, old.splitlines())]
    if len(found) != 1:
        raise StaleMutant(
            f"{owner.__name__}.{method}: {old.splitlines()[0].strip()!r} found {len(found)} times"
        )
    i = found[0]
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    width = len(old.splitlines())
    mutated = lines[:i] + [indent + ln if ln else ln for ln in new.splitlines()] + lines[i + width :]
    namespace: dict[str, Any] = {}
    module = sys.modules[fn.__module__]
    text = "\n".join(mutated) + "\n"
    filename = f"<kvretain mutant of {fn.__qualname__}>"
    # Readable by `inspect.getsource`, as the release's capability probes read the scheduler.
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    exec(
        compile(text, filename, "exec"),
        vars(module),
        namespace,
    )
    _set(stack, owner, method, namespace[method])


def _rewrite_inherited(stack: contextlib.ExitStack, sched: Any, method: str, old: str, new: str) -> None:
    """`_rewrite` of vLLM's own `Scheduler.method`, patched onto `sched` only (the
    `AsyncScheduler`, which inherits it): the synchronous scheduler keeps the original."""
    from vllm.v1.core.sched.scheduler import Scheduler

    _rewrite(stack, sched, method, old, new, source=Scheduler)


def _matches(lines: list[str], i: int, old: list[str]) -> bool:
    if i + len(old) > len(lines):
        return False
    base = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    return all(lines[i + k] == base + o for k, o in enumerate(old))


@mutant("mamba_split_budget_is_chunk", strategy="scheduler-mamba")
def mamba_split_budget_is_chunk(stack: contextlib.ExitStack, sched: Any) -> None:
    """Chunking under the token budget: the Mamba split's "block wider than the budget"
    escape compares the block with the clipped chunk (`block_size <= num_new_tokens`)
    instead of the step's token limit (`max_prefill_tokens`), so a request left less than
    a block of the step's budget runs a sub-block prefill chunk instead of waiting."""
    _rewrite(
        stack,
        sched,
        "_mamba_block_aligned_split",
        "if aligned_end > start or block_size <= max_prefill_tokens:",
        "if aligned_end > start or block_size <= num_new_tokens:",
    )


@mutant("admission_drops_hit_tokens")
def admission_drops_hit_tokens(stack: contextlib.ExitStack, sched: Any) -> None:
    """Admission with a prefix hit: the waiting pass forgets
    `request.num_computed_tokens = num_computed_tokens`, so an admitted request counts
    only its first chunk as computed, not the hit under it (no hit: nothing changes)."""
    _rewrite(
        stack,
        sched,
        "schedule",
        """
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed_tokens
        """,
        """
        request.status = RequestStatus.RUNNING
        """,
    )


@mutant("resume_chunk_stops_at_prompt")
def resume_chunk_stops_at_prompt(stack: contextlib.ExitStack, sched: Any) -> None:
    """Preemption and replay: the waiting pass sizes a re-admitted request's chunk from
    `request.num_prompt_tokens` instead of `request.num_tokens`, so a preempted request
    replays its prompt without the tokens it had generated (a new request: no change)."""
    _rewrite(
        stack,
        sched,
        "schedule",
        "num_new_tokens = request.num_tokens - num_computed_tokens",
        "num_new_tokens = request.num_prompt_tokens - num_computed_tokens",
    )


@mutant("admission_ships_new_blocks_only")
def admission_ships_new_blocks_only(stack: contextlib.ExitStack, sched: Any) -> None:
    """The block table a step ships: an admitted request's `NewRequestData` carries the
    blocks `allocate_slots` returned (`req_to_new_blocks[request_id] = new_blocks`, as the
    running pass does) instead of its whole table, so the worker misses the hit's blocks."""
    _rewrite(
        stack,
        sched,
        "schedule",
        """
        req_to_new_blocks[request_id] = self.kv_cache_manager.get_blocks(
            request_id
        )
        """,
        "req_to_new_blocks[request_id] = new_blocks",
    )


@mutant("running_ships_whole_table")
def running_ships_whole_table(stack: contextlib.ExitStack, sched: Any) -> None:
    """The block ids a step ships for a cached request: the running pass sends the
    request's whole table (`self.kv_cache_manager.get_blocks(request_id)`) as its
    `new_block_ids`, which the worker appends to the table it already holds. (A scheduler
    test that asserts a decode's `new_block_ids` may catch it upstream: the cached-request
    counterpart of `admission_ships_new_blocks_only`.)"""
    _rewrite(
        stack,
        sched,
        "schedule",
        "req_to_new_blocks[request_id] = new_blocks",
        "req_to_new_blocks[request_id] = self.kv_cache_manager.get_blocks(request_id)",
    )


# ---------------------------------------------------------------- KV connector glue (model.machine.connector)


@mutant("async_load_cached_at_admission", strategy="scheduler-connector")
def async_load_cached_at_admission(stack: contextlib.ExitStack, sched: Any) -> None:
    """Delayed caching lost: the waiting pass calls `allocate_slots(...,
    delay_cache_blocks=False)` for an async KV load, so its blocks are cached before
    the load has written them."""
    original = vars(sched)["schedule"]

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        manager = self.kv_cache_manager
        allocate = manager.allocate_slots

        def eager(request: Any, *a: Any, **k: Any) -> Any:
            k["delay_cache_blocks"] = False
            return allocate(request, *a, **k)

        manager.allocate_slots = eager
        try:
            return original(self, *args, **kwargs)
        finally:
            manager.allocate_slots = allocate

    _set(stack, sched, "schedule", schedule)


@mutant("failed_load_keeps_computed_tokens", strategy="scheduler-connector")
def failed_load_keeps_computed_tokens(stack: contextlib.ExitStack, sched: Any) -> None:
    """`_handle_failed_recving` forgets `request.num_computed_tokens = 0` under the
    "recompute" policy: the promotion caches the failed load's blocks as valid KV."""
    original = vars(sched)["_handle_failed_recving"]

    def handle(self: Any, failed_req_ids: set[str]) -> Any:
        computed = {r: self.requests[r].num_computed_tokens for r in failed_req_ids if r in self.requests}
        out = original(self, failed_req_ids)
        for rid, n in computed.items():
            self.requests[rid].num_computed_tokens = n
        return out

    _set(stack, sched, "_handle_failed_recving", handle)


@mutant("loading_request_freed_at_finish", strategy="scheduler-connector")
def loading_request_freed_at_finish(stack: contextlib.ExitStack, sched: Any) -> None:
    """`finish_requests` sets `delay_free_blocks = False` for a request in
    WAITING_FOR_REMOTE_KVS: the blocks an in-flight load writes go back to the pool."""
    original = vars(sched)["finish_requests"]

    def finish_requests(self: Any, request_ids: Any, finished_status: Any) -> Any:
        out = original(self, request_ids, finished_status)
        for request in out:
            if self.requests.get(request.request_id) is request:  # its free was deferred
                self._free_blocks(request)
        return out

    _set(stack, sched, "finish_requests", finish_requests)


@mutant("async_load_ignores_in_flight_reserve", strategy="scheduler-connector")
def async_load_ignores_in_flight_reserve(stack: contextlib.ExitStack, sched: Any) -> None:
    """An async KV load is admitted on the whole free pool (`reserved_blocks=0`), taking
    the blocks the prefills already in flight still need
    (`_inflight_prefill_reserved_blocks` left out)."""
    _set(stack, sched, "_inflight_prefill_reserved_blocks", lambda self: 0)


@mutant("async_load_ignores_spec_step_reserve", strategy="scheduler-connector-spec")
def async_load_ignores_spec_step_reserve(stack: contextlib.ExitStack, sched: Any) -> None:
    """With drafts, an async KV load is admitted leaving only the in-flight prefills'
    blocks free: `reserved_blocks` drops `self._spec_decode_step_blocks`, the blocks its
    first decode step's token, drafts and lookahead will take (the lookahead it does not
    reserve now)."""
    _rewrite(stack, sched, "schedule", "+ self._spec_decode_step_blocks", "+ 0")


@mutant("async_load_reserves_lookahead", strategy="scheduler-connector-spec")
def async_load_reserves_lookahead(stack: contextlib.ExitStack, sched: Any) -> None:
    """With drafts, an async KV load's admission allocates the lookahead slots at once
    (`limit_lookahead_tokens` always False): the blocks wait, unused, for the whole
    transfer, and the pool the load's peers need shrinks by them."""
    _rewrite(
        stack,
        sched,
        "schedule",
        "limit_lookahead_tokens = load_kv_async and self.num_lookahead_tokens > 0",
        "limit_lookahead_tokens = False",
    )


@async_mutant("async_rejection_keeps_placeholders", strategy="scheduler-spec")
def async_rejection_keeps_placeholders(stack: contextlib.ExitStack, sched: Any) -> None:
    """Rejection rollback under async scheduling: `update_from_output` rolls
    `num_computed_tokens` back by the rejected drafts but forgets
    `request.num_output_placeholders -= num_rejected`, so the placeholders keep counting
    rejected drafts and the next step schedules past the request's real position.
    `Scheduler.update_from_output` rewritten onto `AsyncScheduler` (the line only runs
    with output placeholders, i.e. under async scheduling)."""
    _rewrite_inherited(
        stack, sched, "update_from_output", "request.num_output_placeholders -= num_rejected", "pass"
    )


# ---------------------------------------------------------------- saving connectors (model.machine.connector: saves)


@mutant("save_free_not_deferred", strategy="scheduler-connector")
def save_free_not_deferred(stack: contextlib.ExitStack, sched: Any) -> None:
    """A saving connector's deferral lost: `_free_request` drops
    `delay_free_blocks |= connector_delay_free_blocks`, so a finished request's blocks go
    back to the pool (and may be reused) while the connector is still sending them."""
    _rewrite(stack, sched, "_free_request", "delay_free_blocks |= connector_delay_free_blocks", "")


@mutant("saved_blocks_cover_prompt_only", strategy="scheduler-connector")
def saved_blocks_cover_prompt_only(stack: contextlib.ExitStack, sched: Any) -> None:
    """What a finish hands the connector to save: `_connector_finished` clips the block ids
    at `request.num_prompt_tokens` instead of `request.num_computed_tokens`, so the blocks
    of the generated tokens past the prompt's last block are never saved."""
    _rewrite(
        stack,
        sched,
        "_connector_finished",
        "num_computed_tokens=request.num_computed_tokens,",
        "num_computed_tokens=request.num_prompt_tokens,",
    )


@mutant("mamba_external_state_block_missing", strategy="scheduler-connector-mamba")
def mamba_external_state_block_missing(stack: contextlib.ExitStack, sched: Any) -> None:
    """A Mamba group's external tokens get no state block: `MambaManager`'s
    `allocate_external_computed_blocks` takes nothing (as if every external token were out
    of its one-token window), so a sync load has no block to write the state after the
    last external token into, and the chunk after it reads a null state.
    (`MambaManager` rather than `Scheduler`: the defect only shows through a connector.)"""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    _set(stack, MambaManager, "allocate_external_computed_blocks", lambda self, *a, **k: None)


# ---------------------------------------------------------------- decisions vLLM's own tests miss
# One-line defects of the decisions whose first mutants vLLM's tests already catch (chunking
# and the Mamba split, admission with a hit, preemption and replay, rejection rollback):
# `kvretain upstream-tests` says which of these they miss.


@mutant("replay_chunk_not_split", strategy="scheduler-mamba")
def replay_chunk_not_split(stack: contextlib.ExitStack, sched: Any) -> None:
    """Chunking a replay: the Mamba split's prefill ends at the prompt
    (`prefill_end = request.num_prompt_tokens`), so a preempted request replaying its
    output tokens runs chunks that end mid-block, where no state can be cached."""
    _rewrite(
        stack,
        sched,
        "_mamba_block_aligned_split",
        "prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)",
        "prefill_end = request.num_prompt_tokens",
    )


@mutant("chunk_runs_past_block_boundary", strategy="scheduler-mamba")
def chunk_runs_past_block_boundary(stack: contextlib.ExitStack, sched: Any) -> None:
    """Chunking: a prefill chunk that starts mid-block no longer stops at the next block
    boundary (the split's `next_block_boundary` stop reads `start % block_size == 0`), so
    the state of that boundary is never written."""
    _rewrite(
        stack,
        sched,
        "_mamba_block_aligned_split",
        "if start % block_size != 0 and not use_internal_checkpoint",
        "if start % block_size == 0 and not use_internal_checkpoint",
    )


@mutant("hit_admission_not_padded", strategy="scheduler-spec")
def hit_admission_not_padded(stack: contextlib.ExitStack, sched: Any) -> None:
    """Admission with a hit: a request whose prefix hit leaves it one token is padded to
    `1 + num_spec_tokens` only when a running request was scheduled before it
    (`num_computed_tokens > 0` dropped from the padding condition), so alone it runs one
    token and its drafts' slots are never allocated."""
    _rewrite(
        stack,
        sched,
        "schedule",
        "and (scheduled_running_reqs or num_computed_tokens > 0)",
        "and scheduled_running_reqs",
    )


@mutant("resumed_request_skips_lookup")
def resumed_request_skips_lookup(stack: contextlib.ExitStack, sched: Any) -> None:
    """Replay after preemption: the waiting pass looks up the prefix cache only for a
    request never preempted (`and request.num_preemptions == 0` added), so a re-admitted
    request recomputes blocks the cache still holds and its hit is lost."""
    _rewrite(
        stack,
        sched,
        "schedule",
        "if request.num_computed_tokens == 0:",
        "if request.num_computed_tokens == 0 and request.num_preemptions == 0:",
    )


@mutant("admission_beside_preemption")
def admission_beside_preemption(stack: contextlib.ExitStack, sched: Any) -> None:
    """Preemption: the waiting pass runs in a step that preempted
    (`not preempted_reqs and` dropped), so the blocks a preemption freed for a running
    request go to a waiting one, possibly the request just preempted."""
    _rewrite(
        stack,
        sched,
        "schedule",
        "if not preempted_reqs and self._pause_state != PauseState.PAUSED_ALL:",
        "if self._pause_state != PauseState.PAUSED_ALL:",
    )


@mutant("accepted_counts_sampled_token", strategy="scheduler-spec")
def accepted_counts_sampled_token(stack: contextlib.ExitStack, sched: Any) -> None:
    """Rejection rollback: `update_from_output` counts the sampled token among the accepted
    drafts (`num_accepted = len(generated_token_ids)`), so one rejected draft is never
    rolled back and its position counts as computed."""
    _rewrite(
        stack,
        sched,
        "update_from_output",
        "num_accepted = max(len(generated_token_ids) - num_sampled, 0)",
        "num_accepted = len(generated_token_ids)",
    )


@mutant("scheduled_drafts_not_clipped", strategy="scheduler-spec")
def scheduled_drafts_not_clipped(stack: contextlib.ExitStack, sched: Any) -> None:
    """Rejection rollback: the running pass clips a request's drafts to the positions the
    budget left it with the comparison inverted (`len(spec_token_ids) <
    num_scheduled_spec_tokens`), so a clipped decode lists drafts it never ran and their
    rejection rolls back tokens that were computed."""
    _rewrite(
        stack,
        sched,
        "schedule",
        "if len(spec_token_ids) > num_scheduled_spec_tokens:",
        "if len(spec_token_ids) < num_scheduled_spec_tokens:",
    )


@mutant("long_prefill_caps_lone_request", strategy="scheduler-long-prefill")
def long_prefill_caps_lone_request(stack: contextlib.ExitStack, sched: Any) -> None:
    """Chunking under the long-prefill threshold: the cap applies with no other request
    queued (`if num_eligible_reqs > 0`), so a lone long prompt is chunked at the threshold
    though nobody waits for the budget it leaves."""
    _rewrite(stack, sched, "schedule", "if num_eligible_reqs > 1", "if num_eligible_reqs > 0")


@mutant("admission_counts_external_as_local", strategy="scheduler-connector")
def admission_counts_external_as_local(stack: contextlib.ExitStack, sched: Any) -> None:
    """Admission with a hit: the waiting pass passes the whole hit, local and external, as
    `allocate_slots(num_new_computed_tokens=num_computed_tokens)`, so the connector's
    external tokens are counted twice and their blocks are taken for cached ones."""
    _rewrite(
        stack,
        sched,
        "schedule",
        "num_new_computed_tokens=num_new_local_computed_tokens,",
        "num_new_computed_tokens=num_computed_tokens,",
    )


@mutant("rollback_counts_configured_drafts", strategy="scheduler-spec")
def rollback_counts_configured_drafts(stack: contextlib.ExitStack, sched: Any) -> None:
    """Rejection rollback: `update_from_output` counts the configured draft tokens
    (`num_draft_tokens = self.num_spec_tokens`) instead of those the step verified, so a
    decode whose drafts the budget cut rolls back positions it never scheduled."""
    _rewrite(
        stack,
        sched,
        "update_from_output",
        "num_draft_tokens = len(scheduled_spec_token_ids)",
        "num_draft_tokens = self.num_spec_tokens",
    )


@mutant("hit_admission_padded_behind_prefill", strategy="scheduler-spec")
def hit_admission_padded_behind_prefill(stack: contextlib.ExitStack, sched: Any) -> None:
    """Admission with a hit: a request whose hit leaves it one token is padded with
    placeholder drafts even when the running pass scheduled a prefill chunk
    (`and not prefill_scheduled` dropped), so a mixed step carries padding vLLM keeps
    for uniform decode batches and allocates slots for drafts nobody proposes."""
    _rewrite(
        stack,
        sched,
        "schedule",
        """
        and num_new_tokens == 1
        and not prefill_scheduled
        """,
        "and num_new_tokens == 1",
    )


@mutant("mamba_split_ignores_long_prefill", strategy="scheduler-long-prefill")
def mamba_split_ignores_long_prefill(stack: contextlib.ExitStack, sched: Any) -> None:
    """Chunking under the long-prefill threshold: the Mamba split's "block wider than the
    budget" escape reads the step's budget only (the `min(..., long_prefill_threshold)`
    dropped), so under a threshold below the Mamba block a capped prefill chunk rounds
    down to nothing and the request never runs beside another."""
    _rewrite(
        stack,
        sched,
        "_mamba_block_aligned_split",
        "max_prefill_tokens = min(max_prefill_tokens, long_prefill_threshold)",
        "pass",
    )


@mutant("equal_remote_supersedes_local_tail", strategy="scheduler-connector-fine")
def equal_remote_supersedes_local_tail(stack: contextlib.ExitStack, sched: Any) -> None:
    """Admission with a hit ending inside a block: a connector offer exactly as long as the
    hit's sub-block tail supersedes it (`ext_tokens >= partial_tail`), so the request
    loads tokens it already hits locally and drops the hit's copy for an external block."""
    _rewrite(
        stack,
        sched,
        "schedule",
        "if partial_tail and ext_tokens > partial_tail:",
        "if partial_tail and ext_tokens >= partial_tail:",
    )


# The queue order a step leaves (`model.policy.queues`), the fenced frees and the failed-block cut:
# their own modules.
from . import mutants_async_connector, mutants_failed_blocks, mutants_queues  # noqa: E402, F401
