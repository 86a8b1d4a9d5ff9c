"""The vLLM target against the executable model, operation by operation.

`AllocatorModel(config, events="vllm-0.33.0")` and `VllmManagerTarget(config)` are
driven with the same operations (the scenarios of shared/vllm_notes.md: 02
Full+SWA, 04 Eagle, 05/06 Mamba, 07 events, 08 sharing/preemption, 09
junction, 11 full-attention partial tail, 12 hit rules, plus seeded random
walks); after every operation the observation and the whole snapshot must be
equal. Negative controls: two mutated vLLM methods must be caught on a trace
where the unmutated vLLM agrees. Skipped, with the reason, when vLLM cannot be
imported.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from invariants.targets.vllm_env import (
    MODELED_VERSION,
    probe_python,
    version_warning,
    vllm_available,
    vllm_version,
)

_OK, _REASON = vllm_available()
if not _OK:
    pytest.skip(f"vllm target: {_REASON}", allow_module_level=True)

from invariants.harness.checker import Checker, Violation  # noqa: E402
from invariants.harness.known_findings import (  # noqa: E402
    DEFAULT_PATH,
    KnownFindingsError,
    is_known_violation,
    known_finding,
    load_known_findings,
    parse_known_findings,
)
from invariants.targets import target_factory  # noqa: E402
from invariants.targets.base import TargetCrash  # noqa: E402
from invariants.targets.vllm_target import (  # noqa: E402
    NO_PINNED_TIER,
    UnsupportedConfig,
    VllmManagerTarget,
)
from model.contract.config import Config, ConfigError, GroupSpec  # noqa: E402
from model.contract.observation import BlockKey, BlockStored, Observation, diff_snapshots  # noqa: E402
from model.contract.ops import (  # noqa: E402
    AddRequest,
    EvictBlocks,
    Finish,
    Op,
    Preempt,
    Probe,
    ResetPrefixCache,
    Sample,
    Schedule,
    Step,
)
from model.machine.allocator import AllocatorModel  # noqa: E402

pytestmark = pytest.mark.vllm


def full(bs: int) -> GroupSpec:
    return GroupSpec("full", bs)


def swa(bs: int, window: int) -> GroupSpec:
    return GroupSpec("swa", bs, window)


def mamba(bs: int) -> GroupSpec:
    return GroupSpec("mamba", bs)


class Lockstep:
    """Apply each op to the model (vLLM event profile) and to vLLM; record every difference."""

    def __init__(self, cfg: Config) -> None:
        self.model = AllocatorModel(cfg, events="vllm-0.33.0")
        self.target = VllmManagerTarget(cfg)
        self.ops: list[Op] = []
        self.problems: list[str] = []
        self.next_token = 50000
        self.events_seen = 0

    def do(self, op: Op) -> Observation:
        i = len(self.ops)
        self.ops.append(op)
        expected = self.model.apply(op)
        actual = self.target.apply(op)
        if expected != actual:
            self.problems.append(f"op {i} {op}: observation: model {expected} / vllm {actual}")
        snap = self.target.snapshot()
        self.events_seen += len(snap.events)
        self.problems += [f"op {i} {op}: {line}" for line in diff_snapshots(self.model.snapshot(), snap)]
        return expected

    def run_to(self, rid: str, prompt: Sequence[int], total: int, budget: int) -> Observation:
        """Add `rid`, then schedule (sampling whenever it is caught up) until `total`
        tokens are computed; return the admission's observation."""
        self.do(AddRequest(rid, tuple(prompt)))
        req = self.model.requests[rid]
        admission: Observation | None = None
        while not (req.running and req.num_computed >= total):
            if req.running and req.num_computed == req.num_tokens:
                self.next_token += 1
                self.do(Sample(rid, self.next_token))
            else:
                result = self.do(Schedule(rid, budget))
                admission = admission or result
                assert getattr(result, "scheduled", 0) > 0, f"{rid} made no progress: {result}"
        assert admission is not None
        return admission

    def probe(self, tokens: Sequence[int]) -> Observation:
        return self.do(Probe(tuple(tokens)))

    def cached_block(self, group: int, prefix: tuple[int, ...]) -> int:
        block = self.model.pool.lookup(BlockKey(group, prefix))
        assert block is not None
        return block


