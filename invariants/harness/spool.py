"""Operations spooled to disk: a long run keeps the trace replay needs without holding it.

A production episode can run thousands of operations carrying prompts of up to
1M tokens; keeping them in memory makes memory grow with the run. `OpSpool`
appends each operation (the trace format's `op_to_json` form, marshalled: a
1M-token prompt costs milliseconds, not the JSON encoder's tenths of a second)
to an anonymous temporary file and reads them back, in order, only when a
violation needs its replayable trace. `clear()` starts the next episode.
"""

from __future__ import annotations

import marshal
import tempfile
from collections.abc import Iterable

from model.ops import Op, op_from_json, op_to_json


class OpSpool:
    def __init__(self) -> None:
        # Owned for the spool's lifetime (closed by `close`), so no context manager.
        self._file = tempfile.TemporaryFile()  # noqa: SIM115
        self.count = 0

    def extend(self, ops: Iterable[Op]) -> None:
        for op in ops:
            marshal.dump(op_to_json(op), self._file)
            self.count += 1

    def ops(self) -> list[Op]:
        """Every operation since the last `clear`, in order."""
        self._file.flush()
        self._file.seek(0)
        out = [op_from_json(marshal.load(self._file)) for _ in range(self.count)]
        self._file.seek(0, 2)
        return out

    def clear(self) -> None:
        self._file.seek(0)
        self._file.truncate()
        self.count = 0

    def close(self) -> None:
        self._file.close()
