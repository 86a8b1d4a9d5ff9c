"""Allocator configuration and the rules that make one valid.

A configuration is the allocator's view of a hybrid model: its KV-cache groups
(full attention, sliding-window attention, Mamba), their block sizes, the hash
and scheduler block sizes, the retention interval, Eagle/MTP, caching and the
pinned tier of #40676 (an option of ours; vLLM never merged it).

Validation follows vLLM 0.33.0 (`kv_cache_coordinator.py`,
`_validate_prefix_cache_retention_interval`) and the seeds (#43447, #45845):
the retention interval is None (dense), 0 (latest replayable prompt boundary
only) or a positive multiple of the scheduler block size, and a model with no
sliding-window or Mamba group accepts only None or 0.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from functools import reduce
from typing import Literal

from model.contract.eagle import drops_last_block, hash_lookahead_tokens

GroupKind = Literal["full", "swa", "mamba"]


class ConfigError(ValueError):
    """An invalid configuration; the message names the field and the rule."""


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group: its kind, block size (tokens) and kind-specific fields."""

    kind: GroupKind
    block_size: int
    sliding_window: int | None = None
    mamba_cache_mode: Literal["align", "none"] = "align"


@dataclass(frozen=True)
class Config:
    """An allocator configuration.

    `hash_block_size` and `scheduler_block_size` default to the gcd and lcm of
    the group block sizes, as vLLM's `resolve_kv_cache_block_sizes` does.
    `retention_interval`: None = dense, 0 = only the latest replayable prompt
    boundary, k > 0 = one SWA tail / Mamba state per k-token segment plus it.
    `pin_swa_on_drop` / `pin_min_drop_blocks`: the #40676 pinned tier.
    `num_lookahead_tokens`: slots every allocation reserves past the scheduled
    tokens for speculative tokens (vLLM's scheduler passes its spec-token count).
    `max_num_batched_tokens`: the scheduler's token budget per step, fixed when the engine
    is built (vLLM `SchedulerConfig.max_num_batched_tokens`); 0: none stated (an engine is
    built with `max_model_len`; the allocator-level targets take each `Step.budget` as given).
    `max_num_seqs`: at most this many running requests; the waiting pass admits none past
    it (vLLM `max_num_seqs`; 0: none; `model.policy.scheduling.seq_cap_reached`).
    `kv_connector`: a KV connector is attached (`model.machine.connector`): offers and
    loads can be stated, and a finish first frees the blocks out of its windows.
    `kv_load_failure_policy`: what a failed load does, "recompute" (the request is
    admitted afresh) or "fail" (the request ends with an error), as vLLM's.
    `long_prefill_token_threshold`: the scheduler's cap on one request's chunk in a
    step with other requests (vLLM `SchedulerConfig`; 0: none; `model.policy.scheduling`).

    vLLM's scheduler settings (`SchedulerConfig`, `SpeculativeConfig`; `model.policy.admission`).
    Each field's default is the value kvretain built vLLM with before the field existed,
    so a trace written then (the field absent) keeps its meaning; new generation draws
    vLLM's own default most often (`invariants.harness.strategies`):
    `reserve_full_isl`: a waiting request is admitted only if its whole sequence fits the
    free pool (vLLM `scheduler_reserve_full_isl`; vLLM's default True, the field's False);
    `watermark`: the fraction of the pool an admission leaves free while a request runs
    (vLLM `watermark`, default 0.0); `scheduling_policy`: "fcfs" (vLLM's default) or
    "priority" (not predicted by the model: judged by the engine's contract alone);
    `lookahead_block_hashes`: an Eagle configuration's block hashes cover the drafter's
    lookahead token instead of dropping the last hit block (vLLM's default: on, i.e.
    `disable_lookahead_block_hashes=False`; the field's default False; `model.contract.eagle`).
    """

    groups: tuple[GroupSpec, ...]
    num_blocks: int
    retention_interval: int | None = None
    eagle: bool = False
    enable_caching: bool = True
    pin_swa_on_drop: bool = False
    pin_min_drop_blocks: int = 1
    hash_block_size: int = 0
    scheduler_block_size: int = 0
    max_model_len: int = 1 << 20
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    num_lookahead_tokens: int = 0
    kv_connector: bool = False
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    long_prefill_token_threshold: int = 0
    reserve_full_isl: bool = False
    watermark: float = 0.0
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    lookahead_block_hashes: bool = False
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        sizes = [g.block_size for g in self.groups if g.block_size > 0]
        if sizes and self.hash_block_size == 0:
            object.__setattr__(self, "hash_block_size", reduce(math.gcd, sizes))
        if sizes and self.scheduler_block_size == 0:
            object.__setattr__(self, "scheduler_block_size", math.lcm(*sizes))

    @property
    def has_retention_group(self) -> bool:
        return any(g.kind in ("swa", "mamba") for g in self.groups)

    @property
    def has_mamba(self) -> bool:
        return any(g.kind == "mamba" for g in self.groups)

    @property
    def has_mamba_align(self) -> bool:
        """A Mamba group in 'align' mode: the scheduler splits prefill chunks for it."""
        return any(g.kind == "mamba" and g.mamba_cache_mode == "align" for g in self.groups)

    @property
    def effective_retention(self) -> int | None:
        """The interval in force: None (dense) when caching is off."""
        return self.retention_interval if self.enable_caching else None

    @property
    def lookahead_hashes_in_force(self) -> bool:
        """Eagle's block hashes cover the lookahead token (no trailing-block drop): asked for,
        Eagle, prefix caching on and no KV connector (vLLM 0.33.0
        `VllmConfig.num_hash_lookahead_tokens`: connectors keep the legacy hashes)."""
        return self.hash_lookahead > 0

    @property
    def hash_lookahead(self) -> int:
        """Tokens past each block its hash covers (`model.contract.eagle.hash_lookahead_tokens`)."""
        return hash_lookahead_tokens(
            self.eagle, self.lookahead_block_hashes, self.enable_caching, self.kv_connector
        )

    @property
    def eagle_drop(self) -> bool:
        """An Eagle hit gives back its last block, with the margin, replay boundaries and
        junction peek that go with it (`model.contract.eagle.drops_last_block`): the allocator's Eagle."""
        return drops_last_block(self.eagle, self.hash_lookahead)

    def with_(self, **changes: object) -> Config:
        return replace(self, **changes)  # type: ignore[arg-type]


