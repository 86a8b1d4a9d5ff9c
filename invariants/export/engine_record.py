"""What kvretain's real-scheduler targets asked of vLLM's `Scheduler` on a trace, call by call.

`record_calls(trace)` replays the trace on its target ("vllm" or "vllm-async-scheduler":
the engine's own steps) and records every call the target made on the scheduler from
outside (`add_request`, `schedule` with the queues and token budget it was called
with, `update_from_output` with the share of which step's output and the synthetic
`ModelRunnerOutput`, `finish_requests`, `update_draft_token_ids`,
`reset_prefix_cache`) and on kvretain's scripted KV connector (`offer`, `save`).
Calls vLLM makes on itself (a preemption inside `schedule()`) are not recorded: only
the outermost call is the driver's. `engine_file` writes them out as straight-line
calls, so the exported test drives vLLM exactly as the target did, with no kvretain
code between.

The recorder observes: each wrapper calls vLLM's method with the same arguments and
returns its result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from invariants.export.plan import ExportError
from invariants.harness.trace import Trace
from model.contract.ops import Op


@dataclass(frozen=True)
class Call:
    """One driver call. `kind`: "op" (a trace operation starts: `op`), "add", "offer",
    "save", "step", "update", "finish", "drafts", "reset"."""

    kind: str
    rid: str = ""
    op: Op | None = None
    index: int = -1  # "op": the operation's index; "step": the step's number; "update": its output's
    tokens: tuple[int, ...] = ()  # "add": the prompt
    num: int = 0  # "offer": tokens offered; "step": budget; "update": total scheduled tokens
    flag: bool = False  # "offer": an async load
    queues: tuple[tuple[str, ...], ...] = ()  # "step": running, holding, waiting
    scheduled: dict[str, int] = field(default_factory=dict)  # "step" (result), "update" (share)
    sampled: tuple[tuple[str, tuple[int, ...]], ...] = ()  # "update": per request; "drafts"
    connector: dict[str, tuple[Any, ...]] | None = None  # "update": KVConnectorOutput's fields
    raised: str = ""  # the call raised this (type: message)


@dataclass
class Recording:
    calls: list[Call] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    failed_at: int | None = None  # the operation whose apply raised (the target's crash)
    error: str = ""
    version: str = ""
    async_scheduler: bool = False
    target: str = ""  # the target that recorded the calls


_CONNECTOR_FIELDS = ("finished_recving", "failed_recving", "invalid_block_ids", "finished_sending")


class _Recorder:
    def __init__(self, sched: Any, rec: Recording) -> None:
        self.sched, self.rec, self.depth = sched, rec, 0

    def wrap(self, obj: Any, name: str, note: Callable[..., Call | None]) -> None:
        method = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            outer = self.depth == 0
            before = note(*args, **kwargs) if outer else None
            self.depth += 1
            try:
                result = method(*args, **kwargs)
            except Exception as exc:
                if before is not None:
                    if before.kind == "step":
                        self.rec.outputs.append(None)
                        before = _with(before, index=len(self.rec.outputs) - 1)
                    self.rec.calls.append(_with(before, raised=f"{type(exc).__name__}: {exc}"))
                raise
            finally:
                self.depth -= 1
            if before is not None:
                self.rec.calls.append(self.after(before, result))
            return result

        setattr(obj, name, wrapper)

    def after(self, call: Call, result: Any) -> Call:
        if call.kind == "step":
            self.rec.outputs.append(result)
            return _with(call, index=len(self.rec.outputs) - 1, scheduled=dict(result.num_scheduled_tokens))
        return call

    # ------------------------------------------------------------------ notes
    def step(self) -> Call:
        s = self.sched

        def ids(queue: Any) -> tuple[str, ...]:
            return tuple(r.request_id for r in queue)

        holding = ids(s.kv_holding_waiting) if hasattr(s, "kv_holding_waiting") else ()
        return Call("step", queues=(ids(s.running), holding, ids(s.waiting)), num=s.max_num_scheduled_tokens)

    def update(self, share: Any, runner: Any) -> Call:
        index = next(
            (
                i
                for i, out in enumerate(self.rec.outputs)
                if share is out or share.scheduled_new_reqs is out.scheduled_new_reqs
            ),
            None,
        )
        if index is None:
            raise ExportError("an update_from_output of a step output the recorder never saw")
        kv = runner.kv_connector_output
        connector = None
        if kv is not None:
            connector = {f: tuple(sorted(getattr(kv, f) or ())) for f in _CONNECTOR_FIELDS}
        sampled = tuple((r, tuple(t)) for r, t in zip(runner.req_ids, runner.sampled_token_ids))
        return Call(
            "update",
            index=index,
            scheduled=dict(share.num_scheduled_tokens),
            num=int(share.total_num_scheduled_tokens),
            sampled=sampled,
            connector=connector,
        )


def _with(call: Call, **changes: Any) -> Call:
    from dataclasses import replace

    return replace(call, **changes)


def record_calls(trace: Trace) -> Recording:
    """Replay `trace` on its target, recording the driver's calls (see the module docstring)."""
    from invariants.targets import ASYNC_SCHEDULER_TARGETS, target_factory
    from invariants.targets.base import TargetUnavailable
    from invariants.targets.vllm_env import vllm_version

    name = trace.target or "vllm"
    try:
        target = target_factory(name)(trace.config)
    except TargetUnavailable as exc:
        raise ExportError(f"trace.target: {name} cannot be built here ({exc})") from None
    sched = getattr(target, "vllm_scheduler", None)
    if sched is None:
        raise ExportError(f"trace.target: {name} drives no vLLM Scheduler")
    rec = Recording(
        version=vllm_version() or "?", async_scheduler=name in ASYNC_SCHEDULER_TARGETS, target=name
    )
    r = _Recorder(sched, rec)
    r.wrap(sched, "add_request", lambda req: Call("add", req.request_id, tokens=tuple(req.prompt_token_ids)))
    r.wrap(sched, "schedule", r.step)
    r.wrap(sched, "update_from_output", r.update)
    r.wrap(sched, "finish_requests", lambda rid, *a, **k: Call("finish", str(rid)))
    r.wrap(
        sched,
        "update_draft_token_ids",
        lambda d: Call("drafts", sampled=tuple((r, tuple(t)) for r, t in zip(d.req_ids, d.draft_token_ids))),
    )
    r.wrap(sched, "reset_prefix_cache", lambda *a, **k: Call("reset"))
    if sched.connector is not None:
        c = sched.connector
        r.wrap(c, "offer", lambda rid, n, async_load: Call("offer", rid, num=n, flag=async_load))
        r.wrap(c, "save", lambda rid: Call("save", rid))
    for i, op in enumerate(trace.ops):
        rec.calls.append(Call("op", op=op, index=i))
        try:
            target.apply(op)
        except Exception as exc:  # the finding's crash (a vLLM exception, or the adapter's observation)
            rec.failed_at, rec.error = i, f"{type(exc).__name__}: {exc}"
            break
    return rec
