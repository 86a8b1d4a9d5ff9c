"""Pluggable targets: a package registered under the `kvretain.targets` entry
point is a `--target`.

The example package (examples/kvretain-target-example) is installed into a
fresh virtual environment that sees this kvretain and its dependencies; there
it appears in `kvretain fuzz --help` and fuzzes clean, and a broken variant of
it (its free queue's `prepend_n` in the wrong order) is caught. A plug-in that
cannot load, or is no Target, is one line and exit code 2.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sysconfig
import venv
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import invariants.targets as registry
from invariants.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "kvretain-target-example"


def _broken_copy(dst: Path) -> Path:
    """The example with a bug, as another package (own module and entry-point name)."""
    shutil.copytree(EXAMPLE, dst)
    src = dst / "src" / "kvretain_target_example"
    src.rename(dst / "src" / "kvretain_target_broken")
    queue = dst / "src" / "kvretain_target_broken" / "free_queue.py"
    text = queue.read_text()
    assert "for block in reversed(blocks):" in text
    queue.write_text(text.replace("for block in reversed(blocks):", "for block in blocks:"))
    pyproject = dst / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text()
        .replace('name = "kvretain-target-example"', 'name = "kvretain-target-broken"')
        .replace(
            'example = "kvretain_target_example.target:ExampleTarget"',
            'example-broken = "kvretain_target_broken.target:ExampleTarget"',
        )
    )
    return dst


@pytest.fixture(scope="module")
def plugin_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv seeing this checkout and the current environment's packages,
    with the example and its broken variant installed."""
    base = tmp_path_factory.mktemp("plugin-venv")
    env_dir = base / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    Path(purelib, "kvretain-dev.pth").write_text(f"{ROOT}\n{sysconfig.get_paths()['purelib']}\n")
    for pkg in (shutil.copytree(EXAMPLE, base / "example"), _broken_copy(base / "broken")):
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(pkg)],
            check=True,
            env=_env(),
            cwd=base,
            capture_output=True,
        )
    return python


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


# Hypothesis without its shrink phase: the catch is what is tested here, and
# shrinking an unbudgeted run can take minutes on a loaded machine.
NO_SHRINK = (
    "import sys; from hypothesis import Phase, settings; "
    "settings.register_profile('no-shrink', phases=[Phase.explicit, Phase.reuse, Phase.generate]); "
    "settings.load_profile('no-shrink'); from invariants.cli.main import main; sys.exit(main(sys.argv[1:]))"
)


