"""Target registry: name -> factory. Imports are lazy so a missing optional
allocator (vLLM) only matters when it is asked for.

Besides the built-in targets, any installed package may register one under
the `kvretain.targets` entry-point group (`name = "package.module:Factory"`,
where `Factory(config)` returns a `Target`; see docs/targets.md), so a fork
ships its allocator's adapter in its own package and `--target name` fuzzes
it. A plug-in cannot shadow a built-in name. A plug-in class states its
optional capabilities as `features = TargetFeatures(...)` (`base.Target`
declares them with their defaults): `pinning=True` fuzzes it with the #40676
pinned tier too, `fine_mamba=True` with vLLM's fine-grained Mamba hits.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable
from typing import cast

from invariants.targets.base import Target, TargetCrash, TargetFeatures, TargetUnavailable, adopt
from model.contract.config import Config

ENTRY_POINT_GROUP = "kvretain.targets"

# "vllm" is vLLM's real `Scheduler` driving its `KVCacheManager`; "vllm-manager" is the
# `KVCacheManager` alone, its calls re-created by kvretain (releases whose scheduler
# cannot be built offline, and allocator calls no scheduler makes).
_BUILTIN: dict[str, tuple[str, str]] = {
    "model": ("invariants.targets.model_target", "ModelTarget"),
    "reference": ("invariants.targets.reference", "ReferenceTarget"),
    "vllm": ("invariants.targets.vllm_scheduler_target", "VllmSchedulerTarget"),
    "vllm-async-scheduler": ("invariants.targets.vllm_async_scheduler_target", "VllmAsyncSchedulerTarget"),
    "vllm-manager": ("invariants.targets.vllm_target", "VllmManagerTarget"),
}
# Names earlier releases of kvretain used: a trace or command naming one is told the new name.
RENAMED = {
    "vllm-scheduler": "vllm (the real Scheduler; the KVCacheManager emulation is vllm-manager)",
    # The directed targets steered vLLM's queues and budget; kvretain no longer writes them.
    "vllm-directed": "vllm (the engine decides every step; kvretain no longer steers the scheduler)",
    "vllm-async-scheduler-directed": (
        "vllm-async-scheduler (the engine decides every step; kvretain no longer steers the scheduler)"
    ),
}
BUILTIN_TARGETS = tuple(_BUILTIN)


@functools.cache
def plugin_targets() -> dict[str, importlib.metadata.EntryPoint]:
    """Targets registered by installed packages under `kvretain.targets` (not loaded yet)."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _BUILTIN and ep.name not in found:
            found[ep.name] = ep
    return dict(sorted(found.items()))


TARGET_NAMES = BUILTIN_TARGETS + tuple(plugin_targets())
# Targets that implement the #40676 pinned tier (vLLM never merged it): the built-in
# classes stating `TargetFeatures(pinning=True)` (a test holds these sets to them),
# plus the plug-ins that state it once loaded.
PINNING_TARGETS = {"model", "reference"}
# Targets that model vLLM's fine-grained Mamba hits and their CoW copies (the seeds
# do not describe them, so the reference allocator refuses such configurations).
FINE_MAMBA_TARGETS = {
    "model",
    "vllm-manager",
    "vllm",
    "vllm-async-scheduler",
}
# Targets whose steps a real engine scheduler decides (`TargetFeatures(real_scheduler=True)`):
# the fuzzer sends them whole steps and only configurations an engine can run.
REAL_SCHEDULER_TARGETS = {"vllm", "vllm-async-scheduler"}
# Real schedulers driven one step ahead (`TargetFeatures(async_scheduling=True)`), drafts included.
ASYNC_SCHEDULER_TARGETS = {"vllm-async-scheduler"}
# Real schedulers that decide every step themselves (`TargetFeatures(engine_steps=True)`):
# kvretain writes nothing of their state; the fuzzer sends them the engine's own steps.
ENGINE_STEP_TARGETS = {"vllm", "vllm-async-scheduler"}
# Targets that can run a KV connector (`TargetFeatures(connector=True)`, `model.machine.connector`):
# generated configurations include one; the others are never sent one, and say so.
CONNECTOR_TARGETS = {
    "model",
    "vllm",
    "vllm-async-scheduler",
}
# Targets whose steps state the queue order they leave (`TargetFeatures(queues=True)`,
# `model.policy.queues`): judged there; the others' runs say it is unjudged.
QUEUE_TARGETS = {
    "model",
    "reference",
    "vllm",
    "vllm-async-scheduler",
}
# Targets that gate admissions as vLLM's scheduler does (`Config.reserve_full_isl`, `watermark`;
# `model.policy.admission`): generated configurations include the gates; the others refuse them.
GATED_TARGETS = {
    "model",
    "vllm-manager",
    "vllm",
    "vllm-async-scheduler",
}
# Targets that drive another target's allocator code: its known findings are theirs too.
SAME_ALLOCATOR = {
    "vllm": "vllm-manager",
    "vllm-async-scheduler": "vllm-manager",
}


