"""Every command the README shows runs, as written, so an example can never drift.

The convention (stated at the end of README.md): in a fenced block whose info
string is `console`, each line starting with `$ ` is a command (a trailing `\\`
continues it on the next line); every other line there is output. A command
ending in `# not run in CI: REASON` is not run, and REASON must be given: those
are counted and reported (a warning in the run's summary), never dropped
silently. The rest run in order, each under bash in one temporary directory
holding only a `.venv` link to this interpreter's environment (so `.venv/bin/...`
resolves as in a clone, and a trace one command writes is there for the next),
with this environment's `bin` taken off PATH (a bare `kvretain` would fail, as it
does after `make`) and `VLLM_PYTHON` set to this interpreter (the README's
stand-in for a user's vLLM environment). `--budget-s N` is capped at
`BUDGET_CAP_S`. Each must exit 0 within `TIMEOUT_S`.

Also held here: the README stays under `MAX_LINES` lines, its relative links (and
those of the docs pages it points to) name files and headings that exist, and the
runtime dependencies it tells a user to install are those `--vllm-python` asks for.
Each check has a control on a planted broken text.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from invariants.cli.main import runtime_requirements
from invariants.targets.vllm_env import vllm_available

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PROMPT = "$ "
NOT_RUN = "# not run in CI:"
BUDGET_CAP_S = 5
TIMEOUT_S = 240
MAX_LINES = 250
# The docs pages whose links are checked with the README's (the ones it sends a user to first).
LINKED_DOCS = ("docs/README.md", "docs/commands.md", "docs/reading-a-failure.md")


class ReadmeError(Exception):
    """The README breaks its own command convention (one line naming where)."""


@dataclass(frozen=True)
class Command:
    """One `$ ` command of a `console` block: the 1-based line it starts on, the
    command text, and why it is not run in CI (None: it runs)."""

    line: int
    text: str
    not_run: str | None


@dataclass(frozen=True)
class Outcome:
    """What running one command gave: its exit code, seconds and output's tail."""

    command: Command
    returncode: int
    seconds: float
    tail: str


def readme_commands(text: str) -> list[Command]:
    """The `$ ` commands of every `console` block of `text`, in order. A
    not-run marker without a reason, a continuation past the block's end, or an
    unclosed fence is a ReadmeError."""
    commands: list[Command] = []
    fence: str | None = None
    pending: tuple[int, str] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            if pending is not None:
                raise ReadmeError(f"README line {pending[0]}: a `\\` continuation runs past its block")
            fence = stripped[3:].strip() if fence is None else None
            continue
        if fence != "console":
            continue
        if pending is not None:
            start, head = pending
            joined = head + " " + stripped
            pending = (start, joined[:-1].rstrip()) if joined.endswith("\\") else None
            if pending is None:
                commands.append(_command(start, joined))
            continue
        if not raw.startswith(PROMPT):
            continue
        body = raw[len(PROMPT) :].rstrip()
        if body.endswith("\\"):
            pending = (number, body[:-1].rstrip())
        else:
            commands.append(_command(number, body))
    if fence is not None:
        raise ReadmeError(f"README: a ```{fence} block is never closed")
    return commands


def _command(line: int, body: str) -> Command:
    if NOT_RUN not in body:
        return Command(line, body.strip(), None)
    text, reason = body.split(NOT_RUN, 1)
    if not reason.strip():
        raise ReadmeError(f"README line {line}: '{NOT_RUN}' needs a reason after it")
    return Command(line, text.strip(), reason.strip())


def for_ci(text: str, cap_s: float = BUDGET_CAP_S) -> str:
    """`text` with every `--budget-s N` (or `=N`) above `cap_s` lowered to it."""

    def cap(match: re.Match[str]) -> str:
        value = float(match.group(2))
        return f"--budget-s{match.group(1)}{cap_s:g}" if value > cap_s else match.group(0)

    return re.sub(r"--budget-s([ =])(\d+(?:\.\d+)?)", cap, text)


