"""Who may import whom: the layers of the design card and the rooms of `invariants/`.

The judge and the judged share no code (`reference_impl/` never imports
`model/`), the specification stands alone, and inside `invariants/` a room
imports only what `invariants.ROOMS` lists for it. Imports are read as Python
resolves them: relative ones against the file's package, and a module loaded by
name (`importlib.import_module`, `__import__`, a lazy loader's table) is seen
through the string that names it. Each rule has a control: a planted upward
import that the checker must report.

The command line reaches `gpu_check/` (which imports `invariants/`) only
through the `kvretain.commands` entry point declared in pyproject.toml.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path

import pytest

import invariants

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("model", "reference_impl", "invariants", "gpu_check")

# package -> project packages it may import (besides itself)
LAYERS: dict[str, frozenset[str]] = {
    "model": frozenset(),
    "reference_impl": frozenset(),
    "invariants": frozenset({"model", "reference_impl"}),
    "gpu_check": frozenset({"model", "reference_impl", "invariants"}),
}
# gpu_check drives allocators through the judge's targets and scheduler loop only.
GPU_CHECK_ROOMS = frozenset({"targets", "simulate", "zoo", "harness"})


# A string that names a project module (`gpu_check.cli`, `invariants.cli.zoo:add_parser`).
MODULE_NAME = re.compile(r"(?:model|reference_impl|invariants|gpu_check)(?:\.\w+)+(?::[\w.]+)?")
IMPORTERS = frozenset({"import_module", "__import__"})


@functools.cache
def nodes(source: str) -> tuple[ast.AST, ...]:
    """Every node of `source`'s tree, parsed and walked once per run: the checks below
    read the whole project several times over and never change a tree."""
    return tuple(ast.walk(ast.parse(source)))


def package_of(path: Path) -> list[str]:
    """The package a project file belongs to (its own for an `__init__.py`), for relative imports."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1]


def _relative(package: list[str], level: int, module: str | None) -> str:
    """`from ..x import y` in `package` as an absolute module (`level` dots, `module` after them)."""
    base = package[: len(package) - (level - 1)] if level <= len(package) else []
    return ".".join([*base, *([module] if module else [])])


def imported_modules(path: Path, source: str) -> list[tuple[str, int]]:
    """Every project module a source file imports, with its line, at any depth (lazy
    imports too): `import` statements, relative ones resolved against the file's
    package, and modules loaded by name. A string constant that names a project
    module counts as an import wherever it stands (an argument of
    `importlib.import_module` or `__import__`, a table a lazy loader iterates, a
    helper that wraps the import): the checker does not follow a string to the call
    that loads it, so a name hidden in data is still seen."""
    package = package_of(path)
    names: list[tuple[str, int]] = []
    for node in nodes(source):
        if isinstance(node, ast.Import):
            names.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _relative(package, node.level, node.module) if node.level else (node.module or "")
            names.append((module, node.lineno))
            # `from invariants import harness`, `from .. import harness`: the names are modules.
            if module in PROJECT:
                names.extend((f"{module}.{a.name}", node.lineno) for a in node.names)
        elif isinstance(node, ast.Call) and _callee(node.func) in IMPORTERS and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.append((_by_name(arg.value, node, package), node.lineno))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and MODULE_NAME.fullmatch(node.value)
        ):
            names.append((node.value.split(":")[0], node.lineno))
    return list(dict.fromkeys(names))  # a literal argument is seen as a call and as a string


def _callee(func: ast.expr) -> str | None:
    """`import_module` for `importlib.import_module(...)` and `import_module(...)` alike."""
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _by_name(name: str, call: ast.Call, package: list[str]) -> str:
    """The module `import_module(name, package)` loads: a relative name is resolved
    against the package argument when that is a literal, else against the file's
    own package (what `__package__` holds)."""
    if not name.startswith("."):
        return name
    anchors = [*call.args[1:2], *(k.value for k in call.keywords if k.arg == "package")]
    anchor = anchors[0] if anchors else None
    if isinstance(anchor, ast.Constant) and isinstance(anchor.value, str):
        package = anchor.value.split(".")
    level = len(name) - len(name.lstrip("."))
    return _relative(package, level, name.lstrip(".") or None)


