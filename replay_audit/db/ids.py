"""Public ids: a short type prefix and a ULID (48-bit millisecond time + 80 random bits, in
Crockford base32). They sort by creation time as plain strings, which is what cursor pagination
orders by, and reveal nothing but the time. Database primary keys stay integers and never leave
the service.
"""

from __future__ import annotations

import os
import re
import time
from typing import Final

from replay_audit.exceptions import FieldError

_CROCKFORD: Final = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
ULID_LENGTH: Final = 26


def new_ulid(timestamp_ms: int | None = None) -> str:
    """A 26-character ULID; `timestamp_ms` defaults to now."""
    ms = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    value = (ms << 80) | int.from_bytes(os.urandom(10), "big")
    chars = []
    for _ in range(ULID_LENGTH):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def new_public_id(prefix: str, timestamp_ms: int | None = None) -> str:
    """`prefix` + "_" + a ULID, e.g. `tr_01J9Z3...`: time-ordered, unguessable."""
    return f"{prefix}_{new_ulid(timestamp_ms)}"


def ulid_timestamp_ms(ulid: str) -> int:
    """The millisecond timestamp encoded in a ULID (or a prefixed public id)."""
    body = ulid.rsplit("_", 1)[-1][:10]
    value = 0
    for ch in body:
        value = value * 32 + _CROCKFORD.index(ch)
    return value


def cursor_pattern(kind: str) -> str:
    """The pattern of a page cursor of `kind` (stated in the OpenAPI document): the kind and a
    row id of at most 18 digits (within a BIGINT)."""
    return rf"^{kind}[0-9]{{1,18}}$"


def encode_cursor(kind: str, row_id: int) -> str:
    """A page cursor: `kind` and the last row's id, e.g. `run42`."""
    return f"{kind}{row_id}"


def decode_cursor(kind: str, cursor: str) -> int:
    """The row id of a cursor `encode_cursor(kind, ...)` made; `FieldError` on `cursor` else."""
    if not re.fullmatch(cursor_pattern(kind), cursor):
        raise FieldError("malformed cursor", field="cursor")
    return int(cursor[len(kind) :])
