"""The specification's own shape (issue 39, "Judge state out of the spec"): `model/` forms no
import circle, no module of it calls a private method of another module's class, and it
holds no coverage counter, decision recorder or judge's choice (those are the harness's:
`model.machine.seams.Observer`, `invariants.harness.observer`); every module lives in its
layer's subpackage (`model.LAYERS`) and its docstring fits a screen. Each rule's checker runs on
a planted bad input too, and must report it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import model

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "model"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def model_sources() -> dict[str, str]:
    """Module name -> source, for every module of `model/` (subpackages included)."""
    return {module_name(p): p.read_text() for p in sorted(MODEL.rglob("*.py"))}


# ------------------------------------------------------------------------------- import graph
def imports_of(module: str, source: str, known: set[str]) -> set[str]:
    """The `model` modules `source` imports: anywhere in it, `if TYPE_CHECKING:` blocks and
    function bodies included (a circle only type checkers see is a circle a reader sees)."""
    package = module.rsplit(".", 1)[0] if module.count(".") else module
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from model import connector`
    return {m for m in found if m in known and m != module}


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    known = set(sources)
    return {m: imports_of(m, s, known) for m, s in sources.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_model_imports_form_no_circle() -> None:
    assert cycles(import_graph(model_sources())) == []


def test_control_a_type_checking_import_back_is_a_circle() -> None:
    sources = model_sources()
    assert (
        "model.machine.failed_blocks" in import_graph(sources)["model.machine.allocator"]
    )  # the edge the plant closes
    planted = dict(sources)
    planted["model.machine.failed_blocks"] += (
        "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from model.machine.allocator import AllocatorModel\n"
    )
    found = cycles(import_graph(planted))
    assert any({"model.machine.allocator", "model.machine.failed_blocks"} <= set(c) for c in found), found
    # A relative import and a `from model import x` are edges too.
    planted = dict(sources)
    planted["model.machine.connector"] += "\n\ndef _planted() -> None:\n    from . import allocator  # noqa\n"
    assert any("model.machine.connector" in c for c in cycles(import_graph(planted)))


# ------------------------------------------------------------------------------- private calls
def private_methods(sources: dict[str, str]) -> dict[str, set[str]]:
    """Private method name -> the modules whose classes define it."""
    owners: dict[str, set[str]] = {}
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and _private(item.name):
                        owners.setdefault(item.name, set()).add(module)
    return owners


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _on_self(owner: ast.expr) -> bool:
    return isinstance(owner, ast.Name) and owner.id in ("self", "cls")


def private_calls(module: str, source: str, owners: dict[str, set[str]]) -> list[str]:
    """Each call `x._name(...)` in `source`, `x` not self or cls, of a private method that
    only other modules' classes define (a NamedTuple's `_replace` is no project name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name = node.func.attr
        defined = owners.get(name, set())
        if _private(name) and not _on_self(node.func.value) and defined and module not in defined:
            found.append(f"{module}:{node.lineno} calls {name}, private to {sorted(defined)}")
    return found


def test_no_model_module_calls_another_modules_private_method() -> None:
    sources = model_sources()
    owners = private_methods(sources)
    found = [v for m, s in sources.items() for v in private_calls(m, s, owners)]
    assert not found, "\n".join(found)


def test_control_a_private_call_into_the_machine_is_reported() -> None:
    sources = model_sources()
    owners = private_methods(sources)
    planted = (
        sources["model.machine.connector"]
        + "\n\ndef _planted(m):  # noqa\n    return m._allocate(None, 0, 0, None)\n"
    )
    found = private_calls("model.machine.connector", planted, owners)
    assert found and "_allocate" in found[0] and "model.machine.allocator" in found[0], found
    # The same call on self, or to the module's own class, is not reach.
    own = (
        sources["model.machine.allocator"]
        + "\n\ndef _planted(m):  # noqa\n    return m._allocate(None, 0, 0, None)\n"
    )
    assert not private_calls("model.machine.allocator", own, owners)
    on_self = (
        sources["model.machine.connector"]
        + "\n\ndef _planted(self):\n    return self._allocate(None, 0, 0, None)\n"
    )
    assert not private_calls("model.machine.connector", on_self, owners)


# ------------------------------------------------------------------------------- judge state
JUDGE_NAMES = frozenset({"exercised", "recording", "end_order", "coverage", "_decisions"})


