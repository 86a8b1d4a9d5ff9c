"""Which rules a vLLM run is judged by (chosen by version), and whether the installed code
still behaves like them (a regression check that reports, never adopts).

Everything that depends on the release (the vLLM adapter's constructor arguments
and branches, the model's profile, the release matrix's configuration space and
its classification of findings) asks one `Capabilities` object, `detect()`:

- its rules (`vllm_releases.RULE_FIELDS`) are the installed version's row of
  `vllm_releases.RELEASES` (a dev build: the release it descends from, stated
  in `ProfileCheck.note`), plus what the user declares in `KVRETAIN_VLLM_PROFILE`
  ("capability=value,...", for a branch that intends a new rule);
- its API facts (`manager_args`, `event_fields`, `scheduler_missing`) are read
  from the installed classes' signatures, fields and attributes, never their
  source text, so a refactored or edited scheduler (a user's branch) runs.

`detect_code()` derives the same rules from the installed code (a behavioural
probe of a small `BlockPool` for the free orders, signatures and attributes,
and, where nothing else shows a rule, the source text). `profile_check()`
compares the two: each rule where the code behaves like another release's rule
is a `Drift` ("profile drift: ..." in the run's summary, `profile_check` in its
JSON), and the run keeps checking against the version's rule, so a regression
shows as disagreements, never as a silently adopted rule. A rule whose source
cannot be read (a function recompiled from edited text) is counted as unchecked.

What each capability means and the code that shows it:

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
| `scheduler_missing`      | what the vllm target drives that the release's             |        |
|                          | `Scheduler` API lacks (`scheduler_api_missing`, signatures |        |
|                          | and attributes; empty: it runs; None: not detected)        |        |
| `sample_caching`         | `Scheduler.update_from_output` caches a drafting request's |        |
|                          | blocks at its sample (`cache_blocks`; 0.33.0), else they   |        |
|                          | are cached at its next allocation (None: not detected)     |        |
| `manager_args`           | `KVCacheManager.__init__`'s parameter names                |        |
| `event_fields`           | `BlockStored`'s fields                                     |        |

`detect_from(namespace)` derives the rules from the classes of a namespace (the
real vLLM, or fakes in the tests); `detect()` and `detect_code()` import the
interpreter's vLLM once. `Capabilities.profile()` is the model's semantics profile (`model.contract.profile`)
for the release: the one place capabilities become the model's rules.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from model.contract.profile import Profile

from . import vllm_releases

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
def _source(obj: Any) -> str | None:
    """The source text of `obj`: "" when there is no such object (the older rule), None
    when it exists but its source cannot be read (recompiled from edited text, a C function)."""
    if obj is None or obj is object:
        return ""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return None


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


def _reused_first(pool_cls: Any, enable_caching: bool) -> bool:
    """Behaviour: on a 4-block pool, after two blocks (no hash) are taken and freed, is the
    next block handed out the first freed one (the head) rather than a fresh one?"""
    wanted = {"num_gpu_blocks": 4, "enable_caching": enable_caching, "hash_block_size": 16}
    accepted = _params(pool_cls.__init__)
    pool = pool_cls(**{k: v for k, v in wanted.items() if k in accepted})
    taken = pool.get_new_blocks(2)
    pool.free_blocks(taken)
    return bool(pool.get_new_blocks(1)[0] is taken[0])


def probe_free_orders(pool_cls: Any) -> tuple[str, str] | None:
    """(`free_order`, `caching_off_order`) of a `BlockPool` class, by behaviour (None: it
    cannot be built or driven, e.g. a fake). A pool whose freed unhashed blocks go to the
    head with caching on but to the tail with caching off has #48017's "fifo" order."""
    try:
        cached_head = _reused_first(pool_cls, enable_caching=True)
        off_head = _reused_first(pool_cls, enable_caching=False)
    except Exception:  # any failure of the probe: the rule is left to the other readings
        return None
    if "prepend" in _params(pool_cls.free_blocks):
        free_order = "caller"
    else:
        free_order = "pool" if cached_head else "append"
    return free_order, "fifo" if cached_head and not off_head else "lifo"


