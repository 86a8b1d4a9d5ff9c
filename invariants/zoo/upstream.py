"""vLLM's own tests against kvretain's scheduler mutants: which ones upstream catches.

The zoo's scheduler mutants claim to be defects "vLLM's own tests do not catch".
This module checks the claim: it runs the `tests/v1/core/` files of a vLLM source
tree (a checkout or the release's sdist, which ships `tests/`) once without a
mutant (the control) and once per mutant, with the mutant active inside the
pytest process (`invariants.zoo.upstream_plugin`, loaded with `-p`).

Offline on the CPU: vLLM's helpers build a `ModelConfig` from a hub name
(`facebook/opt-125m`); a fake Hugging Face cache (`HF_HOME`, `HF_HUB_OFFLINE=1`)
holds a small `config.json` for each name in `MODELS`, and no tokenizer is loaded
(the helpers never ask for one). `VLLM_TARGET_DEVICE=cpu` lets `DeviceConfig`
resolve on a machine without a GPU. vLLM's root `tests/conftest.py` (engines,
images, HTTP) is not loaded (`--noconftest`); the core tests use none of its
fixtures. Only the tree's `tests/` is copied (to a temporary directory) and run:
a checkout's `vllm/` beside it would shadow the installed vLLM, which is the one
under test.

Verdicts, per mutant:
- caught: a test that passed in the control fails under the mutant (named);
- missed: every test that passed in the control passes under the mutant, and the
  plugin proved the mutant was installed;
- stale: the mutant could not be installed on this vLLM (session aborted);
- hung: the session ran past the timeout (reported, not counted as caught);
- flaky: the catch does not reproduce: the catching test also fails re-run without
  the mutant (every catching test, in one session at the end), or passes re-run
  alone under its mutant (a timeout on a loaded machine, an order dependence).
  The mutant's session is then run once more without that test, and that run's
  verdict (rechecked the same way) is the row's, naming the flaky test.
Tests that fail or error in the control (they need a GPU, Triton, the network,
a tokenizer...) are deselected from every mutant run and listed with why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from invariants.zoo import upstream_plugin as plugin

# vLLM's tests of the scheduler, its allocator and their helpers (test_scheduler.py,
# test_async_scheduler.py, test_prefix_caching.py, ...): the whole directory.
DEFAULT_FILES = ("tests/v1/core",)

# Hub names the core tests build a ModelConfig from -> a small config.json (no weights).
# Not here: llava-hf/llava-1.5-7b-hf and Qwen/Qwen2.5-VL-3B-Instruct (vLLM cannot inspect
# their multimodal model classes on this CPU build even with a config), and the e2e tests'
# models (they load weights); their tests are listed as not run.
MODELS: dict[str, dict[str, Any]] = {
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": 768,
        "word_embed_proj_dim": 768,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "ffn_dim": 3072,
        "vocab_size": 50272,
        "max_position_embeddings": 2048,
        "torch_dtype": "float16",
        "bos_token_id": 2,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "do_layer_norm_before": True,
        "activation_function": "relu",
    },
    "facebook/opt-350m": {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": 1024,
        "word_embed_proj_dim": 512,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "ffn_dim": 4096,
        "vocab_size": 50272,
        "max_position_embeddings": 2048,
        "torch_dtype": "float16",
        "bos_token_id": 2,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "do_layer_norm_before": False,
        "activation_function": "relu",
    },
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 28,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}
_FAKE_REVISION = "0" * 40


class UpstreamError(ValueError):
    """Bad input for an upstream run (one line)."""


@dataclass
class Session:
    """One pytest session over the upstream files."""

    rc: int
    seconds: float
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # node id -> the exception line
    skipped: dict[str, str] = field(default_factory=dict)
    uncollectable: dict[str, str] = field(default_factory=dict)  # test file -> import error
    applied: bool = False
    tail: str = ""


@dataclass
class MutantRow:
    name: str
    target: str
    verdict: str  # caught | missed | flaky | stale | hung | error
    caught_by: str = ""
    reason: str = ""
    seconds: float = 0.0
    passed: int = 0  # tests that passed under the mutant


@dataclass
class UpstreamReport:
    root: str
    vllm_version: str
    vllm_commit: str
    tests_commit: str
    files: tuple[str, ...]
    control_passed: int
    control_seconds: float
    not_run: dict[str, str]  # failed/errored without a mutant: node id -> why
    uncollectable: dict[str, str]  # test files that cannot be imported here -> why
    skipped: dict[str, str]
    rows: list[MutantRow]

    def counts(self) -> dict[str, int]:
        out = {v: 0 for v in ("caught", "missed", "flaky", "stale", "hung", "error")}
        for r in self.rows:
            out[r.verdict] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["counts"] = self.counts()
        return d


def locate(root: Path, files: Sequence[str] = DEFAULT_FILES) -> tuple[str, ...]:
    """The upstream files under `root` (a vLLM source tree; all under its tests/);
    UpstreamError names what is missing."""
    if not root.is_dir():
        raise UpstreamError(f"{root}: not a directory (give a vLLM checkout or unpacked sdist)")
    if not (root / "tests/v1/core/utils.py").is_file():
        raise UpstreamError(f"{root}: no tests/v1/core/utils.py (give a vLLM checkout or unpacked sdist)")
    outside = [f for f in files if Path(f).parts[:1] != ("tests",)]
    if outside:
        raise UpstreamError(f"{', '.join(outside)}: not under tests/")
    missing = [f for f in files if not (root / f).exists()]
    if missing:
        raise UpstreamError(f"{root}: missing {', '.join(missing)}")
    return tuple(files)


def tests_commit(root: Path) -> str:
    """The tree's vLLM commit: `git rev-parse HEAD`, else the sdist's `vllm/_version.py`."""
    if (root / ".git").exists():
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        if out.returncode == 0:
            return out.stdout.strip()
    version = root / "vllm/_version.py"
    if version.is_file():
        m = re.search(r"__commit_id__ = commit_id = '([^']*)'", version.read_text())
        v = re.search(r"__version__ = version = '([^']*)'", version.read_text())
        if m:
            return f"{m.group(1)} (sdist {v.group(1) if v else '?'})"
    return "unknown"


def fake_hf_home(dest: Path) -> Path:
    """A Hugging Face cache under `dest` holding `MODELS`' config.json files (nothing else)."""
    for name, config in MODELS.items():
        repo = dest / "hub" / f"models--{name.replace('/', '--')}"
        snapshot = repo / "snapshots" / _FAKE_REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs/main").write_text(_FAKE_REVISION)
        (snapshot / "config.json").write_text(json.dumps(config))
    return dest


