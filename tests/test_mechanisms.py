"""The mechanism modules and the profile table (issue 25, item 1).

A profile is data: each switch selects, from its mechanism module's table, the
rule of the releases that share its value (`model.contract.profile.rules_of`). These
tests hold the tables to that: every value a switch can take has a rule, every
rule names its releases, the model reads no switch, and the pool's inline
routing is the rule `model.contract.routing.route` states.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import random
import re
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from invariants.harness.observer import ModelObserver
from model.contract import eagle, hybrid_hit, mamba, masks, partial_tails, routing
from model.contract.config import Config, GroupSpec
from model.contract.observation import block_key
from model.contract.ops import AddRequest, Preempt, Sample, Step
from model.contract.profile import FREE_ORDERS, MAMBA_CHECKPOINTS, MODELED, Profile, Rules, rules_of
from model.machine.allocator import AllocatorModel
from model.machine.pool import Pool
from model.machine.seams import Decision

ROOT = Path(__file__).resolve().parent.parent
MODULES = (eagle, hybrid_hit, mamba, masks, partial_tails, routing)
RELEASE = re.compile(r"\b0\.\d+\.(\d+|x)\b")


def switch_values(name: str) -> tuple[Any, ...]:
    """Every value a profile switch may take."""
    return {"free_order": FREE_ORDERS, "mamba_checkpoint": MAMBA_CHECKPOINTS}.get(name, (True, False))


def every_single_switch_profile() -> list[Profile]:
    return [replace(MODELED, **{f.name: v}) for f in fields(Profile) for v in switch_values(f.name)]


def test_every_switch_value_selects_a_rule_of_each_mechanism() -> None:
    for p in every_single_switch_profile():
        rules = rules_of(p)
        assert all(getattr(rules, f.name) is not None for f in fields(Rules)), p


def test_tables_cover_every_combination_of_their_switches() -> None:
    # Tables keyed by two switches: every pair of values has a rule.
    pairs: list[tuple[dict[Any, Any], str, str]] = [
        (masks.CACHEABLE, "block_mask", "eagle_aware_mask"),
        (masks.SWA_MASKS, "block_mask", "eagle_aware_mask"),
        (masks.MAMBA_MASKS, "block_mask", "mamba_retention"),
        (partial_tails.FULL_TAILS, "partial_tail", "partial_tail_excludes_last_token"),
        (partial_tails.CHECKPOINTS, "partial_tail", "mamba_checkpoint"),
    ]
    for table, a, b in pairs:
        assert set(table) == set(itertools.product(switch_values(a), switch_values(b))), (a, b)


def _variant_tables() -> list[tuple[str, dict[object, object]]]:
    return [
        (f"{m.__name__}.{name}", table)
        for m in MODULES
        for name, table in vars(m).items()
        if name.isupper() and isinstance(table, dict)
    ]


def test_every_variant_names_the_releases_that_have_it() -> None:
    tables = _variant_tables()
    assert len(tables) >= 14, [n for n, _ in tables]
    for name, table in tables:
        for key, variant in table.items():
            said = getattr(variant, "since", None) or inspect.getdoc(variant) or ""
            assert RELEASE.search(said), f"{name}[{key!r}] names no release: {said!r}"


def test_the_default_profile_selects_the_newest_rule_of_each_mechanism() -> None:
    rules = rules_of(Profile())
    assert rules.free_order is routing.POOL_ROUTES and rules.caching_off is routing.LIFO
    assert rules.swa_mask is masks.swa_kept_blocks and rules.mamba_mask is masks.mamba_kept_blocks
    assert rules.replay_boundaries is eagle.replay_boundaries
    assert rules.checkpoint is partial_tails.any_block and rules.count is mamba.capped


def _names_profile(node: ast.expr) -> bool:
    """`profile` or `<anything>.profile`."""
    return (isinstance(node, ast.Name) and node.id == "profile") or (
        isinstance(node, ast.Attribute) and node.attr == "profile"
    )


def test_the_allocator_reads_no_profile_switch() -> None:
    """The model composes `Rules`; a `profile.<switch>` read in allocator.py is a branch
    on the release that belongs in a mechanism module. Control: a planted read is seen."""

    def switch_reads(source: str) -> list[str]:
        names = {f.name for f in fields(Profile)}
        return [
            f"line {node.lineno}: profile.{node.attr}"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in names and _names_profile(node.value)
        ]

    source = (ROOT / "model" / "machine" / "allocator.py").read_text()
    assert switch_reads(source) == []
    assert switch_reads(source + "\nx = self.profile.block_mask\n")


@pytest.mark.parametrize("order", FREE_ORDERS)
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("to_head", [True, False])
def test_the_pool_routes_freed_blocks_as_route_says(order: str, caching: bool, to_head: bool) -> None:
    """`Pool.free` (inline, once per freed block) against `routing.route` (the rule)."""
    rng = random.Random(f"{order}{caching}{to_head}")
    for _ in range(60):
        pool = Pool(24, 4, caching, caching_off_to_head=to_head)
        taken = pool.get_new_blocks(rng.randrange(1, 24))
        pool.pinned = {b for b in taken if rng.random() < 0.2}
        for b in taken:
            if rng.random() < 0.5:
                pool.primary[b] = block_key(0, tuple(range(b * 4)), b * 4)  # a hashed block
            if rng.random() < 0.2:
                pool.ref[b] += 1  # still held elsewhere: it stays out of the queues
        freed = rng.sample(taken, rng.randrange(1, len(taken) + 1))
        appended = order != "pool" and rng.random() < 0.5
        old_queue, old_pinned = pool.queue.blocks, pool.pinned_tier.blocks
        to: dict[str, list[int]] = {routing.HEAD: [], routing.TAIL: [], routing.PINNED: []}
        for b in freed:
            if pool.ref[b] == 1:  # the last reference: the block moves
                where = routing.route(
                    pinned=b in pool.pinned,
                    hashed=b in pool.primary,
                    caching=caching,
                    appended=appended,
                    caching_off_to_head=to_head,
                )
                to[where].append(b)
        pool.free(freed, append_all=appended)
        assert pool.queue.blocks == to[routing.HEAD] + old_queue + to[routing.TAIL]
        assert pool.pinned_tier.blocks == old_pinned + to[routing.PINNED]


def test_recording_names_a_steps_attempts_and_preemptions_in_order() -> None:
    """`ModelObserver.recording`: the exporter's seam (it used to monkeypatch the model)."""
    seen = ModelObserver()
    model = AllocatorModel(Config(groups=(GroupSpec("full", 4),), num_blocks=8), observer=seen)
    with seen.recording() as first:
        for op in [AddRequest("a", (1,) * 12), AddRequest("b", (2,) * 8), AddRequest("c", (3,) * 8)]:
            model.apply(op)
        model.apply(Step(("a", "b", "c"), 64))  # the pool's 7 blocks: 3 + 2 + 2
    assert first == [Decision("alloc", rid, n, True, True) for rid, n in (("a", 12), ("b", 8), ("c", 8))]
    for rid, token in (("a", 1), ("b", 2), ("c", 3)):
        model.apply(Sample(rid, token))
    with seen.recording() as second:
        model.apply(Step(("a", "b", "c"), 64))
    # a's next block does not fit: the newest running request gives way, a retries.
    assert second == [
        Decision("alloc", "a", 1, False, False),
        Decision("preempt", "c"),
        Decision("alloc", "a", 1, False, True),
        Decision("alloc", "b", 1, False, True),
    ]
    assert len(first) == 3  # the first block recorded nothing more
    model.apply(Preempt("b"))  # outside any block: recorded nowhere
    assert len(second) == 4
