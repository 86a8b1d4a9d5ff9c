"""Scenarios from the seeds, run under several retention settings over one target.

- `sequential` (#43447): long requests one after another; after each, the
  first request's prompt is probed: after how many others does it stop hitting?
- `concurrent` (#43447): N long requests run together, then each is probed at
  several prompt fractions (a prefix of the prompt plus a fresh suffix).
- `sweep` (#40676): K shared prefixes (15..60), requests = prefix + unique
  suffix, several rounds; how much of the shared prefix hits.
- `multiturn` (#45845): Mamba conversations, each turn's prompt is the whole
  history plus a new user message.
- `agentic` (#43447 trace replay): agent sessions sharing a system prompt, each
  turn resending the whole session plus a tool result, `count` sessions in
  flight at once; the hit rate is vLLM's (hit tokens / prompt tokens, every turn).

Settings (`invariants.simulate.settings`): `off`, `dense`, `r0`, two
intervals `rK`, `pre43447` (the pre-#43447 free order, a named mutant of the
target) and `pinned` (the #40676 tier; reference target only).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from invariants.simulate.loop import LoopConfig, OnFinish, Request, SchedulerLoop
from invariants.simulate.settings import Setting, cached_blocks, make_target, setting_scope, settings_for
from invariants.simulate.tokens import RandomTokens, random_tokens
from invariants.targets import Target
from model.contract.config import Config

Progress = Callable[[str], None]


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
    # pool_x > 0: num_blocks = the pool vLLM would report as pool_x-fold
    # "Maximum concurrency" for max_len-token requests (num_blocks is ignored).
    pool_x: float = 0.0
    max_len: int = 0

    def pool(self, base: Config) -> int:
        """The pool size in blocks for `base`'s layout."""
        if self.pool_x <= 0:
            return self.num_blocks
        from invariants.layouts.presets import pool_blocks

        # the simulator's scheduler runs one batch at a time with `token_budget` tokens
        return pool_blocks(
            base,
            self.pool_x,
            self.max_len or self.length,
            max_num_batched_tokens=self.token_budget,
            concurrent_batches=1,
        )


class Ctx:
    """Where a scenario runs: the target, the seed, progress lines, and `jobs`
    worker processes (settings are independent, each seeded from `seed`, so the
    rows are the same whatever `jobs` is; only wall time changes)."""

    def __init__(self, target: str, seed: int, progress: Progress | None, jobs: int = 1) -> None:
        self.target = target
        self.seed = seed
        self.progress = progress
        self.jobs = jobs

    def loop(self, t: Target, rng: random.Random, budget: int, running: int) -> SchedulerLoop:
        return SchedulerLoop(t, LoopConfig(budget, running), RandomTokens(rng), progress=self.progress)


def _calibrate(ctx: Ctx, setting: Setting, length: int, budget: int) -> int:
    """Blocks one request of `length` tokens leaves cached when it runs alone."""
    t = make_target(ctx.target, setting)
    rng = random.Random(ctx.seed ^ 0xCA1)
    sched = ctx.loop(t, rng, budget, 1)
    sched.submit(Request("cal", random_tokens(rng, length)))
    sched.run()
    return cached_blocks(t)


# ------------------------------------------------------------------ (a)
def sequential(ctx: Ctx, setting: Setting, p: Params) -> Row:
    t0 = time.monotonic()
    t = make_target(ctx.target, setting)
    rng = random.Random(ctx.seed)
    sched = ctx.loop(t, rng, p.token_budget, 1)
    first = Request("r0", random_tokens(rng, p.length))
    sched.submit(first)
    sched.run()
    cached = cached_blocks(t)
    hits = [sched.probe(first.prompt).hit]
    for k in range(1, p.count + 1):
        sched.submit(Request(f"r{k}", random_tokens(rng, p.length)))
        sched.run()
        hits.append(sched.probe(first.prompt).hit)
    survived = next((k - 1 for k, h in enumerate(hits) if h == 0), len(hits) - 1)
    label = "no hit" if survived < 0 else f"{survived}" if survived < p.count else f">={p.count}"
    rate = sum(hits[1:]) / (p.count * p.length)
    return Row(
        setting.name,
        rate,
        cached,
        label,
        sched.accounting.alloc_failures,
        sched.accounting.preemptions,
        time.monotonic() - t0,
        {"replay_after_1": hits[1] / p.length, "hits": hits},
    )


