"""vLLM 0.33.0's mask and hit formulas equal the model's (quick domain); skipped without vLLM.

`python -m invariants.proofs.production_link` runs the full domain (about 700k cases).
"""

from __future__ import annotations

import pytest

from invariants.proofs import production_link as pl


@pytest.fixture(scope="module")
def vllm() -> dict[str, object]:
    v, reason = pl._vllm()
    if v is None:
        pytest.skip(reason)
    return v


def test_quick_domain_agrees(vllm: dict[str, object]) -> None:
    results = pl.run_production_link(quick=True)
    assert len(results) == len(pl.CHECKS)
    for r in results:
        assert r.result == "proved", f"{r.name}: {r.counterexample}"
        assert r.bound and "cases" in r.bound


def test_broken_model_is_caught(vllm: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a model mask with a tail one block too long disagrees with vLLM."""
    real = pl.masks.swa_kept_blocks

    def broken(start: int, end: int, **kw: object) -> set[int] | None:
        kw["window"] = int(kw["window"]) + int(kw["block_size"])  # type: ignore[call-overload]
        return real(start, end, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(pl.masks, "swa_kept_blocks", broken)
    cases, bad = pl._check_masks(vllm, pl.QUICK, "swa")
    assert bad is not None and "vLLM keeps" in bad


def test_broken_hit_is_caught(vllm: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a full-attention hit that forgets the Eagle drop disagrees with vLLM."""
    real = pl.lookup.full_hit
    monkeypatch.setattr(pl.lookup, "full_hit", lambda c, n, bs, a, drop: real(c, n, bs, a, False))
    _, bad = pl._check_hits(vllm, pl.QUICK, "full")
    assert bad is not None and "vLLM hit" in bad


def test_skipped_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pl, "_vllm", lambda: (None, "vLLM cannot be imported: test"))
    results = pl.run_production_link(quick=True)
    assert all(r.result == "skipped" and r.detail == "vLLM cannot be imported: test" for r in results)
