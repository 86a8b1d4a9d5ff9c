"""Mamba retention theorems (#45845): one state per segment, every promised state kept and served.

Every term is evaluated against the executable model on many concrete values
by a test (`tests/test_smt.py`: S, `tests/test_proof_setups.py`: P):

- `Mamba.mask` (`smt.mamba_mask`): `model.contract.masks.mamba_kept_blocks` (S
  `test_masks_match_model`); with the allocator's prompt, junction, range and
  config substituted, the state blocks `AllocatorModel.cache_blocks` keeps (P
  `test_setup_mask_is_the_allocators_mask`), which ties `Mamba.boundaries`.
- `smt.mamba_hit`: `model.contract.lookup.mamba_hit` (S `test_hit_rules_match_model`).
- `smt.mamba_checkpoint_position`: `model.policy.scheduling.mamba_checkpoint_position`
  (S `test_scheduling_and_cacheable_match_model`).
- `Mamba.replay` (`smt.replay_boundaries`), `smt.boundary_edge`: `model.contract.masks`
  (S `test_replay_boundaries_match_model`, `test_tail_and_edge_match_model`).
- `Mamba.side` (`smt.config_side_conditions`): `model.contract.config.validate` (P
  `test_side_conditions_match_validate`).
"""

from __future__ import annotations

import z3

from invariants.proofs.engine import (
    CONTROL_TIMEOUT_MS,
    Outcome,
    Refutes,
    Step,
    Values,
    concrete,
    int_of,
    run_steps,
    theorem,
    value_of,
)
from invariants.proofs.lemmas import generic_lemma, lemma_cancel, lemma_floor_aligned, lemma_mul_mod
from invariants.proofs.swa_setup import MaskAt
from model.contract import lookup, masks, smt
from model.contract.smt import DENSE, INTERVAL, ZERO, I
from model.policy import scheduling


class Mamba:
    """A symbolic Mamba group (align mode) of a hybrid model and the prompt it cached."""

    def __init__(self, *, eagle: bool | None = None) -> None:
        self.bs, self.A, self.P, self.end, self.J, self.L = z3.Ints(
            "block_size alignment prompt end junction max_length"
        )
        self.eagle = z3.Bool("eagle") if eagle is None else z3.BoolVal(eagle)
        self.r = smt.Retention.symbolic("retention")
        self.has_j = z3.Bool("has_junction")
        b1, b2 = smt.replay_boundaries(self.P, self.A, self.eagle)
        self.replay = (b1, b2)
        self.boundaries = [
            b1,
            b2,
            z3.If(self.has_j, self.J, b1),
            z3.If(z3.And(self.has_j, self.eagle), self.J - self.bs, b1),
        ]
        self.per = self.r.k / self.bs
        self.side = [
            smt.config_side_conditions(block_size=self.bs, alignment=self.A, retention=self.r),
            self.P >= 1,
            self.end >= 0,
            z3.Implies(self.has_j, self.J >= 1),
        ]

    def mask(self, **control: object) -> smt.Mask:
        return smt.mamba_mask(
            0,
            self.end,
            block_size=self.bs,
            alignment=self.A,
            retention=self.r,
            boundaries=self.boundaries,
            **control,  # type: ignore[arg-type]
        )

    def cached(
        self, mask: smt.Mask, name: str, exists: z3.FuncDeclRef | None = None
    ) -> tuple[z3.FuncDeclRef, z3.BoolRef]:
        """cached(j) = kept(j) and the state block exists (states exist only at chunk ends)."""
        C = z3.Function(name, z3.IntSort(), z3.BoolSort())
        x = z3.Int("x_" + name)
        body = mask(x) if exists is None else z3.And(mask(x), exists(x))
        return C, z3.ForAll([x], C(x) == body, patterns=[C(x)])

    def describe(self, m: z3.ModelRef) -> str:
        return (
            f"block_size={value_of(m, self.bs)}, alignment={value_of(m, self.A)}, retention={self.r.describe(m)}, "
            f"eagle={value_of(m, self.eagle)}, prompt={value_of(m, self.P)} tokens, {value_of(m, self.end)} blocks computed"
        )

    def grid(self) -> list[list[z3.BoolRef]]:
        out = []
        for bs in (1, 2, 4):
            for mult in (1, 2):
                for r in (0, 2, 3, 4):
                    mode = ZERO if r == 0 else INTERVAL
                    out.append(
                        [self.bs == bs, bs * mult == self.A, self.r.mode == mode, self.r.k == r * bs * mult]
                    )
        return out

    def arith_steps(self) -> list[Step]:
        k, A, bs = self.r.k, self.A, self.bs
        n = (k / A) * (A / bs)
        inter = [self.r.mode == INTERVAL]
        return [
            Step("alignment is whole blocks", (A / bs) * bs == A),
            Step("interval = n alignments", k == (k / A) * A, inter),
            Step("interval = n*a blocks", k == n * bs, inter),
            Step("blocks per interval", self.per == n, inter),
        ]


