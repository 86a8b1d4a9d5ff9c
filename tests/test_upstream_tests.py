"""`kvretain upstream-tests` (invariants.zoo.upstream): the pytest plugin really activates a
scheduler mutant inside the session, the verdicts follow the sessions, bad input is one line.

No network and no vLLM source tree: the upstream "tests" here are a tiny fake directory.
Each session is a fresh pytest process, and one that imports vLLM's scheduler costs about
10 s of CPU: the plugin test's fake test imports it in every session (the clean session
included, on the real unmutated vLLM); the recheck and hunt tests, which judge the
runner's logic across many sessions, use fake tests that read vLLM's scheduler only where
the session loaded it, which a mutant session always has (the plugin installs the mutant
on it before collection), so their sessions without a mutant start without vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from invariants.cli.main import main
from invariants.zoo import upstream

# Fails exactly when Scheduler.schedule is not the installed vLLM's own method.
FAKE_TEST = """
import sys

from vllm.v1.core.sched.scheduler import Scheduler


def test_schedule_is_vllms_own():
    code = Scheduler.schedule.__code__
    assert code.co_filename == sys.modules[Scheduler.__module__].__file__, code.co_filename
"""

# The same verdict, for a session that may not have loaded vLLM: without the module nothing
# can have replaced Scheduler.schedule (a mutant session always loads it, in the plugin).
LAZY_FAKE_TEST = """
import sys


def test_schedule_is_vllms_own():
    module = sys.modules.get("vllm.v1.core.sched.scheduler")
    if module is not None:
        code = module.Scheduler.schedule.__code__
        assert code.co_filename == module.__file__, code.co_filename
"""


@pytest.fixture(scope="module")
def fake_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("upstream")
    (root / "tests").mkdir()
    (root / "tests/test_fake_schedule.py").write_text(FAKE_TEST)
    return root


def test_plugin_activates_the_mutant_in_the_session(fake_tree: Path, tmp_path: Path) -> None:
    env = upstream.session_env(upstream.fake_hf_home(tmp_path / "hf"))
    clean = upstream.run_session(fake_tree, ["tests"], env, timeout_s=900)
    assert clean.rc == 0 and clean.passed == ["tests/test_fake_schedule.py::test_schedule_is_vllms_own"]
    assert not clean.applied and not clean.failed
    # A source mutant of Scheduler.schedule: the fake test must fail under it (the negative control).
    mutated = upstream.run_session(
        fake_tree, ["tests"], env, mutant="vllm:admission_drops_hit_tokens", timeout_s=900
    )
    assert mutated.applied and mutated.rc == 1, mutated.tail
    row = upstream.verdict("admission_drops_hit_tokens", "vllm", mutated)
    assert row.verdict == "caught"
    assert row.caught_by == "tests/test_fake_schedule.py::test_schedule_is_vllms_own"
    assert "kvretain mutant of Scheduler.schedule" in row.reason
    # The control's failures are deselected from a mutant session: nothing left to catch it.
    spared = upstream.run_session(
        fake_tree,
        ["tests"],
        env,
        mutant="vllm:admission_drops_hit_tokens",
        deselect=["tests/test_fake_schedule.py::test_schedule_is_vllms_own"],
        timeout_s=900,
    )
    assert spared.applied and not spared.failed and not spared.passed
    assert upstream.verdict("admission_drops_hit_tokens", "vllm", spared).verdict == "error"


def test_recheck_keeps_only_catches_that_reproduce_alone(tmp_path: Path) -> None:
    """A catch stands when its test passes without the mutant and fails alone under it;
    one failing unmutated too, or passing alone under the mutant (a timeout under load
    was once counted a catch), is flaky."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_pair.py").write_text(
        "def test_good():\n    pass\n\n\ndef test_bad():\n    assert 0\n"
    )
    (tmp_path / "tests/test_fake_schedule.py").write_text(LAZY_FAKE_TEST)
    mutant = "admission_drops_hit_tokens"
    rows = [
        upstream.MutantRow(
            mutant, "vllm", "caught", caught_by="tests/test_fake_schedule.py::test_schedule_is_vllms_own"
        ),
        upstream.MutantRow("b", "vllm", "caught", caught_by="tests/test_pair.py::test_bad"),
        upstream.MutantRow(mutant, "vllm", "caught", caught_by="tests/test_pair.py::test_good"),
        upstream.MutantRow("c", "vllm", "missed"),
    ]
    upstream.recheck(tmp_path, upstream.session_env(tmp_path / "hf"), rows, timeout_s=600)
    assert [r.verdict for r in rows] == ["caught", "flaky", "flaky", "missed"]
    assert "fails without the mutant too" in rows[1].reason
    assert "passes re-run alone under the mutant" in rows[2].reason


