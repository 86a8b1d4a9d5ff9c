"""Every field of vLLM's KV events is compared with the model's, or excluded by name.

The field lists come from vLLM's own event classes (`vllm.distributed.kv_events`,
msgspec structs): a field or an event class a new vLLM adds fails
`test_every_vllm_event_field_is_translated_or_excluded` until the adapter
translates it (`vllm_hashing.STORED_FIELDS` / `REMOVED_FIELDS`) or `kvretain
conformance` excludes it (an `EXCLUDED` entry starting "KV event field" that
names it as `Class.field`). Negative controls: vLLM's `take_events` altered in
one field at a time; the checker must report the difference. The model's and
the reference's events carry the same fields without vLLM.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from invariants.harness.checker import DEFAULT_AUDIT_EVERY, Checker, Violation
from invariants.harness.conformance import EXCLUDED
from invariants.targets.reference import ReferenceTarget
from invariants.targets.vllm_env import vllm_available
from model.contract.config import Config, GroupSpec
from model.contract.observation import BlockRemoved, BlockStored, Event, Snapshot, diff_snapshots
from model.contract.ops import AddRequest, EvictBlocks, Finish, Op, Sample, Schedule
from model.contract.prefix import prefix
from model.machine.allocator import AllocatorModel

_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")

HYBRID = Config(
    (GroupSpec("full", 16), GroupSpec("swa", 16, sliding_window=32), GroupSpec("mamba", 16)),
    num_blocks=64,
    retention_interval=0,
)
SPECS = {0: ("full_attention", None), 1: ("sliding_window", 32), 2: ("mamba", None)}
PROMPT = tuple(range(1, 101))
# The model's names for the fields vLLM names otherwise (the rest keep vLLM's names).
RENAMED = {
    "BlockStored": {
        "group_idx": "group",
        "block_hashes": "block_hashes",
        "parent_block_hash": "parent",
        "token_ids": "token_ids",
        "block_size": "block_size",
    },
    "BlockRemoved": {"group_idx": "group", "block_hashes": "block_hash"},
}


def _excluded_event_fields() -> set[str]:
    """`Class.field` names that `kvretain conformance` excludes from the event comparison."""
    out: set[str] = set()
    for what, _why in EXCLUDED:
        if what.startswith("KV event field"):
            out |= {
                f"{c}.{f}"
                for c, f in re.findall(r"\b(BlockStored|BlockRemoved|AllBlocksCleared)\.(\w+)", what)
            }
    return out


def _trace(model: AllocatorModel) -> Iterator[Op]:
    """Two requests over one prompt (chunks, samples, a hit), then an eviction of
    every block: stored events in every group and removed ones. `model` is the
    checker's, read to know when a request needs a sample."""
    for rid, prompt in (("A", PROMPT), ("B", PROMPT + (7,) * 20)):
        yield AddRequest(rid, prompt)
        req = model.requests[rid]
        while not (req.running and req.num_computed >= len(prompt) + 8):
            if req.running and req.num_computed == req.num_tokens:
                yield Sample(rid, 500 + req.num_tokens)
            else:
                yield Schedule(rid, 32)
        yield Finish(rid)
    yield EvictBlocks(tuple(range(1, HYBRID.num_blocks)))


def _check(target: Any, audit_every: int = 1) -> tuple[list[Violation], list[Event]]:
    """Run `_trace` under the checker (differential checks only): the violations, and
    with `audit_every` 1 (whole snapshots) every event the target emitted."""
    seen: list[Event] = []
    checker = Checker(target, check_invariants=False, audit_every=audit_every)
    found: list[Violation] = []
    for op in _trace(checker.model):
        found += checker.step(op)
        seen += checker.last.events if checker.audit_every == 1 else ()
    return found, seen


# ----------------------------------------------------------------------------- field coverage
@needs_vllm
@pytest.mark.vllm
def test_every_vllm_event_field_is_translated_or_excluded() -> None:
    import vllm.distributed.kv_events as kv

    from invariants.targets.vllm_hashing import REMOVED_FIELDS, STORED_FIELDS

    translated = {
        "BlockStored": set(STORED_FIELDS),
        "BlockRemoved": set(REMOVED_FIELDS),
        "AllBlocksCleared": set(),
    }
    excluded = _excluded_event_fields()
    classes = {
        name: cls
        for name, cls in vars(kv).items()
        if isinstance(cls, type) and issubclass(cls, kv.KVCacheEvent) and cls is not kv.KVCacheEvent
    }
    assert set(classes) == set(translated), f"vLLM's KV event classes changed: {sorted(classes)}"
    for name, cls in classes.items():
        fields = set(cls.__struct_fields__)
        named = {f for f in fields if f"{name}.{f}" in excluded}
        assert not named & translated[name], (
            f"{name}: both translated and excluded: {named & translated[name]}"
        )
        left = fields - translated[name] - named
        assert not left, f"{name}: fields neither translated nor excluded: {sorted(left)}"
        assert translated[name] <= fields, (
            f"{name}: translated fields vLLM lacks: {translated[name] - fields}"
        )


