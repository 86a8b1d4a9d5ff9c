"""The rules of each vLLM release, chosen by its version: the table a run's profile comes from.

A release's rules are what its code did when it was released; a run picks them by
the installed version, never by reading the installed code (that reading is a
regression check, `vllm_capabilities.profile_check`, which reports a difference
and adopts nothing). Contracts:

- `RELEASES` is ordered oldest first; each row states only what changed from
  the row above it, with the PR where one is known.
- `release_of(version)` maps any PEP 440 version to the newest release of the
  table not newer than it, and says so in a note whenever that is not an exact
  match: a dev build (`0.33.1.dev12+gabc`, setuptools-scm's name for 12
  commits after the tag 0.33.0) descends from 0.33.0; a post, local or
  pre-release build likewise; a version older than the table gets the oldest
  row, flagged unverified; newer than the table gets the newest.
- `rules_of(release)` is that release's full row (`RULE_FIELDS`, every field).
- An override (`OVERRIDE_ENV`, "capability=value,...") is how a user's branch
  declares that it intends a different rule: the run then checks against the
  declared rule and says so in its summary. A malformed override is a
  `UsageError` naming the field and the rule (exit 2).

Where the rows come from: each release's code-derived detection
(`vllm_capabilities.detect_code`) run in that release's own environment by the
release matrix, recorded in `docs/matrix-report.json` (`kvretain matrix
--releases 0.21.0,...,0.33.0 --budget-s 40 --seed 0`, 2026-11-27, commits
d0bb14d .. ac50412), cross-checked with the PRs of `docs/matrix.md`'s
capability table. `tests/test_profile_by_version.py` compares every row with
that report; `tests/test_matrix.py` runs the detection on each release
environment that is installed and demands no drift from its row. 0.20.0 and older have no row (the matrix starts at 0.21.0,
the last release before #42258's block mask); they get 0.21.0's rules,
flagged unverified.
"""

from __future__ import annotations

import os
from typing import Any

from invariants.errors import UsageError

OVERRIDE_ENV = "KVRETAIN_VLLM_PROFILE"

# The capabilities that are release rules (the model's profile and the adapter's branches
# follow them), and the values each may take (None: a bool).
RULE_VALUES: dict[str, tuple[str, ...] | None] = {
    "block_mask": None,
    "free_order": ("append", "caller", "pool"),
    "caching_off_order": ("lifo", "fifo"),
    "retention": ("none", "env", "config"),
    "mamba_retention": None,
    "eagle_aware_mask": None,
    "shared_prefix_junction": None,
    "fine_grained_mamba": None,
    "cow_copies": None,
    "coarse_hash": ("last", "concat"),
    "eagle_junction_peek": None,
    "tail_excludes_last": None,
    "eagle_margin_hashed": None,
    "replay_boundaries": None,
    "partial_tail": None,
    "eagle_margin_skips_mamba": None,
    "mamba_checkpoint": ("any_block", "in_block_drop", "in_block"),
    "mamba_count_capped": None,
    "mamba_retired_mark": None,
    "mask_hit_grid": None,
    "sample_caching": None,
}
RULE_FIELDS: tuple[str, ...] = tuple(RULE_VALUES)

# The oldest recorded release: every rule before the mechanisms kvretain judges.
_FIRST: dict[str, Any] = {
    "block_mask": False,
    "free_order": "append",
    "caching_off_order": "lifo",
    "retention": "none",
    "mamba_retention": False,
    "eagle_aware_mask": False,
    "shared_prefix_junction": False,
    "fine_grained_mamba": False,
    "cow_copies": False,
    "coarse_hash": "concat",
    "eagle_junction_peek": False,
    "tail_excludes_last": False,
    "eagle_margin_hashed": False,
    "replay_boundaries": False,
    "partial_tail": False,
    "eagle_margin_skips_mamba": False,
    "mamba_checkpoint": "in_block",
    "mamba_count_capped": False,
    "mamba_retired_mark": False,
    "mask_hit_grid": False,
    "sample_caching": False,
}

