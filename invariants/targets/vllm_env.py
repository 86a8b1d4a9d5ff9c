"""Finding vLLM: is it importable, which version, and does it match what kvretain models.

kvretain's executable model predicts vLLM **0.33.0** (`docs/semantics.md`). Another
version may still run (the allocator's public methods change slowly), but a
disagreement with the model may then be version drift rather than a bug; the
one-line warning of `version_warning()` says so.

Nothing here imports vLLM at module import time: `vllm_available()` does it once,
on first call, and remembers the answer (importing vLLM takes seconds).

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


def vllm_version() -> str | None:
    """The installed vLLM version (package metadata, no import), or None."""
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


def probe_python(python: str, timeout: float = 120.0) -> tuple[bool, str, str | None]:
    """Ask another interpreter whether it can run the vLLM target.

    Returns (ok, one line, version). Used for `--vllm-python PATH`: the line says
    what is missing when ok is False.
    """
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE % (REQUIRED_MODULES,)],
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
        return False, f"--vllm-python {python}: vllm {version} cannot be imported: {info['error']}", version
    return True, f"vLLM {version} (python {info.get('python')} at {python})", version