def validate(cfg: Config) -> Config:
    """Return `cfg` if valid, else raise ConfigError naming the field and rule.

    Rules (vLLM 0.33.0 texts where vLLM has the rule):
    - at least one group; block sizes positive; windows >= 1 for SWA groups;
    - the hash block size divides every group block size, and every group
      block size divides the scheduler block size;
    - num_blocks >= 2 (block 0 is the null block);
    - retention on a model with no SWA/Mamba group: only None or 0;
    - otherwise retention is None or a non-negative multiple of the scheduler
      block size;
    - Mamba prefix caching requires mamba_cache_mode 'align' ('none' only
      with caching off: vLLM `MambaManager.__init__`);
    - the long-prefill threshold is at most max_model_len (`SchedulerConfig`);
    - the watermark is in [0, 1) and the policy "fcfs" or "priority" (`SchedulerConfig`);
      lookahead block hashes only with Eagle (kvretain's rule: vLLM ignores the flag);
    - retention with caching disabled is ignored with a warning.
    """
    _check_groups(cfg)
    hbs, sbs = cfg.hash_block_size, cfg.scheduler_block_size
    for i, g in enumerate(cfg.groups):
        if g.block_size % hbs:
            raise ConfigError(
                f"hash_block_size ({hbs}): must divide every group block size "
                f"(groups[{i}].block_size = {g.block_size})"
            )
        if sbs % g.block_size:
            raise ConfigError(
                f"scheduler_block_size ({sbs}): must be a multiple of every group block size "
                f"(groups[{i}].block_size = {g.block_size})"
            )
    if len(cfg.groups) == 1 and cfg.enable_caching and hbs != cfg.groups[0].block_size:
        raise ConfigError(
            f"hash_block_size ({hbs}): a single-group model needs hash_block_size == block_size "
            f"({cfg.groups[0].block_size}) (vLLM UnitaryKVCacheCoordinator)"
        )
    if cfg.num_blocks < 2:
        raise ConfigError(f"num_blocks: must be >= 2 (block 0 is the null block), got {cfg.num_blocks}")
    _check_load_failure_policy(cfg.kv_load_failure_policy)
    if cfg.pin_min_drop_blocks < 0:
        raise ConfigError("pin_min_drop_blocks: must be non-negative")
    _check_scheduler_fields(cfg)
    _check_batch_caps(cfg)
    r = cfg.retention_interval
    if r is not None:
        if isinstance(r, bool) or not isinstance(r, int):
            raise ConfigError(f"retention_interval: must be None or an integer, got {r!r}")
        if not cfg.has_retention_group:
            if r != 0:
                raise ConfigError(
                    "prefix_cache_retention_interval is set but this model has no "
                    "sliding-window or Mamba KV cache group, so retention has no effect. "
                    "Set it to 0 (it only applies to sliding-window and Mamba attention)."
                )
        elif r < 0 or r % sbs != 0:
            raise ConfigError(
                f"prefix_cache_retention_interval ({r}) must be non-negative and a "
                f"multiple of scheduler_block_size ({sbs})."
            )
        if not cfg.enable_caching and r not in (None, 0):
            warnings.warn(
                "retention_interval is ignored because prefix caching is disabled",
                stacklevel=2,
            )
    return cfg