def room_of(path: Path) -> str | None:
    """The room of a file under invariants/ (None for the package's own __init__)."""
    rel = path.relative_to(ROOT / "invariants").parts
    if len(rel) == 1:
        stem = rel[0].removesuffix(".py")
        return None if stem == "__init__" else stem
    return rel[0]


def violations(path: Path, source: str) -> list[str]:
    """Each import in `source` (the text of project file `path`) that breaks the layers or the rooms."""
    package = path.relative_to(ROOT).parts[0]
    found = []
    for module, line in imported_modules(path, source):
        where = f"{path.relative_to(ROOT)}:{line}"
        top = module.split(".")[0]
        if top not in PROJECT or top == package:
            if top == "invariants" == package:
                found.extend(_room_violations(path, where, module))
            continue
        if top not in LAYERS[package]:
            found.append(f"{where} imports {module}: {package}/ may not import {top}/")
        elif package == "gpu_check" and top == "invariants":
            room = module.split(".")[1] if "." in module else ""
            if room not in GPU_CHECK_ROOMS | invariants.LEAVES:
                found.append(f"{where} imports {module}: gpu_check uses only {sorted(GPU_CHECK_ROOMS)}")
    return found


def _room_violations(path: Path, where: str, module: str) -> list[str]:
    here = room_of(path)
    parts = module.split(".")
    if len(parts) < 2 or here is None:
        return []
    there = parts[1]
    if there == here or there in invariants.LEAVES:
        return []
    if here in invariants.LEAVES:
        return [f"{where} imports {module}: {here} is a leaf and imports no room"]
    if here not in invariants.ROOMS:
        return [f"{where}: room {here!r} is not in invariants.ROOMS (add it to the map)"]
    if there not in invariants.ROOMS[here]:
        return [f"{where} imports {module}: room {here} may not import room {there}"]
    return []


def project_files() -> list[Path]:
    return sorted(p for pkg in PROJECT for p in (ROOT / pkg).rglob("*.py"))


def test_every_import_follows_the_layers_and_rooms() -> None:
    found = [v for p in project_files() for v in violations(p, p.read_text())]
    assert not found, "\n".join(found)


def test_every_room_on_disk_is_on_the_map() -> None:
    on_disk = {p.name for p in (ROOT / "invariants").iterdir() if (p / "__init__.py").exists()}
    assert on_disk == set(invariants.ROOMS), (
        f"rooms on disk {sorted(on_disk)} vs map {sorted(invariants.ROOMS)}"
    )


@pytest.mark.parametrize(
    ("where", "planted", "why"),
    [
        (
            "invariants/catalogue/structure.py",
            "from invariants.harness.checker import Checker",
            "may not import room harness",
        ),
        ("invariants/targets/base.py", "import invariants.cli.main", "may not import room cli"),
        ("invariants/harness/fuzz.py", "from invariants.zoo import runner", "may not import room zoo"),
        ("invariants/report.py", "from invariants.targets import base", "is a leaf"),
        (
            "model/machine/pool.py",
            "from reference_impl.block import KVCacheBlock",
            "may not import reference_impl/",
        ),
        (
            "reference_impl/block_pool.py",
            "from model.contract.free_queue import FreeQueue",
            "may not import model/",
        ),
        ("gpu_check/forward_pass.py", "from invariants.cli.main import main", "gpu_check uses only"),
        # Relative imports, resolved against the file's package.
        ("invariants/catalogue/structure.py", "from ..harness import checker", "may not import room harness"),
        ("invariants/harness/fuzz.py", "from ..cli.main import main", "may not import room cli"),
        # Modules loaded by name: a literal, a relative name with its package, a table a loader iterates.
        ("invariants/cli/main.py", 'importlib.import_module("gpu_check.cli")', "may not import gpu_check/"),
        ("model/machine/pool.py", '__import__("reference_impl")', "may not import reference_impl/"),
        (
            "invariants/targets/base.py",
            'importlib.import_module(".checker", package="invariants.harness")',
            "may not import room harness",
        ),
        (
            "invariants/harness/fuzz.py",
            'COMMANDS = ("invariants.cli.zoo", "gpu_check.cli:add_parser")',
            "may not import room cli",
        ),
    ],
)
def test_control_planted_upward_import_is_reported(where: str, planted: str, why: str) -> None:
    path = ROOT / where
    source = path.read_text()
    assert not violations(path, source), "the unmodified file must be clean"
    # Planted inside a function, where a lazy import hides from a grep.
    bad = source + f"\n\ndef _planted() -> None:\n    {planted}\n"
    found = violations(path, bad)
    assert found and why in found[0], found


