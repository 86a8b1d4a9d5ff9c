"""Production-scale checking: real layouts, real pool sizes, a serving workload.

`kvretain fuzz --scale production` and `kvretain bench --scale production`.
The configurations are the full-size presets (`dsv4-flash`, `gemma-like`,
`kimi-linear-like`) with retention None, 0 or an interval, and pools sized as
vLLM sizes them: `pool_blocks(cfg, 14.5, max context)` (156,281 blocks for
dsv4-flash at 1M tokens), with prompts up to the context length (1M tokens
for dsv4-flash and kimi-linear-like). Each layout also runs squeezed: prompts
up to an eighth of the context and a pool for `SQUEEZE` of them, so that 16+
requests in flight run out of blocks and the scheduler preempts (as vLLM's
does: the newest running request loses its blocks). `kimi-linear-like` also
runs with vLLM's prefix-match unit at `FINE_HASH` tokens, finer than its Mamba
block: the fine-grained hits and copy-on-write path, and without prefix
caching (its Mamba groups in 'none' mode).

The workload (seeded, printed): 16-32 requests in flight, prompts from a few
tokens to the longest (log-uniform) sharing a few long system prompts, some
arriving in bursts that share a step,
8k-token chunks, scheduler steps over several requests, short decodes
(speculative, with Eagle/MTP drafts, in every other episode), probes,
preemption. Every operation goes through the Checker (model
differential and every invariant, fast path plus audits).

Flat memory: prefixes are interned trie nodes (`model.contract.prefix`), so naming
costs O(new tokens) and what no state refers to is collected; the adapters
prune their hash tables as vLLM removes hashes; the operations replay needs
are spooled to disk (`OpSpool`), not kept; finished requests are kept by a
token budget; prompts share one int object per token id. The run is cut into
episodes of `EPISODE_OPS` operations (given a budget, at most a third of it:
the first three episodes are one per preset, so a short budget meets every
layout), each on a fresh model and target (the
heap the last one freed handed back first), so the history never outgrows one
episode. Within an episode memory follows the pool's cached blocks and the
requests in flight (which drift towards the longest prompts: short ones finish
first; together they hold at most `LIVE_PROMPTS` longest prompts); across episodes it must not grow, and the summary shows each setting's
first and latest episode side by side.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import random
import resource
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from operator import itemgetter

from invariants.harness.checker import Checker, InvalidOp, Violation
from invariants.harness.engine_step import engine_step as next_step
from invariants.harness.known_findings import KnownLedger, format_known
from invariants.harness.run_stats import Tolerance
from invariants.harness.spool import OpSpool
from invariants.layouts.presets import MAX_CONTEXT, pool_blocks, preset
from invariants.targets.base import Target
from model.contract.config import Config
from model.contract.fine_mamba import fine_hits_enabled
from model.contract.observation import ScheduleResult, StepResult
from model.contract.ops import AddRequest, Finish, Op, Preempt, Probe, Sample, Schedule, Step
from model.contract.prefix import clear_memo

PRODUCTION_PRESETS = ("dsv4-flash", "gemma-like", "kimi-linear-like")
CONCURRENCY = 14.5  # vLLM's "Maximum concurrency" figure the pools are sized for
SQUEEZE = 4.0  # a squeezed pool holds this many of its longest prompts
CHUNK = 8192
VOCAB = 30000
MAX_DECODE = 32
SPEC_TOKENS = 2  # draft tokens per step in the speculative episodes (lookahead slots)
# The prompts in flight hold at most this many of the longest prompt's tokens
# together: the working set (prompts, their hashes and names on both sides) is
# bounded by the setting, not by how many long prompts a draw happens to stack.
LIVE_PROMPTS = 4
# A tenth of the arrivals come as a burst of 2 to BURST requests with one system
# prompt, admitted in one step (a chunk each).
BURST_P = 0.1
BURST = 4
# Long enough for a 1M-token prompt to be admitted, chunked and finished among
# 16-32 others (128 chunks each); a fresh episode costs a pool build and a full audit.
EPISODE_OPS = 5000
# vLLM's prefix-match unit for the fine-grained settings (`--prefix-match-unit`,
# finer than the 512-token Mamba block): hits and checkpoints every 64 tokens.
FINE_HASH = 64
PRODUCTION_AUDIT_EVERY = 512  # an audit walks the whole pool (156k blocks): amortise it
# The young generation's size for the cyclic collector (Python's default: 700).
YOUNG_GENERATION = 200_000


@contextlib.contextmanager
def episode_collector() -> Iterator[None]:
    """The cyclic collector sized for episodes: what an operation allocates
    (names, observations, deltas, mirror entries) lives until the operation or
    the episode ends and makes no cycles, so collecting every 700 new objects
    walked the same survivors thousands of times (at 156k blocks, a tenth of
    the checked time) and found nothing. A young generation of
    YOUNG_GENERATION objects lets the short-lived die uncollected; each
    episode still ends with a full collection (`_release_episode`). The
    thresholds are restored on the way out."""
    old = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION, 100, 100)
    try:
        yield
    finally:
        gc.set_threshold(*old)


@dataclass(frozen=True)
class Setting:
    name: str
    config: Config
    squeezed: bool
    longest: int  # the longest prompt, in tokens


def max_prompt(cfg: Config) -> int:
    """The longest prompt a layout with this context length runs at full size."""
    return cfg.max_model_len - MAX_DECODE


def _layouts(name: str) -> list[Config]:
    """A preset as vLLM builds it; where it has aligned Mamba groups, the same layout with
    prefixes matched every `FINE_HASH` tokens (fine-grained Mamba hits and copy-on-write);
    where it has Mamba groups, the same layout served without prefix caching (Mamba in
    'none' mode: one running state per request, freed as it advances)."""
    base = preset(name)
    out = [base]
    fine = replace(base, hash_block_size=FINE_HASH)
    if fine_hits_enabled(fine):
        out.append(fine)
    if any(g.kind == "mamba" for g in base.groups):
        groups = tuple(replace(g, mamba_cache_mode="none") if g.kind == "mamba" else g for g in base.groups)
        out.append(replace(base, groups=groups, enable_caching=False, retention_interval=None))
    return out


def settings_for(seed: int) -> list[Setting]:
    """Every preset (and its variants, `_layouts`) x retention (None, 0, one interval; caching
    off: None) x pool (full, squeezed)."""
    out = []
    for name in PRODUCTION_PRESETS:
        for base in _layouts(name):
            sbs = base.scheduler_block_size
            for retention in (None, 0, 4 * sbs) if base.enable_caching else (None,):
                if retention is not None and all(g.kind == "full" for g in base.groups):
                    continue
                cfg = replace(base, retention_interval=retention, max_model_len=MAX_CONTEXT[name])
                full = replace(cfg, num_blocks=pool_blocks(cfg, CONCURRENCY, MAX_CONTEXT[name]))
                short = max_prompt(cfg) // 8
                squeezed = replace(cfg, num_blocks=pool_blocks(cfg, SQUEEZE, short + MAX_DECODE))
                out += [Setting(name, full, False, max_prompt(cfg)), Setting(name, squeezed, True, short)]
    random.Random(seed).shuffle(out)
    # Every layout and retention kind early: a short budget still meets each
    # preset's groups (SWA, Mamba, ...) and dense, zero and interval retention,
    # and the fine-grained path (the one a user turns on to get Mamba hits
    # between block boundaries) rather than the preset's default unit.
    firsts: list[Setting] = []
    for s in sorted(out, key=lambda s: not fine_hits_enabled(s.config)):
        if all(s.name != f.name and _kind(s) != _kind(f) for f in firsts):
            firsts.append(s)
    # Then each layout variant not met yet (the default unit, caching off).
    for s in out:
        if all(_layout(s) != _layout(f) for f in firsts):
            firsts.append(s)
    plan = firsts + [s for s in out if all(s is not f for f in firsts)]
    # Every other episode decodes speculatively (Eagle / MTP drafts): the extra
    # block an Eagle lookup drops and the lookahead slots every allocation reserves.
    return [
        replace(s, config=replace(s.config, eagle=True, num_lookahead_tokens=SPEC_TOKENS)) if i % 2 else s
        for i, s in enumerate(plan)
    ]


def _layout(s: Setting) -> tuple[str, int, bool]:
    return s.name, s.config.hash_block_size, s.config.enable_caching


def _kind(s: Setting) -> str:
    r = s.config.retention_interval
    return "dense" if r is None else "zero" if r == 0 else "interval"


@dataclass
class ProductionStats:
    ops: int = 0
    tokens: int = 0
    preemptions: int = 0
    episodes: int = 0
    # Production traces are spooled and long: counts and first messages, no example traces.
    known: KnownLedger = field(default_factory=lambda: KnownLedger(keep_examples=False))
    rss_at_tenth_kb: int = 0  # peak RSS when a tenth of the run was behind
    rss_now_at_tenth_kb: int = 0  # resident memory then, and at the end
    rss_now_at_end_kb: int = 0
    # Resident memory at the end of each setting's episodes: (first visit, latest visit).
    # The same pool and workload shape again must cost about the same (the requests in
    # flight at the end differ from visit to visit).
    rss_by_setting_kb: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Resident memory once an episode is gone (its model, target, history and chains
    # collected, the freed heap handed back): (after the first episode, after the latest).
    # Nothing of an episode should outlive it: growth here is a leak.
    rss_between_kb: tuple[int, int] = (0, 0)
    # The same for the interpreter's allocated memory blocks (`sys.getallocatedblocks`):
    # live objects, apart from what the C heap keeps of what they freed.
    blocks_between: tuple[int, int] = (0, 0)

    @staticmethod
    def peak_rss_kb() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# One int object per token id: a prompt holds references (8 bytes a token), not
# a fresh int per token (28 more). One object per id, not per 16-bit draw: the
# ids fit in cache, so reading a prompt (hashing, spooling) stays as fast.
_IDS = tuple(range(VOCAB))
_TOKEN_IDS = tuple(_IDS[v % (VOCAB - 1) + 1] for v in range(1 << 16))


def random_tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    """n seeded token ids in [1, VOCAB) (bulk: a 1M-token prompt in tens of milliseconds)."""
    ids = array("H", rng.randbytes(2 * n))
    return itemgetter(*ids)(_TOKEN_IDS) if n > 1 else tuple(_TOKEN_IDS[i] for i in ids)


def workload(
    cfg: Config,
    rng: random.Random,
    checker: Checker,
    longest: int,
    live_prompts: float = LIVE_PROMPTS,
    engine: bool = False,
) -> Iterator[Op]:
    """A serving workload on `checker`'s model state; yields the next operation (never ends).

    The requests in flight hold at most `live_prompts * longest` tokens together, counting
    each at its final length (prompt and decode). `engine`: the target is an engine that
    decides every step (`TargetFeatures.engine_steps`): each step is its own, over every
    request it holds with the budget it was built with (`engine_config`), and it preempts
    only under pool pressure; else steps over some requests, single-request chunks and
    directed preemptions as the allocator's caller chooses them."""
    systems = [random_tokens(rng, rng.randint(longest // 4, longest * 3 // 4)) for _ in range(3)]
    inflight = rng.randint(16, 32)
    wants: dict[str, int] = {}
    added = 0

    def fits(n: int) -> bool:
        """Whether one more request of `n` prompt tokens keeps the requests in flight, each at
        its final length (prompt and decode), within the budget."""
        return sum(wants[rid] for rid in checker.model.requests) + n + MAX_DECODE <= live_prompts * longest

    while True:
        reqs = checker.model.requests
        n = 0
        if len(reqs) < inflight and (not reqs or rng.random() < 0.3):
            n = int(math.exp(rng.uniform(math.log(4), math.log(longest))))
            if reqs and not fits(n):
                n = 0  # full: the request waits until some finish
        if n:
            system = rng.choice(systems)[: rng.randint(0, n - 1)]
            # Now and then a burst: requests with one system prompt arrive together and share
            # a step (parallel sampling, an agent's fan-out), so one looks up the blocks
            # another caches in that very step.
            burst: list[str] = []
            for _ in range(rng.randint(2, BURST) if rng.random() < BURST_P else 1):
                if burst and not fits(n):
                    break
                prompt = system + random_tokens(rng, n - len(system))
                rid = f"p{added}"
                added += 1
                wants[rid] = len(prompt) + rng.randint(1, MAX_DECODE)
                burst.append(rid)
                yield AddRequest(rid, prompt)
            if len(burst) > 1:
                yield from (
                    engine_step(checker, wants, rng) if engine else [Step(tuple(burst), CHUNK * len(burst))]
                )
            continue
        if rng.random() < 0.02:
            yield Probe(rng.choice(systems)[: rng.randint(1, longest)])
            continue
        rid = rng.choice(sorted(reqs))
        r = reqs[rid]
        if r.awaits_sample:  # every known token computed (and any padded drafts)
            yield Finish(rid) if r.num_tokens >= wants[rid] else Sample(rid, rng.randrange(1, VOCAB))
        elif engine:
            yield from engine_step(checker, wants, rng)
        elif r.running and rng.random() < 0.01:
            yield Preempt(rid)
        elif rng.random() < 0.2:
            # One scheduler step over several requests (running first, then waiting; it preempts itself).
            ready = sorted(q for q, s in reqs.items() if not (s.running and s.num_computed >= s.num_tokens))
            yield Step(tuple(rng.sample(ready, min(len(ready), rng.randint(2, 8)))), CHUNK)
        else:
            yield Schedule(rid, CHUNK)
            obs = checker.last_obs
            if isinstance(obs, ScheduleResult) and obs.scheduled == 0:
                # Out of blocks: the scheduler preempts its newest running request.
                running = [q for q, s in checker.model.requests.items() if s.running]
                if running:
                    yield Preempt(running[-1])


def engine_step(checker: Checker, wants: dict[str, int], rng: random.Random) -> Iterator[Op]:
    """The engine's next step: each request awaiting its sample sampled first (finished at its
    length), then the engine's next step (`invariants.harness.engine_step`) with the built
    budget `CHUNK`: none while a running request has computed its tokens and awaits no sample yet."""
    reqs = checker.model.requests
    for rid in sorted(reqs):
        r = reqs.get(rid)
        if r is not None and r.awaits_sample:
            yield Finish(rid) if r.num_tokens >= wants[rid] else Sample(rid, rng.randrange(1, VOCAB))
    step = next_step(checker.model, CHUNK)
    if step is not None:
        yield step


def engine_config(cfg: Config) -> Config:
    """`cfg` as an engine is built for it: vLLM's serving budget, `CHUNK` tokens a step (the
    default the pools are sized for, `invariants.layouts.presets`)."""
    return replace(cfg, max_num_batched_tokens=CHUNK)


def run_production(
    factory: Callable[[Config], Target],
    *,
    seed: int,
    steps: int | None,
    budget_s: float | None,
    tolerated: Tolerance,
    audit_every: int = PRODUCTION_AUDIT_EVERY,
    log: Callable[[str], None] = print,
    engine: bool = False,
) -> tuple[ProductionStats, list[tuple[Setting, Checker, list[Violation]]], float]:
    """Episodes over `settings_for(seed)` until `steps` or `budget_s`; stops at the first violation.
    `engine`: the factory's targets decide every step (`workload`, `engine_config`)."""
    stats, rng, plan = ProductionStats(), random.Random(seed), settings_for(seed)
    start = last_log = time.monotonic()
    failures: list[tuple[Setting, Checker, list[Violation]]] = []

    def done() -> bool:
        over_steps = steps is not None and stats.ops >= steps
        return over_steps or (budget_s is not None and time.monotonic() - start >= budget_s)

    spool = OpSpool()
    with episode_collector():
        while not done() and not failures:
            _release_episode()
            if stats.episodes:
                _measure_between_episodes(stats)
            spool.clear()
            setting = plan[stats.episodes % len(plan)]
            stats.episodes += 1
            cfg = engine_config(setting.config) if engine else setting.config
            checker = Checker(factory(cfg), audit_every=audit_every)
            # The pools just built (156k blocks on each side) live all episode: keep
            # the cyclic collector from walking them again and again.
            gc.freeze()
            log(_episode_banner(stats.episodes, setting))
            ops = workload(cfg, rng, checker, setting.longest, engine=engine)
            episode_end = None if budget_s is None else time.monotonic() + budget_s / len(PRODUCTION_PRESETS)
            for _ in range(EPISODE_OPS):
                if done() or (episode_end is not None and time.monotonic() >= episode_end):
                    break
                op = next(ops)
                try:
                    found = checker.step(op)
                except InvalidOp:
                    continue
                # Replay needs the episode's operations: spool them, keep the last in memory.
                spool.extend(checker.ops[:-1])
                del checker.ops[:-1]
                stats.ops += 1
                if stats.rss_at_tenth_kb == 0 and _tenth_done(
                    stats.ops, steps, time.monotonic() - start, budget_s
                ):
                    stats.rss_at_tenth_kb = stats.peak_rss_kb()
                    stats.rss_now_at_tenth_kb = current_rss_kb()
                _count_work(stats, op, checker.last_obs)
                new = [v for v in found if not _known(v, tolerated, stats)]
                if new:
                    checker.ops[:0] = spool.ops()
                    failures.append((replace(setting, config=cfg), checker, new))
                    break
                if time.monotonic() - last_log >= 5:
                    last_log = time.monotonic()
                    el = last_log - start
                    log(
                        f"{stats.ops:,} ops, {stats.ops / el:,.0f} ops/s, {stats.tokens / el:,.0f} checked tokens/s, "
                        f"{stats.preemptions} preemptions, peak RSS {stats.peak_rss_kb() / 1024:,.0f} MiB"
                    )
            if not failures:
                end = [v for v in checker.audit() if not _known(v, tolerated, stats)]
                if end:
                    checker.ops[:0] = spool.ops()
                    failures.append((replace(setting, config=cfg), checker, end))
            _measure_setting(stats, setting)
            del checker, ops
    gc.unfreeze()
    spool.close()
    stats.rss_now_at_end_kb = current_rss_kb()
    return stats, failures, time.monotonic() - start


def _measure_between_episodes(stats: ProductionStats) -> None:
    """Resident memory and live objects once an episode is gone: the first and the latest."""
    now, live = current_rss_kb(), sys.getallocatedblocks()
    stats.rss_between_kb = (stats.rss_between_kb[0] or now, now)
    stats.blocks_between = (stats.blocks_between[0] or live, live)


def _measure_setting(stats: ProductionStats, setting: Setting) -> None:
    """Resident memory at an episode's end, by setting: its first visit and its latest."""
    label, now = _setting_label(setting), current_rss_kb()
    stats.rss_by_setting_kb[label] = (stats.rss_by_setting_kb.get(label, (now, now))[0], now)


def _episode_banner(episode: int, setting: Setting) -> str:
    cfg = setting.config
    return (
        f"episode {episode}: {setting.name}, {cfg.num_blocks:,} blocks"
        f"{' (squeezed)' if setting.squeezed else ''}, retention {cfg.retention_interval}, "
        f"{f'Eagle/MTP {cfg.num_lookahead_tokens} draft tokens, ' if cfg.eagle else ''}"
        f"{f'prefixes matched every {cfg.hash_block_size} tokens, ' if fine_hits_enabled(cfg) else ''}"
        f"{'' if cfg.enable_caching else 'prefix caching off, '}"
        f"prompts up to {setting.longest:,} tokens; resident {current_rss_kb() / 1024:,.0f} MiB"
    )


def _setting_label(setting: Setting) -> str:
    """A setting's row in the memory-by-setting figures."""
    cfg = setting.config
    return (
        f"{setting.name} {cfg.num_blocks} r{cfg.retention_interval}{' eagle' if cfg.eagle else ''}"
        f"{f' unit{cfg.hash_block_size}' if fine_hits_enabled(cfg) else ''}{'' if cfg.enable_caching else ' nocache'}"
    )


def _count_work(stats: ProductionStats, op: Op, obs: object) -> None:
    """The tokens an operation scheduled and the preemptions it made."""
    if isinstance(obs, ScheduleResult):
        stats.tokens += obs.scheduled
    elif isinstance(obs, StepResult):
        stats.tokens += sum(r.scheduled for _, r in obs.results)
        stats.preemptions += len(obs.preempted)
    stats.preemptions += isinstance(op, Preempt)


def _release_episode() -> None:
    """Let go of everything the last episode built before the next is built."""
    gc.unfreeze()
    clear_memo()  # the remembered chains hold the previous episode's token tuples
    gc.collect()  # the previous episode's model, target and history
    _trim_heap()


def _trim_heap() -> None:
    """Hand the freed heap back to the system (glibc keeps what a 1M-token prompt's
    tuples freed, so resident memory would carry one episode's peak into the next)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(None).malloc_trim(0)


def current_rss_kb() -> int:
    """Resident memory now (Linux /proc; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * (resource.getpagesize() // 1024)
    except (OSError, ValueError, IndexError):
        return ProductionStats.peak_rss_kb()


def _tenth_done(ops: int, steps: int | None, elapsed: float, budget_s: float | None) -> bool:
    """A tenth of the run is behind us (of the steps, or of the budget if it ends first)."""
    return (steps is not None and ops >= steps // 10) or (budget_s is not None and elapsed >= budget_s / 10)


def _known(v: Violation, tolerated: Tolerance, stats: ProductionStats) -> bool:
    finding = tolerated(v)
    if not finding:
        return False
    stats.known.record(str(getattr(finding, "id", v.check)), v)
    return True


def format_production(target: str, seed: int, stats: ProductionStats, seconds: float, verdict: str) -> str:
    from invariants.report import table

    peak = stats.peak_rss_kb()
    tenth = f"{stats.rss_at_tenth_kb / 1024:,.0f}" if stats.rss_at_tenth_kb else "-"
    full = {s.name: s.config.num_blocks for s in settings_for(seed) if not s.squeezed}
    pools = ", ".join(f"{name} {n:,}" for name, n in sorted(full.items()))
    rows = [
        (
            target,
            seed,
            stats.episodes,
            f"{stats.ops:,}",
            f"{stats.ops / seconds:,.0f}" if seconds else "-",
            f"{stats.tokens / seconds:,.0f}" if seconds else "-",
            stats.preemptions,
            tenth,
            f"{peak / 1024:,.0f}",
            verdict,
            f"{seconds:.1f}",
        )
    ]
    head = [
        "target",
        "seed",
        "episodes",
        "ops",
        "ops/s",
        "checked tok/s",
        "preempt",
        "RSS@10% MiB",
        "peak RSS MiB",
    ]
    out = f"pools (full size): {pools}\n" + table([*head, "verdict", "seconds"], rows)
    if stats.rss_at_tenth_kb:
        growth = peak / stats.rss_at_tenth_kb - 1
        out += (
            f"\nmemory: peak RSS {stats.rss_at_tenth_kb / 1024:,.0f} MiB at 10% of the run, "
            f"{peak / 1024:,.0f} MiB at the end ({growth:+.1%}); resident "
            f"{stats.rss_now_at_tenth_kb / 1024:,.0f} MiB at 10%, {stats.rss_now_at_end_kb / 1024:,.0f} MiB at the end"
        )
    again = {k: v for k, v in stats.rss_by_setting_kb.items() if v[0] != v[1]}
    if again:
        worst = max(again, key=lambda k: again[k][1] / again[k][0])
        first, last = again[worst]
        out += (
            f"\nmemory by setting (resident at an episode's end, first vs latest visit, {len(again)} "
            f"settings seen again): largest change {worst}: {first / 1024:,.0f} -> {last / 1024:,.0f} MiB "
            f"({last / first - 1:+.1%})"
        )
    first, latest = stats.rss_between_kb
    if first:
        out += (
            f"\nmemory between episodes (resident once an episode is gone): after the first "
            f"{first / 1024:,.0f} MiB, after the latest {latest / 1024:,.0f} MiB ({latest / first - 1:+.1%}); "
            f"live objects (allocated blocks) {stats.blocks_between[0]:,} -> {stats.blocks_between[1]:,} "
            f"({stats.blocks_between[1] / max(1, stats.blocks_between[0]) - 1:+.1%})"
        )
    if stats.known:
        out += "\n" + format_known(stats.known)
    return out
