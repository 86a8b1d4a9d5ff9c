"""No test dropped: the default run collects at least as many tests as the recorded floor.

Speeding the suite up (issue #42) must never mean running less of it. The floor
in tests/data/suite_floor.txt is the number of tests `make test` collected under
tests/ when it was last raised (this file excluded; the exported findings under
docs/findings come and go with vLLM's fixes and are not counted). A run that
collects fewer fails here with both figures; a collection error fails too,
since a module that no longer imports drops its tests without a word. The count
is taken in a subprocess with the project's own pytest options (so the `slow`
deselection is the one `make test` applies), or, when this session is itself such
a run (`make test`: the testpaths, the project's `-m`, nothing else deselected),
from this session's own collection: the same count without a second collection
(which imports vLLM and every test module again). Raising the floor when tests are
added is a deliberate edit of the data file; a higher count passes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOOR_FILE = ROOT / "tests" / "data" / "suite_floor.txt"
THIS = Path(__file__).resolve()

# pytest's last line after `--collect-only -q`: "1320 tests collected in 9.1s" or
# "1320/1326 tests collected (6 deselected) in 9.1s"; an error adds ", 1 error".
SUMMARY = re.compile(r"^(?:(?P<selected>\d+)/)?(?P<collected>\d+) tests? collected\b(?P<rest>.*)$")


class CountError(ValueError):
    """A collection whose output does not state a clean count (an error, or no summary)."""


def read_floor(path: Path) -> int:
    """The floor: the file's one non-comment line, a non-negative integer."""
    lines = [s for line in path.read_text().splitlines() if (s := line.strip()) and not s.startswith("#")]
    if len(lines) != 1 or not lines[0].isdigit():
        raise CountError(f"{path}: expected one non-negative integer besides '#' comments, got {lines!r}")
    return int(lines[0])


def selected_count(output: str, returncode: int) -> int:
    """The number of tests a clean `pytest --collect-only -q` selected (after deselection).

    A non-zero exit, a collection error or a missing summary line raises `CountError`:
    a module that fails to import must not read as a smaller, or any, count."""
    lines = [s for line in output.splitlines() if (s := line.strip(" =\n"))]
    match = SUMMARY.match(lines[-1]) if lines else None
    if returncode != 0 or match is None or "error" in match["rest"]:
        tail = lines[-1] if lines else "(no output)"
        raise CountError(f"collection did not finish cleanly (exit {returncode}): {tail}")
    return int(match["selected"] or match["collected"])


def floor_violation(count: int, floor: int) -> str | None:
    """Why `count` collected tests break the floor, or None when no test was dropped."""
    if count < floor:
        return f"{count} tests collected, below the floor of {floor}: {floor - count} dropped"
    return None


def collect(paths: list[str], cwd: Path, ignore: tuple[Path, ...] = ()) -> int:
    """How many tests pytest selects under `paths` (run from `cwd`, its options in effect)."""
    # --verbosity sets the level outright, whatever `-q` the project's addopts add.
    argv = [sys.executable, "-m", "pytest", "--collect-only", "--verbosity=-1", "-p", "no:cacheprovider"]
    argv += [*paths, *(f"--ignore={p}" for p in ignore)]
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)
    return selected_count(done.stdout + done.stderr, done.returncode)


# The `-m` of pyproject's addopts: the deselection `make test` applies.
DEFAULT_MARKS = "not slow"


def is_default_run(args_source: pytest.Config.ArgsSource, option: Any) -> bool:
    """Whether a session collected what `make test` collects: the testpaths, the project's
    `-m`, and no `-k`, `--deselect`, `--ignore`, last-failed or kept collection errors of its own."""
    return (
        args_source is pytest.Config.ArgsSource.TESTPATHS
        and option.markexpr == DEFAULT_MARKS
        and not option.keyword
        and not (option.deselect or option.ignore or option.ignore_glob)
        and not getattr(option, "lf", False)
        and not option.continue_on_collection_errors
    )


def counted(nodeids: Iterable[str]) -> int:
    """How many of a collection's node ids the floor counts: those under tests/, this file's excluded."""
    this = THIS.relative_to(ROOT).as_posix()
    return sum(1 for n in nodeids if n.startswith("tests/") and n.split("::")[0] != this)


