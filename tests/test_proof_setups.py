"""The symbolic setups the theorems quantify over are the allocator's own situations.

`tests/test_smt.py` ties each Z3 term of `model/contract/smt.py` to `model/contract/masks.py`,
`model/contract/lookup.py` and `model/policy/scheduling.py`. The theorems compose those
terms into setups (`invariants/proofs/swa_setup.py`, `mamba.py`, `eagle.py`,
`validation.py`): which boundaries the mask is given, which max length a
resend looks up, what the validator guarantees, how the coordinator
re-evaluates a group after the Eagle drop. Here each setup is evaluated
against `model.machine.allocator.AllocatorModel` and `model.contract.config.validate` on
seeded random workloads: the setup's own term, with the allocator's concrete
values substituted, must give what the allocator did.

Negative controls: a setup built without the junction, or with the replay
boundaries of the wrong Eagle mode, disagrees with the allocator; a
configuration the validator rejects violates the side conditions.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import z3

from invariants.proofs.mamba import Mamba
from invariants.proofs.swa_setup import Swa
from model.contract import lookup, smt
from model.contract.config import Config, ConfigError, GroupSpec, validate
from model.contract.fine_mamba import fine_hits_enabled
from model.contract.ops import AddRequest, Finish, Sample, Schedule
from model.machine.allocator import AllocatorModel


@dataclass
class Cached:
    """One call of the allocator's mask: the group, the range, the request it cached for, the result."""

    kind: str
    block_size: int
    window: int | None
    start: int
    end: int
    prompt: int
    junction: int
    kept: set[int] | None


@dataclass
class Recorded:
    cfg: Config
    cached: list[Cached]
    lookups: list[tuple[int, int]]  # (tokens, max length) of each admission's lookup
    passes: list[tuple[int, int, bool, int]]  # (group index, max length, drop, hit) per finder call


def _config(rng: random.Random) -> Config:
    bs = rng.choice([1, 2, 4])
    mult = rng.choice([1, 2, 3])
    groups = [GroupSpec("full", bs * mult), GroupSpec("swa", bs, sliding_window=rng.randint(2, 5 * bs))]
    if rng.random() < 0.5:
        groups.append(GroupSpec("mamba", bs * mult))
    sbs = bs * mult
    retention = rng.choice([None, 0, sbs, 2 * sbs, 3 * sbs])
    return Config(tuple(groups), 400, retention_interval=retention, eagle=rng.random() < 0.5)


def _record(seed: int, requests: int = 12) -> Recorded:
    """Run a workload of prompts sharing prefixes; record every mask call, lookup and finder pass."""
    rng = random.Random(seed)
    cfg = _config(rng)
    alloc = AllocatorModel(cfg)
    rec = Recorded(cfg, [], [], [])
    current: dict[str, Any] = {}

    cache_blocks, kept_fn, find_hit, finder = alloc.cache_blocks, alloc._kept, alloc._find_hit, alloc._finder

    def on_cache(req: Any, num_tokens: int, known: int | None = None) -> None:
        current["req"] = req
        cache_blocks(req, num_tokens, known)

    def on_kept(g: Any, start: int, end: int, boundaries: list[int]) -> set[int] | None:
        kept = kept_fn(g, start, end, boundaries)
        req = current["req"]
        spec = g.spec
        rec.cached.append(
            Cached(
                spec.kind,
                spec.block_size,
                spec.sliding_window,
                start,
                end,
                len(req.prompt),
                req.shared_prefix_boundary,
                kept,
            )
        )
        return kept

    def on_find(tokens: tuple[int, ...], max_len: int | None = None) -> Any:
        if max_len is not None:
            rec.lookups.append((len(tokens), max_len))
        current["pass"] = {}
        return find_hit(tokens, max_len)

    def on_finder(tokens: Any, spec: Any, gids: list[int], max_len: int, drop: bool, a: int) -> Any:
        layout, hit = finder(tokens, spec, gids, max_len, drop, a)
        rec.passes.append((gids[0], max_len, drop, hit))
        return layout, hit

    alloc.cache_blocks, alloc._kept, alloc._find_hit, alloc._finder = on_cache, on_kept, on_find, on_finder  # type: ignore[method-assign]

    stems = [tuple(rng.randint(0, 3) for _ in range(rng.randint(4, 40))) for _ in range(3)]
    for n in range(requests):
        rid = f"r{n}"
        prompt = rng.choice(stems)[: rng.randint(1, 40)] + tuple(
            rng.randint(0, 3) for _ in range(rng.randint(1, 12))
        )
        alloc.apply(AddRequest(rid, prompt))
        for _ in range(200):
            req = alloc.requests[rid]
            if req.running and req.num_computed == req.num_tokens:
                break
            alloc.apply(Schedule(rid, rng.choice([7, 16, 1000])))
        req = alloc.requests[rid]
        assert req.num_computed == req.num_tokens, f"seed {seed}: {rid} never finished its prompt"
        for _ in range(rng.randint(0, 3)):
            alloc.apply(Sample(rid, rng.randint(0, 3)))
            alloc.apply(Schedule(rid, 1000))
        alloc.apply(Finish(rid))
    return rec


