"""CrossHair on reference_impl: contracts and twin equivalence, with a small budget.

The default run uses about a second per function (reported honestly as
"no counterexample in T s" unless CrossHair exhausts the paths); the broken
twin must be caught. `python -m invariants.proofs.crosshair 30` runs the whole
set with a larger budget.
"""

from __future__ import annotations

import random

import pytest

from invariants.proofs import crosshair as cc


def test_twins_agree_on_random_inputs() -> None:
    """A cheap concrete sanity check of the wrappers before CrossHair explores them symbolically."""
    rng = random.Random(0)
    for _ in range(3000):
        args = (
            rng.randint(1, 4),
            rng.randint(1, 3),
            rng.randint(1, 12),
            rng.random() < 0.5,
            rng.randint(0, 2),
            rng.randint(1, 3),
            0,
            rng.randint(0, 8),
            rng.randint(0, 32),
        )
        assert cc.ref_swa_mask(*args) == cc.model_swa_mask(*args), args
        m_args = (args[0], args[1], args[4], args[5], args[6], args[7], args[8])
        assert cc.ref_mamba_mask(*m_args) == cc.model_mamba_mask(*m_args), m_args
        bs = args[0]
        h = (rng.randrange(256), rng.randint(0, 8 * bs), bs, args[1])
        assert cc.ref_full_hit(*h, args[3]) == cc.model_full_hit(*h, args[3]), h
        assert cc.ref_swa_hit(*h, args[2], args[3]) == cc.model_swa_hit(*h, args[2], args[3]), h
        assert cc.ref_mamba_hit(*h) == cc.model_mamba_hit(*h), h
        ops = [rng.randrange(28) for _ in range(rng.randint(0, 8))]
        assert cc.ref_queue(ops) == cc.model_queue(ops), ops


@pytest.mark.parametrize("name", ["swa_mask", "swa_hit", "control_broken_swa_mask"])
def test_crosshair_twin(name: str) -> None:
    ((ref, twin, control),) = [(r, t, c) for n, r, t, c in cc.TWINS if n == name]
    r = cc.run_twin(name, ref, twin, control, budget_s=20.0 if control else 1.0)
    assert r.result != "error", r.counterexample
    assert r.expected_ok, f"{name}: {r.verdict} {r.counterexample or ''}"


def test_crosshair_contract() -> None:
    r = cc.run_contract("ref_swa_hit", budget_s=1.0)
    assert r.result in ("confirmed", "no counterexample"), r.counterexample
