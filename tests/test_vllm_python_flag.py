"""`--vllm-python PATH`: shown where users look (`kvretain --help` and every
command's help), taken out before argparse in either spelling, refused in one
line when abbreviated, given twice or without a path, and refused with the pip
line to run when the other environment lacks kvretain's runtime dependencies; vLLM
imported there once, by the re-run command (which refuses in one line where it does not
import), not also by a probe."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import invariants.targets.vllm_env as vllm_env
from invariants.cli.main import (
    VLLM_PYTHON,
    add_vllm_python_flag,
    build_parser,
    main,
    runtime_requirements,
    split_vllm_python,
)
from invariants.errors import UsageError


def commands_without_flag(parser: argparse.ArgumentParser) -> list[str]:
    """The parser itself ("kvretain") and each command whose help does not show `--vllm-python`."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    parsers = {"kvretain": parser, **{n: p for s in subs for n, p in s.choices.items()}}
    return [name for name, p in parsers.items() if VLLM_PYTHON not in p.format_help()]


def test_every_command_shows_the_flag():
    parser = build_parser()
    assert not commands_without_flag(parser)
    assert "--vllm-python" in parser.format_help() and "Exit codes" in parser.format_help()


def test_control_a_command_without_the_flag_is_named():
    parser = argparse.ArgumentParser(prog="kvretain")
    add_vllm_python_flag(parser)
    sub = parser.add_subparsers()
    add_vllm_python_flag(sub.add_parser("fuzz"))
    sub.add_parser("planted")
    assert commands_without_flag(parser) == ["planted"]


def test_split_both_spellings():
    assert split_vllm_python(["fuzz", "--vllm-python", "/p/python", "--seed", "1"]) == (
        "/p/python",
        ["fuzz", "--seed", "1"],
    )
    assert split_vllm_python(["--vllm-python=/p/python", "verify"]) == ("/p/python", ["verify"])
    assert split_vllm_python(["fuzz"]) == (None, ["fuzz"])


@pytest.mark.parametrize(
    "args",
    [
        ["fuzz", "--vllm-python"],
        ["fuzz", "--vllm-python", "--seed", "1"],
        ["fuzz", "--vllm-python="],
        ["--vllm-python", "/a", "fuzz", "--vllm-python", "/b"],
    ],
)
def test_control_malformed_flag_is_refused(args):
    with pytest.raises(UsageError):
        split_vllm_python(args)