FRACTIONS = (0.1, 0.25, 0.5, 0.75, 1.0)  # #43447 replays 10%..100% of the prompt


# ------------------------------------------------------------------ (b)
def concurrent(ctx: Ctx, setting: Setting, p: Params) -> Row:
    t0 = time.monotonic()
    t = make_target(ctx.target, setting)
    rng = random.Random(ctx.seed)
    sched = ctx.loop(t, rng, p.token_budget, p.count)
    reqs = [Request(f"c{i}", random_tokens(rng, p.length)) for i in range(p.count)]
    for r in reqs:
        sched.submit(r)
    sched.run()
    sbs = t.config.scheduler_block_size
    per_fraction: dict[str, float] = {}
    survived = 0
    for f in FRACTIONS:
        hit = total = 0
        for r in reqs:
            n = int(p.length * f)
            tokens = r.prompt if f >= 1.0 else r.prompt[:n] + random_tokens(rng, sbs)
            h = sched.probe(tokens).hit
            hit += h
            total += n
            if f >= 1.0 and h > 0:
                survived += 1
        per_fraction[f"hit@{f:g}"] = hit / total
    rate = sum(per_fraction.values()) / len(per_fraction)
    cached = _calibrate(ctx, setting, p.length, p.token_budget)
    return Row(
        setting.name,
        rate,
        cached,
        f"{survived}/{p.count}",
        sched.accounting.alloc_failures,
        sched.accounting.preemptions,
        time.monotonic() - t0,
        per_fraction,
    )


# ------------------------------------------------------------------ (c)
def sweep_one(ctx: Ctx, setting: Setting, p: Params, num_prefixes: int, rounds: int = 3) -> Row:
    t0 = time.monotonic()
    t = make_target(ctx.target, setting)
    rng = random.Random(ctx.seed + num_prefixes)
    sched = ctx.loop(t, rng, p.token_budget, p.count)
    prefixes = [random_tokens(rng, p.length) for _ in range(num_prefixes)]
    hit = total = 0
    last_round: list[Request] = []
    n = 0
    for rnd in range(rounds):
        order = list(range(num_prefixes))
        rng.shuffle(order)
        batch = []
        for i in order:
            r = Request(f"s{n}", prefixes[i] + random_tokens(rng, p.suffix))
            n += 1
            batch.append(r)
            sched.submit(r)
        sched.run()
        if rnd > 0:
            hit += sum(min(r.hit or 0, p.length) for r in batch)
            total += p.length * len(batch)
        last_round = batch
        if ctx.progress is not None:
            ctx.progress(f"{setting.name} K={num_prefixes}: round {rnd + 1}/{rounds} done")
    survived = sum(1 for r in last_round if (r.hit or 0) > 0)
    cached = _calibrate(ctx, setting, p.length + p.suffix, p.token_budget)
    return Row(
        f"{setting.name} K={num_prefixes}",
        hit / max(total, 1),
        cached,
        f"{survived}/{num_prefixes}",
        sched.accounting.alloc_failures,
        sched.accounting.preemptions,
        time.monotonic() - t0,
    )


