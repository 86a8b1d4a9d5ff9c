"""Presets: valid, derived from vLLM 0.33.0's own grouping code, pools sized as vLLM reports capacity.

The derivation and capacity tests need vLLM (skipped without it); the rest
runs everywhere. Every check has a negative control: a perturbed preset must
not match the derivation, a wrong per-request formula must disagree with vLLM.
"""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace

import pytest

from invariants.layouts import derive as layouts
from invariants.layouts.presets import (
    DERIVED_FROM,
    MAX_CONTEXT,
    PRESETS,
    fuzz_pool_blocks,
    per_request_blocks,
    pool_blocks,
    preset,
)
from invariants.targets import target_factory
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, ConfigError, GroupSpec, validate

_VLLM_OK, _VLLM_REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _VLLM_OK, reason=f"vllm: {_VLLM_REASON}")

FULL_SIZE = ("dsv4-flash", "dsv4-like", "gemma-like", "kimi-linear-like")


# ----------------------------------------------------------------------------- every preset
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_validates_and_builds_on_every_target(name: str) -> None:
    cfg = validate(preset(name))
    assert cfg.name == name
    targets = ["model", "reference"] + (["vllm-manager"] if _VLLM_OK else [])
    for t in targets:
        target_factory(t)(cfg)  # raises UnsupportedConfig / ConfigError if a target refuses it


def test_unknown_preset_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        preset("nope")


def test_tiny_twins_are_unchanged_and_small() -> None:
    # Other tests rely on these exact layouts; changing one is a deliberate act.
    assert PRESETS["dsv4-tiny"].groups == (GroupSpec("full", 16), GroupSpec("swa", 4, sliding_window=8))
    assert PRESETS["gemma-tiny"].groups == (GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=10))
    assert PRESETS["kimi-linear-tiny"].groups == (GroupSpec("full", 4), GroupSpec("mamba", 4))
    assert [PRESETS[n].num_blocks for n in ("dsv4-tiny", "gemma-tiny", "kimi-linear-tiny")] == [40, 32, 24]
    for n in ("dsv4-tiny", "gemma-tiny", "kimi-linear-tiny"):
        assert PRESETS[n].scheduler_block_size <= 16 and PRESETS[n].retention_interval == 0


@pytest.mark.parametrize("name", ["dsv4-flash", "gemma-like", "kimi-linear-like"])
def test_full_size_pool_is_the_documented_fuzz_pool(name: str) -> None:
    assert PRESETS[name].num_blocks == fuzz_pool_blocks(PRESETS[name])


def test_dsv4_like_is_unchanged() -> None:
    # The seeds' two-group view; the simulator's small-scale pools are tuned to it.
    assert PRESETS["dsv4-like"] == Config(
        groups=(GroupSpec("full", 256), GroupSpec("swa", 64, sliding_window=128)),
        num_blocks=96,
        retention_interval=0,
    )


