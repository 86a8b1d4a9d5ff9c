"""`kvretain export` of SGLang findings: the file imports only SGLang, fails with the defect,
passes without it; its replay kit drives SGLang exactly as the target does.

Skipped, with the reason, when SGLang cannot be imported.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from invariants.targets.sglang_env import sglang_available

_OK, _REASON = sglang_available()
if not _OK:
    pytest.skip(f"sglang export: {_REASON}", allow_module_level=True)

from invariants.cli.main import main  # noqa: E402
from invariants.export import sglang_preamble as kit  # noqa: E402
from invariants.harness.radix_fuzz import fuzz_layout, generate_ops, write_trace  # noqa: E402
from invariants.targets.sglang_drive import SglangDriver  # noqa: E402
from invariants.targets.sglang_snapshot import pool_accounts  # noqa: E402
from invariants.zoo.mutants_sglang import SGLANG_MUTANTS, activate  # noqa: E402
from model.radix.config import LAYOUTS  # noqa: E402
from model.radix.ops import to_json  # noqa: E402

_STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def _export(name: str, tmp_path: Path) -> Path:
    """Hunt mutant `name`, write its (shrunk) trace and export it; the exported file's path."""
    mutant = SGLANG_MUTANTS[name]
    with activate(name):
        run = fuzz_layout(
            mutant.layout,
            LAYOUTS[mutant.layout],
            20.0,
            0,
            cores=("python",),
            shrink_s=8.0,
            identities=mutant.identities,
        )
        assert run.violation is not None, name
        trace = tmp_path / f"{name}.json"
        write_trace(run, LAYOUTS[mutant.layout], trace)
        out = tmp_path / f"test_{name}.py"
        assert main(["export", str(trace), "--out", str(out)]) == 0
    return out


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"exported_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_test(module: ModuleType) -> BaseException | None:
    (test,) = [getattr(module, n) for n in dir(module) if n.startswith("test_")]
    try:
        test()
    except BaseException as exc:  # noqa: BLE001 - the outcome is what is inspected
        return exc
    return None


def _imported_roots(source: str) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    return roots


# A state invariant (checked after every op), a literal of the specification (hit), the
# event replay, and isolation (requests with adapters / salts): the shapes of exported test.
@pytest.mark.parametrize(
    "name",
    [
        "mamba_slot_leaked_on_abort",
        "swa_window_off_by_one",
        "block_removed_not_emitted",
        "namespace_dropped_on_chunk_insert",
    ],
)
def test_export_fails_with_the_mutant_and_passes_without(name: str, tmp_path: Path) -> None:
    path = _export(name, tmp_path)
    source = path.read_text()
    assert _imported_roots(source) - _STDLIB == {"sglang", "torch"}
    module = _load(path)
    with activate(name):
        failed = _run_test(module)
    assert isinstance(failed, AssertionError) and not isinstance(failed, module.SetupDiverged), failed
    assert _run_test(module) is None


def test_exported_file_runs_alone_without_kvretain(tmp_path: Path) -> None:
    """A fresh interpreter whose path cannot see kvretain (the repo and its editable install
    hidden) runs the exported file to a pass on unmutated SGLang."""
    path = _export("block_removed_not_emitted", tmp_path)
    guard = tmp_path / "sitecustomize.py"
    guard.write_text(
        "import sys\n"
        "class _NoKvretain:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('invariants', 'model', 'reference_impl'):\n"
        "            raise ImportError('kvretain is hidden from the exported test: ' + name)\n"
        "sys.meta_path.insert(0, _NoKvretain())\n"
    )
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_replay_kit_drives_sglang_as_the_target_does(name: str) -> None:
    """Same history, same results and pool accounts op by op: the kit and the target agree."""
    layout = LAYOUTS[name]
    ops = generate_ops(7, layout, 50)
    driver = SglangDriver(layout, "python")
    fields = json.loads(json.dumps({k: getattr(layout, k) for k in kit_layout_fields()}))
    replay = kit.Replay(fields, "python")
    for i, op in enumerate(ops):
        want = driver.apply(op)
        got = replay.apply(to_json(op))
        assert got.get("hit") == want.hit and ("rejected" in got) == (want.rejected is not None), (i, op)
        assert bool(got.get("skipped")) == want.skipped, (i, op)
        assert tuple(got["evicted"]) == want.evicted if "evicted" in got else want.evicted is None
        mine = {
            a.pool: (a.available, a.evictable, a.protected, a.held, a.size) for a in pool_accounts(driver)
        }
        assert replay.accounts() == mine, (i, op)


def kit_layout_fields() -> tuple[str, ...]:
    return (
        "components",
        "page_size",
        "sliding_window",
        "kv_size",
        "swa_size",
        "mamba_size",
        "max_reqs",
        "max_context",
    )


def test_trace_without_violation_exits_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from invariants.harness.radix_fuzz import LayoutRun

    layout = LAYOUTS["full-p1"]
    trace = tmp_path / "clean.json"
    write_trace(LayoutRun(layout="full-p1", trace=generate_ops(0, layout, 5)), layout, trace)
    out = tmp_path / "t.py"
    assert main(["export", str(trace), "--out", str(out)]) == 2
    assert capsys.readouterr().out.count("\n") <= 1 and not out.exists()
