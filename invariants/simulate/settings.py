"""The retention settings a scenario compares, and how each becomes a live target.

A setting is a configuration plus, for `pre43447`, a named mutant of the
target (the pre-#43447 free order: SWA blocks freed as the window slides go to
the BACK of the free queue even when uncached; zoo mutant
`swa_slide_appends_uncached`, on the reference target an instance edit, on
vLLM a monkeypatch of `SlidingWindowManager.remove_skipped_blocks` that holds
only while `setting_scope` is open). `pre43447` is dense caching with that
order: before #43447 there was no retention interval.

`pinned` (the #40676 tier) exists only where a target implements it
(`PINNING_TARGETS`): vLLM never merged it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from invariants.targets import PINNING_TARGETS, Target, target_factory
from invariants.targets.reference import ReferenceTarget
from model.contract.config import Config

MUTANT = "swa_slide_appends_uncached"
MUTANT_TARGETS = ("reference", "vllm-manager")


@dataclass(frozen=True)
class Setting:
    name: str
    config: Config
    mutant: str | None = None


def settings_for(base: Config, intervals: tuple[int, ...], target: str) -> list[Setting]:
    """off, dense, r0, one `rK` per interval (rounded to the scheduler block), pre43447, pinned."""
    out = [
        Setting("off", base.with_(enable_caching=False, retention_interval=None)),
        Setting("dense", base.with_(retention_interval=None)),
        Setting("r0", base.with_(retention_interval=0)),
    ]
    sbs = base.scheduler_block_size
    for k in intervals:
        k = max(sbs, k // sbs * sbs)
        if all(s.name != f"r{k}" for s in out):
            out.append(Setting(f"r{k}", base.with_(retention_interval=k)))
    has_swa = any(g.kind == "swa" for g in base.groups)
    if has_swa and target in MUTANT_TARGETS:
        out.append(Setting("pre43447", base.with_(retention_interval=None), mutant=MUTANT))
    if has_swa and target in PINNING_TARGETS:
        out.append(Setting("pinned", base.with_(retention_interval=None, pin_swa_on_drop=True)))
    return out


def interval_of(name: str) -> int | None:
    """K for a setting named `rK` (0 for r0), None for every other setting."""
    return int(name[1:]) if name.startswith("r") and name[1:].isdigit() else None


class _FastReference(ReferenceTarget):
    TRACK_PREFIXES = False


@contextlib.contextmanager
def setting_scope(target: str, setting: Setting) -> Iterator[None]:
    """Hold the setting's process-wide patches (vLLM mutants) while its targets run."""
    if setting.mutant is None or target != "vllm-manager":
        yield
        return
    from invariants.zoo.mutants_vllm import activate

    with activate(setting.mutant):
        yield


def make_target(target: str, setting: Setting) -> Target:
    """A fresh target for `setting`; prefix tracking off (O(n) at 1M-token prompts).

    A vLLM mutant setting must be built inside `setting_scope`.
    """
    if setting.mutant is not None and target == "reference":
        from invariants.zoo.mutants_reference import REFERENCE_MUTANTS, ZooReferenceTarget

        class _FastZoo(ZooReferenceTarget):
            TRACK_PREFIXES = False

        return _FastZoo(setting.config, REFERENCE_MUTANTS[setting.mutant])
    if setting.mutant is not None and target not in MUTANT_TARGETS:
        raise ValueError(f"setting {setting.name}: no mutant {setting.mutant!r} for target {target!r}")
    if target == "reference":
        return _FastReference(setting.config)
    if target == "vllm-manager":
        from invariants.targets.vllm_target import VllmManagerTarget

        target_factory(target)  # TargetUnavailable when vLLM cannot load
        return VllmManagerTarget(setting.config, track_prefixes=False)
    return target_factory(target)(setting.config)


def cached_blocks(target: Target) -> int:
    """Blocks holding a hash now (vLLM: read from its pool, no full snapshot)."""
    pool = getattr(target, "pool", None)
    if pool is not None and hasattr(pool, "blocks"):
        manager = getattr(target, "manager", None)
        if manager is not None:
            manager.take_events()  # drain: the simulator never reads them
        return sum(1 for b in pool.blocks if b.block_hash is not None)
    return len(target.snapshot().block_hash)
