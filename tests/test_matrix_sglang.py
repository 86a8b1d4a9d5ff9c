"""The SGLang release matrix: capabilities from a release's code, the classes and aspects
of a disagreement, the command line, and (where SGLang 0.5.20's environment is prepared)
the legacy adapter's checks and one matrix run.

Capability derivation is pure (facts in, capabilities out), so each capability is
tested on synthetic facts with the variant that lacks it as its control. Tests that
need a release environment are skipped with the reason when it is absent; prepare it
with `python -m invariants.targets.sglang_release_env 0.5.20`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from invariants.matrix.sglang_classify import aspect, classify
from invariants.matrix.sglang_runner import parse_releases
from invariants.targets.sglang_capabilities import (
    API_CACHE_UNFINISHED,
    API_CHECKPOINT,
    HOOK_CHECKPOINTED,
    HOOK_INSERTED,
    WINDOW_CACHE,
    WINDOW_COMMON,
    Facts,
    derive,
    release_hook,
)
from invariants.targets.sglang_release_env import release_env_vars, release_python
from model.radix.config import LAYOUTS

ROOT = Path(__file__).resolve().parents[1]

V20 = Facts(
    version="0.5.20",
    modules=frozenset({"unified", "legacy_swa", "legacy_mamba"}),
    common_functions=frozenset({"maybe_cache_unfinished_req", "release_kv_cache"}),
    release_params=frozenset({"req", "tree_cache", "is_insert"}),
    release_hook=None,
    window_eviction=WINDOW_COMMON,
    paged_cpu=False,
)
V23 = Facts(
    version="0.5.23",
    modules=frozenset({"unified"}),
    common_functions=frozenset({"checkpoint_kv_cache", "release_kv_cache"}),
    release_params=frozenset({"req", "tree_cache", "checkpoint"}),
    release_hook=HOOK_CHECKPOINTED,
    window_eviction=WINDOW_CACHE,
    paged_cpu=True,
)


def test_0520_facts_give_both_families_on_the_old_scheduler_api() -> None:
    caps = derive(V20)
    assert caps.scheduler_api == API_CACHE_UNFINISHED
    assert caps.families() == ("unified", "legacy")
    assert caps.serves("legacy", LAYOUTS["swa-p1"]) is None
    assert caps.serves("legacy", LAYOUTS["mamba-p1"]) is None
    assert "no legacy cache" in (caps.serves("legacy", LAYOUTS["swa-mamba-p1"]) or "")
    assert "no legacy cache" in (caps.serves("legacy", LAYOUTS["full-p1"]) or "")
    assert "no CPU path" in (caps.serves("unified", LAYOUTS["swa-p4"]) or "")


def test_0523_facts_give_the_unified_cache_on_the_checkpoint_api() -> None:
    caps = derive(V23)
    assert caps.scheduler_api == API_CHECKPOINT
    assert caps.families() == ("unified",)
    assert caps.serves("unified", LAYOUTS["swa-p4"]) is None
    assert "not driven" in (caps.serves("legacy", LAYOUTS["swa-p1"]) or "")


def test_each_capability_is_read_from_the_facts() -> None:
    # Control per capability: the same facts without it.
    no_legacy = derive(dataclasses.replace(V20, modules=frozenset({"unified"})))
    assert no_legacy.families() == ("unified",)
    only_swa = derive(dataclasses.replace(V20, modules=frozenset({"unified", "legacy_swa"})))
    assert only_swa.serves("legacy", LAYOUTS["swa-p1"]) is None
    assert only_swa.serves("legacy", LAYOUTS["mamba-p1"]) is not None
    paged = derive(dataclasses.replace(V20, paged_cpu=True))
    assert paged.serves("legacy", LAYOUTS["swa-p4"]) is None
    # The old calls with 0.5.22's hook keyword: neither driver fits.
    hook_mismatch = derive(dataclasses.replace(V20, release_hook=HOOK_CHECKPOINTED))
    assert hook_mismatch.scheduler_api is None and hook_mismatch.families() == ()
    no_checkpoint_param = derive(dataclasses.replace(V23, release_params=frozenset({"req", "is_insert"})))
    assert no_checkpoint_param.scheduler_api is None


def test_classes() -> None:
    assert (
        classify("sglang_raised", "AttributeError: 'Req' object has no attribute 'x'", "legacy").kind
        == "adapter"
    )
    assert classify("sglang_raised", "RuntimeError: 0 active drivers ([])", "unified").kind == "adapter"
    assert classify("sglang_raised", "AssertionError: dec_lock_ref on node", "legacy").kind == "defect"
    assert classify("radix_hit_matches_model", "hit 3 != 4", "legacy").kind == "semantics"
    assert classify("radix_pool_conservation", "[legacy] swa: ...", "legacy").kind == "defect"
    assert classify("radixcores_agree", "Admit: python ... != rust ...", "unified").kind == "defect"


def test_aspects_name_what_differs() -> None:
    evict = "Evict: python (None, (15, 15, 0), True, False) != legacy (None, (20, 20, 0), True, False)"
    assert aspect("Evict", evict) == "Evict: eviction amount (full/swa)"
    hit = "Admit: python (4, None, True, False) != legacy (7, None, True, False)"
    assert aspect("Admit", hit) == "Admit: hit length"
    refused = "Admit: python (4, None, True, False) != legacy (4, None, False, False)"
    assert aspect("Admit", refused) == "Admit: admission (one cache refused)"
    pools = (
        "pools after Admit: python [('full', 8, 25, 10), ('mamba', 10, 1, 2)] != "
        "legacy [('full', 33, 0, 10), ('mamba', 10, 1, 2)]"
    )
    assert aspect("Admit", pools) == "Admit: full available, full evictable"


def test_release_parsing() -> None:
    assert parse_releases("0.5.23, 0.5.20,0.5.20") == ["0.5.20", "0.5.23"]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "invariants.cli.main", "matrix", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (("--engine", "tgi"), "--engine"),
        (("--engine", "sglang", "--releases", "0.5.19"), "0.5.19"),
        (("--engine", "sglang", "--releases", "latest"), "--releases"),
        (("--engine", "sglang", "--budget-s", "-1"), "--budget-s"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, args: tuple[str, ...], names: str) -> None:
    out = tmp_path / "m.json"
    proc = _cli(*args, "--json", str(out))
    assert proc.returncode == 2, proc.stderr
    assert names in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists() and proc.stdout == ""


def test_default_engine_is_vllm() -> None:
    # vLLM's own version rule answers (an SGLang release is a valid version string for it).
    proc = _cli("--releases", "latest")
    assert proc.returncode == 2 and "like 0.21.0" in proc.stderr


_PY20 = release_python("0.5.20")
needs_0520 = pytest.mark.skipif(
    _PY20 is None,
    reason="SGLang 0.5.20's environment is not prepared (python -m invariants.targets.sglang_release_env 0.5.20)",
)

_PLANTED = """
import json, sys
from invariants.targets.sglang_env import sglang_available
assert sglang_available()[0]
from invariants.harness.radix_check import RadixChecker
from invariants.harness.radix_fuzz import generate_ops, run_history
from invariants.targets.sglang_legacy import LegacyDriver
from invariants.targets.sglang_legacy_snapshot import LegacyReader
from model.radix.config import LAYOUTS

