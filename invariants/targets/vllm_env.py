"""Finding vLLM: is it importable, which version, and does it match what kvretain models.

kvretain's executable model predicts vLLM **0.33.0** (`docs/semantics.md`). Another
version may still run (the allocator's public methods change slowly), but a
disagreement with the model may then be version drift rather than a bug; the
one-line warning of `version_warning()` says so.

`prepare_release(version)` builds (once, cached) an isolated interpreter for
another release, for the release matrix and `--vllm-python`.

Nothing here imports vLLM at module import time: `vllm_available()` does it once,
on first call, and remembers the answer (importing vLLM takes seconds);
`vllm_modules()` then hands out the allocator's classes.

`probe_python(path)` asks another interpreter (a separate venv holding vLLM,
the CLI's `--vllm-python`) the same questions in a subprocess.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODELED_VERSION = "0.33.0"

# The modules the vLLM target needs; importing them is the availability test.
REQUIRED_MODULES = (
    "torch",
    "vllm.sampling_params",
    "vllm.utils.hashing",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.request",
    "vllm.distributed.kv_events",
)

INSTALL_HINT = (
    "install it with: pip install -r requirements/vllm.txt && "
    "pip install --no-deps -r requirements/vllm-nodeps.txt"
)


@functools.cache
def vllm_available() -> tuple[bool, str]:
    """(True, "vLLM X") when the allocator modules import, else (False, one reason line)."""
    version = vllm_version()
    if version is None:
        return False, f"vllm is not installed in {sys.executable}; {INSTALL_HINT}"
    # Quiet vLLM's logging (e.g. "Failed to reset prefix cache", an expected
    # outcome here) unless the user chose a level.
    user_level = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for name in REQUIRED_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # any import failure makes the target unavailable
            first = str(exc).splitlines()[0] if str(exc) else ""
            return (
                False,
                f"vllm {version} is installed but {name} cannot be imported: {type(exc).__name__}: {first}",
            )
    if user_level is None:
        logging.getLogger("vllm").setLevel(logging.ERROR)
    return True, f"vLLM {version}"


@functools.cache
def vllm_version() -> str | None:
    """The installed vLLM version (package metadata, no import), or None. Read once per
    process (every vLLM target asks; parsing the metadata was a quarter of building one)."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_warning(version: str | None = None) -> str | None:
    """One line when the vLLM found is not the version kvretain models, else None."""
    if version is None:
        version = vllm_version()
    if version is None or version == MODELED_VERSION:
        return None
    return (
        f"vLLM {version} found; kvretain models {MODELED_VERSION} semantics, "
        "a disagreement may be version drift"
    )


_PROBE = """
import importlib, importlib.metadata, json, os
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
out = {"python": __import__("sys").version.split()[0]}
try:
    out["version"] = importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    out["version"] = None
out["error"] = None
if out["version"] is not None:
    for name in %r:
        try:
            importlib.import_module(name)
        except Exception as exc:
            out["error"] = "%%s: %%s: %%s" %% (name, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            break
print(json.dumps(out))
"""


JUDGED_PYTHON_ENV = "KVRETAIN_VLLM_PYTHON"
"""Set by `--vllm-python PATH` for the command it re-runs: the interpreter whose vLLM is judged."""


def replay_command(trace: Path | str | None) -> str:
    """The command that replays `trace` on the vLLM this run judged: with `--vllm-python
    PATH` when the run was re-run under another interpreter (without it, replay would
    judge kvretain's own vLLM and could call the branch's violation clean)."""
    import shlex

    python = os.environ.get(JUDGED_PYTHON_ENV)
    return f"kvretain replay {trace}" + (f" --vllm-python {shlex.quote(python)}" if python else "")


def probe_python(
    python: str, timeout: float = 120.0, modules: tuple[str, ...] = REQUIRED_MODULES
) -> tuple[bool, str, str | None]:
    """Ask another interpreter whether it can run the vLLM target (import `modules`).

    Returns (ok, one line, version). Used for `--vllm-python PATH`: the line says
    what is missing when ok is False.
    """
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE % (modules,)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError:
        return False, f"--vllm-python {python}: no such interpreter", None
    except subprocess.TimeoutExpired:
        return False, f"--vllm-python {python}: importing vllm took more than {timeout:.0f} s", None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"--vllm-python {python}: probe failed ({tail})", None
    info = json.loads(lines[-1])
    version = info.get("version")
    if version is None:
        return False, f"--vllm-python {python}: vllm is not installed there; {INSTALL_HINT}", None
    if info.get("error"):
        return False, _import_failed(python, version, info["error"]), version
    return True, f"vLLM {version} (python {info.get('python')} at {python})", version