# ------------------------------------------------------------------ (d), (e)
def sessions(ctx: Ctx, setting: Setting, p: Params, shared_system: bool) -> Row:
    """Multi-turn sessions, `count` in flight; each turn resends the whole session plus new input.

    `p.extra = (sessions, turns, new input tokens per turn (mean; uniform in
    [n/2, 3n/2]), output tokens per turn)`. A session's next turn is submitted
    when its previous one finishes, so sessions interleave as in a serving
    trace. With `shared_system` every session starts from one `p.length`-token
    system prompt (agentic traffic), else from its own `p.length`-token prompt.
    Hit rate = hit tokens / prompt tokens over every turn (vLLM's metric);
    `later_turns` counts turns after the first only.
    """
    t0 = time.monotonic()
    num_sessions, turns, user, outputs = p.extra
    t = make_target(ctx.target, setting)
    rng = random.Random(ctx.seed)
    sched = ctx.loop(t, rng, p.token_budget, p.count)
    system = random_tokens(rng, p.length)
    first_hit_floor = p.length if shared_system else 0
    counts = {"hit": 0, "total": 0, "later_hit": 0, "later_total": 0, "survived": 0}
    done_turns = [0] * num_sessions

    def submit(sid: int, history: tuple[int, ...]) -> None:
        n = rng.randint(user // 2, user + user // 2)
        sched.submit(Request(f"{sid}t{done_turns[sid]}", history + random_tokens(rng, n), max_tokens=outputs))

    def on_finish(r: Request) -> None:
        sid = int(r.rid.partition("t")[0])
        h = r.hit or 0
        counts["hit"] += h
        counts["total"] += len(r.prompt)
        if done_turns[sid] > 0:
            counts["later_hit"] += h
            counts["later_total"] += len(r.prompt)
            counts["survived"] += h > first_hit_floor
        done_turns[sid] += 1
        if done_turns[sid] < turns:
            submit(sid, r.all_tokens)

    sched.add_observer(OnFinish(on_finish))
    for sid in range(num_sessions):
        submit(sid, system if shared_system else random_tokens(rng, p.length))
    sched.run()
    cached = _calibrate(ctx, setting, p.length + user * turns // 2, p.token_budget)
    return Row(
        setting.name,
        counts["hit"] / max(counts["total"], 1),
        cached,
        f"{counts['survived']}/{num_sessions * (turns - 1)}",
        sched.accounting.alloc_failures,
        sched.accounting.preemptions,
        time.monotonic() - t0,
        {
            "later_turns": counts["later_hit"] / max(counts["later_total"], 1),
            "prompt_mtok": counts["total"] / 1e6,
        },
    )


def multiturn(ctx: Ctx, setting: Setting, p: Params) -> Row:
    return sessions(ctx, setting, p, shared_system=False)


def agentic(ctx: Ctx, setting: Setting, p: Params) -> Row:
    return sessions(ctx, setting, p, shared_system=True)


@dataclass(frozen=True)
class Scenario:
    name: str
    doc: str
    preset: str
    survived_means: str
    scales: dict[str, Params]


M = 1 << 20
# Full scale follows the seeds: #43447's 1M-token requests on a pool vLLM would
# report as ~14.5x concurrency, 14 concurrent requests, 16-concurrency agent
# sessions; #40676's 15..60 shared prefixes; #45845's Kimi-Linear multi-turn.
# Small scale keeps the ratios that matter (pool vs per-request footprint) at
# 1/32..1/128 of the tokens so the suite can assert the qualitative claims.
SCENARIOS: dict[str, Scenario] = {
    "sequential": Scenario(
        "sequential",
        "sequential long requests; replay of the first after each",
        "dsv4-flash",
        "later requests after which request 0 still hits",
        {
            "small": Params(
                length=8192, num_blocks=0, count=8, token_budget=512, intervals=(1024, 4096), pool_x=7.5
            ),
            "full": Params(
                length=M, num_blocks=0, count=8, token_budget=16384, intervals=(32768,), pool_x=14.5
            ),
        },
    ),
    "concurrent": Scenario(
        "concurrent",
        "N concurrent long requests, replayed at prompt fractions 0.1/0.25/0.5/0.75/1",
        "dsv4-flash",
        "requests whose full replay still hits",
        {
            "small": Params(
                length=32768, num_blocks=0, count=6, token_budget=1024, intervals=(2048, 4096), pool_x=6.5
            ),
            "full": Params(
                length=M, num_blocks=0, count=14, token_budget=16384, intervals=(32768,), pool_x=14.5
            ),
        },
    ),
    "sweep": Scenario(
        "sweep",
        "K shared prefixes x 3 rounds, request = prefix + unique suffix",
        "gemma-like",
        "prefixes hit in the last round",
        {
            "small": Params(
                length=2048,
                num_blocks=30000,
                count=4,
                token_budget=4096,
                extra=(15, 30, 45, 60),
                intervals=(1024, 2048),
                suffix=64,
            ),
            "full": Params(
                length=8192,
                num_blocks=70000,
                count=8,
                token_budget=8192,
                extra=(15, 30, 45, 60),
                intervals=(4096, 8192),
                suffix=256,
            ),
        },
    ),
    "multiturn": Scenario(
        "multiturn",
        "Mamba multi-turn conversations (history + user message each turn)",
        "kimi-linear-like",
        "later turns that hit",
        {
            "small": Params(
                length=2048,
                num_blocks=0,
                count=8,
                token_budget=2048,
                extra=(16, 8, 512, 64),
                intervals=(2048, 8192),
                pool_x=8,
                max_len=16384,
            ),
            "full": Params(
                length=16384,
                num_blocks=0,
                count=16,
                token_budget=8192,
                extra=(32, 10, 2048, 256),
                intervals=(2048, 8192),
                pool_x=8,
                max_len=131072,
            ),
        },
    ),
    "agentic": Scenario(
        "agentic",
        "agent sessions sharing a system prompt, each turn = whole session + a tool result",
        "dsv4-flash",
        "later turns that hit beyond the system prompt",
        {
            "small": Params(
                length=1024,
                num_blocks=1500,
                count=4,
                token_budget=1024,
                extra=(12, 6, 1024, 16),
                intervals=(1024, 2048),
            ),
            "full": Params(
                length=16384,
                num_blocks=0,
                count=16,
                token_budget=16384,
                extra=(32, 8, 16384, 256),
                intervals=(32768,),
                pool_x=14.5,
                max_len=M,
            ),
        },
    ),
}


def run_scenario(name: str, base: Config, p: Params, ctx: Ctx, only: tuple[str, ...] = ()) -> list[Row]:
    settings = [
        s
        for s in settings_for(base.with_(num_blocks=p.pool(base)), p.intervals, ctx.target)
        if not only or s.name in only
    ]
    if ctx.jobs > 1 and len(settings) > 1:
        return _run_parallel(name, p, ctx, settings)
    rows: list[Row] = []
    make_target(ctx.target, settings[0])  # warm-up (imports) outside every row's seconds
    for s in settings:
        rows.extend(_run_setting(name, p, ctx, s))
    return rows


def _run_setting(name: str, p: Params, ctx: Ctx, s: Setting) -> list[Row]:
    if ctx.progress is not None:
        ctx.progress(f"{name}: setting {s.name}")
    with setting_scope(ctx.target, s):
        if name == "sweep":
            return [sweep_one(ctx, s, p, k) for k in p.extra]
        return [RUNNERS[name](ctx, s, p)]


def _print_progress(line: str) -> None:
    import sys

    print(f"[simulate] {line}", file=sys.stderr, flush=True)


def _worker(name: str, p: Params, target: str, seed: int, progress: bool, s: Setting) -> list[Row]:
    ctx = Ctx(target, seed, _print_progress if progress else None)
    make_target(target, Setting("warm-up", s.config))  # imports outside the row's seconds
    return _run_setting(name, p, ctx, s)


def _run_parallel(name: str, p: Params, ctx: Ctx, settings: list[Setting]) -> list[Row]:
    """One process per setting (spawned: vLLM mutants patch classes process-wide), rows in setting order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=ctx.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [
            pool.submit(_worker, name, p, ctx.target, ctx.seed, ctx.progress is not None, s) for s in settings
        ]
        return [row for f in futures for row in f.result()]


RUNNERS: dict[str, Callable[[Ctx, Setting, Params], Row]] = {
    "sequential": sequential,
    "concurrent": concurrent,
    "multiturn": multiturn,
    "agentic": agentic,
}


def bench_request(
    target: str,
    tokens: int = 1 << 20,
    retention: int | None = 32768,
    preset_name: str = "dsv4-like",
    token_budget: int = 16384,
) -> float:
    """Seconds to run one `tokens`-token request alone (prefill + 1 output), import excluded."""
    from invariants.layouts.presets import PRESETS, pool_blocks

    base = PRESETS[preset_name]
    # room for the request twice over, as vLLM would size a 2x-concurrency pool
    cfg = base.with_(
        num_blocks=pool_blocks(base, 2, tokens, max_num_batched_tokens=token_budget, concurrent_batches=1)
        + 1024,
        retention_interval=retention,
        max_model_len=max(base.max_model_len, tokens + 16),
    )
    setting = Setting(f"r{retention}", cfg)
    make_target(target, setting)  # warm-up
    t = make_target(target, setting)
    rng = random.Random(1)
    prompt = random_tokens(rng, tokens)
    t0 = time.monotonic()
    sched = SchedulerLoop(t, LoopConfig(token_budget, 1), RandomTokens(rng))
    sched.submit(Request("bench", prompt))
    sched.run()
    return time.monotonic() - t0
