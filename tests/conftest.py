"""Hypothesis profiles: `dev` (default, quick), `ci` (make test), `nightly` (deep). The suite runs
pure Python (KVRETAIN_PURE_PYTHON=1 unless set: `invariants.compiled`).

The `release_envs` fixture: the cached older vLLM releases a test runs on.
"""

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

# Pure Python unless told otherwise, before anything of the project is imported: monkeypatches
# and mutants edit Python functions that a compiled build (`make compiled`) would not call.
os.environ.setdefault("KVRETAIN_PURE_PYTHON", "1")

from invariants.targets.vllm_env import cache_root

COMMON = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=True)
# Without Hypothesis's explain phase: after shrinking a failure it re-runs variations of it
# only to annotate the report, and a control that expects a failure paid for it every run
# (test_machine's shrink control: 14 s with it excluded, 101 s with it). Generation and
# shrinking, what the tests judge, are unchanged; `nightly` keeps the explanations.
QUICK_PHASES = tuple(p for p in Phase if p is not Phase.explain)
settings.register_profile("dev", max_examples=10, stateful_step_count=30, phases=QUICK_PHASES, **COMMON)
settings.register_profile("ci", max_examples=25, stateful_step_count=40, phases=QUICK_PHASES, **COMMON)
# Every phase named: under CI=true Hypothesis's own default drops the explain phase.
settings.register_profile("nightly", max_examples=1000, stateful_step_count=80, phases=tuple(Phase), **COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
warnings.filterwarnings("ignore", message="retention_interval is ignored")


@dataclass(frozen=True)
class ReleaseEnvs:
    """The cached environments of older vLLM releases (`invariants.targets.vllm_env`).

    `required`: the releases `make test` installs (its TEST_RELEASES, passed as
    KVRETAIN_TEST_RELEASES); `ci`: the CI variable is set (not "", "0" or "false").
    """

    required: frozenset[str]
    ci: bool

    def python(self, version: str) -> Path:
        """The release's interpreter. A missing (or half-made) environment skips the
        test with the reason, or fails it where it must be there: a required release
        under CI, where a skip would pass unseen."""
        root = cache_root() / f"vllm-{version}"
        if (root / ".kvretain-ready").exists():
            return root / "bin" / "python"
        reason = (
            f"vLLM {version} is not installed under {root} "
            f"(make release-envs TEST_RELEASES={version}, or kvretain matrix, installs it)"
        )
        if self.ci and version in self.required:
            pytest.fail(f"{reason}; under CI `make test` must have installed it")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def release_envs() -> ReleaseEnvs:
    """Which release environments the run requires, from the environment variables."""
    required = os.environ.get("KVRETAIN_TEST_RELEASES", "").replace(",", " ").split()
    ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false")
    return ReleaseEnvs(frozenset(required), ci)
