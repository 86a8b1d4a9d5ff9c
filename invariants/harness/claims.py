"""What a known finding claims: the configurations, operations and message
shapes under which a violation is that finding and nothing else.

A known finding tolerates a violation only when all of these hold:

- the violated property and the target (and, for vLLM, the release) match;
- its `message_pattern` matches the whole message (anchored, so a pattern
  names one direction and one shape of its invariant's messages);
- every **configuration condition** it lists holds of the run's `Config`
  (`CONDITIONS`: group kinds, block-size relations, Eagle, retention);
- the violating operation is of a kind it lists (`OPERATIONS`: a `Finish`
  for a lost promise, a batched `Step` for a same-step copy, ...);
- its **shape**, if it names one, holds of the numbers the pattern captured
  (`SHAPES`: a `BlockStored` that carries *more* token ids than its hashes
  cover, a replay hit that lost exactly one aligned segment, ...);
- for a crash, its **trigger** (`TRIGGERS`, required of every crash finding)
  holds of what happened in the crashing operation: who raised it and in which
  frames (`invariants.harness.crash_site`), the operation and the configuration
  (the Mamba manager ran short while `allocate_slots` admitted external tokens,
  the adapter's check of a transfer's report fired for that report's own
  request, ...). A crash raised by kvretain's own adapter code (origin
  `adapter`) is never a known finding, whatever its message.

A violation that matches a pattern but not the rest of the claim is a new
violation: the claim is what was understood, not a wildcard over an invariant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from invariants.harness.crash_site import ADAPTER, ENGINE, OBSERVED, CrashSite
from model.contract.config import Config
from model.contract.ops import Loaded, Op, Saved

Condition = Callable[[Config], bool]
Shape = Callable[[Mapping[str, str], Config], bool]


def _kinds(cfg: Config, kind: str) -> list[int]:
    return [g.block_size for g in cfg.groups if g.kind == kind]


def _mamba_align(cfg: Config) -> list[int]:
    return [g.block_size for g in cfg.groups if g.kind == "mamba" and g.mamba_cache_mode == "align"]


# name -> (condition, the sentence a report prints for it)
CONDITIONS: dict[str, tuple[Condition, str]] = {
    "caching": (lambda c: c.enable_caching, "prefix caching on"),
    "eagle": (lambda c: c.eagle, "Eagle/MTP on"),
    "no_eagle": (lambda c: not c.eagle, "Eagle/MTP off"),
    "swa": (lambda c: bool(_kinds(c, "swa")), "an SWA group"),
    "mamba_align": (lambda c: bool(_mamba_align(c)), "a Mamba group in align mode"),
    "skipping_group": (
        lambda c: bool(_kinds(c, "swa") or _mamba_align(c)),
        "an SWA or align-mode Mamba group (tables with null entries or masked blocks)",
    ),
    "swa_block_below_alignment": (
        lambda c: any(bs < c.scheduler_block_size for bs in _kinds(c, "swa")),
        "an SWA block smaller than the scheduler block",
    ),
    "swa_block_above_hash_block": (
        lambda c: any(bs > c.hash_block_size for bs in _kinds(c, "swa")),
        "an SWA block wider than the hash block",
    ),
    "mamba_block_above_hash_block": (
        lambda c: any(bs > c.hash_block_size for bs in _mamba_align(c)),
        "an align-mode Mamba block wider than the hash block (fine-grained hits)",
    ),
    "kv_connector": (lambda c: c.kv_connector, "a KV connector"),
    "watermark": (lambda c: int(c.watermark * c.num_blocks) > 0, "a watermark of at least one block"),
    "drafts_span_mamba_block": (
        lambda c: any(c.num_lookahead_tokens >= bs for bs in _mamba_align(c)),
        "spec tokens at least an align-mode Mamba block (a padded admission ends a block past its token)",
    ),
    "one_group": (lambda c: len(c.groups) == 1, "a single KV cache group"),
    "recompute_load_failures": (
        lambda c: c.kv_load_failure_policy == "recompute",
        "kv_load_failure_policy 'recompute' (a load failed on some blocks is recomputed)",
    ),
    "retention_dense": (lambda c: c.effective_retention is None, "dense retention (interval None)"),
    "retention_sparse": (lambda c: c.effective_retention is not None, "sparse retention (interval 0 or k)"),
    "retention_interval": (
        lambda c: (c.effective_retention or 0) > 0,
        "a retention interval k > 0",
    ),
}

# The operation kinds a claim may name; "audit" is a check between operations.
OPERATIONS = frozenset(
    {"add", "schedule", "step", "sample", "finish", "preempt", "probe", "reset", "evict", "audit"}
    | {"loaded", "saved"}  # a KV connector's reports (`model.machine.connector`)
)
_OP_NAMES = {
    "AddRequest": "add",
    "Schedule": "schedule",
    "Step": "step",
    "Sample": "sample",
    "Finish": "finish",
    "Preempt": "preempt",
    "Probe": "probe",
    "ResetPrefixCache": "reset",
    "EvictBlocks": "evict",
}


def operation_kind(op: Op | None) -> str:
    """The claim vocabulary's name for an operation (None: an audit between operations)."""
    return "audit" if op is None else _OP_NAMES.get(type(op).__name__, type(op).__name__.lower())