def agree(lock: Lockstep) -> None:
    assert not lock.problems, "model and vLLM disagree:\n" + "\n".join(lock.problems[:12])


P100 = list(range(1, 101))


# --------------------------------------------------------------------------- scenarios
@pytest.mark.parametrize("retention", [None, 0, 64])
@pytest.mark.parametrize(
    "groups,prompt,total,budget",
    [((full(16), swa(16, 32)), 100, 120, 32), ((full(32), swa(16, 32)), 150, 170, 64)],
    ids=["full16+swa16", "full32+swa16"],
)
def test_02_hybrid_full_swa(
    groups: tuple[GroupSpec, ...], prompt: int, total: int, budget: int, retention: int | None
) -> None:
    lock = Lockstep(Config(groups, num_blocks=64, retention_interval=retention))
    lock.run_to("A", range(1, prompt + 1), total, budget)
    tokens = lock.model.requests["A"].tokens
    lock.do(Finish("A"))
    resend = lock.probe(range(1, prompt + 1))
    lock.probe(list(range(1, prompt + 1)) + [7] * 40)
    lock.probe(list(tokens) + [9] * 20)
    agree(lock)
    assert getattr(resend, "hit", 0) == (96 if prompt == 100 else 128)  # notes §7


@pytest.mark.parametrize("retention", [None, 0, 64])
def test_04_eagle(retention: int | None) -> None:
    lock = Lockstep(Config((full(16), swa(16, 32)), num_blocks=64, retention_interval=retention, eagle=True))
    lock.run_to("A", P100, 120, 32)
    lock.do(Finish("A"))
    resend = lock.probe(P100)
    lock.probe(P100 + [7] * 40)
    agree(lock)
    assert getattr(resend, "hit", 0) == 80  # notes §7: Eagle drops one block


@pytest.mark.parametrize("eagle", [False, True])
def test_04_unitary_full(eagle: bool) -> None:
    lock = Lockstep(Config((full(16),), num_blocks=64, eagle=eagle))
    lock.run_to("A", P100, 120, 32)
    lock.do(Finish("A"))
    lock.probe(P100)
    agree(lock)


@pytest.mark.parametrize(
    "groups,retention,eagle,budget",
    [
        ((full(16), mamba(16)), 0, True, 32),
        ((full(16), mamba(16)), 0, False, 32),
        ((full(16), mamba(16)), 64, False, 32),
        ((full(16), mamba(16)), None, False, 32),
        ((full(16), mamba(16)), 0, False, 100),
        ((full(32), mamba(16), swa(16, 32)), 0, False, 64),
        ((full(32), mamba(16), swa(16, 32)), 64, True, 64),
    ],
)
def test_05_06_mamba(groups: tuple[GroupSpec, ...], retention: int | None, eagle: bool, budget: int) -> None:
    lock = Lockstep(Config(groups, num_blocks=64, retention_interval=retention, eagle=eagle))
    lock.run_to("A", P100, 110, budget)
    tokens = lock.model.requests["A"].tokens
    lock.do(Finish("A"))
    lock.probe(P100)
    lock.probe(P100 + [7] * 40)
    lock.probe(list(tokens) + [9] * 20)
    lock.run_to("B", P100, 100, budget)  # re-admission on the Mamba hit
    lock.do(Finish("B"))
    agree(lock)


@pytest.mark.parametrize("retention", [0, None])
def test_07_events_eviction_reset(retention: int | None) -> None:
    lock = Lockstep(Config((full(16), swa(16, 32)), num_blocks=24, retention_interval=retention))
    lock.run_to("A", P100, 101, 64)
    lock.do(Finish("A"))
    lock.do(AddRequest("B", (999,) * 300))
    lock.do(Schedule("B", 300))  # too large: not admitted
    lock.do(AddRequest("C", (999,) * 150))
    lock.do(Schedule("C", 150))  # evicts cached blocks (BlockRemoved)
    lock.do(Finish("C"))
    lock.do(Finish("B"))
    lock.do(ResetPrefixCache())
    agree(lock)
    assert lock.events_seen > 0