def session_env(hf_home: Path, pythonpath: Sequence[str] = ()) -> dict[str, str]:
    """The environment of an offline CPU session; this kvretain first on the path."""
    kvretain_root = str(Path(__file__).resolve().parents[2])
    paths = [kvretain_root, *pythonpath, os.environ.get("PYTHONPATH", "")]
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in paths if p),
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",
    )


def run_session(
    root: Path,
    files: Sequence[str],
    env: dict[str, str],
    *,
    mutant: str | None = None,
    deselect: Sequence[str] = (),
    ignore: Sequence[str] = (),
    stop_first: bool = True,
    timeout_s: float = 1800.0,
    python: str = sys.executable,
) -> Session:
    """Run pytest on `files` in `root` (mutant `<target>:<name>` active if given)."""
    with tempfile.TemporaryDirectory(prefix="kvretain-upstream-") as tmp:
        log, applied, drop = Path(tmp, "log.jsonl"), Path(tmp, "applied"), Path(tmp, "deselect")
        drop.write_text("\n".join(deselect))
        env = dict(env, **{plugin.ENV_LOG: str(log), plugin.ENV_DESELECT: str(drop)})
        env.pop(plugin.ENV_MUTANT, None)
        if mutant is not None:
            env.update({plugin.ENV_MUTANT: mutant, plugin.ENV_APPLIED: str(applied)})
        cmd = [python, "-m", "pytest", "--noconftest", "-q", "-p", "no:cacheprovider"]
        cmd += ["-p", "invariants.zoo.upstream_plugin", *(f"--ignore={f}" for f in ignore)]
        cmd += ["-x"] if stop_first else ["--continue-on-collection-errors"]
        cmd += list(files)
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-4000:]
        except subprocess.TimeoutExpired:
            rc, tail = -1, f"timed out after {timeout_s:.0f}s"
        session = Session(rc, time.monotonic() - start, applied=applied.is_file(), tail=tail)
        for line in log.read_text().splitlines() if log.is_file() else ():
            rec = json.loads(line)
            if rec["when"] == "collect":
                session.uncollectable[rec["nodeid"]] = rec["reason"]
            elif rec["outcome"] == "passed":
                session.passed.append(rec["nodeid"])
            elif rec["outcome"] == "skipped":
                session.skipped[rec["nodeid"]] = rec["reason"]
            else:
                session.failed.setdefault(rec["nodeid"], f"{rec['when']}: {rec['reason']}")
    return session


