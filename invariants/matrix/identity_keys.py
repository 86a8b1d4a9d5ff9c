"""How each vLLM release from 0.20.0 hashed each request-identity field, and whether that let
requests of different identities share blocks.

The table is data read from each release's `vllm/v1/core/kv_cache_utils.py` (the wheels on
the package index, `pip download vllm==X --no-deps`; key functions compared release to
release): `CHANGES` lists, per identity field, the release ranges whose key differs from
0.33.0's, what the key was, whether two requests that must stay apart could share a block,
and the issues / pull requests that name the change. `render_table()` prints it as
Markdown (`kvretain matrix --identity-table`; docs/identity-matrix.md holds the output and a
test keeps it current). `source_features(text)` reads the same facts from a release's
source, so the rows of every installed release are checked against its code, and
`invariants/targets/vllm_identity_probe.py` checks the "shares" verdicts by hashing real
requests with that release's own functions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FIRST, MODELED = "0.20.0", "0.33.0"

# Every release from FIRST to MODELED on the index, in order (patch releases included).
RELEASES: tuple[str, ...] = (
    "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0",
    "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
    "0.33.0",
)  # fmt: skip


@dataclass(frozen=True)
class Change:
    """One identity field's key over a release range that differs from 0.33.0's."""

    field: str
    first: str  # first release with this key
    last: str  # last release with it
    key: str  # what the block hash read for the field there
    shares: str  # whether requests that must stay apart could share a block, and when
    refs: str  # issues / PRs naming the problem or the change
    probe: str | None = None  # the probe of vllm_identity_probe that shows it (None: none)


# 0.33.0's key per field (`model/contract/extra_keys.py` states it), for the table's first column.
CURRENT: dict[str, str] = {
    "cache_salt": '("cache_salt", salt) on the first block only; the hash chain carries it',
    "lora": '("lora", name, path) on every block (the int id is not hashed)',
    "multimodal": '("mm", identifier, offset of the item in the block) on every block the item overlaps',
    "prompt_embeds": '("prompt_embeds", sha256 of the block\'s embeddings) on every block',
    "lookahead": "with an Eagle-family drafter, each hash also covers the next L tokens (their keys too)",
}

CHANGES: tuple[Change, ...] = (
    Change(
        "cache_salt",
        "0.20.0",
        "0.30.0",
        "the bare salt string, untagged, in the same tuple as the bare LoRA name",
        "yes: a base-model request with salt X and an adapter named X (no salt) hash their first "
        "block alike, so one reads the other's first block (KV computed under the adapter's weights)",
        "#44701 (report), #44706 (domain tags); tagged keys ship in 0.31.0",
        probe="salt_equals_adapter_name",
    ),
    Change(
        "lora",
        "0.20.0",
        "0.30.0",
        "the bare adapter name (no path, untagged; the int id left the key before 0.20.0, #27211)",
        "yes: an adapter re-pointed under the same name at other weights (load_inplace) reuses the "
        "old adapter's KV; and the salt collision above",
        "#42125 (report), #42495, #45981 / #48352 (name plus load identity); the path enters in 0.31.0",
        probe="same_adapter_name_other_path",
    ),
    Change(
        "multimodal",
        "0.20.0",
        "0.30.0",
        "(identifier, offset in block), untagged; a block hashed after the request's first hashing "
        "call started from the last item only (curr_mm_idx = -1)",
        "yes: a block completed later (by output tokens) that overlaps two items keys only the last, "
        "so requests differing in the earlier item share it",
        "#49377 / #49448 (report), #51694 (start from the first overlapping item); fixed in 0.31.0",
        probe="incremental_block_drops_earlier_item",
    ),
    Change(
        "prompt_embeds",
        "0.20.0",
        "0.30.0",
        "the bare sha256 digest (bytes, untagged)",
        "no: bytes never equal a salt or an adapter name (str)",
        "tags added with the others in 0.31.0 (#44706)",
    ),
    Change(
        "lookahead",
        "0.20.0",
        "0.32.0",
        "not hashed: block hashes covered the block's tokens only",
        "no: under an Eagle-family drafter vLLM dropped the last matched block of every hit instead "
        "(its drafter KV depends on the next token), so no request read another's boundary",
        "#50438 (RFC), #50897 (lookahead-aware hashing); num_hash_lookahead_tokens ships in 0.33.0",
    ),
)

FIELDS: tuple[str, ...] = tuple(CURRENT)


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def changes_at(version: str) -> list[Change]:
    """The rows in force at `version` (empty: it hashed every field as 0.33.0 does)."""
    v = version_key(version)
    return [c for c in CHANGES if version_key(c.first) <= v <= version_key(c.last)]


def render_table() -> str:
    """The table as Markdown (what docs/identity-matrix.md holds)."""
    lines = [
        "# Identity fields across vLLM releases",
        "",
        f"Generated by `kvretain matrix --identity-table` from `invariants/matrix/identity_keys.py` "
        f"(releases {FIRST} to {MODELED}, read from each release's `vllm/v1/core/kv_cache_utils.py`). "
        "A test keeps this file current; `tests/test_identity_matrix.py` checks the rows of every "
        "installed release against its source and hashes real requests with its own functions.",
        "",
        f"## What {MODELED} hashes",
        "",
        "| field | key |",
        "| --- | --- |",
        *(f"| {f} | {CURRENT[f]} |" for f in FIELDS),
        "",
        "## Releases that hashed a field differently",
        "",
        "| field | releases | key there | requests could share blocks | issues / PRs |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in CHANGES:
        span = c.first if c.first == c.last else f"{c.first} to {c.last}"
        lines.append(f"| {c.field} | {span} | {c.key} | {c.shares} | {c.refs} |")
    lines += [
        "",
        "## Per release",
        "",
        "| release | fields hashed unlike " + MODELED + " | sharing possible through |",
        "| --- | --- | --- |",
    ]
    for r in RELEASES:
        rows = changes_at(r)
        fields = ", ".join(dict.fromkeys(c.field for c in rows)) or "none"
        sharing = ", ".join(dict.fromkeys(c.field for c in rows if c.shares.startswith("yes"))) or "none"
        lines.append(f"| {r} | {fields} | {sharing} |")
    return "\n".join(lines) + "\n"


def source_features(text: str) -> dict[str, bool]:
    """What a release's `kv_cache_utils.py` shows of each row (True: the 0.33.0 behaviour):
    tagged keys, the LoRA path, the multimodal window on later blocks, lookahead hashing."""
    return {
        "tagged_keys": '("cache_salt", request.cache_salt)' in text,
        "lora_path": "lora_request.lora_path" in text,
        "mm_window_on_later_blocks": re.search(r"curr_mm_idx\s*=\s*-1", text) is None,
        "lookahead": "num_hash_lookahead_tokens" in text,
    }


# Which source feature each row's absence stands for (a row is in force iff its feature is False).
ROW_FEATURE: dict[tuple[str, str], str | None] = {
    ("cache_salt", "0.20.0"): "tagged_keys",
    ("lora", "0.20.0"): "lora_path",
    ("multimodal", "0.20.0"): "mm_window_on_later_blocks",
    ("prompt_embeds", "0.20.0"): "tagged_keys",
    ("lookahead", "0.20.0"): "lookahead",
}


def disagreements(version: str, text: str) -> list[str]:
    """Rows the table claims for `version` that its source contradicts (empty: consistent)."""
    feats = source_features(text)
    out = []
    in_force = {(c.field, c.first) for c in changes_at(version)}
    for row, feature in ROW_FEATURE.items():
        if feature is None:
            continue
        if version_key(version) < version_key(row[1]):
            continue  # before the row's range: another row of the field applies
        claimed = row in in_force
        if claimed == feats[feature]:
            say = "in force" if claimed else "not in force"
            out.append(
                f"{version}: row {row[0]} from {row[1]} is {say} but the source shows {feature}={feats[feature]}"
            )
    return out


CONTROLS = ("other_salt", "other_adapter", "other_item_in_prompt")  # never shared, in any release


def probe_disagreements(version: str, shared: dict[str, bool]) -> list[str]:
    """Where a release's probe results (`vllm_identity_probe.probes()`: probe -> the two
    requests shared a block) contradict the table for `version` (empty: they agree). A probe
    of a row in force must share; every other probe, controls included, must not."""
    claimed = {c.probe for c in changes_at(version) if c.probe and c.shares.startswith("yes")}
    known = {c.probe for c in CHANGES if c.probe} | set(CONTROLS)
    out = []
    for name in sorted(known):
        if name not in shared:
            out.append(f"{version}: probe {name} did not run")
        elif shared[name] != (name in claimed):
            want = "share" if name in claimed else "stay apart"
            out.append(
                f"{version}: probe {name}: the table says the requests {want}, vLLM {version} disagrees"
            )
    return out


def installed_sources() -> dict[str, str]:
    """version -> `kv_cache_utils.py` path of every vLLM release installed here: this
    interpreter's and each cached release environment's (`vllm_env.cache_root()`)."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    from invariants.targets.vllm_env import cache_root

    out: dict[str, str] = {}
    try:
        spec = importlib.util.find_spec("vllm")
        if spec is not None and spec.origin is not None:
            out[version("vllm")] = str(Path(spec.origin).parent / "v1" / "core" / "kv_cache_utils.py")
    except PackageNotFoundError:
        pass
    for env in sorted(cache_root().glob("vllm-*")):
        found = sorted(env.glob("lib/python*/site-packages/vllm/v1/core/kv_cache_utils.py"))
        if found:
            out.setdefault(env.name.removeprefix("vllm-"), str(found[0]))
    return {v: p for v, p in out.items() if v in RELEASES}


def run_probes(version: str) -> dict[str, bool]:
    """The probe results of release `version`, run by its own interpreter (this one for the
    installed vLLM, else its cached environment's)."""
    import json
    import subprocess
    from importlib.metadata import version as installed
    from pathlib import Path

    from invariants.targets.vllm_env import cache_root

    if installed("vllm") == version:  # this interpreter's release: asked in process
        from invariants.targets.vllm_identity_probe import probes

        return probes()
    python = str(cache_root() / f"vllm-{version}" / "bin" / "python")
    script = Path(__file__).resolve().parents[1] / "targets" / "vllm_identity_probe.py"
    proc = subprocess.run([python, str(script)], capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"vLLM {version}: the identity probe failed: {proc.stderr.strip().splitlines()[-1:]}"
        )
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return {str(k): bool(v) for k, v in data["probes"].items()}
