"""CrossHair: contracts on reference_impl's mask, lookup and queue code, and twin equivalence.

Two kinds of check, each with a per-function time budget:

- contracts (`crosshair check`, PEP 316 docstrings): the `ref_*` wrappers
  below call reference_impl's engineered code and state postconditions (kept
  blocks in range, hits aligned and within the max length, the queue holds
  each block once);
- twins (`crosshair diffbehavior`): each `ref_*` wrapper against its `model_*`
  twin (model/contract/masks.py, model/contract/lookup.py, model/contract/free_queue.py) on the same
  bounded input domain.

CrossHair explores execution paths symbolically. A result says
"confirmed over all paths" only when CrossHair reports the paths exhausted
(contracts: a CONFIRMED message; twins: "All paths exhausted"), otherwise
"no counterexample in T s". A deliberately broken twin (`broken_swa_mask`:
the Eagle block missing) must be caught.

The wrappers take plain ints so CrossHair can make them symbolic; inputs
outside the bounded domain return None in both twins (the domain is part of
the statement).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from model.contract import lookup, masks
from model.contract.free_queue import FreeQueue
from reference_impl.block import KVCacheBlock
from reference_impl.config import KVCacheGroupConfig
from reference_impl.free_queue import FreeKVCacheBlockQueue
from reference_impl.managers import FullAttentionManager, MambaManager, SlidingWindowManager

MAX_BLOCKS = 8
MAX_BS = 4


def _retention(mode: int, k_mult: int, a: int) -> int | None:
    return None if mode == 0 else (0 if mode == 1 else k_mult * a)


def _mask_domain(
    bs: int, a_mult: int, window: int, mode: int, k_mult: int, start: int, end: int, b: int
) -> bool:
    return (
        1 <= bs <= MAX_BS
        and 1 <= a_mult <= 3
        and 1 <= window <= 3 * MAX_BS
        and 0 <= mode <= 2
        and 1 <= k_mult <= 3
        and 0 <= start <= end <= MAX_BLOCKS
        and 0 <= b <= MAX_BLOCKS * MAX_BS
    )


def _as_tuple(mask: Sequence[bool] | None, start: int) -> tuple[int, ...] | None:
    return None if mask is None else tuple(start + i for i, kept in enumerate(mask) if kept)


# --------------------------------------------------------------------------- masks


def ref_swa_mask(
    bs: int, a_mult: int, window: int, eagle: bool, mode: int, k_mult: int, start: int, end: int, b: int
) -> tuple[int, ...] | None:
    """reference_impl SlidingWindowManager.reachable_block_mask (sorted kept blocks, None = dense).

    post: __return__ is None or all(start <= i < end for i in __return__)
    post: __return__ is None or list(__return__) == sorted(set(__return__))
    """
    if not _mask_domain(bs, a_mult, window, mode, k_mult, start, end, b):
        return None
    spec = KVCacheGroupConfig("swa", bs, sliding_window=window)
    a = bs * a_mult
    mask = SlidingWindowManager.reachable_block_mask(
        start, end, a, spec, eagle, _retention(mode, k_mult, a), (b,)
    )
    return _as_tuple(mask, start)


def model_swa_mask(
    bs: int, a_mult: int, window: int, eagle: bool, mode: int, k_mult: int, start: int, end: int, b: int
) -> tuple[int, ...] | None:
    """The twin: masks.swa_kept_blocks."""
    if not _mask_domain(bs, a_mult, window, mode, k_mult, start, end, b):
        return None
    a = bs * a_mult
    kept = masks.swa_kept_blocks(
        start,
        end,
        block_size=bs,
        window=window,
        alignment=a,
        eagle=eagle,
        retention=_retention(mode, k_mult, a),
        boundaries=(b,),
    )
    return None if kept is None else tuple(sorted(kept))


def broken_swa_mask(
    bs: int, a_mult: int, window: int, eagle: bool, mode: int, k_mult: int, start: int, end: int, b: int
) -> tuple[int, ...] | None:
    """Negative control: the model mask computed without the Eagle block and shift (the pre-#44082 mask)."""
    return model_swa_mask(bs, a_mult, window, False, mode, k_mult, start, end, b)


def ref_mamba_mask(
    bs: int, a_mult: int, mode: int, k_mult: int, start: int, end: int, b: int
) -> tuple[int, ...] | None:
    """reference_impl MambaManager.reachable_block_mask.

    post: __return__ is None or all(start <= i < end for i in __return__)
    """
    if not _mask_domain(bs, a_mult, 1, mode, k_mult, start, end, b):
        return None
    spec = KVCacheGroupConfig("mamba", bs)
    a = bs * a_mult
    return _as_tuple(
        MambaManager.reachable_block_mask(start, end, a, spec, False, _retention(mode, k_mult, a), (b,)),
        start,
    )


def model_mamba_mask(
    bs: int, a_mult: int, mode: int, k_mult: int, start: int, end: int, b: int
) -> tuple[int, ...] | None:
    """The twin: masks.mamba_kept_blocks."""
    if not _mask_domain(bs, a_mult, 1, mode, k_mult, start, end, b):
        return None
    a = bs * a_mult
    kept = masks.mamba_kept_blocks(
        start, end, block_size=bs, alignment=a, retention=_retention(mode, k_mult, a), boundaries=(b,)
    )
    return None if kept is None else tuple(sorted(kept))


# --------------------------------------------------------------------------- hits


class _Pool:
    """The part of a BlockPool find_longest_cache_hit reads: block j cached iff bit j of `cached`."""

    def __init__(self, cached: int, bs: int) -> None:
        self.cached = cached
        self.hash_block_size = bs
        self.null_block = KVCacheBlock(0)
        self.null_block.is_null = True
        self.blocks = [KVCacheBlock(j + 1) for j in range(MAX_BLOCKS + 1)]

    def get_cached_block(self, block_hash: int, group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        return [self.blocks[block_hash] for _ in group_ids] if self.cached >> block_hash & 1 else None


def _hit_domain(cached: int, max_length: int, bs: int, a_mult: int, window: int) -> bool:
    return (
        0 <= cached < 2**MAX_BLOCKS
        and 1 <= bs <= MAX_BS
        and 1 <= a_mult <= 3
        and 1 <= window <= 3 * MAX_BS
        and 0 <= max_length <= MAX_BLOCKS * bs
    )


def _layout(blocks: Sequence[KVCacheBlock]) -> tuple[int | None, ...]:
    return tuple(None if b.is_null else b.block_id - 1 for b in blocks)


def _ref_hit(
    kind: str, cached: int, max_length: int, bs: int, a_mult: int, window: int, eagle: bool
) -> tuple[int | None, ...] | None:
    if not _hit_domain(cached, max_length, bs, a_mult, window):
        return None
    pool = _Pool(cached, bs)
    hashes: list[Any] = list(range(MAX_BLOCKS + 1))  # stand-in hashes: the fake pool keys by index
    a = bs * a_mult
    if kind == "full":
        blocks, hit = FullAttentionManager.find_longest_cache_hit(
            hashes,
            max_length,
            [0],
            pool,  # type: ignore[arg-type]
            KVCacheGroupConfig("full", bs),
            eagle,
            a,
        )
    elif kind == "swa":
        blocks, hit = SlidingWindowManager.find_longest_cache_hit(
            hashes,
            max_length,
            [0],
            pool,  # type: ignore[arg-type]
            KVCacheGroupConfig("swa", bs, sliding_window=window),
            eagle,
            a,
        )
    else:
        blocks, hit = MambaManager.find_longest_cache_hit(
            hashes,
            max_length,
            [0],
            pool,  # type: ignore[arg-type]
            KVCacheGroupConfig("mamba", bs),
            False,
            a,
        )
    layout = _layout(blocks[0])
    assert hit == len(layout) * bs
    return layout


def _model_hit(
    kind: str, cached: int, max_length: int, bs: int, a_mult: int, window: int, eagle: bool
) -> tuple[int | None, ...] | None:
    if not _hit_domain(cached, max_length, bs, a_mult, window):
        return None
    a = bs * a_mult

    def is_cached(j: int) -> bool:
        return 0 <= j <= MAX_BLOCKS and bool(cached >> j & 1)

    if kind == "full":
        return tuple(lookup.full_hit(is_cached, max_length, bs, a, eagle))
    if kind == "swa":
        return tuple(
            lookup.swa_hit(is_cached, max_length, bs, a, masks.swa_tail_blocks(window, bs, eagle), eagle)
        )
    return tuple(lookup.mamba_hit(is_cached, max_length, bs, a))


def ref_full_hit(
    cached: int, max_length: int, bs: int, a_mult: int, eagle: bool
) -> tuple[int | None, ...] | None:
    """reference_impl FullAttentionManager.find_longest_cache_hit (the layout: block index or None per entry).

    post: __return__ is None or (len(__return__) * bs) % (bs * a_mult) == 0
    post: __return__ is None or len(__return__) * bs <= max_length
    """
    return _ref_hit("full", cached, max_length, bs, a_mult, 1, eagle)


def model_full_hit(
    cached: int, max_length: int, bs: int, a_mult: int, eagle: bool
) -> tuple[int | None, ...] | None:
    """The twin: lookup.full_hit."""
    return _model_hit("full", cached, max_length, bs, a_mult, 1, eagle)


def ref_swa_hit(
    cached: int, max_length: int, bs: int, a_mult: int, window: int, eagle: bool
) -> tuple[int | None, ...] | None:
    """reference_impl SlidingWindowManager.find_longest_cache_hit.

    post: __return__ is None or (len(__return__) * bs) % (bs * a_mult) == 0
    post: __return__ is None or len(__return__) * bs <= max_length
    post: __return__ is None or all(j is None or (cached >> j) & 1 for j in __return__)
    """
    return _ref_hit("swa", cached, max_length, bs, a_mult, window, eagle)


def model_swa_hit(
    cached: int, max_length: int, bs: int, a_mult: int, window: int, eagle: bool
) -> tuple[int | None, ...] | None:
    """The twin: lookup.swa_hit."""
    return _model_hit("swa", cached, max_length, bs, a_mult, window, eagle)


def ref_mamba_hit(cached: int, max_length: int, bs: int, a_mult: int) -> tuple[int | None, ...] | None:
    """reference_impl MambaManager.find_longest_cache_hit.

    post: __return__ is None or (len(__return__) * bs) % (bs * a_mult) == 0
    post: __return__ is None or not __return__ or (cached >> __return__[-1]) & 1
    """
    return _ref_hit("mamba", cached, max_length, bs, a_mult, 1, False)


def model_mamba_hit(cached: int, max_length: int, bs: int, a_mult: int) -> tuple[int | None, ...] | None:
    """The twin: lookup.mamba_hit."""
    return _model_hit("mamba", cached, max_length, bs, a_mult, 1, False)


# --------------------------------------------------------------------------- free queue

QUEUE_BLOCKS = 6


def _queue_domain(ops: Sequence[int]) -> bool:
    return len(ops) <= 8 and all(0 <= op < 4 * (QUEUE_BLOCKS + 1) for op in ops)


def ref_queue(ops: list[int]) -> tuple[int, ...] | None:
    """reference_impl FreeKVCacheBlockQueue under a script of ops on blocks 1..6 (start [1..6]).

    Each op o: kind o % 4 (0 popleft_n(arg), 1 prepend_n([arg]), 2 append_n([arg]), 3 remove(arg)),
    arg o // 4; an op that does not apply (block absent / present) is skipped.

    post: __return__ is None or len(set(__return__)) == len(__return__)
    post: __return__ is None or all(1 <= b <= 6 for b in __return__)
    """
    if not _queue_domain(ops):
        return None
    blocks = {b: KVCacheBlock(b) for b in range(1, QUEUE_BLOCKS + 1)}
    q = FreeKVCacheBlockQueue([blocks[b] for b in range(1, QUEUE_BLOCKS + 1)])
    inside = set(blocks)
    for op in ops:
        kind, arg = op % 4, op // 4
        if kind == 0:
            if arg <= len(q):
                inside -= {b.block_id for b in q.popleft_n(arg)}
        elif arg in blocks:
            if kind in (1, 2) and arg not in inside:
                (q.prepend_n if kind == 1 else q.append_n)([blocks[arg]])
                inside.add(arg)
            elif kind == 3 and arg in inside:
                q.remove(blocks[arg])
                inside.discard(arg)
    return tuple(b.block_id for b in q.get_all_free_blocks())


def model_queue(ops: list[int]) -> tuple[int, ...] | None:
    """The twin: model/contract/free_queue.py FreeQueue (a plain list)."""
    if not _queue_domain(ops):
        return None
    q = FreeQueue(range(1, QUEUE_BLOCKS + 1))
    for op in ops:
        kind, arg = op % 4, op // 4
        if kind == 0:
            if arg <= len(q):
                q.popleft_n(arg)
        elif 1 <= arg <= QUEUE_BLOCKS:
            if kind in (1, 2) and arg not in q:
                (q.prepend_n if kind == 1 else q.append_n)([arg])
            elif kind == 3 and arg in q:
                q.remove(arg)
    return tuple(q.blocks)


# --------------------------------------------------------------------------- running CrossHair


@dataclass
class CrosshairResult:
    name: str
    statement: str
    result: (
        str  # "confirmed" (all paths) | "no counterexample" (within the budget) | "counterexample" | "error"
    )
    seconds: float
    budget_s: float
    counterexample: str | None = None
    is_control: bool = False

    @property
    def expected_ok(self) -> bool:
        if self.is_control:
            return self.result == "counterexample"
        return self.result in ("confirmed", "no counterexample")

    @property
    def verdict(self) -> str:
        if self.result == "confirmed":
            return "confirmed over all paths"
        if self.result == "no counterexample":
            return f"no counterexample in {self.budget_s:g} s"
        return self.result


MODULE = __name__ if __name__ != "__main__" else "invariants.proofs.crosshair"

TWINS = [
    ("swa_mask", "ref_swa_mask", "model_swa_mask", False),
    ("mamba_mask", "ref_mamba_mask", "model_mamba_mask", False),
    ("full_hit", "ref_full_hit", "model_full_hit", False),
    ("swa_hit", "ref_swa_hit", "model_swa_hit", False),
    ("mamba_hit", "ref_mamba_hit", "model_mamba_hit", False),
    ("free_queue", "ref_queue", "model_queue", False),
    ("control_broken_swa_mask", "ref_swa_mask", "broken_swa_mask", True),
]
CONTRACTS = ["ref_swa_mask", "ref_mamba_mask", "ref_full_hit", "ref_swa_hit", "ref_mamba_hit", "ref_queue"]


def _crosshair(args: list[str], budget_s: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "crosshair", *args],
            capture_output=True,
            text=True,
            timeout=budget_s * 3 + 60,
        )
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = f"crosshair did not finish: {exc}", -1
    return rc, out, time.monotonic() - t0


def run_twin(name: str, ref: str, twin: str, is_control: bool, budget_s: float) -> CrosshairResult:
    statement = f"{ref} behaves exactly as {twin} on the bounded domain"
    if is_control:
        statement = f"control: {twin} (Eagle block missing) differs from {ref}"
    rc, out, secs = _crosshair(
        [
            "diffbehavior",
            f"--per_condition_timeout={budget_s}",
            "--max_uninteresting_iterations=1000000",
            f"{MODULE}.{ref}",
            f"{MODULE}.{twin}",
        ],
        budget_s,
    )
    if "Given:" in out:
        given = out[out.index("Given:") :].strip().splitlines()
        return CrosshairResult(
            name,
            statement,
            "counterexample",
            secs,
            budget_s,
            " ".join(s.strip() for s in given[:3]),
            is_control,
        )
    if "No differences found" in out:
        result = "confirmed" if "All paths exhausted" in out else "no counterexample"
        return CrosshairResult(name, statement, result, secs, budget_s, None, is_control)
    return CrosshairResult(name, statement, "error", secs, budget_s, out.strip()[-400:], is_control)


def run_contract(fn: str, budget_s: float) -> CrosshairResult:
    statement = f"{fn}: postconditions hold for every input meeting the preconditions"
    rc, out, secs = _crosshair(
        [
            "check",
            "--analysis_kind=PEP316",
            "--report_all",
            f"--per_condition_timeout={budget_s}",
            f"{MODULE}.{fn}",
        ],
        budget_s,
    )
    lines = [ln for ln in out.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r":\s*error:", ln)]
    if errors:
        return CrosshairResult(f"contract_{fn}", statement, "counterexample", secs, budget_s, errors[0])
    confirmed = [ln for ln in lines if re.search(r"info: Confirmed over all paths", ln)]
    n_post = (globals()[fn].__doc__ or "").count("post:")
    result = "confirmed" if len(confirmed) >= n_post and n_post > 0 else "no counterexample"
    if rc not in (0, 1) and not confirmed:
        return CrosshairResult(f"contract_{fn}", statement, "error", secs, budget_s, out.strip()[-400:])
    return CrosshairResult(f"contract_{fn}", statement, result, secs, budget_s)


def run_crosshair(budget_s_per_function: float = 10.0, *, names: Sequence[str] = ()) -> list[CrosshairResult]:
    """Contracts on every ref_* wrapper and diffbehavior between every twin pair (incl. the broken control)."""
    results = []
    for fn in CONTRACTS:
        if not names or f"contract_{fn}" in names:
            results.append(run_contract(fn, budget_s_per_function))
    for name, ref, twin, control in TWINS:
        if not names or name in names:
            results.append(run_twin(name, ref, twin, control, budget_s_per_function))
    return results


def format_crosshair(results: Sequence[CrosshairResult]) -> str:
    lines = []
    for r in results:
        flag = "" if r.expected_ok else "  (UNEXPECTED)"
        lines.append(f"{r.name:28s} {r.verdict:32s} {r.seconds:6.1f}s{flag}  {r.statement}")
        if r.counterexample:
            lines.append(f"{'':28s} {r.counterexample[:300]}")
    return "\n".join(lines)


if __name__ == "__main__":
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    res = run_crosshair(budget, names=sys.argv[2:])
    print(format_crosshair(res))
    sys.exit(0 if all(r.expected_ok for r in res) else 1)
