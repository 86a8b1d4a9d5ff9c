"""The SGLang target: SGLang 0.5.23's real UnifiedRadixCache, pools and scheduler functions.

Every layout (full, full+SWA, full+Mamba; page 1 and 4) is built on both tree
cores and driven through a seeded history with every check on; the cores must
agree op by op. Negative controls plant real defects in the real objects
(a leaked slot, a double free, a corrupted lock count, cores that disagree)
and the checker must report each. Skipped, with the reason, when SGLang
cannot be imported.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

from invariants.targets.sglang_env import sglang_available

_OK, _REASON = sglang_available()
if not _OK:
    pytest.skip(f"sglang target: {_REASON}", allow_module_level=True)

from invariants.cli import sglang as cli_sglang  # noqa: E402
from invariants.cli.main import main  # noqa: E402
from invariants.harness.radix_check import RadixChecker  # noqa: E402
from invariants.harness.radix_fuzz import LayoutRun, generate_ops, read_trace, run_history, write_trace  # noqa: E402
from invariants.targets.sglang_drive import OpResult, SglangDriver  # noqa: E402
from invariants.targets.sglang_standins import STANDIN_ROOTS, install_standins  # noqa: E402
from model.radix.config import LAYOUTS  # noqa: E402
from model.radix.ops import Admit, Decode, Finish  # noqa: E402


def test_standins_are_in_process_only() -> None:
    replaced = install_standins()
    assert replaced <= set(STANDIN_ROOTS)
    for root in replaced:
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(root)  # nothing was installed
        if root in sys.modules:  # imported by SGLang: it is the stand-in
            assert "kvretain stand-in" in (sys.modules[root].__doc__ or "")
    if "torchvision" in replaced:
        assert "kvretain stand-in" in (sys.modules["torchvision"].__doc__ or "")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_clean_on_both_cores(name: str) -> None:
    checker = RadixChecker(LAYOUTS[name])
    violation, _ = run_history(checker, generate_ops(0, LAYOUTS[name], 60))
    assert violation is None, violation
    assert checker.coverage["hit"] > 0
    names = {type(d.cache.tree_core).__name__ for d in checker.drivers.values()}
    assert names == {"UnifiedTreeCore", "RustUnifiedTreeCore"}


def test_chunked_prefill_then_replay_hits_the_cached_prefix() -> None:
    driver = SglangDriver(LAYOUTS["full-p4"], "python")
    tokens = tuple(range(1, 22))
    driver.apply(Admit(0, tokens, 8))
    assert driver.apply(Finish(0)).hit is None  # still prefilling: an abort, nothing cached
    driver.apply(Admit(1, tokens, len(tokens)))
    driver.apply(Finish(1))
    assert driver.apply(Admit(2, tokens, len(tokens))).hit == 20  # (21 - 1) floored to pages of 4


def test_decode_allocates_the_last_sampled_tokens_slot_as_the_scheduler_does() -> None:
    """The prefill samples the first token (no slot); each decode step allocates the slot of
    the last sampled token (SGLang's alloc_for_decode_default) after sliding the SWA window
    from the second step on (ScheduleBatch.maybe_evict_swa)."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    driver = SglangDriver(LAYOUTS["swa-p1"], "python")
    driver.apply(Admit(0, tuple(range(1, 21)), 20))
    kv = driver.running[0].req.kv
    driver.apply(Decode(0, (7,)))
    assert (kv.kv_allocated_len, kv.get_evicted_seqlen(ComponentType.SWA)) == (20, 0)
    driver.apply(Decode(0, (8,)))  # first decode step: one slot, no window slid yet
    assert (kv.kv_allocated_len, kv.get_evicted_seqlen(ComponentType.SWA)) == (21, 0)
    driver.apply(Decode(0, (9, 10)))
    assert kv.kv_allocated_len == 23 and len(driver.running[0].req.output_ids) == 4
    assert kv.get_evicted_seqlen(ComponentType.SWA) > 0  # the window slid
    driver.apply(Finish(0))
    # Cached: the prompt and the decoded tokens whose KV was written (not the last sample).
    assert driver.apply(Admit(1, tuple(range(1, 21)) + (7, 8, 9, 10), 24)).hit == 23


def test_control_leaked_slot_breaks_conservation() -> None:
    checker = RadixChecker(LAYOUTS["full-p1"], ("python",))
    checker.step(Admit(0, (1, 2, 3), 3))
    checker.primary.parts.allocator.alloc(2)  # taken and never accounted for
    found = checker.step(Finish(0))
    assert any(name == "radix_pool_conservation" for name, _ in found)


def test_control_double_free_breaks_disjointness() -> None:
    checker = RadixChecker(LAYOUTS["full-p1"], ("python",))
    checker.step(Admit(0, (1, 2, 3, 4), 4))
    checker.step(Finish(0))
    cached = checker.primary.cache.all_values_flatten()[:1]
    checker.primary.parts.allocator.free(cached)  # a cached slot freed behind the tree's back
    found = checker.step(Admit(1, (9, 9), 2))
    assert any(name == "radix_slots_disjoint" for name, _ in found)


def test_control_corrupt_lock_fails_sglang_sanity_check() -> None:
    checker = RadixChecker(LAYOUTS["full-p1"], ("python",))
    checker.step(Admit(0, (1, 2, 3, 4), 4))
    checker.step(Finish(0))
    node = next(iter(checker.primary.cache.tree_core.root_node.children.values()))
    node.component_data[0].lock_ref = -1
    found = checker.step(Admit(1, (7,), 1))
    assert any(name == "sglang_sanity_check" for name, _ in found)


def test_control_cores_that_disagree_are_reported() -> None:
    checker = RadixChecker(LAYOUTS["full-p1"])
    accounts = {c: [] for c in checker.cores}
    same = checker.cores_agree(
        Admit(0, (1,), 1), {"python": OpResult(hit=3), "rust": OpResult(hit=3)}, accounts
    )
    differ = checker.cores_agree(
        Admit(0, (1,), 1), {"python": OpResult(hit=3), "rust": OpResult(hit=2)}, accounts
    )
    assert same == [] and differ and differ[0][0] == "radixcores_agree"


def test_trace_round_trip(tmp_path: Path) -> None:
    layout = LAYOUTS["swa-p4"]
    ops = generate_ops(3, layout, 10)
    run = LayoutRun(layout="swa-p4", seed=3, trace=ops, violation=("x", "y"))
    write_trace(run, layout, tmp_path / "t.json")
    assert read_trace(tmp_path / "t.json") == (layout, ops)


def test_cli_fuzz_zoo_bench(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the zoo's shrunk traces: this test's own, not the checkout's
    assert main(["fuzz", "--target", "sglang", "--budget-s", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("clean") == len(LAYOUTS)
    assert main(["zoo", "--target", "sglang", "--only", "lock_not_taken", "--budget-s", "5"]) == 0
    assert "1/1 SGLang mutants killed" in capsys.readouterr().out
    assert main(["zoo", "--target", "sglang", "--only", "nope"]) == 2
    assert capsys.readouterr().out.count("\n") == 1
    assert main(["bench", "--target", "sglang", "--requests", "20"]) == 0
    assert "checked/raw" in capsys.readouterr().out


def test_verify_row_passes_and_skips_with_its_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    verdict, detail, rc = cli_sglang.verify_row(2.0, 0, tmp_path)
    assert (verdict, rc) == ("pass", 0) and "clean" in detail
    monkeypatch.setattr("invariants.targets.sglang_env.sglang_available", lambda: (False, "no sglang here"))
    assert cli_sglang.verify_row(2.0, 0, tmp_path) == ("skipped", "no sglang here", 0)


def test_replay_of_a_mutant_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from invariants.harness.radix_fuzz import fuzz_layout
    from invariants.zoo.mutants_sglang import activate

    layout = LAYOUTS["full-p1"]
    with activate("lock_not_taken"):
        run = fuzz_layout("full-p1", layout, 5.0, 0, cores=("python",))
    assert run.violation is not None
    path = tmp_path / "trace.json"
    write_trace(run, layout, path)
    assert main(["replay", str(path)]) == 0  # the real SGLang is clean on it
    with activate("lock_not_taken"):
        assert main(["replay", str(path)]) == 1
    assert "radix_locked_paths_kept" in capsys.readouterr().out


def test_shrunk_trace_still_fails_and_is_shorter() -> None:
    from invariants.harness.radix_fuzz import fuzz_layout
    from invariants.zoo.mutants_sglang import activate

    layout = LAYOUTS["full-p1"]
    with activate("block_removed_not_emitted"):
        raw = fuzz_layout("full-p1", layout, 5.0, 0, cores=("python",))
        small = fuzz_layout("full-p1", layout, 5.0, 0, cores=("python",), shrink_s=10.0)
        assert raw.violation is not None and small.violation is not None
        assert small.violation[0] == raw.violation[0] == "radix_events_replay"
        assert len(small.trace) < len(raw.trace)
        assert run_history(RadixChecker(layout, ("python",)), small.trace)[0] is not None


def test_control_mamba_double_free() -> None:
    import torch

    checker = RadixChecker(LAYOUTS["mamba-p1"], ("python",))
    checker.step(Admit(0, (1, 2, 3, 4), 4))
    checker.step(Finish(0))
    mamba = checker.primary.parts.req_to_token_pool.mamba_allocator
    cached = checker.primary.cache.all_mamba_values_flatten()[:1]
    mamba.free(cached.clone())  # a cached state's slot freed behind the tree's back
    found = checker.step(Admit(1, (9, 9), 2))
    assert any(name == "radix_slots_disjoint" and "mamba" in msg for name, msg in found)
    checker = RadixChecker(LAYOUTS["mamba-p1"], ("python",))
    mamba = checker.primary.parts.req_to_token_pool.mamba_allocator
    mamba.free(torch.tensor([int(mamba.free_slots[-1])]))  # a free slot freed again
    found = checker.step(Admit(0, (9, 9), 2))
    assert any(name == "radix_free_list_unique" for name, _ in found)


def test_cli_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the clean run's example database: this test's own
    for argv in (
        ["fuzz", "--target", "sglang", "--config", "nope"],
        ["fuzz", "--target", "sglang", "--scale", "production"],
        ["fuzz", "--target", "sglang", "--steps", "10"],
    ):
        assert main(argv) == 2, argv
        out = capsys.readouterr().out
        assert out.count("\n") == 1, out
    assert main(["fuzz", "--target", "sglang", "--config", "full-p1", "--budget-s", "1"]) == 0
    assert "full-p1" in capsys.readouterr().out


def test_the_standins_leave_other_libraries_working() -> None:
    """verify runs SGLang's rows and the simulator's plots in one process: matplotlib
    probes `IPython.get_ipython()` on its first figure, and must hear "not a notebook"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ipython = sys.modules.get("IPython")
    if (
        ipython is not None
        and "IPython" in STANDIN_ROOTS
        and getattr(ipython, "__doc__", "").startswith("kvretain")
    ):
        assert ipython.get_ipython() is None
    fig, _ = plt.subplots()
    plt.close(fig)
