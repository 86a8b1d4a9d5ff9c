"""Scenarios from the seeds, run under several retention settings over one target.

- `sequential` (#43447): long requests one after another; after each, the
  first request's prompt is probed: after how many others does it stop hitting?
- `concurrent` (#43447): N long requests run together, then each is probed at
  several prompt fractions (a prefix of the prompt plus a fresh suffix).
- `sweep` (#40676): K shared prefixes (15..60), requests = prefix + unique
  suffix, several rounds; how much of the shared prefix hits.
- `multiturn` (#45845): Mamba conversations, each turn's prompt is the whole
  history plus a new user message.

Settings: `off` (caching disabled), `dense` (retention None), `r0`, two
intervals `rK`, `pre43447` (retention 0 with the pre-#43447 free order: the
zoo mutant `swa_slide_appends_uncached`) and `pinned` (the #40676 tier over
dense). `pre43447` and `pinned` need the reference target and an SWA group.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from invariants.simulate.engine import Engine, SimRequest, random_tokens
from invariants.targets import PINNING_TARGETS, Target, target_factory
from invariants.targets.reference import ReferenceTarget
from model.config import Config

Progress = Callable[[str], None]
MUTANT = "swa_slide_appends_uncached"


@dataclass(frozen=True)
class Setting:
    name: str
    config: Config
    mutant: str | None = None


def settings_for(base: Config, intervals: tuple[int, ...], target: str) -> list[Setting]:
    out = [
        Setting("off", base.with_(enable_caching=False, retention_interval=None)),
        Setting("dense", base.with_(retention_interval=None)),
        Setting("r0", base.with_(retention_interval=0)),
    ]
    sbs = base.scheduler_block_size
    for k in intervals:
        k = max(sbs, k // sbs * sbs)
        out.append(Setting(f"r{k}", base.with_(retention_interval=k)))
    has_swa = any(g.kind == "swa" for g in base.groups)
    if has_swa and target == "reference":
        out.append(Setting("pre43447", base.with_(retention_interval=0), mutant=MUTANT))
    if has_swa and target in PINNING_TARGETS:
        out.append(Setting("pinned", base.with_(retention_interval=None, pin_swa_on_drop=True)))
    return out


class _FastReference(ReferenceTarget):
    TRACK_PREFIXES = False


def make_target(target: str, setting: Setting) -> Target:
    if setting.mutant is not None:
        from invariants.zoo.mutants_reference import REFERENCE_MUTANTS, ZooReferenceTarget

        class _FastZoo(ZooReferenceTarget):
            TRACK_PREFIXES = False

        return _FastZoo(setting.config, REFERENCE_MUTANTS[setting.mutant])
    if target == "reference":
        return _FastReference(setting.config)
    if target == "vllm":
        from invariants.targets.vllm_target import VllmTarget

        target_factory(target)  # TargetUnavailable when vLLM cannot load
        return VllmTarget(setting.config, track_prefixes=False)
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


@dataclass
class Row:
    setting: str
    hit_rate: float
    cached_per_req: int
    survived: str
    alloc_failures: int
    preemptions: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Params:
    """Sizes of one scenario run (see SCALES)."""

    length: int  # prompt tokens per long request / shared prefix
    num_blocks: int
    count: int  # other requests (sequential), concurrency (concurrent), conversations (multiturn)
    token_budget: int
    extra: tuple[int, ...] = ()  # sweep: prefix counts; multiturn: (turns, user tokens, outputs)
    intervals: tuple[int, ...] = ()
    suffix: int = 0


class Ctx:
    def __init__(self, target: str, seed: int, progress: Progress | None) -> None:
        self.target = target
        self.seed = seed
        self.progress = progress

    def engine(self, t: Target, rng: random.Random, budget: int, running: int) -> Engine:
        return Engine(t, token_budget=budget, max_running=running, rng=rng, progress=self.progress)


def _calibrate(ctx: Ctx, setting: Setting, length: int, budget: int) -> int:
    """Blocks one request of `length` tokens leaves cached when it runs alone."""
    t = make_target(ctx.target, setting)
    rng = random.Random(ctx.seed ^ 0xCA1)
    e = ctx.engine(t, rng, budget, 1)
    e.submit(SimRequest("cal", random_tokens(rng, length)))
    e.run()
    return cached_blocks(t)


# ------------------------------------------------------------------ (a)
def sequential(ctx: Ctx, setting: Setting, p: Params) -> Row:
    t0 = time.monotonic()
    t = make_target(ctx.target, setting)
    rng = random.Random(ctx.seed)
    e = ctx.engine(t, rng, p.token_budget, 1)
    first = SimRequest("r0", random_tokens(rng, p.length))
    e.submit(first)
    e.run()
    cached = cached_blocks(t)
    hits = [e.probe(first.prompt).hit]
    for k in range(1, p.count + 1):
        e.submit(SimRequest(f"r{k}", random_tokens(rng, p.length)))
        e.run()
        hits.append(e.probe(first.prompt).hit)
    survived = next((k - 1 for k, h in enumerate(hits) if h == 0), len(hits) - 1)
    label = "no hit" if survived < 0 else f"{survived}" if survived < p.count else f">={p.count}"
    rate = sum(hits[1:]) / (p.count * p.length)
    return Row(setting.name, rate, cached, label, e.stats.alloc_failures, e.stats.preemptions,
               time.monotonic() - t0, {"replay_hit_0": hits[0], "hits": hits})


FRACTIONS = (0.25, 0.5, 0.75, 1.0)


# ------------------------------------------------------------------ (b)
def concurrent(ctx: Ctx, setting: Setting, p: Params) -> Row:
    t0 = time.monotonic()
    t = make_target(ctx.target, setting)
    rng = random.Random(ctx.seed)
    e = ctx.engine(t, rng, p.token_budget, p.count)
    reqs = [SimRequest(f"c{i}", random_tokens(rng, p.length)) for i in range(p.count)]
    for r in reqs:
        e.submit(r)
    e.run()
    sbs = t.config.scheduler_block_size
    per_fraction: dict[str, float] = {}
    survived = 0
    for f in FRACTIONS:
        hit = total = 0
        for r in reqs:
            n = int(p.length * f)
            tokens = r.prompt if f >= 1.0 else r.prompt[:n] + random_tokens(rng, sbs)
            h = e.probe(tokens).hit
            hit += h
            total += n
            if f >= 1.0 and h > 0:
                survived += 1
        per_fraction[f"hit@{f:g}"] = hit / total
    rate = sum(per_fraction.values()) / len(per_fraction)
    cached = _calibrate(ctx, setting, p.length, p.token_budget)
    return Row(setting.name, rate, cached, f"{survived}/{p.count}", e.stats.alloc_failures, e.stats.preemptions,
               time.monotonic() - t0, per_fraction)


# ------------------------------------------------------------------ (c)
def sweep_one(ctx: Ctx, setting: Setting, p: Params, num_prefixes: int, rounds: int = 3) -> Row:
    t0 = time.monotonic()
    t = make_target(ctx.target, setting)
    rng = random.Random(ctx.seed + num_prefixes)
    e = ctx.engine(t, rng, p.token_budget, p.count)
    prefixes = [random_tokens(rng, p.length) for _ in range(num_prefixes)]
    hit = total = 0
    last_round: list[SimRequest] = []
    n = 0
    for rnd in range(rounds):
        order = list(range(num_prefixes))
        rng.shuffle(order)
        batch = []
        for i in order:
            r = SimRequest(f"s{n}", prefixes[i] + random_tokens(rng, p.suffix))
            n += 1
            batch.append(r)
            e.submit(r)
        e.run()
        if rnd > 0:
            hit += sum(min(r.hit or 0, p.length) for r in batch)
            total += p.length * len(batch)
        last_round = batch
        if ctx.progress is not None:
            ctx.progress(f"{setting.name} K={num_prefixes}: round {rnd + 1}/{rounds} done")
    survived = sum(1 for r in last_round if (r.hit or 0) > 0)
    cached = _calibrate(ctx, setting, p.length + p.suffix, p.token_budget)
    return Row(f"{setting.name} K={num_prefixes}", hit / max(total, 1), cached, f"{survived}/{num_prefixes}",
               e.stats.alloc_failures, e.stats.preemptions, time.monotonic() - t0)


# ------------------------------------------------------------------ (d)
def multiturn(ctx: Ctx, setting: Setting, p: Params) -> Row:
    t0 = time.monotonic()
    turns, user, outputs = p.extra
    t = make_target(ctx.target, setting)
    rng = random.Random(ctx.seed)
    e = ctx.engine(t, rng, p.token_budget, p.count)
    history = [random_tokens(rng, p.length) for _ in range(p.count)]
    hit = total = survived = 0
    for turn in range(turns):
        batch = []
        for c in range(p.count):
            prompt = history[c] if turn == 0 else history[c] + random_tokens(rng, user)
            r = SimRequest(f"t{turn}c{c}", prompt, max_tokens=outputs)
            batch.append(r)
            e.submit(r)
        e.run()
        for c, r in enumerate(batch):
            history[c] = r.all_tokens
            if turn > 0:
                hit += r.hit or 0
                total += len(r.prompt)
                survived += (r.hit or 0) > 0
    cached = _calibrate(ctx, setting, p.length, p.token_budget)
    return Row(setting.name, hit / max(total, 1), cached, f"{survived}/{(turns - 1) * p.count}",
               e.stats.alloc_failures, e.stats.preemptions, time.monotonic() - t0)


@dataclass(frozen=True)
class Scenario:
    name: str
    doc: str
    preset: str
    survived_means: str
    scales: dict[str, Params]


SCENARIOS: dict[str, Scenario] = {
    "sequential": Scenario(
        "sequential", "sequential long requests; replay of the first after each", "dsv4-like",
        "later requests after which request 0 still hits",
        {
            "small": Params(length=8192, num_blocks=400, count=8, token_budget=2048, intervals=(1024, 4096)),
            "full": Params(length=131072, num_blocks=5000, count=8, token_budget=8192, intervals=(8192, 32768)),
        },
    ),
    "concurrent": Scenario(
        "concurrent", "N concurrent long requests, replayed at prompt fractions 0.25/0.5/0.75/1", "dsv4-like",
        "requests whose full replay still hits",
        {
            "small": Params(length=8192, num_blocks=420, count=6, token_budget=4096, intervals=(1024, 4096)),
            "full": Params(length=131072, num_blocks=6000, count=8, token_budget=16384, intervals=(8192, 32768)),
        },
    ),
    "sweep": Scenario(
        "sweep", "K shared prefixes x 3 rounds, request = prefix + unique suffix", "gemma-like",
        "prefixes hit in the last round",
        {
            "small": Params(length=2048, num_blocks=2600, count=4, token_budget=4096, extra=(15, 30, 45, 60),
                            intervals=(1024, 2048), suffix=64),
            "full": Params(length=8192, num_blocks=12000, count=8, token_budget=8192, extra=(15, 30, 45, 60),
                           intervals=(4096, 8192), suffix=256),
        },
    ),
    "multiturn": Scenario(
        "multiturn", "Mamba multi-turn conversations (history + user message each turn)", "kimi-linear-like",
        "later turns that hit",
        {
            "small": Params(length=2048, num_blocks=200, count=4, token_budget=256, extra=(6, 256, 32),
                            intervals=(512, 2048)),
            "full": Params(length=16384, num_blocks=6000, count=8, token_budget=8192, extra=(10, 1024, 256),
                           intervals=(2048, 8192)),
        },
    ),
}


def run_scenario(
    name: str, base: Config, p: Params, ctx: Ctx, only: tuple[str, ...] = ()
) -> list[Row]:
    rows: list[Row] = []
    settings = settings_for(base.with_(num_blocks=p.num_blocks), p.intervals, ctx.target)
    make_target(ctx.target, settings[0])  # warm-up (imports) outside every row's seconds
    for s in settings:
        if only and s.name not in only:
            continue
        if ctx.progress is not None:
            ctx.progress(f"{name}: setting {s.name}")
        if name == "sequential":
            rows.append(sequential(ctx, s, p))
        elif name == "concurrent":
            rows.append(concurrent(ctx, s, p))
        elif name == "sweep":
            rows.extend(sweep_one(ctx, s, p, k) for k in p.extra)
        elif name == "multiturn":
            rows.append(multiturn(ctx, s, p))
        else:
            raise KeyError(name)
    return rows


def bench_request(target: str, tokens: int = 1 << 20, retention: int | None = 32768,
                  preset_name: str = "dsv4-like", token_budget: int = 16384) -> float:
    """Seconds to run one `tokens`-token request alone (prefill + 1 output), import excluded."""
    from invariants.presets import PRESETS

    base = PRESETS[preset_name]
    max_bs = max(g.block_size for g in base.groups)
    cfg = base.with_(num_blocks=2 * tokens // max_bs + 1024, retention_interval=retention,
                     max_model_len=max(base.max_model_len, tokens + 16))
    setting = Setting(f"r{retention}", cfg)
    make_target(target, setting)  # warm-up
    t = make_target(target, setting)
    rng = random.Random(1)
    prompt = random_tokens(rng, tokens)
    t0 = time.monotonic()
    e = Engine(t, token_budget=token_budget, max_running=1, rng=rng)
    e.submit(SimRequest("bench", prompt))
    e.run()
    return time.monotonic() - t0
