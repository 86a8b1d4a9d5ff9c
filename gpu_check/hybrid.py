"""A small hybrid model whose KV and states live in paged storage.

Layers (for the default config: full, swa, mamba, full, swa, mamba): each
layer belongs to one KV-cache group of the allocator `Config` and reads and
writes its cache through that group's block table, exactly as an engine would:

- full attention: writes K/V of the new tokens at (table[pos // bs], pos % bs)
  and reads every block from 0 to the query's own.
- sliding window (w): same writes; a query at p reads only the blocks holding
  positions p-w+1..p (blocks before the window may be null and are never read).
- Mamba-like (a diagonal linear recurrence s_t = a_t * s_{t-1} + (1 - a_t) * u_t):
  a chunk [start, end) reads its initial state from the group's table at index
  ceil(start/bs) - 1 (zeros when start == 0) and writes the state after `end`
  into index ceil(end/bs) - 1 (vLLM's align-mode layout: the state after the
  chunk ending at token t lives in block ceil(t/bs) - 1). A hit of h tokens
  therefore resumes from the snapshot in block h/bs - 1.

Storage emulates vLLM's hybrid page sharing: there is one page buffer per
"layer slot", and the i-th layer of every group views the same buffer, so
block id b names the same memory in every group. A block handed to two groups
at once, or reused while still in use, corrupts what the other reads.

Every write to, or required read from, a null (0) or missing table entry is an
`EngineFault` naming the request, position, layer and group: a correct
allocator never makes the engine do that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gpu_check.kernels import AttnBatch, InvariantKernels, Kernels
from model.contract.config import Config, GroupSpec


class EngineFault(RuntimeError):
    """The allocator's tables made the engine write to or read from an invalid block."""


@dataclass(frozen=True)
class ModelDims:
    """Tiny on purpose: the check is about bits, not quality."""

    vocab: int = 64
    d_model: int = 32
    n_heads: int = 2
    layers_per_group: int = 2
    max_len: int = 4096
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class Layer:
    index: int
    kind: str  # "full" | "swa" | "mamba"
    group: int
    slot: int  # which page buffer it views (its rank inside its group)

    @property
    def label(self) -> str:
        return f"L{self.index}:{self.kind}(g{self.group})"


@dataclass
class SeqChunk:
    """One scheduled request in a step: compute tokens[start:end] with these tables."""

    rid: str
    tokens: Sequence[int]
    start: int
    end: int
    tables: tuple[tuple[int, ...], ...]
    sample: bool


@dataclass
class StepResult:
    """Per token (chunk order, then position): the residual stream after each layer."""

    layer_out: Tensor  # (T, L, d)
    next_tokens: dict[str, int]
    written_blocks: set[int] = field(default_factory=set)


class PagedStorage:
    """One (num_blocks, page_floats) buffer per layer slot, all NaN at start."""

    def __init__(self, num_blocks: int, n_slots: int, page_floats: int, dtype: torch.dtype, device: str):
        self.num_blocks = num_blocks
        self.pages = [
            torch.full((num_blocks, page_floats), float("nan"), dtype=dtype, device=device)
            for _ in range(n_slots)
        ]

    def poison(self, block_ids: Sequence[int]) -> None:
        """Fill every slot's page of these blocks with NaN (a later read of them shows)."""
        if not block_ids:
            return
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.pages[0].device)
        for p in self.pages:
            p[idx] = float("nan")

    def kv_view(self, slot: int, bs: int, heads: int, dh: int) -> tuple[Tensor, Tensor]:
        n = 2 * bs * heads * dh
        buf = self.pages[slot][:, :n].view(self.num_blocks, 2, bs, heads, dh)
        return buf[:, 0], buf[:, 1]

    def state_view(self, slot: int, dim: int) -> Tensor:
        return self.pages[slot][:, :dim]


