"""The opt-in mypyc build (`invariants.compiled`, `make compiled`): chosen only when it exists, matches
the sources and is not opted out of; the suite itself runs pure Python; a real build gives the same
certificates as pure Python (slow: it compiles)."""

from __future__ import annotations

import importlib.machinery
import json
import os
from pathlib import Path

import pytest

import invariants
import model.contract.eagle
from invariants import compiled
from invariants.compiled import MANIFEST_NAME, PURE_ENV, choose, source_hash
from invariants.native.build import COMPILED, EXCLUDED

ROOT = Path(__file__).resolve().parent.parent
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
RUNTIME = "abc__mypyc"


def fake_build(tmp_path: Path, modules: tuple[str, ...] = ("model.contract.eagle",)) -> tuple[Path, Path]:
    """A build directory whose manifest matches a copy of the sources (its extensions empty
    files: `choose` reads, never loads), and that copy's root."""
    root, build = tmp_path / "src", tmp_path / "build"
    for m in modules:
        src = root.joinpath(*m.split(".")).with_suffix(".py")
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_bytes(ROOT.joinpath(*m.split(".")).with_suffix(".py").read_bytes())
        ext = build.joinpath(*m.split(".")[:-1], m.split(".")[-1] + SUFFIX)
        ext.parent.mkdir(parents=True, exist_ok=True)
        ext.write_bytes(b"")
    (build / f"{RUNTIME}{SUFFIX}").write_bytes(b"")
    manifest = {"modules": {m: source_hash(m, root) for m in modules}, "runtime": RUNTIME, "suffix": SUFFIX}
    (build / MANIFEST_NAME).write_text(json.dumps(manifest))
    return build, root


def test_the_suite_runs_pure_python() -> None:
    if os.environ.get(PURE_ENV) == "0":
        pytest.skip(f"{PURE_ENV}=0: the suite was asked to run the compiled build")
    assert os.environ.get(PURE_ENV) not in (None, "")
    assert compiled.state().modules == ()
    assert "is set" in compiled.state().line()
    assert model.contract.eagle.__file__ is not None and model.contract.eagle.__file__.endswith(".py")
    assert "compiled" in invariants.LEAVES and "native" in invariants.ROOMS


def test_a_matching_build_is_chosen(tmp_path: Path) -> None:
    build, root = fake_build(tmp_path)
    state, warning = choose(build, root, honour_env=False)
    assert state.modules == ("model.contract.eagle",) and warning is None
    assert state.line().startswith("compiled (mypyc")


def test_control_a_changed_source_makes_the_build_stale(tmp_path: Path) -> None:
    build, root = fake_build(tmp_path)
    src = root / "model" / "contract" / "eagle.py"
    src.write_text(src.read_text() + "\n# edited\n")
    state, warning = choose(build, root, honour_env=False)
    assert state.modules == ()
    assert warning is not None and "stale" in warning and "model.contract.eagle" in warning
    assert "pure Python runs" in warning


