"""Isolation (`invariants.catalogue.isolation`): planted defects in vLLM's extra keys, each
found by its invariant on a short trace (with the clean trace as its control) and by
`run_fuzz("vllm")` within a budget; each invariant's own negative control."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from invariants.catalogue.isolation import RouterIndex  # noqa: E402
from model.contract.extra_keys import Identity, MMItem, keyed  # noqa: E402
from model.contract.observation import BlockStored  # noqa: E402
from model.contract.ops import AddRequest, Finish, Op, Schedule  # noqa: E402

ISOLATION = {"hit_written_by_same_identity", "events_carry_block_keys", "router_sees_target_hits"}


# -- planted defects in vLLM 0.33.0's key functions -----------------------------------


def _mm_keys(keys: tuple[Any, ...] | None) -> list[Any]:
    return [k for k in keys or () if k[0] == "mm"]


def _salt_ignored_with_mm(real: Callable[..., Any]) -> Callable[..., Any]:
    def keys(request: Any, start: int, end: int, mm_idx: int) -> Any:
        out, idx = real(request, start, end, mm_idx)
        if request.mm_features and out:
            out = tuple(k for k in out if k[0] != "cache_salt") or None
        return out, idx

    return keys


def _lora_first_block_only(real: Callable[..., Any]) -> Callable[..., Any]:
    def keys(request: Any, start: int, end: int, mm_idx: int) -> Any:
        out, idx = real(request, start, end, mm_idx)
        if start > 0 and out:
            out = tuple(k for k in out if k[0] != "lora") or None
        return out, idx

    return keys


def _mm_on_next_block(real: Callable[..., Any]) -> Callable[..., Any]:
    def keys(request: Any, start: int, end: int, mm_idx: int) -> Any:
        out, idx = real(request, start, end, mm_idx)
        width = end - start
        # An item's key leaves the block it starts in and lands on the next one.
        kept = [k for k in out or () if not (k[0] == "mm" and k[2] >= 0)]
        if start >= width:
            before, _ = real(request, start - width, start, 0)
            kept += [("mm", k[1], k[2] - width) for k in _mm_keys(before) if k[2] >= 0]
        return tuple(kept) or None, idx

    return keys


def _shifted_event_keys(real: Callable[..., Any]) -> Callable[..., Any]:
    def event_keys(extra_keys: Any) -> Any:
        out = real(extra_keys)
        return None if out is None else [None, *out[:-1]]

    return event_keys


PLANTS: dict[str, tuple[str, Callable[..., Any], set[str]]] = {
    # name -> (the function replaced, in vllm.v1.core.kv_cache_utils and where block_pool imported it; checks)
    "salt_ignored_with_mm": (
        "generate_block_hash_extra_keys",
        _salt_ignored_with_mm,
        {"hit_written_by_same_identity", "events_carry_block_keys"},
    ),
    # The chain carries the first block's key on, so no hit crosses adapters: the events show it.
    "lora_first_block_only": (
        "generate_block_hash_extra_keys",
        _lora_first_block_only,
        {"events_carry_block_keys"},
    ),
    "mm_key_on_next_block": (
        "generate_block_hash_extra_keys",
        _mm_on_next_block,
        {"hit_written_by_same_identity", "events_carry_block_keys"},
    ),
    "event_keys_shifted": ("to_event_extra_keys", _shifted_event_keys, {"events_carry_block_keys"}),
}


@contextlib.contextmanager
def plant(name: str) -> Iterator[None]:
    from vllm.v1.core import block_pool, kv_cache_utils

    fn, wrap, _ = PLANTS[name]
    real = getattr(kv_cache_utils, fn)
    mods = [m for m in (kv_cache_utils, block_pool) if getattr(m, fn, None) is real]
    bad = wrap(real)
    try:
        for m in mods:
            setattr(m, fn, bad)
        yield
    finally:
        for m in mods:
            setattr(m, fn, real)


# Requests whose identities differ only where each defect lies: the same 18 tokens.
P = tuple(range(1, 19))
TRACES: dict[str, list[dict[str, Any]]] = {
    "salt_ignored_with_mm": [{"mm": (("img", 1, 2),)}, {"mm": (("img", 1, 2),), "salt": "t"}],
    "lora_first_block_only": [{"lora": ("x", 1, "/x")}, {"lora": ("y", 2, "/y")}],
    "mm_key_on_next_block": [{"mm": (("img", 5, 2),)}, {}],
    "event_keys_shifted": [{"salt": "t"}],
}


def _trace(name: str) -> list[Op]:
    ops: list[Op] = []
    for i, kw in enumerate(TRACES[name]):
        rid = f"r{i}"
        ops += [AddRequest(rid, P, **kw), Schedule(rid, 64), Finish(rid)]
    return ops


def _found(name: str, planted: bool) -> set[str]:
    from drive import Drive

    from invariants.layouts.presets import PRESETS
    from invariants.targets.vllm_target import VllmManagerTarget

    cfg = replace(PRESETS["gemma-tiny"], groups=PRESETS["gemma-tiny"].groups[:1], num_blocks=24)
    d = Drive(cfg, VllmManagerTarget, known="vllm-manager")
    with plant(name) if planted else contextlib.nullcontext():
        d.do(*_trace(name))
    return {v.check for v in d.audited()}


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_planted_key_defect_is_caught_by_its_isolation_invariant(name: str) -> None:
    """On a trace of two requests with the same tokens (one for the events' defect), each
    planted defect is reported by the isolation invariant that guards it; control: the
    same trace on vLLM as it is is clean."""
    assert _found(name, planted=False) == set()
    assert _found(name, planted=True) & PLANTS[name][2]


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_planted_key_defect_is_found_by_fuzzing(name: str, tmp_path: Path) -> None:
    """`kvretain fuzz --target vllm` finds each planted defect by its isolation invariant
    within its budget (30 s: identities are drawn among a few tenants, adapters and images,
    so the same tokens meet under another identity within a few examples). Every other
    violation is tolerated here (the model's differential reports a plant too, and this
    test is about the model-independent judges). Control: the failing trace replayed on
    vLLM as it is breaks no isolation invariant."""
    from invariants.harness.checker import Checker
    from invariants.harness.fuzz import run_fuzz
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    with plant(name):
        report = run_fuzz(
            "vllm",
            budget_s=30,
            seed=1,
            out_dir=tmp_path,
            progress=False,
            tolerated=lambda v: None if v.check in ISOLATION else v.check,
        )
    failure = report.failure
    assert failure is not None, f"{name}: not found in {report.stats.steps} steps"
    assert {v.check for v in failure.violations} & PLANTS[name][2], failure
    checker = Checker(VllmSchedulerTarget(failure.config))
    clean = [v for op in failure.ops for v in checker.step(op) if v.check in ISOLATION]
    assert clean == [], clean


# The isolation invariants' negative controls: tests/test_invariant_controls.py (by name).


def test_a_router_keys_blocks_by_their_extra_keys() -> None:
    """Two tenants' blocks of the same tokens are two router keys (and a request of a
    third identity routes to neither)."""
    router = RouterIndex()
    toks = tuple(range(8))
    for identity in (Identity(salt="a"), Identity(salt="b")):
        kt = keyed(toks, identity)
        from model.contract.extra_keys import event_keys
        from model.contract.prefix import prefix

        router.apply(
            [
                BlockStored(
                    0,
                    (prefix(kt, 4), prefix(kt, 8)),
                    None,
                    toks,
                    4,
                    extra_keys=(event_keys(identity, 0, 4), event_keys(identity, 4, 8)),
                )
            ]
        )
    assert len(router.held[0]) == 4
    assert router.key(None, toks[:4], ("a",)) != router.key(None, toks[:4], ("b",))
    assert router.key(None, toks[:4], None) is None
    assert MMItem("x", 0, 1).end == 1


@pytest.mark.vllm
@pytest.mark.parametrize("name", [None, *sorted(PLANTS)])
def test_a_planted_key_defect_is_found_by_explore(name: str | None) -> None:
    """`explore` of the instance full-p6-tenants (each prompt also under two tenants, an
    adapter pair, an image and a tenant with an image) to depth 2 finds each planted
    defect within its first states; the clean control searches the whole depth (about 10 s);
    control (None): vLLM as it is, clean to the same depth."""
    from invariants.explore.instances import TENANTS, grid_by_name
    from invariants.explore.search import Limits, explore
    from invariants.targets.vllm_target import VllmManagerTarget

    inst = grid_by_name([TENANTS])[0]
    with plant(name) if name else contextlib.nullcontext():
        cert = explore(inst, VllmManagerTarget, "vllm-manager", Limits(2))
    assert (cert.violation is not None) == (name is not None), (name, cert.violation, cert.states)


# -- export: identity traces become standalone vLLM tests ------------------------------


def _identity_trace(name: str) -> Any:
    """The planted defect's trace, cut at the first isolation violation vLLM (planted) shows
    on it (the differential snapshot check, on the events' keys, reports earlier)."""
    from invariants.harness.replay import replay
    from invariants.harness.trace import Trace
    from invariants.layouts.presets import PRESETS

    cfg = replace(PRESETS["gemma-tiny"], groups=PRESETS["gemma-tiny"].groups[:1], num_blocks=24)
    trace = Trace(cfg, _trace(name), seed=0, target="vllm-manager")
    with plant(name):
        result = replay(trace, "vllm-manager", stop_at_first=False)
    found = [(i, v) for i, v in result.violations if str(v).startswith("hit_written_by_same_identity")]
    assert found, f"{name}: the trace does not show the defect"
    i, v = found[0]
    trace.ops = trace.ops[: i + 1]
    trace.violation = str(v)
    return trace


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["salt_ignored_with_mm", "mm_key_on_next_block"])
def test_an_identity_finding_exports_and_fails_on_its_defect(name: str, tmp_path: Path) -> None:
    """The exported file passes the trace's cache_salt / LoRARequest / multimodal features
    to vLLM: it compiles, passes on vLLM as it is (control) and fails on the planted defect
    (a hit across identities the specification does not give)."""
    from test_export import load_exported

    from invariants.export.plan import plan_export
    from invariants.export.pytest_file import render_test

    trace = _identity_trace(name)
    assert trace.violation.startswith("hit_written_by_same_identity"), trace.violation
    source = render_test(plan_export(trace))
    compile(source, "exported.py", "exec")
    assert "identity(" in source and "MultiModalFeatureSpec" in source
    test = load_exported(source, tmp_path)
    test()  # vLLM as it is keeps the requests apart
    with plant(name), pytest.raises(AssertionError):
        test()