# --------------------------------------------------------------------------- claims on concrete values
# A control's counterexample counts only if it violates its theorem's stated claim, evaluated with the
# executable model (`model.contract.lookup.mamba_hit`, `model.contract.masks`) and the control's broken mask.


def mamba_values(c: Mamba, m: z3.ModelRef) -> Values:
    """The concrete configuration, prompt and lookup of a Z3 model of the Mamba setup."""
    terms = {
        "block_size": c.bs,
        "alignment": c.A,
        "prompt": c.P,
        "end": c.end,
        "junction": c.J,
        "has_junction": c.has_j,
        "max_length": c.L,
        "eagle": c.eagle,
        "mode": c.r.mode,
        "k": c.r.k,
    }
    return {name: concrete(m, t) for name, t in terms.items()}


def mamba_mask_at(v: Values, *, dense: bool = False, **control: object) -> MaskAt:
    """A (possibly broken) Mamba mask at the values `v` (`dense`: the dense twin)."""
    c = Mamba(eagle=bool(v["eagle"]))
    mode, k = (DENSE, 0) if dense else (int(v["mode"]), int(v["k"]))
    sub = [
        (getattr(c, n), I(int(v[key])))
        for n, key in (("bs", "block_size"), ("A", "alignment"), ("P", "prompt"))
    ]
    sub += [(c.J, I(int(v["junction"]))), (c.has_j, z3.BoolVal(bool(v["has_junction"])))]
    mask = smt.mamba_mask(
        0,
        int(v["end"]),
        block_size=c.bs,
        alignment=c.A,
        retention=smt.Retention(I(mode), I(k)),
        boundaries=c.boundaries,
        **control,  # type: ignore[arg-type]
    )
    return MaskAt(mask, sub, int(v["end"]))


def mamba_hit_tokens(v: Values, cached: set[int], max_length: int) -> int:
    bs = int(v["block_size"])
    return len(lookup.mamba_hit(cached.__contains__, max_length, bs, int(v["alignment"]))) * bs


def _boundary_states(v: Values) -> set[int]:
    """The state blocks of the reachable boundaries (replay boundaries, junction, junction minus a block)."""
    bs, A = int(v["block_size"]), int(v["alignment"])
    bounds = list(masks.replay_boundaries(int(v["prompt"]), A, bool(v["eagle"])))
    if v["has_junction"]:
        bounds += [int(v["junction"])] + ([int(v["junction"]) - bs] if v["eagle"] else [])
    return {masks.boundary_edge(b, A, bs) - 1 for b in bounds}


def _one_state_claim(v: Values) -> str | None:
    """mamba_one_state_per_segment's claim at concrete values, for states kept one block early."""
    if v["mode"] != INTERVAL:
        return None
    mask = mamba_mask_at(v, off_by_one=True)
    if mask.dense():
        return None  # a dense mask keeps every state by design
    kept, per = mask.kept(), int(v["k"]) // int(v["block_size"])
    extra = sorted(j for j in kept - _boundary_states(v) if j % per != per - 1)
    return f"retention {v['k']}: state block(s) {extra} kept inside their segments" if extra else None


