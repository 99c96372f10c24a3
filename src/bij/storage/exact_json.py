"""JSON read exactly: an integer beyond 64 bits comes back as the integer it is, never a float.

orjson reads JSON fast, but reads an integer above 2**64 - 1 or below -2**63 as a float
(2**70 as 1.1805916207174113e+21); the stdlib reads it exactly. Such an integer has 19 digits
or more, so only a line with a run of 19 digits goes to the stdlib: a long digit run inside a
string costs that line the slower parse, never a wrong one.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

# 19 digits: the shortest integers orjson cannot hold are -9223372036854775809 and 18446744073709551616.
# Found as a run of 19 zeros once every digit is a zero and every other byte a space: two passes in C,
# several times faster than a regular expression.
_DIGITS_AS_ZEROS = bytes(0x30 if 0x30 <= c <= 0x39 else 0x20 for c in range(256))
_LONG_RUN = b"0" * 19

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def may_hold_big_int(data: bytes) -> bool:
    """Whether `data` (one JSON line or several) may hold an integer that orjson reads as a float."""
    return _LONG_RUN in data.translate(_DIGITS_AS_ZEROS)


def loads(line: bytes) -> Any:
    """One JSON value, read fast by orjson, exactly by the stdlib where it may hold an integer beyond 64 bits.

    Raises ValueError (orjson's JSONDecodeError) for a line that is not JSON, as orjson.loads does.
    """
    value = orjson.loads(line)
    if may_hold_big_int(line):
        return json.loads(line)  # orjson took it: the stdlib does too (it accepts a superset)
    return value


def beyond_int64(value: Any, where: str) -> str | None:
    """Where `value` (a parsed JSON value) holds an integer no int64 can hold, as `where.x[0]`, else None."""
    if isinstance(value, int):
        return where if not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX else None
    if isinstance(value, dict):
        for k, v in value.items():
            found = beyond_int64(v, f"{where}.{k}")
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = beyond_int64(v, f"{where}[{i}]")
            if found is not None:
                return found
    return None
