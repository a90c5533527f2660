"""Packed array columns, UTC timestamps and public ids."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta, timezone

import numpy as np
import pytest
from pydantic import BaseModel, ValidationError
from sqlalchemy.dialects import postgresql, sqlite

from replay_audit.db.base import UTCDateTime
from replay_audit.db.ids import new_public_id, new_ulid, ulid_timestamp_ms
from replay_audit.db.types import (
    ModelJSON,
    PackedFloat32Array,
    PackedInt32Array,
    pack_float32,
    pack_int32,
    unpack_float32,
    unpack_int32,
)

SQLITE = sqlite.dialect()


def test_int32_round_trip_is_bit_exact_little_endian() -> None:
    values = [0, 1, 2**31 - 1, -(2**31), 123456789]
    packed = pack_int32(values)
    assert packed == np.array(values, dtype="<i4").tobytes() and len(packed) == 20
    assert packed[:4] == b"\x00\x00\x00\x00" and packed[8:12] == b"\xff\xff\xff\x7f"
    assert unpack_int32(packed).tolist() == values


def test_int32_refuses_values_that_do_not_fit() -> None:
    with pytest.raises(OverflowError):
        pack_int32([2**31])


def test_float32_round_trip_keeps_float32_values() -> None:
    values = [0.1, -2.5, 3.4028234663852886e38, 1e-45]
    unpacked = unpack_float32(pack_float32(values))
    assert unpacked.dtype == np.float32
    assert np.array_equal(unpacked, np.array(values, dtype=np.float32))


def test_column_types_accept_arrays_sequences_and_packed_bytes() -> None:
    column = PackedInt32Array()
    packed = pack_int32([5, 6])
    assert column.process_bind_param(np.array([5, 6]), SQLITE) == packed
    assert column.process_bind_param([5, 6], SQLITE) == packed
    assert column.process_bind_param(packed, SQLITE) is packed
    assert column.process_bind_param(None, SQLITE) is None
    out = column.process_result_value(memoryview(packed), SQLITE)
    assert out is not None and out.tolist() == [5, 6]
    logits = PackedFloat32Array().process_result_value(pack_float32([1.5]), SQLITE)
    assert logits is not None and logits.tolist() == [1.5]


class _Point(BaseModel):
    ear: float
    n: int = 0  # added after the first rows were written


def test_model_json_dumps_validated_json_and_reads_old_rows() -> None:
    column = ModelJSON(list[_Point])
    assert column.process_bind_param([_Point(ear=0.5, n=3)], SQLITE) == [{"ear": 0.5, "n": 3}]
    assert column.process_bind_param([{"ear": 1}], SQLITE) == [{"ear": 1.0, "n": 0}]
    with pytest.raises(ValidationError):
        column.process_bind_param([{"ear": "high"}], SQLITE)  # refused at the write
    assert column.process_result_value([{"ear": 0.9, "gone": 1}], SQLITE) == [_Point(ear=0.9)]
    assert column.process_result_value(None, SQLITE) is None
    assert ModelJSON(_Point).process_bind_param(None, SQLITE) is None


def test_utc_datetime_normalises_and_refuses_naive_values() -> None:
    column = UTCDateTime()
    paris = datetime(2026, 1, 1, 12, 0, tzinfo=timezone(timedelta(hours=1)))
    stored = column.process_bind_param(paris, SQLITE)
    assert stored == datetime(2026, 1, 1, 11, 0)  # naive UTC on SQLite
    back = column.process_result_value(stored, SQLITE)
    assert back == paris and back is not None and back.tzinfo is UTC
    assert column.process_bind_param(paris, postgresql.dialect()) == paris
    with pytest.raises(ValueError, match="naive"):
        column.process_bind_param(datetime(2026, 1, 1), SQLITE)


def test_public_ids_sort_by_time_and_carry_it() -> None:
    now_ms = int(time.time() * 1000)
    earlier, later = new_public_id("tr", now_ms - 1), new_public_id("tr", now_ms)
    assert earlier < later
    assert earlier.startswith("tr_") and len(earlier) == 3 + 26
    assert ulid_timestamp_ms(later) == now_ms
    assert len({new_ulid() for _ in range(1000)}) == 1000
