"""Named configurations: real model layouts (full size) and small twins to fuzz.

The full-size presets `dsv4-flash`, `gemma-like` and `kimi-linear-like` are the
KV-cache groups vLLM 0.33.0's own grouping code produces for each model:
`invariants/layouts/derive.py` builds the per-layer specs the way the model's layers
build them and runs vLLM's grouping on them, and `tests/test_presets.py`
checks that the groups hard-coded here are exactly what it derives
(docs/presets.md has the tables and sources). Group order is vLLM's group
order. `dsv4-like` is the seeds' two-group view of DeepSeek-V4 (vLLM's main
MLA and SWA groups only, checked against the same derivation); the simulator's
small-scale pools are tuned to it, so it stays as it was.

Each `-tiny` twin keeps only the two group kinds that matter to retention,
with block sizes and windows scaled down (same ratios where it matters:
window vs block size, LCM alignment), so that a fuzzer reaches eviction,
window slides and retained boundaries in a few dozen tokens. The tiny twins
are unchanged since the first presets (other tests rely on their behaviour).

Pool sizing: vLLM reports its KV capacity as "Maximum concurrency for N
tokens per request: Xx", X = num_blocks / (blocks one request needs at
max_model_len) (`kv_cache_utils.get_max_concurrency_for_kv_cache_config`).
`per_request_blocks(cfg, max_len)` computes that divisor for a kvretain
Config, and `pool_blocks(cfg, x, max_len)` the pool that gives concurrency x.

num_blocks of a full-size preset is a pool for fuzzing, not for 1M-token
runs (the simulator sizes its own pools): twice the per-request cost of a
request of 6 scheduler blocks with the fuzzer's largest chunk (4 scheduler
blocks) in flight, `fuzz_pool_blocks(cfg)` (dsv4-like keeps its old 96).
"""

from __future__ import annotations

import math

from model.contract.config import Config, ConfigError, GroupSpec

# vLLM 0.33.0 defaults behind its capacity figure: max_num_batched_tokens for
# the OpenAI server on an H100/H200-class GPU (engine/arg_utils.py,
# `default_max_num_batched_tokens`, >= 70 GiB), and two batches in flight
# (`VllmConfig.max_concurrent_batches`: async scheduling with the V2 model
# runner, pipeline parallel 1).
VLLM_MAX_NUM_BATCHED_TOKENS = 8192
VLLM_CONCURRENT_BATCHES = 2
# MambaSpec.max_memory_usage_bytes in align mode: 2 state blocks per request
# (+ speculative and prefill-checkpoint blocks, none here).
MAMBA_ALIGN_BLOCKS = 2


