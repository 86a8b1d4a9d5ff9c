"""Allocator configuration: KV-cache groups, block sizes, retention, Eagle, pinning.

Invariants a validated `AllocatorConfig` guarantees (checked by `validate`):

- at least one group; every block size is a positive integer; an SWA group has
  a window >= 1 and only SWA groups have one;
- `hash_block_size` (hbs) divides every group block size and every group block
  size divides `scheduler_block_size` (sbs); by default hbs = gcd, sbs = lcm;
- `num_blocks >= 2` (block 0 is the null block);
- `retention_interval` is None (dense), 0 (only reachable boundaries) or a
  positive multiple of sbs; a model without an SWA or Mamba group accepts only
  None or 0. The two retention messages are vLLM 0.33.0's texts verbatim
  (`kv_cache_coordinator._validate_prefix_cache_retention_interval`).
- Mamba prefix caching requires mamba_cache_mode 'align'.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from functools import reduce
from typing import Literal

GroupKind = Literal["full", "swa", "mamba"]
MambaCacheMode = Literal["align", "none"]

_KINDS = ("full", "swa", "mamba")


@dataclass(frozen=True)
class KVCacheGroupConfig:
    """One KV-cache group (vLLM's KVCacheGroupSpec + its KVCacheSpec, reduced)."""

    kind: GroupKind
    block_size: int
    sliding_window: int | None = None
    mamba_cache_mode: MambaCacheMode = "align"

    @property
    def spec_key(self) -> tuple[str, int, int | None, str]:
        """Groups with equal keys share one hit lookup (vLLM's SpecGroup merge)."""
        mode = self.mamba_cache_mode if self.kind == "mamba" else ""
        return (self.kind, self.block_size, self.sliding_window, mode)


@dataclass(frozen=True)
class AllocatorConfig:
    """Everything the allocator needs to know about a hybrid model.

    `retention_interval`: None = dense, 0 = only reachable boundaries, k > 0 =
    one SWA tail / Mamba state per k-token segment plus reachable boundaries.
    `pin_swa_on_drop` / `pin_min_drop_blocks`: the pinned free tier of PR
    #40676 (never merged into vLLM; off by default).
    `num_lookahead_tokens`: slots each allocation reserves for speculative tokens.
    """

    groups: tuple[KVCacheGroupConfig, ...]
    num_blocks: int
    retention_interval: int | None = None
    use_eagle: bool = False
    enable_caching: bool = True
    pin_swa_on_drop: bool = False
    pin_min_drop_blocks: int = 1
    hash_block_size: int = 0
    scheduler_block_size: int = 0
    max_model_len: int = 1 << 20
    num_lookahead_tokens: int = 0
    enable_kv_cache_events: bool = True
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        sizes = [g.block_size for g in self.groups if isinstance(g.block_size, int) and g.block_size > 0]
        if sizes and not self.hash_block_size:
            object.__setattr__(self, "hash_block_size", reduce(math.gcd, sizes))
        if sizes and not self.scheduler_block_size:
            object.__setattr__(self, "scheduler_block_size", reduce(math.lcm, sizes))

    @property
    def has_retention_group(self) -> bool:
        return any(g.kind in ("swa", "mamba") for g in self.groups)

    @property
    def has_mamba(self) -> bool:
        """A Mamba group in 'align' mode (the one whose chunks the scheduler splits)."""
        return any(g.kind == "mamba" and g.mamba_cache_mode == "align" for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1


def validate(cfg: AllocatorConfig) -> AllocatorConfig:
    """Return `cfg` unchanged if valid; raise ValueError naming the field and rule."""
    if not cfg.groups:
        raise ValueError("groups: a configuration needs at least one KV-cache group")
    for i, g in enumerate(cfg.groups):
        if g.kind not in _KINDS:
            raise ValueError(f"groups[{i}].kind: must be 'full', 'swa' or 'mamba', got {g.kind!r}")
        if not isinstance(g.block_size, int) or isinstance(g.block_size, bool) or g.block_size <= 0:
            raise ValueError(f"groups[{i}].block_size: must be a positive integer, got {g.block_size!r}")
        if g.kind == "swa" and (g.sliding_window is None or g.sliding_window < 1):
            raise ValueError(f"groups[{i}].sliding_window: an 'swa' group needs a window >= 1")
        if g.kind != "swa" and g.sliding_window is not None:
            raise ValueError(f"groups[{i}].sliding_window: only 'swa' groups have a window")
        if g.kind == "mamba" and g.mamba_cache_mode not in ("align", "none"):
            raise ValueError(f"groups[{i}].mamba_cache_mode: must be 'align' or 'none'")
        if g.kind == "mamba" and cfg.enable_caching and g.mamba_cache_mode != "align":
            raise ValueError(
                f"groups[{i}].mamba_cache_mode: Mamba prefix caching requires mamba_cache_mode='align'"
            )
    hbs, sbs = cfg.hash_block_size, cfg.scheduler_block_size
    for i, g in enumerate(cfg.groups):
        if g.block_size % hbs:
            raise ValueError(
                f"hash_block_size ({hbs}): must divide every group block size "
                f"(groups[{i}].block_size = {g.block_size})"
            )
        if sbs % g.block_size:
            raise ValueError(
                f"scheduler_block_size ({sbs}): must be a multiple of every group block size "
                f"(groups[{i}].block_size = {g.block_size})"
            )
    if cfg.num_blocks < 2:
        raise ValueError(f"num_blocks: must be >= 2 (block 0 is the null block), got {cfg.num_blocks}")
    if cfg.pin_min_drop_blocks < 0:
        raise ValueError("pin_min_drop_blocks: must be non-negative")
    r = cfg.retention_interval
    if r is not None:
        if isinstance(r, bool) or not isinstance(r, int):
            raise ValueError(f"retention_interval: must be None or an integer, got {r!r}")
        validate_retention_interval(r, sbs, cfg.has_retention_group)
        if not cfg.enable_caching and r != 0:
            warnings.warn("retention_interval is ignored because prefix caching is disabled", stacklevel=2)
    return cfg


def validate_retention_interval(
    retention_interval: int, scheduler_block_size: int, has_retention_group: bool
) -> None:
    """vLLM 0.33.0's rule and texts; runs for every coordinator type."""
    if not has_retention_group:
        if retention_interval == 0:
            return
        raise ValueError(
            "prefix_cache_retention_interval is set but this model has "
            "no sliding-window or Mamba KV cache group, so retention has no "
            "effect. Set it to 0 (it only applies to sliding-window and Mamba "
            "attention)."
        )
    if retention_interval < 0 or retention_interval % scheduler_block_size != 0:
        raise ValueError(
            f"prefix_cache_retention_interval ({retention_interval}) "
            "must be non-negative and a multiple of scheduler_block_size "
            f"({scheduler_block_size})."
        )