def _check_groups(cfg: Config) -> None:
    """At least one group; each group's kind, block size, window and Mamba cache mode."""
    if not cfg.groups:
        raise ConfigError("groups: a configuration needs at least one KV-cache group")
    for i, g in enumerate(cfg.groups):
        if g.kind not in ("full", "swa", "mamba"):
            raise ConfigError(f"groups[{i}].kind: must be 'full', 'swa' or 'mamba', got {g.kind!r}")
        if not isinstance(g.block_size, int) or g.block_size <= 0:
            raise ConfigError(f"groups[{i}].block_size: must be a positive integer, got {g.block_size!r}")
        if g.kind == "swa" and (g.sliding_window is None or g.sliding_window < 1):
            raise ConfigError(f"groups[{i}].sliding_window: an 'swa' group needs a window >= 1")
        if g.kind != "swa" and g.sliding_window is not None:
            raise ConfigError(f"groups[{i}].sliding_window: only 'swa' groups have a window")
        if g.kind == "mamba" and g.mamba_cache_mode not in ("align", "none"):
            raise ConfigError(f"groups[{i}].mamba_cache_mode: must be 'align' or 'none'")
        if g.kind == "mamba" and cfg.enable_caching and g.mamba_cache_mode != "align":
            raise ConfigError(
                f"groups[{i}].mamba_cache_mode: Mamba prefix caching requires mamba_cache_mode='align'"
            )


def _check_scheduler_fields(cfg: Config) -> None:
    if isinstance(cfg.num_lookahead_tokens, bool) or not isinstance(cfg.num_lookahead_tokens, int):
        raise ConfigError(f"num_lookahead_tokens: must be an integer, got {cfg.num_lookahead_tokens!r}")
    if cfg.num_lookahead_tokens < 0:
        raise ConfigError(f"num_lookahead_tokens: must be non-negative, got {cfg.num_lookahead_tokens}")
    t = cfg.long_prefill_token_threshold
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
        raise ConfigError(f"long_prefill_token_threshold: must be a non-negative integer, got {t!r}")
    if t > cfg.max_model_len:
        raise ConfigError(
            f"long_prefill_token_threshold ({t}) cannot be greater than the max_model_len ({cfg.max_model_len})"
        )
    w = cfg.watermark
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w < 1.0:
        raise ConfigError(f"watermark: must be a number in [0.0, 1.0), got {w!r}")
    if cfg.scheduling_policy not in ("fcfs", "priority"):
        raise ConfigError(f"scheduling_policy: must be 'fcfs' or 'priority', got {cfg.scheduling_policy!r}")
    for name in ("reserve_full_isl", "lookahead_block_hashes"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"{name}: must be true or false, got {getattr(cfg, name)!r}")
    if cfg.lookahead_block_hashes and not cfg.eagle:
        raise ConfigError("lookahead_block_hashes: only an Eagle configuration hashes lookahead tokens")


def _check_load_failure_policy(policy: object) -> None:
    if policy not in ("recompute", "fail"):
        raise ConfigError(f"kv_load_failure_policy: must be 'recompute' or 'fail', got {policy!r}")


def _check_batch_caps(cfg: Config) -> None:
    """The batch caps as vLLM's `SchedulerConfig` and `VllmConfig` take them: non-negative
    integers; `max_num_batched_tokens >= max_num_seqs` where both are stated; a speculative
    configuration's budget above its lookahead tokens (vLLM: "does not have enough slots")."""
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{name}: must be a non-negative integer, got {v!r}")
    tokens, seqs = cfg.max_num_batched_tokens, cfg.max_num_seqs
    if tokens and seqs and tokens < seqs:
        raise ConfigError(f"max_num_batched_tokens ({tokens}) must be at least max_num_seqs ({seqs})")
    if tokens and cfg.num_lookahead_tokens and tokens <= cfg.num_lookahead_tokens:
        raise ConfigError(
            f"max_num_batched_tokens ({tokens}): must exceed num_lookahead_tokens ({cfg.num_lookahead_tokens}) "
            "(vLLM: not enough slots to schedule a token and the speculative tokens)"
        )
