"""The opt-in mypyc build of the hot pure modules, and the choice, at import, to run it or not.

`make compiled` (`invariants.native.build`) compiles its `COMPILED` modules into `build/mypyc/` (never
beside the sources: a stray extension next to a `.py` would shadow the source a test or a
mutant edits) and records there, per module, the SHA-256 of the source it compiled. `install()`,
run first by `invariants/__init__.py`, puts a finder in front of `sys.meta_path` that loads
those modules from the build, all of them or none, and only when:

- `KVRETAIN_PURE_PYTHON` is unset or "" or "0" (the test suite sets it: monkeypatches and
  mutants edit Python functions, which a compiled caller would not see);
- the build exists, was made for this interpreter, and every compiled module's source still
  hashes as it did at build time (a stale build is ignored with one warning line, never used);
- none of those modules is imported yet (compiled code reaches its group's classes natively:
  a pure twin already in `sys.modules` would be a different class).

`state()` says which: what `kvretain` and `kvretain bench` print. Otherwise pure Python runs,
the definition; the compiled build must give the same results (tests/test_compiled.py).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DIR_ENV = "KVRETAIN_COMPILED_DIR"  # another build directory (a test's own build)
BUILD_DIR = Path(os.environ.get(DIR_ENV) or ROOT / "build" / "mypyc")
MANIFEST_NAME = "manifest.json"
PURE_ENV = "KVRETAIN_PURE_PYTHON"


@dataclass(frozen=True)
class State:
    """What runs: `modules` compiled (empty: pure Python) and why, in one line."""

    modules: tuple[str, ...]
    why: str

    def line(self) -> str:
        if self.modules:
            where = BUILD_DIR.relative_to(ROOT) if BUILD_DIR.is_relative_to(ROOT) else BUILD_DIR
            return f"compiled (mypyc, {where}): {len(self.modules)} modules: {self.why}"
        return f"pure Python ({self.why})"


_STATE = State((), "not chosen yet")


def source_hash(module: str, root: Path = ROOT) -> str:
    """SHA-256 of `module`'s source file under `root` (what the build records per module)."""
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def opted_out() -> bool:
    return os.environ.get(PURE_ENV, "") not in ("", "0")


def read_manifest(build: Path = BUILD_DIR) -> dict[str, object] | None:
    try:
        data = json.loads((build / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def choose(
    build: Path = BUILD_DIR, root: Path = ROOT, loaded: Sequence[str] = (), honour_env: bool = True
) -> tuple[State, str | None]:
    """Which modules to load compiled, and a warning line when a build exists but is not used
    (stale, for another interpreter, or some of its modules already imported)."""
    if honour_env and opted_out():
        return State((), f"{PURE_ENV} is set"), None
    manifest = read_manifest(build)
    if manifest is None:
        return State((), "no compiled build: `make compiled` makes one"), None
    modules = manifest.get("modules")
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    if not isinstance(modules, dict) or not modules or manifest.get("suffix") != suffix:
        why = f"the compiled build in {build} is not for this interpreter ({suffix})"
        return State((), why), f"{why}; running pure Python: run `make compiled` again"
    inputs = manifest.get("inputs")
    sources = {**modules, **(inputs if isinstance(inputs, dict) else {})}  # compiled, and types they read
    stale = [m for m, digest in sources.items() if _digest(m, root) != digest]
    if stale:
        why = f"the compiled build is stale ({len(stale)} source(s) changed since it was built, {stale[0]} first)"
        return State((), why), f"{why}; it is ignored and pure Python runs: run `make compiled` again"
    missing = [m for m in modules if not _extension(build, m).exists()]
    runtime = str(manifest.get("runtime", ""))
    if missing or not runtime or not (build / f"{runtime}{suffix}").exists():
        why = f"the compiled build in {build} is incomplete ({missing[0] if missing else 'its runtime'} missing)"
        return State((), why), f"{why}; running pure Python: run `make compiled` again"
    early = [m for m in modules if m in loaded]
    if early:
        why = f"{early[0]} was imported before invariants/; compiled modules are used all or none"
        return State((), why), f"the compiled build is not used: {why}"
    return State(tuple(sorted(modules)), "sources match the build"), None


def _digest(module: str, root: Path) -> str | None:
    try:
        return source_hash(module, root)
    except OSError:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the chosen modules' extensions in the build; every other import goes on as usual."""

    def __init__(self, build: Path, modules: tuple[str, ...]) -> None:
        self.build, self.modules = build, frozenset(modules)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return _extension_spec(fullname, _extension(self.build, fullname))


def _extension(build: Path, name: str) -> Path:
    parts = name.split(".")
    return build.joinpath(*parts[:-1], parts[-1] + importlib.machinery.EXTENSION_SUFFIXES[0])


def _extension_spec(name: str, path: Path) -> importlib.machinery.ModuleSpec:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    return spec


def install(build: Path = BUILD_DIR) -> State:
    """Choose (see the module docstring) and, when compiled, put the finder in place; idempotent."""
    global _STATE
    if _STATE.why != "not chosen yet":
        return _STATE
    state, warning = choose(build, loaded=tuple(sys.modules))
    if warning:
        print(f"kvretain: warning: {warning}", file=sys.stderr)
    if state.modules:
        try:
            _load_runtime(build)
        except ImportError as exc:  # a build that cannot load: pure Python, said once
            state = State((), f"the compiled build does not load ({exc})")
            print(f"kvretain: warning: {state.why}; running pure Python", file=sys.stderr)
        else:
            sys.meta_path.insert(0, _Finder(build, state.modules))
    _STATE = state
    return state


def _load_runtime(build: Path) -> None:
    """Import the shared library every compiled module links (its shim imports it by name)."""
    runtime = str((read_manifest(build) or {}).get("runtime", ""))
    if runtime in sys.modules:
        return
    spec = _extension_spec(runtime, build / f"{runtime}{importlib.machinery.EXTENSION_SUFFIXES[0]}")
    lib = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(lib)
    sys.modules[runtime] = lib


def state() -> State:
    """What this process runs (pure Python until `install()` has chosen compiled)."""
    return _STATE


def run_variant(module: str, args: Sequence[str], pure: bool, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run `python -m module *args` in a child process, pure Python (`pure`) or with the
    compiled build, and return the JSON object its last stdout line holds (what a bench child
    measured, with `state`: the `State.line()` it ran). A child that fails, or that ran the
    other variant (a stale build falls back to pure Python), raises RuntimeError."""
    import subprocess

    env = dict(os.environ, **{PURE_ENV: "1" if pure else "0"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", module, *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{module} {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    data = json.loads(lines[-1])
    if not isinstance(data, dict):
        raise RuntimeError(f"{module}: no JSON object on its last line")
    ran = str(data.get("state", ""))
    if ran.startswith("pure Python") != pure:  # a figure of the other variant would be no figure at all
        raise RuntimeError(f"{module}: asked for {'pure Python' if pure else 'compiled'}, it ran {ran}")
    return data


if __name__ == "__main__":  # what a child process runs, as JSON (`run_variant`'s own check)
    install()
    print(json.dumps({"state": state().line(), "modules": list(state().modules)}))
