"""`kvretain export` of real-scheduler findings: drafts, async scheduling, KV connectors.

Each 0.33.0 finding recorded on vLLM's real scheduler is exported as a file that
replays the target's recorded calls (`invariants.export.engine_record`) with a fake
connector written into it, and ends with one assertion: on 0.33.0 it fails there, and
under a plausible fix of vLLM (a monkeypatch here: `FIXES`) it passes. The checked-in
files under docs/findings/ are exactly what the exporter writes today.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import importlib.util
import itertools
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from invariants.export.engine_file import needs_engine_file
from invariants.export.plan import plan_export
from invariants.export.pytest_file import exported_test_name, render_test
from invariants.harness.known_findings import load_known_findings
from invariants.targets.vllm_env import vllm_available

ROOT = Path(__file__).resolve().parent.parent
ENGINE = {
    f.id: f
    for f in load_known_findings()
    if "0.33.0" in f.versions
    and (f.trace.target or "").startswith("vllm")
    and f.trace.target != "vllm-manager"
}
_counter = itertools.count()


def _vllm_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


on_found_vllm = pytest.mark.skipif(
    not vllm_available()[0] or _vllm_version() != "0.33.0",
    reason="the recorded calls and the findings are vLLM 0.33.0's",
)


def load_exported(source: str, tmp_path: Path) -> Callable[[], None]:
    path = tmp_path / f"engine_exported_{next(_counter)}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (test,) = [getattr(module, n) for n in dir(module) if n.startswith("test_")]
    return test  # type: ignore[no-any-return]


# ------------------------------------------------------------------ plausible fixes of vLLM
def fix_placeholders_reset(mp: pytest.MonkeyPatch) -> None:
    """#45146: a request the failed blocks cut drops its output placeholders."""
    from vllm.v1.core.sched.scheduler import Scheduler

    orig = Scheduler._handle_invalid_blocks

    def handle(self: Any, invalid: set[int], scheduled: dict[str, int]) -> set[str]:
        affected = orig(self, invalid, scheduled)
        for rid in affected:
            if rid in self.requests:
                self.requests[rid].num_output_placeholders = 0
        return affected

    mp.setattr(Scheduler, "_handle_invalid_blocks", handle)


def fix_one_free_per_deferral(mp: pytest.MonkeyPatch) -> None:
    """A finished request whose load and save are both in flight is freed by the last
    report (#46240's direction): the load's report leaves a saving request to the save's."""
    from vllm.v1.core.sched.scheduler import Scheduler

    saving: set[str] = set()
    finished = Scheduler._connector_finished
    xfer = Scheduler._update_from_kv_xfer_finished

    def connector_finished(self: Any, request: Any) -> Any:
        result = finished(self, request)
        if result[0]:
            saving.add(request.request_id)
        return result

    def update(self: Any, out: Any) -> None:
        recv = set(out.finished_recving or ())
        held = {r for r in recv if r in saving and r in self.requests and self.requests[r].is_finished()}
        saving.difference_update(out.finished_sending or ())
        xfer(self, dataclasses.replace(out, finished_recving=recv - held) if held else out)

    mp.setattr(Scheduler, "_connector_finished", connector_finished)
    mp.setattr(Scheduler, "_update_from_kv_xfer_finished", update)