@needs_vllm
@pytest.mark.vllm
def test_the_model_events_carry_every_translated_field() -> None:
    from invariants.targets.vllm_hashing import REMOVED_FIELDS, STORED_FIELDS

    for cls, names in ((BlockStored, STORED_FIELDS), (BlockRemoved, REMOVED_FIELDS)):
        model_fields = {f.name for f in dataclasses.fields(cls)}
        wanted = {RENAMED[cls.__name__].get(n, n) for n in names}
        assert wanted == model_fields, f"{cls.__name__}: {wanted ^ model_fields}"


@needs_vllm
@pytest.mark.vllm
def test_vllm_0_33_0_leaves_no_event_field_uncompared() -> None:
    from invariants.targets.vllm_target import VllmManagerTarget

    assert VllmManagerTarget(HYBRID).uncompared_event_fields == ()


# ----------------------------------------------------------------------------- agreement
def _metadata(events: list[Event]) -> set[tuple[Any, ...]]:
    return {
        (
            e.group,
            e.kv_cache_spec_kind,
            e.kv_cache_spec_sliding_window,
            e.medium,
            e.extra_keys == (None,) * len(e.block_hashes),
        )
        for e in events
        if isinstance(e, BlockStored) and e.block_hashes
    }


def _expected_metadata() -> set[tuple[Any, ...]]:
    return {(g, kind, window, "GPU", True) for g, (kind, window) in SPECS.items()}


@needs_vllm
@pytest.mark.vllm
def test_vllm_events_agree_with_the_model_field_by_field() -> None:
    """Not vacuous: vLLM's events carry each group's kind and window, the GPU medium
    and one empty extra key per hash, and the model predicts the same."""
    from invariants.targets.vllm_target import VllmManagerTarget

    found, seen = _check(VllmManagerTarget(HYBRID))
    assert not found, [str(v) for v in found[:5]]
    assert _metadata(seen) == _expected_metadata()
    removed = [e for e in seen if isinstance(e, BlockRemoved)]
    assert removed and all(e.medium == "GPU" for e in removed)
    found, _ = _check(VllmManagerTarget(HYBRID), DEFAULT_AUDIT_EVERY)  # the fast path (partial states) too
    assert not found, [str(v) for v in found[:5]]


def test_model_and_reference_events_carry_the_spec_fields() -> None:
    """The reference adapter fills the fields `reference_impl` does not carry from the
    reference's own group config; the checker compares them with the model's."""
    cfg = dataclasses.replace(HYBRID, groups=HYBRID.groups[:2], retention_interval=None)
    found, seen = _check(ReferenceTarget(cfg))
    assert not found, [str(v) for v in found[:5]]
    assert _metadata(seen) == {m for m in _expected_metadata() if m[0] < 2}


def test_an_event_difference_names_the_field() -> None:
    ev = BlockStored(1, (prefix((1, 2)),), None, (1, 2), 2, "sliding_window", 32, (None,))
    bad = dataclasses.replace(ev, kv_cache_spec_sliding_window=33)
    snap = Snapshot((), (), (0,), frozenset(), {}, {}, {}, (ev,))
    (line,) = diff_snapshots(snap, dataclasses.replace(snap, events=(bad,)))
    assert line.startswith("events: event 0 (BlockStored) kv_cache_spec_sliding_window: expected 32, got 33;")
    assert "kv_cache_spec_sliding_window=33" in repr(bad) and "medium" not in repr(bad)  # defaults omitted


# ----------------------------------------------------------------------------- negative controls
def _off_by_one_window(ev: Any) -> None:
    if ev.kv_cache_spec_sliding_window is not None:
        ev.kv_cache_spec_sliding_window += 1


