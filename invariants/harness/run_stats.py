"""What a fuzz run counts, and when it stops.

A run's figures (`FuzzStats`: steps, examples, hits, the features each example
exercised, the known findings tolerated, policy drifts) are shared by every example;
past the run's deadline every step raises `BudgetSpent`, except in Hypothesis's final
replay of a failure, which must run as the failure did (`check_budget`). A violation
ends an example as `ViolationFound`, carrying the configuration and operations that
replay it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hypothesis.control import current_build_context
from hypothesis.errors import InvalidArgument

from invariants.harness.checker import DEFAULT_AUDIT_EVERY, Violation, unpredicted
from invariants.harness.known_findings import KnownLedger
from model.contract.config import Config
from model.contract.fine_mamba import fine_hits_enabled
from model.contract.observation import BlockIds, StepResult
from model.contract.ops import Op


def config_features(cfg: Config) -> list[str]:
    """The configuration features one example exercises (for the fuzz summary)."""
    out: list[str] = sorted({g.kind for g in cfg.groups})
    r = cfg.effective_retention
    out.append(
        "caching off"
        if not cfg.enable_caching
        else "retention " + ("None" if r is None else "0" if r == 0 else "k")
    )
    if cfg.eagle:
        out.append("eagle")
        if cfg.enable_caching and not cfg.kv_connector:
            out.append(
                "vLLM default: Eagle lookahead block hashes"
                if cfg.hash_lookahead
                else "Eagle legacy hashes (disable_lookahead_block_hashes)"
            )
    if any(g.kind == "mamba" and g.mamba_cache_mode == "none" for g in cfg.groups):
        out.append("mamba mode none")
    if cfg.num_lookahead_tokens:
        out.append("lookahead slots")
    if cfg.pin_swa_on_drop:
        out.append("pinned tier")
    if len({g.block_size for g in cfg.groups}) > 1:
        out.append("mixed block sizes")
    if fine_hits_enabled(cfg):
        out.append("fine-grained Mamba hits")
    out += [f"not predicted, judged by the contract alone: {name}" for name in unpredicted(cfg)]
    return out


def reused_across_requests(before: Mapping[str, tuple[BlockIds, ...]], obs: object) -> bool:
    """A step handed one request a block that another request held before the step
    (`before`: each request's block table just before the step)."""
    if not isinstance(obs, StepResult):
        return False
    for rid, result in obs.results:
        new = {b for group in result.new_blocks or () for b in group if b}
        others = {b for r, table in before.items() if r != rid for group in table for b in group}
        if new & others:
            return True
    return False


class ViolationFound(AssertionError):
    def __init__(self, violations: list[Violation], config: Config, ops: list[Op]) -> None:
        self.violations, self.config, self.ops = violations, config, list(ops)
        super().__init__("\n".join(str(v) for v in violations[:8]))


class BudgetSpent(Exception):
    """Raised by every step past the run's deadline: the batch ends at the next step."""


def check_budget(stats: FuzzStats) -> None:
    """Raise `BudgetSpent` past the deadline, except in Hypothesis's final replay
    of a failure that was neither a violation nor a cut-off.

    That replay must run as the failure did: were it cut off by the budget, a
    harness error that struck just before the deadline would come back as
    `BudgetSpent`, one of the run's own signals, and read as "clean". A
    violation is already recorded and a cut-off is one; their replays are cut
    at once (a cut-off replayed further would draw past its recorded data)."""
    if not stats.out_of_time():
        return
    if stats.last_failure is None and not stats.cut_off:
        try:
            if current_build_context().is_final:
                return
        except InvalidArgument:  # outside a Hypothesis test
            pass
    stats.cut_off = True
    raise BudgetSpent()


@dataclass
class FuzzStats:
    """Figures a fuzz run reports; shared by every example of the run."""

    steps: int = 0
    examples: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    states: set[tuple[object, ...]] = field(default_factory=set)
    known: KnownLedger = field(default_factory=KnownLedger)
    last_failure: ViolationFound | None = None
    # Feature -> how often it was exercised: configuration features per example,
    # model rules per firing, cross-request reuse per step.
    features: Counter[str] = field(default_factory=Counter)
    # Set by a runner: past `deadline` (time.monotonic) every step raises
    # BudgetSpent, so a batch ends at once; `on_violation` hears of each failure the moment it is seen.
    deadline: float | None = None
    on_violation: Callable[[ViolationFound], None] | None = None
    audit_every: int | None = DEFAULT_AUDIT_EVERY

    # Policy drift (`Checker`'s `policy_drift`), apart from violations: each example's
    # first, with its operations; the operations judged after a drift by the
    # model-independent checks alone, and those not judged (the target refused one drawn
    # from the model's diverged state); `on_drift` hears of each drift when it is seen.
    drifts: list[ViolationFound] = field(default_factory=list)
    after_drift: int = 0
    unjudged_after_drift: int = 0
    on_drift: Callable[[ViolationFound], None] | None = None

    # Set once a step was refused for the budget (`check_budget`).
    cut_off: bool = False
    batches: int = 0  # Hypothesis batches started (the fuzz runner's)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


Tolerance = Callable[[Violation], object]
"""A violation -> the known finding that explains it (or any truthy value naming
none), or a falsy value for a new violation."""
