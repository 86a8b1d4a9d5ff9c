"""Target registry: name -> factory. Imports are lazy so a missing optional
allocator (vLLM) only matters when it is asked for."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from invariants.targets.base import Target, TargetCrash, TargetUnavailable
from model.config import Config

_TARGETS: dict[str, tuple[str, str]] = {
    "model": ("invariants.targets.model_target", "ModelTarget"),
    "reference": ("invariants.targets.reference", "ReferenceTarget"),
    "vllm": ("invariants.targets.vllm_target", "VllmTarget"),
}
TARGET_NAMES = tuple(_TARGETS)
# Targets that implement the #40676 pinned tier (vLLM never merged it).
PINNING_TARGETS = {"model", "reference"}


def target_factory(name: str) -> Callable[[Config], Target]:
    """The constructor of target `name`; TargetUnavailable if it cannot load."""
    if name not in _TARGETS:
        raise TargetUnavailable(f"unknown target {name!r} (known: {', '.join(TARGET_NAMES)})")
    module_name, cls_name = _TARGETS[name]
    if name == "vllm":
        from invariants.targets.vllm_env import vllm_available

        ok, reason = vllm_available()
        if not ok:
            raise TargetUnavailable(reason)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetUnavailable(f"target {name!r} cannot be imported: {exc}") from None
    factory: Callable[[Config], Target] = getattr(module, cls_name)
    return factory


def available_targets() -> dict[str, str | None]:
    """name -> None when usable, else the one-line reason it is not."""
    out: dict[str, str | None] = {}
    for name in TARGET_NAMES:
        try:
            target_factory(name)
            out[name] = None
        except TargetUnavailable as exc:
            out[name] = str(exc)
    return out


__all__ = [
    "PINNING_TARGETS",
    "TARGET_NAMES",
    "Target",
    "TargetCrash",
    "TargetUnavailable",
    "available_targets",
    "target_factory",
]
