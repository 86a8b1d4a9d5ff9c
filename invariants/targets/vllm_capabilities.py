"""Which retention mechanisms a vLLM release has, read from that release's own code.

vLLM's allocator gained the mechanisms kvretain judges one release at a time.
A version string says nothing about them; the installed classes do. Everything
that depends on the release (the vLLM adapter's constructor arguments and
branches, the release matrix's configuration space and its classification of
findings) asks one `Capabilities` object, detected once per interpreter:

| capability               | the release's code that shows it                           | PR     |
|--------------------------|------------------------------------------------------------|--------|
| `block_mask`             | `BlockPool.cache_full_blocks(..., block_mask)`             | #42258 |
| `free_order`             | `BlockPool.free_blocks`: "append" (every freed block to    | #43447 |
|                          | the tail), "caller" (callers choose `prepend=`: SWA's own  | #42656 |
|                          | frees, #43447, 0.23.0), "pool" (the pool prepends unhashed,|        |
|                          | appends hashed blocks: #42656, 0.24.0)                     |        |
| `caching_off_order`      | caching off: freed blocks "lifo" (to the head) or "fifo"   | #51482 |
| `retention`              | "none", "env" (`VLLM_PREFIX_CACHE_RETENTION_INTERVAL` read | #43447 |
|                          | by the coordinator) or "config" (`KVCacheConfig` field)    | #52216 |
| `mamba_retention`        | `MambaManager.reachable_block_mask`                        | #45845 |
| `eagle_aware_mask`       | `SlidingWindowManager._contiguous_blocks_for_hit`, shared  | #44082 |
|                          | by the SWA lookup and its mask (Eagle's extra block)       |        |
| `shared_prefix_junction` | `get_computed_blocks` returns `shared_prefix_boundary`     |        |
| `fine_grained_mamba`     | the coordinator's `enable_partial_hash_hits`               |        |
| `cow_copies`             | `KVCacheManager.take_kv_cache_block_copies`                |        |
| `coarse_hash`            | a group block wider than the hash block is keyed by "last" |        |
|                          | fine hash, or by the "concat" of its fine hashes           |        |
| `eagle_junction_peek`    | `cache_blocks` also keeps the block below the junction     |        |
|                          | under Eagle (`shared_prefix_boundary - self.block_size`)  |        |
| `tail_excludes_last`     | full attention's partial prompt tail stops at `prompt - 1` |        |
|                          | without Eagle (`_cache_partial_tail_block`)                |        |
| `eagle_margin_hashed`    | the hybrid lookup's Eagle margin is capped by the hashed   |        |
|                          | tokens (`len(block_hashes) * self.hash_block_size`)        |        |
| `replay_boundaries`      | the coordinator passes Eagle-aware `replay_boundaries` to  |        |
|                          | `cache_blocks` (else only `num_prompt_tokens - 1`)         |        |
| `partial_tail`           | `FullAttentionManager._cache_partial_tail_block` (partial  | #46384 |
|                          | prompt tails keyed inside a block)                         |        |
| `eagle_margin_skips_mamba` | the hybrid lookup gives Mamba no Eagle margin (`not      | #46384 |
|                          | isinstance(spec, MambaSpec)` in the coordinator)           |        |
| `mamba_checkpoint`       | `MambaManager._cache_partial_tail_block`: "any_block" (no  |        |
|                          | `num_tokens % self.block_size == 0` early return), else    |        |
|                          | "in_block_drop" (lowered under Eagle:                      |        |
|                          | `latest_prompt_hash_boundary - hash_block_size`) or        |        |
|                          | "in_block"                                                 |        |
| `mamba_count_capped`     | `MambaManager.get_num_blocks_to_allocate` caps the count   |        |
|                          | (`min(num_new_blocks, physical_block_cap)`)                |        |
| `mamba_retired_mark`     | `MambaManager._remove_blocks_in_range` (align mode frees   |        |
|                          | skipped states past null gaps)                             |        |
| `mask_hit_grid`          | `SingleTypeKVCacheManager.cache_blocks` floors the masks'  |        |
|                          | boundaries to `cache_hit_alignment_tokens` (the hit grid), |        |
|                          | else to `scheduler_block_size`                             |        |
| `scheduler_missing`      | what the vllm target drives that the release's   |        |
|                          | `Scheduler` API lacks (`scheduler_api_missing`; empty: it  |        |
|                          | runs; None: not detected, e.g. a namespace of fakes)       |        |
| `sample_caching`         | `Scheduler.update_from_output` caches a drafting request's |        |
|                          | blocks at its sample (`cache_blocks`; 0.33.0), else they   |        |
|                          | are cached at its next allocation (None: not detected)     |        |
| `manager_args`           | `KVCacheManager.__init__`'s parameter names                |        |
| `event_fields`           | `BlockStored`'s fields                                     |        |

`detect_from(namespace)` reads the classes of a namespace (the real vLLM, or
fakes in the tests); `detect()` imports the interpreter's vLLM once.
`Capabilities.profile()` is the model's semantics profile (`model.profile`)
for the release: the one place capabilities become the model's rules.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from model.profile import Profile

FREE_ORDERS = ("append", "caller", "pool")
RETENTION_SOURCES = ("none", "env", "config")
RETENTION_ENV = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"

# Mechanism -> the upstream PR that introduced it (for "gone in X.Y.Z" lines).
MECHANISM_PR: dict[str, str] = {
    "block_mask": "#42258",
    "free_order": "#42656 pool-wide; #43447 only SWA's own frees, 0.23.0",
    "caching_off_order": "#51482",
    "retention": "#43447",
    "mamba_retention": "#45845",
    "eagle_aware_mask": "#44082",
    "shared_prefix_junction": "shared-prefix junction",
    "fine_grained_mamba": "fine-grained Mamba hits",
}


@dataclass(frozen=True)
class Capabilities:
    """The mechanisms of one vLLM release (see the module docstring for each field)."""

    version: str
    block_mask: bool
    free_order: str
    caching_off_order: str
    retention: str
    mamba_retention: bool
    eagle_aware_mask: bool
    shared_prefix_junction: bool
    fine_grained_mamba: bool
    cow_copies: bool
    coarse_hash: str
    manager_args: frozenset[str]
    event_fields: frozenset[str]
    eagle_junction_peek: bool = True
    tail_excludes_last: bool = True
    eagle_margin_hashed: bool = True
    replay_boundaries: bool = True
    partial_tail: bool = True
    eagle_margin_skips_mamba: bool = True
    mamba_checkpoint: str = "any_block"
    mamba_count_capped: bool = True
    mamba_retired_mark: bool = True
    mask_hit_grid: bool = True
    scheduler_missing: tuple[str, ...] | None = None
    sample_caching: bool | None = None

    def profile(self) -> Profile:
        """The model's semantics profile for this release (its design of the time)."""
        return Profile(
            eagle_junction_peek=self.eagle_junction_peek,
            partial_tail_excludes_last_token=self.tail_excludes_last,
            eagle_margin_to_hashed=self.eagle_margin_hashed,
            eagle_replay_boundaries=self.replay_boundaries,
            caching_off_free_to_head=self.caching_off_order == "lifo",
            block_mask=self.block_mask,
            eagle_aware_mask=self.eagle_aware_mask,
            mamba_retention=self.mamba_retention,
            free_order=self.free_order,
            shared_prefix_junction=self.shared_prefix_junction,
            partial_tail=self.partial_tail,
            eagle_margin_skips_mamba=self.eagle_margin_skips_mamba,
            mamba_checkpoint=self.mamba_checkpoint,
            mamba_count_capped=self.mamba_count_capped,
            mamba_retire_past_nulls=self.mamba_retired_mark,
            masks_on_hit_grid=self.mask_hit_grid,
        )

    @property
    def has_retention_interval(self) -> bool:
        """A retention interval other than dense (None) can be configured."""
        return self.retention != "none"

    @property
    def has_free_order_fix(self) -> bool:
        """Every freed unhashed block goes to the head of the free queue (#42656, 0.24.0)."""
        return self.free_order == "pool"

    def missing(self) -> list[str]:
        """The mechanisms of the modeled design this release lacks, by name."""
        out = [
            name
            for name in (
                "block_mask",
                "mamba_retention",
                "eagle_aware_mask",
                "shared_prefix_junction",
                "fine_grained_mamba",
            )
            if not getattr(self, name)
        ]
        if not self.has_free_order_fix:
            out.append("free_order")
        if self.caching_off_order != "lifo":
            out.append("caching_off_order")
        if not self.has_retention_interval:
            out.append("retention")
        return out

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["manager_args"] = sorted(self.manager_args)
        out["event_fields"] = sorted(self.event_fields)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Capabilities:
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        kwargs["manager_args"] = frozenset(kwargs.get("manager_args", ()))
        kwargs["event_fields"] = frozenset(kwargs.get("event_fields", ()))
        kwargs.setdefault("coarse_hash", "last")
        kwargs.setdefault("caching_off_order", "lifo")
        if kwargs.get("scheduler_missing") is not None:
            kwargs["scheduler_missing"] = tuple(kwargs["scheduler_missing"])
        return cls(**kwargs)


