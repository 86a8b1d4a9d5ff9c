"""Every small configuration, valid or not: the target builds nothing the model rejects.

A configuration is the search's operation zero. Contract of
`check_configurations(factory)`: for every configuration of the bounded domain
below, the model's `validate` decides. A target that builds a configuration the
model rejects is a violation (it would run an allocator the specification
forbids: a negative retention interval, one that is no multiple of the
scheduler block, retention on a model with nothing to retain, Mamba caching
outside 'align' mode); a target that raises anything but
`ConfigError` is a violation (a rejection must name the field and the rule). A
target that refuses what the model accepts is counted as `refused`, not a
violation: a target may support less (fine-grained Mamba on the reference),
and the search reports such an instance as skipped.

The domain: one group of each kind, full attention with an SWA or a Mamba
group, and three groups; block sizes 2 and 4 (equal and unequal); SWA windows
1, 3 and 5; Mamba 'align' and 'none'; retention None, -2, 0, 1, 2, 4 and 6;
Eagle off and on; caching on and off; a pool of 6 blocks. A target whose engine
decides every step (`TargetFeatures.engine_steps`) gets each with a token budget
(`ENGINE_BUDGET`), as its explore instances are built (`instances.engine_budget`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import cast

from invariants.harness.checker import Violation
from invariants.targets.base import Target
from model.contract.config import Config, ConfigError, GroupSpec, validate

BLOCK_SIZES = (2, 4)
WINDOWS = (1, 3, 5)
RETENTIONS: tuple[int | None, ...] = (None, -2, 0, 1, 2, 4, 6)
# Pool size is left out: the model's "at least 2 blocks" is its own rule (block 0 is
# the null block), and vLLM's KVCacheManager builds a one-block pool.
POOLS = (6,)


def _layouts() -> Iterator[tuple[GroupSpec, ...]]:
    swa = [GroupSpec("swa", b, sliding_window=w) for b in BLOCK_SIZES for w in WINDOWS]
    mamba = [GroupSpec("mamba", b, mamba_cache_mode=m) for b in BLOCK_SIZES for m in ("align", "none")]
    full = [GroupSpec("full", b) for b in BLOCK_SIZES]
    yield from ((g,) for g in full + swa + mamba)
    yield from ((f, s) for f in full for s in swa)
    yield from ((f, m) for f in full for m in mamba)
    yield from ((full[0], s, m) for s in swa[:3] for m in mamba)


# The token budget an engine that decides every step is built with here (at max_model_len).
ENGINE_BUDGET = 64


def configurations(budget: int = 0) -> Iterator[Config]:
    """The domain of the module docstring, in a fixed order (`budget`: each one's
    `max_num_batched_tokens`, 0: none stated)."""
    for groups, retention, eagle, caching, pool in itertools.product(
        _layouts(), RETENTIONS, (False, True), (True, False), POOLS
    ):
        yield Config(
            groups=groups,
            num_blocks=pool,
            retention_interval=retention,
            eagle=eagle,
            enable_caching=caching,
            max_model_len=64,
            max_num_batched_tokens=budget,
        )


@dataclass
class ConfigReport:
    """What the domain showed: how many configurations, how the model judged them,
    what the target refused on its own, and the violations (the search stops at `keep`)."""

    checked: int = 0
    valid: int = 0
    refused: int = 0
    first_refusal: str = ""  # the target's reason for the first valid configuration it refused
    violations: list[tuple[Config, Violation]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        """What held and what the target refused, with counts: a refusal of a valid
        configuration is support the target lacks, not a violation, and is never
        described as agreement with the model."""
        rejected = self.checked - self.valid
        head = (
            f"configurations: {self.checked} checked, {self.valid} valid by the model, "
            f"{rejected} rejected by it"
        )
        if self.violations:
            cfg, v = self.violations[0]
            return f"{head}; {len(self.violations)} VIOLATION(s), first: {v.message} ({cfg})"
        refused = (
            f"; the target refused {self.refused} of the {self.valid} valid ones (support it lacks; "
            f"first: {self.first_refusal[:120]}) and built the other {self.valid - self.refused}"
            if self.refused
            else f"; the target built all {self.valid} valid ones"
        )
        return (
            f"{head}: holds: the target built none of the {rejected} the model rejects "
            f"(each refused with a ConfigError){refused}"
        )


def check_configurations(factory: Callable[[Config], Target], keep: int = 5) -> ConfigReport:
    """Judge every configuration of the domain (see the module docstring)."""
    report = ConfigReport()
    engine = isinstance(factory, type) and cast("type[Target]", factory).features.engine_steps
    for cfg in configurations(ENGINE_BUDGET if engine else 0):
        report.checked += 1
        try:
            validate(cfg)
            valid, rule = True, ""
        except ConfigError as exc:
            valid, rule = False, str(exc)
        report.valid += valid
        try:
            factory(cfg)
            built, error = True, None
        except ConfigError as exc:
            built, error = False, None
            if valid and not report.first_refusal:
                report.first_refusal = str(exc)
        except Exception as exc:  # a refusal must be a ConfigError naming the rule
            built, error = False, f"{type(exc).__name__}: {exc}"
        if error is not None:
            found = Violation("config_rejection", f"raised {error}, not ConfigError")
        elif built and not valid:
            found = Violation("config_rejection", f"accepted a configuration the model rejects: {rule}")
        else:
            report.refused += valid and not built
            continue
        report.violations.append((cfg, found))
        if len(report.violations) >= keep:
            break  # enough to act on; the count says the search stopped early
    return report
