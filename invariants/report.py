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


SUMMARY_WIDTH = 120  # the widest line a summary prints (a terminal's width)


def wrap(text: str, width: int = SUMMARY_WIDTH, indent: str = "    ") -> str:
    """Each line of `text` at most `width` characters: a longer one is wrapped at spaces,
    its continuation lines under `indent` (a word longer than the width, a path, stays whole)."""
    import textwrap

    out: list[str] = []
    for line in text.splitlines() or [""]:
        if len(line) <= width:
            out.append(line)
            continue
        lead = line[: len(line) - len(line.lstrip())]
        out += textwrap.wrap(
            line, width=width, subsequent_indent=lead + indent, break_on_hyphens=False, break_long_words=False
        )
    return "\n".join(out)


def fitted_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], *, width: int = SUMMARY_WIDTH, key: int = 0
) -> str:
    """`table`, at most `width` characters a line: the widest columns are capped to fit,
    a longer cell clipped and marked `[n]`, and printed in full (wrapped) on numbered
    lines below the table, named by the row's column `key`."""
    cells = [[str(c) for c in row] for row in rows]
    caps = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    floor = [max(12, len(h)) for h in headers]
    while sum(caps) + 2 * (len(caps) - 1) > width:
        j = max(
            (j for j in range(len(caps)) if j != key and caps[j] > floor[j]),
            key=lambda j: caps[j],
            default=None,
        )
        if j is None:
            break
        caps[j] -= 1
    notes: list[str] = []
    for r in cells:
        full = list(r)
        for j, cap in enumerate(caps):
            if len(r[j]) > cap:
                notes.append(f"[{len(notes) + 1}] {full[key]}: {full[j]}")
                tag = f"... [{len(notes)}]"
                r[j] = r[j][: max(1, cap - len(tag))].rstrip() + tag
    return table(headers, cells) + "".join("\n" + wrap(n, width) for n in notes)