class _Reader:
    """Source readings that remember which rules could not be read (`unread`)."""

    def __init__(self) -> None:
        self.unread: set[str] = set()

    def has(self, rule: str, obj: Any, text: str) -> bool:
        src = _source(obj)
        if src is None:
            self.unread.add(rule)
            return False
        return text in src


def _free_order(free_blocks: Any, read: _Reader) -> str:
    if "prepend" in _params(free_blocks):
        return "caller"
    return "pool" if read.has("free_order", free_blocks, "prepend_n") else "append"


def _mamba_checkpoint(mamba_manager: Any, read: _Reader) -> str:
    tail_fn = getattr(mamba_manager, "_cache_partial_tail_block", None)
    if tail_fn is not None and not read.has("mamba_checkpoint", tail_fn, "num_tokens % self.block_size == 0"):
        return "any_block"
    drop = "latest_prompt_hash_boundary - hash_block_size"
    return "in_block_drop" if read.has("mamba_checkpoint", tail_fn, drop) else "in_block"


def _retention(kv_cache_config: Any, coordinator_module: Any, read: _Reader) -> str:
    if "prefix_cache_retention_interval" in _fields(kv_cache_config):
        return "config"
    return "env" if read.has("retention", coordinator_module, RETENTION_ENV) else "none"


def detect_code_from(ns: Mapping[str, Any], version: str) -> tuple[Capabilities, frozenset[str]]:
    """The rules the code in `ns` behaves like, and the rules it could not show (source
    unreadable). Keys as `detect_from`."""
    read = _Reader()
    manager = ns["KVCacheManager"]
    single_type = ns.get("SingleTypeKVCacheManager", object)
    full = ns.get("FullAttentionManager", object)
    coordinator = ns["coordinator_module"]
    pool = ns["BlockPool"]
    probed = probe_free_orders(pool)
    if probed is None:
        free_order = _free_order(pool.free_blocks, read)
        off = (
            "fifo"
            if read.has("caching_off_order", pool.free_blocks, "is None and self.enable_caching")
            else "lifo"
        )
    else:
        free_order, off = probed
    scheduler = ns.get("Scheduler")
    sample_caching = (
        None
        if scheduler is None
        else read.has("sample_caching", getattr(scheduler, "update_from_output", None), "cache_blocks(")
    )
    caps = Capabilities(
        version=version,
        block_mask="block_mask" in _params(pool.cache_full_blocks),
        free_order=free_order,
        caching_off_order=off,
        retention=_retention(ns["KVCacheConfig"], coordinator, read),
        mamba_retention="reachable_block_mask" in vars(ns["MambaManager"]),
        eagle_aware_mask="_contiguous_blocks_for_hit" in vars(ns["SlidingWindowManager"]),
        shared_prefix_junction=read.has(
            "shared_prefix_junction", manager.get_computed_blocks, "shared_prefix_boundary"
        ),
        fine_grained_mamba=read.has("fine_grained_mamba", coordinator, "enable_partial_hash_hits"),
        cow_copies=hasattr(manager, "take_kv_cache_block_copies"),
        coarse_hash="concat"
        if read.has("coarse_hash", ns["BlockHashListWithBlockSize"], 'b"".join')
        else "last",
        manager_args=_params(manager.__init__),
        event_fields=_fields(ns["BlockStored"]),
        eagle_junction_peek=read.has(
            "eagle_junction_peek",
            getattr(single_type, "cache_blocks", None),
            "shared_prefix_boundary - self.block_size",
        ),
        tail_excludes_last=read.has(
            "tail_excludes_last", getattr(full, "_cache_partial_tail_block", None), "num_prompt_tokens - 1"
        ),
        eagle_margin_hashed=read.has(
            "eagle_margin_hashed", coordinator, "len(block_hashes) * self.hash_block_size"
        ),
        replay_boundaries=read.has("replay_boundaries", coordinator, "replay_boundaries"),
        partial_tail=hasattr(full, "_cache_partial_tail_block"),
        eagle_margin_skips_mamba=read.has(
            "eagle_margin_skips_mamba", coordinator, "not isinstance(spec, MambaSpec)"
        ),
        mamba_checkpoint=_mamba_checkpoint(ns["MambaManager"], read),
        mamba_count_capped=read.has(
            "mamba_count_capped",
            getattr(ns["MambaManager"], "get_num_blocks_to_allocate", None),
            "min(num_new_blocks, physical_block_cap)",
        ),
        mamba_retired_mark="_remove_blocks_in_range" in vars(ns["MambaManager"]),
        mask_hit_grid=read.has(
            "mask_hit_grid", getattr(single_type, "cache_blocks", None), "cache_hit_alignment_tokens"
        ),
        sample_caching=sample_caching,
    )
    return caps, frozenset(read.unread)


