"""vLLM's real `Scheduler`, built offline from a kvretain `Config`
(`invariants.targets.vllm_scheduler_build`), holds the same `KVCacheManager`
as the one `vllm_build.build_manager` builds for the `KVCacheManager`-driven
adapter: coordinator, per-group managers and specs, pool, Eagle drop, caching,
alignment and the sliding-window admission cap. Every preset and the
speculative / fine-grained / caching-off shapes. Negative control: a
configuration that differs in one field gives a different manager. Skipped,
with the reason, when vLLM cannot be imported.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from invariants.targets.vllm_env import vllm_available

_OK, _REASON = vllm_available()
if not _OK:
    pytest.skip(f"vllm target: {_REASON}", allow_module_level=True)

from invariants.layouts.presets import PRESETS  # noqa: E402
from invariants.targets.vllm_build import build_manager  # noqa: E402
from invariants.targets.vllm_capabilities import detect  # noqa: E402
from invariants.targets.vllm_env import vllm_modules  # noqa: E402
from invariants.targets.vllm_scheduler_build import (  # noqa: E402
    SchedulerUnsupported,
    build_scheduler,
)
from model.contract.config import Config, ConfigError, GroupSpec  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parent.parent

SHAPES: dict[str, Config] = {
    **PRESETS,
    "fine-grained mamba": Config(
        groups=(GroupSpec("full", 2), GroupSpec("mamba", 8)),
        num_blocks=20,
        hash_block_size=2,
        retention_interval=0,
        max_model_len=4096,
    ),
    "eagle": Config(
        groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=5)),
        num_blocks=20,
        eagle=True,
        num_lookahead_tokens=2,
        max_model_len=4096,
    ),
    "draft model": Config(
        groups=(GroupSpec("full", 4), GroupSpec("mamba", 4)),
        num_blocks=20,
        num_lookahead_tokens=3,
        retention_interval=8,
        max_model_len=4096,
    ),
    "caching off": Config(
        groups=(GroupSpec("full", 4), GroupSpec("mamba", 4, mamba_cache_mode="none")),
        num_blocks=20,
        enable_caching=False,
        max_model_len=4096,
    ),
}


def manager_signature(m: Any, speculative_blocks: int = 0) -> list[object]:
    """What the allocator's behaviour depends on, read from a `KVCacheManager`; a
    Mamba spec's `num_speculative_blocks` must be `speculative_blocks` and is then
    read as 0 (the real scheduler sizes them for its drafts, `vllm_scheduler_spec`;
    the KVCacheManager-driven target sends none)."""
    c = m.coordinator
    out: list[object] = [
        type(c).__name__,
        m.block_pool.num_gpu_blocks,
        m.enable_caching,
        getattr(c, "enable_partial_hash_hits", None),
        c.retention_interval,
        [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()],
    ]
    for s in c.single_type_managers:
        spec = s.kv_cache_spec
        if hasattr(spec, "num_speculative_blocks"):
            assert spec.num_speculative_blocks == speculative_blocks, spec
            spec = dataclasses.replace(spec, num_speculative_blocks=0)
        out.append(
            (
                type(s).__name__,
                s.block_size,
                spec,
                getattr(s, "max_admission_blocks_per_request", None),
                s.cache_hit_alignment_tokens,
                getattr(s, "use_eagle", None),
            )
        )
    return out


def _build(cfg: Config) -> tuple[Any, Any]:
    v, caps = vllm_modules(), detect()
    return build_scheduler(cfg, v, caps, "0.33.0"), build_manager(cfg, v, caps, "0.33.0")


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_scheduler_manager_matches_build_manager(name: str) -> None:
    cfg = SHAPES[name]
    scheduler, manager = _build(cfg)
    drafts = cfg.num_lookahead_tokens
    assert manager_signature(scheduler.kv_cache_manager, drafts) == manager_signature(manager)
    assert scheduler.num_lookahead_tokens == cfg.num_lookahead_tokens
    assert scheduler.block_size == cfg.scheduler_block_size
    assert scheduler.hash_block_size == cfg.hash_block_size


@pytest.mark.parametrize(
    "change",
    [{"retention_interval": None}, {"num_blocks": 21}, {"eagle": False}],
)
def test_signature_sees_a_one_field_difference(change: dict[str, object]) -> None:
    """Negative control: the comparison above can fail."""
    cfg = SHAPES["eagle"].with_(retention_interval=0)
    scheduler, _ = _build(cfg)
    _, other = _build(cfg.with_(**change))
    assert manager_signature(scheduler.kv_cache_manager) != manager_signature(other)


def test_eagle_without_lookahead_is_unsupported() -> None:
    with pytest.raises(SchedulerUnsupported, match="num_lookahead_tokens"):
        _build(SHAPES["eagle"].with_(num_lookahead_tokens=0))


def test_vllm_rejection_is_a_config_error() -> None:
    bad = SHAPES["eagle"].with_(retention_interval=6)  # not a multiple of the scheduler block size
    with pytest.raises(ConfigError, match="rejects the configuration"):
        build_scheduler(bad, vllm_modules(), detect(), "0.33.0")


def test_async_scheduler_builds_with_the_same_manager() -> None:
    """`AsyncScheduler` (not driven yet) takes the same configuration."""
    cfg = SHAPES["dsv4-tiny"]
    v, caps = vllm_modules(), detect()
    scheduler = build_scheduler(cfg, v, caps, "0.33.0", async_scheduling=True)
    assert type(scheduler).__name__ == "AsyncScheduler"
    assert manager_signature(scheduler.kv_cache_manager) == manager_signature(
        build_manager(cfg, v, caps, "0.33.0")
    )


def test_a_removed_model_directory_is_made_again() -> None:
    """A temp cleaner (or a test) removing the stand-in's directory does not break later builds:
    the same content-addressed directory is written again."""
    import shutil

    from invariants.targets.vllm_scheduler_build import model_dir

    first = model_dir(4096)
    shutil.rmtree(first)
    second = model_dir(4096)
    assert second == first and os.path.isfile(os.path.join(second, "config.json"))
    _build(SHAPES["eagle"])


def test_the_model_directory_is_named_by_its_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One directory per stand-in configuration under the cache, shared by every build and
    rewritten where its file holds anything else (control: another length, another directory)."""
    from invariants.targets.vllm_scheduler_build import model_dir, stand_in_hf_config

    monkeypatch.setenv("KVRETAIN_CACHE", str(tmp_path))
    first = Path(model_dir(4096))
    assert first.parent.parent == tmp_path and model_dir(4096) == str(first)
    assert json.loads((first / "config.json").read_text()) == stand_in_hf_config(4096)
    assert model_dir(2048) != str(first)
    (first / "config.json").write_text("{}")
    assert model_dir(4096) == str(first)
    assert json.loads((first / "config.json").read_text()) == stand_in_hf_config(4096)
    assert sorted(p.name for p in first.iterdir()) == ["config.json"]  # no temporary file left


