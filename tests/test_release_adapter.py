"""The vLLM adapter on older releases: its incremental read agrees with its full one.

The Checker's fast path reads what an operation touched (`VllmManagerTarget.partial`)
and audits with full snapshots; both must name the same holders for every
key, whatever the release. 0.21.0 .. 0.23.0 key a group block wider than the
hash block by the fine hashes it spans, joined ("concat"); a lookup by the
last fine hash alone misses every such block (each wide-block holder read as
none, which the fast path reported as a model difference and as a hash map
that does not point at its holders).

Run on the cached release (skipped, with the reason, where it is absent);
the control is the same read with the lookup by the last fine hash.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from invariants.harness.trace import Trace, write_trace
from invariants.targets.vllm_env import cache_root, vllm_available
from model.contract.config import Config, ConfigError, GroupSpec
from model.contract.observation import block_key
from model.contract.ops import AddRequest, Finish, Schedule

ROOT = Path(__file__).resolve().parents[1]
_OK, _REASON = vllm_available()

# Full 8 and SWA 4 over hash blocks of 2: both groups' blocks are wide.
WIDE = Config((GroupSpec("full", 8), GroupSpec("swa", 2, 4), GroupSpec("swa", 4, 7)), 27, hash_block_size=2)
OPS = (
    AddRequest("a", (1, 1, 3, 1, 3, 1, 3, 2, 1, 2, 3, 3, 1, 1, 2, 1, 1, 3)),
    Schedule("a", 32),
    AddRequest("b", (1, 1, 3, 1, 3, 1, 3, 2, 2, 2)),
    Schedule("b", 32),
    Finish("a"),
)

# One process reads the trace both ways (importing the release's vLLM is most of its cost).
_READ = """
import json, sys
from invariants.harness.trace import read_trace
from invariants.targets.vllm_target import VllmManagerTarget
trace = read_trace(sys.argv[1])
found = {}
for mode in sys.argv[2:]:
    target = VllmManagerTarget(trace.config)
    if mode == "last":  # the control: look a key up by its last fine hash only
        target.keys.map_key = lambda k: target.names.table.hash_of(k.tokens) + k.group.to_bytes(4, "big")
    for op in trace.ops:
        target.apply(op)
    snap = target.snapshot()
    part = target.partial(range(1, snap.num_blocks), list(target.requests), set(snap.cached))
    wide = [k for k in snap.cached if len(k.tokens) >= trace.config.groups[k.group].block_size > 2]
    found[mode] = {
        "caps": target.caps.coarse_hash,
        "wide": len(wide),
        "differ": sorted(str(k) for k in snap.cached if part.holders.get(k) != snap.cached[k]),
    }
print(json.dumps(found))
"""


def _read(python: Path, trace: Path, *modes: str) -> dict[str, dict[str, object]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.run(
        [str(python), "-c", _READ, str(trace), *modes], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out: dict[str, dict[str, object]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("version", ["0.21.0", "0.23.0"])
def test_partial_and_snapshot_agree_on_wide_block_holders(version: str, tmp_path: Path) -> None:
    python = cache_root() / f"vllm-{version}" / "bin" / "python"
    if not (cache_root() / f"vllm-{version}" / ".kvretain-ready").exists():
        pytest.skip(f"vLLM {version} is not installed under {cache_root()} (kvretain matrix installs it)")
    trace = write_trace(Trace(WIDE, list(OPS), 0, "vllm-manager", ""), tmp_path / "t.json")
    read = _read(python, trace, "map", "last")
    got, control = read["map"], read["last"]
    assert got["caps"] == "concat" and isinstance(got["wide"], int) and got["wide"] > 0
    assert got["differ"] == []
    assert control["differ"], "control: the last fine hash alone should miss the wide blocks"


@pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")
def test_the_map_key_joins_the_fine_hashes_only_on_concat_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    # Full 8 over hash blocks of 4: the 8-token block spans two fine hashes.
    import invariants.targets.vllm_target as vt
    from invariants.targets.vllm_capabilities import detect

    cfg = Config((GroupSpec("full", 8), GroupSpec("swa", 4, 4)), 16, hash_block_size=4)
    tokens = (1, 2, 3, 4, 5, 6, 7, 8)
    for coarse in ("concat", "last"):
        monkeypatch.setattr(vt, "detect", lambda c=coarse: dataclasses.replace(detect(), coarse_hash=c))
        t = vt.VllmManagerTarget(cfg)
        t.apply(AddRequest("r", tokens))
        first, second = (bytes(h) for h in t.requests["r"].block_hashes[:2])
        wide, fine = block_key(0, tokens, 8), block_key(1, tokens, 8)
        joined = first + second if coarse == "concat" else second  # control: "last" never joins
        assert t.keys.map_key(wide) == joined + (0).to_bytes(4, "big")
        assert t.keys.map_key(fine) == second + (1).to_bytes(4, "big")  # a hash-block-wide group: one hash
        assert t.keys.key(joined + (0).to_bytes(4, "big")) == wide  # the inverse of the snapshot's naming


@pytest.mark.skipif(not _OK, reason=f"vllm target: {_REASON}")
def test_a_scheduler_block_off_the_lcm_is_refused_where_the_release_takes_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 0.21.0 and 0.22.0 take no scheduler_block_size: they align to the lcm of the
    # group block sizes, so another value would be silently dropped.
    import invariants.targets.vllm_target as vt
    from invariants.targets.vllm_capabilities import detect

    caps = detect()
    older = dataclasses.replace(caps, manager_args=caps.manager_args - {"scheduler_block_size"})
    monkeypatch.setattr(vt, "detect", lambda: older)
    groups = (GroupSpec("full", 4), GroupSpec("swa", 4, 4))
    with pytest.raises(vt.UnsupportedConfig, match="scheduler_block_size"):
        vt.VllmManagerTarget(Config(groups, 16, scheduler_block_size=8))
    # control: the lcm (4) passes the guard (0.33.0's constructor then wants the argument it was not given)
    with pytest.raises(ConfigError, match="rejects the configuration") as refused:
        vt.VllmManagerTarget(Config(groups, 16))
    assert not isinstance(refused.value, vt.UnsupportedConfig)
    monkeypatch.setattr(vt, "detect", lambda: caps)
    vt.VllmManagerTarget(Config(groups, 16, scheduler_block_size=8))  # control: a release that takes it
