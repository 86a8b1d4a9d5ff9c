"""The vLLM target: kvretain operations driven through vLLM's real `KVCacheManager`.

`VllmTarget(config)` builds a `KVCacheManager` (vLLM 0.33.0, `vllm/v1/core/`) for a
`model.config.Config` and applies `model.ops` operations through the manager's
public methods, exactly as `docs/semantics.md` says and as vLLM's scheduler does
(`v1/core/sched/scheduler.py`, synchronous scheduling, no connector, no spec
decode tokens):

- `Schedule`: `new_step_starts()`; a waiting request gets `get_computed_blocks`,
  its `shared_prefix_boundary` stored on the request, the chunk
  `min(num_tokens - hit, budget)` (Mamba split: `model.scheduling.mamba_chunk`,
  the scheduler policy every target shares), `allocate_slots(req, n, hit,
  blocks)`; a running request `allocate_slots(req, n)`. Then, as `schedule()`
  does, `take_kv_cache_block_copies()` (reported as the result's `copies`) and
  `block_pool.free_blocks(retained)`.
- `Step`: one `Scheduler.schedule` over several requests (`_step`: running
  pass with preempt-the-newest-and-retry, waiting pass only without a
  preemption; docs/semantics.md lists how it differs from the real loop).
  Every `allocate_slots` call passes `num_lookahead_tokens` from the config.
- `Sample`: `Request.append_output_token_ids` (hashes of newly full chunks).
- `Finish` / `Preempt`: `KVCacheManager.free` (+ PREEMPTED, `num_computed_tokens
  = 0`, as `Scheduler._preempt_request`).
- `Probe`: `get_computed_blocks` for a throw-away request (pure).
- `ResetPrefixCache`, `EvictBlocks`: the manager's methods (`evict_blocks(set)`).

`snapshot()` reads the pool (free queue via `get_all_free_blocks`, ref counts,
the hash map `cached_block_hash_to_block._cache`, primary keys), the block
tables (`get_block_ids`) and drains `take_events()`. vLLM names a hash by its
bytes; the adapter names it by content (`BlockKey(group, prefix)`) with a table
(`HashNames`) filled from every request's `block_hashes` (hash i stands for
`all_token_ids[:(i+1)*hash_block_size]`) and pruned to the hashes vLLM still
holds or a live request has, once vLLM's removal events were read. KV events
carry the hash as the low 64 bits of its bytes by default
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, `kv_cache_utils.maybe_convert_block_hash`);
the table maps those ints too, so no environment variable is changed.

`VllmTarget(cfg, track_prefixes=False)` records nothing (`_learn_hashes` is a
no-op), and snapshots and events name each hash by a stand-in instead of its
prefix, as the reference adapter does: `BlockKey(group, tuple(hash_bytes))`,
and an event's int hash as the 1-tuple `(h,)`. Such snapshots are internally
consistent (distinct hashes stay distinct) but do not compare with another
target's: use them for counting, never for differential checks.

vLLM has no pinned tier (#40676 was never merged): a configuration asking for
one raises `UnsupportedConfig`. Everything else vLLM rejects is re-raised as
`model.config.ConfigError` carrying vLLM's message.

Fine-grained Mamba hits (a Mamba group wider than the hash block size next to
another group: `HybridKVCacheCoordinator.enable_partial_hash_hits`) run as the
scheduler runs them: the chunk split adds the prompt-tail stop
(`Scheduler.mamba_partial_cache_hit`), and every step's copies are reported.

Older releases: the adapter follows `vllm_capabilities.detect()` (the installed
release's own code), never a version string. It passes only the constructor
arguments the release's `KVCacheManager` takes, sets the retention interval
where the release reads it (a `KVCacheConfig` field, or the environment
variable while the coordinator is built; a release without one accepts only
dense retention), reads a junction only where `get_computed_blocks` returns
one, drains CoW copies only where the release makes them, and names a wide
block keyed by its joined fine hashes by the last of them. A KV event field
it lacks takes the model's value (`uncompared_event_fields` names it).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import replace
from operator import itemgetter
from typing import Any

from model.config import Config, ConfigError
from model.observation import (
    AllBlocksCleared,
    BlockKey,
    BlockRemoved,
    BlockStored,
    Done,
    Event,
    Observation,
    ProbeResult,
    ResetResult,
    ScheduleResult,
    Snapshot,
    StepResult,
    Tokens,
)
from model.ops import (
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
from model.pool import EVENT_PROFILES
from model.prefix import Prefix, extend, prefix
from model.scheduling import mamba_chunk

from .base import END, NOT_FREE, PartialState, Tables, TargetCrash, TargetUnavailable, closure, event_keys
from .hash_names import HashNames
from .vllm_capabilities import RETENTION_ENV, Capabilities, detect
from .vllm_env import MODELED_VERSION, version_warning, vllm_available, vllm_modules, vllm_version
from .vllm_hashing import EventGaps, continuing, event_fields, event_gaps, shared_hashes

VLLM_EVENT_PROFILE = "vllm-0.33.0"
NO_PINNED_TIER = "vLLM 0.33.0 has no pinned tier (#40676 was never merged)"


class UnsupportedConfig(ConfigError):
    """A configuration option of kvretain's that vLLM does not have (not a vLLM rejection)."""