# field -> (event class, how to break it); every translated field beyond the hashes, tokens and sizes.
BREAK: dict[str, tuple[str, Callable[[Any], None]]] = {
    "kv_cache_spec_kind": ("BlockStored", lambda ev: setattr(ev, "kv_cache_spec_kind", "unknown")),
    "kv_cache_spec_sliding_window": ("BlockStored", _off_by_one_window),
    "extra_keys": ("BlockStored", lambda ev: setattr(ev, "extra_keys", None)),
    "medium": ("BlockStored", lambda ev: setattr(ev, "medium", "CPU")),
    "lora_id": ("BlockStored", lambda ev: setattr(ev, "lora_id", 1)),
    "lora_name": ("BlockStored", lambda ev: setattr(ev, "lora_name", "adapter")),
    "lookahead_token_ids": (
        "BlockStored",
        lambda ev: setattr(ev, "lookahead_token_ids", [[0] for _ in ev.block_hashes]),
    ),
    "session_id": ("BlockStored", lambda ev: setattr(ev, "session_id", "s")),
    "locality": ("BlockStored", lambda ev: setattr(ev, "locality", "REMOTE")),
    "ownership": ("BlockStored", lambda ev: setattr(ev, "ownership", "o")),
    "removed medium": ("BlockRemoved", lambda ev: setattr(ev, "medium", "CPU")),
    "removed locality": ("BlockRemoved", lambda ev: setattr(ev, "locality", "REMOTE")),
    "removed ownership": ("BlockRemoved", lambda ev: setattr(ev, "ownership", "o")),
}


def _break_take_events(monkeypatch: pytest.MonkeyPatch, kind: str, edit: Callable[[Any], None]) -> None:
    """vLLM's `KVCacheManager.take_events` hands out its events with one field altered."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    original = KVCacheManager.take_events

    def take_events(self: Any) -> list[Any]:
        events: list[Any] = original(self)
        for ev in events:
            if type(ev).__name__ == kind and ev.block_hashes:
                edit(ev)
        return events

    monkeypatch.setattr(KVCacheManager, "take_events", take_events)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("field", sorted(BREAK))
def test_a_wrong_event_field_is_reported(monkeypatch: pytest.MonkeyPatch, field: str) -> None:
    from invariants.targets.vllm_hashing import REMOVED_FIELDS, STORED_FIELDS
    from invariants.targets.vllm_target import VllmManagerTarget

    assert {f for f in STORED_FIELDS[5:]} | {f"removed {f}" for f in REMOVED_FIELDS[2:]} == set(BREAK)
    kind, edit = BREAK[field]
    _break_take_events(monkeypatch, kind, edit)
    for audit_every in (1, DEFAULT_AUDIT_EVERY):  # whole snapshots, then the fast path
        found, _ = _check(VllmManagerTarget(HYBRID), audit_every)
        events = [v for v in found if v.check == "snapshot" and v.message.startswith(("events", "before"))]
        assert events, f"{field} (audit_every={audit_every}): not reported: {[str(v) for v in found[:3]]}"
        if audit_every == 1:
            assert field.removeprefix("removed ") in events[0].message


# ----------------------------------------------------------------------------- older releases
@needs_vllm
@pytest.mark.vllm
def test_a_field_a_release_lacks_takes_the_model_value_and_is_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release without `kv_cache_spec_kind`, `lookahead_token_ids` (BlockStored) and
    `locality` (BlockRemoved): the adapter never reads them (here they are garbage),
    the checker sees the model's values, and the target lists them as uncompared."""
    from invariants.targets import vllm_hashing
    from invariants.targets.vllm_target import VllmManagerTarget

    lacks = {"kv_cache_spec_kind", "lookahead_token_ids"}
    _break_take_events(monkeypatch, "BlockStored", BREAK["kv_cache_spec_kind"][1])
    _break_take_events(monkeypatch, "BlockRemoved", BREAK["removed locality"][1])
    original = vllm_hashing.struct_fields
    monkeypatch.setattr(
        vllm_hashing,
        "struct_fields",
        lambda cls: original(cls) - {"locality"} if cls.__name__ == "BlockRemoved" else original(cls),
    )
    target = VllmManagerTarget(HYBRID)
    target.caps = dataclasses.replace(target.caps, event_fields=target.caps.event_fields - lacks)
    assert target.uncompared_event_fields == (
        "BlockRemoved.locality",
        "BlockStored.kv_cache_spec_kind",
        "BlockStored.lookahead_token_ids",
    )
    found, seen = _check(target)
    assert not found, [str(v) for v in found[:5]]
    assert _metadata(seen) == _expected_metadata()
