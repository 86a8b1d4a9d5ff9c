"""The state of a real-scheduler vLLM target that its snapshot does not show.

Contract of `hidden_state(target, names)`: a hashable image of everything the
"vllm" and "vllm-async-scheduler" targets keep besides the allocator's
observable state (free queue, ref counts, hash map, block tables) that can
decide what a later operation does or what a later check reads, request ids
renamed by `names` (`invariants.explore.fingerprint`). Two states with equal
images and equal snapshots continue alike, up to what `NOT_IN_IMAGE` lists.

In the image (each read from the target's public attributes, never written):

- vLLM's `Scheduler`: the queues in order (`running`, `waiting`,
  `kv_holding_waiting`; `deferred_waiting` as a set), the order of its
  `requests` dict, the id sets the next step reports or consults
  (`finished_req_ids`, `prev_step_scheduled_req_ids`, `reset_preempted_req_ids`,
  `finished_recving_kv_req_ids`, `failed_recving_kv_req_ids`), fenced frees
  (`deferred_frees`, their fences relative to `processed_step_seq`) and the
  steps scheduled but not processed (`sched_step_seq - processed_step_seq`);
- each vLLM `Request` (`REQUEST_FIELDS`): status, computed tokens, all token
  ids, drafts, output placeholders, in-flight and stale output tokens,
  prefill-chunk flag, the shared-prefix and replay marks, its step sequence
  relative to `processed_step_seq`, its decode eligibility relative to
  `current_step`;
- per KV cache group manager: `num_cached_block` (how much of each request is
  cached), partial hits awaiting a copy, pending copy-on-write copies, new block
  ids not yet shipped;
- kvretain's adapter: the step output awaiting its model-runner half
  (`pending`, its scheduled tokens and drafts), the samples waiting for it, the
  shares held for a sample, ids whose share went stale, the last output a report
  rides on; with drafts the accepted counts and pending proposals; under async
  scheduling the undelivered shares, the samplers, the proposed drafts, the
  generated tokens, and whether a fence is being processed; the requests held
  for a connector's load or save;
- kvretain's scripted connector: pending offers, requests to save, deferred
  frees awaiting `Saved`, async loads awaiting `Loaded`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

Names = Mapping[str, str]

# The vLLM `Request` attributes that decide its future (absent in a release: read as None).
REQUEST_FIELDS = (
    "num_computed_tokens",
    "num_prompt_tokens",
    "spec_token_ids",
    "num_output_placeholders",
    "num_in_flight_tokens",
    "num_stale_output_tokens",
    "drop_stale_output",
    "is_prefill_chunk",
    "shared_prefix_boundary",
    "replay_start",
)

NOT_IN_IMAGE = (
    "timestamps and counters read only for statistics (arrival and preemption times, "
    "num_preemptions, prefix-cache and spec-decode stats, current_step and the step sequences "
    "themselves: only their differences are kept), kvretain's logs (the connector's loads, saves, "
    "finished and handed lists; the shadow worker, checked by its own invariants)"
)
"""What the image leaves out, in words (the certificate quotes it)."""


def _ids(rids: Iterable[str], names: Names) -> tuple[str, ...]:
    return tuple(names.get(r, r) for r in rids)


def _set(rids: Iterable[str] | None, names: Names) -> frozenset[str]:
    return frozenset(names.get(r, r) for r in rids or ())


def _plain(value: Any) -> Hashable:
    """A list, tuple, dict or scalar of vLLM's, as a hashable value."""
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _plain(v)) for k, v in value.items())
    if value is None or isinstance(value, (int, float, str, bool)):
        return value
    return repr(value)


def _output(out: Any, names: Names) -> Hashable:
    """A `SchedulerOutput`: the tokens and drafts it scheduled per request."""
    if out is None:
        return None
    tokens = tuple((names.get(r, r), n) for r, n in out.num_scheduled_tokens.items())
    spec = getattr(out, "scheduled_spec_decode_tokens", None) or {}
    return (tokens, tuple((names.get(r, r), tuple(t)) for r, t in spec.items()))