# ----------------------------------------------------------------------------- per-request blocks
def _wrong_no_inflight(cfg: Config, max_len: int) -> int:
    """A plausible but wrong formula: SWA bounded by the window alone (no in-flight tokens, no +1)."""
    total = 0
    for g in cfg.groups:
        if g.kind == "full":
            total += -(-max_len // g.block_size)
        elif g.kind == "swa":
            assert g.sliding_window is not None
            total += -(-min(g.sliding_window, max_len) // g.block_size)
        else:
            total += 1
    return total


def test_per_request_blocks_by_hand() -> None:
    cfg = Config(
        groups=(GroupSpec("full", 256), GroupSpec("swa", 64, sliding_window=128), GroupSpec("mamba", 256)),
        num_blocks=10,
    )
    # full: 4096; swa: cdiv(127 + 2*8192, 64) + 1 = 259; mamba: 2
    assert per_request_blocks(cfg, 1 << 20) == 4096 + 259 + 2
    # short context: the window term is capped by max_len
    assert per_request_blocks(cfg, 100, max_num_batched_tokens=64, concurrent_batches=1) == 1 + 3 + 2
    assert pool_blocks(cfg, 2.5, 1 << 20) == math.ceil(2.5 * (4096 + 259 + 2))
    with pytest.raises(ConfigError):
        pool_blocks(cfg, 0, 1024)
    with pytest.raises(ConfigError):
        per_request_blocks(cfg, 0)


def test_per_request_figures_of_the_presets() -> None:
    # The numbers docs/presets.md quotes (vLLM defaults: 8192 batched tokens, 2 batches in flight).
    figures = {n: per_request_blocks(PRESETS[n], MAX_CONTEXT[n]) for n in FULL_SIZE}
    assert figures == {"dsv4-flash": 10778, "dsv4-like": 4355, "gemma-like": 14726, "kimi-linear-like": 2054}


# ----------------------------------------------------------------------------- vLLM derivation
@needs_vllm
@pytest.mark.parametrize("name", sorted(DERIVED_FROM))
def test_vllm_grouping_reproduces_the_preset(name: str) -> None:
    d = layouts.derive(DERIVED_FROM[name])
    assert d.dropped == ()
    assert layouts.matches(PRESETS[name], d), (
        f"{name}: preset {layouts.layout_of(PRESETS[name])} != vLLM "
        f"{layouts.layout_of(d.config)}\n{layouts.describe(d)}"
    )


@needs_vllm
def test_dsv4_like_is_vllms_main_mla_and_swa_groups() -> None:
    view = layouts.dsv4_main_view(layouts.derive("dsv4"))
    assert view == (GroupSpec("swa", 64, sliding_window=128), GroupSpec("full", 256))
    assert sorted(map(repr, PRESETS["dsv4-like"].groups)) == sorted(map(repr, view))


@needs_vllm
def test_derivation_facts() -> None:
    dsv4 = layouts.derive("dsv4")
    assert dsv4.layout == "BLHNC"
    assert [(g.spec_type, g.num_layers) for g in dsv4.groups] == [
        ("SlidingWindowMLASpec", 22),
        ("SlidingWindowMLASpec", 21),
        ("MLAAttentionSpec", 62),
        ("SlidingWindowMLASpec", 42),
        ("SlidingWindowMLASpec", 20),
    ]
    # transformers' DeepseekV4Config default schedule groups into the same kinds (other order, counts)
    other = layouts.derive("dsv4", compress_ratios=layouts.DSV4_TRANSFORMERS_DEFAULT_RATIOS)
    assert sorted(map(repr, other.config.groups)) == sorted(map(repr, dsv4.config.groups))
    gemma = layouts.derive("gemma3")
    assert [g.num_layers for g in gemma.groups] == [9, 9, 9, 9, 8, 8, 10]
    kimi = layouts.derive("kimi-linear")
    assert [(g.manager, g.num_layers) for g in kimi.groups] == [
        ("MambaManager", 7),
        ("MambaManager", 7),
        ("MambaManager", 6),
        ("FullAttentionManager", 7),
    ]
    # #45845 ran Kimi-Linear at TP4 with block_size 512; other TP sizes move the block.
    assert {tp: layouts.derive("kimi-linear", tp=tp).config.groups[0].block_size for tp in (1, 2, 4, 8)} == {
        1: 1920,
        2: 1024,
        4: 512,
        8: 256,
    }


@needs_vllm
def test_perturbed_presets_do_not_match_the_derivation() -> None:
    """Negative control: every kind of mistake in a hard-coded layout is caught."""
    d = {name: layouts.derive(fam) for name, fam in DERIVED_FROM.items()}
    dsv4 = PRESETS["dsv4-flash"]
    g = dsv4.groups
    perturbed = {
        "dsv4 without compressor groups": ("dsv4-flash", PRESETS["dsv4-like"]),
        "dsv4 compressor window 8 -> 16": (
            "dsv4-flash",
            dsv4.with_(groups=g[:3] + (GroupSpec("swa", 4, sliding_window=16),) + g[4:]),
        ),
        "dsv4 groups reordered": ("dsv4-flash", dsv4.with_(groups=(g[2], g[0], g[1], g[3], g[4]))),
        "dsv4 explicit hash block 8": ("dsv4-flash", replace(dsv4, hash_block_size=8)),
        "gemma one SWA group": (
            "gemma-like",
            PRESETS["gemma-like"].with_(groups=PRESETS["gemma-like"].groups[5:]),
        ),
        "kimi one Mamba group": (
            "kimi-linear-like",
            PRESETS["kimi-linear-like"].with_(groups=PRESETS["kimi-linear-like"].groups[2:]),
        ),
        "kimi block 64": (
            "kimi-linear-like",
            Config(groups=(GroupSpec("mamba", 64),) * 3 + (GroupSpec("full", 64),), num_blocks=24),
        ),
    }
    for what, (name, cfg) in perturbed.items():
        assert not layouts.matches(cfg, d[name]), what
    assert layouts.matches(dsv4.with_(num_blocks=7), d["dsv4-flash"])  # the pool is not layout


@needs_vllm
@pytest.mark.parametrize("name", sorted(DERIVED_FROM))
def test_per_request_blocks_equals_vllm_on_the_real_specs(name: str) -> None:
    d = layouts.derive(DERIVED_FROM[name])
    cfg = PRESETS[name]
    for max_len, batch, conc in (
        (MAX_CONTEXT[name], 8192, 2),
        (MAX_CONTEXT[name], 2048, 1),
        (1000, 512, 2),
        (100, 8192, 2),
    ):
        mine = per_request_blocks(cfg, max_len, batch, conc)
        theirs = layouts.vllm_per_request_blocks(
            d.vllm_groups, max_len, max_num_batched_tokens=batch, concurrent_batches=conc
        )
        assert mine == theirs, (name, max_len, batch, conc)


@needs_vllm
def test_per_request_blocks_equals_vllm_on_other_configs_and_a_wrong_formula_is_caught() -> None:
    configs = [PRESETS[n] for n in sorted(PRESETS)] + [
        Config(groups=(GroupSpec("full", 32), GroupSpec("swa", 16, sliding_window=1)), num_blocks=4),
        Config(
            groups=(GroupSpec("swa", 8, sliding_window=4096), GroupSpec("mamba", 8), GroupSpec("full", 8)),
            num_blocks=4,
        ),
        Config(groups=(GroupSpec("full", 16),), num_blocks=4),
    ]
    caught = 0
    for cfg in configs:
        for max_len in (1, 17, 4096, 1 << 20):
            mine = per_request_blocks(cfg, max_len)
            assert mine == layouts.vllm_per_request_blocks(cfg, max_len), (cfg, max_len)
            caught += _wrong_no_inflight(cfg, max_len) != mine
    assert caught > 0


@needs_vllm
def test_pool_blocks_gives_vllms_concurrency() -> None:
    for name in FULL_SIZE:
        cfg = PRESETS[name]
        per = layouts.vllm_per_request_blocks(cfg, MAX_CONTEXT[name])
        for x in (1, 2.5, 8):
            n = pool_blocks(cfg, x, MAX_CONTEXT[name])
            assert x <= n / per < x + 1 / per + 1e-12  # vLLM would report ~x-fold concurrency


# ----------------------------------------------------------------------------- vLLM stays optional
def test_layouts_imports_without_vllm_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    code = (
        "import sys; sys.modules['vllm'] = None; import invariants.layouts.derive, invariants.layouts.presets; "
        "assert 'torch' not in sys.modules; print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    from invariants.targets import vllm_env

    monkeypatch.setattr(vllm_env, "vllm_available", lambda: (False, "vllm is not installed in X"))
    with pytest.raises(layouts.LayoutUnavailable, match="needs vLLM: vllm is not installed"):
        layouts.derive("dsv4")