SEEDS = tuple(range(12))


@pytest.fixture(scope="module")
def runs() -> list[Recorded]:
    return [_record(seed) for seed in SEEDS]


def _retention(r: int | None) -> tuple[int, int]:
    return (smt.DENSE, 0) if r is None else ((smt.ZERO, 0) if r == 0 else (smt.INTERVAL, r))


def _setup_values(setup: Swa | Mamba, cfg: Config, c: Cached) -> list[tuple[z3.ExprRef, z3.ExprRef]]:
    """The allocator's concrete values for the setup's variables."""
    mode, k = _retention(cfg.retention_interval)
    sub = [
        (setup.bs, z3.IntVal(c.block_size)),
        (setup.A, z3.IntVal(cfg.scheduler_block_size)),
        (setup.P, z3.IntVal(c.prompt)),
        (setup.end, z3.IntVal(c.end)),
        (setup.J, z3.IntVal(c.junction)),
        (setup.has_j, z3.BoolVal(c.junction != 0)),  # the allocator adds the junction when nonzero
        (setup.eagle, z3.BoolVal(cfg.eagle)),
        (setup.r.mode, z3.IntVal(mode)),
        (setup.r.k, z3.IntVal(k)),
    ]
    if isinstance(setup, Swa):
        sub.append((setup.w, z3.IntVal(c.window or 0)))
    return sub


def _setup_mask(setup: Swa | Mamba, mask: smt.Mask, cfg: Config, c: Cached) -> set[int] | None:
    sub = _setup_values(setup, cfg, c)
    side = z3.simplify(z3.substitute(z3.And(setup.side), *sub))
    assert z3.is_true(side), f"the allocator's values violate the setup's side conditions: {c}"
    if z3.is_true(z3.simplify(z3.substitute(mask.dense, *sub))):
        return None
    kept = z3.substitute(mask(z3.Int("i_probe")), *sub)
    return {
        i
        for i in range(c.start, c.end)
        if z3.is_true(z3.simplify(z3.substitute(kept, (z3.Int("i_probe"), z3.IntVal(i)))))
    }


def _mismatches(
    runs: list[Recorded], kind: str, *, drop_junction: bool = False, flip_eagle: bool = False
) -> int:
    """How many mask calls of `kind` the setup's mask term gets wrong (0 when the setup is the allocator's)."""
    setup: Swa | Mamba = Swa(eagle=None) if kind == "swa" else Mamba(eagle=None)
    mask = setup.mask(drop_boundaries=True) if drop_junction and kind == "swa" else setup.mask()
    bad = seen = 0
    for run in runs:
        if fine_hits_enabled(run.cfg):
            continue  # hash-block-aligned boundaries (model.contract.fine_mamba): not the setups' design
        for c in run.cached:
            if (
                c.kind != kind
                or c.end <= c.start
                or (kind == "swa" and (c.window or 0) < 2 and not run.cfg.eagle)
            ):
                continue  # a one-token window without Eagle is finding_swa_window_one's case
            cfg = run.cfg
            if flip_eagle:
                cfg = Config(cfg.groups, cfg.num_blocks, cfg.retention_interval, not cfg.eagle)
            if drop_junction and kind == "mamba":
                c = Cached(**{**c.__dict__, "junction": 0})
            seen += 1
            bad += _setup_mask(setup, mask, cfg, c) != c.kept
    assert seen >= 20, f"only {seen} {kind} mask calls recorded"
    return bad


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_setup_mask_is_the_allocators_mask(kind: str, runs: list[Recorded]) -> None:
    """Swa.mask / Mamba.mask with the allocator's prompt, junction, range and config give the kept blocks."""
    assert _mismatches(runs, kind) == 0