def detect_from(ns: Mapping[str, Any], version: str) -> Capabilities:
    """The rules the code in a namespace of vLLM's classes and modules behaves like.

    Keys: BlockPool, KVCacheManager, KVCacheConfig, BlockStored,
    SlidingWindowManager, MambaManager, BlockHashListWithBlockSize,
    coordinator_module; optional (absent = the older rule):
    SingleTypeKVCacheManager, FullAttentionManager; Scheduler (absent:
    `sample_caching` None).
    """
    return detect_code_from(ns, version)[0]


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
    the vllm target can drive this release's scheduler). A class absent from `ns` is
    missing whole. Read from signatures, fields and attributes only, never source text:
    a scheduler whose methods were recompiled or refactored runs (that `schedule()`
    honours the per-step budget, `max_num_scheduled_tokens`, is judged by behaviour:
    every step's scheduled tokens are compared with the model's)."""
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


def _code_namespace() -> dict[str, Any]:
    """This interpreter's vLLM classes that `detect_code_from` reads (imports vLLM)."""
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

    ns: dict[str, Any] = {
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
    try:
        from vllm.v1.core.sched.scheduler import Scheduler

        ns["Scheduler"] = Scheduler
    except ImportError:
        pass
    return ns


def _installed_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("vllm")


def by_version(version: str, code: Capabilities, overrides: Mapping[str, Any] | None = None) -> Capabilities:
    """The run's capabilities: `version`'s rules (`vllm_releases`), then `overrides`, with
    the API facts (`manager_args`, `event_fields`, `scheduler_missing`) of `code`."""
    release, _ = vllm_releases.release_of(version)
    rules = {**vllm_releases.rules_of(release), **(overrides or {})}
    return dataclasses.replace(code, version=version, **rules)


@dataclass(frozen=True)
class Drift:
    """One rule the installed code behaves unlike the run's rule for (a possible regression)."""

    capability: str
    installed: Any
    rule: Any
    release: str
    declared: bool  # the run's rule was declared by an override, not the version's row

    def line(self) -> str:
        whose = (
            f"the declared rule ({vllm_releases.OVERRIDE_ENV})" if self.declared else f"{self.release}'s rule"
        )
        pr = None if self.declared else vllm_releases.RULE_PR.get(self.capability)
        return (
            f"profile drift: {self.capability}: installed code behaves like {self.installed!r} "
            f"({vllm_releases.releases_with(self.capability, self.installed)}), {whose} is "
            f"{self.rule!r}{f' ({pr})' if pr else ''}; checked against {self.rule!r} (a branch that "
            f"intends it: {vllm_releases.OVERRIDE_ENV}={self.capability}={_spelled(self.installed)})"
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _spelled(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class ProfileCheck:
    """Which release's rules a run uses, why, and where the installed code differs.

    `release`: the row of `vllm_releases` the version maps to (`note` says how, when not
    exactly); `overrides`: the rules the user declared; `drift`: every rule the installed
    code behaves unlike; `unchecked`: the rules the code could not show (source unreadable),
    counted so that a clean check says what it did not see."""

    version: str
    release: str
    note: str | None
    overrides: Mapping[str, Any]
    drift: tuple[Drift, ...]
    unchecked: tuple[str, ...]

    def lines(self) -> list[str]:
        """The run's summary lines (empty: an exact release, no override, no drift, all read)."""
        out = [self.note] if self.note else []
        if self.overrides:
            declared = ", ".join(f"{k}={_spelled(v)}" for k, v in sorted(self.overrides.items()))
            out.append(f"profile: declared by {vllm_releases.OVERRIDE_ENV}: {declared}")
        out += [d.line() for d in self.drift]
        if self.unchecked:
            out.append(
                f"profile: {len(self.unchecked)} rule(s) not checked against the installed code "
                f"(source unreadable): {', '.join(self.unchecked)}"
            )
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "release": self.release,
            "note": self.note,
            "overrides": dict(self.overrides),
            "drift": [d.to_json() for d in self.drift],
            "unchecked": list(self.unchecked),
        }


def compare(
    version: str, run: Capabilities, code: Capabilities, unread: frozenset[str], overrides: Mapping[str, Any]
) -> ProfileCheck:
    """The `ProfileCheck` of a run using `run`'s rules on code that behaves like `code`."""
    release, note = vllm_releases.release_of(version)
    drift = tuple(
        Drift(name, getattr(code, name), getattr(run, name), release, name in overrides)
        for name in vllm_releases.RULE_FIELDS
        if name not in unread
        and getattr(code, name) is not None
        and getattr(code, name) != getattr(run, name)
    )
    unchecked = tuple(n for n in vllm_releases.RULE_FIELDS if n in unread or getattr(code, n) is None)
    return ProfileCheck(version, release, note, dict(overrides), drift, unchecked)


@functools.cache
def detect_code() -> tuple[Capabilities, frozenset[str]]:
    """The rules this interpreter's vLLM code behaves like, and those it could not show
    (`detect_code_from`), with the scheduler API it offers (imports vLLM; call after
    `vllm_available()` said it imports)."""
    caps, unread = detect_code_from(_code_namespace(), _installed_version())
    return dataclasses.replace(caps, scheduler_missing=detect_scheduler_api()), unread


@functools.cache
def detect() -> Capabilities:
    """The capabilities of this run: the installed version's rules (and the declared
    overrides), the installed API. Never the installed code's rules (`profile_check`)."""
    code, _ = detect_code()
    return by_version(code.version, code, vllm_releases.env_overrides())


@functools.cache
def profile_check() -> ProfileCheck:
    """`compare` of this run's rules (`detect`) with the installed code (`detect_code`)."""
    code, unread = detect_code()
    return compare(code.version, detect(), code, unread, vllm_releases.env_overrides())


def clear_caches() -> None:
    """Forget what `detect`, `detect_code` and `profile_check` found (after the installed
    code or the overrides changed, e.g. in a test)."""
    for f in (detect, detect_code, profile_check):
        f.cache_clear()


def detect_sample_caching() -> bool | None:
    """`sample_caching` as the installed code shows it (None: its scheduler does not
    import, or its source cannot be read)."""
    code, unread = detect_code()
    return None if "sample_caching" in unread else code.sample_caching


def profile_lines() -> list[str]:
    """`profile_check().lines()` where vLLM imports, else none (the CLI's summary lines)."""
    from .vllm_env import vllm_available

    return profile_check().lines() if vllm_available()[0] else []


def profile_json() -> dict[str, Any] | None:
    """`profile_check().to_json()` where vLLM imports, else None (the CLI's JSON field)."""
    from .vllm_env import vllm_available

    return profile_check().to_json() if vllm_available()[0] else None
