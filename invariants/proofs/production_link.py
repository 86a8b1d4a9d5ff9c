"""Production link: vLLM 0.33.0's mask and hit formulas equal the model's on a bounded domain.

The Z3 theorems are about `model/contract/masks.py` and `model/contract/lookup.py` (via
`model/contract/smt.py`, checked equal by `tests/test_smt.py`). This module checks,
exhaustively over a stated bounded domain, that vLLM's own classmethods
compute the same thing, so the theorems speak about the production formulas
too:

- `SlidingWindowManager.reachable_block_mask` vs `masks.swa_kept_blocks`;
- `MambaManager.reachable_block_mask` vs `masks.mamba_kept_blocks`;
- `FullAttentionManager` / `SlidingWindowManager` / `MambaManager`
  `.find_longest_cache_hit` vs `lookup.full_hit` / `swa_hit` / `mamba_hit`
  (hit length and block layout), through a small fake pool exposing
  `get_cached_block`, `null_block` and `hash_block_size`;
- `HybridKVCacheCoordinator.find_longest_cache_hit` (the fixed point, built
  by vLLM's own `KVCacheManager`) vs `hybrid_hit.reconcile` with the model's
  finders: hit, per-group layouts and junction (`coordinator_link`, whose
  docstring states its domain and what it fakes);
- `replay_boundaries` and `HybridKVCacheCoordinator.get_num_cacheable_tokens`
  vs the model's replay boundaries and cacheable lengths (`boundary_link`).

The boundaries passed to the masks are the ones the allocator passes: the
prompt's replay boundaries (`masks.replay_boundaries`) and, for some prompts,
a shared-prefix junction J (and J - bs with Eagle). Without vLLM the checks
are reported as skipped with the reason.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from invariants.proofs import boundary_link, coordinator_link
from invariants.proofs.engine import TheoremResult
from model.contract import lookup, masks


@dataclass(frozen=True)
class Domain:
    """The bounded domain of one check (stated in the result)."""

    block_sizes: tuple[int, ...]
    alignment_multiples: tuple[int, ...]
    blocks: int  # masks: blocks [start, blocks)
    hit_blocks: int  # hits: every cached subset of this many blocks
    coordinator: coordinator_link.Domain  # the hybrid fixed point, the cacheable lengths
    replay: tuple[int, int]  # replay boundaries: prompts up to, scheduler blocks up to


FULL = Domain((1, 2, 4, 8, 16), (1, 2, 3, 4), 24, 8, coordinator_link.FULL, boundary_link.REPLAY_FULL)
QUICK = Domain((1, 2, 4), (1, 2, 3), 12, 6, coordinator_link.QUICK, boundary_link.REPLAY_QUICK)


def _vllm() -> tuple[dict[str, Any] | None, str]:
    # Quiet vLLM's logging (a warning_once about fine-grained hits, expected here) unless the user chose a level.
    user_level = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import torch
        from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator, replay_boundaries
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.single_type_kv_cache_manager import (
            FullAttentionManager,
            MambaManager,
            SlidingWindowManager,
        )
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            MambaSpec,
            SlidingWindowSpec,
        )
    except Exception as exc:  # any import failure: skip with the reason
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        return None, f"vLLM cannot be imported: {type(exc).__name__}: {first}"
    if user_level is None:
        logging.getLogger("vllm").setLevel(logging.ERROR)
    try:
        import vllm

        version = getattr(vllm, "__version__", "?")
    except Exception:
        version = "?"
    return {
        "torch": torch,
        "version": version,
        "FullAttentionManager": FullAttentionManager,
        "SlidingWindowManager": SlidingWindowManager,
        "MambaManager": MambaManager,
        "FullAttentionSpec": FullAttentionSpec,
        "SlidingWindowSpec": SlidingWindowSpec,
        "MambaSpec": MambaSpec,
        "KVCacheManager": KVCacheManager,
        "KVCacheConfig": KVCacheConfig,
        "KVCacheGroupSpec": KVCacheGroupSpec,
        "HybridKVCacheCoordinator": HybridKVCacheCoordinator,
        "replay_boundaries": replay_boundaries,
    }, ""


def _windows(bs: int) -> tuple[int, ...]:
    return tuple(sorted({1, 2, bs, bs + 1, 2 * bs, 2 * bs + 1, 3 * bs + 2}))


def _retentions(a: int) -> tuple[int | None, ...]:
    return (None, 0, a, 2 * a, 3 * a)


def _boundaries(p: int, a: int, bs: int, eagle: bool) -> tuple[int, ...]:
    """What the allocator passes: replay boundaries, plus a junction for every third prompt length."""
    out = list(masks.replay_boundaries(p, a, eagle))
    if p % 3 == 0:
        j = p * 2 // 3
        out.append(j)
        if eagle:
            out.append(j - bs)
    return tuple(out)


def _as_set(mask: Sequence[bool] | None, start: int) -> set[int] | None:
    return None if mask is None else {start + i for i, kept in enumerate(mask) if kept}


def _check_masks(v: dict[str, Any], dom: Domain, kind: str) -> tuple[int, str | None]:
    torch = v["torch"]
    cases = 0
    end = dom.blocks
    for bs, m in itertools.product(dom.block_sizes, dom.alignment_multiples):
        a = bs * m
        if kind == "swa":
            for w in _windows(bs):
                spec = v["SlidingWindowSpec"](
                    block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=w
                )
                for r, eagle, start, p in itertools.product(
                    _retentions(a), (False, True), (0, 5), range(1, end * bs + 1)
                ):
                    bnd = _boundaries(p, a, bs, eagle)
                    got = _as_set(
                        v["SlidingWindowManager"].reachable_block_mask(start, end, a, spec, eagle, r, bnd),
                        start,
                    )
                    want = masks.swa_kept_blocks(
                        start,
                        end,
                        block_size=bs,
                        window=w,
                        alignment=a,
                        eagle=eagle,
                        retention=r,
                        boundaries=bnd,
                    )
                    cases += 1
                    if got != want:
                        return cases, (
                            f"block_size={bs}, window={w}, alignment={a}, retention={r}, eagle={eagle}, "
                            f"blocks [{start}, {end}), boundaries={bnd}: vLLM keeps "
                            f"{'all' if got is None else sorted(got)}, the model "
                            f"{'all' if want is None else sorted(want)}"
                        )
        else:
            spec = v["MambaSpec"](
                block_size=bs, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align"
            )
            for r, eagle, start, p in itertools.product(
                (*_retentions(a), 5 * a), (False, True), (0, 5), range(1, end * bs + 1)
            ):
                bnd = _boundaries(p, a, bs, eagle)
                got = _as_set(
                    v["MambaManager"].reachable_block_mask(start, end, a, spec, eagle, r, bnd), start
                )
                want = masks.mamba_kept_blocks(
                    start, end, block_size=bs, alignment=a, retention=r, boundaries=bnd
                )
                cases += 1
                if got != want:
                    return cases, (
                        f"block_size={bs}, alignment={a}, retention={r}, eagle={eagle}, blocks "
                        f"[{start}, {end}), boundaries={bnd}: vLLM keeps "
                        f"{'all' if got is None else sorted(got)}, the model "
                        f"{'all' if want is None else sorted(want)}"
                    )
    return cases, None


class _Block:
    __slots__ = ("idx",)

    def __init__(self, idx: int) -> None:
        self.idx = idx


class _FakePool:
    """Just what find_longest_cache_hit reads from a BlockPool: block j cached iff j in `cached`."""

    def __init__(self, cached: set[int], hash_block_size: int) -> None:
        self.cached = cached
        self.hash_block_size = hash_block_size
        self.null_block = _Block(-1)
        self.blocks = [_Block(j) for j in range(64)]

    def get_cached_block(self, block_hash: int, kv_cache_group_ids: Sequence[int]) -> list[_Block] | None:
        return [self.blocks[block_hash] for _ in kv_cache_group_ids] if block_hash in self.cached else None


def _subsets(n: int) -> Iterator[set[int]]:
    for mask in range(1 << n):
        yield {j for j in range(n) if mask >> j & 1}


def _check_hits(v: dict[str, Any], dom: Domain, kind: str) -> tuple[int, str | None]:
    torch = v["torch"]
    nb = dom.hit_blocks
    cases = 0
    hashes = list(range(nb + 2))
    for bs, m in itertools.product(dom.block_sizes, dom.alignment_multiples[:3]):
        a = bs * m
        lengths = sorted({3 * bs, nb * bs - 1, nb * bs, nb * bs + bs - 1})
        if kind == "full":
            specs: list[tuple[Any, int | None]] = [
                (
                    v["FullAttentionSpec"](block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32),
                    None,
                )
            ]
            manager = v["FullAttentionManager"]
        elif kind == "swa":
            specs = [
                (
                    v["SlidingWindowSpec"](
                        block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=w
                    ),
                    w,
                )
                for w in _windows(bs)
            ]
            manager = v["SlidingWindowManager"]
        else:
            specs = [
                (
                    v["MambaSpec"](
                        block_size=bs, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align"
                    ),
                    None,
                )
            ]
            manager = v["MambaManager"]
        for (spec, w), cached, length, eagle in itertools.product(
            specs, list(_subsets(nb)), lengths, (False, True)
        ):
            if kind == "mamba" and eagle:
                continue  # Mamba never drops for Eagle (vLLM asserts nothing; the model has no flag)
            pool = _FakePool(cached, bs)
            blocks, hit = manager.find_longest_cache_hit(hashes, length, [0], pool, spec, eagle, a)
            got = [None if b is pool.null_block else b.idx for b in blocks[0]]
            if kind == "full":
                want = lookup.full_hit(cached.__contains__, length, bs, a, eagle)
            elif kind == "swa":
                assert w is not None
                want = lookup.swa_hit(
                    cached.__contains__, length, bs, a, masks.swa_tail_blocks(w, bs, eagle), eagle
                )
            else:
                want = lookup.mamba_hit(cached.__contains__, length, bs, a)
            cases += 1
            if got != want or hit != len(want) * bs:
                return cases, (
                    f"{kind}: block_size={bs}, alignment={a}, window={w}, eagle={eagle}, "
                    f"max_length={length}, cached blocks {sorted(cached)}: vLLM hit {hit} layout {got}, "
                    f"the model hit {len(want) * bs} layout {want}"
                )
    return cases, None


def _check_coordinator(v: dict[str, Any], dom: Domain) -> tuple[int, str | None, str]:
    tally, bad = coordinator_link.check_coordinator(v, dom.coordinator)
    return tally.cases, bad, tally.describe()


def _single(dom: Domain, where: str, extra: str) -> str:
    return f"bs in {sorted(dom.block_sizes)}, A/bs in {sorted(dom.alignment_multiples)}, {where}; {extra}"


def _mask_bound(extra: str) -> Callable[[Domain], str]:
    return lambda dom: _single(dom, f"blocks [start, {dom.blocks})", extra)


def _hit_bound(extra: str) -> Callable[[Domain], str]:
    return lambda dom: _single(dom, f"every cached subset of n={dom.hit_blocks} blocks, A/bs <= 3", extra)


def _coordinator_bound(dom: Domain) -> str:
    return dom.coordinator.describe()


# (v, domain) -> (cases, first disagreement or None, what the cases covered or "")
Check = Callable[[dict[str, Any], Domain], tuple[int, str | None, str]]
CHECKS: list[tuple[str, str, Check, Callable[[Domain], str]]] = [
    (
        "vllm_swa_mask",
        "vLLM SlidingWindowManager.reachable_block_mask equals masks.swa_kept_blocks",
        lambda v, d: (*_check_masks(v, d, "swa"), ""),
        _mask_bound(
            "windows {1,2,bs,bs+1,2bs,2bs+1,3bs+2}, retention {None,0,A,2A,3A}, Eagle both, start {0,5}, "
            "prompts 1..end*bs"
        ),
    ),
    (
        "vllm_mamba_mask",
        "vLLM MambaManager.reachable_block_mask equals masks.mamba_kept_blocks",
        lambda v, d: (*_check_masks(v, d, "mamba"), ""),
        _mask_bound("retention {None,0,A,2A,3A,5A}, Eagle both, start {0,5}, prompts 1..end*bs"),
    ),
    (
        "vllm_full_hit",
        "vLLM FullAttentionManager.find_longest_cache_hit equals lookup.full_hit (length and layout)",
        lambda v, d: (*_check_hits(v, d, "full"), ""),
        _hit_bound("max length {3bs, n*bs-1, n*bs, (n+1)*bs-1}, Eagle both"),
    ),
    (
        "vllm_swa_hit",
        "vLLM SlidingWindowManager.find_longest_cache_hit equals lookup.swa_hit (length and layout)",
        lambda v, d: (*_check_hits(v, d, "swa"), ""),
        _hit_bound("windows as above, max length {3bs, n*bs-1, n*bs, (n+1)*bs-1}, Eagle both"),
    ),
    (
        "vllm_mamba_hit",
        "vLLM MambaManager.find_longest_cache_hit equals lookup.mamba_hit (length and layout)",
        lambda v, d: (*_check_hits(v, d, "mamba"), ""),
        _hit_bound("max length {3bs, n*bs-1, n*bs, (n+1)*bs-1}"),
    ),
    (
        "vllm_replay_bounds",
        "vLLM replay_boundaries equals the model's (eagle.replay_boundaries)",
        lambda v, d: (*boundary_link.check_replay_boundaries(v, d.replay), ""),
        lambda d: f"prompts 1..{d.replay[0]} tokens, scheduler blocks 1..{d.replay[1]}, Eagle both",
    ),
    (
        "vllm_cacheable",
        "vLLM HybridKVCacheCoordinator.get_num_cacheable_tokens equals the model's cacheable length "
        "(masks.floor_with_peek; every token under fine-grained hits)",
        lambda v, d: (*boundary_link.check_cacheable(v, d.coordinator), ""),
        lambda d: (
            "every configuration of the hybrid-hit domain below, every group, computed tokens "
            "0..3*scheduler block+2"
        ),
    ),
    (
        "vllm_hybrid_hit",
        "vLLM HybridKVCacheCoordinator.find_longest_cache_hit equals hybrid_hit.reconcile with the "
        "model's finders (hit, per-group layouts, junction)",
        _check_coordinator,
        _coordinator_bound,
    ),
]


def run_production_link(quick: bool = False) -> list[TheoremResult]:
    """Run every check; each result is `proved` (agreement on every case of the stated domain),
    `refuted` (the first disagreement) or `skipped` (vLLM not importable, with the reason)."""
    dom = QUICK if quick else FULL
    v, reason = _vllm()
    results = []
    for name, statement, fn, bound in CHECKS:
        if v is None:
            results.append(TheoremResult(name, statement, "skipped", None, 0.0, None, detail=reason))
            continue
        t0 = time.monotonic()
        cases, bad, covered = fn(v, dom)
        results.append(
            TheoremResult(
                name,
                f"{statement} (vLLM {v['version']})",
                "refuted" if bad else "proved",
                f"{covered or f'{cases} cases'}: {bound(dom)}",
                time.monotonic() - t0,
                bad,
                detail=f"exhaustive over {cases} cases",
            )
        )
    return results


def format_link(results: Sequence[TheoremResult]) -> str:
    lines = []
    for r in results:
        lines.append(f"{r.name:18s} {r.result:8s} {r.seconds:6.1f}s  {r.statement}")
        lines.append(f"{'':18s} domain: {r.bound or '-'}")
        if r.counterexample or (r.result == "skipped" and r.detail):
            lines.append(f"{'':18s} {r.counterexample or r.detail}")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    res = run_production_link(quick="--quick" in sys.argv)
    print(format_link(res))
    sys.exit(0 if all(r.result in ("proved", "skipped") for r in res) else 1)
