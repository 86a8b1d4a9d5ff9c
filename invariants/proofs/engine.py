"""The proof engine: a theorem is a chain of Z3 validity steps, registered in one catalogue.

Each theorem is a named function whose docstring is its statement. It returns
`proved` (Z3 showed the negation unsatisfiable), `refuted` (with a
counterexample in domain terms) or `unknown` (a step undecided within its
resource limit on every seed). Variables are unbounded integers unless the
result names a bound. The verdict does not depend on the machine's load: a
step is limited by Z3's resource count, not by the clock.

Proof style. A theorem is a chain of steps; each step is one validity check
`hyps => claim`. A proved step is a tautology, so later steps may use it as a
hypothesis (and its universal closure over a free index, `generalize`). Steps
keep Z3 in decidable territory: quotient facts are proved once as separate
steps (see `lemmas`) instead of asking Z3 for nonlinear integer reasoning in
one go. Hit rules are maxima; steps use the witness part (`Hit.chosen`) and
explicit instances of the maximality quantifier (`Hit.instance(x)`), both
consequences of the rule.

Negative controls: every theorem has a deliberately broken twin that must be
refuted, and the refutation is of the theorem's stated claim: a control names
a `confirm` that evaluates that claim on the concrete counterexample (with the
executable model) and only a confirmed counterexample counts. Findings:
statements the design would like that do not hold of the model (or of vLLM);
expected to be refuted, reported with the counterexample.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Union

import z3

Values = dict[str, Union[int, bool]]
# a stated claim on concrete values: how it is violated there, or None where it holds
Claim = Callable[[Values], Union[str, None]]

STEP_TIMEOUT_MS = 60_000  # a wall-clock backstop per attempt; the step's real limit is STEP_RLIMIT
# Z3's resource count, not seconds: the same limit gives the same verdict on an idle or a loaded
# machine. The costliest proved step takes under 1M (about 0.5 s idle); 20M is about 3 s idle.
STEP_RLIMIT = 20_000_000
# Nonlinear steps (a product modulo a variable) are solved at once on most seeds and run away on a
# few, depending on Z3's term order, which varies with what the process built before. A step is
# tried on these seeds in turn: it is unknown only when every one runs out of STEP_RLIMIT.
STEP_SEEDS = (0, 1, 2, 3)
CONTROL_TIMEOUT_MS = 2_000  # controls fall back to a small-size counterexample search
SEARCH_CPU_S = 20.0  # the small-size search of one control (the slowest takes ~3 s idle)
_STEP_TIMES = bool(os.environ.get("KVRETAIN_STEP_TIMES"))

# --------------------------------------------------------------------------- results


@dataclass
class TheoremResult:
    name: str
    statement: str
    result: str  # "proved" | "refuted" | "unknown"
    bound: str | None
    seconds: float
    counterexample: str | None = None
    is_control: bool = False
    is_finding: bool = False
    detail: str | None = None
    witness: Values | None = None  # a control's counterexample as concrete values

    @property
    def expected_ok(self) -> bool:
        """Theorems must be proved; controls and findings must be refuted; a skipped check is no failure."""
        if self.result == "skipped":
            return True
        if self.is_control or self.is_finding:
            return self.result == "refuted"
        return self.result == "proved"

    @property
    def kind(self) -> str:
        return "control" if self.is_control else ("finding" if self.is_finding else "theorem")


@dataclass
class Step:
    """One validity check: hyps => claim (or, with `witness`, satisfiability of hyps and claim)."""

    label: str
    claim: z3.BoolRef
    hyps: Sequence[z3.BoolRef] = ()
    generalize: Sequence[z3.ExprRef] = ()
    witness: bool = False
    # the proved implication is valid for every value of its constants, so it may
    # also be recorded with some constants replaced by terms (instances)
    also_at: Sequence[Sequence[tuple[z3.ExprRef, z3.ExprRef]]] = ()
    # the labels of earlier steps this one uses (None: all of them); fewer lemmas, faster Z3
    uses: Sequence[str] | None = None
    # a lemma over fresh variables: checked without the theorem's premises
    standalone: bool = False


@dataclass
class Outcome:
    result: str
    counterexample: str | None = None
    detail: str | None = None
    witness: Values | None = None


Describe = Callable[[z3.ModelRef], str]


@dataclass
class Refutes:
    """What a control's counterexample must violate: its theorem's stated claim, evaluated concretely.

    `values` reads the counterexample's concrete values from a Z3 model;
    `claim` evaluates the stated claim on such values with the executable
    model and returns how it is violated (None: it holds there, the model only
    breaks an intermediate lemma and does not count).
    """

    values: Callable[[z3.ModelRef], Values]
    claim: Claim


def _search_small(
    s: z3.Solver,
    grid: Sequence[Sequence[z3.BoolRef]],
    accept: Callable[[z3.ModelRef], bool] = lambda m: True,
) -> z3.ModelRef | None:
    """Look for a counterexample with the size parameters pinned to small values (linear, fast).

    `accept` may reject a model (a control's counterexample that does not
    violate the stated claim): the search then goes on with the next pins.
    """
    # CPU seconds, not wall: on a loaded machine the same search must reach the same verdict.
    deadline = time.process_time() + SEARCH_CPU_S
    for pins in grid:
        if time.process_time() > deadline:
            break
        s.push()
        s.add(*pins)
        s.set("timeout", 1500)
        r = s.check()
        model = s.model() if r == z3.sat else None
        s.pop()
        if model is not None and accept(model):
            return model
    return None


def check_on_seeds(
    s: z3.Solver, timeout_ms: int, seeds: Sequence[int] = STEP_SEEDS
) -> tuple[z3.CheckSatResult, str]:
    """Z3's verdict on `s`, trying each seed in turn until one decides; with the last reason when none does."""
    reason = ""
    for seed in seeds:
        s.set("timeout", timeout_ms)
        s.set("rlimit", STEP_RLIMIT)
        s.set("random_seed", seed)
        r = s.check()
        if r != z3.unknown:
            return r, ""
        reason = s.reason_unknown()
    return z3.unknown, f"undecided on seeds {', '.join(map(str, seeds))} (last: {reason})"


