"""Hypothesis strategies: allocator configurations worth fuzzing.

Configs are small on purpose (tiny blocks, small pools) so that eviction,
window slides, retained boundaries and the pinned tier are reached within a
few dozen operations. About half of the Mamba configurations make the Mamba
block 2 or 4 hash blocks wide, which turns on vLLM's fine-grained Mamba hits
and their copy-on-write copies (`model.contract.fine_mamba`) when the other groups allow
them.
"""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import strategies as st

from model.contract.config import Config, GroupSpec, validate

SHAPES: tuple[tuple[str, ...], ...] = (
    ("full",),
    ("swa",),
    ("full", "swa"),
    ("full", "swa"),
    ("full", "mamba"),
    ("full", "swa", "mamba"),
    ("full", "swa", "swa"),
)


@st.composite
def configs(
    draw: st.DrawFn,
    *,
    allow_pinning: bool = True,
    allow_mamba: bool = True,
    shapes: tuple[tuple[str, ...], ...] | None = None,
    retention: str | None = None,
    eagle: bool | None = None,
    caching: bool | None = None,
    lookahead: bool | None = None,
    allow_fine: bool = True,
    fine: bool | None = None,
    eagle_drafts: bool = False,
    connector: bool | None = False,
    load_failure: str | None = None,
    long_prefill: bool | None = False,
    gates: bool | None = False,
    unpredicted: bool = False,
    lookahead_hashes: bool | None = False,
) -> Config:
    """A valid configuration; keyword arguments narrow it to one feature.

    `retention`: "dense" (None), "zero" (0) or "interval" (k * sbs).
    With caching off a Mamba group is in 'align' or 'none' mode (vLLM allows
    'none' only without prefix caching).
    `lookahead`: True = speculative slots (1..3 per allocation), False = none,
    None = either (mostly none, as most deployments run without spec decode).
    `fine`: True = a Mamba block 2 or 4 hash blocks wide (fine-grained hits where
    the other groups allow them), False = Mamba block == hash block, None = either
    (unless `allow_fine` is False: targets that refuse such configurations).
    `eagle_drafts`: a real scheduler's speculative decoding: an Eagle
    configuration always reserves lookahead slots (vLLM's Eagle drafts at least
    one token); a Mamba group's draft state blocks follow (`model.contract.mamba`).
    `connector`: True = a KV connector attached (`Config.kv_connector`), False = none,
    None = either, drafts or not (`model.machine.connector` states both); `load_failure`: its
    `kv_load_failure_policy` ("recompute", "fail"; None = either, mostly "recompute").
    `long_prefill`: True = a long-prefill threshold (`Config.long_prefill_token_threshold`,
    above the spec tokens: vLLM asserts when it clips a padded admission), False = none,
    None = either (mostly none).
    `gates`: the scheduler's admission gates (`model.policy.admission`): None = vLLM's defaults
    most often (`reserve_full_isl` True 3 in 4, a nonzero `watermark` 1 in 3), True = both
    gates on (a watermark of 0.1 to 0.3), False = neither (the field defaults).
    `unpredicted`: also the vLLM settings the model does not predict (judged by the engine
    contract alone: `invariants.harness.checker.unpredicted`): the priority policy (1 in 6).
    `lookahead_hashes`: an Eagle configuration's lookahead block hashes
    (`Config.lookahead_block_hashes`, vLLM's default; in force with caching on and no connector:
    `Config.hash_lookahead`): None = vLLM's default most often (3 in 4), True = always, False =
    never (the legacy hashes and their trailing-block drop: targets that hash without lookahead).
    """
    allowed = [s for s in (shapes or SHAPES) if allow_mamba or "mamba" not in s]
    shape = draw(st.sampled_from(allowed))
    base = draw(st.sampled_from([2, 4]))
    wide_mamba = allow_fine and "mamba" in shape and (draw(st.booleans()) if fine is None else fine)
    groups = _groups(draw, shape, base, wide_mamba)
    interval = _retention(draw, groups, retention)
    pin = allow_pinning and "swa" in shape and draw(st.booleans())
    num_blocks = draw(st.integers(6, 28))
    use_eagle = draw(st.booleans()) if eagle is None else eagle
    cfg = Config(
        groups=tuple(groups),
        num_blocks=num_blocks,
        retention_interval=interval,
        eagle=use_eagle,
        enable_caching=draw(st.sampled_from([True, True, True, True, False])) if caching is None else caching,
        pin_swa_on_drop=pin,
        pin_min_drop_blocks=draw(st.integers(0, 3)) if pin else 1,
        max_model_len=4096,
        num_lookahead_tokens=_lookahead(draw, True if eagle_drafts and use_eagle else lookahead),
        # The hash block stays one `base` wide (vLLM `--prefix-match-unit`) when the Mamba block is wider.
        hash_block_size=base if wide_mamba else 0,
    )
    cfg = _scheduler_options(draw, cfg, connector, load_failure, long_prefill, gates, unpredicted)
    if use_eagle and lookahead_hashes is not False:
        asked = lookahead_hashes or draw(st.sampled_from([True, True, True, False]))
        cfg = cfg.with_(lookahead_block_hashes=asked)
    if not cfg.enable_caching and cfg.has_mamba and draw(st.booleans()):
        cfg = cfg.with_(
            groups=tuple(replace(g, mamba_cache_mode="none") if g.kind == "mamba" else g for g in cfg.groups)
        )
    return validate(cfg)


