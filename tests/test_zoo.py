"""The bug zoo: a fixed subset of mutants is killed (100%), and the unmutated
reference passes the very same runs (same strategies, seeds and budgets).

Budget: the Hypothesis profile's `max_examples` bounds the batches per mutant
(`ci`: 25 examples -> 3 batches of 8); most mutants die in the first batch.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from hypothesis import settings

from invariants.cli.zoo import QUICK_SUBSET
from invariants.targets.reference import ReferenceTarget
from invariants.zoo.checks import config_rejection, exception_safety
from invariants.zoo.mutants_reference import REFERENCE_MUTANTS, ZooReferenceTarget, factory
from invariants.zoo.runner import EXAMPLES_PER_BATCH, ZooEntry, known_tolerance, reference_entries, run_entry

SUBSET = list(QUICK_SUBSET)
BATCHES = max(1, settings().max_examples // EXAMPLES_PER_BATCH)
BUDGET_S = 30.0


def _run(entry: ZooEntry, tmp_path: Path):
    return run_entry(
        entry, seed=0, budget_s=BUDGET_S, shrink_s=1.0, out_dir=tmp_path, progress=False, max_batches=BATCHES
    )


@pytest.mark.parametrize("name", SUBSET)
def test_mutant_is_killed(name: str, tmp_path: Path) -> None:
    (entry,) = reference_entries([name])
    result = _run(entry, tmp_path)
    assert result.killed, f"{name} survived {result.steps} steps ({result.strategy}, seeds {result.seeds})"
    if result.trace_path is not None:
        assert result.trace_path.exists()


@pytest.mark.parametrize("strategy", sorted({REFERENCE_MUTANTS[n].strategy for n in SUBSET}))
def test_unmutated_reference_passes_the_same_runs(strategy: str, tmp_path: Path) -> None:
    entry = ZooEntry(
        "(unmutated)",
        "reference",
        "control",
        strategy,
        (),
        lambda: contextlib.nullcontext(ReferenceTarget),
        tolerated=known_tolerance("reference"),
        control=True,
    )
    result = _run(entry, tmp_path)
    assert not result.killed, f"unmutated reference flagged on {strategy}: {result.detail}"
    assert result.steps > 0


def _killing_everywhere(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The registry's unmutated "reference" planted with mutant `name`: a killing trace
    then fails the target the zoo judges a kill against too."""
    import invariants.targets as targets

    real = targets.target_factory
    monkeypatch.setattr(targets, "target_factory", lambda t: factory(name) if t == "reference" else real(t))


def test_a_kill_whose_trace_fails_the_unmutated_target_is_not_credited(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A killing trace must be clean on the unmutated target (else it names no defect of
    the mutant: a harness, model or shrinker fault). Control: the same hunt against the
    real unmutated reference is a kill (test_mutant_is_killed)."""
    name = SUBSET[0]
    (entry,) = reference_entries([name])
    _killing_everywhere(monkeypatch, name)
    result = _run(entry, tmp_path)
    assert not result.killed and result.verdict == "UNSOUND" and result.unsound.startswith("op ")


def test_a_flagged_control_stays_flagged(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The control's "kill" is itself the finding: it is never replayed away."""
    name = SUBSET[0]
    _killing_everywhere(monkeypatch, name)
    m = REFERENCE_MUTANTS[name]
    entry = ZooEntry(
        "(unmutated)",
        "reference",
        "control",
        m.strategy,
        (),
        lambda: contextlib.nullcontext(factory(name)),
        control=True,
    )
    result = _run(entry, tmp_path)
    assert result.killed and not result.unsound


def test_direct_checks_pass_on_the_unmutated_reference() -> None:
    assert config_rejection(ReferenceTarget).violation is None
    outcome = exception_safety(ReferenceTarget)
    assert outcome.vacuous is None and outcome.violation is None


def test_direct_checks_kill_their_mutants() -> None:
    assert config_rejection(factory("retention_validation_lax")).violation is not None
    assert exception_safety(factory("mask_flag_not_restored")).violation is not None


def test_every_mutant_is_documented_and_instance_scoped() -> None:
    for name, m in REFERENCE_MUTANTS.items():
        doc = " ".join(m.doc.split())
        assert "Bug class" in doc and "Seen in" in doc and "Edit" in doc, name
    # Building mutants never touches the shared registry or another target.
    before = dict(ReferenceTarget.MUTANTS)
    from model.contract.config import Config, GroupSpec

    cfg = Config(
        groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=6)),
        num_blocks=12,
        retention_interval=0,
    )
    for name in REFERENCE_MUTANTS:
        ZooReferenceTarget(cfg, REFERENCE_MUTANTS[name])
    assert before == ReferenceTarget.MUTANTS
    plain = ReferenceTarget(cfg)
    pool = plain.allocator.block_pool
    assert "free_blocks" not in vars(pool) and "touch" not in vars(pool)


def test_vllm_mutants_restore_vllm() -> None:
    pytest.importorskip("vllm")
    from invariants.targets.vllm_env import vllm_available

    if not vllm_available()[0]:
        pytest.skip("vLLM unavailable")
    from vllm.v1.core import block_pool, kv_cache_coordinator, single_type_kv_cache_manager

    from invariants.zoo.mutants_vllm import VLLM_MUTANTS, activate

    def state() -> dict[str, object]:
        out: dict[str, object] = {}
        for mod in (block_pool, kv_cache_coordinator, single_type_kv_cache_manager):
            out.update({f"{mod.__name__}.{k}": v for k, v in vars(mod).items()})
            for cname, cls in vars(mod).items():
                if isinstance(cls, type):
                    out.update({f"{mod.__name__}.{cname}.{k}": v for k, v in vars(cls).items()})
        return out

    before = state()
    for name in VLLM_MUTANTS:
        with activate(name):
            assert state() != before, name
        assert state() == before, name
