"""The catalogue's shortcuts agree with the plain definitions they stand for.

Some invariants answer the usual case early (equal maps, the same key object,
an operation whose inputs the delta shows unchanged). Each plain definition is
written out here as the oracle; on random runs of every target (fast path and
audit alike) every context the checker builds gets the same verdict from both.
"""

from __future__ import annotations

import random

import pytest
from test_incremental import CFG, random_ops

import invariants.harness.checker as checker_mod
from invariants.catalogue import BY_NAME, CheckContext, incremental
from invariants.harness.checker import Checker
from invariants.targets import available_targets, target_factory
from model.contract.observation import BlockKey, block_key
from model.contract.prefix import prefix

# ----------------------------------------------------------------- the oracles


def plain_events_match_hash_map(ctx: CheckContext) -> list[str]:
    actual = {k: len(v) for k, v in ctx.after.cached.items()}
    shadow = ctx.history.shadow
    return sorted(
        f"{k.short()}: events say {shadow.get(k, 0)} holder(s), map has {actual.get(k, 0)}"
        for k in set(actual) | set(shadow)
        if shadow.get(k, 0) != actual.get(k, 0)
    )


def _points_at(key: BlockKey, b: int, primary: BlockKey | None, bs: int) -> str | None:
    if primary is None:
        return f"{key.short()} -> block {b}, which carries no hash"
    if primary != key and not (
        primary.group == key.group
        and len(primary.tokens) - bs < len(key.tokens) < len(primary.tokens)
        and primary.tokens[: len(key.tokens)] == key.tokens
    ):
        return f"{key.short()} -> block {b}, whose hash is {primary.short()}"
    return None


def plain_hash_map_points_at_holders(ctx: CheckContext) -> list[str]:
    s, groups = ctx.after, ctx.config.groups
    out = [
        msg
        for key, blocks in s.cached.items()
        for b in blocks
        if (msg := _points_at(key, b, s.block_hash.get(b), groups[key.group].block_size))
    ]
    out += [
        f"block {b} carries {key.short()} but the map does not point at it"
        for b, key in s.block_hash.items()
        if b not in s.cached.get(key, ())
    ]
    return out


def plain_hash_map_points_at_holders_delta(ctx: CheckContext) -> list[str]:
    d, groups = ctx.delta, ctx.config.groups
    assert d is not None
    out = [
        msg
        for key, blocks in d.holders.items()
        for b in blocks
        if (msg := _points_at(key, b, d.key_of.get(b), groups[key.group].block_size))
    ]
    out += [
        f"block {b} carries {carried.short()} but the map does not point at it"
        for b, (_, carried, _, _) in d.blocks.items()
        if carried is not None and b not in d.holders.get(carried, ())
    ]
    return out


# (name, plain definition) for the full forms and the delta forms
FULL_ORACLES = {
    "events_match_hash_map": plain_events_match_hash_map,
    "hash_map_points_at_holders": plain_hash_map_points_at_holders,
}
DELTA_ORACLES = {"hash_map_points_at_holders": plain_hash_map_points_at_holders_delta}


# ----------------------------------------------------------------- the runs


class Compared:
    """Wraps the checker's check_all / check_delta: every context it sees is also
    judged by the oracles, and the verdicts must be the same."""

    def __init__(self) -> None:
        self.full = self.delta = 0
        self.violations = 0
        self.real_all, self.real_delta = checker_mod.check_all, checker_mod.check_delta

    def check_all(self, ctx: CheckContext) -> list[tuple[str, str]]:
        self.full += 1
        for name, oracle in FULL_ORACLES.items():
            got = BY_NAME[name].check(ctx)
            assert got == oracle(ctx), name
            self.violations += bool(got)
        return self.real_all(ctx)

    def check_delta(self, ctx: CheckContext) -> list[tuple[str, str]]:
        self.delta += 1
        for name, oracle in DELTA_ORACLES.items():
            got = incremental.DELTA_CHECKS[name](ctx)
            assert got == oracle(ctx), name
            self.violations += bool(got)
        return self.real_delta(ctx)


@pytest.fixture
def compared(monkeypatch: pytest.MonkeyPatch) -> Compared:
    c = Compared()
    monkeypatch.setattr(checker_mod, "check_all", c.check_all)
    monkeypatch.setattr(checker_mod, "check_delta", c.check_delta)
    return c


@pytest.mark.parametrize("name", ["model", "reference", "vllm-manager"])
def test_shortcuts_agree_with_plain_definitions_on_random_runs(name: str, compared: Compared) -> None:
    reason = available_targets().get(name)
    if reason is not None:
        pytest.skip(f"{name} unavailable: {reason}")
    for seed in range(3):
        random_ops(random.Random(seed), Checker(target_factory(name)(CFG), audit_every=5), 100)
    assert compared.full > 20 and compared.delta > 100  # both paths were exercised


def test_shortcuts_agree_where_the_maps_disagree(compared: Compared) -> None:
    """The oracles also agree on corrupted states (where the shortcut must not fire)."""
    chk = Checker(target_factory("model")(CFG), audit_every=1)
    random_ops(random.Random(1), chk, 40)
    snap = chk.last
    key = next(iter(snap.cached))
    ctx = CheckContext(chk.config, chk.ops[-1], chk.last_obs, snap, snap, chk.history, None, None)  # type: ignore[arg-type]
    chk.history.shadow[key] = chk.history.shadow.get(key, 0) + 1  # an unannounced holder
    assert BY_NAME["events_match_hash_map"].check(ctx) == plain_events_match_hash_map(ctx) != []
    b = snap.cached[key][0]
    other = next(k for k in snap.cached if k.group != key.group or len(k.tokens) != len(key.tokens))
    snap.block_hash[b] = other  # the map names a block carrying another hash
    assert BY_NAME["hash_map_points_at_holders"].check(ctx) == plain_hash_map_points_at_holders(ctx) != []


def test_block_key_equality_is_content_equality() -> None:
    rng = random.Random(0)
    base = tuple(rng.choice((1, 2)) for _ in range(40))
    keys = [block_key(rng.randrange(2), base, rng.randrange(1, 41)) for _ in range(200)]
    pairs = [(k, BlockKey(k.group, k.tokens.tokens())) for k in keys[:50]]  # rebuilt from tuples
    pairs += [(rng.choice(keys), rng.choice(keys)) for _ in range(500)]
    verdicts = set()
    for a, b in pairs:
        same = (a.group, a.tokens.tokens()) == (b.group, b.tokens.tokens())
        assert (a == b) is same and (a != b) is not same
        assert not same or hash(a) == hash(b)
        verdicts.add(same)
    assert verdicts == {True, False}
    # Order is the pair's: group first, then the tokens.
    assert sorted(keys) == sorted(keys, key=lambda k: (k.group, k.tokens.tokens()))
    assert BlockKey(1, (1, 2)) == BlockKey(1, prefix((1, 2))) != BlockKey(0, (1, 2))