def test_08_sharing_preemption_failure_evict() -> None:
    lock = Lockstep(Config((full(16), swa(16, 32)), num_blocks=40, retention_interval=0))
    lock.run_to("A", P100, 100, 64)
    lock.do(AddRequest("B", tuple(P100) + (5,) * 30))
    lock.do(Schedule("B", 64))  # shares A's blocks
    lock.do(Preempt("B"))
    lock.do(Schedule("B", 64))  # re-admitted on a hit
    lock.do(Schedule("B", 64))
    lock.do(ResetPrefixCache())  # refused: blocks in use
    lock.do(Finish("A"))
    lock.do(Finish("B"))
    lock.do(AddRequest("C", tuple(range(1000, 1000 + 16 * 30))))
    lock.do(Schedule("C", 10**6))  # allocation failure
    lock.do(EvictBlocks(tuple(sorted(lock.model.pool.primary)[:3])))
    lock.probe(P100)
    agree(lock)


@pytest.mark.parametrize(
    "groups,eagle",
    [((full(16), swa(16, 32)), False), ((full(16), mamba(16)), False), ((full(16), swa(16, 32)), True)],
    ids=["swa", "mamba", "swa-eagle"],
)
def test_09_shared_prefix_junction(groups: tuple[GroupSpec, ...], eagle: bool) -> None:
    system = list(range(1, 71))
    lock = Lockstep(Config(groups, num_blocks=64, retention_interval=0, eagle=eagle))
    lock.run_to("A", system + [500 + i for i in range(40)], 110, 32)
    lock.do(Finish("A"))
    seen = []
    for rid, tail in (("B", 600), ("C", 700)):
        admission = lock.run_to(rid, system + [tail + i for i in range(40)], 110, 32)
        seen.append((getattr(admission, "hit", None), getattr(admission, "shared_prefix_boundary", None)))
        lock.do(Finish(rid))
    agree(lock)
    # B finds the junction, C hits it (notes §5.3: 64, or 48 with Eagle)
    junction = 48 if eagle else 64
    assert seen[0][1] == junction and seen[1][0] == junction, seen


@pytest.mark.parametrize("retention", [None, 0, 64])
def test_11_full_partial_tail(retention: int | None) -> None:
    lock = Lockstep(Config((full(32), swa(16, 32)), num_blocks=64, retention_interval=retention))
    lock.run_to("A", range(1, 151), 170, 64)
    lock.do(Finish("A"))
    lock.probe(range(1, 145))
    lock.probe(range(1, 151))
    agree(lock)


def test_12_hit_rules() -> None:
    tokens = tuple(range(1, 161))
    lock = Lockstep(Config((full(16), swa(16, 32)), num_blocks=80))
    lock.run_to("A", tokens, 160, 160)
    lock.do(Finish("A"))
    hits = [getattr(lock.probe(tokens), "hit", None)]
    for group, j in ((1, 3), (1, 8), (0, 5)):
        lock.do(EvictBlocks((lock.cached_block(group, tokens[: (j + 1) * 16]),)))
        hits.append(getattr(lock.probe(tokens), "hit", None))
    agree(lock)
    assert hits == [144, 144, 128, 48]  # notes §3.3

    short = Lockstep(Config((full(16), swa(16, 64)), num_blocks=64))
    short.run_to("A", range(1, 41), 40, 40)
    short.do(Finish("A"))
    assert getattr(short.probe(range(1, 41)), "hit", None) == 32
    agree(short)

    three = Lockstep(Config((full(16), swa(16, 32), swa(16, 64)), num_blocks=80, retention_interval=0))
    three.run_to("A", P100, 100, 32)
    three.do(Finish("A"))
    three.probe(P100)
    agree(three)