# ----------------------------------------------------------------------------- detection
def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _params(func: Any) -> frozenset[str]:
    try:
        return frozenset(p for p in inspect.signature(func).parameters if p != "self")
    except (TypeError, ValueError):
        return frozenset()


def _fields(cls: Any) -> frozenset[str]:
    if dataclasses.is_dataclass(cls):
        return frozenset(f.name for f in dataclasses.fields(cls))
    # msgspec structs (vLLM's KV events) list theirs in __struct_fields__.
    names = getattr(cls, "__struct_fields__", None)
    if names is not None:
        return frozenset(names)
    return frozenset(getattr(cls, "__annotations__", {}))


def _free_order(free_blocks: Any) -> str:
    if "prepend" in _params(free_blocks):
        return "caller"
    return "pool" if "prepend_n" in _source(free_blocks) else "append"


def _mamba_checkpoint(mamba_manager: Any) -> str:
    tail = _source(getattr(mamba_manager, "_cache_partial_tail_block", None))
    if tail and "num_tokens % self.block_size == 0" not in tail:
        return "any_block"
    return "in_block_drop" if "latest_prompt_hash_boundary - hash_block_size" in tail else "in_block"


def _retention(kv_cache_config: Any, coordinator_module: Any) -> str:
    if "prefix_cache_retention_interval" in _fields(kv_cache_config):
        return "config"
    return "env" if RETENTION_ENV in _source(coordinator_module) else "none"