def _refute_first(
    steps: Sequence[Step],
    base: Sequence[z3.BoolRef],
    describe: Describe,
    grid: Sequence[Sequence[z3.BoolRef]],
    refute_at: str,
    refutes: Refutes | None,
) -> Outcome | None:
    """A control's counterexample at the step its breakage hits, that step alone (no earlier lemma).

    With `refutes`, only a counterexample violating the stated claim counts and
    none found is `unknown`; without it, none found (or no grid) is None: the
    chain of steps decides.
    """
    target = [st for st in steps if st.label == refute_at]
    assert target, f"no step {refute_at!r}"
    s = z3.Solver()
    s.add(*base, *target[0].hyps, z3.Not(target[0].claim))
    if refutes is not None:
        violations: list[tuple[Values, str]] = []

        def accept(m: z3.ModelRef) -> bool:
            values = refutes.values(m)
            how = refutes.claim(values)
            if how is not None:
                violations.append((values, how))
            return how is not None

        found = _search_small(s, grid, accept)
        if found is None:
            return Outcome("unknown", None, f"no counterexample at {refute_at!r} violates the stated claim")
        values, how = violations[-1]
        return Outcome("refuted", f"{refute_at}: {describe(found)}; claim violated: {how}", witness=values)
    found = _search_small(s, grid) if grid else None
    if found is not None:
        return Outcome("refuted", f"{refute_at}: {describe(found)}")
    return None


def _counterexample(step: Step, s: z3.Solver, describe: Describe, refutes: Refutes | None) -> Outcome:
    """The verdict on a step whose negation `s` has a model: refuted, unless a control's
    counterexample holds the stated claim (then unknown)."""
    if refutes is None:
        return Outcome("refuted", f"{step.label}: {describe(s.model())}")
    at = refutes.values(s.model())
    violated = refutes.claim(at)
    if violated is None:
        return Outcome("unknown", None, f"the counterexample at {step.label!r} holds the stated claim")
    return Outcome("refuted", f"{step.label}: {describe(s.model())}; claim violated: {violated}", witness=at)


def _lemmas_of(step: Step) -> list[tuple[str, z3.BoolRef]]:
    """What a proved step lets later steps assume: its implication at each recorded instance,
    then in general (each closed over `generalize`)."""
    fact = z3.Implies(z3.And(list(step.hyps) + [z3.BoolVal(True)]), step.claim)
    lemmas: list[tuple[str, z3.BoolRef]] = []
    for inst in [*(z3.substitute(fact, *subs) for subs in step.also_at), fact]:
        lemmas.append((step.label, z3.ForAll(list(step.generalize), inst) if step.generalize else inst))
    return lemmas


