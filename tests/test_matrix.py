"""The release matrix: capabilities from a release's own code, the adapter
following them, the classification of disagreements, shrinking, the table.

Capability detection is checked three ways: on synthetic fakes (one test per
capability, each with the variant that lacks it as its control), on the
installed vLLM, and on every cached release environment (skipped, with the
reason, where a release is not installed). The two-release matrix run installs
releases when they are missing, so it is marked slow.
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

from invariants.matrix.classify import classify
from invariants.targets.vllm_capabilities import Capabilities, detect_from
from invariants.targets.vllm_env import cache_root, vllm_available
from model.contract.profile import Profile

ROOT = Path(__file__).resolve().parents[1]
_OK, _REASON = vllm_available()
needs_vllm = pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")


# ----------------------------------------------------------------------------- fakes
# Source text is what detection reads, so each variant is its own class.
class _JoinedHashList:
    def __getitem__(self, idx):  # type: ignore[no-untyped-def]
        return b"".join(self.block_hashes[idx : idx + 2])  # type: ignore[attr-defined]


class _LastHashList:
    def __getitem__(self, idx):  # type: ignore[no-untyped-def]
        return self.block_hashes[idx]  # type: ignore[attr-defined]


class _Coordinator:
    pass


class _EnvCoordinator:
    retention = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"


class _FineCoordinator:
    enable_partial_hash_hits = True


class _EnvFineCoordinator:
    retention = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"
    enable_partial_hash_hits = True


class _ReplayCoordinator:
    def cache_blocks(self, request):  # type: ignore[no-untyped-def]
        return replay_boundaries(request.num_prompt_tokens)  # type: ignore[name-defined]  # noqa: F821


class _NoMambaMarginCoordinator:
    def find_longest_cache_hit(self, spec, drop_eagle_block, curr_hit_length, margin):  # type: ignore[no-untyped-def]
        if drop_eagle_block and not isinstance(spec, MambaSpec):  # type: ignore[name-defined]  # noqa: F821
            return curr_hit_length + margin
        return curr_hit_length


class _MarginCoordinator:
    def find_longest_cache_hit(self, block_hashes, curr_hit_length, margin):  # type: ignore[no-untyped-def]
        return min(curr_hit_length + margin, len(block_hashes) * self.hash_block_size)  # type: ignore[attr-defined]


def _fake_namespace(**new: bool) -> dict[str, Any]:
    """vLLM-shaped classes of a release before every mechanism; `new` turns one on."""

    class BlockPool:
        if new.get("block_mask"):

            def cache_full_blocks(self, request, blocks, block_mask=None):  # type: ignore[no-untyped-def]
                return None
        else:

            def cache_full_blocks(self, request, blocks):  # type: ignore[no-untyped-def]
                return None

        if new.get("fifo_off"):

            def free_blocks(self, ordered_blocks):  # type: ignore[no-untyped-def]
                self.queue.append_n(
                    [b for b in ordered_blocks if b.block_hash is None and self.enable_caching]
                )
        elif new.get("pool_order"):

            def free_blocks(self, ordered_blocks):  # type: ignore[no-untyped-def]
                self.free_block_queue.prepend_n([b for b in ordered_blocks if b.block_hash is None])
        elif new.get("caller_order"):

            def free_blocks(self, ordered_blocks, prepend=False):  # type: ignore[no-untyped-def]
                self.free_block_queue.append_n(ordered_blocks)
        else:

            def free_blocks(self, ordered_blocks):  # type: ignore[no-untyped-def]
                self.free_block_queue.append_n(ordered_blocks)

    class KVCacheManager:
        def __init__(self, kv_cache_config, max_model_len, hash_block_size):  # type: ignore[no-untyped-def]
            pass

        if new.get("junction"):

            def get_computed_blocks(self, request):  # type: ignore[no-untyped-def]
                shared_prefix_boundary = 0
                return None, 0, shared_prefix_boundary
        else:

            def get_computed_blocks(self, request):  # type: ignore[no-untyped-def]
                return None, 0

        if new.get("cow"):

            def take_kv_cache_block_copies(self):  # type: ignore[no-untyped-def]
                return [], []

    @dataclasses.dataclass
    class KVCacheConfig:
        num_blocks: int = 0

    if new.get("config_retention"):

        @dataclasses.dataclass
        class KVCacheConfig:  # type: ignore[no-redef]
            num_blocks: int = 0
            prefix_cache_retention_interval: int | None = None

    class BlockStored:
        __struct_fields__ = ("block_hashes", "token_ids") + (
            ("lookahead_token_ids",) if new.get("ev") else ()
        )

    class SlidingWindowManager:
        if new.get("eagle_mask"):

            @classmethod
            def _contiguous_blocks_for_hit(cls, window, block_size, use_eagle):  # type: ignore[no-untyped-def]
                return 1

    class MambaManager:
        if new.get("mamba_retention"):

            def reachable_block_mask(self):  # type: ignore[no-untyped-def]
                return None

        if new.get("mamba_capped"):

            def get_num_blocks_to_allocate(self, num_new_blocks, physical_block_cap):  # type: ignore[no-untyped-def]
                return min(num_new_blocks, physical_block_cap)

        if new.get("mamba_any_block"):

            def _cache_partial_tail_block(self, request, num_tokens):  # type: ignore[no-untyped-def]
                return num_tokens == checkpoint_position(request.num_prompt_tokens)  # type: ignore[name-defined]  # noqa: F821
        elif new.get("mamba_in_block_drop"):

            def _cache_partial_tail_block(self, request, num_tokens, latest_prompt_hash_boundary):  # type: ignore[no-untyped-def]
                if num_tokens % self.block_size == 0:  # type: ignore[attr-defined]
                    return None
                return latest_prompt_hash_boundary - hash_block_size  # type: ignore[name-defined]  # noqa: F821

        if new.get("mamba_retire"):

            def _remove_blocks_in_range(self, request_id, first_block, last_block):  # type: ignore[no-untyped-def]
                return None

    class SingleTypeKVCacheManager:
        if new.get("hit_grid_mask"):

            def cache_blocks(self, request, boundaries):  # type: ignore[no-untyped-def]
                return self.reachable_block_mask(alignment_tokens=self.cache_hit_alignment_tokens)  # type: ignore[attr-defined]
        elif new.get("junction_peek"):

            def cache_blocks(self, request, boundaries):  # type: ignore[no-untyped-def]
                return [*boundaries, request.shared_prefix_boundary - self.block_size]  # type: ignore[attr-defined]
        else:

            def cache_blocks(self, request, boundaries):  # type: ignore[no-untyped-def]
                return [*boundaries, request.shared_prefix_boundary]

    class FullAttentionManager:
        if new.get("no_partial_tail"):
            pass
        elif new.get("tail_limit"):

            def _cache_partial_tail_block(self, request):  # type: ignore[no-untyped-def]
                return request.num_prompt_tokens - 1
        else:

            def _cache_partial_tail_block(self, request):  # type: ignore[no-untyped-def]
                return request.num_prompt_tokens

    coordinator = {
        (False, False): _Coordinator,
        (True, False): _EnvCoordinator,
        (False, True): _FineCoordinator,
        (True, True): _EnvFineCoordinator,
    }[bool(new.get("env_retention")), bool(new.get("fine"))]
    if new.get("margin_hashed"):
        coordinator = _MarginCoordinator
    if new.get("replay"):
        coordinator = _ReplayCoordinator
    if new.get("mamba_no_margin"):
        coordinator = _NoMambaMarginCoordinator
    hashes = _LastHashList if new.get("last_hash") else _JoinedHashList

    return {
        "BlockPool": BlockPool,
        "KVCacheManager": KVCacheManager,
        "KVCacheConfig": KVCacheConfig,
        "BlockStored": BlockStored,
        "SlidingWindowManager": SlidingWindowManager,
        "MambaManager": MambaManager,
        "BlockHashListWithBlockSize": hashes,
        "coordinator_module": coordinator,
        "SingleTypeKVCacheManager": SingleTypeKVCacheManager,
        "FullAttentionManager": FullAttentionManager,
    }


def _caps(**new: bool) -> Capabilities:
    return detect_from(_fake_namespace(**new), "0.0.0")


def test_fake_release_before_every_mechanism_has_none() -> None:
    c = _caps()
    assert (c.block_mask, c.free_order, c.retention) == (False, "append", "none")
    assert not (c.mamba_retention or c.eagle_aware_mask or c.shared_prefix_junction or c.fine_grained_mamba)
    assert not c.cow_copies and c.coarse_hash == "concat"
    assert set(c.missing()) == {
        "block_mask",
        "free_order",
        "retention",
        "mamba_retention",
        "eagle_aware_mask",
        "shared_prefix_junction",
        "fine_grained_mamba",
    }


@pytest.mark.parametrize(
    ("flag", "field", "value"),
    [
        ("block_mask", "block_mask", True),
        ("pool_order", "free_order", "pool"),
        ("caller_order", "free_order", "caller"),
        ("config_retention", "retention", "config"),
        ("env_retention", "retention", "env"),
        ("mamba_retention", "mamba_retention", True),
        ("eagle_mask", "eagle_aware_mask", True),
        ("junction", "shared_prefix_junction", True),
        ("fine", "fine_grained_mamba", True),
        ("cow", "cow_copies", True),
        ("last_hash", "coarse_hash", "last"),
        ("fifo_off", "caching_off_order", "fifo"),
        ("junction_peek", "eagle_junction_peek", True),
        ("tail_limit", "tail_excludes_last", True),
        ("margin_hashed", "eagle_margin_hashed", True),
        ("replay", "replay_boundaries", True),
        ("no_partial_tail", "partial_tail", False),
        ("mamba_no_margin", "eagle_margin_skips_mamba", True),
        ("mamba_any_block", "mamba_checkpoint", "any_block"),
        ("mamba_in_block_drop", "mamba_checkpoint", "in_block_drop"),
        ("mamba_capped", "mamba_count_capped", True),
        ("hit_grid_mask", "mask_hit_grid", True),
    ],
)
def test_each_capability_is_read_from_the_code(flag: str, field: str, value: object) -> None:
    before, after = _caps(), _caps(**{flag: True})
    assert getattr(before, field) != value  # control: the release without it
    assert getattr(after, field) == value
    changed = {
        f.name for f in dataclasses.fields(Capabilities) if getattr(before, f.name) != getattr(after, f.name)
    }
    assert changed == {field}


def test_constructor_arguments_and_event_fields() -> None:
    c = _caps(ev=True)
    assert c.manager_args == {"kv_cache_config", "max_model_len", "hash_block_size"}
    assert "lookahead_token_ids" in c.event_fields and "lookahead_token_ids" not in _caps().event_fields


def test_capabilities_round_trip_json() -> None:
    c = _caps(block_mask=True, cow=True)
    assert Capabilities.from_json(json.loads(json.dumps(c.to_json()))) == c


# ----------------------------------------------------------------------------- real releases
@needs_vllm
def test_installed_release_has_every_mechanism() -> None:
    from invariants.targets.vllm_capabilities import detect

    c = detect()
    if c.version != "0.33.0":
        pytest.skip(f"installed vLLM is {c.version}, the expectations are for 0.33.0")
    assert c.missing() == [] and c.free_order == "pool" and c.retention == "config"
    assert c.cow_copies and c.coarse_hash == "last"
    assert {"scheduler_block_size", "max_in_flight_tokens"} <= c.manager_args
    assert c.sample_caching is True and c.scheduler_missing == ()


# What each release's own code shows (read from the wheels' vllm/v1/core).
EXPECTED = {
    "0.21.0": dict(block_mask=False, free_order="append", retention="none", mamba_retention=False),
    "0.22.0": dict(block_mask=True, free_order="append", retention="none", eagle_aware_mask=False),
    "0.23.0": dict(free_order="caller", retention="env", eagle_aware_mask=True, mamba_retention=False),
    "0.24.0": dict(free_order="pool", retention="env", mamba_retention=True, shared_prefix_junction=False),
    "0.27.0": dict(caching_off_order="fifo", retention="env", mask_hit_grid=False),
    "0.28.0": dict(caching_off_order="lifo", retention="env", mask_hit_grid=False),
    "0.26.0": dict(shared_prefix_junction=True, cow_copies=True, retention="env", sample_caching=False),
    "0.29.0": dict(retention="config", coarse_hash="last", caching_off_order="lifo", mask_hit_grid=True),
    "0.25.0": dict(eagle_margin_skips_mamba=False, partial_tail=False),
    "0.30.0": dict(eagle_margin_skips_mamba=True, mamba_checkpoint="in_block_drop", mamba_count_capped=False),
    "0.31.0": dict(mamba_checkpoint="in_block_drop", mamba_count_capped=True),
    "0.32.0": dict(mamba_checkpoint="any_block", sample_caching=False),
}


@pytest.mark.parametrize("version", sorted(EXPECTED))
def test_capabilities_of_cached_releases(version: str) -> None:
    python = cache_root() / f"vllm-{version}" / "bin" / "python"
    if not (cache_root() / f"vllm-{version}" / ".kvretain-ready").exists():
        pytest.skip(f"vLLM {version} is not installed under {cache_root()} (kvretain matrix installs it)")
    # The release's own code (`detect_code`), and the run's rules by version (`detect`):
    # both show the expectations, and the code shows no drift from its version's row.
    code = (
        "import json; from invariants.targets.vllm_capabilities import detect, detect_code, profile_check; "
        "print(json.dumps([detect_code()[0].to_json(), detect().to_json(), profile_check().to_json()]))"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="ERROR")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-500:]
    from_code, by_version, check = json.loads(out.stdout.strip().splitlines()[-1])
    assert from_code["version"] == by_version["version"] == version
    for key, value in EXPECTED[version].items():
        assert from_code[key] == value, (version, key)
        assert by_version[key] == value, (version, key)
    assert check["release"] == version and check["drift"] == [] and check["unchecked"] == []


# ----------------------------------------------------------------------------- the adapter follows
@needs_vllm
class TestAdapterFollowsCapabilities:
    @staticmethod
    def _target(monkeypatch: pytest.MonkeyPatch, cfg: Any, **changes: Any) -> Any:
        import invariants.targets.vllm_target as vt
        from invariants.targets.vllm_capabilities import detect

        monkeypatch.setattr(vt, "detect", lambda: dataclasses.replace(detect(), **changes))
        return vt.VllmManagerTarget(cfg)

    @staticmethod
    def _cfg(**kw: Any) -> Any:
        from model.contract.config import Config, GroupSpec

        return Config(
            groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=4)), num_blocks=16, **kw
        )

    def test_no_retention_interval_accepts_only_dense(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from invariants.targets.vllm_target import UnsupportedConfig

        self._target(monkeypatch, self._cfg(retention_interval=None), retention="none")
        with pytest.raises(UnsupportedConfig, match="retention_interval"):
            self._target(monkeypatch, self._cfg(retention_interval=0), retention="none")
        self._target(monkeypatch, self._cfg(retention_interval=0))  # control: 0.33.0 takes it

    def test_a_wide_mamba_block_needs_fine_grained_hits(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from invariants.targets.vllm_target import UnsupportedConfig
        from model.contract.config import Config, GroupSpec

        cfg = Config(
            (GroupSpec("full", 4), GroupSpec("mamba", 16)), 16, hash_block_size=4, scheduler_block_size=16
        )
        with pytest.raises(UnsupportedConfig, match="fine-grained Mamba"):
            self._target(monkeypatch, cfg, fine_grained_mamba=False)
        self._target(monkeypatch, cfg)  # control: 0.33.0 takes it

    def test_env_retention_is_set_only_while_building(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import invariants.targets.vllm_build as vb

        seen = []
        real = vb._retention_env

        monkeypatch.setenv(vb.RETENTION_ENV, "999")

        def spy(interval: int | None) -> Any:
            seen.append(interval)
            return real(interval)

        monkeypatch.setattr(vb, "_retention_env", spy)
        self._target(monkeypatch, self._cfg(retention_interval=8), retention="env")
        assert seen == [8] and os.environ[vb.RETENTION_ENV] == "999"
        with real(16):
            assert os.environ[vb.RETENTION_ENV] == "16"
        with real(None):
            assert vb.RETENTION_ENV not in os.environ
        assert os.environ[vb.RETENTION_ENV] == "999"

    def test_constructor_gets_only_the_arguments_the_release_takes(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from invariants.targets.vllm_capabilities import detect

        args = detect().manager_args - {"enable_kv_cache_events", "use_eagle"}
        t = self._target(monkeypatch, self._cfg(), manager_args=args)
        assert t.manager.use_eagle is False and t.manager.block_pool.enable_kv_cache_events is False
        full = self._target(monkeypatch, self._cfg(eagle=True))  # control: every argument passed
        assert full.manager.use_eagle is True and full.manager.block_pool.enable_kv_cache_events is True

    def test_no_junction_reports_boundary_zero(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from model.contract.ops import AddRequest, Probe, Schedule

        t = self._target(monkeypatch, self._cfg(), shared_prefix_junction=False)
        t.manager.get_computed_blocks = lambda req: (t.manager.empty_kv_cache_blocks, 0)
        t.apply(AddRequest("r", (1, 2, 3, 4, 5)))
        assert t.apply(Probe((1, 2, 3))).shared_prefix_boundary == 0
        assert t.apply(Schedule("r", 8)).scheduled == 5

    def test_no_cow_copies_are_drained_without_them(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from model.contract.ops import AddRequest, Schedule

        t = self._target(monkeypatch, self._cfg(), cow_copies=False)

        def boom() -> None:
            raise AssertionError("a release without CoW copies has no take_kv_cache_block_copies")

        t.manager.take_kv_cache_block_copies = boom
        t.apply(AddRequest("r", (1, 2, 3, 4, 5)))
        assert t.apply(Schedule("r", 8)).admitted
        t2 = self._target(monkeypatch, self._cfg())  # control: 0.33.0 drains them
        t2.manager.take_kv_cache_block_copies = boom
        t2.apply(AddRequest("r", (1, 2, 3)))
        with pytest.raises(Exception, match="take_kv_cache_block_copies"):
            t2.apply(Schedule("r", 8))

    def test_joined_coarse_hashes_are_named_by_their_last_fine_hash(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from invariants.targets.base import TargetCrash
        from model.contract.ops import AddRequest

        t = self._target(monkeypatch, self._cfg(), coarse_hash="concat")
        t.apply(AddRequest("r", (1, 2, 3, 4, 5, 6, 7, 8)))
        first, second = (bytes(h) for h in t.requests["r"].block_hashes[:2])
        assert t.keys.prefix(first + second) == (1, 2, 3, 4, 5, 6, 7, 8)
        t2 = self._target(monkeypatch, self._cfg())  # control: "last" releases never join
        t2.apply(AddRequest("r", (1, 2, 3, 4, 5, 6, 7, 8)))
        with pytest.raises(TargetCrash):
            t2.keys.prefix(first + second)


# ----------------------------------------------------------------------------- classification
def test_classes() -> None:
    old, new = (
        _caps(block_mask=True),
        _caps(
            block_mask=True,
            pool_order=True,
            config_retention=True,
            mamba_retention=True,
            eagle_mask=True,
            junction=True,
            fine=True,
        ),
    )
    assert classify("snapshot", "free_queue: ...", old).kind == "semantics"
    assert classify("uncached_reused_before_cached", "x", old).kind == "predates"
    assert classify("uncached_reused_before_cached", "x", new).kind == "defect"  # control
    assert classify("no_waste", "x", _caps()).kind == "predates"
    assert classify("hit_blocks_hold_their_prefix", "x", old).kind == "defect"
    assert classify("crash", "ValueError: sample: 'r0' is not waiting for a sample", old).kind == "semantics"
    assert (
        classify("crash", "TargetCrash: vLLM 0.22.0 raised on Schedule: AssertionError: x", old).kind
        == "defect"
    )
    assert (
        classify("crash", "TargetCrash: vLLM 0.22.0 raised on Schedule: TypeError: x", old).kind == "adapter"
    )
    adapter_raised = "TargetCrash: the vLLM adapter (vllm_target.py:430, under vLLM 0.22.0) raised on Step"
    assert classify("crash", adapter_raised + ": ValueError: x", old).kind == "adapter"
    assert "#43447" in classify("uncached_reused_before_cached", "x", old).note


def test_a_semantics_note_names_the_profile_the_model_predicted() -> None:
    # The note lists the switches that select an older rule; a release with
    # every mechanism gets the 0.33.0 profile, named as such (the control).
    old = _caps(block_mask=True, caller_order=True)
    profile = classify("snapshot", "events: ...", old).note.split("]")[0]
    assert "free_order='caller'" in profile and "eagle_aware_mask=False" in profile
    assert "block_mask" not in profile  # it has the block mask: not an older rule
    newest = {
        f.name: f.default for f in dataclasses.fields(Capabilities) if f.default is not dataclasses.MISSING
    }
    modeled = dataclasses.replace(
        old,
        **newest,
        free_order="pool",
        caching_off_order="lifo",
        mamba_retention=True,
        eagle_aware_mask=True,
        shared_prefix_junction=True,
    )
    assert modeled.profile() == Profile()
    assert "predicted profile [0.33.0]" in classify("observation", "x", modeled).note


# ----------------------------------------------------------------------------- shrinking
def test_shrink_keeps_the_failure_and_drops_the_rest() -> None:
    from invariants.harness.known_findings import load_known_findings
    from invariants.matrix.shrink import first_failure, shrink
    from invariants.targets import target_factory
    from model.contract.ops import AddRequest, Finish, Probe

    finding = next(f for f in load_known_findings() if "reference" in f.targets)
    factory = target_factory("reference")
    noise = [AddRequest("zz", (3, 3, 3)), Probe((3, 3)), Finish("zz")]
    ops = noise + list(finding.trace.ops)

    def judge(v: Any) -> tuple[str, bool]:
        return ("defect", False) if v.check == finding.property else ("other", True)

    hit = first_failure(factory, finding.trace.config, ops, judge)
    assert hit is not None and hit[1].check == finding.property
    small = shrink(factory, finding.trace.config, ops, judge, (finding.property, "defect"), float("inf"))
    assert len(small) <= len(finding.trace.ops) < len(ops)
    assert first_failure(factory, finding.trace.config, small, judge) is not None
    # control: a list without the failing part does not fail
    assert first_failure(factory, finding.trace.config, noise, judge) is None


# ----------------------------------------------------------------------------- table and CLI
def _run(version: str, verdict: str) -> Any:
    from invariants.matrix.runner import ReleaseRun

    caps = _caps(block_mask=version != "0.21.0").to_json()
    check = {
        "check": "fuzz",
        "verdict": verdict,
        "message": "no_waste: block 3",
        "tolerated": {"semantics": 2},
    }
    return ReleaseRun(
        version,
        python="/x/bin/python",
        install_s=12.0,
        disk_bytes=600_000_000,
        check_s=30.0,
        result={
            "capabilities": caps,
            "checks": [check, {**check, "check": "invariants", "verdict": "clean"}],
            "conformance": [{"check": "row", "verdict": "clean"}, {"check": "r0", "verdict": "n/a: x"}],
            "known": [{"id": "f1", "expected": True, "reproduces": False}],
        },
    )


def test_table_and_markdown_from_results() -> None:
    from invariants.matrix.markdown import render
    from invariants.matrix.runner import format_table

    runs = [_run("0.21.0", "predates"), _run("0.33.0", "clean")]
    text = format_table(runs)
    assert "predates: no_waste" in text and "clean (semantics 2)" in text and "1/1 agree" in text
    assert "unlisted/stale: f1" in text
    md = render(runs, "kvretain matrix")
    assert md.count("## vLLM") == 2 and "| 0.21.0 | 12 | 30 | 600 |" in md
    assert (
        md.count("model profile: `0.33.0 but ") == 2 and "block_mask=False" in md.split("## vLLM 0.33.0")[0]
    )


def test_scheduler_column_and_known_findings_through_the_scheduler() -> None:
    """The table's scheduler column and the known findings replayed through a release's own
    Scheduler reach the table and the report. Control: a report from before the scheduler
    check (no such row, no such field) still renders, saying it was not run."""
    from invariants.matrix.markdown import render
    from invariants.matrix.runner import format_table

    run = _run("0.33.0", "clean")
    run.result["checks"].insert(1, {"check": "scheduler", "verdict": "adapter", "message": "TargetCrash: x"})
    run.result["known"] = [
        {"id": "f1", "expected": True, "reproduces": True, "scheduler": True, "scheduler_note": ""},
        {"id": "f2", "expected": True, "reproduces": True, "scheduler": False, "scheduler_note": ""},
        {"id": "f3", "expected": True, "reproduces": True, "scheduler": None, "scheduler_note": "refused: y"},
    ]
    text = format_table([run])
    assert "adapter: TargetCrash" in text and "3 listed repro (1/2 via Scheduler)" in text
    md = render([run], "kvretain matrix")
    assert "`f2`: reproduces (listed for this release); through the real Scheduler: does not reproduce" in md
    assert "through the real Scheduler: not applicable (refused: y)" in md
    old = format_table([_run("0.33.0", "clean")])
    assert "n/a" in old.splitlines()[2] and "via Scheduler" not in old


def test_scheduler_check_is_na_where_the_scheduler_cannot_be_built(tmp_path: Path) -> None:
    """A release whose Scheduler lacks what the vllm target drives gets an n/a row naming
    what is missing, without building anything."""
    from invariants.matrix.worker import scheduler_check

    caps = dataclasses.replace(
        _caps(), version="0.24.0", scheduler_missing=("SchedulerOutput.kv_cache_block_copies",)
    )
    row = scheduler_check(caps, seed=0, budget_s=1.0, out=tmp_path)
    assert row["check"] == "scheduler" and row["verdict"].startswith("n/a: ")
    assert "kv_cache_block_copies" in row["verdict"] and not list(tmp_path.iterdir())


@needs_vllm
def test_scheduler_check_fuzzes_the_installed_scheduler(tmp_path: Path) -> None:
    """On the installed release the scheduler check drives the real Scheduler (target vllm)
    and judges it; its known findings replay there too. Control: a listed finding reproduces
    through the real scheduler, and the release's own tolerance lets nothing else through."""
    from invariants.matrix.worker import NO_SAMPLE_CACHING, run_known, scheduler_check
    from invariants.targets.vllm_capabilities import detect

    caps = detect()
    row = scheduler_check(caps, seed=0, budget_s=4.0, out=tmp_path)
    assert row["check"] == "scheduler" and row["verdict"] == "clean" and row["steps"] > 0, row
    assert NO_SAMPLE_CACHING not in row["not_generated"]
    # A release that caches drafting requests at allocation is not sent drafts, and says so.
    older = scheduler_check(
        dataclasses.replace(caps, sample_caching=False), seed=0, budget_s=2.0, out=tmp_path
    )
    assert older["verdict"] == "clean" and NO_SAMPLE_CACHING in older["not_generated"]
    known = {k["id"]: k for k in run_known(caps)}
    assert known["vllm-blockstored-token-range"]["scheduler"] is True
    assert all(k["scheduler"] is not False or not k["expected"] for k in known.values()), known