def test_relative_and_by_name_imports_resolve_to_absolute_modules() -> None:
    source = (
        "from . import zoo\n"
        "from ..harness.fuzz import run_fuzz\n"
        "from .. import proofs\n"
        "importlib.import_module('.trace', __package__)\n"
        "for name in ('gpu_check.cli', 'invariants.cli.zoo:add_parser'):\n"
        "    importlib.import_module(name)\n"
        "HELP = 'model cli, not a module name'\n"
    )
    found = {m for m, _ in imported_modules(ROOT / "invariants" / "cli" / "main.py", source)}
    assert found == {
        "invariants.cli",
        "invariants.harness.fuzz",
        "invariants",
        "invariants.proofs",
        "invariants.cli.trace",
        "gpu_check.cli",
        "invariants.cli.zoo",
    }


def test_gpu_check_reaches_the_command_line_through_the_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """invariants/ names only the entry-point group; pyproject.toml names gpu_check.cli. A
    checkout run without installed metadata (`--vllm-python`) still finds it there."""
    from invariants.cli import main

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"][main.COMMAND_GROUP] == {"gpu-check": "gpu_check.cli"}
    main.command_plugins.cache_clear()
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_: [])
    try:
        assert [ep.module for ep in main.command_plugins().values()] == ["gpu_check.cli"]
        assert "gpu-check" in main.build_parser().format_help()
    finally:
        main.command_plugins.cache_clear()


def test_size_limits() -> None:
    """No module directly under invariants/ over 400 lines, no project file over 800."""
    flat = [p for p in (ROOT / "invariants").glob("*.py") if len(p.read_text().splitlines()) > 400]
    big = [
        p
        for p in project_files() + sorted((ROOT / "tests").glob("*.py"))
        if len(p.read_text().splitlines()) > 800
    ]
    assert not flat and not big, f"too long: {[str(p.relative_to(ROOT)) for p in flat + big]}"


# Every project function stays readable in one screen (issue 25; issue 42's review extended it
# from model/, invariants/harness and invariants/targets to the whole project): at most
# MAX_FUNCTION_LINES lines from its `def` to its last line, docstring included. A function that
# cannot reasonably be split (a table, one match statement) is allowed by name with its reason;
# the limit is never raised.
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {
    # "path/to/module.py::function": "why it cannot be split",
}


def long_functions(path: Path, source: str, allowed: Mapping[str, str] = LONG_FUNCTIONS_ALLOWED) -> list[str]:
    """`path:line name: N lines` for each function (nested ones too) over MAX_FUNCTION_LINES
    lines that `allowed` does not name (`relative/path.py::name`)."""
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
    return [
        f"{rel}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in nodes(source)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
        and f"{rel}::{node.name}" not in allowed
    ]


def test_no_function_over_80_lines() -> None:
    found = [f for p in project_files() for f in long_functions(p, p.read_text())]
    assert not found, "split along its ideas (or allow it by name, with why):\n" + "\n".join(found)
    assert {p.relative_to(ROOT).parts[0] for p in project_files()} == set(PROJECT)
    # Every allowance still names a long function (a stale one would hide the next long one).
    for key in LONG_FUNCTIONS_ALLOWED:
        path, name = key.split("::")
        unallowed = long_functions(ROOT / path, (ROOT / path).read_text(), {})
        assert any(f" {name}: " in f for f in unallowed), f"stale allowance {key}"


