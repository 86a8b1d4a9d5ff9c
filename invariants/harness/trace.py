"""Replayable traces: a versioned JSON file holding a config, a seed and operations.

Format (version 1):
    {"format": "kvretain-trace", "version": 1,
     "config": {...config_to_json...}, "seed": 123, "target": "reference",
     "ops": [{"op": "add", "rid": "r0", "prompt": [1, 2]}, ...],
     "violation": "one-line description" | null}

Reading a file validates every field and raises TraceError naming what is
wrong; `kvretain replay` turns that into one line and exit code 2.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from model.contract.config import Config, ConfigError, GroupSpec, validate
from model.contract.ops import Op, op_from_json, op_to_json

TRACE_FORMAT = "kvretain-trace"
TRACE_VERSION = 1


class TraceError(ValueError):
    """A malformed trace file; the message names the field."""


@dataclass
class Trace:
    config: Config
    ops: list[Op]
    seed: int | None = None
    target: str | None = None
    violation: str | None = None


def config_to_json(cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if (f.name, value) in (
            ("kv_connector", False),
            ("kv_load_failure_policy", "recompute"),
            ("long_prefill_token_threshold", 0),
            ("max_num_batched_tokens", 0),
            ("max_num_seqs", 0),
            ("reserve_full_isl", False),
            ("watermark", 0.0),
            ("scheduling_policy", "fcfs"),
            ("lookahead_block_hashes", False),
        ):
            continue  # absent = the default (traces from before these fields read the same)
        if f.name == "groups":
            value = [
                {
                    k: v
                    for k, v in vars(g).items()
                    if v is not None and not (k == "mamba_cache_mode" and g.kind != "mamba")
                }
                for g in value
            ]
        out[f.name] = value
    return out


def config_from_json(data: Any) -> Config:
    if not isinstance(data, dict):
        raise ConfigError("config: must be an object")
    known = {f.name for f in fields(Config)}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"config: unknown field(s) {sorted(unknown)}")
    if "groups" not in data or not isinstance(data["groups"], list):
        raise ConfigError("config.groups: must be a list of group objects")
    if "num_blocks" not in data:
        raise ConfigError("config.num_blocks: required")
    groups = []
    for i, g in enumerate(data["groups"]):
        if not isinstance(g, dict):
            raise ConfigError(f"config.groups[{i}]: must be an object")
        allowed = {f.name for f in fields(GroupSpec)}
        if set(g) - allowed:
            raise ConfigError(f"config.groups[{i}]: unknown field(s) {sorted(set(g) - allowed)}")
        if "kind" not in g or "block_size" not in g:
            raise ConfigError(f"config.groups[{i}]: needs 'kind' and 'block_size'")
        groups.append(GroupSpec(**g))
    kwargs = {k: v for k, v in data.items() if k != "groups"}
    for key in (
        "num_blocks",
        "hash_block_size",
        "scheduler_block_size",
        "max_model_len",
        "pin_min_drop_blocks",
        "long_prefill_token_threshold",
        "max_num_batched_tokens",
        "max_num_seqs",
    ):
        if key in kwargs and (not isinstance(kwargs[key], int) or isinstance(kwargs[key], bool)):
            raise ConfigError(f"config.{key}: must be an integer")
    for key in (
        "eagle",
        "enable_caching",
        "pin_swa_on_drop",
        "kv_connector",
        "reserve_full_isl",
        "lookahead_block_hashes",
    ):
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise ConfigError(f"config.{key}: must be true or false")
    return validate(Config(groups=tuple(groups), **kwargs))


def trace_to_json(trace: Trace) -> dict[str, Any]:
    return {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "config": config_to_json(trace.config),
        "seed": trace.seed,
        "target": trace.target,
        "violation": trace.violation,
        "ops": [op_to_json(op) for op in trace.ops],
    }


def trace_from_json(data: Any) -> Trace:
    if not isinstance(data, dict):
        raise TraceError("trace: top level must be a JSON object")
    if data.get("format") != TRACE_FORMAT:
        raise TraceError(f"trace.format: expected {TRACE_FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") != TRACE_VERSION:
        raise TraceError(
            f"trace.version: this kvretain reads version {TRACE_VERSION}, got {data.get('version')!r}"
        )
    try:
        config = config_from_json(data.get("config"))
    except (ConfigError, TypeError) as exc:
        raise TraceError(f"trace.config: {exc}") from None
    raw_ops = data.get("ops")
    if not isinstance(raw_ops, list):
        raise TraceError("trace.ops: must be a list")
    ops = []
    for i, raw in enumerate(raw_ops):
        try:
            ops.append(op_from_json(raw))
        except (ValueError, TypeError) as exc:
            raise TraceError(f"trace.ops[{i}]: {exc}") from None
    seed = data.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TraceError("trace.seed: must be an integer or null")
    return Trace(config, ops, seed, data.get("target"), data.get("violation"))


def read_trace(path: str | Path) -> Trace:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    return trace_from_json(data)


def write_trace(trace: Trace, path: str | Path) -> Path:
    """Write atomically (no partial file is ever left behind)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".trace-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(trace_to_json(trace), fh, indent=1)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