def test_the_known_design_is_stated_once_per_release() -> None:
    """Every check counts breaks of invariants of mechanisms the release lacks
    (class predates) and runs on; the report states them once per release, with
    the invariants not judged and the total. Control: a release that lacks no
    guarded mechanism gets no such line."""
    from invariants.matrix.markdown import render

    old = _run("0.21.0", "clean")
    for c in [*old.result["checks"], *old.result["conformance"]]:
        c["tolerated"] = {"predates": 5}
        c["tolerated_first"] = {"predates": "uncached_reused_before_cached: uncached block 6 sits behind 3"}
    old.result["capabilities"] = _caps().to_json()
    new = _run("0.33.0", "clean")
    new.result["capabilities"] = _caps(
        block_mask=True, pool_order=True, env_retention=True, mamba_retention=True, junction=True
    ).to_json()
    md = render([old, new], "kvretain matrix")
    first, second = md.split("## vLLM 0.33.0")
    assert first.count("known design") == 1 and "tolerated predates" not in first
    assert "20 break(s) over 4 check(s)" in first and "`uncached_reused_before_cached`" in first
    assert "free_order (#42656" in first
    assert "known design" not in second


def test_bad_releases_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In this process (the command line's exit code and stderr are main's; a fresh process
    added only its imports, torch's among them)."""
    from invariants.cli.main import main

    out = tmp_path / "m.json"
    assert main(["matrix", "--releases", "latest", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--releases" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.slow
@needs_vllm
def test_two_release_matrix_table_and_json(tmp_path: Path) -> None:
    js, md = tmp_path / "m.json", tmp_path / "m.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "invariants.cli.main",
            "matrix",
            "--releases",
            "0.33.0,0.22.0",
            "--budget-s",
            "10",
            "--json",
            str(js),
            "--markdown",
            str(md),
            "--out",
            str(tmp_path / "traces"),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-800:]
    assert "release" in proc.stdout and "0.22.0" in proc.stdout and "0.33.0" in proc.stdout
    data = json.loads(js.read_text())
    versions = [r["version"] for r in data["releases"]]
    assert versions == ["0.22.0", "0.33.0"]
    by = {r["version"]: r for r in data["releases"]}
    assert (
        by["0.22.0"]["capabilities"]["block_mask"] and by["0.22.0"]["capabilities"]["free_order"] == "append"
    )
    assert by["0.33.0"]["capabilities"]["free_order"] == "pool"
    assert all(r["error"] is None and r["checks"] for r in data["releases"])
    assert "## vLLM 0.22.0" in md.read_text()


def test_missing_module_reads_the_probe_line() -> None:
    """Both engines' release environments install what a failed import probe names;
    any other failure is an error, never a package to install."""
    from invariants.targets.vllm_env import ReleaseEnvError, missing_module

    assert missing_module(True, "vllm 0.30.0") is None
    assert missing_module(False, "ModuleNotFoundError: No module named 'einops.layers'") == "einops"
    with pytest.raises(ReleaseEnvError, match="cannot import name"):
        missing_module(False, "ImportError: cannot import name 'X' from 'vllm'")


def test_a_stamped_environment_gets_the_schedulers_extras_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An environment stamped before the scheduler's modules were probed installs the
    pinned package its scheduler misses (0.29.0's `einops`) on its next use, once, and
    restamps. Control: a scheduler failing for any other reason installs nothing and
    leaves the environment usable (the vllm target then says why it cannot run)."""
    from invariants.targets import vllm_env

    installed: list[str] = []
    probes = iter(
        [
            (False, "vllm.v1.core.sched.scheduler: ModuleNotFoundError: No module named 'einops'", "0.29.0"),
            (True, "vLLM 0.29.0", "0.29.0"),
        ]
    )
    monkeypatch.setattr(vllm_env, "probe_python", lambda python, timeout=0, modules=(): next(probes))
    monkeypatch.setattr(vllm_env, "pip_install_target", lambda site, req, what=None: installed.append(req))
    monkeypatch.setattr(vllm_env, "_site_dir", lambda root: root)
    root = tmp_path / "vllm-0.29.0"
    root.mkdir()
    (root / ".kvretain-ready").write_text(json.dumps({"version": "0.29.0", "disk_bytes": 1, "extras": []}))
    env = vllm_env.prepare_release("0.29.0", root)
    assert installed == ["einops==0.8.1"] and env.extras == ("einops==0.8.1",)
    assert json.loads((root / ".kvretain-ready").read_text())["probe"] == vllm_env.STAMP_PROBE
    assert vllm_env.prepare_release("0.29.0", root).extras == ("einops==0.8.1",) and len(installed) == 1

    other = tmp_path / "vllm-0.26.0"
    other.mkdir()
    (other / ".kvretain-ready").write_text(json.dumps({"version": "0.26.0", "disk_bytes": 1, "extras": []}))
    monkeypatch.setattr(
        vllm_env,
        "probe_python",
        lambda python, timeout=0, modules=(): (
            False,
            "vllm.v1.core.sched.scheduler: ImportError: x",
            "0.26.0",
        ),
    )
    assert vllm_env.prepare_release("0.26.0", other).extras == () and len(installed) == 1