def fix_failed_blocks_recomputed(mp: pytest.MonkeyPatch) -> None:
    """Under 'recompute' a failed block is recomputed before anyone reads it: its hash
    leaves the prefix cache, and every request that computed past it is cut there."""
    from vllm.v1.core.sched.scheduler import Scheduler

    orig = Scheduler._handle_invalid_blocks

    def handle(self: Any, invalid: set[int], scheduled: dict[str, int]) -> set[str]:
        affected = orig(self, invalid, scheduled)
        self.kv_cache_manager.evict_blocks(set(invalid))
        size = self.block_size
        for req in self.running:
            (ids,) = self.kv_cache_manager.get_block_ids(req.request_id)
            bad = [i for i, b in enumerate(ids[: -(-req.num_computed_tokens // size)]) if b in invalid]
            if bad:
                req.num_computed_tokens = min(req.num_computed_tokens, bad[0] * size)
        return affected

    mp.setattr(Scheduler, "_handle_invalid_blocks", handle)


def fix_rollback_leaves_inflight(mp: pytest.MonkeyPatch) -> None:
    """A failed async load that keeps nothing leaves the in-flight prefills with its blocks."""
    from vllm.v1.core.sched.scheduler import Scheduler

    orig = Scheduler._update_waiting_for_remote_kv

    def update(self: Any, request: Any) -> None:
        failed = request.request_id in self.failed_recving_kv_req_ids
        orig(self, request)
        if failed and not request.num_computed_tokens:
            self._inflight_prefills.discard(request)

    mp.setattr(Scheduler, "_update_waiting_for_remote_kv", update)


def fix_mamba_external_state_counted(mp: pytest.MonkeyPatch) -> None:
    """PR #46892: a sync load's external tokens take their own Mamba state block; count it."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    orig = MambaManager.get_num_blocks_to_allocate

    def count(
        self: Any, request_id: str, num_tokens: int, new_computed: Any, total: int, *a: Any, **k: Any
    ) -> int:
        n = orig(self, request_id, num_tokens, new_computed, total, *a, **k)
        main = k.get("num_tokens_main_model", a[1] if len(a) > 1 else num_tokens)
        external = total > len(new_computed) * self.block_size
        if (
            self.mamba_cache_mode == "align"
            and external
            and main > total
            and n <= self.block_pool.num_gpu_blocks
        ):
            n += 1
        return int(n)

    mp.setattr(MambaManager, "get_num_blocks_to_allocate", count)


FIXES: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str]] = {
    "async-load-cut-keeps-placeholders": (fix_placeholders_reset, "keeps 1 output placeholder"),
    "save-during-load-freed-at-first-report": (fix_one_free_per_deferral, "freed at its load's report"),
    "sync-load-failed-block-hash-kept": (fix_failed_blocks_recomputed, "r1 resumes at 12, reading block 2"),
    "sync-load-failed-block-read-before-recompute": (
        fix_failed_blocks_recomputed,
        "r1 resumes at 12, reading block 2",
    ),
    "failed-load-rollback-reserves-against-itself": (
        fix_rollback_leaves_inflight,
        "r0 needs 19 blocks and is refused by an idle pool of 27",
    ),
    "vllm-mamba-external-state-uncounted": (
        fix_mamba_external_state_counted,
        "the scheduler raised on a well-formed call: ValueError: Cannot get 1 free blocks",
    ),
    "vllm-mamba-external-state-uncounted-watermark": (
        fix_mamba_external_state_counted,
        r"left 0 free block\(s\), below the watermark's 1",
    ),
}
# Exported and failing on their property, without a fix written here yet (each named).
UNFIXED = {
    "vllm-mamba-external-state-overcounted": "r0 needs 4 blocks and is refused by an idle pool of 4",
    "swa-load-cut-reads-skipped-window": "block index 0 of group 0 through its window: it is the null block",
    "vllm-mamba-padded-admission-null-state": "column 1 of its worker table \\(group 1\\): the null block",
}


def test_every_engine_finding_is_exported_with_a_fix_or_named() -> None:
    assert set(FIXES) | set(UNFIXED) == set(ENGINE) and not set(FIXES) & set(UNFIXED)
    for fid in ENGINE:
        path = ROOT / "docs" / "findings" / f"test_{fid.replace('-', '_')}.py"
        assert path.exists(), f"{fid}: no exported test at {path}"


@on_found_vllm
@pytest.mark.parametrize("fid", sorted(ENGINE))
def test_checked_in_engine_export_is_current(fid: str) -> None:
    plan = plan_export(ENGINE[fid].trace)
    assert needs_engine_file(plan)
    path = ROOT / "docs" / "findings" / f"{exported_test_name(plan)}.py"
    assert path.read_text() == render_test(plan), f"re-export {fid}: kvretain export TRACE --out {path}"


@pytest.mark.parametrize("fid", sorted(ENGINE))
def test_engine_export_imports_only_vllm_torch_pytest(fid: str) -> None:
    path = ROOT / "docs" / "findings" / f"test_{fid.replace('-', '_')}.py"
    tops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            tops.add(node.module.split(".")[0])
    stdlib = {"dataclasses", "json", "os", "sys", "tempfile", "time", "types"}
    assert tops - stdlib <= {"vllm", "torch"}, tops


@on_found_vllm
@pytest.mark.parametrize("fid", sorted(FIXES))
def test_engine_finding_fails_on_vllm_then_passes_fixed(
    fid: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = ROOT / "docs" / "findings" / f"test_{fid.replace('-', '_')}.py"
    test = load_exported(path.read_text(), tmp_path)
    fix, message = FIXES[fid]
    with pytest.raises(AssertionError, match=message):
        test()
    fix(monkeypatch)
    test()  # the property holds once the defect is fixed


@on_found_vllm
@pytest.mark.parametrize("fid", sorted(UNFIXED))
def test_unfixed_engine_finding_fails_on_its_property(fid: str, tmp_path: Path) -> None:
    path = ROOT / "docs" / "findings" / f"test_{fid.replace('-', '_')}.py"
    with pytest.raises(AssertionError, match=UNFIXED[fid]):
        load_exported(path.read_text(), tmp_path)()


@on_found_vllm
def test_engine_setup_divergence_raises_setup_diverged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control of the setup checks: a vLLM whose schedule() schedules one token less for a
    request fails a setup step with the file's SetupDiverged (not the property's
    AssertionError), naming the step."""
    from vllm.v1.core.sched.scheduler import Scheduler

    path = ROOT / "docs" / "findings" / "test_sync_load_failed_block_read_before_recompute.py"
    test = load_exported(path.read_text(), tmp_path)
    diverged = test.__globals__["SetupDiverged"]
    assert not issubclass(diverged, AssertionError)
    orig = Scheduler.schedule

    def schedule(self: Any) -> Any:
        self.max_num_scheduled_tokens -= 1
        return orig(self)

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    with pytest.raises(diverged, match=r"op 3: tokens scheduled: vLLM gives \{'r0': 1, 'r1': 6\}"):
        test()
