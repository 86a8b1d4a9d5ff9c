"""Plain-text tables and progress lines for long-running commands."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([line, rule, *body])


class Progress:
    """Periodic progress lines on stderr (at most one every `every` seconds)."""

    def __init__(self, label: str, every: float = 2.0, enabled: bool = True) -> None:
        self.label, self.every, self.enabled = label, every, enabled
        self.start = self.last = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def tick(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if self.enabled and (force or now - self.last >= self.every):
            self.last = now
            print(f"[{self.label} {self.elapsed():6.1f}s] {text}", file=sys.stderr, flush=True)
