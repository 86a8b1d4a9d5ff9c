"""Named configurations modeled on the seeds' models, small enough to fuzz.

Each full-size preset keeps the seed model's group layout and block sizes;
its `-tiny` twin scales block sizes and windows down (same ratios where it
matters: window vs block size, LCM alignment) so that a fuzzer reaches
eviction, window slides and retained boundaries in a few dozen tokens.
"""

from __future__ import annotations

from model.config import Config, ConfigError, GroupSpec

PRESETS: dict[str, Config] = {
    # DeepSeek-V4 (#43447, #42258): full/MLA block 256 + SWA block 64, window 128.
    "dsv4-like": Config(
        groups=(GroupSpec("full", 256), GroupSpec("swa", 64, sliding_window=128)),
        num_blocks=96,
        retention_interval=0,
        name="dsv4-like",
    ),
    "dsv4-tiny": Config(
        groups=(GroupSpec("full", 16), GroupSpec("swa", 4, sliding_window=8)),
        num_blocks=40,
        retention_interval=0,
        name="dsv4-tiny",
    ),
    # Gemma-3/4 (#40676): block 16, SWA window 1024 + full attention.
    "gemma-like": Config(
        groups=(GroupSpec("full", 16), GroupSpec("swa", 16, sliding_window=1024)),
        num_blocks=512,
        retention_interval=0,
        name="gemma-like",
    ),
    "gemma-tiny": Config(
        groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=10)),
        num_blocks=32,
        retention_interval=0,
        name="gemma-tiny",
    ),
    # Kimi-Linear (#45845): Mamba/linear attention + full attention.
    "kimi-linear-like": Config(
        groups=(GroupSpec("full", 64), GroupSpec("mamba", 64)),
        num_blocks=128,
        retention_interval=0,
        name="kimi-linear-like",
    ),
    "kimi-linear-tiny": Config(
        groups=(GroupSpec("full", 4), GroupSpec("mamba", 4)),
        num_blocks=24,
        retention_interval=0,
        name="kimi-linear-tiny",
    ),
}


def preset(name: str) -> Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"--config: unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})") from None
