"""The vllm-manager target: kvretain operations driven through vLLM's real `KVCacheManager`,
the calls its scheduler would make re-created by kvretain (target "vllm" runs the real scheduler).

`VllmManagerTarget(config)` builds a `KVCacheManager` (vLLM 0.33.0, `vllm/v1/core/`) for a
`model.contract.config.Config` and applies `model.contract.ops` operations through the manager's
public methods, exactly as `docs/semantics.md` says and as vLLM's scheduler does.
The adapter is split along its jobs, each a module of `targets/` with one class
per job, sharing one `VllmSession` (the live vLLM objects):

| job | module | class / functions |
|---|---|---|
| build the manager and vLLM's specs | `vllm_build` | `build_manager`, `group_specs` (shared with `layouts/derive.py`) |
| learn what each hash stands for | `vllm_names`, `hash_names` | `HashLearner` (`HashNames` table) |
| translate keys and event hashes | `vllm_names` | `KeyTranslator` |
| emulate the scheduler's calls | `vllm_schedule` | `StepScheduler` |
| apply operations | `vllm_drive` | `OpDriver` |
| read snapshots and partial states | `vllm_snapshot` | `SnapshotReader` |
| translate KV events | `vllm_snapshot`, `vllm_hashing` | `EventTranslator` |

This class only composes them and states the `Target` protocol.

`VllmManagerTarget(cfg, track_prefixes=False)` records nothing, and snapshots and
events name each hash by a stand-in instead of its prefix (see `vllm_names`):
use them for counting, never for differential checks.

vLLM has no pinned tier (#40676 was never merged): a configuration asking for
one raises `UnsupportedConfig`. Everything else vLLM rejects is re-raised as
`model.contract.config.ConfigError` carrying vLLM's message.

Older releases: the adapter follows `vllm_capabilities.detect()` (the installed
version's rules; where the installed code behaves otherwise, `profile_check`
reports drift and the rules stay the version's): `vllm_build` passes only the
constructor arguments the release takes and sets the retention interval where it
reads it; `vllm_schedule` reads a junction only where `get_computed_blocks`
returns one and drains CoW copies only where the release makes them;
`vllm_names` names a wide block keyed by its joined fine hashes by the last of
them. A KV event field it lacks takes the model's value
(`uncompared_event_fields` names it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from model.contract.config import Config, ConfigError
from model.contract.extra_keys import IDENTITY_FIELDS as IDENTITIES
from model.contract.observation import BlockKey, Observation, Snapshot
from model.contract.ops import Op
from model.machine.pool import EVENT_PROFILES

from .base import PartialState, Tables, Target, TargetFeatures, TargetUnavailable
from .vllm_build import NO_PINNED_TIER, UnsupportedConfig, build_manager
from .vllm_capabilities import Capabilities, detect
from .vllm_drive import OpDriver, Scheduling
from .vllm_env import MODELED_VERSION, version_warning, vllm_available, vllm_modules, vllm_version
from .vllm_names import HashLearner, KeyTranslator
from .vllm_schedule import StepScheduler
from .vllm_session import VllmSession
from .vllm_snapshot import EventTranslator, SnapshotReader

VLLM_EVENT_PROFILE = "vllm-0.33.0"


NO_KV_CONNECTOR = (
    "kv_connector: the KVCacheManager-driven target has no scheduler to ask a KV connector "
    "(use --target vllm)"
)
NO_LONG_PREFILL = (
    "long_prefill_token_threshold: the KVCacheManager-driven target re-creates the scheduler's "
    "calls without the long-prefill cap (use --target vllm)"
)

NO_PRIORITY = (
    "scheduling_policy: the KVCacheManager-driven target re-creates the scheduler's FCFS calls only "
    "(use --target vllm)"
)

NO_LOOKAHEAD_HASHES = (
    "lookahead_block_hashes: the KVCacheManager-driven target hashes requests without lookahead "
    "tokens (use --target vllm)"
)


class VllmManagerTarget(Target):
    """Drives vLLM's `KVCacheManager` with kvretain operations (see module docstring)."""

    name = "vllm-manager"
    # vLLM has no pinned tier (#40676 was never merged).
    features = TargetFeatures(partial=True, fine_mamba=True)
    identities = IDENTITIES  # every identity field (`model.contract.extra_keys`)

    def __init__(self, config: Config, events: str = VLLM_EVENT_PROFILE, track_prefixes: bool = True) -> None:
        ok, reason = vllm_available()
        if not ok:
            raise TargetUnavailable(reason)
        if events not in EVENT_PROFILES:
            raise ValueError(f"events: must be one of {EVENT_PROFILES}, got {events!r}")
        if config.pin_swa_on_drop:
            raise UnsupportedConfig(f"pin_swa_on_drop: {NO_PINNED_TIER}")
        self.config = config
        # The model event profile this target is judged against (the Checker
        # builds its model with it). vLLM emits the "vllm-0.33.0" profile; with
        # "seed" the #42258 token-range finding shows up as an events difference.
        self.event_profile = events
        self.version = vllm_version() or "?"
        # One line for the CLI to print when this is not the vLLM kvretain models (else None).
        self.version_note = version_warning(self.version)
        v, caps = vllm_modules(), detect()
        # The model's semantics profile for this release (the Checker builds its model with it).
        self.profile = caps.profile()
        self.hbs = config.hash_block_size
        manager = self.build_manager(config, v, caps)
        self.session = VllmSession(config, v, caps, self.version, manager, manager.block_pool)
        self.names = HashLearner(self.session, track_prefixes)
        self.keys = KeyTranslator(self.session, self.names)
        self.scheduler: Scheduling = StepScheduler(self.session, self.names)
        self.driver = OpDriver(self.session, self.names, self.scheduler)
        self.event_translator = EventTranslator(self.session, self.keys)
        self.reader = SnapshotReader(self.session, self.keys, self.event_translator)

    def build_manager(self, config: Config, v: dict[str, Any], caps: Capabilities) -> Any:
        """The `KVCacheManager` to drive (`vllm_build.build_manager`): the seam a fork of
        vLLM overrides to build its own manager (`v`: the modules `vllm_env.vllm_modules`
        imported; `caps`: what `vllm_capabilities.detect` found)."""
        if config.kv_connector:
            raise ConfigError(NO_KV_CONNECTOR)
        if config.long_prefill_token_threshold:
            raise ConfigError(NO_LONG_PREFILL)
        if config.scheduling_policy != "fcfs":
            raise ConfigError(NO_PRIORITY)
        if config.lookahead_block_hashes:
            raise ConfigError(NO_LOOKAHEAD_HASHES)
        return build_manager(config, v, caps, self.version)

    # ------------------------------------------------------------------ the Target protocol
    def apply(self, op: Op) -> Observation:
        return self.driver.apply(op)

    def snapshot(self) -> Snapshot:
        return self.reader.snapshot()

    def partial(
        self,
        blocks: Iterable[int],
        rids: Iterable[str],
        keys: Iterable[BlockKey],
        before: Tables | None = None,
    ) -> PartialState:
        """What an operation touched, read from those blocks and tables only (see `PartialState`)."""
        return self.reader.partial(blocks, rids, keys, before)

    @property
    def uncompared_event_fields(self) -> tuple[str, ...]:
        """The KV event fields no comparison sees on this release; none on vLLM 0.33.0."""
        return self.event_translator.uncompared()

    # ------------------------------------------------------------------ the live vLLM objects
    # Read and replaced through the session, so a replacement (a benchmark's timing
    # wrapper, a test's changed capabilities) is what every part of the adapter uses.
    @property
    def manager(self) -> Any:
        return self.session.manager

    @manager.setter
    def manager(self, value: Any) -> None:
        self.session.manager = value

    @property
    def pool(self) -> Any:
        return self.session.pool

    @pool.setter
    def pool(self, value: Any) -> None:
        self.session.pool = value

    @property
    def caps(self) -> Capabilities:
        """The rules and API of the installed release (`vllm_capabilities.detect`)."""
        return self.session.caps

    @caps.setter
    def caps(self, value: Capabilities) -> None:
        self.session.caps = value

    @property
    def requests(self) -> dict[str, Any]:
        """The live vLLM `Request`s by id."""
        return self.session.requests

    @property
    def track_prefixes(self) -> bool:
        return self.names.track_prefixes


__all__ = [
    "MODELED_VERSION",
    "NO_PINNED_TIER",
    "VLLM_EVENT_PROFILE",
    "UnsupportedConfig",
    "VllmManagerTarget",
]