def test_a_changed_type_input_makes_the_build_stale(tmp_path: Path) -> None:
    build, root = fake_build(tmp_path, ("model.contract.eagle", "model.contract.mamba"))
    manifest = json.loads((build / MANIFEST_NAME).read_text())
    manifest["inputs"] = {"model.contract.mamba": manifest["modules"].pop("model.contract.mamba")}
    (build / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert choose(build, root, honour_env=False)[0].modules == ("model.contract.eagle",)
    (root / "model" / "contract" / "mamba.py").write_text("# changed\n")
    state, warning = choose(build, root, honour_env=False)
    assert state.modules == () and warning is not None and "stale" in warning


def test_opting_out_runs_pure_python_whatever_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build, root = fake_build(tmp_path)
    monkeypatch.setenv(PURE_ENV, "1")
    state, warning = choose(build, root)
    assert state.modules == () and warning is None and PURE_ENV in state.why
    # Control: "0" (as unset) does not opt out.
    monkeypatch.setenv(PURE_ENV, "0")
    assert choose(build, root)[0].modules == ("model.contract.eagle",)


@pytest.mark.parametrize(
    "breakage, reported",
    [
        ("no manifest", "no compiled build"),
        ("another interpreter", "not for this interpreter"),
        ("an extension missing", "incomplete"),
        ("the runtime missing", "incomplete"),
        ("imported already", "imported before invariants/"),
    ],
)
def test_an_unusable_build_is_not_used(tmp_path: Path, breakage: str, reported: str) -> None:
    build, root = fake_build(tmp_path)
    loaded: tuple[str, ...] = ()
    if breakage == "no manifest":
        (build / MANIFEST_NAME).unlink()
    elif breakage == "another interpreter":
        manifest = json.loads((build / MANIFEST_NAME).read_text())
        (build / MANIFEST_NAME).write_text(json.dumps({**manifest, "suffix": ".cpython-39-x.so"}))
    elif breakage == "an extension missing":
        (build / "model" / "contract" / f"eagle{SUFFIX}").unlink()
    elif breakage == "the runtime missing":
        (build / f"{RUNTIME}{SUFFIX}").unlink()
    else:
        loaded = ("model.contract.eagle",)
    state, _ = choose(build, root, loaded=loaded, honour_env=False)
    assert state.modules == () and reported in state.why


def test_compiled_and_excluded_modules_are_real_and_apart() -> None:
    assert COMPILED and len(set(COMPILED)) == len(COMPILED)
    assert not set(COMPILED) & set(EXCLUDED)
    for m in COMPILED:
        assert ROOT.joinpath(*m.split(".")).with_suffix(".py").is_file(), m
        assert not m.endswith("__init__")


@pytest.mark.slow  # compiles with mypyc, then searches twice per variant: 82 s on the loaded 2-core machine
def test_the_compiled_build_searches_what_pure_python_searches(tmp_path: Path) -> None:
    from invariants.compiled import DIR_ENV, run_variant
    from invariants.native.build import build

    build(tmp_path / "mypyc")
    os.environ[DIR_ENV] = str(tmp_path / "mypyc")
    try:
        for target in ("model", "vllm-manager"):
            got = {
                pure: run_variant(
                    "invariants.explore.compiled_bench", [target, "full+swa-p7-dense", "3"], pure=pure
                )
                for pure in (True, False)
            }
            assert got[True]["state"].startswith("pure Python"), got[True]
            assert got[False]["state"].startswith("compiled"), got[False]
            assert got[True]["certificate"] == got[False]["certificate"], (target, got)
            assert got[True]["states"] == got[False]["states"] > 0
    finally:
        os.environ.pop(DIR_ENV)


def test_compare_compiled_without_a_build_is_bad_usage(tmp_path: Path) -> None:
    import subprocess
    import sys

    from invariants.compiled import DIR_ENV

    env = dict(os.environ, **{DIR_ENV: str(tmp_path), PURE_ENV: "0", "PYTHONPATH": str(ROOT)})
    done = subprocess.run(
        [sys.executable, "-m", "invariants.cli.main", "bench", "--compare-compiled"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    lines = [x for x in done.stderr.splitlines() if "error" in x]
    assert len(lines) == 1 and "--compare-compiled needs a usable compiled build" in lines[0], done.stderr


def test_control_a_child_that_ran_the_other_variant_is_refused(tmp_path: Path) -> None:
    """A stale build makes a "compiled" child run pure Python: its figure must not count."""
    from invariants.compiled import DIR_ENV, run_variant

    os.environ[DIR_ENV] = str(tmp_path)  # no build there: the child runs pure Python
    try:
        got = run_variant("invariants.compiled", [], pure=True)
        assert got["state"].startswith("pure Python")
        with pytest.raises(RuntimeError, match="asked for compiled, it ran pure Python"):
            run_variant("invariants.compiled", [], pure=False)
    finally:
        os.environ.pop(DIR_ENV)