def run(leak):
    found = []
    for seed in range(3):
        ch = RadixChecker(LAYOUTS["swa-p1"], ("legacy",), make_driver=LegacyDriver, reader=LegacyReader)
        if leak:  # planted defect: the legacy cache forgets to give SWA slots back
            ch.primary.parts.allocator.free_swa_segment = lambda *a, **k: None
        v, _ = run_history(ch, generate_ops(seed, LAYOUTS["swa-p1"], 60))
        found.append(None if v is None else v[0] + ": " + v[1][:200])
    return found

print(json.dumps({"clean": run(False), "leak": run(True)}))
"""


@needs_0520
def test_legacy_adapter_is_clean_and_catches_a_planted_swa_leak() -> None:
    proc = subprocess.run(
        [str(_PY20), "-c", _PLANTED],
        capture_output=True,
        text=True,
        env=release_env_vars("0.5.20", dict(os.environ, PYTHONPATH=str(ROOT))),
        timeout=300,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["clean"] == [None, None, None]
    assert any(v and v.startswith("radix_pool_conservation") for v in result["leak"]), result


@pytest.mark.slow
@needs_0520
def test_matrix_on_0520_reports_both_families_and_their_differences(tmp_path: Path) -> None:
    js, md = tmp_path / "m.json", tmp_path / "m.md"
    proc = _cli(
        "--engine",
        "sglang",
        "--releases",
        "0.5.20",
        "--budget-s",
        "10",
        "--json",
        str(js),
        "--markdown",
        str(md),
        "--out",
        str(tmp_path / "traces"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    (release,) = json.loads(js.read_text())["releases"]
    assert release["error"] is None
    assert release["capabilities"]["families"] == ["unified", "legacy"]
    families = {(r["family"], r["layout"]) for r in release["fuzz"]}
    assert ("legacy", "swa-p1") in families and ("legacy", "mamba-p1") in families
    diff = {r["layout"]: r for r in release["legacy_vs_unified"]}
    assert set(diff) >= {"swa-p1", "mamba-p1"} and all(r["seeds"] >= 1 for r in diff.values())
    assert "Legacy vs unified" in md.read_text()


# -- 0.5.21 and 0.5.22 ---------------------------------------------------------------

V21 = dataclasses.replace(
    V20,
    version="0.5.21",
    modules=frozenset({"unified"}),
    release_hook=HOOK_INSERTED,
    window_eviction=WINDOW_CACHE,
)
V22 = dataclasses.replace(V23, version="0.5.22")


def test_0521_facts_give_the_unified_cache_on_the_old_calls_with_its_release_hook() -> None:
    caps = derive(V21)
    assert caps.scheduler_api == API_CACHE_UNFINISHED and caps.families() == ("unified",)
    assert caps.release_hook == HOOK_INSERTED and caps.window_eviction == WINDOW_CACHE
    assert "no CPU path" in (caps.serves("unified", LAYOUTS["swa-p4"]) or "")
    # Control: the same calls with 0.5.22's hook keyword are driven by neither driver.
    assert derive(dataclasses.replace(V21, release_hook=HOOK_CHECKPOINTED)).scheduler_api is None


def test_0522_facts_give_the_checkpoint_api_only_with_its_hook_keyword() -> None:
    caps = derive(V22)
    assert caps.scheduler_api == API_CHECKPOINT and caps.families() == ("unified",)
    # Controls: the checkpoint driver calls on_release(checkpointed=); another keyword
    # or no hook at all leaves the release undriven.
    assert derive(dataclasses.replace(V22, release_hook=HOOK_INSERTED)).scheduler_api is None
    assert derive(dataclasses.replace(V22, release_hook=None)).scheduler_api is None


def _consensus(fn):  # like SGLang's rank_consensus: a functools.wraps wrapper
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def test_release_hook_is_read_from_the_keyword_of_on_release() -> None:
    class Hook21:
        @_consensus
        def on_release(self, req, *, inserted: bool) -> None: ...

    class Hook23:
        def on_release(self, req, *, checkpointed: bool) -> None: ...

    class Positional:  # control: a hook without a keyword-only parameter names none
        def on_release(self, req, inserted) -> None: ...

    class NoHook:  # control: 0.5.20's cache has no hook
        pass

    assert release_hook(Hook21) == HOOK_INSERTED
    assert release_hook(Hook23) == HOOK_CHECKPOINTED
    assert release_hook(Positional) is None
    assert release_hook(NoHook) is None


def _in_release(version: str, script: str) -> dict:
    python = release_python(version)
    assert python is not None
    proc = subprocess.run(
        [str(python), "-c", script],
        capture_output=True,
        text=True,
        env=release_env_vars(version, dict(os.environ, PYTHONPATH=str(ROOT))),
        timeout=300,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    assert lines, proc.stderr[-2000:]
    return json.loads(lines[-1])


needs_0521 = pytest.mark.skipif(
    release_python("0.5.21") is None,
    reason="SGLang 0.5.21's environment is not prepared (python -m invariants.targets.sglang_release_env 0.5.21)",
)
needs_0522 = pytest.mark.skipif(
    release_python("0.5.22") is None,
    reason="SGLang 0.5.22's environment is not prepared (python -m invariants.targets.sglang_release_env 0.5.22)",
)

_V21_SWITCH = """
import json, warnings
warnings.simplefilter("ignore")
from invariants.targets.sglang_env import sglang_available
assert sglang_available()[0]
from invariants.harness.radix_check import RadixChecker
from invariants.harness.radix_fuzz import generate_ops, run_history
from invariants.targets.sglang_capabilities import WINDOW_COMMON, detect
from invariants.targets.sglang_legacy import LegacyDriver
from invariants.targets.sglang_legacy_snapshot import LegacyReader
from model.radix.config import LAYOUTS

