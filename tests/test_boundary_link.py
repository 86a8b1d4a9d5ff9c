"""vLLM 0.33.0's replay boundaries and cacheable lengths equal the model's; the checks' negative controls."""

from __future__ import annotations

from typing import Any

import pytest

from invariants.proofs import boundary_link as bl
from invariants.proofs import coordinator_link as cl
from invariants.proofs import production_link as pl
from model.contract.profile import Profile


@pytest.fixture(scope="module")
def vllm() -> dict[str, Any]:
    v, reason = pl._vllm()
    if v is None:
        pytest.skip(reason)
    return v


def test_quick_domains_agree(vllm: dict[str, Any]) -> None:
    cases, bad = bl.check_replay_boundaries(vllm, bl.REPLAY_QUICK)
    assert bad is None and cases == 64 * 8 * 2
    cases, bad = bl.check_cacheable(vllm, cl.QUICK)
    assert bad is None and cases > 3000


def test_older_replay_rule_is_caught(vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """0.29.0's rule (every group keeps the tail of prompt - 1, whatever Eagle)."""
    monkeypatch.setattr(bl, "MODELED", Profile(eagle_replay_boundaries=False))
    _, bad = bl.check_replay_boundaries(vllm, bl.REPLAY_QUICK)
    assert bad is not None and "eagle=True" in bad and "vLLM resumes at" in bad and "the model at" in bad


def test_vllm_replay_mutant_is_caught(vllm: dict[str, Any]) -> None:
    """A vLLM whose Eagle replay resumes at the last aligned boundary itself (no block below)."""
    real = vllm["replay_boundaries"]

    def no_block_below(p: int, sbs: int, eagle: bool) -> tuple[int, ...]:
        return tuple(b + sbs if eagle and b + sbs <= p - 1 else b for b in real(p, sbs, eagle))

    _, bad = bl.check_replay_boundaries({**vllm, "replay_boundaries": no_block_below}, bl.REPLAY_QUICK)
    assert bad is not None and "eagle=True" in bad


@pytest.mark.parametrize(
    "older",
    [Profile(eagle_aware_mask=False), Profile(block_mask=False)],
    ids=lambda p: p.differences()[0],
)
def test_older_cacheable_rules_are_caught(
    vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch, older: Profile
) -> None:
    """0.22.0 (no peek block past the grid) and 0.21.0 (no grid) cache other lengths."""
    monkeypatch.setattr(bl, "MODELED", older)
    _, bad = bl.check_cacheable(vllm, cl.QUICK)
    assert bad is not None and "vLLM caches" in bad and "the model" in bad


def test_vllm_cacheable_mutant_is_caught(vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A coordinator that forgets Eagle's peek block (floors every group to the grid)."""
    coordinator = vllm["HybridKVCacheCoordinator"]

    def floored(self: Any, n: int, gid: int) -> int:
        return n // self.scheduler_block_size * self.scheduler_block_size

    monkeypatch.setattr(coordinator, "get_num_cacheable_tokens", floored)
    _, bad = bl.check_cacheable(vllm, cl.QUICK)
    assert bad is not None and "eagle=True" in bad


def test_rows_are_in_the_production_link() -> None:
    names = [c[0] for c in pl.CHECKS]
    assert {"vllm_replay_bounds", "vllm_cacheable", "vllm_hybrid_hit"} <= set(names)
    assert pl.QUICK.replay == bl.REPLAY_QUICK and pl.FULL.replay == bl.REPLAY_FULL
