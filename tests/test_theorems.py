"""The Z3 theorem catalogue: every theorem proved, every negative control and finding refuted.

The whole catalogue runs once per test run (two processes, about 30 s).
Each control states which theorem's claim it refutes, and its reported
counterexample is re-evaluated here against that claim. Plus conformance
checks that tie the validator term and the free-queue positions to the code
(the transition system itself: tests/test_queue_link.py).
"""

from __future__ import annotations

import random
import re
import warnings

import pytest
import z3

from invariants.proofs import runner
from invariants.proofs.engine import (
    STEP_SEEDS,
    Refutes,
    Step,
    Theorem,
    TheoremResult,
    check_on_seeds,
    run_steps,
)
from invariants.proofs.validation import validator_accepts
from model.contract.config import Config, ConfigError, GroupSpec, validate
from model.contract.free_queue import FreeQueue

NAMES = [th.name for th in runner.THEOREMS]


def test_every_theorem_has_a_control() -> None:
    controls = [th for th in runner.THEOREMS if th.is_control]
    plain = [th for th in runner.THEOREMS if not th.is_control and not th.is_finding]
    for th in plain:
        assert any(th.name in c.statement for c in controls), f"{th.name} has no negative control"
    assert len(plain) >= 15 and len(controls) >= len(plain)


def test_statements_are_one_line() -> None:
    for th in runner.THEOREMS:
        assert th.statement and "\n" not in th.statement, th.name


def test_each_theorem_names_its_pr() -> None:
    for th in runner.THEOREMS:
        if not th.is_control and not th.is_finding:
            assert re.search(r"#\d{5}", th.statement), f"{th.name}: no PR in its statement"


def test_each_control_states_the_claim_it_refutes() -> None:
    """'Control for <theorem> (<its claim>): ...', and a claim evaluator on concrete values."""
    plain = {th.name for th in runner.THEOREMS if not th.is_control and not th.is_finding}
    for th in runner.THEOREMS:
        if th.is_control:
            m = re.match(r"Control for (\w+) \(", th.statement)
            assert m and m.group(1) in plain, th.name
            assert th.claim is not None, f"{th.name} names no claim its counterexample must violate"


def test_a_counterexample_that_keeps_the_claim_is_not_a_refutation() -> None:
    """The gate of every control: a model of the broken step whose values satisfy the stated claim leaves
    the control unknown (here: a claim evaluator that never finds a violation)."""
    x = z3.Int("x")
    steps = [Step("x is small", x < 3, [x >= 0])]
    grid = [[x == v] for v in range(6)]
    kept = Refutes(lambda m: {"x": m.eval(x, model_completion=True).as_long()}, lambda v: None)
    assert run_steps(steps, [], str, grid=grid, refute_at="x is small", refutes=kept).result == "unknown"
    broken = Refutes(kept.values, lambda v: f"x = {v['x']}" if int(v["x"]) >= 3 else None)
    o = run_steps(steps, [], str, grid=grid, refute_at="x is small", refutes=broken)
    assert o.result == "refuted" and o.witness is not None and int(o.witness["x"]) >= 3


class _SeedSensitiveSolver:
    """A stand-in for z3.Solver whose search decides only on the given seeds (Z3 on a nonlinear step)."""

    def __init__(self, decides_on: set[int]) -> None:
        self.decides_on = decides_on
        self.params: dict[str, int] = {}
        self.tried: list[int] = []

    def set(self, key: str, value: int) -> None:
        self.params[key] = value

    def check(self) -> z3.CheckSatResult:
        self.tried.append(self.params["random_seed"])
        return z3.unsat if self.params["random_seed"] in self.decides_on else z3.unknown

    def reason_unknown(self) -> str:
        return "canceled"


def test_a_step_undecided_on_one_seed_is_decided_on_the_next() -> None:
    s = _SeedSensitiveSolver({STEP_SEEDS[2]})
    r, why = check_on_seeds(s, 1000)  # type: ignore[arg-type]
    assert r == z3.unsat and why == "" and s.tried == list(STEP_SEEDS[:3])


def test_control_a_step_undecided_on_every_seed_stays_unknown_and_says_so() -> None:
    s = _SeedSensitiveSolver(set())
    r, why = check_on_seeds(s, 1000)  # type: ignore[arg-type]
    assert r == z3.unknown and s.tried == list(STEP_SEEDS)
    assert why == f"undecided on seeds {', '.join(map(str, STEP_SEEDS))} (last: canceled)"


def test_the_step_limit_is_z3s_resource_count_not_the_clock() -> None:
    """A search that needs more than the resource limit stops with 'canceled' well before the wall timeout."""
    xs = [z3.Int(f"p{i}") for i in range(3)]
    s = z3.Solver()
    # x^3 + y^3 = z^3 in positive integers: no solution, and no quick proof of that for Z3
    s.add(*[x >= 1 for x in xs], xs[0] ** 3 + xs[1] ** 3 == xs[2] ** 3)
    r, why = check_on_seeds(s, 600_000, seeds=(0,))
    assert r == z3.unknown and "canceled" in why


