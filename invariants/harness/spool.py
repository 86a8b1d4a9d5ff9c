"""Operations spooled to disk: a long run keeps the trace replay needs without holding it.

A production episode can run thousands of operations carrying prompts of up to
1M tokens; keeping them in memory makes memory grow with the run. `OpSpool`
appends each operation to an anonymous temporary file (its type and fields,
marshalled, token tuples as packed machine integers: a 1M-token prompt costs
milliseconds) and reads them back, in order, only when a violation needs its
replayable trace. `clear()` starts the next episode.
"""

from __future__ import annotations

import marshal
import tempfile
from array import array
from collections.abc import Iterable
from typing import Any

from model.contract.ops import OP_TYPES, Op

_PACKED = "\0packed"  # marks a field stored as packed integers


class OpSpool:
    def __init__(self) -> None:
        # Owned for the spool's lifetime (closed by `close`), so no context manager.
        self._file = tempfile.TemporaryFile()  # noqa: SIM115
        self.count = 0

    def extend(self, ops: Iterable[Op]) -> None:
        for op in ops:
            fields = {k: _pack(v) for k, v in vars(op).items()}
            marshal.dump((_NAMES[type(op)], fields), self._file)
            self.count += 1

    def ops(self) -> list[Op]:
        """Every operation since the last `clear`, in order."""
        self._file.flush()
        self._file.seek(0)
        out = []
        for _ in range(self.count):
            name, fields = marshal.load(self._file)
            out.append(OP_TYPES[name](**{k: _unpack(v) for k, v in fields.items()}))
        self._file.seek(0, 2)
        return out

    def clear(self) -> None:
        self._file.seek(0)
        self._file.truncate()
        self.count = 0

    def close(self) -> None:
        self._file.close()


# The operation's name in the trace format (`op_to_json`), without converting its fields.
_NAMES = {cls: name for name, cls in OP_TYPES.items()}


def _pack(value: Any) -> Any:
    if isinstance(value, tuple) and value and all(type(v) is int for v in value[:1]):
        try:
            return (_PACKED, array("q", value).tobytes())
        except (TypeError, OverflowError):
            pass
    return value


def _unpack(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == _PACKED:
        return tuple(array("q", value[1]))
    return value
