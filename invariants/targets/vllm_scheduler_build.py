"""Building vLLM's real `Scheduler` offline, on the CPU, for a kvretain `Config`.

vLLM's own scheduler tests (`tests/v1/core/utils.py`, `create_scheduler`) build
a `Scheduler` from configuration objects alone; `build_scheduler` does the same
with kvretain's configuration, so no weights, tokenizer or hub access are
needed:

- `ModelConfig` reads a small `config.json` in a directory of the user's cache
  named by its content (`model_dir`; `skip_tokenizer_init=True`,
  `HF_HUB_OFFLINE=1`). Its architecture is a stand-in registered with vLLM's
  `ModelRegistry` (`register_model`, the out-of-tree model API): the scheduler never runs a model, and inspecting an
  in-tree architecture would import vLLM's attention layers (and their extra
  dependencies) for nothing.
- `KVCacheConfig` holds the groups `vllm_build.group_specs` makes (the same
  specs the `KVCacheManager`-driven adapter and `layouts/derive.py` use), the
  pool size and the retention interval.
- `CacheConfig`: the scheduler block size, prefix caching on or off, the Mamba
  cache mode; `SchedulerConfig`: chunked prefill, the long-prefill threshold, and
  the batch caps: the configuration's `max_num_batched_tokens` and
  `max_num_seqs`, which bind (`model.policy.scheduling`: `build_budget`, `seq_cap`). A
  configuration stating no budget (0: a directed target's steps choose theirs) is
  built with `max_num_batched_tokens = max_model_len`, which no step reaches. A
  draft model's drafting takes one input slot per request past the scheduled
  tokens (`max_num_new_slots_for_drafting`), which the model does not state:
  there the budget is vLLM's `max_num_scheduled_tokens` and
  `max_num_batched_tokens` leaves every request its slot (Eagle takes none).
  The sliding-window admission cap vLLM derives from the in-flight bound
  (`max_in_flight_tokens`) reads `max_num_batched_tokens`. The admission gates
  and the queue policy are the configuration's (`model.policy.admission`): `scheduler_reserve_full_isl` =
  `Config.reserve_full_isl` (vLLM's default True admits a request only if its
  whole sequence fits the free pool), `watermark` = `Config.watermark`,
  `policy` = `Config.scheduling_policy` (the model predicts "fcfs" only).
- Speculative decoding (`SpeculativeConfig`) where the configuration reserves
  lookahead slots: Eagle (`method="eagle"`: the manager drops the volatile last
  block) or a draft model (`method="draft_model"`), with
  `num_speculative_tokens = num_lookahead_tokens`, so `vllm_config.num_lookahead_tokens`
  is kvretain's. Eagle's block hashes as `Config.lookahead_block_hashes` says:
  off (`disable_lookahead_block_hashes=True`), the manager's trailing-block drop
  (`use_eagle`); on (vLLM's default), each hash covers the drafter's next token
  and nothing is dropped; the model predicts both (`model.contract.eagle`), and requests
  are hashed as `EngineCore` hashes them, with the pool's `num_hash_lookahead_tokens`
  (`VllmSession.block_hasher`).
  vLLM's Eagle always drafts at least one token: an Eagle configuration without
  lookahead slots cannot be built (`SchedulerUnsupported`).

With `Config.kv_connector` the scheduler gets kvretain's scripted KV connector
(`vllm_connector.transfer_config`).

KV cache events are on (`KVEventsConfig(enable_kv_cache_events=True,
publisher="null")`), published to an `EventCapture` the scheduler gets from
vLLM's publisher factory while it is built (`capturing_events`: the factory
answers the capture for that call only), so nothing is written to the
scheduler after construction.
What vLLM rejects is re-raised as `ConfigError` carrying vLLM's message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, Literal
from unittest.mock import patch

from model.contract.config import Config, ConfigError
from model.policy.scheduling import build_budget, seq_cap

from .vllm_build import group_specs
from .vllm_capabilities import Capabilities, scheduler_unsupported
from .vllm_env import cache_root
from .vllm_identity import encoder_cache_config

STAND_IN_ARCH = "KvretainStandInForCausalLM"
# vLLM's Eagle config names the draft architecture "Eagle" + the target's.
EAGLE_STAND_IN_ARCH = "Eagle" + STAND_IN_ARCH
# Requests at once: more than any kvretain trace keeps live, and no more than
# `StructuredOutputManager.fill_bitmask_parallel_threshold` (128): above it vLLM starts a
# bitmask thread pool per scheduler, which explore's hand-over cannot fork (pickle).
MAX_NUM_SEQS = 128
EAGLE_NEEDS_LOOKAHEAD = (
    "num_lookahead_tokens: vLLM's Eagle drafts at least one token, so its scheduler "
    "reserves at least one lookahead slot; an Eagle configuration with 0 cannot be built"
)


class SchedulerUnsupported(ConfigError):
    """A configuration the real scheduler cannot express (not a vLLM rejection)."""


class EventCapture:
    """The scheduler's KV-event publisher (`capturing_events`): keeps the batches
    `update_from_output` publishes, for the adapter's event reader."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def take(self) -> list[Any]:
        out, self.events = self.events, []
        return out

    def shutdown(self) -> None:
        pass