# ----------------------------------------------------------------------------- the target
class VllmTarget:
    """Drives vLLM's `KVCacheManager` with kvretain operations (see module docstring)."""

    name = "vllm"

    def __init__(self, config: Config, events: str = VLLM_EVENT_PROFILE, track_prefixes: bool = True) -> None:
        ok, reason = vllm_available()
        if not ok:
            raise TargetUnavailable(reason)
        if events not in EVENT_PROFILES:
            raise ValueError(f"events: must be one of {EVENT_PROFILES}, got {events!r}")
        if config.pin_swa_on_drop:
            raise UnsupportedConfig(f"pin_swa_on_drop: {NO_PINNED_TIER}")
        self.config = config
        # The model event profile this target is judged against (the Checker
        # builds its model with it). vLLM emits the "vllm-0.33.0" profile; with
        # "seed" the #42258 token-range finding shows up as an events difference.
        self.event_profile = events
        self.version = vllm_version() or "?"
        # One line for the CLI to print when this is not the vLLM kvretain models (else None).
        self.version_note = version_warning(self.version)
        self._v = vllm_modules()
        self.caps: Capabilities = detect()
        # The model's semantics profile for this release (the Checker builds its model with it).
        self.profile = self.caps.profile()
        self.hbs = config.hash_block_size
        self.manager = self._build_manager(config)
        # `Scheduler.mamba_partial_cache_hit`: fine-grained hits add the prompt-tail stop.
        self._fine = bool(getattr(self.manager.coordinator, "enable_partial_hash_hits", False))
        self.pool = self.manager.block_pool
        self.requests: dict[str, Any] = {}
        self._probe_seq = 0
        # hash bytes (and the low 64 bits events use) <-> the token prefix it stands for
        self._names = HashNames(self._rehash)
        # rid -> (its prompt tuple, how many of its hashes are learnt): see `_learn_computed`.
        self._pending: dict[str, tuple[Tokens | None, int]] = {}
        self._keys: dict[bytes, BlockKey] = {}
        # The last finished request, until the next probe (see `_probe_request`).
        self._finished: Any = None
        # False: learn nothing, name hashes by stand-ins (see the module docstring).
        self.track_prefixes = track_prefixes

    # ------------------------------------------------------------------ setup
    def _build_manager(self, cfg: Config) -> Any:
        v = self._v
        torch = v["torch"]
        specs = []
        for i, g in enumerate(cfg.groups):
            if g.kind == "full":
                spec = v["FullAttentionSpec"](
                    block_size=g.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
                )
            elif g.kind == "swa":
                spec = v["SlidingWindowSpec"](
                    block_size=g.block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                    sliding_window=g.sliding_window,
                )
            elif g.kind == "mamba":
                spec = v["MambaSpec"](
                    block_size=g.block_size,
                    shapes=((1,),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode=g.mamba_cache_mode,
                )
            else:
                raise ConfigError(f"groups[{i}].kind: must be 'full', 'swa' or 'mamba', got {g.kind!r}")
            specs.append(v["KVCacheGroupSpec"]([f"layer{i}"], spec))
        caps = self.caps
        if caps.retention == "none" and cfg.retention_interval is not None:
            raise UnsupportedConfig(
                f"retention_interval: vLLM {self.version} has no retention interval (dense only)"
            )
        if not caps.fine_grained_mamba and any(
            g.kind == "mamba" and g.block_size > cfg.hash_block_size for g in cfg.groups
        ):
            # A Mamba block wider than the hash block asks for fine-grained hits.
            raise UnsupportedConfig(f"groups: vLLM {self.version} has no fine-grained Mamba hits")
        lcm = math.lcm(*(g.block_size for g in cfg.groups))
        if "scheduler_block_size" not in caps.manager_args and cfg.scheduler_block_size != lcm:
            # Such a release aligns hits and caching to the lcm of the group block sizes.
            raise UnsupportedConfig(
                f"scheduler_block_size: vLLM {self.version} takes none (it aligns to the lcm of "
                f"the group block sizes, {lcm}), got {cfg.scheduler_block_size}"
            )
        cfg_args: dict[str, Any] = {}
        if caps.retention == "config":
            # The dataclass default is None (dense); always pass it explicitly.
            cfg_args["prefix_cache_retention_interval"] = cfg.retention_interval
        wanted = {
            "max_model_len": cfg.max_model_len,
            "scheduler_block_size": cfg.scheduler_block_size,
            "hash_block_size": cfg.hash_block_size,
            "enable_caching": cfg.enable_caching,
            "use_eagle": cfg.eagle,
            "enable_kv_cache_events": True,
        }
        manager_args = {k: val for k, val in wanted.items() if k in caps.manager_args}
        try:
            kv_cfg = v["KVCacheConfig"](
                num_blocks=cfg.num_blocks, kv_cache_tensors=[], kv_cache_groups=specs, **cfg_args
            )
            # The environment-variable releases reject the variable for a model
            # without SWA/Mamba groups, where the field of later releases has no effect.
            env_r = cfg.retention_interval if any(g.kind != "full" for g in cfg.groups) else None
            with _retention_env(env_r if caps.retention == "env" else None):
                return v["KVCacheManager"](kv_cfg, **manager_args)
        except (ValueError, AssertionError, TypeError) as exc:
            kind = "" if isinstance(exc, ValueError) else f" ({type(exc).__name__})"
            raise ConfigError(f"vLLM {self.version} rejects the configuration{kind}: {exc}") from exc

    def _new_request(self, rid: str, tokens: Iterable[int], known: list[Any] | None = None) -> Any:
        """A WAITING request for `tokens`, hashed by vLLM's hasher, its hashes learnt;
        with `known`, a probe's (see `_probe_request`): the hashes of its first full
        blocks are `known`, and it learns nothing (a lookup puts no hash in the map,
        and a request that does learns its own)."""
        v = self._v
        sp = v["SamplingParams"](max_tokens=1 << 30)
        hasher = None
        if self.config.enable_caching:  # EngineCore hashes requests only when prefix caching is on (core.py)
            hasher = v["get_request_block_hasher"](self.hbs, v["sha256"])
            if known:
                hasher = continuing(hasher, known)
        req = v["Request"](
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=sp,
            pooling_params=None,
            mm_features=None,
            block_hasher=hasher,
        )
        if known is None:
            self._pending[rid] = (tokens if isinstance(tokens, tuple) else None, 0)
        return req

    def _learn_computed(self, req: Any) -> None:
        """Learn a request's hashes as far as vLLM may cache its blocks (its computed
        tokens and lookahead slots), not all at admission: the blocks of a 1M-token
        prompt no one computed yet cost no table entry. A hash met before it was
        learnt sends every live request's in (`_learn_pending`)."""
        ahead = req.num_computed_tokens + self.config.num_lookahead_tokens
        self._learn_upto(req, -(-ahead // self.hbs) + 1)

    def _learn_pending(self) -> None:
        for req in self.requests.values():
            self._learn_upto(req, len(req.block_hashes))

    def _learn_upto(self, req: Any, upto: int) -> None:
        """The request's first `upto` hashes are in the table."""
        entry = self._pending.get(req.request_id)
        if entry is None or not self.track_prefixes:
            return
        tokens, done = entry
        upto = min(upto, len(req.block_hashes))
        if upto <= done:
            return
        if tokens is None or upto * self.hbs > len(tokens):
            tokens = tuple(req.all_token_ids)
        self._names.learn(tokens, req.block_hashes, done, self.hbs, stop=upto)
        self._pending[req.request_id] = (tokens, upto)

    def _learn_hashes(self, req: Any, start: int, tokens: Tokens | None = None) -> None:
        if not self.track_prefixes or start >= len(req.block_hashes):
            return
        before = (
            None if tokens is not None or not start else self._names.name(bytes(req.block_hashes[start - 1]))
        )
        if before is not None:
            # A sampled token's new blocks: the request's last named prefix, extended by
            # their tokens (O(new tokens); no copy of a 1M-token request kept per hash).
            for i in range(start, len(req.block_hashes)):
                before = extend(before, req.all_token_ids[i * self.hbs : (i + 1) * self.hbs])
                self._names.adopt(bytes(req.block_hashes[i]), before)
            return
        # The operation's own tuple where it is the request's tokens: prefixes named along it are shared.
        toks = tokens if tokens is not None else tuple(req.all_token_ids)
        self._names.learn(toks, req.block_hashes, start, self.hbs)

    def _rehash(self, p: Prefix) -> bytes | None:
        """vLLM's hash of a prefix the table does not hold (a throw-away request hashes it)."""
        if not self.config.enable_caching or len(p) == 0 or len(p) % self.hbs:
            return None
        v = self._v
        req = v["Request"](
            request_id="__rehash",
            prompt_token_ids=list(p.tokens()),
            sampling_params=v["SamplingParams"](max_tokens=1),
            pooling_params=None,
            mm_features=None,
            block_hasher=v["get_request_block_hasher"](self.hbs, v["sha256"]),
        )
        return bytes(req.block_hashes[-1])

    def _prune_names(self) -> None:
        """Forget the prefixes of hashes vLLM removed (after their events were read)."""
        if not self.track_prefixes or not self._names.should_prune():
            return
        keep: set[bytes] = set()
        for rid, r in self.requests.items():
            learnt = self._pending[rid][1] if rid in self._pending else len(r.block_hashes)
            keep.update(map(bytes, r.block_hashes[:learnt]))  # C loops: 1M-token requests hold 250k
        width = len(self._names.any_hash() or b"")
        cache = self.pool.cached_block_hash_to_block._cache
        keep.update(map(bytes, map(itemgetter(slice(None, -4)), cache)))  # the group id is 4 bytes
        if self.caps.coarse_hash == "concat":  # and the last fine hash of a joined key
            keep.update(map(bytes, map(itemgetter(slice(-4 - width, -4)), cache)))
        if not self._names.prune(keep):
            return
        self._keys = {
            k: v for k, v in self._keys.items() if bytes(k[:-4]) in keep or bytes(k[:-4][-width:]) in keep
        }

    # ------------------------------------------------------------------ ops
    def apply(self, op: Op) -> Observation:
        self._check_well_formed(op)
        try:
            return self._apply(op)
        except (TargetCrash, TargetUnavailable):
            raise
        except Exception as exc:
            raise TargetCrash(f"{self._raiser(exc)} raised on {op!r}: {type(exc).__name__}: {exc}") from exc

    def _raiser(self, exc: BaseException) -> str:
        """Who raised: vLLM (the innermost frame is in its package), or the
        adapter itself, which is a gap in kvretain, never a defect of vLLM."""
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is None:
            return f"vLLM {self.version}"
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if path.startswith(_vllm_package_dir()):
            return f"vLLM {self.version}"
        return f"the vLLM adapter ({os.path.basename(path)}:{tb.tb_lineno}, under vLLM {self.version})"

    def _check_well_formed(self, op: Op) -> None:
        rid = getattr(op, "rid", None)
        if isinstance(op, AddRequest):
            if rid in self.requests:
                raise ValueError(f"add: request {rid!r} already exists")
        elif rid is not None and rid not in self.requests:
            raise ValueError(f"{type(op).__name__}: unknown request {rid!r}")
        if isinstance(op, Sample):
            req = self.requests[op.rid]
            if req.status != self._v["RequestStatus"].RUNNING or req.num_computed_tokens != req.num_tokens:
                raise ValueError(f"sample: {op.rid!r} is not waiting for a sample")
        if isinstance(op, Step) and any(r not in self.requests for r in op.rids):
            raise ValueError(f"step: unknown request among {list(op.rids)}")
        if isinstance(op, Preempt) and self.requests[op.rid].status != self._v["RequestStatus"].RUNNING:
            raise ValueError(f"preempt: {op.rid!r} is not running")

    def _apply(self, op: Op) -> Observation:
        m = self.manager
        if isinstance(op, AddRequest):
            self.requests[op.rid] = self._new_request(op.rid, op.prompt)
            return Done()
        if isinstance(op, Schedule):
            m.new_step_starts()
            result = self._schedule(self.requests[op.rid], op.budget)
            return replace(result, copies=self._take_copies())
        if isinstance(op, Step):
            return self._step(op)
        if isinstance(op, Sample):
            req = self.requests[op.rid]
            start = len(req.block_hashes)
            self._learn_upto(req, start)  # a sampled request computed every token before it
            req.append_output_token_ids(op.token)
            self._learn_hashes(req, start)  # the sampled blocks, named on from the last (O(new tokens))
            if op.rid in self._pending:
                self._pending[op.rid] = (self._pending[op.rid][0], len(req.block_hashes))
            return Done()
        if isinstance(op, Finish):
            req = self.requests.pop(op.rid)
            self._pending.pop(op.rid, None)
            m.free(req)
            self._finished = req
            req.status = self._v["RequestStatus"].FINISHED_STOPPED
            return Done()
        if isinstance(op, Preempt):
            req = self.requests[op.rid]
            m.free(req)
            req.status = self._v["RequestStatus"].PREEMPTED
            req.num_computed_tokens = 0
            req.num_preemptions += 1
            return Done()
        if isinstance(op, Probe):
            req = self._probe_request(op.tokens)
            if req.num_tokens == 0:
                empty = tuple(() for _ in self.config.groups)
                return ProbeResult(0, 0, empty)
            blocks, hit, spb = self._computed_blocks(req)
            return ProbeResult(hit, spb, _ids(blocks))
        if isinstance(op, ResetPrefixCache):
            return ResetResult(bool(m.reset_prefix_cache()))
        if isinstance(op, EvictBlocks):
            m.evict_blocks(set(op.block_ids))
            return Done()
        raise TypeError(f"unknown operation {op!r}")

    def _take_copies(self) -> tuple[tuple[int, int], ...]:
        """Scheduler.schedule(): drain the CoW copies, release their retained endpoints."""
        if not self.caps.cow_copies:
            return ()
        copies, retained = self.manager.take_kv_cache_block_copies()
        if retained:
            self.pool.free_blocks(retained)
        return tuple((c.src_block_id, c.dst_block_id) for c in copies)

    def _probe_request(self, tokens: Tokens) -> Any:
        """A throw-away request for `tokens` (a lookup reads only its token count and
        block hashes).

        vLLM's block hash is a function of the prefix's tokens alone (no LoRA,
        multimodal input, salt or hash lookahead here), so the full blocks `tokens`
        shares with a request vLLM already hashed take that request's hashes, and
        vLLM's hasher hashes only the blocks after them: a probe of a 1M-token
        prefix costs a token comparison, not 62k hashes. The donors are the live
        requests and the last finished one (the promise probe replays its
        prompt); when that one has no outputs it serves itself (a free leaves its
        token count and hashes as they were)."""
        last, self._finished = self._finished, None
        if (
            last is not None
            and last.num_tokens == last.num_prompt_tokens == len(tokens)
            and last.prompt_token_ids == list(tokens)
        ):
            return last
        self._probe_seq += 1
        donors = [*self.requests.values(), *([last] if last is not None else [])]
        want = list(tokens)
        known = shared_hashes(want, donors, self.hbs) if self.config.enable_caching else []
        return self._new_request(f"__probe{self._probe_seq}", tokens, known)

    def _computed_blocks(self, req: Any) -> tuple[Any, int, int]:
        """`get_computed_blocks`; a release without the junction returns no boundary (0)."""
        out = self.manager.get_computed_blocks(req)
        return out if self.caps.shared_prefix_junction else (*out, 0)

    def _chunk(self, req: Any, start: int, n: int, budget: int) -> int:
        if not self._has_mamba:
            return n
        return mamba_chunk(
            start=start,
            num_new=n,
            budget=budget,
            num_prompt_tokens=req.num_prompt_tokens,
            num_tokens=req.num_tokens,
            shared_prefix_boundary=getattr(req, "shared_prefix_boundary", 0),
            block_size=self.config.scheduler_block_size,
            eagle=self.config.eagle,
            fine_hash_block_size=self.hbs if self._fine else 0,
        )

    @property
    def _has_mamba(self) -> bool:
        """`Scheduler.need_mamba_block_aligned_split`: a Mamba group in 'align' mode."""
        return self.config.has_mamba_align

    def _schedule(self, req: Any, budget: int) -> ScheduleResult:
        m = self.manager
        status = self._v["RequestStatus"]
        if req.status == status.RUNNING:
            start = req.num_computed_tokens
            n = self._chunk(req, start, min(req.num_tokens - start, budget), budget)
            if n <= 0:
                return ScheduleResult(scheduled=0, admitted=False)
            out = m.allocate_slots(req, n, num_lookahead_tokens=self.config.num_lookahead_tokens)
            if out is None:
                return ScheduleResult(scheduled=0, admitted=False)
            req.num_computed_tokens += n
            self._learn_computed(req)
            return ScheduleResult(scheduled=n, admitted=False, new_blocks=_ids(out))
        return self._admit(req, budget, budget)

    def _admit(self, req: Any, left: int, budget: int) -> ScheduleResult:
        """A WAITING or PREEMPTED request's admission (`Scheduler.schedule`'s
        waiting queue) with `left` tokens of the step's `budget` remaining."""
        blocks, hit, spb = self._computed_blocks(req)
        req.shared_prefix_boundary = spb
        hit_blocks = _ids(blocks)
        n = self._chunk(req, hit, min(req.num_tokens - hit, left), budget)
        result = ScheduleResult(0, False, hit, spb, hit_blocks, None)
        if n <= 0:
            return result
        out = self.manager.allocate_slots(
            req,
            n,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            num_lookahead_tokens=self.config.num_lookahead_tokens,
        )
        if out is None:
            return result
        req.status = self._v["RequestStatus"].RUNNING
        req.num_computed_tokens = hit + n
        self._learn_computed(req)
        return ScheduleResult(n, True, hit, spb, hit_blocks, _ids(out))

    # ------------------------------------------------------------------ batched step
    def _step(self, op: Step) -> StepResult:
        """`Scheduler.schedule` (FCFS) over the requests `op.rids`, as its loops run.

        Running pass: `num_new_tokens = min(num_tokens - num_computed_tokens,
        token_budget)`, the Mamba split, `allocate_slots`; on None preempt
        `running.pop()` (`_preempt_request`: free, PREEMPTED, computed 0) and
        retry until it fits or the request preempted itself, then stop the pass.
        Waiting pass (only if nobody was preempted): `get_computed_blocks`, the
        chunk, `allocate_slots(..., num_new_computed_tokens, new_computed_blocks)`;
        None ends the pass. Then the CoW copies are drained once for the step.
        """
        m = self.manager
        status = self._v["RequestStatus"]
        m.new_step_starts()
        running = [self.requests[r] for r in op.rids if self.requests[r].status == status.RUNNING]
        waiting = [self.requests[r] for r in op.rids if self.requests[r].status != status.RUNNING]
        results: list[tuple[str, ScheduleResult]] = []
        preempted: list[str] = []
        token_budget = op.budget
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            req = running[req_index]
            start = req.num_computed_tokens
            n = self._chunk(req, start, min(req.num_tokens - start, token_budget), op.budget)
            if n == 0:
                results.append((req.request_id, ScheduleResult(scheduled=0, admitted=False)))
                req_index += 1
                continue
            while True:
                out = m.allocate_slots(req, n, num_lookahead_tokens=self.config.num_lookahead_tokens)
                if out is not None:
                    break
                victim = running.pop()
                m.free(victim)
                victim.status = status.PREEMPTED
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if out is None:
                results.append((req.request_id, ScheduleResult(scheduled=0, admitted=False)))
                break
            req.num_computed_tokens += n
            self._learn_computed(req)
            token_budget -= n
            results.append(
                (req.request_id, ScheduleResult(scheduled=n, admitted=False, new_blocks=_ids(out)))
            )
            req_index += 1
        if not preempted:
            for req in waiting:
                if token_budget <= 0:
                    break
                result = self._admit(req, token_budget, op.budget)
                results.append((req.request_id, result))
                if not result.admitted:
                    break
                token_budget -= result.scheduled
        return StepResult(tuple(results), tuple(preempted), self._take_copies())

    # ------------------------------------------------------------------ snapshot
    def snapshot(self) -> Snapshot:
        pool = self.pool
        n = len(pool.blocks)
        ref = tuple(0 if b.is_null else b.ref_cnt for b in pool.blocks)
        cached: dict[BlockKey, tuple[int, ...]] = {}
        for key, val in pool.cached_block_hash_to_block._cache.items():
            ids = (val.block_id,) if not isinstance(val, dict) else tuple(b.block_id for b in val.values())
            cached[self._key(key)] = ids
        block_hash = {b.block_id: self._key(b.block_hash) for b in pool.blocks if b.block_hash is not None}
        tables: dict[str, tuple[tuple[int, ...], ...]] = {}
        for rid in sorted(self.requests):
            per_group = tuple(tuple(ids) for ids in self.manager.get_block_ids(rid))
            if any(per_group):
                tables[rid] = per_group
        snap = Snapshot(
            free_queue=_walk_free_queue(pool.free_block_queue, n),
            pinned_queue=(),
            ref_cnt=ref,
            pinned=frozenset(),
            cached=cached,
            block_hash=block_hash,
            tables=tables,
            events=tuple(e for ev in self.manager.take_events() for e in self._event(ev)),
        )
        self._prune_names()
        return snap

    def partial(
        self,
        blocks: Iterable[int],
        rids: Iterable[str],
        keys: Iterable[BlockKey],
        before: Tables | None = None,
    ) -> PartialState:
        """What an operation touched, read from those blocks and tables only (see `PartialState`)."""
        pool, queue = self.pool, self.pool.free_block_queue
        head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
        tables = {}
        for rid in rids:
            table = (
                tuple(tuple(ids) for ids in self.manager.get_block_ids(rid)) if rid in self.requests else ()
            )
            tables[rid] = table if any(table) else ()
        events = tuple(e for ev in self.manager.take_events() for e in self._event(ev))
        want, want_keys = closure(tables, blocks, keys, before)
        cache = pool.cached_block_hash_to_block._cache
        holders: dict[BlockKey, tuple[int, ...]] = {}

        def held(k: BlockKey) -> tuple[int, ...]:
            h = self._map_key(k)
            val = None if h is None else cache.get(h)
            if val is None:
                return ()
            return (val.block_id,) if not isinstance(val, dict) else tuple(x.block_id for x in val.values())

        for k in event_keys(events):
            holders[k] = held(k)
            want.update(holders[k])
        out: dict[int, tuple[int, BlockKey | None, int, int]] = {}
        for b in want:
            blk = pool.blocks[b]
            key = None if blk.block_hash is None else self._key(blk.block_hash)
            if key is not None:
                want_keys.add(key)
            prev, nxt = blk.prev_free_block, blk.next_free_block
            links = (
                (NOT_FREE, NOT_FREE)
                if prev is None or nxt is None
                # `is`: a KVCacheBlock's `==` compares every field
                else (END if prev is head else prev.block_id, END if nxt is tail else nxt.block_id)
            )
            out[b] = (blk.ref_cnt, key, *links)
        for k in want_keys:
            if k not in holders:
                holders[k] = held(k)
        self._prune_names()
        first, last = head.next_free_block, tail.prev_free_block
        ends = (END, END) if first is tail or first is None else (first.block_id, last.block_id)
        return PartialState(out, holders, tables, queue.num_free_blocks, events, ends)

    def _prefix(self, h: bytes) -> Prefix:
        if not self.track_prefixes:
            return prefix(tuple(bytes(h)))  # stand-in (see the module docstring)
        h = bytes(h)
        named = self._name(h)
        if named is None:
            self._learn_pending()
            named = self._name(h)
        if named is None:
            raise TargetCrash(f"hash {bytes(h).hex()[:16]}... comes from no known request")
        return named

    def _name(self, h: bytes) -> Prefix | None:
        if self.caps.coarse_hash == "concat" and h not in self._names:
            # Releases that key a wide block by its fine hashes joined: the last
            # one already chains over the whole prefix.
            h = h[-len(self._names.any_hash() or h) :]
        return self._names.name(h)

    def _map_key(self, k: BlockKey) -> bytes | None:
        """The key vLLM files `k` under in its hash map (the inverse of `_key`); None
        when the prefix has no hash. A "concat" release keys a block wider than the
        hash block by the fine hashes it spans, joined in order; those hashes are
        the release's own (the learnt table, else a throw-away request's)."""
        group = k.group.to_bytes(4, "big")
        if not self.track_prefixes:
            return bytes(k.tokens.tokens()) + group  # the stand-in is the key's bytes
        n, hbs = len(k.tokens), self.hbs
        width = self.config.groups[k.group].block_size if self.caps.coarse_hash == "concat" else hbs
        if width == hbs or n < width or n % width:
            h = self._names.hash_of(k.tokens)
            return None if h is None else h + group
        parts = [self._names.hash_of(k.tokens.head(end)) for end in range(n - width + hbs, n + 1, hbs)]
        if any(h is None for h in parts):
            return None
        return b"".join(h for h in parts if h is not None) + group

    def _key(self, key: bytes) -> BlockKey:
        """BlockHashWithGroupId (hash bytes + 4-byte big-endian group) -> BlockKey, memoised."""
        out = self._keys.get(key)
        if out is None:
            out = self._keys[key] = BlockKey(int.from_bytes(key[-4:], "big"), self._prefix(key[:-4]))
        return out

    def _event_prefix(self, h: bytes | int) -> Prefix:
        if isinstance(h, int):
            if not self.track_prefixes:
                return prefix((h,))  # stand-in (see the module docstring)
            named = self._names.name_int(h)
            if named is None:
                self._learn_pending()
                named = self._names.name_int(h)
            if named is None:
                raise TargetCrash(f"event hash {h:#x} comes from no known request")
            return named
        return self._prefix(h)

    def _event(self, ev: Any) -> list[Event]:
        """vLLM's KV event as the model's, every field translated (`vllm_hashing.event_fields`)."""
        kv, gaps = self._v, self._event_gaps
        if isinstance(ev, kv["BlockStored"]):
            parent = None if ev.parent_block_hash is None else self._event_prefix(ev.parent_block_hash)
            hashes = tuple(self._event_prefix(h) for h in ev.block_hashes)
            meta = event_fields(ev, BlockStored, gaps, self.config, len(hashes))
            return [BlockStored(ev.group_idx, hashes, parent, tuple(ev.token_ids), ev.block_size, **meta)]
        if isinstance(ev, kv["BlockRemoved"]):
            meta = event_fields(ev, BlockRemoved, gaps, self.config, 1)
            return [BlockRemoved(ev.group_idx, self._event_prefix(h), **meta) for h in ev.block_hashes]
        if isinstance(ev, kv["AllBlocksCleared"]):
            return [AllBlocksCleared()]
        raise TargetCrash(f"unexpected KV event {type(ev).__name__}")

    @functools.cached_property
    def _event_gaps(self) -> EventGaps:
        return event_gaps(self.caps.event_fields, self._v["BlockRemoved"])

    @property
    def uncompared_event_fields(self) -> tuple[str, ...]:
        """The KV event fields no comparison sees on this release; none on vLLM 0.33.0."""
        return self._event_gaps.uncompared()


# ----------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _retention_env(interval: int | None) -> Iterator[None]:
    """A release that reads the retention interval from the environment sees
    `interval` while its coordinator is built; the variable is restored after."""
    old = os.environ.pop(RETENTION_ENV, None)
    if interval is not None:
        os.environ[RETENTION_ENV] = str(interval)
    try:
        yield
    finally:
        os.environ.pop(RETENTION_ENV, None)
        if old is not None:
            os.environ[RETENTION_ENV] = old


def _ids(blocks: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(ids) for ids in blocks.get_block_ids())


def _walk_free_queue(queue: Any, num_blocks: int) -> tuple[int, ...]:
    """Head to tail; a corrupted (cyclic) list ends with -1 instead of looping forever."""
    out: list[int] = []
    cur = queue.fake_free_list_head.next_free_block
    while cur is not None and cur is not queue.fake_free_list_tail:
        if len(out) > num_blocks:
            out.append(-1)
            break
        out.append(cur.block_id)
        cur = cur.next_free_block
    return tuple(out)


__all__ = [
    "MODELED_VERSION",
    "NO_PINNED_TIER",
    "VLLM_EVENT_PROFILE",
    "UnsupportedConfig",
    "VllmTarget",
]


def _vllm_package_dir() -> str:
    import vllm

    return os.path.dirname(os.path.abspath(vllm.__file__))
