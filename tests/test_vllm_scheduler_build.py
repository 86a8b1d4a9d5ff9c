"""vLLM's real `Scheduler`, built offline from a kvretain `Config`
(`invariants.targets.vllm_scheduler_build`), holds the same `KVCacheManager`
as the one `vllm_build.build_manager` builds for the `KVCacheManager`-driven
adapter: coordinator, per-group managers and specs, pool, Eagle drop, caching,
alignment and the sliding-window admission cap. Every preset and the
speculative / fine-grained / caching-off shapes. Negative control: a
configuration that differs in one field gives a different manager. Skipped,
with the reason, when vLLM cannot be imported.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from invariants.targets.vllm_env import vllm_available

_OK, _REASON = vllm_available()
if not _OK:
    pytest.skip(f"vllm target: {_REASON}", allow_module_level=True)

from invariants.layouts.presets import PRESETS  # noqa: E402
from invariants.targets.vllm_build import build_manager  # noqa: E402
from invariants.targets.vllm_capabilities import detect  # noqa: E402
from invariants.targets.vllm_env import vllm_modules  # noqa: E402
from invariants.targets.vllm_scheduler_build import (  # noqa: E402
    SchedulerUnsupported,
    build_scheduler,
)
from model.contract.config import Config, ConfigError, GroupSpec  # noqa: E402

pytestmark = pytest.mark.vllm

SHAPES: dict[str, Config] = {
    **PRESETS,
    "fine-grained mamba": Config(
        groups=(GroupSpec("full", 2), GroupSpec("mamba", 8)),
        num_blocks=20,
        hash_block_size=2,
        retention_interval=0,
        max_model_len=4096,
    ),
    "eagle": Config(
        groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=5)),
        num_blocks=20,
        eagle=True,
        num_lookahead_tokens=2,
        max_model_len=4096,
    ),
    "draft model": Config(
        groups=(GroupSpec("full", 4), GroupSpec("mamba", 4)),
        num_blocks=20,
        num_lookahead_tokens=3,
        retention_interval=8,
        max_model_len=4096,
    ),
    "caching off": Config(
        groups=(GroupSpec("full", 4), GroupSpec("mamba", 4, mamba_cache_mode="none")),
        num_blocks=20,
        enable_caching=False,
        max_model_len=4096,
    ),
}


def manager_signature(m: Any, speculative_blocks: int = 0) -> list[object]:
    """What the allocator's behaviour depends on, read from a `KVCacheManager`; a
    Mamba spec's `num_speculative_blocks` must be `speculative_blocks` and is then
    read as 0 (the real scheduler sizes them for its drafts, `vllm_scheduler_spec`;
    the KVCacheManager-driven target sends none)."""
    c = m.coordinator
    out: list[object] = [
        type(c).__name__,
        m.block_pool.num_gpu_blocks,
        m.enable_caching,
        getattr(c, "enable_partial_hash_hits", None),
        c.retention_interval,
        [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()],
    ]
    for s in c.single_type_managers:
        spec = s.kv_cache_spec
        if hasattr(spec, "num_speculative_blocks"):
            assert spec.num_speculative_blocks == speculative_blocks, spec
            spec = dataclasses.replace(spec, num_speculative_blocks=0)
        out.append(
            (
                type(s).__name__,
                s.block_size,
                spec,
                getattr(s, "max_admission_blocks_per_request", None),
                s.cache_hit_alignment_tokens,
                getattr(s, "use_eagle", None),
            )
        )
    return out


def _build(cfg: Config) -> tuple[Any, Any]:
    v, caps = vllm_modules(), detect()
    return build_scheduler(cfg, v, caps, "0.33.0"), build_manager(cfg, v, caps, "0.33.0")


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_scheduler_manager_matches_build_manager(name: str) -> None:
    cfg = SHAPES[name]
    scheduler, manager = _build(cfg)
    drafts = cfg.num_lookahead_tokens
    assert manager_signature(scheduler.kv_cache_manager, drafts) == manager_signature(manager)
    assert scheduler.num_lookahead_tokens == cfg.num_lookahead_tokens
    assert scheduler.block_size == cfg.scheduler_block_size
    assert scheduler.hash_block_size == cfg.hash_block_size


@pytest.mark.parametrize(
    "change",
    [{"retention_interval": None}, {"num_blocks": 21}, {"eagle": False}],
)
def test_signature_sees_a_one_field_difference(change: dict[str, object]) -> None:
    """Negative control: the comparison above can fail."""
    cfg = SHAPES["eagle"].with_(retention_interval=0)
    scheduler, _ = _build(cfg)
    _, other = _build(cfg.with_(**change))
    assert manager_signature(scheduler.kv_cache_manager) != manager_signature(other)


def test_eagle_without_lookahead_is_unsupported() -> None:
    with pytest.raises(SchedulerUnsupported, match="num_lookahead_tokens"):
        _build(SHAPES["eagle"].with_(num_lookahead_tokens=0))


def test_vllm_rejection_is_a_config_error() -> None:
    bad = SHAPES["eagle"].with_(retention_interval=6)  # not a multiple of the scheduler block size
    with pytest.raises(ConfigError, match="rejects the configuration"):
        build_scheduler(bad, vllm_modules(), detect(), "0.33.0")


def test_async_scheduler_builds_with_the_same_manager() -> None:
    """`AsyncScheduler` (not driven yet) takes the same configuration."""
    cfg = SHAPES["dsv4-tiny"]
    v, caps = vllm_modules(), detect()
    scheduler = build_scheduler(cfg, v, caps, "0.33.0", async_scheduling=True)
    assert type(scheduler).__name__ == "AsyncScheduler"
    assert manager_signature(scheduler.kv_cache_manager) == manager_signature(
        build_manager(cfg, v, caps, "0.33.0")
    )


def test_a_removed_model_directory_is_made_again() -> None:
    """A temp cleaner (or a test) removing the stand-in's directory does not break later builds."""
    import shutil

    from invariants.targets.vllm_scheduler_build import model_dir

    first = model_dir(4096)
    shutil.rmtree(first)
    second = model_dir(4096)
    assert second != first
    _build(SHAPES["eagle"])