def _int(groups: Mapping[str, str], name: str) -> int:
    return int(groups[name])


def _token_ids_span_skipped_blocks(g: Mapping[str, str], cfg: Config) -> bool:
    """#44451: the event's token ids cover the whole computed range, skipped
    blocks included, so there are MORE token ids than the stored hashes cover,
    a whole number of blocks; the group is one that skips blocks."""
    group, hashes, bs, tokens = _int(g, "group"), _int(g, "hashes"), _int(g, "bs"), _int(g, "tokens")
    if not 0 <= group < len(cfg.groups):
        return False
    spec = cfg.groups[group]
    skips = spec.kind == "swa" or (spec.kind == "mamba" and spec.mamba_cache_mode == "align")
    return skips and tokens > hashes * bs and tokens % bs == 0


def _one_aligned_segment_lost(g: Mapping[str, str], cfg: Config) -> bool:
    """The Eagle pop and the re-alignment of a short SWA run lose exactly one
    aligned segment, and the promised prefix is shorter than the window of an
    SWA group whose block is smaller than the alignment."""
    hit, promised, sbs = _int(g, "hit"), _int(g, "promised"), cfg.scheduler_block_size
    short = any(
        s.kind == "swa" and s.block_size < sbs and promised < (s.sliding_window or 0) for s in cfg.groups
    )
    return short and hit == promised - sbs


def _aligned_resend_hits_zero(g: Mapping[str, str], cfg: Config) -> bool:
    """The resend of a prompt lands below the extension boundary: it hits 0, and
    the promised boundary is scheduler-block aligned."""
    return _int(g, "hit") == 0 and _int(g, "promised") % cfg.scheduler_block_size == 0


def _full_group_short_of_hit(g: Mapping[str, str], cfg: Config) -> bool:
    """A full-attention group returns fewer blocks than the hit covers (never more)."""
    group, blocks, hit = _int(g, "group"), _int(g, "blocks"), _int(g, "hit")
    if not 0 <= group < len(cfg.groups) or cfg.groups[group].kind != "full":
        return False
    return blocks * cfg.groups[group].block_size < hit


def _window_reaches_null_before_cut(g: Mapping[str, str], cfg: Config) -> bool:
    """A computation resumed at `start` (a load cut at a failed block) in an SWA
    group whose window reaches back into a block it skipped or freed: one wholly
    before the computed range and inside the window of its first token. The block
    is at `index`, or (where the read names no index: a running holder's table still
    names the freed block) the one holding `position`."""
    group, start = _int(g, "group"), _int(g, "start")
    if not 0 <= group < len(cfg.groups) or cfg.groups[group].kind != "swa":
        return False
    spec = cfg.groups[group]
    index = _int(g, "index") if g.get("index") is not None else _int(g, "position") // spec.block_size
    end_of_block = (index + 1) * spec.block_size
    return start - (spec.sliding_window or 0) + 1 < end_of_block <= start


def _need_fills_pool(g: Mapping[str, str], cfg: Config) -> bool:
    """An idle pool refused an admission needing exactly the pool: a count one block
    over what the admission takes (never a larger shortfall)."""
    return _int(g, "need") == _int(g, "pool") == cfg.num_blocks - 1


def _watermark_short_by_mamba_states(g: Mapping[str, str], cfg: Config) -> bool:
    """An admission with external tokens left the watermark short by at most one block
    per align-mode Mamba group (the external state block vLLM's count leaves out)."""
    short = _int(g, "wm") - _int(g, "free")
    return _int(g, "external") > 0 and 0 < short <= len(_mamba_align(cfg))


SHAPES: dict[str, tuple[Shape, tuple[str, ...]]] = {
    "token_ids_span_skipped_blocks": (_token_ids_span_skipped_blocks, ("group", "hashes", "bs", "tokens")),
    "one_aligned_segment_lost": (_one_aligned_segment_lost, ("hit", "promised")),
    "aligned_resend_hits_zero": (_aligned_resend_hits_zero, ("hit", "promised")),
    "full_group_short_of_hit": (_full_group_short_of_hit, ("group", "blocks", "hit")),
    "window_reaches_null_before_cut": (_window_reaches_null_before_cut, ("group", "start", "index")),
    "need_fills_pool": (_need_fills_pool, ("need", "pool")),
    "watermark_short_by_mamba_states": (_watermark_short_by_mamba_states, ("external", "free", "wm")),
}


Trigger = Callable[[CrashSite, Mapping[str, str], Op | None, Config], bool]