def verdict(name: str, target: str, s: Session) -> MutantRow:
    """What one mutant session says: the first failing test, or a proven-active green."""
    row = MutantRow(name, target, "error", seconds=s.seconds, passed=len(s.passed))
    if s.rc == -1:
        row.verdict, row.reason = "hung", s.tail
    elif not s.applied:
        row.verdict, row.reason = "stale", _last_error(s.tail)
    elif s.failed:
        nodeid, why = next(iter(s.failed.items()))
        row.verdict, row.caught_by, row.reason = "caught", nodeid, why
    elif s.rc == 0 and s.passed:
        row.verdict = "missed"
    elif s.rc == 0:
        row.reason = "no test ran"
    else:
        row.reason = f"pytest exit {s.rc}: {_last_error(s.tail)}"
    return row


def recheck(
    root: Path,
    env: dict[str, str],
    rows: list[MutantRow],
    *,
    timeout_s: float = 1800.0,
    log: Callable[[str], None] = lambda line: None,
) -> None:
    """A catch must reproduce alone: its test passes re-run without a mutant (every
    catching test, in one session) and fails re-run alone under its mutant. A row where
    either does not hold is "flaky", not a catch (a timeout on a loaded machine, an
    order dependence between tests)."""
    catchers = sorted({r.caught_by for r in rows if r.verdict == "caught"})
    if not catchers:
        return
    s = run_session(root, catchers, env, stop_first=False, timeout_s=timeout_s)
    log(f"recheck without a mutant: {len(s.passed)} of {len(catchers)} catching tests pass")
    for r in rows:
        if r.verdict == "caught" and r.caught_by not in s.passed:
            r.verdict, r.reason = "flaky", f"fails without the mutant too: {s.failed.get(r.caught_by, s.rc)}"
    caught = [r for r in rows if r.verdict == "caught"]
    for r in caught:
        alone = run_session(
            root, [r.caught_by], env, mutant=f"{r.target}:{r.name}", stop_first=False, timeout_s=timeout_s
        )
        if r.caught_by in alone.failed:
            continue
        if alone.applied and r.caught_by in alone.passed:
            r.verdict, r.reason = "flaky", f"passes re-run alone under the mutant (it failed with {r.reason})"
        else:  # the re-run proved nothing either way: the catch stands, said so
            r.reason += f" (its re-run alone under the mutant did not run: pytest exit {alone.rc})"
    log(
        f"recheck under each mutant: {sum(r.verdict == 'caught' for r in caught)} of {len(caught)} catches reproduce"
    )


def _last_error(tail: str) -> str:
    lines = [ln.strip() for ln in tail.splitlines() if "Error" in ln or "error" in ln]
    return lines[-1] if lines else (tail.strip().splitlines() or [""])[-1]


def scheduler_mutants(only: Sequence[str] = ()) -> list[tuple[str, str]]:
    """(target, name) of every scheduler mutant, sync then async; `only` filters by name."""
    from invariants.zoo.mutants_scheduler import ASYNC_SCHEDULER_MUTANTS, SCHEDULER_MUTANTS

    pairs = [("vllm", n) for n in SCHEDULER_MUTANTS]
    pairs += [("vllm-async-scheduler", n) for n in ASYNC_SCHEDULER_MUTANTS]
    if only:
        unknown = sorted(set(only) - {n for _, n in pairs})
        if unknown:
            raise UpstreamError(f"no scheduler mutant named {', '.join(unknown)}")
        pairs = [p for p in pairs if p[1] in only]
    return pairs