def detect_from(ns: Mapping[str, Any], version: str) -> Capabilities:
    """Capabilities from a namespace of vLLM's classes and modules.

    Keys: BlockPool, KVCacheManager, KVCacheConfig, BlockStored,
    SlidingWindowManager, MambaManager, BlockHashListWithBlockSize,
    coordinator_module; optional (absent = the older rule):
    SingleTypeKVCacheManager, FullAttentionManager.
    """
    manager = ns["KVCacheManager"]
    single_type = ns.get("SingleTypeKVCacheManager", object)
    full = ns.get("FullAttentionManager", object)
    return Capabilities(
        version=version,
        block_mask="block_mask" in _params(ns["BlockPool"].cache_full_blocks),
        free_order=_free_order(ns["BlockPool"].free_blocks),
        caching_off_order="fifo"
        if "is None and self.enable_caching" in _source(ns["BlockPool"].free_blocks)
        else "lifo",
        retention=_retention(ns["KVCacheConfig"], ns["coordinator_module"]),
        mamba_retention="reachable_block_mask" in vars(ns["MambaManager"]),
        eagle_aware_mask="_contiguous_blocks_for_hit" in vars(ns["SlidingWindowManager"]),
        shared_prefix_junction="shared_prefix_boundary" in _source(manager.get_computed_blocks),
        fine_grained_mamba="enable_partial_hash_hits" in _source(ns["coordinator_module"]),
        cow_copies=hasattr(manager, "take_kv_cache_block_copies"),
        coarse_hash="concat" if 'b"".join' in _source(ns["BlockHashListWithBlockSize"]) else "last",
        manager_args=_params(manager.__init__),
        event_fields=_fields(ns["BlockStored"]),
        eagle_junction_peek="shared_prefix_boundary - self.block_size"
        in _source(getattr(single_type, "cache_blocks", None)),
        tail_excludes_last="num_prompt_tokens - 1"
        in _source(getattr(full, "_cache_partial_tail_block", None)),
        eagle_margin_hashed="len(block_hashes) * self.hash_block_size" in _source(ns["coordinator_module"]),
        replay_boundaries="replay_boundaries" in _source(ns["coordinator_module"]),
        partial_tail=hasattr(full, "_cache_partial_tail_block"),
        eagle_margin_skips_mamba="not isinstance(spec, MambaSpec)" in _source(ns["coordinator_module"]),
        mamba_checkpoint=_mamba_checkpoint(ns["MambaManager"]),
        mamba_count_capped="min(num_new_blocks, physical_block_cap)"
        in _source(getattr(ns["MambaManager"], "get_num_blocks_to_allocate", None)),
        mamba_retired_mark="_remove_blocks_in_range" in vars(ns["MambaManager"]),
        mask_hit_grid="cache_hit_alignment_tokens" in _source(getattr(single_type, "cache_blocks", None)),
    )