def run_steps(
    steps: Sequence[Step],
    base: Sequence[z3.BoolRef],
    describe: Describe,
    grid: Sequence[Sequence[z3.BoolRef]] = (),
    timeout_ms: int | None = None,
    refute_at: str | None = None,
    refutes: Refutes | None = None,
) -> Outcome:
    """Check the steps in order; each proved step becomes a hypothesis of the next.

    When a step is unknown and `grid` is given, small pinned size parameters are
    tried: a model found there is a genuine counterexample (refuted); none
    found leaves the step unknown. Controls name the step their breakage hits
    (`refute_at`): that step is searched first, without the earlier lemmas
    (they only help a proof; a model of the step alone is a counterexample).
    With `refutes`, a control counts only a counterexample whose concrete
    values violate the theorem's stated claim; none found is `unknown`.
    """
    if refute_at is not None:
        early = _refute_first(steps, base, describe, grid, refute_at, refutes)
        if early is not None:
            return early
    lemmas: list[tuple[str, z3.BoolRef]] = []
    witnesses: list[str] = []
    timeout = timeout_ms or (CONTROL_TIMEOUT_MS if grid else STEP_TIMEOUT_MS)
    # a control with a grid falls back to its small-size search: one seed is enough there
    seeds = STEP_SEEDS[:1] if grid else STEP_SEEDS
    for step in steps:
        t0 = time.monotonic()
        s = z3.Solver()
        if not step.standalone:
            s.add(*base, *[f for label, f in lemmas if step.uses is None or label in step.uses])
        s.add(*step.hyps)
        if step.witness:
            s.add(step.claim)
            r, _ = check_on_seeds(s, timeout, seeds)
            if r == z3.sat:
                witnesses.append(f"{step.label}: {describe(s.model())}")
                continue
            return Outcome("refuted" if r == z3.unsat else "unknown", None, f"no witness for {step.label}")
        s.add(z3.Not(step.claim))
        r, reason = check_on_seeds(s, timeout, seeds)
        if _STEP_TIMES:
            print(f"    {step.label}: {r} {time.monotonic() - t0:.2f}s", flush=True)
        if r == z3.sat:
            return _counterexample(step, s, describe, refutes)
        if r != z3.unsat:
            found = _search_small(s, grid) if grid else None
            if found is not None:
                return Outcome("refuted", f"{step.label}: {describe(found)}")
            return Outcome("unknown", None, f"step '{step.label}': {reason}")
        lemmas.extend(_lemmas_of(step))
    return Outcome("proved", None, "; ".join(witnesses) or None)


@dataclass
class Theorem:
    name: str
    fn: Callable[[], Outcome]
    is_control: bool = False
    is_finding: bool = False
    bound: str | None = None
    # a control's stated claim on concrete values (the one its counterexample must violate)
    claim: Claim | None = None

    @property
    def statement(self) -> str:
        doc = (self.fn.__doc__ or "").strip()
        return " ".join(doc.split("\n\n")[0].split())


CATALOGUE: list[Theorem] = []


def theorem(  # type: ignore[no-untyped-def]
    *, control: bool = False, finding: bool = False, bound: str | None = None, claim: Claim | None = None
):
    """Register a theorem; a control names the claim (on concrete values) its counterexample violates."""

    def register(fn: Callable[[], Outcome]) -> Callable[[], Outcome]:
        CATALOGUE.append(Theorem(fn.__name__, fn, control, finding, bound, claim))
        return fn

    return register


# --------------------------------------------------------------------------- describing models


def value_of(m: z3.ModelRef, t: z3.ExprRef) -> str:
    x = m.eval(t, model_completion=True)
    if z3.is_int_value(x):
        return str(x.as_long())
    if z3.is_true(x):
        return "yes"
    if z3.is_false(x):
        return "no"
    return str(x)


def concrete(m: z3.ModelRef, t: z3.ExprRef) -> int | bool:
    """The value of an integer or Boolean term in a model."""
    x = m.eval(t, model_completion=True)
    return bool(z3.is_true(x)) if z3.is_bool(x) else int(x.as_long())


def int_of(m: z3.ModelRef, t: z3.ExprRef) -> int:
    return int(m.eval(t, model_completion=True).as_long())