def test_long_function_control(tmp_path: Path) -> None:
    """Control: a synthetic 81-line function (nested in a class) in a temp module is flagged;
    80 lines pass; an allowance by name silences exactly that function."""

    def module(lines: int) -> str:
        body = "".join(f"        x{i} = {i}\n" for i in range(lines - 1))
        return f"class C:\n    def long(self):\n{body}"

    path = tmp_path / "synthetic.py"
    path.write_text(module(MAX_FUNCTION_LINES + 1))
    found = long_functions(path, path.read_text())
    assert found == [f"{path.as_posix()}:2 long: {MAX_FUNCTION_LINES + 1} lines"]
    assert long_functions(path, module(MAX_FUNCTION_LINES)) == []
    assert long_functions(path, path.read_text(), {f"{path.as_posix()}::long": "a table"}) == []
    assert long_functions(path, path.read_text(), {f"{path.as_posix()}::other": "a table"}) == found


# ----------------------------------------------------------------------------- private reach
# No room reads another room's private attribute or patches it: what one room
# needs of another is a public, documented name. Rooms: model, reference_impl,
# gpu_check, and each room of invariants/ (a module directly under it is its own).
# An access `x._name` (or `getattr`/`setattr`/`delattr`/`hasattr(x, "_name")`)
# with `x` not self, cls or super() counts when `_name` is defined (a method, a
# class attribute, a `self._name = ...` assignment) only in other rooms. Names
# the project never defines (vLLM's, Hypothesis's) are out of scope.
_ALLOWED = (
    # (room, name or "*", why): accesses to objects outside the project that share a project name.
    ("invariants.targets", "_cache_partial_tail_block", "vLLM's manager method, read to detect a capability"),
    (
        "invariants.targets",
        "_cache",
        "vLLM's `cached_block_hash_to_block._cache` (reference_impl mirrors it)",
    ),
    (
        "invariants.zoo",
        "*",
        "mutants re-create bug classes by patching reference_impl's and vLLM's internals",
    ),
)
PRIVATE_REACH_ALLOWED: dict[tuple[str, str], str] = {(room, name): why for room, name, why in _ALLOWED}
ATTR_FUNCTIONS = frozenset({"getattr", "setattr", "delattr", "hasattr"})


def project_room(path: Path) -> str:
    """model, reference_impl, gpu_check, or invariants.<room> (`room_of`)."""
    top = path.relative_to(ROOT).parts[0]
    if top != "invariants":
        return top
    room = room_of(path)
    return "invariants" if room is None else f"invariants.{room}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_definitions(sources: dict[Path, str]) -> dict[str, set[str]]:
    """Private name -> the rooms that define it on a class or an instance."""
    defined: dict[str, set[str]] = {}
    for path, source in sources.items():
        room = project_room(path)
        for node in nodes(source):
            names: list[str] = []
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        names.append(item.name)
                    elif isinstance(item, ast.Assign | ast.AnnAssign):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        names += [t.id for t in targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node.value):
                names.append(node.attr)
            for name in filter(_private, names):
                defined.setdefault(name, set()).add(room)
    return defined


def _on_self(owner: ast.expr) -> bool:
    """`self`, `cls` or `super()`: the object's own names."""
    if isinstance(owner, ast.Call):
        return isinstance(owner.func, ast.Name) and owner.func.id == "super"
    return isinstance(owner, ast.Name) and owner.id in ("self", "cls")


def _reached(node: ast.AST) -> str | None:
    """The private name `node` reaches on another object, if any."""
    if isinstance(node, ast.Attribute) and _private(node.attr):
        return None if _on_self(node.value) else node.attr
    if isinstance(node, ast.Call) and _callee(node.func) in ATTR_FUNCTIONS and len(node.args) >= 2:
        name = node.args[1]
        if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
            return name.value
    return None


