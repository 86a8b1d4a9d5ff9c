"""Building vLLM's `KVCacheManager` for a kvretain `Config`.

`group_specs` turns the configuration's groups into vLLM's own group specs
(`FullAttentionSpec`, `SlidingWindowSpec`, `MambaSpec`, one layer each, one
float32 element per token: the allocator reads only block sizes, windows and
Mamba modes); `invariants.layouts.derive` builds its plain specs with it too.
`build_manager` makes the `KVCacheConfig` and the manager, with KV events on.

Older releases: the adapter follows `vllm_capabilities.detect()`: the installed
version's rules (`vllm_releases`) and the installed classes' signatures. It passes
only the constructor arguments the release's `KVCacheManager` takes, and sets the retention interval
where the release reads it (a `KVCacheConfig` field, or the environment
variable while the coordinator is built; a release without one accepts only
dense retention). What a release cannot express raises `UnsupportedConfig`;
what vLLM itself rejects is re-raised as `model.contract.config.ConfigError` carrying
vLLM's message.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from collections.abc import Iterator
from typing import Any

from model.contract.config import Config, ConfigError

from .vllm_capabilities import RETENTION_ENV, Capabilities

NO_PINNED_TIER = "vLLM 0.33.0 has no pinned tier (#40676 was never merged)"


class UnsupportedConfig(ConfigError):
    """A configuration option of kvretain's that vLLM does not have (not a vLLM rejection)."""


def group_specs(cfg: Config, v: dict[str, Any], draft_blocks: int = 0) -> list[Any]:
    """vLLM `KVCacheGroupSpec`s for `cfg`'s groups, in order (`v`: vLLM's modules,
    with `torch`, `FullAttentionSpec`, `SlidingWindowSpec`, `MambaSpec`, `KVCacheGroupSpec`).
    `draft_blocks`: each Mamba group's `num_speculative_blocks` (a Mamba layer
    declares one per speculative token, `MambaBase.get_kv_cache_spec`); only the
    scheduler target speculates."""
    torch = v["torch"]
    drafts = {"num_speculative_blocks": draft_blocks} if draft_blocks else {}
    specs = []
    for i, g in enumerate(cfg.groups):
        if g.kind == "full":
            spec = v["FullAttentionSpec"](
                block_size=g.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
            )
        elif g.kind == "swa":
            spec = v["SlidingWindowSpec"](
                block_size=g.block_size,
                num_kv_heads=1,
                head_size=1,
                dtype=torch.float32,
                sliding_window=g.sliding_window,
            )
        elif g.kind == "mamba":
            spec = v["MambaSpec"](
                block_size=g.block_size,
                shapes=((1,),),
                dtypes=(torch.float32,),
                mamba_cache_mode=g.mamba_cache_mode,
                **drafts,
            )
        else:
            raise ConfigError(f"groups[{i}].kind: must be 'full', 'swa' or 'mamba', got {g.kind!r}")
        specs.append(v["KVCacheGroupSpec"]([f"layer{i}"], spec))
    return specs


def check_supported(cfg: Config, caps: Capabilities, version: str) -> None:
    """Raise `UnsupportedConfig` for what the installed release cannot express."""
    if caps.retention == "none" and cfg.retention_interval is not None:
        raise UnsupportedConfig(f"retention_interval: vLLM {version} has no retention interval (dense only)")
    if not caps.fine_grained_mamba and any(
        g.kind == "mamba" and g.block_size > cfg.hash_block_size for g in cfg.groups
    ):
        # A Mamba block wider than the hash block asks for fine-grained hits.
        raise UnsupportedConfig(f"groups: vLLM {version} has no fine-grained Mamba hits")
    lcm = math.lcm(*(g.block_size for g in cfg.groups))
    if "scheduler_block_size" not in caps.manager_args and cfg.scheduler_block_size != lcm:
        # Such a release aligns hits and caching to the lcm of the group block sizes.
        raise UnsupportedConfig(
            f"scheduler_block_size: vLLM {version} takes none (it aligns to the lcm of "
            f"the group block sizes, {lcm}), got {cfg.scheduler_block_size}"
        )


def build_manager(cfg: Config, v: dict[str, Any], caps: Capabilities, version: str) -> Any:
    """vLLM's `KVCacheManager` for `cfg` on the installed release (see the module docstring)."""
    specs = group_specs(cfg, v)
    check_supported(cfg, caps, version)
    cfg_args: dict[str, Any] = {}
    if caps.retention == "config":
        # The dataclass default is None (dense); always pass it explicitly.
        cfg_args["prefix_cache_retention_interval"] = cfg.retention_interval
    wanted = {
        "max_model_len": cfg.max_model_len,
        "scheduler_block_size": cfg.scheduler_block_size,
        "hash_block_size": cfg.hash_block_size,
        "enable_caching": cfg.enable_caching,
        "use_eagle": cfg.eagle,
        "enable_kv_cache_events": True,
        "watermark": cfg.watermark,
    }
    if cfg.watermark and "watermark" not in caps.manager_args:
        raise UnsupportedConfig(f"watermark: vLLM {version}'s KVCacheManager takes none")
    gates = inspect.signature(v["KVCacheManager"].allocate_slots).parameters
    if cfg.reserve_full_isl and "full_sequence_must_fit" not in gates:
        raise UnsupportedConfig(
            f"reserve_full_isl: vLLM {version}'s allocate_slots has no full-sequence gate"
        )
    manager_args = {k: val for k, val in wanted.items() if k in caps.manager_args}
    try:
        kv_cfg = v["KVCacheConfig"](
            num_blocks=cfg.num_blocks, kv_cache_tensors=[], kv_cache_groups=specs, **cfg_args
        )
        # The environment-variable releases reject the variable for a model
        # without SWA/Mamba groups, where the field of later releases has no effect.
        env_r = cfg.retention_interval if any(g.kind != "full" for g in cfg.groups) else None
        with _retention_env(env_r if caps.retention == "env" else None):
            return v["KVCacheManager"](kv_cfg, **manager_args)
    except (ValueError, AssertionError, TypeError) as exc:
        kind = "" if isinstance(exc, ValueError) else f" ({type(exc).__name__})"
        raise ConfigError(f"vLLM {version} rejects the configuration{kind}: {exc}") from exc


@contextlib.contextmanager
def _retention_env(interval: int | None) -> Iterator[None]:
    """A release that reads the retention interval from the environment sees
    `interval` while its coordinator is built; the variable is restored after."""
    old = os.environ.pop(RETENTION_ENV, None)
    if interval is not None:
        os.environ[RETENTION_ENV] = str(interval)
    try:
        yield
    finally:
        os.environ.pop(RETENTION_ENV, None)
        if old is not None:
            os.environ[RETENTION_ENV] = old