def _load_plugin(name: str) -> Callable[[Config], Target]:
    ep = plugin_targets()[name]
    where = f"target {name!r} (entry point {ep.value} of {ep.dist.name if ep.dist else 'an unknown package'})"
    try:
        factory = ep.load()
    except Exception as exc:  # a broken plug-in is one line, never a traceback
        raise TargetUnavailable(f"{where} cannot be loaded: {type(exc).__name__}: {exc}") from None
    if not callable(factory):
        raise TargetUnavailable(f"{where} is not callable (expected a class or function taking a Config)")
    missing = [m for m in ("apply", "snapshot") if isinstance(factory, type) and not hasattr(factory, m)]
    if missing:
        names = ", ".join(f"{m}()" for m in missing)
        raise TargetUnavailable(f"{where} does not implement the Target protocol: no {names}")
    loaded = adopt(factory)  # its targets have every optional member of the protocol
    # A class states its features; a function's targets have the defaults.
    features = cast("type[Target]", loaded).features if isinstance(loaded, type) else TargetFeatures()
    if features.pinning:
        PINNING_TARGETS.add(name)
    if features.fine_mamba:
        FINE_MAMBA_TARGETS.add(name)
    if features.queues:
        QUEUE_TARGETS.add(name)
    return loaded


def target_factory(name: str) -> Callable[[Config], Target]:
    """The constructor of target `name`; TargetUnavailable if it cannot load."""
    if name in plugin_targets():
        return _load_plugin(name)
    if name in RENAMED:
        raise TargetUnavailable(f"target {name!r} is now called {RENAMED[name]}")
    if name not in _BUILTIN:
        raise TargetUnavailable(f"unknown target {name!r} (known: {', '.join(TARGET_NAMES)})")
    module_name, cls_name = _BUILTIN[name]
    if name == "vllm-manager" or name in REAL_SCHEDULER_TARGETS:
        from invariants.targets.vllm_env import vllm_available

        ok, reason = vllm_available()
        if not ok:
            raise TargetUnavailable(reason)
        if name in REAL_SCHEDULER_TARGETS:
            from invariants.targets.vllm_capabilities import detect, scheduler_unsupported

            why = scheduler_unsupported(detect())
            if why is not None:
                raise TargetUnavailable(why)
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
    "BUILTIN_TARGETS",
    "ENTRY_POINT_GROUP",
    "PINNING_TARGETS",
    "QUEUE_TARGETS",
    "REAL_SCHEDULER_TARGETS",
    "RENAMED",
    "ASYNC_SCHEDULER_TARGETS",
    "ENGINE_STEP_TARGETS",
    "SAME_ALLOCATOR",
    "FINE_MAMBA_TARGETS",
    "GATED_TARGETS",
    "TARGET_NAMES",
    "Target",
    "TargetFeatures",
    "TargetCrash",
    "TargetUnavailable",
    "adopt",
    "available_targets",
    "plugin_targets",
    "target_factory",
]