def _replay_state_served(v: Values) -> str | None:
    """mamba_promise_kept's claim (replay boundary) at concrete values, for boundary states one block late;
    every state exists (the most a scheduler can produce)."""
    bs, A, L = int(v["block_size"]), int(v["alignment"]), int(v["max_length"])
    b1 = smt.replay_boundaries(int(v["prompt"]), A, bool(v["eagle"]))[0]
    E = int(z3.simplify(I(b1)).as_long()) // A * A
    if v["mode"] == DENSE or E < A or int(v["end"]) <= E // bs - 1 or L < E:
        return None
    kept = mamba_mask_at(v, boundary_shift=1).kept()
    hit = mamba_hit_tokens(v, kept, L)
    problems = [f"state block {E // bs - 1} not kept"] if E // bs - 1 not in kept else []
    if hit < E:
        problems.append(f"max length {L}: the hit is {hit} tokens, below the replay boundary {E}")
    return "; ".join(problems) or None


def _mamba_within_claim(v: Values) -> str | None:
    """mamba_within_one_interval's claim at concrete values (every state exists), for states one block early."""
    if v["mode"] != INTERVAL:
        return None
    k, bs = int(v["k"]), int(v["block_size"])
    sparse, dense = mamba_mask_at(v, off_by_one=True).kept(), mamba_mask_at(v, dense=True).kept()
    for L in range((int(v["end"]) + 2) * bs):
        hs, hd = mamba_hit_tokens(v, sparse, L), mamba_hit_tokens(v, dense, L)
        if hs <= hd - k:
            return f"retention {k}, max length {L}: sparse hit {hs} tokens <= dense hit {hd} - {k}"
    return None


def _checkpoint_claim(v: Values) -> str | None:
    """mamba_checkpoint_is_replay_boundary's claim at concrete values, for a stop that ignores Eagle."""
    P, A, eagle = int(v["prompt"]), int(v["alignment"]), bool(v["eagle"])
    latest = max(masks.replay_boundaries(P, A, eagle)) // A * A
    stop = scheduling.mamba_checkpoint_position(P, A, False)
    return (
        f"prompt {P} tokens: the scheduler stops at {stop}, the replay boundary is {latest}"
        if stop != latest
        else None
    )


def _one_state_steps(c: Mamba, mask: smt.Mask) -> list[Step]:
    i = z3.Int("i")
    not_boundary = z3.And([i != smt.boundary_edge(b, c.A, c.bs) - 1 for b in c.boundaries])
    pre = [c.r.mode == INTERVAL, z3.Not(mask.dense), mask(i), not_boundary]
    return [
        generic_lemma(
            "last block of a segment",
            2,
            lambda x, p: ([p >= 2, (x + 1) % p == 0], x % p == p - 1),
            (i, c.per),
        ),
        Step("one state per segment: its last block", i % c.per == c.per - 1, pre),
    ]


@theorem()
def mamba_one_state_per_segment() -> Outcome:
    """Mamba (#45845): with retention k, within every k-token segment the only state block kept other than the reachable-boundary states (the replay boundary, the junction) is the segment's last block.

    Unbounded.
    """
    c = Mamba()
    return run_steps(_one_state_steps(c, c.mask()), c.side, c.describe)


@theorem(control=True, claim=_one_state_claim)
def control_mamba_state_off_by_one() -> Outcome:
    """Control for mamba_one_state_per_segment (only the segment's last block, besides boundary states): keeping block k with k % per == 0 keeps a state inside its segment."""
    c = Mamba()
    return run_steps(
        _one_state_steps(c, c.mask(off_by_one=True)),
        c.side,
        c.describe,
        grid=c.grid(),
        refute_at="one state per segment: its last block",
        refutes=Refutes(lambda m: mamba_values(c, m), _one_state_claim),
    )