# --------------------------------------------------------------------------- random walks
def _random_config(rng: random.Random) -> Config:
    hbs = rng.choice([4, 8, 16])
    kinds = rng.choice(
        [["full", "swa"], ["full", "mamba"], ["full", "swa", "mamba"], ["swa"], ["full", "swa", "swa"]]
    )
    groups = []
    for kind in kinds:
        if kind == "mamba":
            groups.append(mamba(hbs))
        elif kind == "full":
            groups.append(full(hbs * rng.choice([1, 2, 4])))
        else:  # windows >= 2: see test_swa_window_one_disagreement
            groups.append(swa(hbs * rng.choice([1, 2]), rng.choice([2, hbs, hbs + 1, 2 * hbs, 5 * hbs - 1])))
    sbs = math.lcm(*(g.block_size for g in groups))
    return Config(
        tuple(groups),
        num_blocks=rng.choice([10, 16, 32]),
        retention_interval=rng.choice([None, 0, sbs, 2 * sbs]),
        eagle=rng.random() < 0.3,
    )


def _random_walk(seed: int, steps: int) -> Iterator[Lockstep]:
    rng = random.Random(seed)
    cfg = _random_config(rng)
    lock = Lockstep(cfg)
    prompts: list[tuple[int, ...]] = []
    n = 0

    def tokens() -> tuple[int, ...]:
        if prompts and rng.random() < 0.7:
            base = rng.choice(prompts)
            cut = rng.randint(1, len(base))
            return base[:cut] + tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 30)))
        return tuple(rng.randint(1, 1000) for _ in range(rng.randint(1, 60)))

    for _ in range(steps):
        reqs = lock.model.requests
        live = sorted(reqs)
        x = rng.random()
        if x < 0.2 or not live:
            n += 1
            prompt = tokens()
            prompts.append(prompt)
            lock.do(AddRequest(f"r{n}", prompt))
        elif x < 0.62:
            rid = rng.choice(live)
            req = reqs[rid]
            if req.running and req.num_computed == req.num_tokens:
                lock.next_token += 1
                lock.do(Sample(rid, rng.choice([lock.next_token, 1, 2])))
            else:
                lock.do(Schedule(rid, rng.choice([1, 3, 8, 16, 32, 64, 1000])))
        elif x < 0.72:
            rid = rng.choice(live)
            prompts.append(reqs[rid].tokens)
            lock.do(Finish(rid))
        elif x < 0.77:
            rid = rng.choice(live)
            if reqs[rid].running:
                lock.do(Preempt(rid))
        elif x < 0.9:
            lock.probe(list(tokens()))
        elif x < 0.93:
            lock.do(ResetPrefixCache())
        else:
            lock.do(EvictBlocks(tuple(rng.sample(range(1, cfg.num_blocks), rng.randint(1, 3)))))
        if lock.problems:
            break
    yield lock


@pytest.mark.parametrize("seed", range(24))
def test_random_walk_agrees(seed: int) -> None:
    for lock in _random_walk(seed, 120):
        agree(lock)


# --------------------------------------------------------------------------- model disagreement
def test_swa_window_one_agrees() -> None:
    """vLLM `SlidingWindowManager.find_longest_cache_hit` only counts a boundary once it
    has found a cached block, so with `ceil((w-1)/bs) = 0` the hit still needs block
    e-1 cached (and the w=1 mask never caches one: the hit is always 0). Found by this
    suite; the model's `swa_hit` now needs at least one block."""
    lock = Lockstep(Config((swa(16, 1),), num_blocks=8, retention_interval=0))
    lock.do(AddRequest("r1", tuple(range(1, 21))))
    lock.do(Schedule("r1", 3))
    agree(lock)


# --------------------------------------------------------------------------- negative controls
def _mutation_trace(lock: Lockstep) -> None:
    lock.run_to("A", P100, 110, 32)
    lock.do(Finish("A"))
    lock.probe(P100)
    lock.run_to("B", P100 + [3] * 20, 120, 64)
    lock.do(Finish("B"))


