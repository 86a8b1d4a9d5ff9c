"""Equivalence runner: one workload under several cache modes, compared bit for bit.

The baseline is prefix caching off: every token is computed. Every other mode
(dense retention, retention 0, retention k, the pinned tier) must produce, for
every request, every position it computes and every layer, the same bits as
the baseline, and the same greedy tokens. A hit of h tokens means the first h
positions are not computed in that mode: their KV and Mamba state come from
blocks the allocator kept, so any block the allocator should not have served
(reused, evicted, masked away) shows up as a difference or as NaN (poison).

Verdicts per mode: `pass`; `mismatch` (first differing request, position,
layer, with the pair of modes); `vacuous` (a caching mode served no prefill
token from cache, or the pinned mode never pinned a block: the comparison
would prove nothing); `fault` (the engine was told to read or write a null or
missing block, or the target crashed); `skipped` (the target rejects the
configuration). The baseline is also checked against itself: a position
computed twice (after a preemption) must give the same bits both times.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from gpu_check.forward_pass import GPU_CHECK_LOOP, ForwardPass, StorageFigures
from gpu_check.hybrid import EngineFault, HybridModel, ModelDims, SeqChunk
from gpu_check.kernels import Kernels
from gpu_check.workload import Workload, replay_sessions
from invariants.report import table
from invariants.simulate.loop import BlockAccounting, LoopConfig, SchedulerLoop, SchedulerStalled
from invariants.targets.base import Target, TargetCrash, TargetUnavailable
from model.contract.config import Config, ConfigError, GroupSpec
from model.contract.ops import Op

TargetFactory = Callable[[Config], Target]


def default_config(num_blocks: int = 48) -> Config:
    """Full 16, SWA 16 with window 24 (not a multiple of the block size), Mamba 16."""
    return Config(
        groups=(GroupSpec("full", 16), GroupSpec("swa", 16, sliding_window=24), GroupSpec("mamba", 16)),
        num_blocks=num_blocks,
    )


@dataclass(frozen=True)
class Mode:
    name: str
    changes: dict[str, object]
    expect_hits: bool = True
    expect_pins: bool = False

    def config(self, base: Config) -> Config:
        return base.with_(**self.changes)


def default_modes(base: Config, intervals: Sequence[int] | None = None) -> list[Mode]:
    """off (baseline), dense, r0, r<k> for k in `intervals` (default 2 and 4 scheduler blocks), pinned."""
    sbs = base.scheduler_block_size
    ks = list(intervals) if intervals is not None else [2 * sbs, 4 * sbs]
    modes = [
        Mode("off", {"enable_caching": False, "retention_interval": None}, expect_hits=False),
        Mode("dense", {"enable_caching": True, "retention_interval": None}),
        Mode("r0", {"enable_caching": True, "retention_interval": 0}),
    ]
    modes += [Mode(f"r{k}", {"enable_caching": True, "retention_interval": k}) for k in ks]
    modes.append(
        Mode(
            "pinned",
            {"enable_caching": True, "retention_interval": 0, "pin_swa_on_drop": True},
            expect_pins=True,
        )
    )
    return modes


@dataclass(frozen=True)
class Mismatch:
    base_mode: str
    mode: str
    rid: str
    position: int
    layer: str  # "L2:mamba(g2)" or "sampled token"
    step: int
    max_abs_diff: float
    nan: bool
    expected: str = ""
    got: str = ""

    def describe(self) -> str:
        what = f"layer {self.layer}" if self.layer != "sampled token" else "sampled token"
        extra = " (NaN: a poisoned or stale block was read)" if self.nan else ""
        vals = f"; expected {self.expected}, got {self.got}" if self.expected else ""
        return (
            f"{self.mode} vs {self.base_mode}: request {self.rid} position {self.position} {what} "
            f"at step {self.step}, max |diff| {self.max_abs_diff:.3g}{extra}{vals}"
        )


@dataclass(frozen=True)
class ModeStats:
    """One mode's figures: the scheduler's block accounting and what the forward pass saw."""

    accounting: BlockAccounting
    storage: StorageFigures
    steps: int
    seconds: float


@dataclass
class ModeResult:
    mode: str
    verdict: str  # pass | mismatch | vacuous | fault | skipped
    detail: str = ""
    stats: ModeStats | None = None
    tokens_checked: int = 0
    mismatch: Mismatch | None = None
    ops: list[Op] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.verdict in ("pass", "skipped")


@dataclass
class CheckReport:
    seed: int
    target: str
    kernels: str
    device: str
    results: list[ModeResult]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results) and any(r.verdict == "pass" for r in self.results[1:])

    @property
    def tokens_checked(self) -> int:
        return sum(r.tokens_checked for r in self.results)

    @property
    def first_mismatch(self) -> Mismatch | None:
        return next((r.mismatch for r in self.results if r.mismatch), None)

    def table(self) -> str:
        """One row per mode: verdict, tokens computed and checked, cache hits, churn, steps, time."""
        headers = ["mode", "verdict", "tokens", "checked", "from cache", "hit adm", "preempt", "evict"]
        headers += ["pins", "steps", "time s"]
        rows: list[list[object]] = []
        for r in self.results:
            s = r.stats
            if s is None:  # skipped, or a fault before the first step: its detail is printed below
                rows.append([r.mode, r.verdict, *["-"] * (len(headers) - 2)])
                continue
            a, st = s.accounting, s.storage
            rows.append(
                [
                    r.mode,
                    r.verdict,
                    a.scheduled_tokens,
                    r.tokens_checked,
                    a.hit_tokens,
                    f"{a.admissions_with_hit}/{a.admissions}",
                    a.preemptions,
                    st.evictions,
                    st.max_pinned,
                    s.steps,
                    f"{s.seconds:.2f}",
                ]
            )
        return table(headers, rows, right=range(2, len(headers)))


class _Stop(Exception):
    def __init__(self, mismatch: Mismatch):
        super().__init__(mismatch.describe())
        self.mismatch = mismatch


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int64 if x.dtype == torch.float64 else torch.int32)


class _Recorder:
    """Stores the baseline's outputs; in compare mode, checks each new output against them."""

    def __init__(self, model: HybridModel, mode: str, base: _Recorder | None):
        self.model = model
        self.mode = mode
        self.base = base
        self.out: dict[str, torch.Tensor] = {}
        self.have: dict[str, torch.Tensor] = {}
        self.tokens: dict[tuple[str, int], int] = {}
        self.checked = 0
        self.labels = [layer.label for layer in model.layers]

    def _slot(self, rid: str, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        buf = self.out.get(rid)
        if buf is None or buf.shape[0] < n:
            new = torch.full(
                (max(n, 64) * 2, *like.shape[1:]), float("nan"), dtype=like.dtype, device=like.device
            )
            mask = torch.zeros(new.shape[0], dtype=torch.bool, device=like.device)
            if buf is not None:
                new[: buf.shape[0]] = buf
                mask[: buf.shape[0]] = self.have[rid]
            self.out[rid], self.have[rid] = new, mask
        return self.out[rid], self.have[rid]

    def on_tokens(self, step: int, chunks: list[SeqChunk], layer_out: torch.Tensor) -> None:
        row = 0
        for c in chunks:
            n = c.end - c.start
            got = layer_out[row : row + n]
            row += n
            if self.base is None:
                if bool(torch.isnan(got).any()):
                    self._report(step, c, got, torch.zeros_like(got), "baseline", force_nan=True)
                buf, mask = self._slot(c.rid, c.end, got)
                seen = mask[c.start : c.end]
                if bool(seen.any()):  # recomputation after preemption: must repeat itself
                    self._compare(step, c, got[seen], buf[c.start : c.end][seen], self.mode, offset_mask=seen)
                buf[c.start : c.end] = got
                mask[c.start : c.end] = True
                continue
            bbuf = self.base.out.get(c.rid)
            bmask = self.base.have.get(c.rid)
            if (
                bbuf is None
                or bmask is None
                or bbuf.shape[0] < c.end
                or not bool(bmask[c.start : c.end].all())
            ):
                raise _Stop(
                    Mismatch(
                        self.base.mode,
                        self.mode,
                        c.rid,
                        c.start,
                        "position not in baseline",
                        step,
                        float("nan"),
                        False,
                    )
                )
            self._compare(step, c, got, bbuf[c.start : c.end], self.base.mode)
            self.checked += n

    def _compare(
        self,
        step: int,
        c: SeqChunk,
        got: torch.Tensor,
        want: torch.Tensor,
        base_mode: str,
        offset_mask: torch.Tensor | None = None,
    ) -> None:
        diff = _bits(got) != _bits(want)  # (n, L, d)
        bad = diff.any(dim=-1)  # (n, L)
        if not bool(bad.any()):
            return
        t, layer = (int(v) for v in bad.nonzero()[0].tolist())
        positions = torch.arange(c.start, c.end)
        if offset_mask is not None:
            positions = positions[offset_mask.cpu()]
        g, w = got[t, layer], want[t, layer]
        raise _Stop(
            Mismatch(
                base_mode,
                self.mode,
                c.rid,
                int(positions[t]),
                self.labels[layer],
                step,
                float((g - w).abs().nan_to_num(float("inf")).max()),
                bool(torch.isnan(g).any()),
                _fmt(w),
                _fmt(g),
            )
        )

    def _report(
        self, step: int, c: SeqChunk, got: torch.Tensor, want: torch.Tensor, base_mode: str, force_nan: bool
    ) -> None:
        bad = torch.isnan(got).any(dim=-1)
        t, layer = (int(v) for v in bad.nonzero()[0].tolist())
        raise _Stop(
            Mismatch(
                base_mode, self.mode, c.rid, c.start + t, self.labels[layer], step, float("nan"), force_nan
            )
        )

    def on_sample(self, step: int, rid: str, position: int, token: int) -> None:
        key = (rid, position)
        if self.base is None:
            prev = self.tokens.setdefault(key, token)
            if prev != token:
                raise _Stop(
                    Mismatch(
                        self.mode,
                        self.mode,
                        rid,
                        position,
                        "sampled token",
                        step,
                        float("nan"),
                        False,
                        str(prev),
                        str(token),
                    )
                )
            return
        want = self.base.tokens.get(key)
        if want != token:
            raise _Stop(
                Mismatch(
                    self.base.mode,
                    self.mode,
                    rid,
                    position,
                    "sampled token",
                    step,
                    float("nan"),
                    False,
                    str(want),
                    str(token),
                )
            )


def _fmt(x: torch.Tensor, n: int = 3) -> str:
    return "[" + ", ".join(f"{v:.9g}" for v in x[:n].tolist()) + ", ...]"


def run_check(
    target_factory: TargetFactory,
    workload: Workload,
    *,
    base_config: Config | None = None,
    modes: Sequence[Mode] | None = None,
    kernels: Kernels | None = None,
    dims: ModelDims | None = None,
    model_seed: int | None = None,
    device: str = "cpu",
    loop_config: LoopConfig | None = None,
    log: Callable[[str], None] | None = None,
    stop_on_mismatch: bool = True,
) -> CheckReport:
    """Run `workload` under every mode (the first is the baseline) and compare bit for bit.

    `target_factory(config)` builds a fresh allocator per mode. The model's
    weights come from `model_seed` (default: the workload seed), identical in
    every mode. Returns a report; never raises for a target failure (it
    becomes a `fault` verdict), only for bad arguments.
    """
    base = base_config if base_config is not None else default_config()
    mode_list = list(modes) if modes is not None else default_modes(base)
    if not mode_list:
        raise ValueError("modes: need at least the baseline")
    dims = dims or ModelDims()
    loop_config = loop_config or GPU_CHECK_LOOP
    model = HybridModel(base, dims, workload.seed if model_seed is None else model_seed, device, kernels)
    if workload.vocab > dims.vocab:
        raise ValueError(f"workload vocab {workload.vocab} exceeds the model's {dims.vocab}")
    # One intra-op thread on CPU: with several, OpenMP spin-waiting on a shared
    # 2-core machine made each step ~10x slower. Bits do not depend on it.
    prev_threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        return _run_modes(
            target_factory,
            workload,
            base,
            mode_list,
            model,
            kernels,
            device,
            loop_config,
            log,
            stop_on_mismatch,
        )
    finally:
        torch.set_num_threads(prev_threads)


def _run_modes(
    target_factory: TargetFactory,
    workload: Workload,
    base: Config,
    mode_list: list[Mode],
    model: HybridModel,
    kernels: Kernels | None,
    device: str,
    loop_config: LoopConfig,
    log: Callable[[str], None] | None,
    stop_on_mismatch: bool,
) -> CheckReport:
    t0 = time.perf_counter()
    results: list[ModeResult] = []
    baseline: _Recorder | None = None
    target_name = "?"
    for mode in mode_list:
        try:
            target = target_factory(mode.config(base))
        except ConfigError as exc:
            results.append(ModeResult(mode.name, "skipped", f"target rejects the configuration: {exc}"))
            if baseline is None:
                break
            continue
        target_name = getattr(target, "name", type(target).__name__)
        rec = _Recorder(model, mode.name, baseline)
        if target_name == "vllm":
            result = _real_scheduler_mode(target, model, rec, workload, mode, log)
        else:
            result = _loop_mode(target, model, rec, workload, mode, loop_config, log)
        _judge_vacuity(result, mode)
        if log:
            log(
                f"[gpu-check] mode {mode.name}: {result.verdict}"
                + (f" - {result.detail}" if result.detail else "")
            )
        results.append(result)
        if baseline is None:
            if result.verdict != "pass":
                break  # nothing to compare against
            baseline = rec
        elif result.verdict == "mismatch" and stop_on_mismatch:
            break
    kname = kernels.name if kernels is not None else "invariant"
    return CheckReport(workload.seed, target_name, kname, device, results, time.perf_counter() - t0)


def _loop_mode(
    target: Target,
    model: HybridModel,
    rec: _Recorder,
    workload: Workload,
    mode: Mode,
    loop_config: LoopConfig,
    log: Callable[[str], None] | None,
) -> ModeResult:
    """One mode with kvretain's scheduler loop deciding and `target` allocating."""
    forward = ForwardPass(target, model, rec)
    progress = (lambda line, m=mode.name: log(f"  [{m}] {line}")) if log else None
    loop = SchedulerLoop(target, loop_config, forward, [forward], progress)
    replay_sessions(loop, workload)
    if log:
        log(f"[gpu-check] mode {mode.name}: {_describe_mode(target.config)}")
    result = ModeResult(mode.name, "pass")
    try:
        loop.run()
    except _Stop as stop:
        result.verdict, result.mismatch, result.detail = "mismatch", stop.mismatch, stop.mismatch.describe()
    except EngineFault as exc:
        result.verdict, result.detail = "fault", f"engine fault at step {loop.step_no}: {exc}"
    except SchedulerStalled as exc:
        result.verdict, result.detail = "fault", f"scheduler stalled at step {loop.step_no}: {exc}"
    except (TargetCrash, TargetUnavailable) as exc:
        result.verdict, result.detail = "fault", f"target crashed at step {loop.step_no}: {exc}"
    result.stats = ModeStats(loop.accounting, forward.figures, loop.step_no, loop.seconds)
    result.tokens_checked = rec.checked
    result.ops = forward.ops
    return result


def _judge_vacuity(result: ModeResult, mode: Mode) -> None:
    """A passing mode that served nothing from cache (or pinned nothing) proves nothing."""
    if result.verdict != "pass" or result.stats is None:
        return
    if mode.expect_hits and result.stats.accounting.hit_tokens == 0:
        result.verdict = "vacuous"
        result.detail = "caching is on but no prefill token was served from cache: the check proves nothing"
    elif mode.expect_pins and result.stats.storage.max_pinned == 0:
        result.verdict = "vacuous"
        result.detail = "the pinned tier never held a block"


def _real_scheduler_mode(
    target: Target,
    model: HybridModel,
    rec: _Recorder,
    workload: Workload,
    mode: Mode,
    log: Callable[[str], None] | None,
) -> ModeResult:
    """One mode with vLLM's real scheduler as the engine (`gpu_check.engine`): the
    kernels read the tables vLLM shipped; the shadow worker's contract breaks are
    reported beside the bitwise verdict (either fails the mode)."""
    from gpu_check.engine import RealSchedulerEngine

    if log:
        log(f"[gpu-check] mode {mode.name}: {_describe_mode(target.config)}, vLLM's scheduler deciding")
    result = ModeResult(mode.name, "pass")
    engine: RealSchedulerEngine | None = None
    try:
        engine = RealSchedulerEngine(target, model, rec)
        engine.replay(workload)
    except _Stop as stop:
        result.verdict, result.mismatch, result.detail = "mismatch", stop.mismatch, stop.mismatch.describe()
    except EngineFault as exc:
        steps = engine.run.steps if engine is not None else 0
        result.verdict, result.detail = "fault", f"engine fault at step {steps}: {exc}"
    except (TargetCrash, TargetUnavailable) as exc:
        result.verdict, result.detail = "fault", f"target crashed: {exc}"
    if engine is not None:
        run = engine.run
        result.stats = ModeStats(run.accounting, run.storage, run.steps, run.seconds)
        if run.problems and result.verdict == "pass":
            check, message = run.problems[0]
            result.verdict = "fault"
            result.detail = f"{len(run.problems)} engine-contract problem(s), first: {check}: {message}"
        elif run.problems:
            result.detail += f"; {len(run.problems)} engine-contract problem(s), first: {run.problems[0][1]}"
    result.tokens_checked = rec.checked
    return result


def _describe_mode(cfg: Config) -> str:
    if not cfg.enable_caching:
        return "prefix caching off"
    r = "dense" if cfg.retention_interval is None else f"retention {cfg.retention_interval}"
    return r + (" + pinned tier" if cfg.pin_swa_on_drop else "")