def _mamba_promise_steps(c: Mamba, mask: smt.Mask, which: str) -> tuple[list[Step], smt.Hit]:
    exists = z3.Function("state_exists", z3.IntSort(), z3.BoolSort())
    C, axiom = c.cached(mask, "cached", exists)
    hit = smt.mamba_hit(C, c.L, c.bs, c.A)
    q = z3.Int("q")
    if which == "segment":
        E = q * c.r.k
        cond = [c.r.mode == INTERVAL, q >= 1]
    else:
        E = c.boundaries[0 if which == "replay" else 2] / c.A * c.A
        cond = [c.r.mode != DENSE, E >= c.A] + ([c.has_j] if which == "junction" else [])
    s = E / c.bs - 1  # the state block of the boundary: no Eagle shift
    pre = [axiom, *cond, c.end > s, c.L >= E, exists(s)]
    steps = c.arith_steps() + [
        lemma_mul_mod(
            (q, c.r.k, c.r.k / c.A, c.A),
            (q, c.r.k, (c.r.k / c.A) * (c.A / c.bs), c.bs),
            (E / c.A, c.A, c.A / c.bs, c.bs),
        ),
        lemma_cancel((q * c.per, c.bs)),
        lemma_mul_mod((q, c.per, 1, c.per)),
        Step("segment end in blocks", z3.Implies(c.r.mode == INTERVAL, (q * c.r.k) / c.bs == q * c.per), pre),
        Step("boundary in whole blocks", (E / c.bs) * c.bs == E, pre),
        lemma_floor_aligned(E, c.A),
        Step("boundary aligned", z3.Or(E % c.A == 0, which == "segment"), pre, uses=["floor is aligned"]),
        Step(
            "state block index",
            z3.Implies(c.r.mode == INTERVAL, (s + 1) % c.per == 0)
            if which == "segment"
            else z3.BoolVal(True),
            pre,
        ),
        Step("state block kept", C(s), pre),
        Step(
            "scan finds the state",
            hit.blocks * c.bs >= E,
            pre + [hit.chosen, hit.instance(s)],
            uses=[
                "state block kept",
                "boundary in whole blocks",
                "boundary aligned",
                "multiple of a multiple",
                "segment end in blocks",
                "interval = n*a blocks",
                "blocks per interval",
                "alignment is whole blocks",
            ],
        ),
    ]
    return steps, hit


@theorem()
def mamba_promise_kept() -> Outcome:
    """Mamba (#45845): for every retained boundary (a segment end for interval k, the replay boundary, the junction; floored to the alignment), the state block ending exactly there (no Eagle shift) is kept, and a lookup reaching the boundary hits at least it, provided the scheduler produced that state.

    Unbounded; mamba_checkpoint_is_replay_boundary shows the scheduler does
    produce the replay boundary's state.
    """
    for which in ("segment", "replay", "junction"):
        c = Mamba()
        steps, _ = _mamba_promise_steps(c, c.mask(), which)
        o = run_steps(steps, c.side, c.describe)
        if o.result != "proved":
            return Outcome(o.result, o.counterexample, f"{which}: {o.detail}")
    return Outcome("proved")


@theorem(control=True, claim=_replay_state_served)
def control_mamba_eagle_shift() -> Outcome:
    """Control for mamba_promise_kept (the boundary's state kept and the hit reaching it): shifting the boundary state by one block (an Eagle shift applied to Mamba) drops that state and the replay hit falls below the boundary."""
    c = Mamba()
    steps, _ = _mamba_promise_steps(c, c.mask(boundary_shift=1), "replay")

    def describe(m: z3.ModelRef) -> str:
        E = int_of(m, c.replay[0] / c.A * c.A)
        return f"{c.describe(m)}: replay boundary {E} tokens, its state block {E // int_of(m, c.bs) - 1} not kept"

    refutes = Refutes(lambda m: mamba_values(c, m), _replay_state_served)
    return run_steps(steps, c.side, describe, grid=c.grid(), refute_at="state block kept", refutes=refutes)


