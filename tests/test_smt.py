"""model/contract/smt.py evaluates to exactly what model/contract/masks.py and model/contract/lookup.py return.

Thousands of random concrete inputs (seeded), drawn from the configurations
the validator accepts (and, for the masks, also non-multiple intervals and
sub-block alignments, where the functions still have a defined value). If
these agree, the Z3 theorems speak about the code the fuzzer runs.

For speed each Z3 definition is built once over symbolic inputs (a template)
and evaluated per sample by substituting numerals: the evaluated term is the
very term the theorems use, with its free variables instantiated.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import z3

from model.contract import lookup, masks, smt

N_MASK = 1500
N_HIT = 500
MAX_BLOCKS = 32  # block indices sampled in [0, MAX_BLOCKS)
MAX_HIT_BLOCKS = 16


def _config(rng: random.Random, valid_only: bool = True) -> tuple[int, int, int | None, bool]:
    bs = rng.choice([1, 2, 3, 4, 8, 16])
    alignment = bs * rng.choice([1, 1, 2, 3, 4])
    if not valid_only and rng.random() < 0.15:
        alignment = rng.randint(1, 40)
    kind = rng.random()
    if kind < 0.3:
        retention: int | None = None
    elif kind < 0.55:
        retention = 0
    else:
        retention = alignment * rng.randint(1, 6)
        if not valid_only and rng.random() < 0.2:
            retention = rng.randint(1, 80)
    return bs, alignment, retention, rng.random() < 0.4


class MaskTemplate:
    """A mask over symbolic inputs, encoded as one integer: bit i set iff block i kept."""

    def __init__(self, kind: str, n_boundaries: int) -> None:
        self.v = {n: z3.Int(n) for n in ("bs", "w", "a", "mode", "k", "start", "end")}
        self.eagle = z3.Bool("eagle")
        self.bnd = [z3.Int(f"b{i}") for i in range(n_boundaries)]
        r = smt.Retention(self.v["mode"], self.v["k"])
        if kind == "swa":
            m = smt.swa_mask(
                self.v["start"],
                self.v["end"],
                block_size=self.v["bs"],
                window=self.v["w"],
                alignment=self.v["a"],
                eagle=self.eagle,
                retention=r,
                boundaries=self.bnd,
            )
        else:
            m = smt.mamba_mask(
                self.v["start"],
                self.v["end"],
                block_size=self.v["bs"],
                alignment=self.v["a"],
                retention=r,
                boundaries=self.bnd,
            )
        self.dense = m.dense
        self.bits = z3.Sum([z3.If(m(i), 2**i, 0) for i in range(MAX_BLOCKS)])

    def evaluate(self, values: dict[str, int], eagle: bool, boundaries: list[int]) -> set[int] | None:
        sub = [(self.v[n], z3.IntVal(x)) for n, x in values.items()]
        sub += [(self.eagle, z3.BoolVal(eagle))] + [(b, z3.IntVal(x)) for b, x in zip(self.bnd, boundaries)]
        if z3.is_true(z3.simplify(z3.substitute(self.dense, *sub))):
            return None
        bits = z3.simplify(z3.substitute(self.bits, *sub)).as_long()
        return {i for i in range(MAX_BLOCKS) if bits >> i & 1}


def _retention_values(r: int | None) -> dict[str, int]:
    mode = smt.DENSE if r is None else (smt.ZERO if r == 0 else smt.INTERVAL)
    return {"mode": mode, "k": r or 0}


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_masks_match_model(kind: str) -> None:
    rng = random.Random({"swa": 1234, "mamba": 99}[kind])
    templates = {n: MaskTemplate(kind, n) for n in range(4)}
    dense_seen = sparse_seen = 0
    for _ in range(N_MASK):
        bs, a, r, eagle = _config(rng, valid_only=False)
        window = rng.randint(1, 6 * bs)
        start = rng.randint(0, 10)
        end = start + rng.randint(0, MAX_BLOCKS - 10)
        bnd = [rng.randint(0, (end + 2) * bs) for _ in range(rng.choice([0, 1, 2, 3]))]
        if kind == "swa":
            expected = masks.swa_kept_blocks(
                start,
                end,
                block_size=bs,
                window=window,
                alignment=a,
                eagle=eagle,
                retention=r,
                boundaries=bnd,
            )
        else:
            expected = masks.mamba_kept_blocks(
                start, end, block_size=bs, alignment=a, retention=r, boundaries=bnd
            )
        values = {"bs": bs, "w": window, "a": a, "start": start, "end": end, **_retention_values(r)}
        got = templates[len(bnd)].evaluate(values, eagle, bnd)
        assert got == expected, (kind, bs, window, a, r, eagle, start, end, bnd)
        dense_seen += got is None
        sparse_seen += got is not None
    assert dense_seen > 100 and sparse_seen > 800


def test_replay_boundaries_match_model() -> None:
    for p in range(1, 70):
        for sbs in (1, 2, 4, 16):
            for eagle in (False, True):
                terms = smt.replay_boundaries(p, sbs, eagle)
                got = {z3.simplify(t).as_long() for t in terms}
                assert got == set(masks.replay_boundaries(p, sbs, eagle)), (p, sbs, eagle)


def test_tail_and_edge_match_model() -> None:
    rng = random.Random(5)
    w, bs, a, b = z3.Ints("w bs a b")
    eg = z3.Bool("eg")
    tail, edge = smt.swa_tail_blocks(w, bs, eg), smt.boundary_edge(b, a, bs)
    for _ in range(2000):
        vw, vbs, va, vb = rng.randint(1, 100), rng.randint(1, 20), rng.randint(1, 50), rng.randint(0, 500)
        ve = rng.random() < 0.5
        sub = [
            (w, z3.IntVal(vw)),
            (bs, z3.IntVal(vbs)),
            (a, z3.IntVal(va)),
            (b, z3.IntVal(vb)),
            (eg, z3.BoolVal(ve)),
        ]
        assert z3.simplify(z3.substitute(tail, *sub)).as_long() == masks.swa_tail_blocks(vw, vbs, ve)
        assert z3.simplify(z3.substitute(edge, *sub)).as_long() == masks.boundary_edge(vb, va, vbs)


def test_scheduling_and_cacheable_match_model() -> None:
    from model.contract.config import Config, GroupSpec
    from model.machine.allocator import AllocatorModel
    from model.policy.scheduling import mamba_checkpoint_position

    n, bs, sbs = z3.Ints("n bs sbs")
    eg, hy = z3.Bool("eg"), z3.Bool("hy")
    ckpt = smt.mamba_checkpoint_position(n, bs, eg)
    cache = smt.cacheable_tokens(n, hybrid=hy, scheduler_block_size=sbs, block_size=bs, eagle=eg)
    rng = random.Random(11)
    models = {}
    for vbs in (1, 2, 4, 8):
        for mult in (1, 2, 3):
            for veagle in (False, True):
                for hybrid in (False, True):
                    groups = [GroupSpec("swa", vbs, sliding_window=5)]
                    if hybrid:
                        groups = [GroupSpec("full", vbs * mult), *groups]
                    models[vbs, mult, veagle, hybrid] = AllocatorModel(Config(tuple(groups), 8, eagle=veagle))
    for _ in range(1500):
        key = rng.choice(list(models))
        vbs, mult, veagle, hybrid = key
        model = models[key]
        vn = rng.randint(0, 80)
        vsbs = model.cfg.scheduler_block_size
        sub = [(n, z3.IntVal(vn)), (bs, z3.IntVal(vbs)), (sbs, z3.IntVal(vsbs))]
        sub += [(eg, z3.BoolVal(veagle)), (hy, z3.BoolVal(hybrid))]
        assert z3.simplify(z3.substitute(cache, *sub)).as_long() == model._cacheable_tokens(
            model.groups[-1], vn
        )
        assert z3.simplify(z3.substitute(ckpt, *sub)).as_long() == mamba_checkpoint_position(vn, vbs, veagle)


def _bitmask_pred(c: z3.ArithRef, n: int) -> smt.Pred:
    """Block j is cached iff bit j of c is set (j < n)."""

    def bit(x: int) -> z3.BoolRef:
        return (c / (2**x)) % 2 == 1

    def pred(j: z3.ArithRef) -> z3.BoolRef:
        cj = smt.as_int(j)
        if cj is not None:
            return bit(cj) if 0 <= cj < n else z3.BoolVal(False)
        return z3.Or([z3.And(j == x, bit(x)) for x in range(n)])

    return pred


def _cached_set(rng: random.Random, nb: int) -> set[int]:
    style = rng.random()
    if style < 0.3:  # a prefix run: what a finished request leaves (dense)
        return set(range(rng.randint(0, nb)))
    if style < 0.6:  # a masked prompt
        return {j for j in range(nb) if rng.random() < 0.7}
    return {j for j in range(nb) if rng.random() < 0.35}


@pytest.mark.parametrize("kind", ["full", "swa", "mamba"])
def test_hit_rules_match_model(kind: str) -> None:
    rng = random.Random({"full": 7, "swa": 8, "mamba": 9}[kind])
    bs, a, length, need, c = z3.Ints("bs a length need c")
    eagle = z3.Bool("eagle")
    pred = _bitmask_pred(c, MAX_HIT_BLOCKS + 2)
    build: dict[str, Callable[[], smt.Hit]] = {
        "full": lambda: smt.full_hit(pred, length, bs, a, eagle),
        "swa": lambda: smt.swa_hit(pred, length, bs, a, need, eagle),
        "mamba": lambda: smt.mamba_hit(pred, length, bs, a),
    }
    with smt.bounded_indices(MAX_HIT_BLOCKS + 2):  # every sampled index lies below this
        hit = build[kind]()
        term, side = hit.blocks, hit.side
    solver = z3.SolverFor("QF_LIA")
    hits_seen = 0
    for _ in range(N_HIT):
        vbs, va, _, veagle = _config(rng)
        if rng.random() < 0.2:
            va = vbs  # unitary coordinator: alignment = block size
        nb = rng.randint(0, MAX_HIT_BLOCKS)
        vlen = nb * vbs + rng.randint(0, vbs - 1)
        cached = _cached_set(rng, nb + 2)
        window = rng.randint(1, 5 * vbs)
        vneed = masks.swa_tail_blocks(window, vbs, veagle)
        if kind == "full":
            expected = len(lookup.full_hit(cached.__contains__, vlen, vbs, va, veagle))
        elif kind == "swa":
            expected = len(lookup.swa_hit(cached.__contains__, vlen, vbs, va, vneed, veagle))
        else:
            expected = len(lookup.mamba_hit(cached.__contains__, vlen, vbs, va))
        sub = [
            (bs, z3.IntVal(vbs)),
            (a, z3.IntVal(va)),
            (length, z3.IntVal(vlen)),
            (need, z3.IntVal(vneed)),
            (c, z3.IntVal(sum(1 << j for j in cached))),
            (eagle, z3.BoolVal(veagle)),
        ]
        got = smt.evaluate_hit(z3.substitute(term, *sub), z3.substitute(side, *sub), solver)
        assert got == expected, (kind, vbs, va, veagle, window, vlen, sorted(cached))
        hits_seen += expected > 0
    assert hits_seen > N_HIT // 4
