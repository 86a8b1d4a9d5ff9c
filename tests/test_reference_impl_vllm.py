"""reference_impl against vLLM 0.33.0 itself, operation by operation.

Seeded random workloads (shared prefixes, chunked prefill, decode, preemption,
probes, evictions, resets) on Full / SWA / Mamba(align) configurations where the
seeds' design and vLLM agree (pinned tier off). After every operation the
observable state must be equal: free-queue order, ref counts, block tables, the
hash map and primary keys (as token prefixes), lookup / allocation results.
Events are compared in the part both profiles share (which keys were stored /
removed, in order, one entry per key); how stored keys are grouped into events
and their token ranges differ by design (docs/semantics.md).
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("PYTHONHASHSEED", "0")

try:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as vku
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import Request as VllmRequest
    from vllm.v1.request import RequestStatus as VllmStatus

    vku.init_none_hash(sha256)
    logging.disable(logging.WARNING)
    VLLM_ERROR = ""
except Exception as exc:  # pragma: no cover - depends on the environment
    VLLM_ERROR = f"vllm 0.33.0 cannot be imported: {type(exc).__name__}: {exc}"

from reference_impl import AllocatorConfig, KVCacheGroupConfig, KVCacheManager, Scheduler, kv_events
from reference_impl.hashing import get_block_hash, get_group_id

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(VLLM_ERROR), reason=VLLM_ERROR or "n/a")]

G = KVCacheGroupConfig


# --------------------------------------------------------------------------- vLLM driver
class VllmDriver:
    """Drives vLLM's KVCacheManager like the reference Scheduler (docs/semantics.md)."""

    def __init__(self, cfg: AllocatorConfig) -> None:
        specs: list[Any] = []
        for g in cfg.groups:
            if g.kind == "full":
                specs.append(
                    FullAttentionSpec(
                        block_size=g.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
                    )
                )
            elif g.kind == "swa":
                specs.append(
                    SlidingWindowSpec(
                        block_size=g.block_size,
                        num_kv_heads=1,
                        head_size=1,
                        dtype=torch.float32,
                        sliding_window=cast(int, g.sliding_window),
                    )
                )
            else:
                specs.append(
                    MambaSpec(
                        block_size=g.block_size,
                        shapes=((1,),),
                        dtypes=(torch.float32,),
                        mamba_cache_mode="align",
                    )
                )
        kcfg = KVCacheConfig(
            num_blocks=cfg.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)],
            prefix_cache_retention_interval=cfg.retention_interval,
        )
        self.cfg = cfg
        self.m = VllmKVCacheManager(
            kcfg,
            max_model_len=cfg.max_model_len,
            scheduler_block_size=cfg.scheduler_block_size,
            hash_block_size=cfg.hash_block_size,
            enable_caching=cfg.enable_caching,
            use_eagle=cfg.use_eagle,
            enable_kv_cache_events=True,
        )
        self.requests: dict[str, Any] = {}
        self.prefix: dict[bytes, tuple[int, ...]] = {}

    def _label(self, r: Any) -> None:
        hbs = self.cfg.hash_block_size
        toks = tuple(r.all_token_ids)
        for i, h in enumerate(r.block_hashes):
            self.prefix.setdefault(bytes(h), toks[: (i + 1) * hbs])

    def _request(self, rid: str, tokens: list[int]) -> Any:
        sp = SamplingParams(max_tokens=100000)
        sp.update_from_generation_config({}, eos_token_id=10**9)
        r = VllmRequest(
            request_id=rid,
            prompt_token_ids=list(tokens),
            mm_features=None,
            sampling_params=sp,
            pooling_params=None,
            block_hasher=vku.get_request_block_hasher(self.cfg.hash_block_size, sha256),
        )
        self._label(r)
        return r

    def split(self, r: Any, start: int, n: int, budget: int) -> int:
        # Same rule as reference_impl.Scheduler.mamba_block_aligned_split (docs/semantics.md).
        prefill_end = max(r.num_prompt_tokens, r.num_tokens - 1)
        if start >= prefill_end or n <= 0:
            return n
        cbs = self.cfg.scheduler_block_size
        end = start + n
        if end < prefill_end:
            aligned = end // cbs * cbs
            if aligned > start or cbs <= budget:
                end = aligned
        if self.cfg.use_eagle:
            last = max(r.num_tokens // cbs * cbs - cbs, 0)
        else:
            last = max((r.num_tokens - 1) // cbs * cbs, 0)
        j = r.shared_prefix_boundary
        stops = (
            (start // cbs + 1) * cbs if start % cbs else 0,
            last,
            start + (j - start) // cbs * cbs if start < j < end else 0,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    @staticmethod
    def _ids(blocks: Any) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(b.block_id for b in g) for g in blocks.blocks)

    def add(self, rid: str, prompt: list[int]) -> None:
        self.requests[rid] = self._request(rid, prompt)

    def schedule(self, rid: str, budget: int) -> tuple:
        m, r = self.m, self.requests[rid]
        m.new_step_starts()
        has_mamba = self.cfg.has_mamba
        if r.status == VllmStatus.RUNNING:
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            if has_mamba:
                n = self.split(r, r.num_computed_tokens, n, budget)
            if n <= 0:
                return (0, False, None, None, None, None)
            out = m.allocate_slots(r, n)
            if out is None:
                return (0, False, None, None, None, None)
            r.num_computed_tokens += n
            return (n, False, None, None, None, self._ids(out))
        cb, hit, spb = m.get_computed_blocks(r)
        r.shared_prefix_boundary = spb
        hit_ids = self._ids(cb)
        n = min(r.num_tokens - hit, budget)
        if has_mamba:
            n = self.split(r, r.num_computed_tokens + hit, n, budget)
        if n <= 0:
            return (0, False, hit, spb, hit_ids, None)
        out = m.allocate_slots(r, n, num_new_computed_tokens=hit, new_computed_blocks=cb)
        copies, retained = m.take_kv_cache_block_copies()
        assert not copies and not retained
        if out is None:
            return (0, False, hit, spb, hit_ids, None)
        r.status = VllmStatus.RUNNING
        r.num_computed_tokens = hit + n
        return (n, True, hit, spb, hit_ids, self._ids(out))

    def sample(self, rid: str, tok: int) -> None:
        r = self.requests[rid]
        r.append_output_token_ids(tok)
        self._label(r)

    def finish(self, rid: str) -> None:
        self.m.free(self.requests.pop(rid))

    def preempt(self, rid: str) -> None:
        r = self.requests[rid]
        self.m.free(r)
        r.status = VllmStatus.PREEMPTED
        r.num_computed_tokens = 0

    def probe(self, tokens: list[int]) -> tuple:
        cb, hit, spb = self.m.get_computed_blocks(self._request("__probe__", tokens))
        return (hit, spb, self._ids(cb))

    def state(self) -> dict[str, Any]:
        pool = self.m.block_pool
        cached: dict[tuple[int, tuple[int, ...]], tuple[int, ...]] = {}
        for key, val in pool.cached_block_hash_to_block._cache.items():
            blocks = list(val.values()) if isinstance(val, dict) else [val]
            cached[(vku.get_group_id(key), self.prefix[bytes(vku.get_block_hash(key))])] = tuple(
                b.block_id for b in blocks
            )
        primary = {
            b.block_id: (vku.get_group_id(b.block_hash), self.prefix[bytes(vku.get_block_hash(b.block_hash))])
            for b in pool.blocks
            if b.block_hash is not None
        }
        tables = {}
        for rid in self.requests:
            ids = tuple(tuple(g) for g in self.m.get_block_ids(rid))
            if any(ids):
                tables[rid] = ids
        events: list[tuple[Any, ...]] = []
        for e in self.m.take_events():  # vLLM event objects (untyped here)
            e = cast(Any, e)
            name = type(e).__name__
            if name == "BlockStored":
                # Per key: vLLM emits one event per call (empty ones too), the seed profile one per run.
                events.extend(("stored", e.group_idx, self._ev_prefix(h)) for h in e.block_hashes)
            elif name == "BlockRemoved":
                events.append(("removed", e.group_idx, self._ev_prefix(e.block_hashes[0])))
            else:
                events.append(("cleared",))
        return {
            "free": tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks()),
            "ref": tuple(0 if b.is_null else b.ref_cnt for b in pool.blocks),
            "cached": cached,
            "primary": primary,
            "tables": tables,
            "events": events,
        }

    def _ev_prefix(self, h: Any) -> tuple[int, ...]:
        if isinstance(h, int):  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: low 64 bits
            for full, pre in self.prefix.items():
                if int.from_bytes(full[-8:], "big") == h:
                    return pre
            raise KeyError(h)
        return self.prefix[bytes(h)]


# --------------------------------------------------------------------------- reference driver
@dataclass
class RefDriver:
    cfg: AllocatorConfig
    prefix: dict[bytes, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kvm = KVCacheManager(self.cfg)
        self.s = Scheduler(self.kvm, on_new_block_hashes=self._label)

    def _label(self, r: Any, first: int) -> None:
        hbs = self.cfg.hash_block_size
        toks = tuple(r.all_token_ids)
        for i in range(first, len(r.block_hashes)):
            self.prefix.setdefault(r.block_hashes[i], toks[: (i + 1) * hbs])

    def _key(self, key: bytes) -> tuple[int, tuple[int, ...]]:
        return (get_group_id(key), self.prefix[get_block_hash(key)])

    def state(self) -> dict[str, Any]:
        pool = self.kvm.block_pool
        events: list[tuple[Any, ...]] = []
        for e in self.kvm.take_events():
            if isinstance(e, kv_events.BlockStored):
                events.extend(("stored", e.group_idx, self.prefix[h]) for h in e.block_hashes)
            elif isinstance(e, kv_events.BlockRemoved):
                events.append(("removed", e.group_idx, self.prefix[e.block_hashes[0]]))
            else:
                events.append(("cleared",))
        return {
            "free": tuple(b.block_id for b in pool.free_block_queue.iter_blocks()),
            "ref": tuple(0 if b.is_null else b.ref_cnt for b in pool.blocks),
            "cached": {
                self._key(k): tuple(b.block_id for b in v) for k, v in pool.cached_block_hash_to_block.items()
            },
            "primary": {b.block_id: self._key(b.block_hash) for b in pool.blocks if b.block_hash is not None},
            "tables": {
                rid: tuple(tuple(g) for g in self.kvm.get_block_ids(rid))
                for rid in self.kvm.request_ids_with_blocks()
            },
            "events": events,
        }


# --------------------------------------------------------------------------- workloads
CONFIGS: dict[str, AllocatorConfig] = {}


def _add(name: str, groups: tuple[KVCacheGroupConfig, ...], **kw: Any) -> None:
    CONFIGS[name] = AllocatorConfig(groups=groups, name=name, **kw)


for _r in (None, 0, 32):
    _add(f"full8+swa8w12-R{_r}", (G("full", 8), G("swa", 8, 12)), num_blocks=40, retention_interval=_r)
    _add(f"full16+swa8w12-R{_r}", (G("full", 16), G("swa", 8, 12)), num_blocks=40, retention_interval=_r)
    _add(f"full8+mamba8-R{_r}", (G("full", 8), G("mamba", 8)), num_blocks=40, retention_interval=_r)
    _add(
        f"full16+swa8w12-eagle-R{_r}",
        (G("full", 16), G("swa", 8, 12)),
        num_blocks=40,
        retention_interval=_r,
        use_eagle=True,
    )
_add("full16+mamba8-R0", (G("full", 16), G("mamba", 8)), num_blocks=40, retention_interval=0)
_add(
    "full8+mamba8-eagle-R0",
    (G("full", 8), G("mamba", 8)),
    num_blocks=40,
    retention_interval=0,
    use_eagle=True,
)
_add(
    "full8+swa8+mamba8-R0",
    (G("full", 8), G("swa", 8, 12), G("mamba", 8)),
    num_blocks=48,
    retention_interval=0,
)
_add(
    "full8+full8+swa8-R32",
    (G("full", 8), G("full", 8), G("swa", 8, 20)),
    num_blocks=48,
    retention_interval=32,
)
_add("full8-R0", (G("full", 8),), num_blocks=24, retention_interval=0)
_add("swa8w12-R16", (G("swa", 8, 12),), num_blocks=24, retention_interval=16)
_add("full8+swa8-nocache", (G("full", 8), G("swa", 8, 12)), num_blocks=32, enable_caching=False)


def random_workload(rng: random.Random, n_ops: int) -> list[tuple]:
    """Well-formed ops over a few requests sharing prefixes."""
    bases = [[rng.randrange(1, 50) for _ in range(rng.randrange(8, 60))] for _ in range(3)]
    ops: list[tuple] = []
    state: dict[str, str] = {}  # rid -> waiting / running
    tokens: dict[str, int] = {}
    computed: dict[str, int] = {}
    next_id = 0
    tok = 1000
    for _ in range(n_ops):
        live = list(state)
        choice = rng.random()
        if choice < 0.15 or not live:
            rid = f"r{next_id}"
            next_id += 1
            base = rng.choice(bases)
            prompt = base[: rng.randrange(1, len(base) + 1)] + [
                rng.randrange(1, 50) for _ in range(rng.randrange(0, 20))
            ]
            ops.append(("add", rid, prompt))
            state[rid], tokens[rid], computed[rid] = "waiting", len(prompt), 0
            continue
        rid = rng.choice(live)
        if choice < 0.60:
            ops.append(("schedule", rid, rng.choice([1, 4, 8, 16, 24, 64])))
        elif choice < 0.78:
            ops.append(("sample", rid, tok))
            tok += 1
        elif choice < 0.84:
            ops.append(("finish", rid))
            del state[rid]
        elif choice < 0.88:
            ops.append(("preempt", rid))
        elif choice < 0.95:
            base = rng.choice(bases)
            ops.append(("probe", base[: rng.randrange(1, len(base) + 1)]))
        elif choice < 0.98:
            ops.append(("evict", sorted({rng.randrange(1, 24) for _ in range(rng.randrange(1, 4))})))
        else:
            ops.append(("reset",))
    return ops


def run_both(cfg: AllocatorConfig, ops: list[tuple]) -> None:
    ref, ref_state = RefDriver(cfg), {}
    vl = VllmDriver(cfg)
    for step, op in enumerate(ops):
        kind = op[0]
        ctx = f"{cfg.name} step {step} {op}"
        if kind == "add":
            ref.s.add_request(op[1], op[2])
            vl.add(op[1], op[2])
            continue
        if kind in ("sample", "schedule", "finish", "preempt") and op[1] not in ref.s.requests:
            continue
        if kind == "sample":
            r = ref.s.requests[op[1]]
            if r.status.value != "running" or r.num_computed_tokens != r.num_tokens:
                continue
            ref.s.sample(op[1], op[2])
            vl.sample(op[1], op[2])
        elif kind == "schedule":
            o = ref.s.schedule(op[1], op[2])
            got = (o.scheduled, o.admitted, o.hit, o.shared_prefix_boundary, o.hit_blocks, o.new_blocks)
            assert got == vl.schedule(op[1], op[2]), ctx
        elif kind == "finish":
            ref.s.finish(op[1])
            vl.finish(op[1])
        elif kind == "preempt":
            ref.s.preempt(op[1])
            vl.preempt(op[1])
        elif kind == "probe":
            p = ref.s.probe(op[1])
            assert (p.hit, p.shared_prefix_boundary, p.hit_blocks) == vl.probe(op[1]), ctx
        elif kind == "evict":
            # vLLM iterates a set[int]; the reference evicts in the order given.
            id_set = {i for i in op[1] if i < cfg.num_blocks}
            ref.s.evict_blocks(list(id_set))
            vl.m.evict_blocks(id_set)
        elif kind == "reset":
            assert ref.s.reset_prefix_cache() == vl.m.reset_prefix_cache(), ctx
        ref_state, vl_state = ref.state(), vl.state()
        for name in ("free", "ref", "tables", "cached", "primary", "events"):
            assert ref_state[name] == vl_state[name], (
                f"{ctx}: {name} differs\nref  {ref_state[name]}\nvllm {vl_state[name]}"
            )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_random_workloads_match_vllm(name: str) -> None:
    cfg = CONFIGS[name]
    for seed in range(12):
        run_both(cfg, random_workload(random.Random(f"{name}/{seed}"), 120))