class HybridModel:
    """Random seeded weights; `forward(chunks, storage)` runs one engine step."""

    def __init__(
        self,
        config: Config,
        dims: ModelDims = ModelDims(),
        seed: int = 0,
        device: str = "cpu",
        kernels: Kernels | None = None,
    ) -> None:
        if dims.d_model % dims.n_heads:
            raise ValueError("d_model must be a multiple of n_heads")
        self.config = config
        self.dims = dims
        self.device = device
        self.kernels: Kernels = kernels if kernels is not None else InvariantKernels()
        self.groups: tuple[GroupSpec, ...] = config.groups
        self.layers: list[Layer] = []
        for slot in range(dims.layers_per_group):
            for g, spec in enumerate(self.groups):
                self.layers.append(Layer(len(self.layers), spec.kind, g, slot))
        d, dt = dims.d_model, dims.dtype
        self.dh = d // dims.n_heads
        gen = torch.Generator().manual_seed(seed)

        def rnd(*shape: int, scale: float = 1.0) -> Tensor:
            return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dt).to(device)

        self.embed = rnd(dims.vocab, d)
        pos = torch.arange(dims.max_len, dtype=torch.float64).unsqueeze(1)
        freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float64) / d)
        pe = torch.zeros(dims.max_len, d, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(pos * freq)
        pe[:, 1::2] = torch.cos(pos * freq)
        self.pos_table = (0.5 * pe).to(dt).to(device)  # computed once: a lookup, not a kernel
        self.params: list[dict[str, Tensor]] = []
        for layer in self.layers:
            p = {"norm": (1.0 + 0.1 * rnd(d))}
            if layer.kind == "mamba":
                p["w_in"] = rnd(d, 3 * d, scale=d**-0.5)
                p["a_bias"] = rnd(d, scale=0.5) + 2.0  # decays around sigmoid(2) ~ 0.88
                p["w_out"] = rnd(d, d, scale=d**-0.5)
            else:
                p["w_qkv"] = rnd(d, 3 * d, scale=d**-0.5)
                p["w_o"] = rnd(d, d, scale=d**-0.5)
            self.params.append(p)
        self.final_norm = 1.0 + 0.1 * rnd(d)
        self.w_lm = rnd(d, dims.vocab, scale=d**-0.5)

    # ------------------------------------------------------------- storage
    def page_floats(self) -> int:
        need = [self.dims.d_model]
        for spec in self.groups:
            if spec.kind != "mamba":
                need.append(2 * spec.block_size * self.dims.d_model)
        return max(need)

    def new_storage(self, num_blocks: int) -> PagedStorage:
        return PagedStorage(
            num_blocks, self.dims.layers_per_group, self.page_floats(), self.dims.dtype, self.device
        )

    # ------------------------------------------------------------- forward
    def forward(self, chunks: Sequence[SeqChunk], storage: PagedStorage) -> StepResult:
        """Compute every chunk's tokens; return per-layer outputs and greedy next tokens.

        Attention layers write all new K/V of the step before any query reads
        (as vLLM's per-layer cache write precedes attention). Mamba layers run
        the chunks in order, so a state written by an earlier chunk of the
        step is visible to a later one: each `Schedule` op is its own allocator
        step, so the engine must behave as if the chunks ran in that order.
        """
        K = self.kernels
        dev = self.device
        toks: list[int] = []
        poss: list[int] = []
        seq: list[int] = []
        for i, c in enumerate(chunks):
            if not 0 <= c.start < c.end <= len(c.tokens):
                raise ValueError(f"chunk {c.rid}: bad range [{c.start}, {c.end}) for {len(c.tokens)} tokens")
            toks.extend(c.tokens[c.start : c.end])
            poss.extend(range(c.start, c.end))
            seq.extend([i] * (c.end - c.start))
        tok_t = torch.tensor(toks, dtype=torch.long, device=dev)
        pos_t = torch.tensor(poss, dtype=torch.long, device=dev)
        seq_t = torch.tensor(seq, dtype=torch.long, device=dev)
        h = self.embed[tok_t] + self.pos_table[pos_t]
        outs: list[Tensor] = []
        written: set[int] = set()
        tables = self._tables(chunks)
        for layer, p in zip(self.layers, self.params, strict=True):
            if layer.kind == "mamba":
                h = h + self._mamba(layer, p, h, chunks, storage, written)
            else:
                h = h + self._attention(
                    layer, p, h, pos_t, seq_t, tables[layer.group], chunks, storage, written
                )
            outs.append(h)
        next_tokens: dict[str, int] = {}
        last_rows = []
        sampled = []
        offset = 0
        for c in chunks:
            offset += c.end - c.start
            if c.sample:
                last_rows.append(offset - 1)
                sampled.append(c.rid)
        if last_rows:
            x = K.rmsnorm(h[torch.tensor(last_rows, device=dev)], self.final_norm)
            logits = K.linear(x, self.w_lm)
            for rid, tok in zip(sampled, logits.argmax(dim=-1).tolist(), strict=True):
                next_tokens[rid] = int(tok)
        return StepResult(torch.stack(outs, dim=1), next_tokens, written)

    def _tables(self, chunks: Sequence[SeqChunk]) -> list[Tensor]:
        out = []
        for g in range(len(self.groups)):
            width = max(1, max(len(c.tables[g]) for c in chunks))
            t = torch.zeros(len(chunks), width, dtype=torch.long)
            for i, c in enumerate(chunks):
                if c.tables[g]:
                    t[i, : len(c.tables[g])] = torch.tensor(c.tables[g], dtype=torch.long)
            out.append(t.to(self.device))
        return out

    def _attention(
        self,
        layer: Layer,
        p: dict[str, Tensor],
        h: Tensor,
        pos: Tensor,
        seq: Tensor,
        table: Tensor,
        chunks: Sequence[SeqChunk],
        storage: PagedStorage,
        written: set[int],
    ) -> Tensor:
        K = self.kernels
        spec = self.groups[layer.group]
        bs, H, dh = spec.block_size, self.dims.n_heads, self.dh
        T = h.shape[0]
        qkv = K.linear(K.rmsnorm(h, p["norm"]), p["w_qkv"])
        q, k, v = (x.reshape(T, H, dh) for x in qkv.split(self.dims.d_model, dim=1))
        k_cache, v_cache = storage.kv_view(layer.slot, bs, H, dh)
        bidx = pos // bs
        if int(bidx.max().item()) >= table.shape[1]:
            self._fault_missing(layer, chunks, table, bs)
        blk = table[seq, bidx]
        if bool((blk == 0).any()):
            t = int((blk == 0).nonzero()[0, 0].item())
            c = chunks[int(seq[t].item())]
            raise EngineFault(
                f"write to the null block: request {c.rid} position {int(pos[t].item())} "
                f"layer {layer.label} table {list(c.tables[layer.group])}"
            )
        off = pos % bs
        k_cache[blk, off] = k
        v_cache[blk, off] = v
        written.update(blk.unique().tolist())
        self._check_reads(layer, pos, seq, table, chunks, spec)
        meta = AttnBatch(pos, seq, table, spec.sliding_window if spec.kind == "swa" else None, bs)
        attn = K.attention(q, k_cache, v_cache, meta)
        return K.linear(attn.reshape(T, self.dims.d_model), p["w_o"])

    def _fault_missing(self, layer: Layer, chunks: Sequence[SeqChunk], table: Tensor, bs: int) -> None:
        for c in chunks:
            need = math.ceil(c.end / bs)
            if len(c.tables[layer.group]) < need:
                raise EngineFault(
                    f"table too short: request {c.rid} computing [{c.start}, {c.end}) needs {need} blocks "
                    f"in group {layer.group}, table {list(c.tables[layer.group])}"
                )

    def _check_reads(
        self,
        layer: Layer,
        pos: Tensor,
        seq: Tensor,
        table: Tensor,
        chunks: Sequence[SeqChunk],
        spec: GroupSpec,
    ) -> None:
        """Every block a query must read (its window) is non-null: else a named fault."""
        bs = spec.block_size
        for c in chunks:
            lo = c.start - spec.sliding_window + 1 if spec.kind == "swa" and spec.sliding_window else 0
            first = max(0, lo) // bs
            row = c.tables[layer.group]
            for b in range(first, (c.end - 1) // bs + 1):
                if b >= len(row) or row[b] == 0:
                    raise EngineFault(
                        f"read of a null block: request {c.rid} chunk [{c.start}, {c.end}) needs "
                        f"block index {b} in {layer.label}, table {list(row)}"
                    )

    def _mamba(
        self,
        layer: Layer,
        p: dict[str, Tensor],
        h: Tensor,
        chunks: Sequence[SeqChunk],
        storage: PagedStorage,
        written: set[int],
    ) -> Tensor:
        K = self.kernels
        d = self.dims.d_model
        bs = self.groups[layer.group].block_size
        z = K.linear(K.rmsnorm(h, p["norm"]), p["w_in"])
        a = K.sigmoid(z[:, :d] + p["a_bias"])
        b = (1.0 - a) * z[:, d : 2 * d]
        g = z[:, 2 * d :]
        gate = g * K.sigmoid(g)
        states = storage.state_view(layer.slot, d)
        ys = torch.empty_like(b)
        row = 0
        for c in chunks:
            tab = c.tables[layer.group]
            if c.start == 0:
                s = torch.zeros(d, dtype=h.dtype, device=h.device)
            else:
                ri = math.ceil(c.start / bs) - 1
                if ri >= len(tab) or tab[ri] == 0:
                    raise EngineFault(
                        f"Mamba state missing: request {c.rid} resumes at token {c.start} from table "
                        f"index {ri} of {layer.label}, table {list(tab)}"
                    )
                s = states[tab[ri]].clone()
            for t in range(row, row + c.end - c.start):
                s = a[t] * s + b[t]  # sequential in time: the recurrence has one order
                ys[t] = s
            row += c.end - c.start
            wi = math.ceil(c.end / bs) - 1
            if wi >= len(tab) or tab[wi] == 0:
                raise EngineFault(
                    f"Mamba state slot missing: request {c.rid} chunk ends at {c.end}, table index {wi} "
                    f"of {layer.label}, table {list(tab)}"
                )
            states[tab[wi]] = s
            written.add(tab[wi])
        return K.linear(ys * gate, p["w_out"])