def per_request_blocks(
    config: Config,
    max_len: int,
    max_num_batched_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS,
    concurrent_batches: int = VLLM_CONCURRENT_BATCHES,
) -> int:
    """Blocks one request holds at `max_len` tokens, the way vLLM sizes its capacity.

    vLLM 0.33.0 (`get_max_concurrency_for_kv_cache_config`) sums over groups
    `cdiv(spec.max_memory_usage_bytes, spec.page_size_bytes)`:
    - full attention (`FullAttentionSpec`): cdiv(max_len, block);
    - sliding window (`SlidingWindowSpec.max_admission_blocks_per_request`):
      cdiv(min(window - 1 + in_flight, max_len), block) + 1, in_flight =
      concurrent_batches * max_num_batched_tokens (`max_in_flight_tokens`:
      out-of-window blocks are freed only once a step settles), +1 because the
      window need not start on a block boundary;
    - Mamba in align mode (`MambaSpec`): 2 blocks, whatever the length.
    """
    if max_len < 1:
        raise ConfigError(f"max_len: must be >= 1, got {max_len}")
    if max_num_batched_tokens < 1 or concurrent_batches < 1:
        raise ConfigError("max_num_batched_tokens and concurrent_batches: must be >= 1")
    in_flight = concurrent_batches * max_num_batched_tokens
    total = 0
    for g in config.groups:
        if g.kind == "full":
            total += -(-max_len // g.block_size)
        elif g.kind == "swa":
            assert g.sliding_window is not None
            total += -(-min(g.sliding_window - 1 + in_flight, max_len) // g.block_size) + 1
        else:
            total += MAMBA_ALIGN_BLOCKS
    return total


def pool_blocks(
    config: Config,
    x: float,
    max_len: int,
    max_num_batched_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS,
    concurrent_batches: int = VLLM_CONCURRENT_BATCHES,
) -> int:
    """num_blocks for a pool vLLM would report as "Maximum concurrency ... x"-fold.

    ceil(x * per_request_blocks). Like vLLM's `KVCacheConfig.num_blocks`, the
    count includes block 0 (the null block), so exactly x requests of
    max_len fit only when x * per_request <= num_blocks - 1.
    """
    if x <= 0:
        raise ConfigError(f"x: must be positive, got {x}")
    return math.ceil(x * per_request_blocks(config, max_len, max_num_batched_tokens, concurrent_batches))


def fuzz_pool_blocks(config: Config) -> int:
    """The fuzzing pool of a full-size preset: 2 requests of 6 scheduler blocks, chunk 4 blocks."""
    sbs = config.scheduler_block_size
    return pool_blocks(config, 2, 6 * sbs, max_num_batched_tokens=4 * sbs, concurrent_batches=1)


def _swa(block: int, window: int) -> GroupSpec:
    return GroupSpec("swa", block, sliding_window=window)


PRESETS: dict[str, Config] = {
    # DeepSeek-V4-Flash as vLLM 0.33.0 runs it (#43447, #42258, the vllm-ascend
    # backport). 43 layers, compress_ratios [0, 0] + [4, 128] x 20 + [4]; per-layer
    # specs from models/deepseek_v4/attention.py, compressor.py and
    # v1/attention/backends/mla/sparse_swa.py (fp8_ds_mla cache), grouped by
    # v1/core/kv_cache_planning.py get_kv_cache_groups -> _get_packed_kv_cache_groups
    # (mixed page sizes; BLHNC layout forced by DeepseekV4IndexerBackend):
    #   0, 1: SlidingWindowMLASpec block 64, window 128 (config.sliding_window): the
    #         SWA cache of all 43 layers, split 22 + 21 to fit one packed block;
    #   2:    MLAAttentionSpec block 256 (cache_config.block_size): 41 main
    #         compressed-MLA caches (tokens_per_state 4 / 128) + 21 indexer K caches;
    #   3:    SlidingWindowMLASpec block 4, window 8: ratio-4 compressor states
    #         (main + indexer, 42 layers; window = 2 x ratio, overlapping);
    #   4:    SlidingWindowMLASpec block 8, window 128: ratio-128 compressor states.
    # hash block gcd = 4, scheduler block lcm = 256
    # (kv_cache_utils.resolve_kv_cache_block_sizes). Pool: fuzz_pool_blocks.
    "dsv4-flash": Config(
        groups=(_swa(64, 128), _swa(64, 128), GroupSpec("full", 256), _swa(4, 8), _swa(8, 128)),
        num_blocks=896,
        retention_interval=0,
        name="dsv4-flash",
    ),
    # The seeds' view of DeepSeek-V4 (#42258: "full-attn block 256 and SWA block
    # 64"): the main MLA group + the SWA group of dsv4-flash, without the
    # compressor-state groups (and the SWA cache as one group). Kept as it was
    # because the simulator's small-scale pools (tests/test_simulate.py,
    # invariants/simulate/scenarios.py) are tuned to it: dsv4-flash needs
    # ~2.5x the blocks per request (per_request_blocks). Hash block 64 instead
    # of 4: 16x fewer hashes per token.
    "dsv4-like": Config(
        groups=(GroupSpec("full", 256), _swa(64, 128)),
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
    # Gemma 3 27B (#40676 validated on Gemma 3/4 SWA + full): 62 layers, 5 local
    # : 1 global (sliding_window_pattern 6 -> 52 SWA + 10 full), sliding_window
    # 1024, block 16 (CUDA default; equal head sizes keep SWA on the primary
    # block, model_executor/layers/attention/attention.py). One page size, so
    # get_kv_cache_groups -> _get_kv_cache_groups_uniform_page_size: groups of
    # min(layer count) = 10 layers, 52 SWA layers -> 6 SWA groups (9,9,9,9,8,8)
    # + 1 full group, SWA first (layer 0 is local). hash = scheduler block 16.
    # Context 128k (max_position_embeddings 131072).
    "gemma-like": Config(
        groups=tuple(_swa(16, 1024) for _ in range(6)) + (GroupSpec("full", 16),),
        num_blocks=96,
        retention_interval=0,
        max_model_len=131072,
        name="gemma-like",
    ),
    "gemma-tiny": Config(
        groups=(GroupSpec("full", 4), GroupSpec("swa", 4, sliding_window=10)),
        num_blocks=32,
        retention_interval=0,
        name="gemma-tiny",
    ),
    # Kimi-Linear-48B-A3B-Instruct (#45845): 27 layers, KDA linear attention
    # (MambaSpec) on 20, MLA full attention on 7 (full_attn_layers 4, 8, ..., 24,
    # 27). Block size as Platform._align_hybrid_block_size picks it at TP4
    # (#45845's run): MLA page 1152 B/token, KDA state 542,720 B -> 512 tokens
    # (multiple of 128 for MLA), Mamba block = block size in align mode and its
    # page padded to the attention page. One page size ->
    # _get_kv_cache_groups_uniform_page_size: groups of 7 layers, 20 KDA layers
    # -> 3 Mamba groups (7,7,6) + 1 full group. hash = scheduler block 512, so
    # no fine-grained Mamba hits (the vLLM target supports it). Each retained
    # state snapshot spans 3 blocks, one per Mamba group (#45845: "each
    # snapshot spans several base blocks").
    "kimi-linear-like": Config(
        groups=(
            GroupSpec("mamba", 512),
            GroupSpec("mamba", 512),
            GroupSpec("mamba", 512),
            GroupSpec("full", 512),
        ),
        num_blocks=24,
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

# Which full-size preset each layouts.derive() family reproduces (tests/test_presets.py).
DERIVED_FROM = {"dsv4-flash": "dsv4", "gemma-like": "gemma3", "kimi-linear-like": "kimi-linear"}
# Context length each full-size preset's per-request figure is quoted at (docs/presets.md).
MAX_CONTEXT = {"dsv4-flash": 1 << 20, "dsv4-like": 1 << 20, "gemma-like": 131072, "kimi-linear-like": 1 << 20}


def preset(name: str) -> Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"--config: unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})"
        ) from None
