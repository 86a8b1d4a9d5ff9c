"""kvretain operations applied to vLLM, as `docs/semantics.md` says:

- `AddRequest`: a WAITING `Request`, hashed by vLLM's hasher (only when prefix
  caching is on, as `EngineCore` does).
- `Schedule` / `Step`: `vllm_schedule.StepScheduler`.
- `Sample`: `Request.append_output_token_ids` (hashes of newly full chunks).
- `Finish` / `Preempt`: `KVCacheManager.free` (+ PREEMPTED, `num_computed_tokens
  = 0`, as `Scheduler._preempt_request`).
- `Probe`: `get_computed_blocks` for a throw-away request (pure).
- `ResetPrefixCache`, `EvictBlocks`: the manager's methods (`evict_blocks(set)`).

An operation the state does not allow raises `ValueError` before vLLM sees
it; anything else raised while applying it is a `TargetCrash` naming who
raised: vLLM (the innermost frame is in its package), or the adapter, which
is a gap in kvretain, never a defect of vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Protocol

from model.contract.extra_keys import Identity, identity_of
from model.contract.observation import (
    Done,
    Observation,
    ProbeResult,
    ResetResult,
    ScheduleResult,
    StepResult,
    Tokens,
)
from model.contract.ops import (
    AddRequest,
    EvictBlocks,
    Finish,
    Op,
    Preempt,
    Probe,
    ResetPrefixCache,
    Sample,
    Schedule,
    Step,
)

from .base import TargetCrash, TargetUnavailable
from .vllm_hashing import continuing, shared_hashes
from .vllm_identity import request_identity
from .vllm_names import HashLearner
from .vllm_schedule import block_ids
from .vllm_session import VllmSession


class Scheduling(Protocol):
    """What `OpDriver` asks of the part that schedules (`vllm_schedule.StepScheduler`,
    which re-creates the scheduler's calls, or `vllm_scheduler_drive.RealStepScheduler`,
    vLLM's own `Scheduler`)."""

    def schedule(self, req: Any, budget: int) -> ScheduleResult: ...

    def step(self, rids: tuple[str, ...], budget: int) -> StepResult: ...

    def preempt(self, req: Any) -> None: ...

    def computed_blocks(self, req: Any) -> tuple[Any, int, int]: ...


class OpDriver:
    """Applies kvretain operations to one session's vLLM objects."""

    def __init__(self, session: VllmSession, names: HashLearner, scheduler: Scheduling) -> None:
        self.s = session
        self.names = names
        self.scheduler = scheduler
        self.probe_seq = 0
        # rid -> its identity (`model.contract.extra_keys`): a probe borrows only its own identity's hashes.
        self.identities: dict[str, Identity] = {}
        # The last finished request, until the next probe (see `probe_request`).
        self.finished: Any = None

    def apply(self, op: Op) -> Observation:
        self.check_well_formed(op)
        try:
            return self.dispatch(op)
        except (TargetCrash, TargetUnavailable):
            raise
        except Exception as exc:
            raise TargetCrash(f"{self.raiser(exc)} raised on {op!r}: {type(exc).__name__}: {exc}") from exc

    def raiser(self, exc: BaseException) -> str:
        """Who raised: vLLM (the innermost frame is in its package), or the
        adapter itself, which is a gap in kvretain, never a defect of vLLM."""
        version = self.s.version
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is None:
            return f"vLLM {version}"
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if path.startswith(_vllm_package_dir()):
            return f"vLLM {version}"
        return f"the vLLM adapter ({os.path.basename(path)}:{tb.tb_lineno}, under vLLM {version})"

    def check_well_formed(self, op: Op) -> None:
        requests, running = self.s.requests, self.s.v["RequestStatus"].RUNNING
        rid = getattr(op, "rid", None)
        if isinstance(op, AddRequest):
            if rid in requests:
                raise ValueError(f"add: request {rid!r} already exists")
        elif rid is not None and rid not in requests:
            raise ValueError(f"{type(op).__name__}: unknown request {rid!r}")
        if isinstance(op, Sample):
            req = requests[op.rid]
            # Computed past its tokens: the drafts a real scheduler's step verified.
            if req.status != running or req.num_computed_tokens < req.num_tokens:
                raise ValueError(f"sample: {op.rid!r} is not waiting for a sample")
        if isinstance(op, Step) and any(r not in requests for r in op.rids):
            raise ValueError(f"step: unknown request among {list(op.rids)}")
        if isinstance(op, Preempt) and requests[op.rid].status != running:
            raise ValueError(f"preempt: {op.rid!r} is not running")

    def dispatch(self, op: Op) -> Observation:
        """Apply a well-formed operation (see the module docstring)."""
        m, requests = self.s.manager, self.s.requests
        if isinstance(op, AddRequest):
            requests[op.rid] = self.new_request(op.rid, op.tokens())
            return Done()
        if isinstance(op, Schedule):
            return self.scheduler.schedule(requests[op.rid], op.budget)
        if isinstance(op, Step):
            return self.scheduler.step(op.rids, op.budget)
        if isinstance(op, Sample):
            req = requests[op.rid]
            start = self.names.before_sample(req)
            req.append_output_token_ids(op.token)
            self.names.after_sample(req, start)
            return Done()
        if isinstance(op, Finish):
            req = requests.pop(op.rid)
            self.names.forget(op.rid)
            m.free(req)
            self.finished = req
            req.status = self.s.v["RequestStatus"].FINISHED_STOPPED
            return Done()
        if isinstance(op, Preempt):
            self.scheduler.preempt(requests[op.rid])
            return Done()
        if isinstance(op, Probe):
            return self.probe(op.tokens)
        if isinstance(op, ResetPrefixCache):
            return ResetResult(bool(m.reset_prefix_cache()))
        if isinstance(op, EvictBlocks):
            m.evict_blocks(set(op.block_ids))
            return Done()
        raise TypeError(f"unknown operation {op!r}")

    def probe(self, tokens: Tokens) -> ProbeResult:
        """The lookup `tokens` would get (`get_computed_blocks`; changes nothing)."""
        req = self.probe_request(tokens)
        if req.num_tokens == 0:
            return ProbeResult(0, 0, tuple(() for _ in self.s.config.groups))
        blocks, hit, spb = self.scheduler.computed_blocks(req)
        return ProbeResult(hit, spb, block_ids(blocks))

    def new_request(self, rid: str, tokens: Iterable[int], known: list[Any] | None = None) -> Any:
        """A WAITING request for `tokens`, hashed by vLLM's hasher, its hashes learnt;
        with `known`, a probe's (see `probe_request`): the hashes of its first full
        blocks are `known`, and it learns nothing (a lookup puts no hash in the map,
        and a request that does learns its own)."""
        v = self.s.v
        sp = v["SamplingParams"](max_tokens=1 << 30)
        hasher = None
        if (
            self.s.config.enable_caching
        ):  # EngineCore hashes requests only when prefix caching is on (core.py)
            hasher = self.s.block_hasher()
            if known:
                hasher = continuing(hasher, known)
        identity = identity_of(tokens)
        kwargs: dict[str, Any] = {"mm_features": None, **request_identity(identity)}
        req = v["Request"](
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=hasher,
            **kwargs,
        )
        if known is None:
            self.identities[rid] = identity
            self.names.register(rid, tokens)
        return req

    def probe_request(self, tokens: Tokens) -> Any:
        """A throw-away request for `tokens` (a lookup reads only its token count and
        block hashes).

        vLLM's block hash is a function of the prefix's tokens and identity
        (`model.contract.extra_keys`; under lookahead hashes, of the tokens past it too), so the full blocks `tokens`
        shares with a request of its identity vLLM already hashed take that
        request's hashes (a donor of another identity gives none), and
        vLLM's hasher hashes only the blocks after them: a probe of a 1M-token
        prefix costs a token comparison, not 62k hashes. The donors are the live
        requests and the last finished one (the promise probe replays its
        prompt); when that one has no outputs it serves itself (a free leaves its
        token count and hashes as they were)."""
        last, self.finished = self.finished, None
        identity = identity_of(tokens)
        if (
            last is not None
            and last.num_tokens == last.num_prompt_tokens == len(tokens)
            and last.prompt_token_ids == list(tokens)
            and self.identities.get(last.request_id) == identity
        ):
            return last
        self.probe_seq += 1
        donors = [
            r
            for r in (*self.s.requests.values(), *([last] if last is not None else []))
            if self.identities.get(r.request_id) == identity
        ]
        want = list(tokens)
        known = (
            shared_hashes(want, donors, self.s.hbs, self.s.hash_lookahead)
            if self.s.config.enable_caching
            else []
        )
        return self.new_request(f"__probe{self.probe_seq}", tokens, known)


def _vllm_package_dir() -> str:
    import vllm

    return os.path.dirname(os.path.abspath(vllm.__file__))
