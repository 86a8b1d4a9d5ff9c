"""vLLM 0.33.0's hybrid fixed point equals the model's (quick domain); the check's negative controls.

`python -m invariants.proofs.production_link` runs the full domain (the
`vllm_hybrid_hit` row). Without vLLM only the model's own tie runs here (the
row is reported as skipped with the reason: `test_production_link`).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from invariants.proofs import coordinator_link as cl
from invariants.proofs import production_link as pl
from invariants.targets import vllm_build, vllm_capabilities
from model.contract import hybrid_hit, lookup
from model.contract.observation import ProbeResult, block_key
from model.contract.ops import Probe
from model.contract.profile import Profile
from model.machine.allocator import AllocatorModel


@pytest.fixture(scope="module")
def vllm() -> dict[str, Any]:
    v, reason = pl._vllm()
    if v is None:
        pytest.skip(reason)
    return v


def _counterexample(v: dict[str, Any], dom: cl.Domain) -> str:
    tally, bad = cl.check_coordinator(v, dom)
    assert bad is not None, f"the mutant survived {tally.describe()}"
    # The first counterexample names the inputs and both answers.
    for part in ("groups [", "max length", "cached keys", "vLLM hit", "the model hit", "layouts"):
        assert part in bad, bad
    return bad


def _sub_domain(**changes: Any) -> cl.Domain:
    """A part of the full domain (every configuration of it is one of FULL's)."""
    dom = dataclasses.replace(cl.FULL, **changes)
    full = {(i.cfg, i.hashed) for i in cl.instances(cl.FULL)}
    assert all((i.cfg, i.hashed) in full for i in cl.instances(dom))
    return dom


# ---------------------------------------------------------------- agreement
def test_quick_domain_agrees(vllm: dict[str, Any]) -> None:
    tally, bad = cl.check_coordinator(vllm, cl.QUICK)
    assert bad is None, bad
    assert tally.configs == sum(1 for _ in cl.instances(cl.QUICK)) > 100
    # Not vacuous: hits and junctions occur (most cached subsets serve no common hit).
    assert tally.cases > 20_000 and tally.with_hit > 500 and tally.with_junction > 500
    assert tally.with_rounds > 500
    assert tally.describe().startswith(f"{tally.cases} cases over {tally.configs} configurations, ")


def test_production_link_runs_it() -> None:
    """`kvretain prove` / `verify` run the row: the quick variant over the quick domain."""
    assert [c[0] for c in pl.CHECKS][-1] == "vllm_hybrid_hit"
    assert pl.QUICK.coordinator is cl.QUICK and pl.FULL.coordinator is cl.FULL
    described = pl._coordinator_bound(pl.QUICK)
    assert "layouts {full+swa, full+mamba, swa+mamba, full+swa+mamba}" in described
    assert "every max length in [0, T + hbs - 2]" in described


def test_built_as_the_vllm_target_builds(vllm: dict[str, Any]) -> None:
    """Proofs may not import targets: the check builds the manager itself. It gets the
    specs the vLLM target builds, and a coordinator whose lookup-relevant state (spec
    groups and their order, Eagle bits, alignment, fine-grained switch, block sizes)
    equals that of the target's `build_manager`, on every configuration of the domain."""

    def lookup_state(coord: Any) -> tuple[Any, ...]:
        return (
            [(g.spec, g.group_ids, g.manager_cls, g.use_eagle) for g in coord.attention_groups],
            coord.hash_block_size,
            coord.scheduler_block_size,
            coord.enable_partial_hash_hits,
            [
                (m.block_size, m.use_eagle, m.dcp_world_size, m.pcp_world_size)
                for m in coord.single_type_managers
            ],
        )

    caps = vllm_capabilities.detect()
    configs = {i.cfg: i for i in cl.instances(cl.FULL)}
    for cfg, inst in configs.items():
        assert cl.group_specs(cfg, vllm) == vllm_build.group_specs(cfg, vllm), cfg
        target = vllm_build.build_manager(cfg, vllm, caps, vllm["version"]).coordinator
        ours, _ = cl.build_coordinator(inst, vllm)
        assert lookup_state(ours) == lookup_state(target), inst.describe()


def _key_sets(inst: cl.Instance) -> Iterator[tuple[set[int], ...]]:
    subsets = [
        [{n for i, n in enumerate(ks) if m >> i & 1} for m in range(1 << len(ks))]
        for ks in (inst.key_positions(g) for g in range(len(inst.cfg.groups)))
    ]
    return itertools.product(*subsets)


def test_model_hit_is_the_allocators_lookup() -> None:
    """`ModelHit` composes the finders as `AllocatorModel` does: on every quick input a
    request's default limit reaches (max length = tokens - 1), its answer is the
    allocator's own `Probe` (hit, junction, block per table position)."""
    probes = 0
    for inst in cl.instances(cl.QUICK):
        cfg, width = inst.cfg, inst.hashed + 1
        model = AllocatorModel(cfg)
        want_hit = cl.ModelHit(cfg, inst.hashed)
        for extra, keyed in itertools.product(range(cfg.hash_block_size), _key_sets(inst)):
            tokens = tuple(range(7, 7 + inst.hashed + extra))
            model.pool.cached = {
                block_key(g, tokens, n): [1 + g * width + n] for g, ks in enumerate(keyed) for n in ks
            }
            got = model.apply(Probe(tokens))
            assert isinstance(got, ProbeResult)
            layouts, hit, junction = want_hit(keyed, len(tokens) - 1)
            blocks = tuple(
                tuple(0 if n is None else 1 + g * width + n for n in layouts[g]) for g in range(len(keyed))
            )
            assert (got.hit, got.shared_prefix_boundary, got.hit_blocks) == (hit, junction, blocks), (
                inst.describe(),
                keyed,
            )
            probes += 1
    assert probes > 4000


# ---------------------------------------------------------------- model mutants
def _mutant(old: str, new: str) -> Callable[..., Any]:
    """`hybrid_hit.reconcile` with one line edited (the edit must apply exactly once)."""
    src = textwrap.dedent(inspect.getsource(hybrid_hit.reconcile))
    assert src.count(old) == 1, old
    namespace = dict(vars(hybrid_hit))
    exec(compile(src.replace(old, new), hybrid_hit.__file__, "exec"), namespace)
    return namespace["reconcile"]  # type: ignore[no-any-return]


def test_one_round_is_caught(vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """One round instead of the fixed point: a group lowered late leaves an earlier one's longer layout."""
    monkeypatch.setattr(hybrid_hit, "reconcile", _mutant("if single_round:", "if True:"))
    bad = _counterexample(vllm, cl.QUICK)
    assert "groups [swa" in bad


def test_untrimmed_layout_is_caught(vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Layouts are compared, not only lengths: full attention's layout left longer than the hit."""
    monkeypatch.setattr(
        hybrid_hit,
        "reconcile",
        _mutant("layouts[gid] = layouts[gid][: -(-hit // spec.block_size)]", "pass"),
    )
    bad = _counterexample(vllm, cl.QUICK)
    vllm_hit, model_hit = bad.split(": vLLM hit ")[1].split("; the model hit ")
    assert vllm_hit.split(",")[0] == model_hit.split(",")[0]  # the same hit, another layout


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("eagle_dropped.clear()", "pass"),  # a lower candidate no longer voids the drops made
        ("rules.cfg.eagle_drop and idx not in eagle_dropped", "rules.cfg.eagle_drop"),  # a drop every round
    ],
)
def test_eagle_drop_bookkeeping_is_caught(
    vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch, old: str, new: str
) -> None:
    """Only two dropping SWA lookups tell these apart: the full domain's swa+swa layouts
    (the quick domain has none) catch both."""
    monkeypatch.setattr(hybrid_hit, "reconcile", _mutant(old, new))
    bad = _counterexample(vllm, _sub_domain(layouts=(("swa", "swa"),), sizes_two=(1, 2)))
    assert "eagle=True" in bad


@pytest.mark.parametrize(
    "older",
    [
        Profile(eagle_margin_skips_mamba=False),  # 0.25.x: Mamba searched past the candidate
        Profile(shared_prefix_junction=False),  # 0.25.0 and older: no junction
        Profile(eagle_margin_to_hashed=False),  # 0.31.0 and older: margin stops at the limit
    ],
    ids=lambda p: p.differences()[0],
)
def test_older_release_rules_are_caught(
    vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch, older: Profile
) -> None:
    """The model's own rules for older releases disagree with 0.33.0's coordinator."""
    monkeypatch.setattr(cl, "MODELED", older)
    _counterexample(vllm, cl.QUICK)


def test_broken_finder_is_caught(vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A model SWA finder that forgets the Eagle block (no peek block needed, no drop)."""
    real = lookup.swa_hit
    monkeypatch.setattr(lookup, "swa_hit", lambda c, n, bs, a, need, drop: real(c, n, bs, a, need, False))
    assert "eagle=True" in _counterexample(vllm, cl.QUICK)


# ---------------------------------------------------------------- vLLM mutants
def _patch_classmethod(
    monkeypatch: pytest.MonkeyPatch, cls: type, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    real = cls.find_longest_cache_hit  # type: ignore[attr-defined]
    monkeypatch.setattr(
        cls, "find_longest_cache_hit", classmethod(lambda _cls, *a, **kw: wrap(real)(*a, **kw))
    )


def test_vllm_swa_without_eagle_is_caught(vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
        return lambda **kw: real(**{**kw, "drop_eagle_block": False})

    _patch_classmethod(monkeypatch, vllm["SlidingWindowManager"], wrap)
    assert "eagle=True" in _counterexample(vllm, cl.QUICK)


def test_vllm_mamba_margin_is_caught(vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-creates the 0.25.x Mamba look past the candidate under Eagle (the known finding
    `vllm-eagle-mamba-hit-without-full-blocks`)."""

    def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(**kw: Any) -> Any:
            if kw["drop_eagle_block"]:
                hashed = len(kw["block_hashes"]) * kw["block_pool"].hash_block_size
                kw["max_length"] = min(kw["max_length"] + kw["kv_cache_spec"].block_size, hashed)
            return real(**kw)

        return call

    _patch_classmethod(monkeypatch, vllm["MambaManager"], wrap)
    bad = _counterexample(vllm, cl.QUICK)
    assert "mamba" in bad and "eagle=True" in bad


def test_vllm_lost_junction_is_caught(vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    coordinator = vllm["HybridKVCacheCoordinator"]
    real = coordinator.find_longest_cache_hit

    def no_junction(self: Any, block_hashes: Any, max_len: int) -> Any:
        blocks, hit, _ = real(self, block_hashes, max_len)
        return blocks, hit, 0

    monkeypatch.setattr(coordinator, "find_longest_cache_hit", no_junction)
    assert "uncached common prefix 0 (junction 0)" in _counterexample(vllm, cl.QUICK)