def run_upstream(
    root: Path,
    *,
    files: Sequence[str] = DEFAULT_FILES,
    only: Sequence[str] = (),
    pythonpath: Sequence[str] = (),
    timeout_s: float = 1800.0,
    log: Callable[[str], None] = lambda line: None,
) -> UpstreamReport:
    """The control session, then one session per mutant (the control's failures deselected)."""
    import vllm

    files = locate(root, files)
    mutants = scheduler_mutants(only)
    with tempfile.TemporaryDirectory(prefix="kvretain-upstream-") as work:
        env = session_env(fake_hf_home(Path(work, "hf")), pythonpath)
        stage = Path(work, "tree")
        # Only tests/ is copied: a source tree's vllm/ next to it would shadow the installed vLLM.
        shutil.copytree(root / "tests", stage / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        log(f"control: {' '.join(files)}, no mutant")
        control = run_session(stage, files, env, stop_first=False, timeout_s=timeout_s)
        if control.rc not in (0, 1) or not control.passed:
            raise UpstreamError(
                f"the control session did not run (pytest exit {control.rc}): {_last_error(control.tail)}"
            )
        log(
            f"control: {len(control.passed)} passed, {len(control.failed)} cannot run, {control.seconds:.0f}s"
        )

        def hunt(target: str, name: str, skip: Sequence[str] = ()) -> MutantRow:
            s = run_session(
                stage,
                files,
                env,
                mutant=f"{target}:{name}",
                deselect=[*control.failed, *skip],
                ignore=list(control.uncollectable),
                timeout_s=timeout_s,
            )
            row = verdict(name, target, s)
            log(f"{name}: {row.verdict} {row.caught_by} ({s.seconds:.0f}s)")
            return row

        rows = [hunt(target, name) for target, name in mutants]
        recheck(stage, env, rows, timeout_s=timeout_s, log=log)
        # A flaky first failure stopped its session before the other tests ran: run them.
        for i, r in enumerate(rows):
            if r.verdict == "flaky":
                again = hunt(r.target, r.name, skip=[r.caught_by])
                recheck(stage, env, [again], timeout_s=timeout_s, log=log)
                again.reason = f"{again.reason} (re-run without {r.caught_by}, flaky: {r.reason})".lstrip()
                rows[i] = again
    return UpstreamReport(
        root=str(root),
        vllm_version=vllm.__version__,
        vllm_commit=_installed_commit(),
        tests_commit=tests_commit(root),
        files=tuple(files),
        control_passed=len(control.passed),
        control_seconds=round(control.seconds, 1),
        not_run=control.failed,
        uncollectable=control.uncollectable,
        skipped=control.skipped,
        rows=rows,
    )


def _installed_commit() -> str:
    try:
        from vllm._version import __commit_id__

        return str(__commit_id__)
    except ImportError:
        return "unknown"


def render(report: UpstreamReport) -> str:
    """The table (mutant | vLLM's tests | verdict), the counts, the commits, what could not run."""
    from invariants.report import table

    lines = [
        f"vLLM {report.vllm_version} installed (commit {report.vllm_commit}); tests from {report.root} "
        f"(commit {report.tests_commit})",
        f"files: {' '.join(report.files)}",
        f"control (no mutant): {report.control_passed} passed, {len(report.not_run)} cannot run here, "
        f"{len(report.skipped)} skipped, {len(report.uncollectable)} test files cannot be imported, "
        f"{report.control_seconds:.0f}s",
        "",
    ]
    body = [
        [
            r.name,
            r.target,
            r.caught_by or r.reason or f"all {r.passed} passed",
            r.verdict,
            f"{r.seconds:.0f}s",
        ]
        for r in report.rows
    ]
    lines.append(table(["mutant", "target", "vLLM's tests", "verdict", "time"], body))
    c = report.counts()
    lines.append(
        f"{len(report.rows)} mutants: {c['missed']} missed by vLLM's tests, {c['caught']} caught"
        + "".join(f", {c[k]} {k}" for k in ("flaky", "stale", "hung", "error") if c[k])
    )
    for path, why in sorted(report.uncollectable.items()):
        lines.append(f"not imported (ignored): {path}: {why}")
    if report.not_run:
        lines.append(f"not run ({len(report.not_run)}: they fail without any mutant here, deselected):")
        lines += [f"  {nodeid}: {why}" for nodeid, why in sorted(report.not_run.items())]
    return "\n".join(lines)
