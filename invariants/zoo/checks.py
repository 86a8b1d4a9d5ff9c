"""Direct checks: bug classes the stateful fuzzer cannot reach by construction.

- `config_rejection`: every generated config is valid, so a validation gap is
  invisible to the fuzzer; this check builds the target on invalid configs
  and demands `ConfigError` for each (the rule named in the row).
- `exception_safety`: the fuzzer stops at the first exception (a crash is
  already a finding), so state left behind by an exception path is never
  judged. This check injects one fault inside `cache_full_blocks` (the KV
  event sink raises on the SWA group's BlockStored), then judges the pool's
  structure invariants on the state the failed call left.

Each returns a `DirectOutcome`: a violation (the target is killed), or
none (it passes), or `vacuous` set when the check could not exercise the
target (never counted as a kill or a pass).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from invariants.catalogue import BY_NAME, CheckContext, History
from invariants.harness.checker import Violation
from invariants.targets.base import Target, TargetCrash
from model.contract.config import Config, ConfigError, GroupSpec
from model.contract.observation import Done
from model.contract.ops import AddRequest, Op, Schedule

Factory = Callable[[Config], Target]


@dataclass
class DirectOutcome:
    violation: Violation | None = None
    vacuous: str | None = None
    config: Config | None = None
    ops: list[Op] = field(default_factory=list)


INVALID_CONFIGS: tuple[tuple[str, Config], ...] = (
    (
        "retention -4 (negative multiple of scheduler_block_size 4)",
        Config(
            groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=6)),
            num_blocks=16,
            retention_interval=-4,
        ),
    ),
    (
        "retention 6 (not a multiple of scheduler_block_size 4)",
        Config(
            groups=(GroupSpec("full", 4), GroupSpec("swa", 2, sliding_window=5)),
            num_blocks=16,
            retention_interval=6,
        ),
    ),
    (
        "retention 4 on a model with no SWA/Mamba group",
        Config(groups=(GroupSpec("full", 4),), num_blocks=16, retention_interval=4),
    ),
)

STRUCTURE = (
    "block_in_exactly_one_place",
    "no_negative_ref_count",
    "free_queue_has_no_duplicates",
    "ref_count_matches_tables",
    "hash_map_points_at_holders",
)

FAULT_CONFIG = Config(
    groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=6)),
    num_blocks=24,
    retention_interval=0,
    max_model_len=4096,
)
FAULT_PROMPT = tuple([1, 2, 3] * 7)


def config_rejection(factory: Factory) -> DirectOutcome:
    for rule, cfg in INVALID_CONFIGS:
        try:
            factory(cfg)
        except ConfigError:
            continue
        except Exception as exc:  # a rejection must be a clear ConfigError, not a traceback
            return DirectOutcome(
                Violation("config_rejection", f"{rule}: raised {type(exc).__name__}: {exc}, not ConfigError")
            )
        return DirectOutcome(Violation("config_rejection", f"{rule}: accepted"))
    return DirectOutcome()


class _FaultySink(list):  # type: ignore[type-arg]
    """A KV event queue whose next BlockStored for `group` raises once."""

    def __init__(self, items: list[Any], group: int) -> None:
        super().__init__(items)
        self.group, self.fired = group, False

    def append(self, ev: Any) -> None:
        if (
            not self.fired
            and type(ev).__name__ == "BlockStored"
            and getattr(ev, "group_idx", None) == self.group
        ):
            self.fired = True
            raise RuntimeError("injected fault: KV event sink failed")
        super().append(ev)


def _pool(target: Target) -> Any:
    alloc = getattr(target, "allocator", None)
    return alloc.block_pool if alloc is not None else getattr(target, "pool", None)


def exception_safety(factory: Factory) -> DirectOutcome:
    """The fault fires on the second operation (the prompt's first schedule)."""
    target = factory(FAULT_CONFIG)
    pool = _pool(target)
    if pool is None or not isinstance(getattr(pool, "kv_event_queue", None), list):
        return DirectOutcome(vacuous="the target exposes no KV event queue to fault")
    ops: list[Op] = [AddRequest("x", FAULT_PROMPT), Schedule("x", 64)]
    target.apply(ops[0])
    before = target.snapshot()
    sink = _FaultySink(list(pool.kv_event_queue), group=1)
    pool.kv_event_queue = sink
    crashed = False
    try:
        target.apply(ops[1])
    except TargetCrash:
        crashed = True
    finally:
        pool.kv_event_queue = list(sink)
    if not sink.fired or not crashed:
        return DirectOutcome(vacuous="the injected fault did not fire", config=FAULT_CONFIG, ops=ops)
    after = target.snapshot()
    ctx = CheckContext(FAULT_CONFIG, ops[1], Done(), before, after, History())
    for name in STRUCTURE:
        msgs = BY_NAME[name].check(ctx)
        if msgs:
            msg = f"after an injected fault in cache_full_blocks: {name}: {msgs[0]}"
            return DirectOutcome(Violation("exception_safety", msg), config=FAULT_CONFIG, ops=ops)
    return DirectOutcome(config=FAULT_CONFIG, ops=ops)


DIRECT_CHECKS: dict[str, Callable[[Factory], DirectOutcome]] = {
    "config_rejection": config_rejection,
    "exception_safety": exception_safety,
}