# Builds the "vllm" target, then leaves as pytest-xdist, pool and Ray workers do.
_BUILD_THEN_EXIT = """
import os
from invariants.targets import target_factory
from invariants.layouts.presets import PRESETS
target_factory("vllm")(PRESETS["{preset}"])
os._exit(0)
"""
# The scheme the stand-in's directory had: one per process, removed by `atexit`.
_OLD_SCHEME_THEN_EXIT = """
import atexit, os, shutil, tempfile
path = tempfile.mkdtemp(prefix="kvretain-model-")
atexit.register(shutil.rmtree, path, ignore_errors=True)
os._exit(0)
"""


def _model_dirs_left(script: str, tmp_path: Path) -> list[str]:
    """The `kvretain-model-*` directories a subprocess running `script` leaves in its temporary
    directory."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(parents=True)
    env = {**os.environ, "TMPDIR": str(tmp), "KVRETAIN_CACHE": str(tmp_path / "cache")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    return sorted(p.name for p in tmp.glob("kvretain-model-*"))


def test_a_scheduler_target_leaves_no_model_directory_behind(tmp_path: Path) -> None:
    """A process that builds the "vllm" target and exits through `os._exit` leaves no
    `kvretain-model-*` directory (its stand-in's is in the cache); control: the old
    `mkdtemp` + `atexit` scheme leaves one. About 20 s under load: a fresh interpreter imports
    vLLM, which only a subprocess can exit through `os._exit`."""
    preset = next(iter(PRESETS))
    assert _model_dirs_left(_BUILD_THEN_EXIT.format(preset=preset), tmp_path / "new") == []
    assert len(list((tmp_path / "new" / "cache" / "models").glob("stand-in-*/config.json"))) == 1
    assert len(_model_dirs_left(_OLD_SCHEME_THEN_EXIT, tmp_path / "old")) == 1


def test_the_cache_honours_kvretain_cache_then_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$KVRETAIN_CACHE first, then an absolute $XDG_CACHE_HOME, then ~/.cache (control: a
    relative $XDG_CACHE_HOME is ignored, as the XDG specification asks)."""
    from invariants.targets.vllm_env import cache_root

    monkeypatch.delenv("KVRETAIN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "kvretain"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    assert cache_root() == Path.home() / ".cache" / "kvretain"
    monkeypatch.setenv("KVRETAIN_CACHE", str(tmp_path / "own"))
    assert cache_root() == tmp_path / "own"
