"""Target factories by name, imported lazily (vLLM only when asked for)."""

from __future__ import annotations

from collections.abc import Callable

from invariants.targets.base import Target
from model.config import Config

TARGET_NAMES = ("reference", "model", "vllm-manager")


def target_factory(name: str) -> Callable[[Config], Target]:
    """'reference' (default), 'model' (the executable spec) or 'vllm-manager' (needs vllm installed).

    The vLLM target raises `TargetUnavailable` from its constructor when vLLM
    cannot be imported; callers check that once before a long run.
    """
    if name == "reference":
        from invariants.targets.reference import ReferenceTarget

        return ReferenceTarget
    if name == "model":
        from invariants.targets.model_target import ModelTarget

        return ModelTarget
    if name == "vllm-manager":
        from invariants.targets.vllm_target import VllmManagerTarget

        return VllmManagerTarget
    raise ValueError(f"target: expected one of {', '.join(TARGET_NAMES)}, got {name!r}")
