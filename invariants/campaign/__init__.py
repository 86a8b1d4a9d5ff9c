"""Campaigns: long runs spread over a Ray cluster, their results merged into one report.

Ray is an optional extra (`pip install kvretain[ray]`, pinned in pyproject.toml);
this room is the only one that imports it, and only when a command is given
`--ray ADDRESS`. Two campaigns:

- `explore` (`invariants.campaign.explore`): the breadth-first search of
  `invariants.explore` with its frontier partitioned by fingerprint over the
  workers, each state expanded once cluster-wide; the certificate is the one a
  one-process run writes (per-depth distinct counts, transitions, known
  findings, the shortest counterexample), only its time differs.
- `fuzz` (`invariants.campaign.fuzz`): one `run_fuzz` per (seed, configuration)
  as a Ray task; counts summed, known-finding ledgers merged per finding, every
  shrunk trace kept per seed, one JSON and one JUnit report.

`ADDRESS` is `local` (a Ray instance started for the command, one worker per
core), `local:N` (N workers), `auto` (the cluster this machine belongs to, as
`ray start` left it) or a cluster's address (`HOST:PORT`, `ray://HOST:PORT`).
A Ray instance the command started is shut down when it ends; one that was
already running in this process (a test's) is reused and left running.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from invariants.errors import UsageError


@dataclass
class Session:
    """A connection to a Ray instance: how many workers a campaign spreads over."""

    address: str
    workers: int
    owned: bool  # started here: shut down by `close`

    def close(self) -> None:
        if self.owned:
            import ray

            ray.shutdown()


def parse_address(text: str) -> tuple[str | None, int | None]:
    """`--ray ADDRESS` -> (the address ray.init gets, None for a local instance; the
    local worker count, None for an existing cluster). Bad input is a UsageError."""
    if text == "local" or text.startswith("local:"):
        if text == "local":
            return None, os.cpu_count() or 1
        count = text.split(":", 1)[1]
        if not count.isdigit() or int(count) < 1:
            raise UsageError(f"--ray {text}: expected local, local:N (N >= 1 workers), auto or HOST:PORT")
        return None, int(count)
    if not text.strip():
        raise UsageError("--ray: an empty address (give local, local:N, auto or HOST:PORT)")
    return text, None


def connect(text: str, workers: int | None = None) -> Session:
    """Connect to (or start) the Ray instance `text` names (see the module docstring).
    `workers` overrides how many workers a campaign uses (default: local N, or the
    cluster's CPUs). A missing `ray` package is one usage line."""
    address, local = parse_address(text)
    try:
        import ray
    except ImportError:
        raise UsageError(
            "--ray needs the optional Ray extra: pip install 'kvretain[ray]' (ray==2.60.0)"
        ) from None
    owned = not ray.is_initialized()
    if owned:
        common: dict[str, Any] = {
            "include_dashboard": False,
            "log_to_driver": False,
        }
        try:
            if address is None:
                ray.init(num_cpus=local, **common)
            else:
                ray.init(address=address, **common)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise UsageError(f"--ray {text}: cannot connect: {str(exc).splitlines()[0]}") from None
    n = workers or local or int(ray.cluster_resources().get("CPU", 1))
    return Session(text, max(1, n), owned)
