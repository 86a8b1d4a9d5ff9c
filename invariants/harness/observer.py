"""The judge's side of the model's `Observer` (`model.machine.seams`): what the spec no longer keeps.

`ModelObserver` counts the rules only some traces reach (`coverage`: the fuzz
summary's "features exercised" and the conformance rows that need a rule reached),
logs the scheduler decisions of the operations applied inside `recording()` (the
exporter's seam), and holds the judge's choice where the contract leaves one open
(`choose_end_order`: the order the target ended a "fail" report's requests in, taken
by the model's next such report and then forgotten).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from model.machine.seams import Decision


class ModelObserver:
    """Watches one `AllocatorModel` (pass it as `AllocatorModel(..., observer=)`)."""

    def __init__(self) -> None:
        self.coverage: Counter[str] = Counter()  # rule -> how often it fired
        self._log: list[Decision] | None = None  # `recording`
        self._chosen_order: tuple[str, ...] = ()

    def fired(self, rule: str) -> None:
        self.coverage[rule] += 1

    def decided(self, decision: Decision) -> None:
        if self._log is not None:
            self._log.append(decision)

    def order_to_end(self, rids: tuple[str, ...]) -> tuple[str, ...]:
        chosen, self._chosen_order = self._chosen_order, ()
        return chosen

    def choose_end_order(self, order: Iterable[str]) -> None:
        """The order the model's next "fail" report ends its requests in, if it names
        exactly them (`model.machine.connector.end_all`); () leaves the model's own (id order)."""
        self._chosen_order = tuple(order)

    @contextmanager
    def recording(self) -> Iterator[list[Decision]]:
        """The scheduler decisions of the operations applied inside the block: each
        allocation attempt and each preemption, in the order they happen. A step's
        result alone cannot tell during whose allocation a request was preempted, nor
        the chunk of an admission that did not fit (the exporter reads them here)."""
        outer, self._log = self._log, []
        try:
            yield self._log
        finally:
            self._log = outer
