"""Finding SGLang: is its radix cache importable on this machine, and which version.

kvretain's radix model (`model/radix/`) describes SGLang **0.5.23**'s
`UnifiedRadixCache`. Importing it on a CPU needs two environment variables
(`SGLANG_USE_CPU_ENGINE=1`, `HF_HUB_OFFLINE=1`, set here only when the user
has not set them) and the stand-ins of `sglang_standins` for modules the cache
never uses. Importing takes about ten seconds, so it happens once, on the
first call of `sglang_available()`, and the answer is remembered.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import os
import sys
import warnings

from invariants.targets.sglang_standins import install_standins

MODELED_VERSION = "0.5.23"

# The modules the SGLang target drives; importing them is the availability test.
REQUIRED_MODULES = (
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.mem_cache.allocator.swa",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.swa_memory_pool",
    "sglang.srt.mem_cache.common",
    "sglang.srt.mem_cache.allocation",
    "sglang.srt.managers.schedule_batch",
)

INSTALL_HINT = "install it with: make setup (pip install --no-deps -r requirements/sglang-nodeps.txt)"


def sglang_version() -> str | None:
    """The installed SGLang version (package metadata, no import), or None."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def sglang_available() -> tuple[bool, str]:
    """(True, "SGLang X") when the radix cache imports, else (False, one reason line)."""
    version = sglang_version()
    if version is None:
        return False, f"sglang is not installed in {sys.executable}; {INSTALL_HINT}"
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    install_standins()
    with warnings.catch_warnings():
        # "Only CUDA ... support AWQ/GGUF": expected on a CPU, irrelevant to the cache.
        warnings.simplefilter("ignore")
        for name in REQUIRED_MODULES:
            try:
                importlib.import_module(name)
            except Exception as exc:  # any import failure makes the target unavailable
                first = str(exc).splitlines()[0] if str(exc) else ""
                return False, (
                    f"sglang {version} is installed but {name} cannot be imported: {type(exc).__name__}: {first}"
                )
    # "Prefill out of memory" is logged at ERROR; the target reports rejections itself.
    logging.getLogger("sglang").setLevel(logging.CRITICAL)
    return True, f"SGLang {version}"


def version_warning() -> str | None:
    """One line when the installed SGLang is not the release the radix model describes."""
    version = sglang_version()
    if version is None or version == MODELED_VERSION:
        return None
    return (
        f"warning: kvretain's radix model describes SGLang {MODELED_VERSION}; installed is {version} "
        "(a disagreement may be version drift)"
    )
