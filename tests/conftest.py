"""Hypothesis profiles: `dev` (default, quick), `ci` (make test), `nightly` (deep)."""

import os
import warnings

from hypothesis import HealthCheck, settings

COMMON = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=True)
settings.register_profile("dev", max_examples=10, stateful_step_count=30, **COMMON)
settings.register_profile("ci", max_examples=25, stateful_step_count=40, **COMMON)
settings.register_profile("nightly", max_examples=1000, stateful_step_count=80, **COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
warnings.filterwarnings("ignore", message="retention_interval is ignored")
