"""Production runs keep memory bounded by the pool and the requests in flight.

- prompts hold one int object per token id (not one per token);
- the heap freed by one episode goes back to the system before the next;
- the summary compares each setting's resident memory at the end of its first
  and latest episode (the same pool and workload shape must cost about the same),
  and the resident memory once an episode is gone, after the first and the
  latest (nothing of an episode outlives it).
"""

from __future__ import annotations

import gc
import platform
import random
import sys

import pytest

from invariants.harness import production
from invariants.harness.production import (
    VOCAB,
    ProductionStats,
    current_rss_kb,
    format_production,
    random_tokens,
)


def test_prompts_share_one_int_per_token_id():
    rng = random.Random(3)
    a, b = random_tokens(rng, 50_000), random_tokens(rng, 3)
    assert len(a) == 50_000 and len(b) == 3 and random_tokens(rng, 1)[0] in range(1, VOCAB)
    assert all(0 < t < VOCAB for t in a)
    assert len({id(t) for t in a}) <= VOCAB - 1  # fresh ints would give ~50,000 objects
    assert random_tokens(random.Random(4), 100) == random_tokens(random.Random(4), 100)


def test_the_summary_compares_a_setting_with_itself():
    stats = ProductionStats(ops=10, episodes=3, rss_at_tenth_kb=1024 * 100)
    stats.rss_by_setting_kb = {
        "gemma-like 96 r0": (1024 * 100, 1024 * 130),
        "dsv4-flash 896 rNone": (1024, 1024),
    }
    out = format_production("model", 0, stats, 1.0, "clean")
    line = next(ln for ln in out.splitlines() if ln.startswith("memory by setting"))
    assert "gemma-like 96 r0: 100 -> 130 MiB (+30.0%)" in line and "1 settings seen again" in line


def test_the_summary_reports_what_episodes_leave_behind():
    stats = ProductionStats(
        ops=10, episodes=5, rss_between_kb=(1024 * 500, 1024 * 520), blocks_between=(2_000_000, 2_002_000)
    )
    out = format_production("model", 0, stats, 1.0, "clean")
    line = next(ln for ln in out.splitlines() if ln.startswith("memory between episodes"))
    assert "after the first 500 MiB, after the latest 520 MiB (+4.0%)" in line
    assert "live objects (allocated blocks) 2,000,000 -> 2,002,000 (+0.1%)" in line


def test_control_one_episode_leaves_nothing_to_compare():
    out = format_production("model", 0, ProductionStats(ops=10, episodes=1), 1.0, "clean")
    assert "memory between episodes" not in out


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc")
def test_freed_heap_goes_back_between_episodes():
    # Mid-sized blocks (8 KB tuples) come from glibc's heap, which keeps them once
    # freed; every 8th stays alive, so the freed runs are never the heap's top
    # (which glibc would hand back by itself).
    production._trim_heap()
    blocks = [tuple(range(i, i + 1000)) for i in range(16000)]
    pins = blocks[7::8]
    del blocks
    gc.collect()
    kept = current_rss_kb()
    production._trim_heap()
    assert current_rss_kb() < kept - 32 * 1024
    assert len(pins) == 2000


def _live_peak(live_prompts: float, longest: int = 2000) -> tuple[int, int]:
    """The most prompt tokens in flight at once over 800 workload operations, and the adds."""
    from invariants.harness.checker import Checker
    from invariants.targets import target_factory
    from model.contract.config import Config, GroupSpec
    from model.contract.ops import AddRequest

    cfg = Config(groups=(GroupSpec("full", 16),), num_blocks=4096, max_model_len=2048)
    checker = Checker(target_factory("model")(cfg))
    ops = production.workload(cfg, random.Random(5), checker, longest, live_prompts)
    peak = adds = 0
    for _ in range(800):
        op = next(ops)
        adds += isinstance(op, AddRequest)
        assert not checker.step(op)
        peak = max(peak, sum(r.num_tokens for r in checker.model.requests.values()))
    return peak, adds


def test_the_prompts_in_flight_stay_within_the_live_budget():
    """However the draw stacks long prompts (and bursts), the live requests together
    hold at most `live_prompts` of the longest, decoded tokens included: the working
    set a production run carries. Control: the same draw without the budget goes past it."""
    assert production.LIVE_PROMPTS >= 2
    peak, adds = _live_peak(1.5)
    assert adds > 20 and 1000 < peak <= 1.5 * 2000
    unbounded, _ = _live_peak(1e9)
    assert unbounded > 1.5 * 2000
