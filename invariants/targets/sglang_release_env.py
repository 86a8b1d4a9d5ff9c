"""Per-release SGLang environments for the release matrix (`kvretain matrix --engine sglang`).

`prepare_release(version)` builds, once, an isolated interpreter holding
`sglang==version` in front of this interpreter's packages, the way
`vllm_env.prepare_release` does for vLLM: a venv without pip whose own
site-packages holds SGLang (installed with `--no-deps`, so no torch or CUDA
kernel is ever pulled) and a path file that puts this interpreter's
site-packages (torch, transformers, msgspec and the small pins of
`requirements/sglang-nodeps.txt`) behind it. A package the release imports
that the shared set lacks is installed pinned from `EXTRA_PACKAGES`, never
unpinned. A finished environment carries a stamp; a second call installs
nothing. Environments live under `$KVRETAIN_CACHE` (or `~/.cache/kvretain`)
as `sglang-X.Y.Z`.

The availability probe runs `sglang_env.sglang_available` inside the release's
interpreter (the CPU stand-ins included), asking for the modules of the cache
families that release ships (`sglang_capabilities.family_modules`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from invariants.targets.vllm_env import (
    ReleaseEnv,
    ReleaseEnvError,
    cache_root,
    missing_module,
    pip_install_target,
)

# module -> pinned requirement, for a module an older release imports that the shared set lacks
EXTRA_PACKAGES: dict[str, str] = {}
MAX_EXTRA_ROUNDS = 4
REPO_ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
sys.path.insert(0, {root!r})
from invariants.targets.sglang_env import sglang_available, sglang_version
ok, line = sglang_available()
print(json.dumps({{"ok": ok, "line": line, "version": sglang_version()}}))
"""


def env_root(version: str) -> Path:
    """Where the environment of SGLang `version` lives."""
    return cache_root() / f"sglang-{version}"


def probe(python: str, timeout: float = 180.0) -> tuple[bool, str, str | None]:
    """(ok, one line, version) from `python`: can it import SGLang's radix caches?"""
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE.format(root=str(REPO_ROOT))],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError:
        return False, f"{python}: no such interpreter", None
    except subprocess.TimeoutExpired:
        return False, f"{python}: importing sglang took more than {timeout:.0f} s", None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"{python}: probe failed ({tail})", None
    info = json.loads(lines[-1])
    return bool(info["ok"]), str(info["line"]), info.get("version")


def _missing_module(python: Path) -> str | None:
    ok, line, _ = probe(str(python))
    return missing_module(ok, line)


def prepare_release(version: str, root: Path | None = None) -> ReleaseEnv:
    """The environment of SGLang `version`, created on first use and reused after."""
    import shutil
    import sysconfig
    import venv

    root = root or env_root(version)
    python = root / "bin" / "python"
    stamp = root / ".kvretain-ready"
    if stamp.exists():
        info = json.loads(stamp.read_text())
        return ReleaseEnv(version, root, python, 0.0, int(info["disk_bytes"]), tuple(info["extras"]))
    start = time.monotonic()
    if root.exists():  # a half-made environment from an interrupted run
        shutil.rmtree(root)
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    site = root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    pip_install_target(site, f"sglang=={version}")
    (site / "kvretain-shared.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    extras: list[str] = []
    for _ in range(MAX_EXTRA_ROUNDS):
        missing = _missing_module(python)
        if missing is None:
            break
        if missing not in EXTRA_PACKAGES:
            raise ReleaseEnvError(
                f"sglang {version} needs module {missing!r}, which no pinned extra package provides"
            )
        pip_install_target(site, EXTRA_PACKAGES[missing])
        extras.append(EXTRA_PACKAGES[missing])
    else:
        raise ReleaseEnvError(
            f"sglang {version} still misses modules after {MAX_EXTRA_ROUNDS} extra packages"
        )
    build_native_extensions(version, python)
    disk = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    stamp.write_text(json.dumps({"version": version, "disk_bytes": disk, "extras": extras}))
    return ReleaseEnv(version, root, python, time.monotonic() - start, disk, tuple(extras))


def release_env_vars(version: str, base: dict[str, str]) -> dict[str, str]:
    """`base` plus what a process of release `version` needs: its own directory for
    SGLang's JIT-built native extensions. Every release builds its KV-event hash
    extension under the same name from different sources, so sharing torch's default
    directory makes releases rebuild over each other (and fail when two build at once)."""
    out = dict(base)
    out.setdefault("TORCH_EXTENSIONS_DIR", str(env_root(version) / "torch_extensions"))
    return out


_BUILD = """
import importlib.util, sys
sys.path.insert(0, {root!r})
from invariants.targets.sglang_env import sglang_available
ok, line = sglang_available()
if not ok:
    raise SystemExit(line)
if importlib.util.find_spec("sglang.srt.mem_cache.cpp_utils.native_hash") is None:
    raise SystemExit(0)  # a release without the extension: nothing to build
from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module
_load_native_hash_module()
"""


def build_native_extensions(version: str, python: Path) -> bool:
    """Build the release's KV-event hash extension into its own directory now, so the
    first check does not spend its budget compiling. False when the build failed (the
    cache then fails its first event; the matrix reports it)."""
    proc = subprocess.run(
        [str(python), "-c", _BUILD.format(root=str(REPO_ROOT))],
        capture_output=True,
        text=True,
        env=release_env_vars(version, dict(os.environ)),
        timeout=600,
        check=False,
    )
    return proc.returncode == 0


def release_python(version: str) -> Path | None:
    """The interpreter of a prepared environment of `version`, or None (nothing is installed)."""
    root = env_root(version)
    return root / "bin" / "python" if (root / ".kvretain-ready").exists() else None


def main(argv: list[str] | None = None) -> int:
    """`python -m invariants.targets.sglang_release_env VERSION...`: prepare each release."""
    for version in argv if argv is not None else sys.argv[1:]:
        try:
            env = prepare_release(version)
        except ReleaseEnvError as exc:
            print(f"SGLang {version}: {exc}", file=sys.stderr)
            return 1
        how = f"installed in {env.install_s:.0f} s" if env.install_s else "cached"
        print(f"SGLang {version}: {env.python} ({how}, {env.disk_bytes / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