def test_abbreviation_is_refused(capsys):
    """argparse would expand `--vllm-pyth X` and run this interpreter's vLLM silently."""
    assert main(["fuzz", "--vllm-pyth", "/p/python", "--target", "model", "--steps", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "in full" in err[0]


def _fake_python(tmp_path: Path, import_rc: int) -> Path:
    """An "interpreter" that fails `-c` (the dependency check) with `import_rc`
    and records any other argv (and the judged interpreter it is told), exiting 0."""
    script = tmp_path / "python"
    log = tmp_path / "argv"
    script.write_text(
        f'#!/bin/sh\nif [ "$1" = "-c" ]; then exit {import_rc}; fi\necho "$@" > {log}\n'
        f'echo "${vllm_env.JUDGED_PYTHON_ENV}" > {tmp_path / "judged"}\nexit 0\n'
    )
    script.chmod(0o755)
    return script


def _probe_ok(monkeypatch):
    monkeypatch.setattr(vllm_env, "probe_python", lambda python, **_: (True, f"vLLM 9.9 at {python}", "9.9"))


def test_missing_runtime_dependencies_are_named(tmp_path, monkeypatch, capsys):
    _probe_ok(monkeypatch)
    python = _fake_python(tmp_path, import_rc=1)
    assert main(["fuzz", "--target", "vllm", f"--vllm-python={python}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "runtime dependencies" in err and f"-m pip install {' '.join(runtime_requirements())}" in err
    assert not (tmp_path / "argv").exists()


def test_control_with_dependencies_the_command_reruns_there(tmp_path, monkeypatch):
    """The same fake environment with its dependencies importable: the command runs
    under it, the flag taken out of its arguments."""
    _probe_ok(monkeypatch)
    python = _fake_python(tmp_path, import_rc=0)
    assert main(["fuzz", "--target", "vllm", "--vllm-python", str(python), "--seed", "3"]) == 0
    argv = (tmp_path / "argv").read_text().split()
    assert argv == ["-m", "invariants.cli.main", "fuzz", "--target", "vllm", "--seed", "3"]


def test_replay_hints_name_the_judged_interpreter(tmp_path, monkeypatch):
    """Under `--vllm-python PATH` the re-run command is told PATH, so the replay line a
    violation prints judges the same vLLM (bare, it would replay on kvretain's own vLLM
    and could call the branch's violation clean). Control: a run not re-run elsewhere
    prints the bare command."""
    _probe_ok(monkeypatch)
    python = _fake_python(tmp_path, import_rc=0)
    assert main(["fuzz", "--target", "vllm", "--vllm-python", str(python)]) == 0
    judged = (tmp_path / "judged").read_text().strip()
    assert judged == str(python)
    monkeypatch.setenv(vllm_env.JUDGED_PYTHON_ENV, judged)
    assert vllm_env.replay_command("t.json") == f"kvretain replay t.json --vllm-python {judged}"
    monkeypatch.delenv(vllm_env.JUDGED_PYTHON_ENV)
    assert vllm_env.replay_command("t.json") == "kvretain replay t.json"


def test_runtime_requirements_are_pinned_as_dev_txt_pins_them():
    """(The real re-run under another interpreter runs in tests/test_readme_commands.py.)"""
    dev = (Path(__file__).resolve().parents[1] / "requirements" / "dev.txt").read_text().splitlines()
    assert all(req in dev for req in runtime_requirements())
    assert [r.split("==")[0] for r in runtime_requirements()] == ["hypothesis", "z3-solver"]


def test_vllm_is_imported_once_by_the_rerun_command_not_by_the_probe(tmp_path, monkeypatch):
    """The parent asks the other interpreter for vLLM's version only (no module imported)
    and tells the re-run command to check the imports itself, which it needs anyway."""
    asked: list[tuple[str, ...]] = []

    def probe(python: str, modules: tuple[str, ...] = vllm_env.REQUIRED_MODULES) -> tuple[bool, str, str]:
        asked.append(modules)
        return True, f"vLLM 9.9 at {python}", "9.9"

    monkeypatch.setattr(vllm_env, "probe_python", probe)
    python = _fake_python(tmp_path, import_rc=0)
    (tmp_path / "python").write_text(
        (tmp_path / "python")
        .read_text()
        .replace("exit 0\n", f'echo "${vllm_env.IMPORT_CHECK_ENV}" > {tmp_path / "check"}\nexit 0\n')
    )
    assert main(["fuzz", "--target", "vllm", "--vllm-python", str(python)]) == 0
    assert asked == [()]
    assert (tmp_path / "check").read_text().strip() == str(python)


def test_the_rerun_command_refuses_in_one_line_where_vllm_does_not_import(monkeypatch, capsys):
    monkeypatch.setenv(vllm_env.IMPORT_CHECK_ENV, "/envs/branch/bin/python")
    original = vllm_env.import_check_here
    monkeypatch.setattr(
        vllm_env, "import_check_here", lambda: original(modules=("json", "kvretain_no_such_module"))
    )
    assert main(["fuzz", "--target", "model", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "--vllm-python /envs/branch/bin/python: vllm" in err[0] and "cannot be imported" in err[0]
    assert "kvretain_no_such_module: ModuleNotFoundError" in err[0]


def test_control_the_import_check_passes_where_the_modules_import_and_runs_once(monkeypatch):
    """Passes where they import; checks only in a re-run command, once (the variable is
    cleared, so the commands it starts do not check again)."""
    missing = ("kvretain_no_such_module",)
    monkeypatch.delenv(vllm_env.IMPORT_CHECK_ENV, raising=False)
    assert vllm_env.import_check_here(modules=missing) is None  # not a re-run command
    monkeypatch.setenv(vllm_env.IMPORT_CHECK_ENV, "/envs/branch/bin/python")
    assert vllm_env.import_check_here(modules=("json",)) is None
    assert vllm_env.IMPORT_CHECK_ENV not in __import__("os").environ
    assert vllm_env.import_check_here(modules=missing) is None