@contextmanager
def capturing_events() -> Iterator[EventCapture]:
    """While the block runs, vLLM's `EventPublisherFactory.create` answers a fresh
    `EventCapture` (the scheduler asks it once, in `__init__`); restored after."""
    from vllm.distributed.kv_events import EventPublisherFactory

    capture = EventCapture()
    with patch.object(EventPublisherFactory, "create", lambda *args, **kwargs: capture):
        yield capture


@cache
def scheduler_modules() -> dict[str, Any]:
    """vLLM's configuration and scheduler classes (imported once), the stand-in
    architectures registered."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.request_queue import create_request_queue
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.structured_output import StructuredOutputManager

    stand_in = _stand_in_class()
    ModelRegistry.register_model(STAND_IN_ARCH, stand_in)
    ModelRegistry.register_model(EAGLE_STAND_IN_ARCH, stand_in)
    return {
        "CacheConfig": CacheConfig,
        "DeviceConfig": DeviceConfig,
        "KVEventsConfig": KVEventsConfig,
        "ModelConfig": ModelConfig,
        "ParallelConfig": ParallelConfig,
        "SchedulerConfig": SchedulerConfig,
        "SpeculativeConfig": SpeculativeConfig,
        "VllmConfig": VllmConfig,
        "Scheduler": Scheduler,
        "AsyncScheduler": AsyncScheduler,
        "ModelRunnerOutput": ModelRunnerOutput,
        "create_request_queue": create_request_queue,
        "StructuredOutputManager": StructuredOutputManager,
    }


def _stand_in_class() -> type:
    """A model class vLLM's registry accepts as a text-generation model; never run."""
    from torch import nn

    class KvretainStandIn(nn.Module):
        """Stands for the model: the scheduler reads only its configuration."""

        def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
            super().__init__()

        def embed_input_ids(self, input_ids: Any) -> Any:
            raise NotImplementedError("kvretain's stand-in model never runs")

        def forward(self, input_ids: Any, positions: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("kvretain's stand-in model never runs")

        def compute_logits(self, hidden_states: Any) -> Any:
            raise NotImplementedError("kvretain's stand-in model never runs")

    return KvretainStandIn


def stand_in_hf_config(max_positions: int) -> dict[str, Any]:
    """The stand-in's Hugging Face `config.json` (`max_positions`: its context length)."""
    return {
        "architectures": [STAND_IN_ARCH],
        "model_type": "opt",
        "hidden_size": 16,
        "num_attention_heads": 1,
        "num_hidden_layers": 1,
        "ffn_dim": 16,
        "vocab_size": 64,
        "word_embed_proj_dim": 16,
        "max_position_embeddings": max_positions,
    }


def model_dir(max_positions: int) -> str:
    """The directory holding the stand-in's `config.json`, named by the hash of that file's
    content: under the user's cache (`vllm_env.cache_root()`; the system's temporary directory
    where that cannot be written), shared by every process asking for the same file and removed
    by none, so no process leaves a directory behind however it exits (pytest-xdist, pool and Ray
    workers leave through `os._exit`, which runs no `atexit`). The file is written atomically (a
    temporary name in the same directory, then `os.replace`), and again where it is missing or
    holds anything else."""
    text = json.dumps(stand_in_hf_config(max_positions), sort_keys=True)
    name = "stand-in-" + hashlib.sha256(text.encode()).hexdigest()[:16]
    roots = (cache_root() / "models", Path(tempfile.gettempdir()) / f"kvretain-models-{os.getuid()}")
    failure: OSError | None = None
    for root in roots:
        path = root / name
        try:
            _write_once(path / "config.json", text)
        except OSError as exc:
            failure = exc
            continue
        return str(path)
    assert failure is not None
    raise failure


def _write_once(path: Path, text: str) -> None:
    """`path` holds `text` (written atomically unless it already does)."""
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".config-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def check_scheduler_supported(cfg: Config) -> None:
    """Raise `SchedulerUnsupported` for what vLLM's scheduler cannot be configured to do."""
    if cfg.eagle and cfg.num_lookahead_tokens == 0:
        raise SchedulerUnsupported(EAGLE_NEEDS_LOOKAHEAD)


def vllm_config(
    cfg: Config, *, async_scheduling: bool = False, batch_caps: tuple[int, int] | None = None
) -> Any:
    """The `VllmConfig` of `cfg` (see the module docstring); `batch_caps`:
    (`max_num_batched_tokens`, `max_num_seqs`) that bind, for an engine loop that
    leaves every decision to vLLM (gpu_check's real-scheduler mode)."""
    m = scheduler_modules()
    model = m["ModelConfig"](
        model=model_dir(max(cfg.max_model_len, 1)),
        skip_tokenizer_init=True,
        max_model_len=cfg.max_model_len,
        dtype="float32",
    )
    mamba_modes = {g.mamba_cache_mode for g in cfg.groups if g.kind == "mamba"}
    if len(mamba_modes) > 1:
        raise SchedulerUnsupported("groups: vLLM's CacheConfig has one Mamba cache mode for all groups")
    cache_args: dict[str, Any] = {"mamba_cache_mode": mamba_modes.pop()} if mamba_modes else {}
    cache = m["CacheConfig"](
        block_size=cfg.scheduler_block_size,
        enable_prefix_caching=cfg.enable_caching,
        **cache_args,
    )
    cache.num_gpu_blocks = cfg.num_blocks
    tokens, seqs = batch_caps if batch_caps else (build_budget(cfg), min(MAX_NUM_SEQS, seq_cap(cfg)))
    limits: dict[str, int] = {"max_num_batched_tokens": tokens}
    if cfg.num_lookahead_tokens and not cfg.eagle:  # a draft model's slot per request (module docstring)
        limits = {"max_num_batched_tokens": tokens + seqs, "max_num_scheduled_tokens": tokens}
    sched = m["SchedulerConfig"](
        max_num_seqs=seqs,
        **limits,
        max_model_len=cfg.max_model_len,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        is_encoder_decoder=False,
        # The admission gates and the queue policy as the configuration says (`model.policy.admission`).
        watermark=cfg.watermark,
        scheduler_reserve_full_isl=cfg.reserve_full_isl,
        policy=cfg.scheduling_policy,
        async_scheduling=async_scheduling,
    )
    parallel = m["ParallelConfig"]()
    spec = None
    if cfg.num_lookahead_tokens:
        # Eagle's lookahead block hashes as the configuration says (`Config.lookahead_block_hashes`).
        # Releases before 0.33.0 have no lookahead hashes, nor the field that turns them off.
        # A draft model hashes no lookahead whatever the flag: it keeps vLLM's default there.
        off = {"disable_lookahead_block_hashes": cfg.eagle and not cfg.lookahead_block_hashes}
        spec = m["SpeculativeConfig"](
            method="eagle" if cfg.eagle else "draft_model",
            model=model.model,
            num_speculative_tokens=cfg.num_lookahead_tokens,
            target_model_config=model,
            target_parallel_config=parallel,
            **{k: v for k, v in off.items() if k in _field_names(m["SpeculativeConfig"])},
        )
    return m["VllmConfig"](
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        parallel_config=parallel,
        device_config=m["DeviceConfig"](device="cpu"),
        speculative_config=spec,
        kv_events_config=m["KVEventsConfig"](enable_kv_cache_events=True, publisher="null"),
        kv_transfer_config=_transfer_config(cfg.kv_load_failure_policy) if cfg.kv_connector else None,
        **encoder_cache_config(m["VllmConfig"]),  # multimodal items: `vllm_identity`
    )


def _transfer_config(failure_policy: Literal["recompute", "fail"]) -> Any:
    """kvretain's scripted KV connector (`vllm_connector`), for `Config.kv_connector`."""
    from .vllm_connector import transfer_config

    return transfer_config(failure_policy)


def build_scheduler(
    cfg: Config,
    v: dict[str, Any],
    caps: Capabilities,
    version: str,
    *,
    async_scheduling: bool = False,
    speculative_blocks: bool = True,
    batch_caps: tuple[int, int] | None = None,
) -> Any:
    """vLLM's `Scheduler` (`AsyncScheduler` with `async_scheduling`) for `cfg`
    (`batch_caps`: see `vllm_config`).
    `speculative_blocks=False` leaves the Mamba specs without their draft blocks
    (a planted defect for the tests: a real model never builds that)."""
    from .vllm_build import _retention_env as retention_env
    from .vllm_build import check_supported

    check_supported(cfg, caps, version)
    check_scheduler_supported(cfg)
    why = scheduler_unsupported(caps)
    if why is not None:  # the release's scheduler API (`vllm_capabilities.scheduler_api_missing`)
        raise SchedulerUnsupported(why)
    # With lookahead slots the scheduler speculates, so its Mamba layers keep draft blocks.
    specs = group_specs(cfg, v, draft_blocks=cfg.num_lookahead_tokens if speculative_blocks else 0)
    m = scheduler_modules()
    try:
        vcfg = vllm_config(cfg, async_scheduling=async_scheduling, batch_caps=batch_caps)
        # The retention interval as the release takes it (`vllm_build.build_manager`): a
        # `KVCacheConfig` field, or the environment while the coordinator is built.
        retention = (
            {"prefix_cache_retention_interval": cfg.retention_interval} if caps.retention == "config" else {}
        )
        kv_cfg = v["KVCacheConfig"](
            num_blocks=cfg.num_blocks, kv_cache_tensors=[], kv_cache_groups=specs, **retention
        )
        cls = m["AsyncScheduler"] if async_scheduling else m["Scheduler"]
        env_r = cfg.retention_interval if any(g.kind != "full" for g in cfg.groups) else None
        with retention_env(env_r if caps.retention == "env" else None), capturing_events():
            return cls(
                vllm_config=vcfg,
                kv_cache_config=kv_cfg,
                structured_output_manager=m["StructuredOutputManager"](vcfg),
                block_size=cfg.scheduler_block_size,
                hash_block_size=cfg.hash_block_size,
                log_stats=False,
            )
    except (ValueError, AssertionError, TypeError) as exc:
        kind = "" if isinstance(exc, ValueError) else f" ({type(exc).__name__})"
        raise ConfigError(f"vLLM {version}'s scheduler rejects the configuration{kind}: {exc}") from exc


def _field_names(cls: Any) -> frozenset[str]:
    """The fields a vLLM config dataclass takes in the installed release."""
    return frozenset(f.name for f in dataclasses.fields(cls))
