"""Request: the token sequence an allocator serves, with its chained hashes.

Invariants:
- `all_token_ids == prompt_token_ids + output_token_ids`;
- `block_hashes` has one entry per full hash-block-size chunk of
  `all_token_ids` (never for a partial chunk) and is extended as output tokens
  arrive (`append_output_token_ids`), as vLLM's request block hasher does;
- `num_computed_tokens <= num_tokens`;
- `shared_prefix_boundary` is what `get_computed_blocks` reported at the
  latest admission (0 = none); retention keeps the state at that junction.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence

from .hashing import BlockHash, hash_block_tokens


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


# Called with (request, first new hash index) each time hashes are appended.
BlockHashListener = Callable[["Request", int], None]


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        hash_block_size: int,
        on_new_block_hashes: BlockHashListener | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.hash_block_size = hash_block_size
        self.block_hashes: list[BlockHash] = []
        self.num_computed_tokens = 0
        self.shared_prefix_boundary = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self._on_new_block_hashes = on_new_block_hashes
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        new = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self.output_token_ids.extend(new)
        self.all_token_ids.extend(new)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        hbs = self.hash_block_size
        first_new = len(self.block_hashes)
        start = first_new * hbs
        parent = self.block_hashes[-1] if self.block_hashes else None
        while start + hbs <= len(self.all_token_ids):
            parent = hash_block_tokens(parent, self.all_token_ids[start : start + hbs])
            self.block_hashes.append(parent)
            start += hbs
        if self._on_new_block_hashes is not None and len(self.block_hashes) > first_new:
            self._on_new_block_hashes(self, first_new)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, prompt={self.num_prompt_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