def sandbox(directory: Path) -> dict[str, str]:
    """Make `directory` look like a clone's root to the commands (`.venv` linked
    to this environment) and return their environment."""
    (directory / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    venv_bin = str(Path(sys.prefix) / "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return dict(env, PATH=path, VLLM_PYTHON=sys.executable)


def run_commands(
    commands: list[Command], directory: Path, env: dict[str, str], timeout_s: float = TIMEOUT_S
) -> list[Outcome]:
    """Run the commands that are not marked not-run, in order, in `directory`;
    stop after the first that fails (the next may need what it writes)."""
    outcomes: list[Outcome] = []
    for command in commands:
        if command.not_run is not None:
            continue
        start = time.monotonic()
        try:
            proc = subprocess.run(
                ["bash", "-c", for_ci(command.text)],
                cwd=directory,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, output = 124, f"timed out after {timeout_s:.0f} s: {exc.output or ''}"
        outcomes.append(Outcome(command, rc, time.monotonic() - start, output[-1500:]))
        if rc != 0:
            break
    return outcomes


def failures(outcomes: list[Outcome]) -> list[str]:
    """One line per command that did not exit 0: its README line, text, exit code and output's tail."""
    return [
        f"README line {o.command.line}: `{o.command.text}` exited {o.returncode}:\n{o.tail}"
        for o in outcomes
        if o.returncode != 0
    ]


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def broken_links(text: str, base: Path) -> list[str]:
    """Relative Markdown links of `text` (resolved from `base`) naming a file that
    does not exist, or a `#anchor` that no heading of that Markdown file gives."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path_part, _, anchor = target.partition("#")
        path = (base / path_part) if path_part else None
        if path is not None and not path.exists():
            broken.append(target)
            continue
        if anchor:
            page = path.read_text() if path is not None and path.is_file() else text
            headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", page, flags=re.M)}
            if anchor not in headings:
                broken.append(target)
    return broken


def pin_mismatches(text: str, wanted: list[str]) -> list[str]:
    """The README's `pip install` commands naming a runtime dependency, where the
    set of requirements named differs from `wanted` (what `--vllm-python` asks for)."""
    names = {w.split("==")[0] for w in wanted}
    bad = []
    for command in readme_commands(text):
        if "pip install" not in command.text:
            continue
        words = command.text.split()
        named = [w for w in words if w.split("==")[0] in names]
        if named and sorted(named) != sorted(wanted):
            bad.append(f"README line {command.line}: installs {named}, --vllm-python asks for {wanted}")
    return bad


# ---------------------------------------------------------------- the README itself
def test_readme_commands_run(tmp_path):
    ok, reason = vllm_available()
    if not ok:
        pytest.skip(f"the README's commands judge vLLM: {reason}")
    commands = readme_commands(README.read_text())
    runnable = [c for c in commands if c.not_run is None]
    not_run = [c for c in commands if c.not_run is not None]
    # The fuzz/replay/export walk and the --vllm-python run at least: an empty list
    # would mean the convention broke, not that everything runs.
    assert len(runnable) >= 4, f"only {len(runnable)} runnable README command(s): {runnable}"
    assert any("--vllm-python" in c.text for c in runnable), "no README command runs --vllm-python"
    outcomes = run_commands(commands, tmp_path, sandbox(tmp_path))
    print(f"README: {len(commands)} command(s), {len(outcomes)} run, {len(not_run)} not run in CI")
    for o in outcomes:
        print(f"  line {o.command.line}: rc {o.returncode}, {o.seconds:.1f} s: {for_ci(o.command.text)}")
    for c in not_run:
        print(f"  line {c.line}: not run ({c.not_run}): {c.text}")
    if not_run:
        warnings.warn(
            f"README: {len(not_run)} of {len(commands)} command(s) not run in CI: "
            + "; ".join(f"line {c.line} ({c.not_run})" for c in not_run),
            stacklevel=1,
        )
    assert not failures(outcomes), "\n".join(failures(outcomes))
    assert len(outcomes) == len(runnable)


def test_readme_is_the_first_hour():
    assert len(README.read_text().splitlines()) <= MAX_LINES


def test_readme_links_resolve():
    bad = broken_links(README.read_text(), ROOT)
    for page in LINKED_DOCS:
        path = ROOT / page
        bad += [f"{page}: {b}" for b in broken_links(path.read_text(), path.parent)]
    assert not bad


def test_readme_installs_what_vllm_python_asks_for():
    text = README.read_text()
    assert any("pip install" in c.text for c in readme_commands(text))
    assert not pin_mismatches(text, runtime_requirements())


# ---------------------------------------------------------------- the convention, and controls
PLANTED = """
Some prose with `$ kvretain fuzz` inline, never run.

```sh
$ false   # a sh block is prose, not a command
```

```console
$ .venv/bin/kvretain fuzz --target model --steps 20 --seed 0
target  ...   (output lines are not commands)
$ .venv/bin/kvretain fuzz --target model \\
    --steps 20 --budget-secs 5
$ make verify   # not run in CI: the main job itself
```
"""


def test_extraction_follows_the_convention():
    commands = readme_commands(PLANTED)
    assert [(c.line, c.not_run) for c in commands] == [
        (9, None),
        (11, None),
        (13, "the main job itself"),
    ]
    assert commands[1].text == ".venv/bin/kvretain fuzz --target model --steps 20 --budget-secs 5"
    assert commands[2].text == "make verify"


def test_control_a_wrong_flag_fails_the_run(tmp_path):
    """A README example with a misspelt flag (`--budget-secs`) fails the run,
    naming its line; the correct command before it ran and passed."""
    outcomes = run_commands(readme_commands(PLANTED), tmp_path, sandbox(tmp_path))
    assert [o.returncode for o in outcomes] == [0, 2]
    (failure,) = failures(outcomes)
    assert failure.startswith("README line 11:") and "--budget-secs" in failure


def test_control_a_bare_kvretain_fails(tmp_path):
    """`kvretain` is not on PATH after `make`: an example that assumes it fails here too."""
    env = sandbox(tmp_path)
    elsewhere = shutil.which("kvretain", path=env["PATH"])
    if elsewhere:
        pytest.skip(f"a kvretain outside this environment is on PATH ({elsewhere})")
    planted = "```console\n$ kvretain --help\n```\n"
    outcomes = run_commands(readme_commands(planted), tmp_path, env)
    assert [o.returncode for o in outcomes] == [127]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("```console\n$ make test   # not run in CI:\n```\n", "needs a reason"),
        ("```console\n$ ls \\\n```\n", "runs past its block"),
        ("```console\n$ ls\n", "never closed"),
    ],
)
def test_control_malformed_blocks_are_refused(text, message):
    with pytest.raises(ReadmeError, match=message):
        readme_commands(text)


def test_budget_cap():
    assert (
        for_ci("kvretain fuzz --budget-s 300 --seed 0") == f"kvretain fuzz --budget-s {BUDGET_CAP_S} --seed 0"
    )
    assert for_ci("kvretain fuzz --budget-s=60") == f"kvretain fuzz --budget-s={BUDGET_CAP_S}"
    assert for_ci("kvretain fuzz --budget-s 2") == "kvretain fuzz --budget-s 2"


def test_control_length_and_links_and_pins(tmp_path):
    assert len(("line\n" * (MAX_LINES + 1)).splitlines()) > MAX_LINES
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Some section\n")
    text = "[ok](docs/page.md#some-section) [gone](docs/moved.md) [anchor](docs/page.md#no-such) [web](https://x.y)"
    assert broken_links(text, tmp_path) == ["docs/moved.md", "docs/page.md#no-such"]
    wanted = ["hypothesis==1.0", "z3-solver==2.0"]
    planted = "```console\n$ pip install hypothesis==0.9 z3-solver==2.0   # not run in CI: yours\n```\n"
    assert pin_mismatches(planted, wanted) and not pin_mismatches(planted.replace("0.9", "1.0"), wanted)