def _mamba_short_at_external_admission(
    site: CrashSite, g: Mapping[str, str], op: Op | None, cfg: Config
) -> bool:
    """vllm-mamba-external-state-uncounted: the pool ran short (`BlockPool.get_new_blocks`)
    for the Mamba manager (the innermost manager frame is a `MambaManager`'s), inside an
    `allocate_slots` that admits external (connector) tokens."""
    inner = site.innermost
    if inner is None or not inner.is_method("BlockPool", "get_new_blocks"):
        return False
    manager = site.nearest("SingleTypeKVCacheManager")
    if manager is None or "MambaManager" not in manager.classes:
        return False
    admission = site.enclosing("KVCacheManager", "allocate_slots")
    return admission is not None and (admission.int("num_external_computed_tokens") or 0) > 0


def _swa_fine_grained_assert(site: CrashSite, g: Mapping[str, str], op: Op | None, cfg: Config) -> bool:
    """vllm-swa-fine-grained-mamba-assert: an AssertionError raised by
    `SlidingWindowManager.find_longest_cache_hit` itself (its alignment assertion)."""
    inner = site.innermost
    return (
        site.error == "AssertionError"
        and inner is not None
        and inner.is_method("SlidingWindowManager", "find_longest_cache_hit")
    )


def _freed_during_other_transfer(site: CrashSite, g: Mapping[str, str], op: Op | None, cfg: Config) -> bool:
    """save-during-load-freed-at-first-report: the adapter's check at a transfer's report
    (`Loaded` / `Saved`: the report's dispatch, or the requests a failed load ended) fired
    for the reporting request itself (the one the message names)."""
    inner = site.innermost
    return (
        isinstance(op, (Loaded, Saved))
        and g.get("rid") == op.rid
        and inner is not None
        and inner.qualname.rsplit(".", 1)[-1] in ("dispatch", "ended")
    )


def _placeholders_kept_after_cut(site: CrashSite, g: Mapping[str, str], op: Op | None, cfg: Config) -> bool:
    """async-load-cut-keeps-placeholders: the adapter's placeholder check fired after a load
    report that names failed blocks (only a failed block's cut skips a step output)."""
    inner = site.innermost
    return (
        isinstance(op, Loaded)
        and bool(op.invalid)
        and inner is not None
        and inner.qualname.endswith("._check_placeholders")
    )


# name -> (trigger, the origin it requires, the sentence a report prints for it)
TRIGGERS: dict[str, tuple[Trigger, str, str]] = {
    "mamba_short_at_external_admission": (
        _mamba_short_at_external_admission,
        ENGINE,
        "vLLM raised: the pool ran short for the Mamba manager in an allocate_slots admitting external tokens",
    ),
    "swa_fine_grained_assert": (
        _swa_fine_grained_assert,
        ENGINE,
        "vLLM raised: SlidingWindowManager.find_longest_cache_hit's own assertion",
    ),
    "freed_during_other_transfer": (
        _freed_during_other_transfer,
        OBSERVED,
        "the adapter's check at a transfer's report, for the reporting request",
    ),
    "placeholders_kept_after_cut": (
        _placeholders_kept_after_cut,
        OBSERVED,
        "the adapter's placeholder check after a load report with failed blocks",
    ),
}


@dataclass(frozen=True)
class Precondition:
    """Where a finding is the known defect: configuration conditions, operation
    kinds, and a named shape over the message's captured numbers."""

    conditions: tuple[str, ...]
    operations: frozenset[str]
    shape: str | None = None
    trigger: str | None = None

    def holds(
        self,
        config: Config | None,
        op_kind: str,
        groups: Mapping[str, str],
        op: Op | None = None,
        crash: CrashSite | None = None,
    ) -> bool:
        """Does the claim hold of a violation at an operation of kind `op_kind` (`op`), in a
        run of `config`, whose message captured `groups`, raised at `crash` (a crash's site;
        None for any other violation)? A crash raised by kvretain's adapter never holds."""
        if op_kind not in self.operations:
            return False
        if config is None:  # no configuration to judge: the claim cannot be checked
            return False
        if crash is not None and crash.raised_by == ADAPTER:
            return False  # a gap in kvretain, whatever its message says
        if self.trigger is not None:
            trigger, origin, _ = TRIGGERS[self.trigger]
            if crash is None or crash.raised_by != origin or not trigger(crash, groups, op, config):
                return False
        if not all(CONDITIONS[name][0](config) for name in self.conditions):
            return False
        return self.shape is None or SHAPES[self.shape][0](groups, config)

    def describe(self) -> str:
        parts = [CONDITIONS[name][1] for name in self.conditions]
        parts.append("on " + "/".join(sorted(self.operations)))
        if self.shape is not None:
            parts.append(f"shape {self.shape}")
        if self.trigger is not None:
            parts.append(f"trigger: {TRIGGERS[self.trigger][2]}")
        return "; ".join(parts)


__all__ = ["CONDITIONS", "OPERATIONS", "SHAPES", "TRIGGERS", "Precondition", "operation_kind"]