def private_reaches(
    path: Path,
    source: str,
    defined: dict[str, set[str]],
    allowed: Mapping[tuple[str, str], str] | None = None,
) -> list[str]:
    """Each access in `source` to a private name only other rooms define (`allowed` aside)."""
    allowed = PRIVATE_REACH_ALLOWED if allowed is None else allowed
    room = project_room(path)
    found = []
    for node in nodes(source):
        name = _reached(node)
        owners = defined.get(name, set()) if name else set()
        if not owners or room in owners:
            continue
        if (room, name) in allowed or (room, "*") in allowed:
            continue
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
        found.append(f"{where} ({room}) reaches {name}, private to {sorted(owners)}")
    return found


def _project_sources() -> dict[Path, str]:
    return {p: p.read_text() for p in project_files()}


def test_no_room_reaches_another_rooms_private_names() -> None:
    sources = _project_sources()
    defined = private_definitions(sources)
    found = [v for p, s in sources.items() for v in private_reaches(p, s, defined)]
    assert not found, "\n".join(found)


def test_every_allowed_private_reach_is_still_needed() -> None:
    sources = _project_sources()
    defined = private_definitions(sources)
    found = [v for p, s in sources.items() for v in private_reaches(p, s, defined, allowed={})]
    for room, name in PRIVATE_REACH_ALLOWED:
        seen = [v for v in found if f"({room}) reaches {'' if name == '*' else name}" in v]
        assert seen, f"allow-list entry ({room}, {name}) matches no access: remove it"


@pytest.mark.parametrize(
    ("where", "planted", "reported"),
    [
        # The shapes this rule replaced: a monkeypatched step, a reached-into target.
        ("invariants/export/plan.py", "model._allocate = None", "_allocate"),
        ("invariants/export/plan.py", 'setattr(model, "_preempt", None)', "_preempt"),
        ("invariants/harness/checker.py", "return target._model", "_model"),
        ("gpu_check/forward_pass.py", "return model.machine.pool._insert", "_insert"),
        ("model/machine/pool.py", "return manager._maybe_evict_cached_block", "_maybe_evict_cached_block"),
    ],
)
def test_control_planted_private_reach_is_reported(where: str, planted: str, reported: str) -> None:
    sources = _project_sources()
    path = ROOT / where
    defined = private_definitions(sources)
    assert not private_reaches(path, sources[path], defined), "the unmodified file must be clean"
    bad = sources[path] + f"\n\ndef _planted(model, target, manager):  # noqa\n    {planted}\n"
    found = private_reaches(path, bad, defined)
    assert found and reported in found[0], found
    # Its own room's names and self's are not reach: the same access on self is clean.
    own = sources[path] + f"\n\ndef _planted(self):\n    return self.{reported}\n"
    assert not private_reaches(path, own, defined)


# Ray, an optional extra, is imported by the campaign room alone (design: "nothing else imports Ray").
RAY_ROOM = ROOT / "invariants" / "campaign"


def ray_imports(path: Path, source: str) -> list[str]:
    """Each import of Ray in `source` (project file `path`) outside the campaign room."""
    if path.is_relative_to(RAY_ROOM):
        return []
    names = [a.name for n in nodes(source) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in nodes(source) if isinstance(n, ast.ImportFrom) and not n.level]
    return [
        f"{path.relative_to(ROOT)} imports {m}: only invariants/campaign/ imports Ray"
        for m in names
        if m.split(".")[0] == "ray"
    ]


def test_only_the_campaign_room_imports_ray() -> None:
    found = [v for p in project_files() for v in ray_imports(p, p.read_text())]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("where", "planted"),
    [
        ("invariants/explore/search.py", "import ray"),
        ("invariants/cli/fuzz.py", "from ray import cloudpickle"),
    ],
)
def test_control_planted_ray_import_is_reported(where: str, planted: str) -> None:
    path = ROOT / where
    source = path.read_text()
    assert not ray_imports(path, source)
    found = ray_imports(path, source + f"\n\ndef _planted() -> None:\n    {planted}\n")
    assert found and "only invariants/campaign/ imports Ray" in found[0]
    assert not ray_imports(RAY_ROOM / "explore.py", planted)  # the room itself may
