"""Public ids: a short type prefix and a ULID (48-bit millisecond time + 80 random bits, in
Crockford base32). They sort by creation time as plain strings, which is what cursor pagination
orders by, and reveal nothing but the time. Database primary keys stay integers and never leave
the service.
"""

from __future__ import annotations

import base64
import os
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


def encode_cursor(kind: str, row_id: int) -> str:
    """An opaque page cursor: `kind:row_id`, URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(f"{kind}:{row_id}".encode()).decode().rstrip("=")


def decode_cursor(kind: str, cursor: str) -> int:
    """The row id of a cursor `encode_cursor(kind, ...)` made; `FieldError` on `cursor` else."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        got, _, value = raw.partition(":")
        if got != kind or not value.isdigit():
            raise ValueError
        return int(value)
    except (ValueError, UnicodeDecodeError):
        raise FieldError("malformed cursor", field="cursor") from None