def _kvretain(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-c", NO_SHRINK, *args],
        env=_env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_example_is_listed_in_fuzz_help(plugin_python: Path, tmp_path: Path) -> None:
    out = _kvretain(plugin_python, "fuzz", "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "{model,reference,vllm,example,example-broken}" in out.stdout
    assert "plug-ins: example, example-broken" in " ".join(out.stdout.split())


@pytest.mark.slow
def test_example_fuzzes_clean(plugin_python: Path, tmp_path: Path) -> None:
    out = _kvretain(plugin_python, "fuzz", "--target", "example", "--steps", "300", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "example  generated" in out.stdout and "clean" in out.stdout


@pytest.mark.slow
def test_broken_variant_is_caught(plugin_python: Path, tmp_path: Path) -> None:
    junit = tmp_path / "fuzz.xml"
    out = _kvretain(
        plugin_python,
        *("fuzz", "--target", "example-broken", "--steps", "2000", "--seed", "0", "--junit-xml", str(junit)),
        cwd=tmp_path,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "VIOLATION on target example-broken" in out.stdout
    (case,) = ET.parse(junit).getroot().iter("testcase")
    failure = case.find("failure")
    assert failure is not None and failure.text is not None
    trace = next(line.split(": ", 1)[1] for line in failure.text.splitlines() if line.startswith("trace: "))
    assert (tmp_path / trace).exists()


# ------------------------------------------------------------------ in this process (default run)
@pytest.fixture
def example_registered(monkeypatch: pytest.MonkeyPatch) -> dict[str, importlib.metadata.EntryPoint]:
    """The example's entry point and a broken twin, as if their packages were installed."""
    import invariants.cli.main as cli

    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    eps = {
        "example": importlib.metadata.EntryPoint(
            "example", "kvretain_target_example.target:ExampleTarget", registry.ENTRY_POINT_GROUP
        ),
        "example-broken": importlib.metadata.EntryPoint(
            "example-broken", f"{__name__}:BrokenExampleTarget", registry.ENTRY_POINT_GROUP
        ),
    }
    monkeypatch.setattr(registry, "plugin_targets", lambda: eps)
    monkeypatch.setattr(cli, "TARGET_NAMES", (*registry.BUILTIN_TARGETS, *eps))
    return eps


def _broken_target() -> type:
    """The example with its free queue's `prepend_n` in the wrong order."""
    from dataclasses import replace

    from kvretain_target_example.free_queue import DictFreeQueue
    from kvretain_target_example.target import ExampleTarget

    from reference_impl.block_pool import BlockPool

    class WrongOrderQueue(DictFreeQueue):
        def prepend_n(self, blocks):  # type: ignore[no-untyped-def]
            super().prepend_n(list(reversed(blocks)))

    class Pool(BlockPool):
        free_queue_cls = WrongOrderQueue  # type: ignore[assignment]

    class Broken(ExampleTarget):
        name = "example-broken"
        MUTANTS = {"fork": lambda c: replace(c, block_pool_cls=Pool)}

    return Broken


def __getattr__(name: str) -> object:
    if name == "BrokenExampleTarget":  # loaded lazily by the entry point above
        return _broken_target()
    raise AttributeError(name)


def test_registered_example_fuzzes_clean_and_broken_twin_is_caught(
    example_registered: object,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hypothesis import Phase, settings

    monkeypatch.chdir(tmp_path)
    assert main(["fuzz", "--target", "example", "--steps", "300", "--json", "clean.json"]) == 0
    assert "clean" in capsys.readouterr().out
    # Without the shrink phase (see NO_SHRINK): the catch is what is tested.
    settings.register_profile("no-shrink", phases=[Phase.explicit, Phase.reuse, Phase.generate])
    previous = settings.get_current_profile_name()
    settings.load_profile("no-shrink")
    try:
        assert main(["fuzz", "--target", "example-broken", "--steps", "2000", "--json", "broken.json"]) == 1
    finally:
        settings.load_profile(previous)
    assert "VIOLATION on target example-broken" in capsys.readouterr().out
    clean = json.loads((tmp_path / "clean.json").read_text())
    broken = json.loads((tmp_path / "broken.json").read_text())
    assert clean["ok"] and clean["cases"][0]["outcome"] == "passed"
    assert not broken["ok"] and broken["cases"][0]["outcome"] == "failed"
    assert (tmp_path / broken["cases"][0]["trace"]).exists()


def test_plugin_that_cannot_load_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    eps = {
        "ghost": importlib.metadata.EntryPoint(
            "ghost", "no_such_module_kvretain:Target", registry.ENTRY_POINT_GROUP
        ),
        "notarget": importlib.metadata.EntryPoint("notarget", "os.path:sep", registry.ENTRY_POINT_GROUP),
        "halftarget": importlib.metadata.EntryPoint(
            "halftarget", "collections:OrderedDict", registry.ENTRY_POINT_GROUP
        ),
    }
    monkeypatch.setattr(registry, "plugin_targets", lambda: eps)
    with pytest.raises(registry.TargetUnavailable, match="'ghost'.*cannot be loaded: ModuleNotFoundError"):
        registry.target_factory("ghost")
    with pytest.raises(registry.TargetUnavailable, match="'notarget'.*is not callable"):
        registry.target_factory("notarget")
    with pytest.raises(registry.TargetUnavailable, match=r"'halftarget'.*no apply\(\), snapshot\(\)"):
        registry.target_factory("halftarget")
    # Through the command: one line on stderr, exit code 2.
    import invariants.cli.main as cli

    monkeypatch.setattr(cli, "TARGET_NAMES", (*registry.BUILTIN_TARGETS, *eps))
    assert main(["fuzz", "--target", "ghost", "--steps", "10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be loaded" in err[0], err


def test_plugins_cannot_shadow_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = [
        importlib.metadata.EntryPoint("reference", "collections:OrderedDict", registry.ENTRY_POINT_GROUP),
        importlib.metadata.EntryPoint("mine", "collections:OrderedDict", registry.ENTRY_POINT_GROUP),
    ]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: fake)
    registry.plugin_targets.cache_clear()
    try:
        assert list(registry.plugin_targets()) == ["mine"]
    finally:
        monkeypatch.undo()
        registry.plugin_targets.cache_clear()