def judge_state(module: str, source: str) -> list[str]:
    """What in `source` is judge state: a name the judge's bookkeeping used (`JUDGE_NAMES`,
    as an attribute, a variable, a function or a parameter), a `Counter` or a
    context-managed recorder imported, or a counter bumped under a literal key
    (`x["rule"] += 1`). `model.contract.smt`'s solver scope is a context manager and no recorder."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        names: list[str] = []
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        elif isinstance(node, ast.Name):
            names.append(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.append(node.name)
        elif isinstance(node, ast.arg):
            names.append(node.arg)
        elif isinstance(node, ast.ImportFrom):
            imported = {a.name for a in node.names}
            if "Counter" in imported or ("contextmanager" in imported and module != "model.contract.smt"):
                found.append(f"{module}:{line} imports {sorted(imported & {'Counter', 'contextmanager'})}")
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Subscript):
            key = node.target.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str) or isinstance(key, ast.JoinedStr):
                found.append(f"{module}:{line} counts under a literal key")
        found += [f"{module}:{line} names {n}" for n in names if n in JUDGE_NAMES]
    return found


def test_model_holds_no_counter_recorder_or_judge_choice() -> None:
    found = [v for m, s in model_sources().items() for v in judge_state(m, s)]
    assert not found, "\n".join(found)


def test_control_planted_judge_state_is_reported() -> None:
    planted = {
        "self.exercised = {}": "names exercised",
        "self.end_order = ()": "names end_order",
        'self.fired["rule"] += 1': "counts under a literal key",
        'seen[f"connector: {x}"] += 1': "counts under a literal key",
        "from collections import Counter": "imports ['Counter']",
        "from contextlib import contextmanager": "imports ['contextmanager']",
        "def recording(self): pass": "names recording",
    }
    clean = model_sources()["model.machine.connector"]
    assert not judge_state("model.machine.connector", clean)
    for line, reported in planted.items():
        found = judge_state(
            "model.machine.connector", clean + f"\n\ndef _planted(self, seen, x):\n    {line}\n"
        )
        assert any(reported in f for f in found), (line, found)


# ------------------------------------------------------------------------------- layers
POLICY_SENTENCE = re.compile(
    r"vLLM's policy, read from .+ in vLLM \d+\.\d+.*predicted, no claim to be correct"
)


def _top(module: str) -> str:
    """model.contract.masks -> contract; model.radix.tree -> radix; model -> ''."""
    return module.split(".")[1] if "." in module else ""


def layer_problems(sources: dict[str, str], layers: dict[str, str]) -> list[str]:
    """What breaks `model.LAYERS` (subpackage -> layer): a module outside every layer's
    subpackage, a subpackage on the map and not on disk, a layer the map does not know, a contract module importing a machine module (TYPE_CHECKING
    included), a policy module whose docstring does not say it is vLLM's policy."""
    on_disk = {_top(m) for m in sources} - {""}
    problems = [f"model.{m}: in no layer's subpackage (model.LAYERS)" for m in sorted(on_disk - set(layers))]
    problems += [f"model.{m}: on model.LAYERS, not on disk" for m in sorted(set(layers) - on_disk)]
    problems += [f"model.{m}: no such layer {k!r}" for m, k in layers.items() if k not in KNOWN_LAYERS]
    for module, deps in import_graph(sources).items():
        if layers.get(_top(module)) == model.CONTRACT:
            problems += [
                f"{module} (contract) imports {d} (machine)"
                for d in sorted(deps)
                if layers.get(_top(d)) == model.MACHINE
            ]
    for module, source in sources.items():
        if layers.get(_top(module)) == model.POLICY and module.count(".") > 1:  # not the package
            doc = " ".join((ast.get_docstring(ast.parse(source)) or "").split())
            if not POLICY_SENTENCE.search(doc):
                problems.append(f"{module} (policy): its docstring does not say whose policy it predicts")
    return problems


KNOWN_LAYERS = frozenset({model.CONTRACT, model.POLICY, model.MACHINE, model.SGLANG})


def test_every_model_module_is_on_the_layer_map() -> None:
    assert layer_problems(model_sources(), model.LAYERS) == []


def test_control_layer_map_breaks_are_reported() -> None:
    sources = model_sources()
    flat = dict(sources)
    flat["model.planted"] = sources["model.contract.kinds"]  # a module outside the layers
    assert layer_problems(flat, model.LAYERS) == ["model.planted: in no layer's subpackage (model.LAYERS)"]
    unmapped = dict(model.LAYERS)
    del unmapped["policy"]
    assert layer_problems(sources, unmapped) == ["model.policy: in no layer's subpackage (model.LAYERS)"]
    upward = dict(sources)
    upward["model.contract.masks"] += "\nfrom model.machine.pool import Pool  # noqa\n"
    assert layer_problems(upward, model.LAYERS) == [
        "model.contract.masks (contract) imports model.machine.pool (machine)"
    ]
    unsaid = dict(sources)
    unsaid["model.policy.queues"] = unsaid["model.policy.queues"].replace("vLLM's policy", "vLLM's order", 1)
    assert layer_problems(unsaid, model.LAYERS) == [
        "model.policy.queues (policy): its docstring does not say whose policy it predicts"
    ]


# ------------------------------------------------------------------------------- docstrings
# A screen: a module docstring states the contract; the narrative is docs/semantics.md.
MAX_DOCSTRING_LINES = 40


def long_docstrings(sources: dict[str, str]) -> list[str]:
    """Each module of `model/` whose docstring is longer than a screen."""
    found = []
    for module, source in sources.items():
        tree = ast.parse(source)
        first = tree.body[0] if tree.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            lines = (first.end_lineno or first.lineno) - first.lineno + 1
            if lines > MAX_DOCSTRING_LINES:
                found.append(f"{module}: a {lines}-line docstring (at most {MAX_DOCSTRING_LINES})")
    return found


def test_model_docstrings_fit_a_screen() -> None:
    assert long_docstrings(model_sources()) == []


def test_control_a_long_docstring_is_reported() -> None:
    source = model_sources()["model.policy.queues"]
    planted = source.replace('"""', '"""' + "narrative\n" * MAX_DOCSTRING_LINES, 1)
    found = long_docstrings({"model.policy.queues": planted})
    assert len(found) == 1 and found[0].startswith("model.policy.queues: a "), found
    assert not long_docstrings({"model.policy.queues": source})
