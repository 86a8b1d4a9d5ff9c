"""CI's output (`make test`, run by `.ci/run`) names every skipped test's reason and
lists the slowest tests: pyproject's `addopts` carry `-r` with `s`, the Makefile's
`test` target `--durations`. Checked by running pytest under the project's own
configuration on a planted directory (one test passes, one skips with a reason); the
control turns the short summary off (`-rN`) and the reason is gone from the output."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLANTED = """import pytest


def test_passes():
    pass


@pytest.mark.skip(reason="planted reason 42")
def test_skipped():
    pass
"""


def make_test_flags() -> list[str]:
    """The `--durations` flags of the Makefile's `test` recipe (its pytest command line)."""
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), flags=re.M)
    assert recipe is not None, "the Makefile has no test target"
    (command,) = [line for line in recipe.group(1).splitlines() if "pytest" in line]
    return [word for word in command.split() if word.startswith("--durations")]


def _run(tmp_path: Path, *extra: str) -> str:
    (tmp_path / "test_planted.py").write_text(PLANTED)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "-n", "0"]
        + [*make_test_flags(), *extra, str(tmp_path / "test_planted.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_ci_output_names_skip_reasons_and_the_slowest_tests(tmp_path: Path) -> None:
    assert make_test_flags() == ["--durations=15"]
    out = _run(tmp_path)
    assert re.search(r"SKIPPED \[1\] .*test_planted\.py:\d+: planted reason 42", out), out
    assert "slowest 15 durations" in out, out


def test_control_without_the_short_summary_the_reason_is_gone(tmp_path: Path) -> None:
    out = _run(tmp_path, "-rN")
    assert "1 passed, 1 skipped" in out and "planted reason 42" not in out, out