def _scheduler_options(
    draw: st.DrawFn,
    cfg: Config,
    connector: bool | None,
    load_failure: str | None,
    long_prefill: bool | None,
    gates: bool | None,
    unpredicted: bool,
) -> Config:
    """`cfg` with the scheduler's options `configs` documents: a KV connector, a
    long-prefill threshold, the admission gates, the settings the model does not predict."""
    if connector or (connector is None and draw(st.booleans())):
        policy = load_failure or draw(st.sampled_from(["recompute", "recompute", "fail"]))
        cfg = cfg.with_(kv_connector=True, kv_load_failure_policy=policy)
    if long_prefill or (long_prefill is None and draw(st.sampled_from([False, False, False, True]))):
        threshold = draw(st.integers(cfg.num_lookahead_tokens + 1, 4 * cfg.scheduler_block_size))
        cfg = cfg.with_(long_prefill_token_threshold=threshold)
    if gates is not False:
        cfg = cfg.with_(**_gates(draw, gates))
    if unpredicted:
        cfg = cfg.with_(scheduling_policy=draw(st.sampled_from(["fcfs"] * 5 + ["priority"])))
    return cfg


def _groups(draw: st.DrawFn, shape: tuple[str, ...], base: int, wide_mamba: bool) -> list[GroupSpec]:
    groups = []
    for kind in shape:
        if kind == "mamba" and wide_mamba:
            bs = base * draw(st.sampled_from([2, 4]))
        elif kind == "mamba" or len(shape) == 1:
            bs = base * (1 if kind == "mamba" else draw(st.sampled_from([1, 2])))
        else:
            bs = base * draw(st.sampled_from([1, 2, 4]))
        window = draw(st.integers(2, 3 * bs)) if kind == "swa" else None
        groups.append(GroupSpec(kind, bs, sliding_window=window))  # type: ignore[arg-type]
    return groups


def _retention(draw: st.DrawFn, groups: list[GroupSpec], retention: str | None) -> int | None:
    sbs = math.lcm(*(g.block_size for g in groups))
    has_retention_group = any(g.kind != "full" for g in groups)
    choices: list[int | None] = [None, 0, 0, sbs, 2 * sbs, 3 * sbs] if has_retention_group else [None, 0]
    if retention == "dense":
        choices = [None]
    elif retention == "zero":
        choices = [0]
    elif retention == "interval":
        choices = [sbs, 2 * sbs, 3 * sbs]
    return draw(st.sampled_from(choices))


def _gates(draw: st.DrawFn, gates: bool | None) -> dict[str, object]:
    """`reserve_full_isl` and `watermark` (see `configs`)."""
    if gates:
        return {"reserve_full_isl": True, "watermark": draw(st.sampled_from([0.1, 0.2, 0.3]))}
    return {
        "reserve_full_isl": draw(st.sampled_from([True, True, True, False])),
        "watermark": draw(st.sampled_from([0.0, 0.0, 0.1, 0.2, 0.3, 0.0])),
    }


def _lookahead(draw: st.DrawFn, lookahead: bool | None) -> int:
    if lookahead is False:
        return 0
    choices = [1, 2, 3] if lookahead else [0, 0, 0, 1, 2, 3]
    return draw(st.sampled_from(choices))


def engine_runnable(config: Config, lookahead: int = 1) -> Config:
    """`config` as a real scheduler runs it: vLLM's Eagle drafts at least one token, so an
    Eagle configuration without lookahead slots gets `lookahead` (1..3) of them; any
    other configuration is returned unchanged."""
    if not config.eagle or config.num_lookahead_tokens > 0:
        return config
    return validate(replace(config, num_lookahead_tokens=lookahead))
