"""A replay kit for SGLang's radix cache that imports only SGLang, torch and the standard library.

`kvretain export` of an SGLang finding copies this module's source, verbatim,
into the exported pytest file (below a marker line), so the file runs where
only SGLang is installed. It must therefore never import kvretain. It is the
same scheduler-side driving as kvretain's SGLang target
(`invariants/targets/sglang_drive.py`), written for one file:

- `install_standins()`: empty in-process modules for `torchvision`,
  `sgl_kernel`, `IPython`, `datasets` when they cannot be found (SGLang's
  import path reaches them on a CPU; the cache never calls into them);
- `build(layout, core)`: SGLang's real request pool, KV allocator and
  `UnifiedRadixCache` for a layout given as a dict;
- `Replay`: applies ops (dicts such as `{"op": "Admit", "rid": 0, ...}`) the
  way SGLang's scheduler does (an Admit's `lora` / `salt` go in as the Req's `lora_id`
  and `cache_salt`, the adapter's name in the cache's KV-event LoRA table), and reads back pool accounts, slot sets, free
  lists, the Python core's tree and the KV events;
- `CHECKS`: the invariants an exported finding asserts, by name.

tests/test_sglang_export.py holds this kit to the target: on fuzzed histories
both give the same results and pool accounts op by op.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import os
import sys
import types
import uuid
from array import array
from typing import Any

# SGLANG_SWA_EVICTION_INTERVAL for decode steps: SGLang's default (128) never slides a window
# as short as a small history's; 1 slides it at every due step (as kvretain's target does).
SWA_EVICTION_INTERVAL = 1

STANDIN_ROOTS: dict[str, dict[str, Any]] = {
    "torchvision": {"__version__": "0.0.0+standin"},
    "sgl_kernel": {},
    "IPython": {"get_ipython": lambda: None, "version_info": (0, 0, 0)},
    "datasets": {},
}


class _InertMeta(type):
    def __getattr__(cls, name: str) -> Any:  # class-level names (`InterpolationMode.NEAREST`)
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Inert(metaclass=_InertMeta):
    """Any name of a stand-in module: constructible, callable, every attribute inert."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Inert()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert


class _StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: frozenset[str]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.split(".")[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name, "stand-in: absent on a CPU machine, unused by the cache")
        module.__path__ = []
        module.__dict__.update(STANDIN_ROOTS.get(spec.name, {}))

        def _getattr(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Inert

        module.__getattr__ = _getattr  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install_standins() -> None:
    """Stand-ins for the roots that cannot be found, and SGLang's CPU environment."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if any(isinstance(f, _StandinFinder) for f in sys.meta_path):
        return
    missing = frozenset(
        r for r in STANDIN_ROOTS if r not in sys.modules and importlib.util.find_spec(r) is None
    )
    if missing:
        sys.meta_path.insert(0, _StandinFinder(missing))


def _req_pool(layout: dict[str, Any]) -> Any:
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, ReqToTokenPool

    common = dict(size=layout["max_reqs"], max_context_len=layout["max_context"], device="cpu")
    if "mamba" not in layout["components"]:
        return ReqToTokenPool(**common, enable_memory_saver=False)
    with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
        shape = Mamba2StateShape.create(
            tp_world_size=1,
            intermediate_size=32,
            n_groups=1,
            num_heads=2,
            head_dim=16,
            state_size=4,
            conv_kernel=4,
        )
        params = Mamba2CacheParams(shape=shape, layers=[0, 2])
    return HybridReqToTokenPool(
        **common,
        mamba_size=layout["mamba_size"],
        mamba_spec_state_size=layout["max_reqs"],
        enable_memory_saver=False,
        cache_params=params,
        mamba_layer_ids=[0, 2],
        enable_mamba_extra_buffer=layout["page_size"] > 1,
        speculative_num_draft_tokens=3,
    )


def _allocator(layout: dict[str, Any], req_pool: Any) -> Any:
    import torch
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MHATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    page, size = layout["page_size"], layout["kv_size"]
    kv_args = dict(dtype=torch.bfloat16, head_num=1, head_dim=8, device="cpu", page_size=page)
    alloc_args = dict(dtype=torch.bfloat16, device="cpu", need_sort=False)
    if "swa" in layout["components"]:
        swa_size = layout["swa_size"] or size
        kv = SWAKVPool(
            size=size,
            size_swa=swa_size,
            swa_attention_layer_ids=[0, 2],
            full_attention_layer_ids=[1, 3],
            **kv_args,
        )
        return SWATokenToKVPoolAllocator(
            size=size, size_swa=swa_size, page_size=page, kvcache=kv, **alloc_args
        )
    if "mamba" in layout["components"]:
        kv = HybridLinearKVPool(
            size=size,
            full_attention_layer_ids=[1, 3],
            enable_memory_saver=False,
            mamba_pool=req_pool.mamba_pool,
            **kv_args,
        )
    else:
        kv = MHATokenToKVPool(size=size, layer_num=4, enable_memory_saver=False, **kv_args)
    if page == 1:
        return TokenToKVPoolAllocator(size=size, kvcache=kv, **alloc_args)
    return PagedTokenToKVPoolAllocator(size=size, page_size=page, kvcache=kv, **alloc_args)


def build(layout: dict[str, Any], core: str, lora_names: Any = None) -> tuple[Any, Any, Any]:
    """(cache, allocator, request pool): SGLang's own classes for `layout` on tree core `core`
    (`lora_names`: the KV-event LoRA name table the cache reads, SGLang's `KvEventLoraNames`)."""
    install_standins()
    from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.events import KvEventLoraNames
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    args = ServerArgs(model_path="dummy", page_size=layout["page_size"])
    args._mamba_cache_chunk_size = max(CHUNK_SIZE, layout["page_size"])  # else read from the hub
    set_global_server_args_for_scheduler(args)
    req_pool = _req_pool(layout)
    allocator = _allocator(layout, req_pool)
    cache = UnifiedRadixCache(
        params=CacheInitParams(
            disable=False,
            req_to_token_pool=req_pool,
            token_to_kv_pool_allocator=allocator,
            page_size=layout["page_size"],
            sliding_window_size=layout["sliding_window"],
            tree_components=tuple(getattr(ComponentType, c.upper()) for c in layout["components"]),
            enable_mamba_extra_buffer="mamba" in layout["components"] and layout["page_size"] > 1,
            enable_kv_cache_events=True,
            eviction_policy="lru",
            tree_core_backend=core,
            kv_event_lora_names=KvEventLoraNames() if lora_names is None else lora_names,
        )
    )
    return cache, allocator, req_pool


def lora_id_of(name: str) -> str:
    """The adapter id (a uuid hex, as SGLang's LoRA registry gives) for adapter `name`."""
    return uuid.uuid5(uuid.NAMESPACE_OID, f"kvretain-lora:{name}").hex


@contextlib.contextmanager
def _quiet() -> Any:
    """SGLang prints its tree on out-of-memory (the Rust core from native code)."""
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


class Replay:
    """One cache on one tree core, driven op by op as SGLang's scheduler drives it."""

    def __init__(self, layout: dict[str, Any], core: str) -> None:
        import logging

        self.layout, self.core = layout, core
        self.page = layout["page_size"]
        self.swa, self.mamba = "swa" in layout["components"], "mamba" in layout["components"]
        install_standins()
        from sglang.srt.mem_cache.events import KvEventLoraNames

        self.lora_names = KvEventLoraNames()
        self.cache, self.allocator, self.req_pool = build(layout, core, self.lora_names)
        self.running: dict[int, dict[str, Any]] = {}
        self.events: list[Any] = []
        self.refusal: dict[str, tuple[int, int, int]] | None = None
        # Isolation: the identity (adapter, salt) each request has and each full-attention slot
        # was last allocated to, and the last admission's (identity, hit slots).
        self.identity_of: dict[str, tuple[Any, Any]] = {}
        self.slot_writer: dict[int, tuple[Any, Any]] = {}
        self.last_hit: tuple[tuple[Any, Any], list[int]] | None = None
        logging.getLogger("sglang").setLevel(logging.CRITICAL)

    def apply(self, op: dict[str, Any]) -> dict[str, Any]:
        """Apply one op; its result: hit, evicted, rejected (a reason) or skipped."""
        self.refusal = None
        self.last_hit = None
        kind = op["op"]
        if kind == "Admit":
            out = self._admit(op["rid"], tuple(op["tokens"]), op["chunk"], op.get("lora"), op.get("salt"))
        elif kind == "Evict":
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            res = self.cache.evict(
                EvictParams(num_tokens=op["full"], swa_num_tokens=op["swa"], mamba_num=op["mamba"])
            )
            out = {"evicted": (res.num_tokens_evicted, res.swa_num_tokens_evicted, res.mamba_num_evicted)}
        elif op["rid"] not in self.running:
            out = {"skipped": True}
        elif kind == "Extend":
            out = self._extend(self.running[op["rid"]], op["chunk"], first=False)
        elif kind == "Decode":
            out = self._decode(self.running[op["rid"]], tuple(op["tokens"]))
        else:
            out = self._release(op["rid"], checkpoint=kind == "Finish")
        self.events += list(self.cache.take_events())
        return out

    def _admit(
        self, rid: int, tokens: tuple[int, ...], chunk: int, lora: str | None = None, salt: str | None = None
    ) -> dict[str, Any]:
        import torch
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache import allocation
        from sglang.srt.sampling.sampling_params import SamplingParams

        if rid in self.running or not tokens:
            return {"skipped": True}
        if self.req_pool.available_size() < 1:
            return {"rejected": "no request slot"}
        req = Req(
            rid=str(rid),
            origin_input_text="",
            origin_input_ids=array("q", tokens),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1 << 20),
            lora_id=None if lora is None else lora_id_of(lora),
            cache_salt=salt,
        )
        if lora is not None:
            self.lora_names.register(req, lora)  # Scheduler._record_kv_event_lora_name
        req.init_next_round_input(self.cache)
        hit = req.prefix_len
        req.lock = self.cache.lock(req.last_node)
        prefix = self.cache.prefix_device_indices(req) if hit else None
        self.identity_of[str(rid)] = (lora, salt)
        if prefix is not None:
            self.last_hit = ((lora, salt), [int(x) for x in prefix.tolist()])
        try:
            allocation.alloc_req_slots(self.req_pool, [req], self.cache)
        except RuntimeError as exc:
            self._drop_unbound(req)
            return {"hit": hit, "rejected": str(exc).splitlines()[0]}
        if prefix is not None:
            self.req_pool.write((req.kv.req_pool_idx, slice(0, hit)), prefix.to(torch.int32))
        req.kv.cache_protected_len = hit
        run = {"req": req, "tokens": tokens, "prefilled": hit, "decoded": []}
        self.running[rid] = run
        out = self._extend(run, max(1, chunk), first=True)
        out["hit"] = hit
        return out

    def _drop_unbound(self, req: Any) -> None:
        self.cache.unlock(req.lock)
        req.lock = None
        if req.kv.holds_mamba:
            self.req_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
            req.kv.mamba_pool_idx = None

    def _slots(self, req: Any, start: int, count: int) -> Any:
        import torch
        from sglang.srt.mem_cache import allocation

        try:
            with _quiet():
                if self.page == 1:
                    return allocation.alloc_token_slots(self.cache, count)
                row = self.req_pool.req_to_token[req.kv.req_pool_idx]
                last = (
                    row[start - 1 : start].to(torch.int64)
                    if start
                    else torch.full((1,), -1, dtype=torch.int64)
                )
                pre, seq = torch.tensor([start]), torch.tensor([start + count])
                return allocation.alloc_paged_token_slots_extend(
                    tree_cache=self.cache,
                    prefix_lens=pre,
                    prefix_lens_cpu=pre,
                    seq_lens=seq,
                    seq_lens_cpu=seq,
                    last_loc=last,
                    extend_num_tokens=count,
                )
        except RuntimeError:
            self._note_refusal(start, count)
            return None

    def _note_refusal(self, start: int, count: int) -> None:
        """Per KV pool, right after SGLang refused: (tokens needed, available, evictable)."""
        need = (-(-(start + count) // self.page) - -(-start // self.page)) * self.page
        full_free = self.allocator.full_available_size() if self.swa else self.allocator.available_size()
        self.refusal = {"full": (need, full_free, self.cache.full_evictable_size())}
        if self.swa:
            swa_free = self.allocator.swa_available_size()
            self.refusal["swa"] = (need, swa_free, self.cache.swa_evictable_size())

    def _grow(self, req: Any, count: int) -> bool:
        import torch

        start = req.kv.kv_allocated_len
        slots = self._slots(req, start, count)
        if slots is None:
            return False
        self.req_pool.write((req.kv.req_pool_idx, slice(start, start + count)), slots.to(torch.int32))
        for slot in slots.tolist():
            self.slot_writer[int(slot)] = self.identity_of.get(str(req.rid), (None, None))
        req.kv.kv_allocated_len = req.kv.kv_committed_len = start + count
        return True

    def _extend(self, run: dict[str, Any], chunk: int, first: bool) -> dict[str, Any]:
        from sglang.srt.mem_cache import common

        req = run["req"]
        remaining = len(run["tokens"]) - run["prefilled"]
        if remaining <= 0:
            return {"skipped": not first}
        if not first:
            req.extend_end = run["prefilled"]
            common.checkpoint_kv_cache(req, self.cache)
        if req.kv.kv_allocated_len == 0:
            req.kv.kv_allocated_len = req.kv.kv_committed_len = run["prefilled"]
        count = min(chunk, remaining)
        if not self._grow(req, count):
            if first:
                return self._undo_admission(run)
            self._release(int(req.rid), checkpoint=False)
            return {"rejected": "out of memory (extend)"}
        run["prefilled"] += count
        req.prefix_len = run["prefilled"]
        return {}

    def _decode(self, run: dict[str, Any], tokens: tuple[int, ...]) -> dict[str, Any]:
        """The first sampled token comes from the prefill (no slot); each later one is a decode
        step: `check_decode_mem` (no fit: the request is retracted), `alloc_for_decode_default`."""
        req = run["req"]
        if run["prefilled"] < len(run["tokens"]):
            return {"skipped": True}
        for token in tokens:
            if run["decoded"] and not self._decode_step(req):
                self._release(int(req.rid), checkpoint=False)
                return {"rejected": "out of memory (decode)"}
            req.output_ids.append(token)
            run["decoded"].append(token)
        return {}

    def _decode_step(self, req: Any) -> bool:
        import torch
        from sglang.srt.environ import envs
        from sglang.srt.managers.schedule_batch import ForwardMode, ScheduleBatch
        from sglang.srt.mem_cache import allocation
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        seq = torch.tensor([req.kv.kv_allocated_len], dtype=torch.int64)
        idx = torch.tensor([req.kv.req_pool_idx], dtype=torch.int64)
        batch = types.SimpleNamespace(  # a decode batch of one, as SGLang's functions read it
            reqs=[req],
            tree_cache=self.cache,
            token_to_kv_pool_allocator=self.allocator,
            req_to_token_pool=self.req_pool,
            seq_lens=seq,
            seq_lens_cpu=seq.clone(),
            req_pool_indices=idx,
            req_pool_indices_cpu=idx.clone(),
            model_config=types.SimpleNamespace(is_encoder_decoder=False),
            forward_mode=ForwardMode.DECODE,
            forward_iter=0,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        for name in (
            "maybe_evict_swa",
            "_swa_eviction_trigger",
            "_evict_swa",
            "check_decode_mem",
            "new_tokens_required_next_decode",
        ):
            setattr(batch, name, types.MethodType(getattr(ScheduleBatch, name), batch))
        start = req.kv.kv_allocated_len
        with _quiet():
            fits = batch.check_decode_mem()
        try:
            if not fits:
                raise RuntimeError("retracted")
            with _quiet(), envs.SGLANG_SWA_EVICTION_INTERVAL.override(SWA_EVICTION_INTERVAL):
                allocation.alloc_for_decode_default(batch, token_per_req=1)
        except RuntimeError:
            self._note_refusal(start, 1)
            return False
        slot = int(self.req_pool.req_to_token[req.kv.req_pool_idx, start])
        self.slot_writer[slot] = self.identity_of.get(str(req.rid), (None, None))
        req.decode_batch_idx += 1
        return True

    def _undo_admission(self, run: dict[str, Any]) -> dict[str, Any]:
        req = run["req"]
        self.running.pop(int(req.rid))
        self.cache.unlock(req.lock)
        req.lock = None
        self.cache.on_release(req, checkpointed=False)
        if req.kv.holds_mamba:
            self.req_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
            req.kv.mamba_pool_idx = None
        self.req_pool.free(req)
        return {"rejected": "out of memory (admission)"}

    def _release(self, rid: int, checkpoint: bool) -> dict[str, Any]:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH
        from sglang.srt.mem_cache import common

        run = self.running.pop(rid)
        req = run["req"]
        checkpoint = checkpoint and run["prefilled"] >= len(run["tokens"])
        req.finished_reason = FINISH_LENGTH(length=0) if checkpoint else FINISH_ABORT()
        if not checkpoint and not req.kv.holds_kv:
            self._drop_unbound(req)
            return {}
        common.release_kv_cache(req, self.cache, checkpoint=checkpoint)
        return {}

    # -- observations ---------------------------------------------------------------

    def accounts(self) -> dict[str, tuple[int, int, int, int, int]]:
        """Per pool: (available, evictable, protected, held by running requests, size)."""
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        cache, alloc, page = self.cache, self.allocator, self.page
        reqs = [run["req"] for run in self.running.values() if run["req"].kv.holds_kv]

        def ceil(n: int) -> int:
            return -(-n // page) * page

        held = sum(ceil(r.kv.kv_allocated_len) - r.kv.cache_protected_len for r in reqs)
        free = alloc.full_available_size() if self.swa else alloc.available_size()
        size = alloc.size_full if self.swa else alloc.size
        out = {"full": (free, cache.full_evictable_size(), cache.full_protected_size(), held, size)}
        if self.swa:
            held_swa = sum(
                ceil(r.kv.kv_allocated_len)
                - r.kv.cache_protected_len
                - max(0, r.kv.get_evicted_seqlen(ComponentType.SWA) - r.kv.swa_dead_lo(page))
                for r in reqs
            )
            out["swa"] = (
                alloc.swa_available_size(),
                cache.swa_evictable_size(),
                cache.swa_protected_size(),
                held_swa,
                alloc.size_swa,
            )
        if self.mamba:
            held_m = sum(len(self.mamba_held(run["req"].kv)) for run in self.running.values())
            pool = self.req_pool
            out["mamba"] = (
                pool.mamba_allocator.available_size(),
                cache.mamba_evictable_size(),
                cache.mamba_protected_size(),
                held_m,
                pool.mamba_pool.size,
            )
        return out

    @staticmethod
    def mamba_held(kv: Any) -> list[int]:
        held = [int(x) for x in kv.mamba_pool_idx.reshape(-1).tolist()] if kv.holds_mamba else []
        if kv.mamba_ping_pong_track_buffer is not None:
            buf = kv.mamba_ping_pong_track_buffer.reshape(-1).tolist()
            held += [int(x) for x, empty in zip(buf, kv.mamba_ping_pong_empty, strict=False) if not empty]
        return held

    def free_lists(self) -> dict[str, list[int]]:
        full_alloc = self.allocator.full_attn_allocator if self.swa else self.allocator
        out = {"full": [int(p) for p in full_alloc.get_all_free_pages().tolist()]}
        if self.mamba:
            out["mamba"] = [int(x) for x in self.req_pool.mamba_allocator.free_slots.tolist()]
        return out

    def slot_sets(self) -> dict[str, dict[str, set[int]]]:
        """Full-attention (and Mamba) slots: free, cached in the tree, held by running requests."""
        page, rows = self.page, self.req_pool.req_to_token
        held: set[int] = set()
        for run in self.running.values():
            kv = run["req"].kv
            if kv.holds_kv:
                held.update(
                    int(x)
                    for x in rows[kv.req_pool_idx, kv.cache_protected_len : kv.kv_allocated_len].tolist()
                )
        free = {p * page + i for p in self.free_lists()["full"] for i in range(page)}
        out = {"full": {"free": free, "cached": set(self.cache.all_values_flatten().tolist()), "held": held}}
        if self.mamba:
            out["mamba"] = {
                "free": set(self.free_lists()["mamba"]),
                "cached": {int(x) for x in self.cache.all_mamba_values_flatten().tolist()},
                "held": {x for run in self.running.values() for x in self.mamba_held(run["req"].kv)},
            }
        return out

    def tree(self) -> dict[tuple[int, ...], dict[str, Any]]:
        """The Python core's nodes by their token prefix: full KV, SWA, locks, last access, leaf."""
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        root = self.cache.tree_core.root_node
        out: dict[tuple[int, ...], dict[str, Any]] = {}
        stack = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                key = prefix + tuple(child.key.token_ids)
                full = child.component_data[ComponentType.FULL]
                out[key] = {
                    "id": child.id,
                    "edge": len(child.key.token_ids),
                    "full": full.value is not None,
                    "full_lock": full.lock_ref,
                    "last_access": float(child.last_access_time),
                    "leaf": not child.children,
                }
                stack.append((child, key))
        return out

    def event_pages(self) -> set[tuple[int, ...]]:
        """The cached pages that BlockStored / BlockRemoved / AllBlocksCleared replay to."""
        prefix_of: dict[Any, tuple[int, ...]] = {}
        for ev in self.events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                prefix_of.clear()
            elif kind == "BlockStored":
                base = () if ev.parent_block_hash is None else prefix_of[ev.parent_block_hash]
                for i, h in enumerate(ev.block_hashes):
                    base = base + tuple(ev.token_ids[i * self.page : (i + 1) * self.page])
                    prefix_of[h] = base
            elif kind == "BlockRemoved":
                for h in ev.block_hashes:
                    assert prefix_of.pop(h, None) is not None, f"BlockRemoved names a block never stored: {h}"
        return set(prefix_of.values())

    def tree_pages(self) -> set[tuple[int, ...]]:
        pages = set()
        for key, node in self.tree().items():
            if node["full"]:
                base = key[: len(key) - node["edge"]]
                pages |= {key[:end] for end in range(len(base) + self.page, len(key) + 1, self.page)}
        return pages


# -- the invariants an export asserts (each raises AssertionError with its reading) ----------


def check_sanity(r: Replay, **_: Any) -> None:
    r.cache.sanity_check()


def check_conservation(r: Replay, **_: Any) -> None:
    for pool, (free, evictable, protected, held, size) in r.accounts().items():
        total = free + evictable + protected + held
        assert total == size, (
            f"{pool} pool: available {free} + evictable {evictable} + protected {protected} + held {held}"
            f" = {total} != size {size}"
        )


def check_disjoint(r: Replay, **_: Any) -> None:
    for pool, sets in r.slot_sets().items():
        for a, b in (("free", "cached"), ("free", "held"), ("cached", "held")):
            both = sets[a] & sets[b]
            assert not both, f"{pool} slots both {a} and {b}: {sorted(both)[:8]}"


def check_free_list_unique(r: Replay, **_: Any) -> None:
    for pool, ids in r.free_lists().items():
        assert len(ids) == len(set(ids)), f"{pool} free list holds a slot twice"


def check_refusal(r: Replay, **_: Any) -> None:
    if r.refusal is not None:
        shown = ", ".join(
            f"{p}: need {n}, available {a}, evictable {e}" for p, (n, a, e) in r.refusal.items()
        )
        assert any(n > a + e for n, a, e in r.refusal.values()), (
            f"refused although every pool could serve ({shown})"
        )


def check_locked_paths(r: Replay, **_: Any) -> None:
    tree = r.tree()
    by_id = {node["id"]: key for key, node in tree.items()}
    for rid, run in r.running.items():
        req = run["req"]
        if req.lock is None or req.last_node == r.cache.tree_core.root_node.id:
            continue
        key = by_id.get(int(req.last_node))
        assert key is not None, f"request {rid}'s locked node {int(req.last_node)} was removed"
        for k, node in tree.items():
            if key[: len(k)] == k:
                assert node["full"] and node["full_lock"] > 0, f"request {rid}'s locked path lost KV or lock"


def check_prefix_backed(r: Replay, **_: Any) -> None:
    """A running request's matched prefix (row slots before cache_protected_len) is cached, never free."""
    sets, rows = r.slot_sets()["full"], r.req_pool.req_to_token
    for rid, run in r.running.items():
        kv = run["req"].kv
        if kv.holds_kv and kv.cache_protected_len > 0:
            prefix = {int(x) for x in rows[kv.req_pool_idx, : kv.cache_protected_len].tolist()}
            assert not prefix & sets["free"], (
                f"request {rid}'s prefix slots {sorted(prefix & sets['free'])[:8]} are free"
            )
            assert prefix <= sets["cached"], (
                f"request {rid}'s prefix slots {sorted(prefix - sets['cached'])[:8]} left the tree"
            )


def check_events(r: Replay, **_: Any) -> None:
    replayed, cached = r.event_pages(), r.tree_pages()
    assert replayed == cached, (
        f"events name {len(replayed - cached)} pages the tree does not hold; "
        f"the tree holds {len(cached - replayed)} pages no event announced"
    )


def check_eviction_lru(r: Replay, before: dict[Any, Any] | None = None, **_: Any) -> None:
    """A full-attention eviction removed no node used later than an unlocked leaf it kept."""
    if before is None:
        return
    after = r.tree()
    ids_after = {n["id"] for n in after.values()}
    removed = [n for n in before.values() if n["id"] not in ids_after]
    if not removed:
        return
    newest = max(n["last_access"] for n in removed)
    kept_ids = {n["id"] for n in after.values() if n["full"]}
    older = [
        n["id"]
        for n in before.values()
        if n["leaf"] and n["full_lock"] == 0 and n["id"] in kept_ids and n["last_access"] < newest
    ]
    assert not older, f"eviction removed a node used at {newest} but kept older unlocked leaves {older}"


def check_same_identity(r: Replay, **_: Any) -> None:
    """Isolation: every slot an admission's hit hands it was written by its own identity."""
    if r.last_hit is None:
        return
    identity, slots = r.last_hit
    other = [s for s in slots if r.slot_writer.get(s) != identity]
    assert not other, (
        f"a request of identity {identity} hit {len(other)} slot(s) written by another identity "
        f"(slot {other[0]}: {r.slot_writer.get(other[0])})"
    )


CHECKS = {
    "sglang_sanity_check": check_sanity,
    "radix_hit_same_identity": check_same_identity,
    "radix_pool_conservation": check_conservation,
    "radix_slots_disjoint": check_disjoint,
    "radix_free_list_unique": check_free_list_unique,
    "radix_refusal_justified": check_refusal,
    "radix_locked_paths_kept": check_locked_paths,
    "radix_events_replay": check_events,
    "radix_running_prefix_backed": check_prefix_backed,
    "radix_eviction_lru": check_eviction_lru,
}


def full_hit(r: Replay, tokens: tuple[int, ...], max_len: int) -> int:
    """Full-attention layouts: the longest whole-page prefix of `tokens[:max_len]` the tree holds."""
    keys = [k for k, node in r.tree().items() if node["full"]]
    best = 0
    for end in range(r.page, max_len + 1, r.page):
        if any(len(k) >= end and k[:end] == tokens[:end] for k in keys):
            best = end
    return best


class SetupDiverged(Exception):
    """An op before the finding behaved otherwise than when the finding was recorded: the
    history no longer reaches the finding's state (re-derive it; this is not a pass)."""


def expect(got: Any, want: Any, what: str) -> None:
    if got != want:
        raise SetupDiverged(f"{what}: got {got!r}, recorded {want!r}")