def test_no_test_dropped(request: pytest.FixtureRequest) -> None:
    config = request.config
    if config.rootpath == ROOT and is_default_run(config.args_source, config.option):
        # Under xdist each worker collects the whole run (deselection applied) and runs its share.
        count = counted(item.nodeid for item in request.session.items)
    else:
        count = collect(["tests"], ROOT, ignore=(THIS,))
    assert floor_violation(count, read_floor(FLOOR_FILE)) is None, (
        f"{count} collected; floor {read_floor(FLOOR_FILE)}"
    )


# Controls: each way a count can be wrong is caught.


def test_control_fewer_tests_than_the_floor_fail() -> None:
    assert floor_violation(1319, 1320) == "1319 tests collected, below the floor of 1320: 1 dropped"
    assert floor_violation(1320, 1320) is None
    assert floor_violation(1400, 1320) is None


def test_control_a_planted_smaller_suite_is_caught(tmp_path: Path) -> None:
    (tmp_path / "test_two.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n")
    count = collect(["."], tmp_path)
    assert count == 2
    assert floor_violation(count, 3) is not None


def test_control_a_collection_error_is_no_count(tmp_path: Path) -> None:
    (tmp_path / "test_ok.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "test_broken.py").write_text("import no_such_module_kvretain\n\n\ndef test_b():\n    pass\n")
    with pytest.raises(CountError, match="did not finish cleanly"):
        collect(["."], tmp_path)


def test_control_only_a_default_run_counts_its_own_collection() -> None:
    testpaths, args = pytest.Config.ArgsSource.TESTPATHS, pytest.Config.ArgsSource.ARGS
    plain = dict(markexpr="not slow", keyword="", deselect=None, ignore=None, ignore_glob=None)
    plain |= dict(continue_on_collection_errors=False)
    assert is_default_run(testpaths, SimpleNamespace(**plain))
    assert not is_default_run(args, SimpleNamespace(**plain))  # paths named: a part of the suite
    for narrowed in (
        dict(markexpr=""),
        dict(markexpr="vllm"),
        dict(keyword="layers"),
        dict(deselect=["tests/test_cli.py"]),
        dict(ignore=["tests/test_cli.py"]),
        dict(ignore_glob=["*cli*"]),
        dict(continue_on_collection_errors=True),
        dict(lf=True),
    ):
        assert not is_default_run(testpaths, SimpleNamespace(**(plain | narrowed))), narrowed
    this = THIS.relative_to(ROOT).as_posix()
    ids = ["tests/test_a.py::test_x", "tests/test_a.py::test_y[1]", f"{this}::test_no_test_dropped"]
    assert counted([*ids, "docs/findings/test_f.py::test_z"]) == 2


def test_control_summary_lines() -> None:
    assert selected_count("a::b\n1320/1326 tests collected (6 deselected) in 9.10s\n", 0) == 1320
    assert selected_count("a::b\n\n1 test collected in 0.01s\n", 0) == 1
    with pytest.raises(CountError):
        selected_count("1 test collected, 1 error in 0.1s", 0)
    with pytest.raises(CountError):
        selected_count("no tests collected in 0.01s", 5)
    with pytest.raises(CountError):
        selected_count("", 0)


def test_control_floor_file_format(tmp_path: Path) -> None:
    good = tmp_path / "floor.txt"
    good.write_text("# comment\n1320\n")
    assert read_floor(good) == 1320
    for text in ("", "# only a comment\n", "12x\n", "1\n2\n", "-3\n"):
        bad = tmp_path / "bad.txt"
        bad.write_text(text)
        with pytest.raises(CountError):
            read_floor(bad)
    assert read_floor(FLOOR_FILE) > 0


def test_quick_profiles_shrink_but_skip_the_explain_phase() -> None:
    """The `dev` and `ci` profiles generate and shrink as before, without the explain phase
    (its re-runs only annotate a failure's report); `nightly` keeps it."""
    from hypothesis import Phase, settings

    for name in ("dev", "ci"):
        phases = set(settings.get_profile(name).phases)
        assert {Phase.generate, Phase.shrink} <= phases and Phase.explain not in phases, name
    assert Phase.explain in settings.get_profile("nightly").phases
