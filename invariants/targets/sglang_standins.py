"""Stand-ins that let SGLang's radix cache import on a CPU-only machine.

SGLang 0.5.23 pulls in, on the import path of `unified_radix_cache`, four
modules that a CPU machine cannot or need not have. None of them is used by
the prefix cache, its allocators or its pools; each is replaced by an empty
module **in this process only** (entries in `sys.modules` and one import
finder), never installed into the environment:

| module       | why it is missing                       | who imports it                   |
|--------------|-----------------------------------------|----------------------------------|
| `torchvision`| PyPI wheels are CUDA builds (`torchvision::nms does not exist`) | `srt.multimodal.internvl_utils`, transformers' image utils |
| `sgl_kernel` | CUDA kernels; the CPU path imports one name | `kernels.ops.kvcache.cache_move` |
| `IPython`    | notebook display helpers                | `sglang.utils`                   |
| `datasets`   | only SGLang's own test kit              | `sglang.test`                    |

A stand-in is installed only when the real module cannot be found, so a
machine that has the real package keeps it. The stand-ins stay for the
process (SGLang imports more of itself later), so a probe another library
makes of them must get the answer "absent": `IPython.get_ipython()` is None
(and its `version_info` a tuple, which matplotlib compares before asking). Any attribute of a stand-in is an
inert placeholder class (attribute access and calls return placeholders);
calling into one from the cache would be a bug in the target, and the cache's
own code paths exercised by kvretain never do.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

# module name -> attributes it must carry by name (everything else is a placeholder)
STANDIN_ROOTS: dict[str, dict[str, Any]] = {
    "torchvision": {"__version__": "0.0.0+kvretain-standin"},
    "sgl_kernel": {},
    # Others probe `IPython.get_ipython()` to ask "am I in a notebook?" (matplotlib's
    # pyplot does on its first figure): the stand-in answers no.
    "IPython": {"get_ipython": lambda: None, "version_info": (0, 0, 0)},
    "datasets": {},
}


class _PlaceholderMeta(type):
    """Class-level attribute access answers a placeholder (`InterpolationMode.NEAREST`)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class Placeholder(metaclass=_PlaceholderMeta):
    """Any name of a stand-in module: constructible, callable, every attribute a placeholder."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Placeholder:
        return Placeholder()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder


def _module_getattr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return Placeholder


def _standin(name: str) -> types.ModuleType:
    module = types.ModuleType(name, "kvretain stand-in (invariants/targets/sglang_standins.py)")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []
    module.__dict__.update(STANDIN_ROOTS.get(name, {}))
    module.__getattr__ = _module_getattr  # type: ignore[method-assign]
    return module


class _StandinLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _standin(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _StandinFinder(importlib.abc.MetaPathFinder):
    """Answers `roots` and their submodules (`torchvision.transforms`) with stand-ins."""

    def __init__(self, roots: frozenset[str]) -> None:
        self.roots = roots

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, _StandinLoader(), is_package=True)


_installed: frozenset[str] | None = None


def install_standins() -> frozenset[str]:
    """Install stand-ins for the roots that cannot be found; idempotent. Returns the roots replaced."""
    global _installed
    if _installed is not None:
        return _installed
    missing = frozenset(
        root for root in STANDIN_ROOTS if root not in sys.modules and importlib.util.find_spec(root) is None
    )
    if missing:
        # First in line, but only for names nobody else can provide (checked above).
        sys.meta_path.insert(0, _StandinFinder(missing))
    _installed = missing
    return missing
