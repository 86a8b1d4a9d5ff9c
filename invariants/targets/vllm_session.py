"""The live vLLM objects one `VllmManagerTarget` drives, shared by the adapter's parts.

Building (`vllm_build`), naming hashes (`vllm_names`), emulating the scheduler
(`vllm_schedule`), applying operations (`vllm_drive`) and reading snapshots and
events (`vllm_snapshot`) each read the manager, its block pool, the request
objects and vLLM's classes from one `VllmSession`, at the moment they use them:
an object replaced here (a benchmark's timing wrapper, a test's changed
capabilities) is what every part sees next.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from model.contract.config import Config

from .vllm_capabilities import Capabilities


@dataclass
class VllmSession:
    """One target's vLLM: its configuration, the installed release's modules
    (`vllm_env.vllm_modules`) and capabilities, the `KVCacheManager` and its
    `BlockPool`, and the live requests by id."""

    config: Config
    v: dict[str, Any]
    caps: Capabilities
    version: str
    manager: Any
    pool: Any
    requests: dict[str, Any] = field(default_factory=dict)

    @property
    def hbs(self) -> int:
        """The hash block size (vLLM hashes a request in blocks of this many tokens)."""
        return self.config.hash_block_size

    @property
    def hash_lookahead(self) -> int:
        """Tokens past each block its hash covers, as vLLM built the block pool
        (`BlockPool.num_hash_lookahead_tokens`, 0.33.0; 0 for a release without it)."""
        return int(getattr(self.pool, "num_hash_lookahead_tokens", 0))

    def block_hasher(self) -> Any:
        """vLLM's request hasher as `EngineCore` builds it (`get_request_block_hasher` with the
        pool's `num_hash_lookahead_tokens`; sha256, the hash kvretain builds vLLM with)."""
        v, lookahead = self.v, self.hash_lookahead
        if lookahead:
            return v["get_request_block_hasher"](self.hbs, v["sha256"], lookahead)
        return v["get_request_block_hasher"](self.hbs, v["sha256"])