# What the vllm target (`vllm_scheduler_build`, `vllm_scheduler_drive`) calls or
# reads of vLLM's scheduler, by class: constructor parameters, methods, fields.
SCHEDULER_API: dict[str, tuple[str, ...]] = {
    "Scheduler.__init__": (
        "vllm_config",
        "kv_cache_config",
        "structured_output_manager",
        "block_size",
        "hash_block_size",
        "log_stats",
    ),
    "Scheduler": (
        "add_request",
        "schedule",
        "update_from_output",
        "finish_requests",
        "reset_prefix_cache",
        "_preempt_request",
        "_mamba_block_aligned_split",
    ),
    "SchedulerConfig": (
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "enable_chunked_prefill",
        "long_prefill_token_threshold",
        "is_encoder_decoder",
        "watermark",
        "scheduler_reserve_full_isl",
        "async_scheduling",
    ),
    "CacheConfig": ("block_size", "enable_prefix_caching", "mamba_cache_mode"),
    "SchedulerOutput": (
        "num_scheduled_tokens",
        "scheduled_new_reqs",
        "scheduled_cached_reqs",
        "scheduled_spec_decode_tokens",
        "kv_cache_block_copies",
    ),
    "CachedRequestData": ("req_ids", "new_block_ids"),
    "ModelRunnerOutput": ("req_ids", "req_id_to_index", "sampled_token_ids"),
}


def scheduler_api_missing(ns: Mapping[str, Any]) -> tuple[str, ...]:
    """What of `SCHEDULER_API` the release's classes in `ns` lack, as "Class.name" (empty:
    the vllm target can drive this release's scheduler). A class absent from
    `ns` is missing whole; the per-step token budget is the scheduler's
    `max_num_scheduled_tokens`, which `schedule()` must read."""
    missing: list[str] = []
    for owner, names in SCHEDULER_API.items():
        cls_name, _, method = owner.partition(".")
        cls = ns.get(cls_name)
        if cls is None:
            missing.append(cls_name)
            continue
        have = (
            _params(getattr(cls, method))
            if method
            # constructor parameters (a config's InitVars too), fields, attributes
            else _params(cls) | _fields(cls) | frozenset(n for n in dir(cls) if not n.startswith("__"))
        )
        missing += [f"{owner}({n})" if method else f"{cls_name}.{n}" for n in names if n not in have]
    schedule = getattr(ns.get("Scheduler"), "schedule", None)
    if schedule is not None and "self.max_num_scheduled_tokens" not in _source(schedule):
        missing.append("Scheduler.schedule reading self.max_num_scheduled_tokens")
    return tuple(missing)


def scheduler_unsupported(caps: Capabilities) -> str | None:
    """Why the vllm target cannot drive this release's scheduler (None: it can)."""
    if not caps.scheduler_missing:
        return None
    return f"vLLM {caps.version}'s Scheduler lacks what the vllm target drives: " + ", ".join(
        caps.scheduler_missing
    )


def detect_scheduler_api() -> tuple[str, ...]:
    """`scheduler_api_missing` of this interpreter's vLLM; a scheduler module that does not
    import is missing whole (named with the import error)."""
    try:
        from vllm.config import CacheConfig, SchedulerConfig
        from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.outputs import ModelRunnerOutput
    except ImportError as exc:
        return (f"vllm.v1.core.sched ({type(exc).__name__}: {exc})",)
    return scheduler_api_missing(
        {
            "Scheduler": Scheduler,
            "SchedulerConfig": SchedulerConfig,
            "CacheConfig": CacheConfig,
            "SchedulerOutput": SchedulerOutput,
            "CachedRequestData": CachedRequestData,
            "ModelRunnerOutput": ModelRunnerOutput,
        }
    )


@functools.cache
def detect() -> Capabilities:
    """The capabilities of this interpreter's vLLM (imports it; call after
    `vllm_available()` said it imports)."""
    import importlib.metadata

    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import BlockHashListWithBlockSize
    from vllm.v1.core.single_type_kv_cache_manager import (
        FullAttentionManager,
        MambaManager,
        SingleTypeKVCacheManager,
        SlidingWindowManager,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig

    ns = {
        "BlockPool": BlockPool,
        "KVCacheManager": KVCacheManager,
        "KVCacheConfig": KVCacheConfig,
        "BlockStored": BlockStored,
        "SlidingWindowManager": SlidingWindowManager,
        "MambaManager": MambaManager,
        "BlockHashListWithBlockSize": BlockHashListWithBlockSize,
        "coordinator_module": kv_cache_coordinator,
        "SingleTypeKVCacheManager": SingleTypeKVCacheManager,
        "FullAttentionManager": FullAttentionManager,
    }
    caps = detect_from(ns, importlib.metadata.version("vllm"))
    return dataclasses.replace(
        caps, scheduler_missing=detect_scheduler_api(), sample_caching=detect_sample_caching()
    )


def detect_sample_caching() -> bool | None:
    """`sample_caching` of this interpreter's vLLM (None: its scheduler does not import)."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        return None
    return "cache_blocks(" in _source(Scheduler.update_from_output)