def test_mutant_uncached_blocks_appended_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pre-#43447 free order: uncached blocks go to the tail instead of the head."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    cfg = Config((full(16), swa(16, 32)), num_blocks=40, retention_interval=0)
    clean = Lockstep(cfg)
    _mutation_trace(clean)
    agree(clean)
    monkeypatch.setattr(FreeKVCacheBlockQueue, "prepend_n", FreeKVCacheBlockQueue.append_n)
    mutant = Lockstep(cfg)
    _mutation_trace(mutant)
    assert any("free_queue" in p for p in mutant.problems), mutant.problems[:5]


def test_mutant_swa_mask_off_by_one_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """`SlidingWindowManager.reachable_block_mask` shifted one block: the wrong SWA tail is kept."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    original = SlidingWindowManager.reachable_block_mask.__func__  # type: ignore[attr-defined]

    def shifted(cls: type, start_block: int, end_block: int, *args: object, **kwargs: object) -> object:
        return original(cls, start_block + 1, end_block + 1, *args, **kwargs)

    cfg = Config((full(16), swa(16, 32)), num_blocks=40, retention_interval=0)
    clean = Lockstep(cfg)
    _mutation_trace(clean)
    agree(clean)
    monkeypatch.setattr(SlidingWindowManager, "reachable_block_mask", classmethod(shifted))
    mutant = Lockstep(cfg)
    _mutation_trace(mutant)
    assert any("cached[" in p or "block_hash[" in p for p in mutant.problems), mutant.problems[:5]


# --------------------------------------------------------------------------- configuration
def test_vllm_rejection_becomes_config_error() -> None:
    with pytest.raises(
        ConfigError, match=r"must be non-negative and a multiple of scheduler_block_size \(16\)"
    ):
        VllmManagerTarget(Config((full(16), swa(16, 32)), num_blocks=16, retention_interval=40))
    with pytest.raises(ConfigError, match="no sliding-window or Mamba KV cache group"):
        VllmManagerTarget(Config((full(16),), num_blocks=16, retention_interval=64))


def test_pinned_tier_is_unsupported() -> None:
    with pytest.raises(UnsupportedConfig, match="no pinned tier"):
        VllmManagerTarget(Config((full(16), swa(16, 32)), num_blocks=16, pin_swa_on_drop=True))
    assert "#40676" in NO_PINNED_TIER
    assert issubclass(UnsupportedConfig, ConfigError)


@pytest.mark.parametrize("retention", [0, None])
def test_06_fine_grained_mamba_resend(retention: int | None) -> None:
    """Full16 + Mamba64 (hash block 16): a 150-token prompt's chunks end at 64, 128,
    144, 150; its state at 144 is keyed inside a Mamba block and moved to a copy;
    the resend hits 144 and reads a private copy of that state."""
    cfg = Config((full(16), mamba(64)), num_blocks=64, retention_interval=retention, hash_block_size=16)
    lock = Lockstep(cfg)
    prompt = list(range(1000, 1150))
    lock.do(AddRequest("A", tuple(prompt)))
    chunks = [lock.do(Schedule("A", 64)) for _ in range(4)]
    assert [c.scheduled for c in chunks] == [64, 64, 16, 6]  # type: ignore[union-attr]
    ((src, moved_to),) = chunks[-1].copies  # type: ignore[union-attr]
    assert lock.cached_block(1, tuple(prompt[:144])) == moved_to
    lock.do(Finish("A"))
    resend = lock.run_to("B", prompt, 150, 64)
    assert resend.hit == 144  # type: ignore[union-attr]
    ((copied, private),) = resend.copies  # type: ignore[union-attr]
    assert copied == moved_to and resend.new_blocks[1][0] == private  # type: ignore[union-attr]
    agree(lock)


def test_fine_grained_mamba_fuzz_agrees(tmp_path: Path) -> None:
    """A few hundred generated operations on fine-grained configurations: no
    difference from the model and no invariant broken on vLLM."""
    from invariants.harness.fuzz import run_fuzz
    from invariants.harness.strategies import configs

    shapes = (("full", "mamba"), ("full", "swa", "mamba"))
    report = run_fuzz(
        "vllm-manager",
        seed=5,
        steps=400,
        strategy=configs(allow_pinning=False, fine=True, shapes=shapes),
        progress=False,
        database=None,
        out_dir=tmp_path,
    )
    assert report.failure is None, report.failure
    assert report.stats.steps >= 400
    assert report.stats.features["config: fine-grained Mamba hits"] > 0
    assert report.stats.features["CoW copy of a request's own tail (move_block_hashes)"] > 0


def test_registry_builds_the_vllm_target() -> None:
    target = target_factory("vllm-manager")(Config((full(16), swa(16, 32)), num_blocks=16))
    assert target.name == "vllm-manager"
    assert getattr(target, "version_note", "x") is None  # vLLM 0.33.0: no drift warning
    assert getattr(target, "event_profile", None) == "vllm-0.33.0"


# --------------------------------------------------------------------------- known findings
def test_known_finding_replays_on_vllm() -> None:
    [finding] = [f for f in load_known_findings() if f.id == "vllm-blockstored-token-range"]
    assert "vllm-manager" in finding.targets and MODELED_VERSION in finding.versions
    checker = Checker(VllmManagerTarget(finding.trace.config))
    found = [v for op in finding.trace.ops for v in checker.step(op)]
    assert found, "the known finding no longer reproduces (fixed upstream?)"
    assert {v.check for v in found} == {finding.property}, found
    assert all(is_known_violation("vllm-manager", v) for v in found)
    events = [e for e in checker.last.events if isinstance(e, BlockStored) and e.group == 1]
    assert [(len(e.block_hashes), len(e.token_ids)) for e in events] == [(2, 96)]


def test_known_finding_matching() -> None:
    [finding] = [f for f in load_known_findings() if f.id == "vllm-blockstored-token-range"]
    cfg, op = finding.trace.config, finding.trace.ops[-1]
    prop = "stored_tokens_match_hashes"
    msg = "BlockStored(group 1) has 2 hash(es) of 16 tokens but 96 token ids"
    v = Violation(prop, msg, cfg, op)
    assert known_finding("vllm-manager", "0.33.0", v) is finding
    assert known_finding("vllm-manager", "0.34.0", v) is None
    assert known_finding("reference", "0.33.0", v) is None
    assert known_finding("vllm-manager", "0.33.0", Violation("no_waste", msg, cfg, op)) is None
    chain = Violation(prop, "BlockStored(group 1) hash 0 does not chain from its parent and tokens", cfg, op)
    assert known_finding("vllm-manager", "0.33.0", chain) is None


def test_known_findings_file_errors_name_the_field() -> None:
    with pytest.raises(KnownFindingsError, match="format"):
        parse_known_findings({"format": "x", "version": 1, "findings": []})
    with pytest.raises(KnownFindingsError, match=r"findings\[0\]\.property"):
        parse_known_findings(
            {
                "format": "kvretain-known-findings",
                "version": 2,
                "findings": [{"id": "a", "target": "vllm-manager"}],
            }
        )
    # A finding is a claim: a pattern, and a precondition whose names are known.
    [finding] = [f for f in load_known_findings() if f.id == "vllm-blockstored-token-range"]
    raw = json.loads(DEFAULT_PATH.read_text())
    entry = next(e for e in raw["findings"] if e["id"] == finding.id)
    for edit, field in (
        ({"message_pattern": None}, "message_pattern"),
        ({"precondition": None}, "precondition"),
        ({"precondition": {"config": ["no_such"], "operations": ["step"]}}, r"precondition\.config"),
        ({"precondition": {"config": [], "operations": []}}, r"precondition\.operations"),
        ({"precondition": {"config": [], "operations": ["step"], "shape": "nope"}}, r"precondition\.shape"),
        (
            {
                "message_pattern": "x",
                "precondition": {"operations": ["step"], "shape": "token_ids_span_skipped_blocks"},
            },
            r"precondition\.shape.*does not capture",
        ),
    ):
        bad = {**raw, "findings": [{**entry, **edit}]}
        with pytest.raises(KnownFindingsError, match=field):
            parse_known_findings(bad)


# --------------------------------------------------------------------------- environment
def test_version_detection() -> None:
    assert vllm_version() == MODELED_VERSION
    assert version_warning(MODELED_VERSION) is None
    warning = version_warning("0.34.1")
    assert warning == (
        "vLLM 0.34.1 found; kvretain models 0.33.0 semantics, a disagreement may be version drift"
    )


def test_the_installed_version_is_read_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every vLLM target asks for the installed version: its metadata is parsed once per
    process (parsing it was about a sixth of building a target). Control: the reader
    without its cache parses it on every call."""
    import importlib.metadata

    real = importlib.metadata.version
    reads: list[str] = []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: reads.append(name) or real(name))
    vllm_version.cache_clear()
    try:
        assert vllm_version() == vllm_version() == real("vllm")
        assert reads == ["vllm"]
        reads.clear()
        assert vllm_version.__wrapped__() == vllm_version.__wrapped__()
        assert reads == ["vllm", "vllm"]
    finally:
        vllm_version.cache_clear()