@pytest.mark.vllm
def test_a_salted_scheduler_trace_exports_with_its_identity(tmp_path: Path) -> None:
    """A vllm (real scheduler) trace with a salt and an adapter exports with them; one with
    multimodal items is refused in one line (the file cannot state an encoder budget)."""
    from invariants.export.plan import ExportError, plan_export
    from invariants.export.pytest_file import render_test
    from invariants.harness.trace import Trace
    from model.contract.config import Config, GroupSpec
    from model.contract.ops import Step

    cfg = Config(groups=(GroupSpec("full", 4),), num_blocks=8)
    ops: list[Op] = [AddRequest("r0", tuple(range(1, 10)), salt="t", lora=("x", 1, "/x")), Step(("r0",), 16)]
    source = render_test(plan_export(Trace(cfg, ops, 0, "vllm", "snapshot: (a planted violation)")))
    compile(source, "exported.py", "exec")
    assert "driver.add('r0', list(range(1, 10)), **identity(cache_salt='t', lora=('x', 1, '/x')))" in source
    mm: list[Op] = [AddRequest("r0", tuple(range(1, 10)), mm=(("img", 0, 2),)), Step(("r0",), 16)]
    with pytest.raises(ExportError, match=r"trace.ops\[0\]: multimodal items"):
        render_test(plan_export(Trace(cfg, mm, 0, "vllm", "snapshot: (a planted violation)")))