def _import_failed(python: str, version: str, error: str) -> str:
    return f"--vllm-python {python}: vllm {version} cannot be imported: {error}"


IMPORT_CHECK_ENV = "KVRETAIN_IMPORT_CHECK"
"""Set by `--vllm-python PATH` for the command it re-runs: check there, once, that vLLM
imports (the parent probed only its version, so vLLM is imported once per command, not twice)."""


def import_check_here(modules: tuple[str, ...] = REQUIRED_MODULES) -> str | None:
    """In the re-run command (`IMPORT_CHECK_ENV` set, then cleared so that the commands it
    starts do not check again): None when `modules` import in this interpreter, else the
    one line `probe_python` would have printed for them."""
    python = os.environ.pop(IMPORT_CHECK_ENV, None)
    if python is None:
        return None
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            version = importlib.metadata.version("vllm")
            return _import_failed(python, version, f"{name}: {type(exc).__name__}: {first}")
    return None


# ----------------------------------------------------------------------------- release environments
# Packages an older release's allocator imports that the pinned set lacks, found
# by trying the imports (module -> pip requirement, installed with --no-deps).
EXTRA_PACKAGES: dict[str, str] = {"gguf": "gguf==0.19.0", "einops": "einops==0.8.1"}
MAX_EXTRA_ROUNDS = 4
# What the vllm target (the real scheduler) imports beyond the allocator: its missing small
# packages are installed too (0.29.0 and 0.30.0 import `einops` there), but a scheduler
# that still does not import leaves the environment usable for vllm-manager.
SCHEDULER_MODULES = ("vllm.v1.core.sched.scheduler",)
# Stamps record the probe that made them: an environment stamped before the scheduler's
# modules were probed gets their extras on its next use.
STAMP_PROBE = "allocator+scheduler"


