"""Who raised a target's crash, and in which frames: what a crash finding's trigger reads.

A crash is one of three things, told apart by where it was raised, never by
its message:

- `engine`: raised inside the allocator under test. The innermost frame of the
  exception the adapter wrapped (the end of its `__cause__` chain) runs in an
  engine's package (`ENGINE_PACKAGES`: vLLM, SGLang, `reference_impl`, the
  model), named positively: code of no listed package is not an engine.
- `observed`: a `TargetCrash` the adapter raised itself, at one of its
  observation sites (`OBSERVATION_SITES`): the adapter saw the engine break its
  own contract at a point where the engine fails at its next call (an assertion
  the adapter cannot let it reach), and stopped there. A finding about the
  engine, stated by the adapter.
- `adapter`: anything else: raised by kvretain's own code (an adapter, its
  snapshot translation, its scripted connector, which vLLM calls) or by code
  of no engine package: a gap in kvretain, never a defect of the engine, and
  never a known finding (`claims.Precondition`).

`CrashSite` keeps the frames of that innermost exception (module, qualified
name, the classes of its `self`/`cls`, its integer locals) so that a crash
finding's trigger (`claims.TRIGGERS`) can check what actually happened in the
crashing operation: which manager ran short, whether the admission carried
external tokens, which of the adapter's checks fired.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

ENGINE = "engine"
OBSERVED = "observed"
ADAPTER = "adapter"
ORIGINS = (ENGINE, OBSERVED, ADAPTER)

# The top-level packages whose code is an allocator under test.
ENGINE_PACKAGES = frozenset({"vllm", "sglang", "reference_impl", "model"})

# (module, qualified name): the adapter functions that raise `TargetCrash` only to report
# the engine breaking its own contract (each names the finding it reports). Any other
# `TargetCrash` raised by kvretain's code is an adapter gap.
OBSERVATION_SITES: frozenset[tuple[str, str]] = frozenset(
    {
        # save-during-load-freed-at-first-report: a transfer's report freed the request
        # while its other transfer is in flight (the later report would assert).
        ("invariants.targets.vllm_scheduler_target", "SchedulerOpDriver.dispatch"),
        ("invariants.targets.vllm_scheduler_target", "SchedulerOpDriver.ended"),
        # async-load-cut-keeps-placeholders: a cut request kept its output placeholders.
        ("invariants.targets.vllm_async_scheduler_drive", "AsyncStepScheduler._check_placeholders"),
    }
)


@dataclass(frozen=True)
class Frame:
    """One frame of a crash: where it ran and the integers it held."""

    module: str
    qualname: str
    classes: tuple[str, ...] = ()  # the MRO names of its `self` (or `cls`); () for a function
    ints: tuple[tuple[str, int], ...] = ()

    def is_method(self, cls: str, name: str) -> bool:
        """Is this `name` run on an instance (or subclass) of a class named `cls`?"""
        return self.qualname.rsplit(".", 1)[-1] == name and (
            cls in self.classes or self.qualname == f"{cls}.{name}"
        )

    def int(self, name: str) -> int | None:
        return dict(self.ints).get(name)


@dataclass(frozen=True)
class CrashSite:
    """Who raised a crash (`ENGINE`, `OBSERVED` or `ADAPTER`), the type of the innermost
    exception, and its frames, outermost first."""

    raised_by: str
    error: str
    frames: tuple[Frame, ...]

    @property
    def innermost(self) -> Frame | None:
        return self.frames[-1] if self.frames else None

    def enclosing(self, cls: str, name: str) -> Frame | None:
        """The innermost frame running `cls.name` (None: the crash did not pass through it)."""
        return next((f for f in reversed(self.frames) if f.is_method(cls, name)), None)

    def nearest(self, cls: str) -> Frame | None:
        """The innermost frame run on an instance of `cls` (or a subclass)."""
        return next((f for f in reversed(self.frames) if cls in f.classes), None)


def crash_site(exc: BaseException) -> CrashSite:
    """Where `exc` (what a target raised, usually a `TargetCrash`) came from; see the module
    docstring for the three origins."""
    from invariants.targets.base import TargetCrash

    root = exc
    seen = {id(root)}
    while root.__cause__ is not None and id(root.__cause__) not in seen:
        root = root.__cause__
        seen.add(id(root))
    frames = _frames(root.__traceback__)
    inner = frames[-1] if frames else None
    if root is exc and isinstance(exc, TargetCrash):
        raised_at = (inner.module, inner.qualname) if inner is not None else None
        origin = OBSERVED if raised_at in OBSERVATION_SITES else ADAPTER
    elif inner is not None and inner.module.split(".", 1)[0] in ENGINE_PACKAGES:
        origin = ENGINE
    else:
        origin = ADAPTER
    return CrashSite(origin, type(root).__name__, frames)


def _frames(tb: TracebackType | None) -> tuple[Frame, ...]:
    out = []
    while tb is not None:
        f = tb.tb_frame
        local: dict[str, Any] = f.f_locals
        owner = local.get("self", local.get("cls"))
        kind = owner if isinstance(owner, type) else type(owner) if owner is not None else None
        classes = tuple(c.__name__ for c in kind.__mro__) if kind is not None else ()
        ints = tuple((k, v) for k, v in local.items() if isinstance(v, int) and not isinstance(v, bool))
        out.append(Frame(str(f.f_globals.get("__name__", "")), f.f_code.co_qualname, classes, ints))
        tb = tb.tb_next
    return tuple(out)


__all__ = [
    "ADAPTER",
    "ENGINE",
    "ENGINE_PACKAGES",
    "OBSERVATION_SITES",
    "OBSERVED",
    "ORIGINS",
    "CrashSite",
    "Frame",
    "crash_site",
]