@pytest.fixture(scope="module")
def results() -> dict[str, TheoremResult]:
    return {r.name: r for r in runner.run_theorems()}


@pytest.mark.parametrize("name", NAMES)
def test_catalogue(name: str, results: dict[str, TheoremResult]) -> None:
    """Theorems proved (unbounded unless the result names a bound); controls and findings refuted."""
    r = results[name]
    assert r.expected_ok, f"{name}: {r.result} {r.counterexample or r.detail or ''}"
    if r.is_control or r.is_finding:
        assert r.counterexample and any(ch.isdigit() for ch in r.counterexample)  # concrete domain values


CONTROLS = [th for th in runner.THEOREMS if th.is_control]


@pytest.mark.parametrize("control", CONTROLS, ids=[th.name for th in CONTROLS])
def test_control_counterexample_violates_the_stated_claim(
    control: Theorem, results: dict[str, TheoremResult]
) -> None:
    """Re-evaluated here on the reported values: the counterexample breaks the theorem's claim, not a lemma."""
    r = results[control.name]
    assert r.witness is not None, f"{control.name}: no concrete counterexample"
    assert control.claim is not None
    violated = control.claim(r.witness)
    assert violated is not None, f"{control.name}: the claim holds at {r.witness}"
    assert r.counterexample is not None and violated in r.counterexample


def test_format_table_lists_every_result(results: dict[str, TheoremResult]) -> None:
    table = runner.format_table(list(results.values()))
    for name in results:
        assert name in table
    assert "as expected" in table


def test_result_expectations() -> None:
    base = dict(statement="s", bound=None, seconds=0.0)
    assert TheoremResult("t", result="proved", **base).expected_ok  # type: ignore[arg-type]
    assert not TheoremResult("t", result="unknown", **base).expected_ok  # type: ignore[arg-type]
    assert TheoremResult("c", result="refuted", is_control=True, **base).expected_ok  # type: ignore[arg-type]
    assert not TheoremResult("c", result="proved", is_control=True, **base).expected_ok  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- conformance


def test_validator_term_matches_config_validate() -> None:
    """validator_accepts is model.contract.config.validate's retention rule."""
    k, sbs = z3.Ints("k sbs")
    none, group = z3.Bools("none group")
    term = validator_accepts(k, none, sbs, group)
    rng = random.Random(3)
    for _ in range(400):
        bs = rng.choice([1, 2, 4, 8])
        has_group = rng.random() < 0.7
        groups = (
            (GroupSpec("full", bs), GroupSpec("swa", bs * 2, sliding_window=5))
            if has_group
            else (GroupSpec("full", bs),)
        )
        r = rng.choice([None, 0, -bs, rng.randint(1, 40)])
        cfg = Config(groups, 8, retention_interval=r)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                validate(cfg)
            accepted = True
        except ConfigError:
            accepted = False
        sub = [
            (k, z3.IntVal(r or 0)),
            (sbs, z3.IntVal(cfg.scheduler_block_size)),
            (none, z3.BoolVal(r is None)),
            (group, z3.BoolVal(has_group)),
        ]
        assert z3.is_true(z3.simplify(z3.substitute(term, *sub))) == accepted, (r, bs, has_group)


def test_free_queue_matches_the_transition_system() -> None:
    """model/contract/free_queue.py behaves as the theorems' position model: prepend at lo - 1,
    append at hi + 1, popleft_n takes the smallest positions, remove takes any."""
    rng = random.Random(17)
    q = FreeQueue(range(1, 9))
    pos = {b: b for b in range(1, 9)}
    lo, hi = 0, 9
    outside = set()
    for _ in range(3000):
        op = rng.choice(["pop", "prepend", "append", "remove"])
        if op == "pop" and len(q):
            n = rng.randint(0, len(q))
            taken = q.popleft_n(n)
            assert taken == sorted(pos, key=pos.__getitem__)[:n]
            for b in taken:
                del pos[b]
            outside |= set(taken)
        elif op in ("prepend", "append") and outside:
            blocks = rng.sample(sorted(outside), rng.randint(1, min(3, len(outside))))
            if op == "prepend":
                q.prepend_n(blocks)
                for b in reversed(blocks):
                    pos[b], lo = lo, lo - 1
            else:
                q.append_n(blocks)
                for b in blocks:
                    pos[b], hi = hi, hi + 1
            outside -= set(blocks)
        elif op == "remove" and len(q):
            b = rng.choice(q.blocks)
            q.remove(b)
            del pos[b]
            outside.add(b)
        assert q.blocks == sorted(pos, key=pos.__getitem__)