def cache_root() -> Path:
    """kvretain's cache (release environments, the stand-in model's configuration):
    $KVRETAIN_CACHE, else `kvretain` under $XDG_CACHE_HOME (an absolute path, as the XDG
    specification asks) or under ~/.cache."""
    if os.environ.get("KVRETAIN_CACHE"):
        return Path(os.environ["KVRETAIN_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return Path(xdg if os.path.isabs(xdg) else Path.home() / ".cache") / "kvretain"


@dataclass(frozen=True)
class ReleaseEnv:
    """An isolated interpreter holding one vLLM release in front of this
    interpreter's packages (torch and the small pins are shared, not copied)."""

    version: str
    root: Path
    python: Path
    install_s: float  # 0.0 when it was already there
    disk_bytes: int
    extras: tuple[str, ...]


class ReleaseEnvError(RuntimeError):
    """A release environment could not be prepared; the message is one line."""


def _site_dir(root: Path) -> Path:
    return root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def pip_install_target(site: Path, requirement: str, what: str | None = None) -> None:
    """`pip install --no-deps` of `requirement` into the directory `site` (a release
    environment's own site-packages); a failure raises `ReleaseEnvError` with pip's last line."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-compile",
            "--target",
            str(site),
            requirement,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip() and "is ignored" not in line]
        raise ReleaseEnvError(
            f"pip could not install {what or requirement}: {(lines or ['no output'])[-1].strip()}"
        )


def missing_module(ok: bool, line: str) -> str | None:
    """From an import probe's (ok, line): the top-level module it found not installed,
    None if the probe passed; any other failure raises `ReleaseEnvError`."""
    if ok:
        return None
    marker = "No module named "
    if marker in line:
        return line.split(marker, 1)[1].strip().strip("'\"").split(".")[0]
    raise ReleaseEnvError(line)


def _missing_module(python: Path) -> str | None:
    """The first module the release's allocator imports that is not installed, else None."""
    ok, line, _ = probe_python(str(python))
    return missing_module(ok, line)


def _scheduler_extras(python: Path, site: Path) -> list[str]:
    """Install the pinned extras the release's scheduler imports (`SCHEDULER_MODULES`);
    stop quietly at anything else (the vllm target then says why it cannot run)."""
    extras: list[str] = []
    for _ in range(MAX_EXTRA_ROUNDS):
        ok, line, _ = probe_python(str(python), modules=SCHEDULER_MODULES)
        marker = "No module named "
        missing = line.split(marker, 1)[1].strip().strip("'\"").split(".")[0] if marker in line else None
        if ok or missing not in EXTRA_PACKAGES:
            break
        pip_install_target(site, EXTRA_PACKAGES[missing], missing)
        extras.append(EXTRA_PACKAGES[missing])
    return extras


def prepare_release(version: str, root: Path | None = None) -> ReleaseEnv:
    """The environment of vLLM `version`, created on first use and reused after.

    A venv without pip whose own site-packages holds `vllm==version` (installed
    with --no-deps) and whatever extra small package its allocator imports, and a
    path file that puts this interpreter's site-packages behind it. A finished
    environment carries a stamp; a second call installs nothing.
    """
    import sysconfig
    import time
    import venv

    root = root or cache_root() / f"vllm-{version}"
    python = root / "bin" / "python"
    stamp = root / ".kvretain-ready"
    if stamp.exists():
        info = json.loads(stamp.read_text())
        if info.get("probe") != STAMP_PROBE:  # stamped before the scheduler's modules were probed
            info["extras"] = [*info["extras"], *_scheduler_extras(python, _site_dir(root))]
            info.update(probe=STAMP_PROBE, disk_bytes=_disk_bytes(root))
            stamp.write_text(json.dumps(info))
        return ReleaseEnv(version, root, python, 0.0, int(info["disk_bytes"]), tuple(info["extras"]))
    start = time.monotonic()
    if root.exists():  # a half-made environment from an interrupted run
        import shutil

        shutil.rmtree(root)
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    site = _site_dir(root)
    pip_install_target(site, f"vllm=={version}")
    (site / "kvretain-shared.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    extras: list[str] = []
    for _ in range(MAX_EXTRA_ROUNDS):
        missing = _missing_module(python)
        if missing is None:
            break
        if missing not in EXTRA_PACKAGES:
            raise ReleaseEnvError(
                f"vllm {version} needs module {missing!r}, which no pinned extra package provides"
            )
        pip_install_target(site, EXTRA_PACKAGES[missing], missing)
        extras.append(EXTRA_PACKAGES[missing])
    else:
        raise ReleaseEnvError(f"vllm {version} still misses modules after {MAX_EXTRA_ROUNDS} extra packages")
    extras += _scheduler_extras(python, site)
    disk = _disk_bytes(root)
    stamp.write_text(
        json.dumps({"version": version, "disk_bytes": disk, "extras": extras, "probe": STAMP_PROBE})
    )
    return ReleaseEnv(version, root, python, time.monotonic() - start, disk, tuple(extras))


def main(argv: list[str] | None = None) -> int:
    """`python -m invariants.targets.vllm_env VERSION...`: prepare each release's
    environment (cached; `make test` uses it). One line per release; exit 1 with
    the reason at the first that cannot be prepared."""
    for version in argv if argv is not None else sys.argv[1:]:
        try:
            env = prepare_release(version)
        except ReleaseEnvError as exc:
            print(f"vLLM {version}: {exc}", file=sys.stderr)
            return 1
        how = f"installed in {env.install_s:.0f} s" if env.install_s else "cached"
        print(f"vLLM {version}: {env.python} ({how}, {env.disk_bytes / 1e6:.0f} MB)")
    return 0


_MODULES: dict[str, Any] = {}  # filled on first use


def vllm_modules() -> dict[str, Any]:
    """vLLM's classes, imported once (after `vllm_available()` said they import)."""
    if _MODULES:
        return _MODULES
    import torch
    from vllm.distributed.kv_events import AllBlocksCleared as VAllBlocksCleared
    from vllm.distributed.kv_events import BlockRemoved as VBlockRemoved
    from vllm.distributed.kv_events import BlockStored as VBlockStored
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import Request, RequestStatus

    init_none_hash(sha256)
    _MODULES.update(
        torch=torch,
        BlockStored=VBlockStored,
        BlockRemoved=VBlockRemoved,
        AllBlocksCleared=VAllBlocksCleared,
        SamplingParams=SamplingParams,
        sha256=sha256,
        KVCacheManager=KVCacheManager,
        get_request_block_hasher=get_request_block_hasher,
        FullAttentionSpec=FullAttentionSpec,
        KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec,
        MambaSpec=MambaSpec,
        SlidingWindowSpec=SlidingWindowSpec,
        Request=Request,
        RequestStatus=RequestStatus,
    )
    return _MODULES


if __name__ == "__main__":
    sys.exit(main())