def test_controls_a_wrong_setup_disagrees_with_the_allocator(runs: list[Recorded]) -> None:
    assert _mismatches(runs, "swa", drop_junction=True) > 0
    assert _mismatches(runs, "swa", flip_eagle=True) > 0
    assert _mismatches(runs, "mamba", drop_junction=True) > 0


def test_a_resend_looks_up_prompt_minus_one(runs: list[Recorded]) -> None:
    """swa_setup.resend: an admission's lookup has max length (tokens - 1), the setup's L == P - 1."""
    lookups = [x for run in runs for x in run.lookups]
    assert len(lookups) >= 100
    assert all(max_len == n - 1 for n, max_len in lookups)


def test_eagle_reevaluation_at_own_hit_is_what_the_allocator_does(runs: list[Recorded]) -> None:
    """eagle.py's drop-once setup: after a pass with the drop, a group re-evaluated at its own hit without
    the drop (the coordinator's verified pass) keeps that hit, in every recorded lookup."""
    checked = 0
    for run in (r for r in runs if r.cfg.eagle):
        last: dict[int, int] = {}
        for gid, max_len, drop, hit in run.passes:
            if drop:
                last[gid] = hit
            elif last.get(gid) == max_len:
                assert hit == max_len, (run.cfg, gid, max_len, hit)
                checked += 1
    assert checked >= 10, checked


def test_eagle_drop_once_setup_on_the_lookup_rules() -> None:
    """The drop-once setup evaluated on the executable lookup rules (random cached sets): the second pass
    at the first pass's hit, without the drop, returns that hit; with the drop again it can shrink."""
    rng = random.Random(23)
    shrunk = 0
    for _ in range(2000):
        bs = rng.choice([1, 2, 4])
        a = bs * rng.choice([1, 2, 3])
        n = rng.randint(0, 14)
        cached = {j for j in range(n + 2) if rng.random() < 0.8}
        length = n * bs + rng.randint(0, bs - 1)
        need0 = rng.randint(1, 4)
        h1 = len(lookup.full_hit(cached.__contains__, length, bs, a, True)) * bs
        assert len(lookup.full_hit(cached.__contains__, h1, bs, a, False)) * bs == h1
        s1 = len(lookup.swa_hit(cached.__contains__, length, bs, a, need0 + 1, True)) * bs
        assert len(lookup.swa_hit(cached.__contains__, s1, bs, a, need0, False)) * bs == s1
        shrunk += len(lookup.full_hit(cached.__contains__, h1, bs, a, True)) * bs < h1
    assert shrunk > 100  # control: re-applying the drop (the #33270 bug) shrinks the hit


def test_side_conditions_match_validate() -> None:
    """smt.config_side_conditions holds for every SWA/Mamba group of every configuration validate accepts,
    and fails for the retention intervals it rejects."""
    rng = random.Random(31)
    accepted = rejected = 0
    for _ in range(600):
        bs = rng.choice([1, 2, 3, 4, 8])
        mult = rng.choice([1, 2, 3])
        window = rng.randint(1, 30)
        groups = (GroupSpec("full", bs * mult), GroupSpec("swa", bs, sliding_window=window))
        r = rng.choice([None, 0, -bs, bs, bs * mult * rng.randint(1, 4), rng.randint(1, 50)])
        cfg = Config(groups, 8, retention_interval=r)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                validate(cfg)
            ok = True
        except ConfigError:
            ok = False
        mode, k = _retention(r)
        if r is not None and r < 0:
            mode, k = smt.INTERVAL, r
        side = smt.config_side_conditions(
            block_size=bs,
            alignment=cfg.scheduler_block_size,
            retention=smt.Retention(smt.I(mode), smt.I(k)),
            window=window,
        )
        holds = z3.is_true(z3.simplify(side))
        assert holds == ok, (bs, mult, window, r, ok)
        accepted += ok
        rejected += not ok
    assert accepted > 100 and rejected > 50