def _mamba_within_steps(c: Mamba, sparse: smt.Mask) -> list[Step]:
    """States exist at every computed block; sparse (interval k) hit > dense hit - k."""
    dense = smt.mamba_mask(
        0,
        c.end,
        block_size=c.bs,
        alignment=c.A,
        retention=smt.Retention(I(DENSE), I(0)),
        boundaries=c.boundaries,
    )
    D, dense_axiom = c.cached(dense, "cached_dense")
    S, sparse_axiom = c.cached(sparse, "cached_sparse")
    hd = smt.mamba_hit(D, c.L, c.bs, c.A)
    hs = smt.mamba_hit(S, c.L, c.bs, c.A)
    k = c.r.k
    hd_tokens = hd.blocks * c.bs
    qd = hd_tokens / k
    s = qd * c.per - 1
    premises = [
        dense_axiom,
        sparse_axiom,
        c.r.mode == INTERVAL,
        z3.Not(sparse.dense),
        hd.chosen,
        hs.chosen,
        hs.instance(s),
    ]
    tail = [
        Step("floor to the interval", z3.And(qd * k <= hd_tokens, hd_tokens < qd * k + k)),
        Step("floored boundary in blocks", qd * c.per <= hd.blocks),
        Step("dense hit state computed", z3.Implies(hd.blocks >= 1, D(hd.blocks - 1))),
        Step("state edge in tokens", (s + 1) * c.bs == qd * k),
        Step("floored state kept", z3.Implies(qd >= 1, S(s))),
        Step("floored state aligned", z3.Implies(qd >= 1, ((s + 1) * c.bs) % c.A == 0)),
        Step("floored boundary served", z3.Implies(qd >= 1, hs.blocks >= qd * c.per)),
        generic_lemma(
            "scale", 3, lambda x, y, b_: ([x >= y, b_ >= 1], x * b_ >= y * b_), (hs.blocks, qd * c.per, c.bs)
        ),
        Step(
            "sparse within one interval of dense",
            hs.blocks * c.bs > hd_tokens - k,
            uses=[
                "floor to the interval",
                "floored boundary served",
                "scale",
                "interval = n*a blocks",
                "blocks per interval",
            ],
        ),
    ]
    for st in tail:
        st.hyps = [*premises, *st.hyps]
    return (
        c.arith_steps()
        + [
            lemma_mul_mod((qd * (k / c.A), c.A, c.A / c.bs, c.bs), (qd, k, k / c.A, c.A)),
            lemma_cancel((qd * c.per, c.bs)),
        ]
        + tail
    )


@theorem()
def mamba_within_one_interval() -> Outcome:
    """Mamba (#45845): when a state exists at every computed block, the retention-k hit over a cached prompt is greater than the dense hit minus k.

    Unbounded. (With chunked prefill states exist only at chunk ends; then the
    bound holds for the segment ends the scheduler stopped at.)
    """
    c = Mamba()
    return run_steps(_mamba_within_steps(c, c.mask()), c.side, c.describe)


@theorem(control=True, claim=_mamba_within_claim)
def control_mamba_within_off_by_one() -> Outcome:
    """Control for mamba_within_one_interval (sparse hit > dense hit - k): with states kept one block early the sparse hit falls a whole interval or more behind."""
    c = Mamba()
    return run_steps(
        _mamba_within_steps(c, c.mask(off_by_one=True)),
        c.side,
        c.describe,
        grid=c.grid(),
        refute_at="floored state kept",
        refutes=Refutes(lambda m: mamba_values(c, m), _mamba_within_claim),
    )


def _checkpoint_steps(c: Mamba, eagle_aware: bool) -> list[Step]:
    b1, b2 = c.replay
    ckpt = smt.mamba_checkpoint_position(c.P, c.A, c.eagle if eagle_aware else False)
    latest = smt.zmax(b1, b2) / c.A * c.A
    return [Step("checkpoint = latest replay boundary, floored", ckpt == latest, [c.A >= 1])]


@theorem()
def mamba_checkpoint_is_replay_boundary() -> Outcome:
    """Mamba (#45845): the scheduler's chunk stop (scheduling.mamba_checkpoint_position) is exactly the latest replay boundary floored to the alignment, with and without Eagle, so the state the Mamba mask promises to keep exists.

    Unbounded prompt length and scheduler block size.
    """
    c = Mamba()
    return run_steps(_checkpoint_steps(c, True), c.side, c.describe)


@theorem(control=True, claim=_checkpoint_claim)
def control_mamba_checkpoint_ignores_eagle() -> Outcome:
    """Control for mamba_checkpoint_is_replay_boundary (the chunk stop is the latest replay boundary): a scheduler stop that ignores Eagle stops past the Eagle replay boundary."""
    c = Mamba(eagle=True)
    refutes = Refutes(lambda m: mamba_values(c, m), _checkpoint_claim)
    return run_steps(
        _checkpoint_steps(c, False), c.side, c.describe, timeout_ms=CONTROL_TIMEOUT_MS, refutes=refutes
    )