def run(plant):
    found = []
    for seed in range(2):
        ch = RadixChecker(LAYOUTS["swa-p1"], ("python",), make_driver=LegacyDriver, reader=LegacyReader)
        if plant == "leak":  # planted defect: SWA slots freed by a window slide never come back
            ch.primary.parts.allocator.free_swa_segment = lambda *a, **k: None
        if plant == "old_window":  # control of the switch: 0.5.20's window path on 0.5.21
            ch.primary._window = WINDOW_COMMON
        try:
            v, _ = run_history(ch, generate_ops(seed, LAYOUTS["swa-p1"], 60))
        except Exception as exc:
            v = ("raised", type(exc).__name__)
        found.append(None if v is None else v[0] + ": " + v[1][:200])
    return found

caps = detect()
print(json.dumps({"caps": caps.to_json(), "clean": run(None), "leak": run("leak"), "old": run("old_window")}))
"""


@needs_0521
def test_0521_is_driven_by_the_old_calls_and_the_window_switch() -> None:
    result = _in_release("0.5.21", _V21_SWITCH)
    assert result["caps"]["scheduler_api"] == API_CACHE_UNFINISHED
    assert result["caps"]["release_hook"] == HOOK_INSERTED
    assert result["caps"]["window_eviction"] == WINDOW_CACHE
    assert result["clean"] == [None, None]
    assert any(v and v.startswith("radix_pool_conservation") for v in result["leak"]), result
    # 0.5.20's window path does not fit 0.5.21 (its request has no swa_evicted_seqlen field).
    assert all(v is not None for v in result["old"]), result


_V22_FINDING = """
import json, warnings
warnings.simplefilter("ignore")
from invariants.targets.sglang_env import sglang_available
assert sglang_available()[0]
from invariants.harness.radix_check import RadixChecker
from invariants.harness.radix_fuzz import generate_ops, run_history
from model.radix.config import LAYOUTS

