"""The shape of one radix-cache instance: which components, page size, window, pool sizes.

A `RadixLayout` is data that both the model and the SGLang target read; the
target turns it into SGLang's real pools and cache (`invariants/targets/
sglang_build.py`). Sizes are in tokens (KV pools) and slots (Mamba pool).
"""

from __future__ import annotations

from dataclasses import dataclass

COMPONENTS = ("full", "swa", "mamba")


@dataclass(frozen=True)
class RadixLayout:
    """One cache instance.

    Invariants (checked by `validate`): `full` is always a component; SWA needs
    a window >= 1; page_size >= 1; every pool holds at least one page.
    """

    components: tuple[str, ...] = ("full",)
    page_size: int = 1
    sliding_window: int | None = None
    kv_size: int = 256
    swa_size: int | None = None  # SWA pool tokens (None: as large as the full pool)
    mamba_size: int = 16
    max_reqs: int = 8
    max_context: int = 512

    @property
    def swa_pool_size(self) -> int:
        return self.kv_size if self.swa_size is None else self.swa_size

    @property
    def has_swa(self) -> bool:
        return "swa" in self.components

    @property
    def has_mamba(self) -> bool:
        return "mamba" in self.components

    @property
    def name(self) -> str:
        parts = ["+".join(self.components), f"p{self.page_size}"]
        if self.sliding_window is not None:
            parts.append(f"w{self.sliding_window}")
        return "-".join(parts)

    def validate(self) -> None:
        """Raise ValueError naming the field and the rule it breaks."""
        if "full" not in self.components:
            raise ValueError(f"components: 'full' is required, got {self.components}")
        unknown = set(self.components) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"components: unknown {sorted(unknown)}; known: {COMPONENTS}")
        if self.page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {self.page_size}")
        if self.has_swa and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError("sliding_window: an SWA layout needs a window >= 1")
        if self.kv_size < self.page_size:
            raise ValueError(f"kv_size: must hold a page ({self.page_size}), got {self.kv_size}")
        if self.has_swa and self.swa_pool_size < self.page_size:
            raise ValueError(f"swa_size: must hold a page ({self.page_size}), got {self.swa_pool_size}")


# The layouts a fuzz run covers: every component combination SGLang 0.5.23's
# UnifiedRadixCache serves on this path, with page 1 and page > 1; pools small
# enough that allocation evicts and sometimes fails. A Mamba pool holds two
# states per running request (a chunk checkpoint forks the request's state),
# as SGLang's scheduler reserves.
LAYOUTS: dict[str, RadixLayout] = {
    "full-p1": RadixLayout(("full",), 1, kv_size=96),
    "full-p4": RadixLayout(("full",), 4, kv_size=128),
    "swa-p1": RadixLayout(("full", "swa"), 1, sliding_window=8, kv_size=96),
    "swa-p4": RadixLayout(("full", "swa"), 4, sliding_window=8, kv_size=128),
    # SWA pool smaller than the full pool, as deployments size it: SWA pressure of its own.
    "swa-small-p1": RadixLayout(("full", "swa"), 1, sliding_window=8, kv_size=128, swa_size=48),
    "mamba-p1": RadixLayout(("full", "mamba"), 1, kv_size=96, mamba_size=18),
    # A page wider than the window (SGLang #29860: all-tombstone leaves).
    "swa-p4-w2": RadixLayout(("full", "swa"), 4, sliding_window=2, kv_size=128),
    # All three components in one tree.
    "swa-mamba-p1": RadixLayout(("full", "swa", "mamba"), 1, sliding_window=8, kv_size=96, mamba_size=18),
}
