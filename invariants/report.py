"""Tables (plain text or Markdown, from one function) and progress lines for long-running commands."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    markdown: bool = False,
    right: Sequence[int] = (),
) -> str:
    """`rows` under `headers`, each column as wide as its widest cell.

    Plain: columns two spaces apart over a rule of dashes. `markdown`: a
    GitHub table (`| a | b |`). Columns whose index is in `right` are
    right-aligned (numbers), in both forms.
    """
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> list[str]:
        return [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]

    if markdown:
        rule = (
            "|" + "|".join("-" * (w + 1) + (":" if i in right else "-") for i, w in enumerate(widths)) + "|"
        )
        body = ["| " + " | ".join(line(r)) + " |" for r in [list(headers), *cells]]
        return "\n".join([body[0], rule, *body[1:]])
    body = ["  ".join(line(r)) for r in [list(headers), *cells]]
    return "\n".join([body[0], "  ".join("-" * w for w in widths), *body[1:]])


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