def test_verdicts() -> None:
    s = upstream.Session
    assert upstream.verdict("m", "t", s(rc=0, seconds=1, passed=["a"], applied=True)).verdict == "missed"
    caught = upstream.verdict("m", "t", s(rc=1, seconds=1, failed={"x::y": "call: boom"}, applied=True))
    assert (caught.verdict, caught.caught_by) == ("caught", "x::y")
    # A green session whose mutant was never installed proves nothing.
    assert upstream.verdict("m", "t", s(rc=0, seconds=1, passed=["a"], applied=False)).verdict == "stale"
    assert upstream.verdict("m", "t", s(rc=-1, seconds=9, applied=True)).verdict == "hung"
    assert upstream.verdict("m", "t", s(rc=2, seconds=1, applied=True)).verdict == "error"
    # A green session in which no test ran is no evidence either.
    assert upstream.verdict("m", "t", s(rc=0, seconds=1, applied=True)).verdict == "error"


def test_fake_hf_cache_resolves_offline(tmp_path: Path) -> None:
    from huggingface_hub import try_to_load_from_cache

    hub = upstream.fake_hf_home(tmp_path) / "hub"
    for name, config in upstream.MODELS.items():
        found = try_to_load_from_cache(name, "config.json", cache_dir=hub)
        assert isinstance(found, str) and json.loads(Path(found).read_text()) == config


@pytest.mark.parametrize(
    "argv, message",
    [
        (["/nonexistent-kvretain-dir"], "not a directory"),
        (["{tmp}"], "no tests/v1/core/utils.py"),
        (["{tree}", "--files", "vllm/v1"], "not under tests/"),
        (["{tree}", "--files", "tests/v1/core/test_missing.py"], "missing tests/v1/core/test_missing.py"),
        (["{tree}", "--only", "no_such_mutant"], "no scheduler mutant named no_such_mutant"),
        (["{tree}", "--pythonpath", "/nonexistent-kvretain-dir"], "not a directory"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = tmp_path / "tree"
    (tree / "tests/v1/core").mkdir(parents=True)
    (tree / "tests/v1/core/utils.py").write_text("")
    args = [a.format(tmp=tmp_path, tree=tree) for a in argv]
    assert main(["upstream-tests", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and message in err


ORDER_A = """
import builtins


def test_a_runs_first():
    builtins._kvretain_ran_a = True
"""
# Fails under a mutant only after test_a ran in the same session: an order dependence.
# (vLLM's scheduler read only where the session loaded it, as in LAZY_FAKE_TEST.)
ORDER_B = """
import builtins
import sys


def test_b_depends_on_order():
    module = sys.modules.get("vllm.v1.core.sched.scheduler")
    mutated = module is not None and module.Scheduler.schedule.__code__.co_filename != module.__file__
    assert not (mutated and getattr(builtins, "_kvretain_ran_a", False))
"""


def test_a_flaky_first_failure_is_hunted_again_without_it(tmp_path: Path) -> None:
    """A mutant session stopped by a failure that does not reproduce alone (here an order
    dependence) is run again without that test: the row's verdict is the second run's,
    naming the flaky test, not "flaky" with the rest of the suite unrun."""
    root = tmp_path / "tree"
    (root / "tests/v1/core").mkdir(parents=True)
    (root / "tests/v1/core/utils.py").write_text("")  # what marks a vLLM tree
    (root / "tests/test_a_order.py").write_text(ORDER_A)
    (root / "tests/test_b_order.py").write_text(ORDER_B)
    (root / "tests/test_fake_schedule.py").write_text(LAZY_FAKE_TEST)
    report = upstream.run_upstream(root, files=["tests"], only=["admission_drops_hit_tokens"], timeout_s=600)
    [row] = report.rows
    assert (row.verdict, row.caught_by) == (
        "caught",
        "tests/test_fake_schedule.py::test_schedule_is_vllms_own",
    )
    assert "re-run without tests/test_b_order.py::test_b_depends_on_order" in row.reason
    assert "passes re-run alone under the mutant" in row.reason