def test_a_request_identity_is_exported_with_it() -> None:
    """A trace whose request carries an identity (cache salt, LoRA, multimodal) plans and
    renders with the identity passed to vLLM's Request (it used to be refused: the file
    would replay it plain and hit where the specification misses). Control: the same
    trace without the salt renders the plain file, without the identity helper."""
    from invariants.export.plan import plan_export
    from invariants.export.pytest_file import render_test
    from invariants.harness.trace import Trace
    from model.contract.config import Config, GroupSpec

    cfg = Config(groups=(GroupSpec("full", 4),), num_blocks=8)
    ops: list[Op] = [
        AddRequest("r0", tuple(range(1, 10)), salt="tenant-a", lora=("x", 1, "/x"), mm=(("img", 2, 3),)),
        Schedule("r0", 16),
    ]
    trace = Trace(cfg, ops, 0, "vllm-manager", "snapshot: (a planted violation)")
    source = render_test(plan_export(trace))
    compile(source, "exported.py", "exec")
    assert (
        "make_request(\"r0\", list(range(1, 10)), **identity(cache_salt='tenant-a', lora=('x', 1, '/x'), "
        "mm=[('img', 2, 3)]))" in source
    )
    plain = Trace(
        cfg, [AddRequest("r0", tuple(range(1, 10))), Schedule("r0", 16)], 0, "vllm-manager", trace.violation
    )
    plain_source = render_test(plan_export(plain))
    assert "def identity(" not in plain_source and "LoRARequest" not in plain_source


def test_a_router_look_ahead_leaves_the_index_as_it_was() -> None:
    """`stored_keys` with an overlay (what `router_sees_target_hits` reads of an
    operation's pending stores) gives the keys applying the events would, reads its own
    earlier names first (a chain split over two events), and leaves the index's names
    and orphan count as they were; control: without the overlay the index learns them."""
    from model.contract.prefix import prefix

    toks = tuple(range(8))
    first = BlockStored(0, (prefix(toks, 4),), None, toks[:4], 4)
    second = BlockStored(0, (prefix(toks, 8),), prefix(toks, 4), toks[4:], 4)
    orphan = BlockStored(0, (prefix((9, 9, 9, 9, 9, 9, 9, 9), 8),), prefix((9, 9, 9, 9), 4), (9,) * 4, 4)
    router, applied = RouterIndex(), RouterIndex()
    overlay: dict[Any, int] = {}
    ahead = [k for ev in (first, second, orphan) for k in router.stored_keys(ev, overlay)]
    assert router.key_of == {} and router.orphans == 0 and len(overlay) == 2
    applied.apply([first, second, orphan])
    assert ahead == [(0, k) for k in applied.key_of.values()] and applied.orphans == 1
    assert [k for ev in (first, second) for k in router.stored_keys(ev)] == ahead  # control
    assert len(router.key_of) == 2