# release -> what changed from the row above (the PR where known); oldest first.
RELEASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("0.21.0", _FIRST),
    ("0.22.0", {"block_mask": True}),  # #42258
    ("0.22.1", {}),
    # #43447 (SWA's own frees by `prepend=`, the retention env var); #44082 (Eagle-aware mask)
    ("0.23.0", {"free_order": "caller", "retention": "env", "eagle_aware_mask": True}),
    # #42656 (the pool splits every free), #45845 (Mamba retention), wide blocks keyed by the last hash
    ("0.24.0", {"free_order": "pool", "mamba_retention": True, "coarse_hash": "last"}),
    ("0.25.0", {}),
    ("0.25.1", {}),
    # #46384 (partial prefix hits: partial tails, no Eagle margin for Mamba); junction, fine-grained, CoW
    (
        "0.26.0",
        {
            "shared_prefix_junction": True,
            "fine_grained_mamba": True,
            "cow_copies": True,
            "partial_tail": True,
            "eagle_margin_skips_mamba": True,
        },
    ),
    ("0.27.0", {"caching_off_order": "fifo"}),  # #48017's fast path appends with caching off
    ("0.27.1", {}),
    ("0.28.0", {"caching_off_order": "lifo"}),  # #51482
    ("0.29.0", {"retention": "config", "mask_hit_grid": True}),  # #52216 (KVCacheConfig field)
    ("0.30.0", {"replay_boundaries": True, "mamba_checkpoint": "in_block_drop", "mamba_retired_mark": True}),
    ("0.31.0", {"mamba_count_capped": True}),
    ("0.32.0", {"tail_excludes_last": True, "eagle_margin_hashed": True, "mamba_checkpoint": "any_block"}),
    ("0.33.0", {"eagle_junction_peek": True, "sample_caching": True}),
)

# The PR that set a capability's current rule, for drift lines.
RULE_PR: dict[str, str] = {
    "block_mask": "#42258",
    "free_order": "#42656",
    "caching_off_order": "#51482",
    "retention": "#52216",
    "mamba_retention": "#45845",
    "eagle_aware_mask": "#44082",
    "partial_tail": "#46384",
    "eagle_margin_skips_mamba": "#46384",
}


def _key(version: str) -> Any:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version)
    except InvalidVersion:
        raise UsageError(f"vLLM version {version!r}: not a PEP 440 version (e.g. 0.33.0)") from None


def _rows() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    row: dict[str, Any] = {}
    for release, changes in RELEASES:
        row = {**row, **changes}
        out[release] = row
    return out


ROWS: dict[str, dict[str, Any]] = _rows()


def release_of(version: str) -> tuple[str, str | None]:
    """The table's release whose rules `version` has, and a note when it is not exactly
    that release (a dev/post/local/pre-release build, a release without its own row,
    one older or newer than the table); None for an exact match."""
    v = _key(version)
    older = [r for r, _ in RELEASES if _key(r) <= v]
    if not older:
        first = RELEASES[0][0]
        return first, (
            f"vLLM {version} predates the release table (oldest row {first}): "
            f"rules of {first}, unverified for {version}"
        )
    release = older[-1]
    if str(v) == release:
        return release, None
    if v.is_devrelease or v.local is not None or v.is_postrelease or v.is_prerelease:
        kind = "a development build" if v.is_devrelease else "a build"
        return release, f"vLLM {version} is {kind} descending from {release}: rules of {release}"
    newest = RELEASES[-1][0]
    if release == newest:
        return (
            release,
            f"vLLM {version} is newer than the release table (newest row {newest}): rules of {newest}",
        )
    return release, f"vLLM {version} has no row of its own: rules of {release}, the newest release before it"


def rules_of(release: str) -> dict[str, Any]:
    """Every rule of a release of the table (`RULE_FIELDS`)."""
    return dict(ROWS[release])


def releases_with(field: str, value: Any) -> str:
    """The releases of the table whose `field` rule is `value`, as spans ("0.27.0 .. 0.27.1")."""
    spans: list[list[str]] = []
    previous = False
    for release, _ in RELEASES:
        hit = ROWS[release][field] == value
        if hit and previous:
            spans[-1][1] = release
        elif hit:
            spans.append([release, release])
        previous = hit
    if not spans:
        return "no release of the table"
    return ", ".join(a if a == b else f"{a} .. {b}" for a, b in spans)


def parse_overrides(text: str | None) -> dict[str, Any]:
    """The rules a branch declares (`OVERRIDE_ENV`: "capability=value,..."); empty for
    none. A capability that is no rule or a value it cannot take is a `UsageError`."""
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, raw = (s.strip() for s in item.partition("="))
        if not sep or name not in RULE_VALUES:
            raise UsageError(
                f"{OVERRIDE_ENV}: {item.strip()!r} is not capability=value with a capability of "
                f"{', '.join(RULE_FIELDS)}"
            )
        allowed = RULE_VALUES[name]
        if allowed is None:
            if raw.lower() not in ("true", "false"):
                raise UsageError(f"{OVERRIDE_ENV}: {name} is true or false, got {raw!r}")
            out[name] = raw.lower() == "true"
        elif raw in allowed:
            out[name] = raw
        else:
            raise UsageError(f"{OVERRIDE_ENV}: {name} is one of {', '.join(allowed)}, got {raw!r}")
    return out


def env_overrides() -> dict[str, Any]:
    """The overrides this process declares (`OVERRIDE_ENV`)."""
    return parse_overrides(os.environ.get(OVERRIDE_ENV))
