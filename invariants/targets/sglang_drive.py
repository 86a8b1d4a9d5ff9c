"""Driving SGLang's real radix cache the way its scheduler does, one `RadixOp` at a time.

Each op calls SGLang's own scheduler-side functions, not copies of them:
`Req.init_next_round_input` (match_prefix and Mamba copy-on-write),
`UnifiedRadixCache.lock`, `alloc_req_slots`, `alloc_token_slots` /
`alloc_paged_token_slots_extend` (which evict under pressure),
`alloc_for_decode_default` (a decode step: `ScheduleBatch.maybe_evict_swa`, the
running request's SWA window, then one slot, by `alloc_token_slots` or
`alloc_paged_token_slots_decode`), `checkpoint_kv_cache` (an unfinished
request's chunk), `release_kv_cache` (finish with checkpoint, abort without)
and `evict`.

The only glue written here is what a `ScheduleBatch` does around those calls
for a batch of one: writing the prefix and the new slots into the request's
row and advancing its lengths. A request's identity goes in as SGLang's scheduler passes it: `Req(lora_id=...,
cache_salt=...)` (the Req appends the adapter id to its `extra_key`; both namespace every
`RadixKey` SGLang builds for it, on match and on every insert), and the adapter's name in
the cache's KV-event LoRA table. The driver records which identity was allocated each
full-attention slot (`slot_writer`), the provenance the isolation check reads.

An op the pools cannot serve (SGLang raises
"out of memory") is *rejected*: the request is rolled back the way the
scheduler drops it, and the result says so.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import uuid
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from invariants.targets.sglang_build import SglangParts, build_cache
from invariants.targets.sglang_env import MODELED_VERSION, sglang_version
from model.radix.config import RadixLayout
from model.radix.ops import Abort, Admit, Decode, Evict, Extend, Finish, RadixOp
from model.radix.tree import DEFAULT_NAMESPACE, Namespace


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Silence file descriptor 1 (Python and native writers) for the block."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


@dataclass
class OpResult:
    """What one op did, as the scheduler sees it."""

    hit: int | None = None  # Admit: device prefix length reported by match_prefix
    max_len: int | None = None  # Admit: the match limit (input length - 1)
    evicted: tuple[int, int, int] | None = None  # Evict: (full tokens, SWA tokens, Mamba states)
    rejected: str | None = None  # the pools could not serve it (SGLang's out-of-memory)
    skipped: bool = False  # the op named no live request (nothing done)
    locked_node: Any = None  # Admit: the node the request locked
    prefix_slots: tuple[int, ...] = ()  # Admit: the full-attention slots of the hit


@dataclass(frozen=True)
class TreeCall:
    """One lookup or insert of the tree core: its kind ("match" / "insert"), the path it
    ended on (node ids from the root's child; for a lookup, down to the node its recency
    refresh starts from, `best_match_node`) and the path it walked (a lookup may walk, and
    split, past its valid end; an insert walks its own path), as they stood after the call."""

    kind: str
    path: tuple[int, ...]
    walked: tuple[int, ...]


@dataclass
class RunningReq:
    req: Any
    tokens: tuple[int, ...]
    prefilled: int = 0
    decoded: list[int] = field(default_factory=list)
    namespace: Namespace = DEFAULT_NAMESPACE


def lora_id_of(name: str) -> str:
    """The adapter id SGLang's LoRA registry would give adapter `name` (a uuid hex, 32
    characters: `LoRARef.lora_id`), deterministic here so runs replay."""
    return uuid.uuid5(uuid.NAMESPACE_OID, f"kvretain-lora:{name}").hex


class SglangDriver:
    """One real cache instance plus the requests running on it."""

    # Whether requests' identities reach the cache (a legacy release's driver may not).
    passes_identity = True

    def __init__(self, layout: RadixLayout, core: str = "python", swa_eviction_interval: int = 1) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
        from sglang.srt.mem_cache import allocation, common
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.layout = layout
        # SGLANG_SWA_EVICTION_INTERVAL: SGLang's default (128 tokens) never slides windows
        # as short as these layouts' histories; 1 slides them at every due step.
        self.swa_eviction_interval = swa_eviction_interval
        self.parts: SglangParts = build_cache(layout, core)
        self.cache = self.parts.cache
        self.running: dict[int, RunningReq] = {}
        self._req_cls, self._sampling = Req, SamplingParams
        self._finish_length, self._finish_abort = FINISH_LENGTH, FINISH_ABORT
        self._alloc, self._common = allocation, common
        self.events: list[Any] = []
        # Set when SGLang refuses an allocation during the current op (see _refusal).
        self.last_refusal: dict[str, tuple[int, int, int]] | None = None
        # Where each tree-core lookup and insert of the current op ended, in call order.
        self.tree_calls: list[TreeCall] = []
        # The token each full-attention slot a request wrote holds (slot -> token id).
        self.slot_tokens: dict[int, int] = {}
        # The identity of the request each full-attention slot was last allocated to.
        self.slot_writer: dict[int, Namespace] = {}
        self.lora_by_id: dict[str, str] = {}  # adapter id (SGLang's extra_key) -> adapter name
        # The tree-core calls are observed on the release the model describes (0.5.23's
        # tree-core interface); another release's run is judged without them (the checker
        # counts the ops it could not judge per core).
        self.observes_tree = sglang_version() == MODELED_VERSION
        if self.observes_tree:
            self._observe_tree_core()

    def _observe_tree_core(self) -> None:
        """Record each lookup and insert of this cache's tree core as a `TreeCall`, with
        the paths as they stood right after the call (a later eviction in the same op may
        remove nodes). Wrappers on this instance only, calling the class's current method:
        SGLang's classes and results are untouched (a mutant patched on the class still runs)."""
        core = self.cache.tree_core
        cls = type(core)
        calls = self.tree_calls

        def path(node: int) -> tuple[int, ...]:
            if core.is_root(node):
                return ()
            return tuple(int(info.node_id) for info in core.collect_path_info([node])[0])

        def match_prefix(params: Any) -> Any:
            result = cls.match_prefix(core, params)
            best = int(result.best_match_node)
            visited = result.last_visited_node_id
            walked = path(int(visited)) if visited is not None else ()
            calls.append(TreeCall("match", path(best), walked))
            return result

        def noted(step: Any) -> Any:
            if step.result is not None:
                end = path(int(step.result.last_device_node))
                calls.append(TreeCall("insert", end, end))
            return step

        core.match_prefix = match_prefix
        core.begin_insert = lambda params: noted(cls.begin_insert(core, params))
        core.resume_insert = lambda: noted(cls.resume_insert(core))

    def _note_slot_tokens(self) -> None:
        """Remember the token of every slot a running request's row binds (its prompt and
        the sampled tokens written so far), so a tree value can be read back as tokens on a
        core that exposes slots but not keys (the Rust core)."""
        rows = self.parts.req_to_token_pool.req_to_token
        for run in self.running.values():
            kv = run.req.kv
            if not kv.holds_kv or kv.kv_allocated_len <= 0:
                continue
            seq = tuple(run.tokens) + tuple(run.decoded)
            n = min(kv.kv_allocated_len, len(seq))
            for pos, slot in enumerate(rows[kv.req_pool_idx, :n].tolist()):
                self.slot_tokens[int(slot)] = seq[pos]

    # -- ops -------------------------------------------------------------------

    def apply(self, op: RadixOp) -> OpResult:
        """Apply `op`; afterwards `tree_calls` holds this op's lookups and inserts."""
        self.tree_calls.clear()
        result = self._apply(op)
        self._note_slot_tokens()
        return result

    def _apply(self, op: RadixOp) -> OpResult:
        self.last_refusal = None
        if isinstance(op, Admit):
            return self._admit(op)
        if isinstance(op, Evict):
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            res = self.cache.evict(EvictParams(num_tokens=op.full, swa_num_tokens=op.swa, mamba_num=op.mamba))
            return OpResult(
                evicted=(res.num_tokens_evicted, res.swa_num_tokens_evicted, res.mamba_num_evicted)
            )
        run = self.running.get(op.rid)
        if run is None:
            return OpResult(skipped=True)
        if isinstance(op, Extend):
            return self._extend(run, op.chunk)
        if isinstance(op, Decode):
            return self._decode(run, op.tokens)
        if isinstance(op, Finish):
            return self._release(op.rid, checkpoint=True)
        if isinstance(op, Abort):
            return self._release(op.rid, checkpoint=False)
        raise TypeError(f"unknown op {op!r}")

    def _admit(self, op: Admit) -> OpResult:
        if op.rid in self.running or len(op.tokens) < 1:
            return OpResult(skipped=True)
        if self.parts.req_to_token_pool.available_size() < 1:
            return OpResult(rejected="no request slot")
        req = self._req_cls(
            rid=str(op.rid),
            origin_input_text="",
            origin_input_ids=array("q", op.tokens),
            sampling_params=self._sampling(temperature=0, max_new_tokens=1 << 20),
            lora_id=None if op.lora is None else lora_id_of(op.lora),
            cache_salt=op.salt,
        )
        if op.lora is not None:
            self.lora_by_id[lora_id_of(op.lora)] = op.lora
        if op.lora is not None and self.parts.lora_names is not None:
            self.parts.lora_names.register(req, op.lora)  # Scheduler._record_kv_event_lora_name
        req.init_next_round_input(self.cache)
        hit = req.prefix_len
        req.lock = self.cache.lock(req.last_node)
        run = RunningReq(req=req, tokens=op.tokens, prefilled=hit, namespace=op.namespace)
        prefix = self.cache.prefix_device_indices(req) if hit else torch.empty(0, dtype=torch.int64)
        prefix_slots = tuple(int(x) for x in prefix.tolist())
        try:
            self._alloc.alloc_req_slots(self.parts.req_to_token_pool, [req], self.cache)
        except RuntimeError as exc:
            self._drop_unbound(req)
            return OpResult(
                hit=hit,
                max_len=len(op.tokens) - 1,
                rejected=str(exc).splitlines()[0],
                prefix_slots=prefix_slots,
            )
        if hit:
            self.parts.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, hit)), prefix.to(torch.int32))
        req.kv.cache_protected_len = hit
        self.running[op.rid] = run
        result = self._extend(run, max(1, op.chunk), first=True)
        result.hit, result.max_len, result.locked_node = hit, len(op.tokens) - 1, req.last_node
        result.prefix_slots = prefix_slots
        return result

    def _drop_unbound(self, req: Any) -> None:
        """Undo an admission that got no request row: unlock, give back a CoW'd Mamba slot."""
        self.cache.unlock(req.lock)
        req.lock = None
        if req.kv.holds_mamba:
            self.parts.req_to_token_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
            req.kv.mamba_pool_idx = None

    def _new_slots(self, req: Any, start: int, count: int) -> torch.Tensor | None:
        """`count` slots for positions [start, start+count) of `req`'s row, evicting under pressure."""
        page = self.layout.page_size
        # SGLang prints its tree on out-of-memory (the Rust core from native code);
        # a rejection is an outcome here, not news.
        with _quiet_stdout():
            slots = self._alloc_quietly(req, start, count, page)
        if slots is None:
            self.last_refusal = self._refusal(start, count)
        return slots

    def _refusal(self, start: int, count: int) -> dict[str, tuple[int, int, int]]:
        """Per KV pool, right after SGLang refused: (tokens needed, available, evictable)."""
        page = self.layout.page_size
        need = (-(-(start + count) // page) - -(-start // page)) * page
        alloc, cache = self.parts.allocator, self.cache
        if not self.layout.has_swa:
            return {"full": (need, alloc.available_size(), cache.full_evictable_size())}
        return {
            "full": (need, alloc.full_available_size(), cache.full_evictable_size()),
            "swa": (need, alloc.swa_available_size(), cache.swa_evictable_size()),
        }

    def _alloc_quietly(self, req: Any, start: int, count: int, page: int) -> torch.Tensor | None:
        try:
            if page == 1:
                return self._alloc.alloc_token_slots(self.cache, count)
            row = self.parts.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            last = (
                row[start - 1 : start].to(torch.int64)
                if start > 0
                else torch.full((1,), -1, dtype=torch.int64)
            )
            pre = torch.tensor([start], dtype=torch.int64)
            seq = torch.tensor([start + count], dtype=torch.int64)
            return self._alloc.alloc_paged_token_slots_extend(
                tree_cache=self.cache,
                prefix_lens=pre,
                prefix_lens_cpu=pre,
                seq_lens=seq,
                seq_lens_cpu=seq,
                last_loc=last,
                extend_num_tokens=count,
            )
        except RuntimeError:
            return None

    def _grow(self, run: RunningReq, count: int) -> bool:
        """Allocate and bind `count` more positions of the request's row."""
        req = run.req
        start = req.kv.kv_allocated_len
        slots = self._new_slots(req, start, count)
        if slots is None:
            return False
        self.parts.req_to_token_pool.write(
            (req.kv.req_pool_idx, slice(start, start + count)), slots.to(torch.int32)
        )
        for slot in slots.tolist():
            self.slot_writer[int(slot)] = run.namespace
        req.kv.kv_allocated_len = start + count
        req.kv.kv_committed_len = start + count
        return True

    def _extend(self, run: RunningReq, chunk: int, first: bool = False) -> OpResult:
        req = run.req
        remaining = len(run.tokens) - run.prefilled
        if remaining <= 0:
            return OpResult(skipped=not first)
        if not first:
            # The previous chunk is published before the next one runs (cache_unfinished_req).
            req.extend_end = run.prefilled
            self._common.checkpoint_kv_cache(req, self.cache)
        count = min(chunk, remaining)
        if req.kv.kv_allocated_len == 0:
            req.kv.kv_allocated_len = req.kv.kv_committed_len = run.prefilled
        if not self._grow(run, count):
            if first:
                return self._undo_admission(run)
            return self._reject(run, "out of memory (extend)")
        run.prefilled += count
        req.prefix_len = run.prefilled
        return OpResult()

    def _decode(self, run: RunningReq, tokens: tuple[int, ...]) -> OpResult:
        """Each token is one sampled token. The first of a request is sampled by its prefill's
        forward (no slot: SGLang writes a token's KV at the next step); every later one is a
        decode step for a batch of one: `ScheduleBatch.check_decode_mem` (a step that does
        not fit retracts the request: released uncached, a rejection), then SGLang's
        `alloc_for_decode_default`: SWA window eviction of the request
        (`ScheduleBatch.maybe_evict_swa`, from the second step on), one slot for the
        position of the last sampled token; then the new token."""
        req = run.req
        if run.prefilled < len(run.tokens):
            return OpResult(skipped=True)  # still prefilling
        for token in tokens:
            if run.decoded and not self._decode_step(run):
                return self._reject(run, "out of memory (decode)")
            req.output_ids.append(token)
            run.decoded.append(token)
        return OpResult()

    def _decode_step(self, run: RunningReq) -> bool:
        from sglang.srt.environ import envs

        req, start = run.req, run.req.kv.kv_allocated_len
        batch = self._batch_of_one(req)
        # The scheduler first asks whether the step fits (evicting what it may); when it
        # does not, it retracts the request rather than letting the allocation fail.
        with _quiet_stdout():
            fits = batch.check_decode_mem()
        if not fits:
            self.last_refusal = self._refusal(start, 1)
            return False
        try:
            with _quiet_stdout(), envs.SGLANG_SWA_EVICTION_INTERVAL.override(self.swa_eviction_interval):
                self._decode_alloc()(batch, token_per_req=1)
        except RuntimeError:
            self.last_refusal = self._refusal(start, 1)
            return False
        slot = self.parts.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start]
        self.slot_writer[int(slot)] = run.namespace
        req.decode_batch_idx += 1  # ScheduleBatch.prepare_for_decode, after the allocation
        return True

    def _decode_alloc(self) -> Any:
        """The release's decode allocation for a CPU batch: `alloc_for_decode_default`
        (0.5.22, 0.5.23, where `alloc_for_decode` dispatches on the device), else
        `alloc_for_decode` (0.5.20, 0.5.21: the same body under its first name)."""
        return getattr(self._alloc, "alloc_for_decode_default", None) or self._alloc.alloc_for_decode

    def _batch_of_one(self, req: Any) -> Any:
        """The attributes of a decode `ScheduleBatch` holding only `req` that SGLang's
        decode allocation reads, with ScheduleBatch's own SWA-eviction methods bound to it."""
        import types

        from sglang.srt.managers.schedule_batch import ForwardMode, ScheduleBatch
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        seq = torch.tensor([req.kv.kv_allocated_len], dtype=torch.int64)
        idx = torch.tensor([req.kv.req_pool_idx], dtype=torch.int64)
        batch = types.SimpleNamespace(
            reqs=[req],
            tree_cache=self.cache,
            token_to_kv_pool_allocator=self.parts.allocator,
            req_to_token_pool=self.parts.req_to_token_pool,
            seq_lens=seq,
            seq_lens_cpu=seq.clone(),
            req_pool_indices=idx,
            req_pool_indices_cpu=idx.clone(),
            model_config=types.SimpleNamespace(is_encoder_decoder=False),
            forward_mode=ForwardMode.DECODE,
            forward_iter=0,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        methods = ("maybe_evict_swa", "_swa_eviction_trigger", "_evict_swa")
        for name in (*methods, "check_decode_mem", "new_tokens_required_next_decode"):
            setattr(batch, name, types.MethodType(getattr(ScheduleBatch, name), batch))
        return batch

    def _undo_admission(self, run: RunningReq) -> OpResult:
        """The first chunk found no room: the scheduler would not have admitted it.
        Give back the lock, the component state (Mamba) and the row."""
        req = run.req
        self.running.pop(int(req.rid))
        self.cache.unlock(req.lock)
        req.lock = None
        self.cache.on_release(req, checkpointed=False)
        if req.kv.holds_mamba:
            self.parts.req_to_token_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
            req.kv.mamba_pool_idx = None
        self.parts.req_to_token_pool.free(req)
        return OpResult(rejected="out of memory (admission)")

    def _reject(self, run: RunningReq, why: str) -> OpResult:
        """The scheduler aborts a request it cannot serve: release without caching."""
        self._release(int(run.req.rid), checkpoint=False)
        return OpResult(rejected=why)

    def _release(self, rid: int, checkpoint: bool) -> OpResult:
        run = self.running.pop(rid)
        req = run.req
        if checkpoint and run.prefilled < len(run.tokens):
            checkpoint = False  # a request finishes only after its prompt ran
        req.finished_reason = self._finish_length(length=0) if checkpoint else self._finish_abort()
        if not checkpoint and not req.kv.holds_kv:
            self._drop_unbound(req)
            return OpResult()
        self._common.release_kv_cache(req, self.cache, checkpoint=checkpoint)
        return OpResult()

    def take_events(self) -> list[Any]:
        return list(self.cache.take_events())
