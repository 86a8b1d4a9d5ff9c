"""Target factories by name, imported lazily (vLLM only when asked for)."""

from __future__ import annotations

from collections.abc import Callable

from invariants.targets.base import Target
from model.contract.config import Config

TARGET_NAMES = ("reference", "model", "vllm-manager", "vllm")


def target_factory(name: str) -> Callable[[Config], Target]:
    """'reference' (default), 'model' (the executable spec), 'vllm-manager' (vLLM's
    KVCacheManager, needs vllm installed; gpu_check's engine loop makes the scheduler's
    calls) or 'vllm' (vLLM's real Scheduler as the engine: `gpu_check.engine`, with
    `real_scheduler_factory`'s batch caps).

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
    if name == "vllm":
        return real_scheduler_factory(48, 4)
    raise ValueError(f"target: expected one of {', '.join(TARGET_NAMES)}, got {name!r}")


def real_scheduler_factory(token_budget: int, max_running: int) -> Callable[[Config], Target]:
    """vLLM's real `Scheduler` with binding batch caps (`max_num_batched_tokens`,
    `max_num_seqs`), for the engine loop of `gpu_check.engine`."""
    from invariants.targets.vllm_scheduler_target import VllmSchedulerTarget

    def build(config: Config) -> Target:
        return VllmSchedulerTarget(config, batch_caps=(token_budget, max_running))

    return build