def test_probe_python_reports_a_missing_interpreter() -> None:
    ok, line, version = probe_python("/nonexistent/python")
    assert not ok and "no such interpreter" in line and version is None


# --------------------------------------------------------------------------- crash attribution
def test_a_crash_names_who_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure inside the adapter is kvretain's gap, never a defect of vLLM;
    one inside vLLM's package is vLLM's."""
    target = VllmManagerTarget(Config(groups=(full(4),), num_blocks=8))
    target.apply(AddRequest("r0", (1, 2, 3, 4, 5)))

    def broken(req: object) -> tuple[object, int, int]:
        raise ValueError("adapter bookkeeping")

    monkeypatch.setattr(target.scheduler, "computed_blocks", broken)
    with pytest.raises(TargetCrash, match=r"the vLLM adapter \(test_vllm_target\.py:\d+"):
        target.apply(Step(("r0",), 8))
    try:
        target.manager.free(None)  # vLLM itself raises on a request it cannot read
    except Exception as exc:
        assert target.driver.raiser(exc).startswith("vLLM ")
    else:
        pytest.fail("KVCacheManager.free(None) did not raise")


def test_a_probe_takes_shared_hashes_and_vllm_hashes_the_rest() -> None:
    """A probe's block hashes equal a freshly hashed request's, whichever donor
    lends the shared blocks; a donor that differs mid-way lends only the blocks
    before the difference (a wrong loan would change the lookup's hashes)."""
    cfg = Config(groups=(GroupSpec("full", 4),), num_blocks=64)
    target = VllmManagerTarget(cfg)
    rng = random.Random(5)
    base = tuple(rng.randrange(1, 50) for _ in range(40))
    target.apply(AddRequest("a", base))
    target.apply(AddRequest("b", base[:13] + (99,) + base[14:]))  # differs in block 3
    for tokens in (base, base[:22], base[:9] + (7,) * 20, base[:13] + (99,) + base[14:30], (5,) * 12):
        fresh = target.driver.new_request("fresh", tokens, known=[])
        probe = target.driver.probe_request(tokens)
        assert probe.block_hashes == fresh.block_hashes, tokens
    # The loan itself: the longest shared run of full blocks, from the start.
    from invariants.targets.vllm_hashing import shared_hashes

    a, b = target.requests["a"], target.requests["b"]
    assert shared_hashes(list(base[:13] + (99,) + base[14:]), [a], 4) == a.block_hashes[:3]
    assert shared_hashes(list(base[:13] + (99,) + base[14:]), [a, b], 4) == b.block_hashes
    assert shared_hashes(list((7,) + base[1:]), [a, b], 4) == []