def _request(req: Any, sched: Any, names: Names) -> Hashable:
    processed = getattr(sched, "processed_step_seq", 0)
    step = getattr(sched, "current_step", 0)
    return (
        names.get(req.request_id, req.request_id),
        getattr(req.status, "name", str(req.status)),
        tuple(req.all_token_ids),
        tuple(_plain(getattr(req, f, None)) for f in REQUEST_FIELDS),
        max(getattr(req, "last_sched_seq", 0) - processed, 0),
        max(getattr(req, "next_decode_eligible_step", 0) - step, 0),
    )


def _managers(sched: Any, names: Names) -> Hashable:
    out = []
    for m in sched.kv_cache_manager.coordinator.single_type_managers:
        partial = getattr(m, "_partial_hit_reqs", {})
        cows = getattr(m, "_pending_cow_copies", [])
        out.append(
            (
                tuple((names.get(r, r), n) for r, n in m.num_cached_block.items()),
                tuple((names.get(r, r), n, b.block_id) for r, (n, b) in partial.items()),
                tuple((a.block_id, b.block_id) for a, b in cows),
                tuple(getattr(m, "new_block_ids", ())),
            )
        )
    return tuple(out)


def _scheduler(sched: Any, names: Names) -> Hashable:
    processed = getattr(sched, "processed_step_seq", 0)
    holding = getattr(sched, "kv_holding_waiting", ())
    fenced = getattr(sched, "deferred_frees", ())
    return (
        _ids((r.request_id for r in sched.running), names),
        _ids((r.request_id for r in sched.waiting), names),
        _ids((r.request_id for r in holding), names),
        _set((r.request_id for r in getattr(sched, "deferred_waiting", ())), names),
        tuple(_request(r, sched, names) for r in sched.requests.values()),
        _set(sched.finished_req_ids, names),
        _set(getattr(sched, "prev_step_scheduled_req_ids", ()), names),
        _set(getattr(sched, "reset_preempted_req_ids", ()), names),
        _set(getattr(sched, "finished_recving_kv_req_ids", ()), names),
        _set(getattr(sched, "failed_recving_kv_req_ids", ()), names),
        tuple((max(f - processed, 0), tuple(b.block_id for b in blocks)) for f, blocks in fenced),
        max(getattr(sched, "sched_step_seq", 0) - processed, 0),
        _managers(sched, names),
    )


def _adapter(target: Any, names: Names) -> Hashable:
    steps, driver = target.steps, target.driver
    pending, last = steps.pending, steps.last_out
    held = tuple(
        (names.get(r, r), out is pending, out is last, _output(out, names)) for r, out in steps.held.items()
    )
    draft_state = tuple(
        tuple((names.get(r, r), _plain(v)) for r, v in (getattr(steps, a, None) or {}).items())
        for a in ("accepted", "drafting", "proposed", "generated")
    )
    return (
        _output(pending, names),
        _output(last, names),
        tuple((names.get(r, r), t) for r, t in steps.samples.items()),
        held,
        _set(steps.stale, names),
        getattr(steps, "sync_loads", False),
        draft_state,
        _ids(getattr(steps, "undelivered", ()), names),
        _set(getattr(steps, "samplers", ()), names),
        getattr(steps, "fencing", None) is not None,
        _set(driver.held_by_load, names),
        _set(driver.held_by_save, names),
    )


def _connector(sched: Any, names: Names) -> Hashable:
    conn = sched.connector
    if conn is None:
        return None
    return (
        tuple((names.get(r, r), n, a) for r, (n, a) in conn.offers.items()),
        _set(conn.saving, names),
        _set(conn.deferred, names),
        _set(conn.loading, names),
    )


def hidden_state(target: Any, names: Names) -> Hashable:
    """The image of the module docstring for a "vllm" or "vllm-async-scheduler" target."""
    sched = target.vllm_scheduler
    return (_scheduler(sched, names), _adapter(target, names), _connector(sched, names))


HiddenState = Callable[[Any, Names], Hashable]
"""A target -> the image of its hidden state (`hidden_state`)."""
