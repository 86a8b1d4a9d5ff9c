"""Who may import whom: the layers of the design card and the rooms of `invariants/`.

The judge and the judged share no code (`reference_impl/` never imports
`model/`), the specification stands alone, and inside `invariants/` a room
imports only what `invariants.ROOMS` lists for it. Each rule has a control: a
planted upward import that the checker must report.
"""

from __future__ import annotations

import ast
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


def imported_modules(source: str) -> list[str]:
    """Every absolute module a source file imports, at any depth (lazy imports too)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            if node.module in PROJECT or node.module == "invariants":
                names.extend(f"{node.module}.{a.name}" for a in node.names)
    return names


def room_of(path: Path) -> str | None:
    """The room of a file under invariants/ (None for the package's own __init__)."""
    rel = path.relative_to(ROOT / "invariants").parts
    if len(rel) == 1:
        stem = rel[0].removesuffix(".py")
        return None if stem == "__init__" else stem
    return rel[0]


def violations(path: Path, source: str) -> list[str]:
    package = path.relative_to(ROOT).parts[0]
    found = []
    for module in imported_modules(source):
        top = module.split(".")[0]
        if top not in PROJECT or top == package:
            if top == "invariants" == package:
                found.extend(_room_violations(path, module))
            continue
        if top not in LAYERS[package]:
            found.append(f"{path.relative_to(ROOT)} imports {module}: {package}/ may not import {top}/")
        elif package == "gpu_check" and top == "invariants":
            room = module.split(".")[1] if "." in module else ""
            if room not in GPU_CHECK_ROOMS | invariants.LEAVES:
                found.append(
                    f"{path.relative_to(ROOT)} imports {module}: gpu_check uses only {sorted(GPU_CHECK_ROOMS)}"
                )
    return found


def _room_violations(path: Path, module: str) -> list[str]:
    here = room_of(path)
    parts = module.split(".")
    if len(parts) < 2 or here is None:
        return []
    there = parts[1]
    if there == here or there in invariants.LEAVES:
        return []
    if here in invariants.LEAVES:
        return [f"{path.relative_to(ROOT)} imports {module}: {here} is a leaf and imports no room"]
    if here not in invariants.ROOMS:
        return [f"{path.relative_to(ROOT)}: room {here!r} is not in invariants.ROOMS (add it to the map)"]
    if there not in invariants.ROOMS[here]:
        return [f"{path.relative_to(ROOT)} imports {module}: room {here} may not import room {there}"]
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
        ("model/pool.py", "from reference_impl.block import KVCacheBlock", "may not import reference_impl/"),
        ("reference_impl/block_pool.py", "from model.free_queue import FreeQueue", "may not import model/"),
        ("gpu_check/forward_pass.py", "from invariants.cli.main import main", "gpu_check uses only"),
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


def test_size_limits() -> None:
    """No module directly under invariants/ over 400 lines, no project file over 800."""
    flat = [p for p in (ROOT / "invariants").glob("*.py") if len(p.read_text().splitlines()) > 400]
    big = [
        p
        for p in project_files() + sorted((ROOT / "tests").glob("*.py"))
        if len(p.read_text().splitlines()) > 800
    ]
    assert not flat and not big, f"too long: {[str(p.relative_to(ROOT)) for p in flat + big]}"