layout = LAYOUTS["swa-small-p1"]
ops = generate_ops(18, layout, 60)
def run(n):
    try:
        v, done = run_history(RadixChecker(layout, ("python",)), ops[:n])
    except Exception as exc:
        return {"raised": type(exc).__name__}
    return {"found": None if v is None else list(v), "ops": len(done), "last": type(done[-1]).__name__}
print(json.dumps({"before": run(52), "with_finish": run(53)}))
"""


@needs_0522
def test_0522_finish_after_a_window_slide_trips_checkpoint_into_tree() -> None:
    """The 0.5.22 finding of docs/matrix-sglang-report.md: swa-small-p1, seed 0+18, op 52
    `Finish(rid=17)` (a request whose SWA window slid while decoding, inserted over a
    tombstoned prefix) raises in `UnifiedRadixCache.checkpoint_into_tree`. Control: the
    same history up to the op before it is clean."""
    result = _in_release("0.5.22", _V22_FINDING)
    assert result["before"]["found"] is None and result["before"]["ops"] == 52
    found = result["with_finish"]["found"]
    assert found is not None and found[0] == "sglang_raised", result
    assert "new_prefix_len=4, len(new_indices)=0" in found[1]
    assert result["with_finish"]["last"] == "Finish"


class _RaisesAtThirdOp:
    """A checker whose cache raises on the third op (as 0.5.22's checkpoint_into_tree does)."""

    def __init__(self) -> None:
        self.checked_ops = 0
        self.coverage: dict[str, int] = {}

    def step(self, op: object) -> None:
        if self.checked_ops == 2:
            raise AssertionError("new_prefix_len=4, len(new_indices)=0")
        self.checked_ops += 1


def test_a_raising_op_is_the_last_op_of_the_written_trace(tmp_path: Path, monkeypatch) -> None:
    from invariants.harness.radix_fuzz import generate_ops, read_trace
    from invariants.matrix import sglang_worker

    monkeypatch.setattr(sglang_worker, "_checker", lambda *a, **k: _RaisesAtThirdOp())
    caps = derive(V22)
    row = sglang_worker.fuzz_family(caps, "unified", "full-p1", 0.0, 5, tmp_path)
    assert row["verdict"] == "defect" and row["check"] == "sglang_raised"
    _, ops = read_trace(Path(row["trace"]))
    # The replayable trace ends with the op SGLang raised on, not the one before it.
    assert ops == generate_ops(5, LAYOUTS["full-p1"], sglang_worker.OPS_PER_SEED)[:3]
