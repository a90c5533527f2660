"""Column types: numeric arrays stored compactly, and typed JSON.

Token ids are packed little-endian int32 (4 bytes a token, not a JSON list); logits packed
little-endian float32. Both read back as read-only numpy arrays (`np.frombuffer`, no copy).
Bind values may be numpy arrays, sequences of numbers, or `bytes` that are already packed (the
ingest path packs once, with numpy, and hands the bytes straight through).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt
from pydantic import TypeAdapter
from sqlalchemy import JSON, BigInteger, Integer, LargeBinary, TypeDecorator
from sqlalchemy.engine import Dialect

INT32_LE: Final = np.dtype("<i4")
FLOAT32_LE: Final = np.dtype("<f4")

#: 64-bit keys on PostgreSQL; SQLite autoincrements only an INTEGER PRIMARY KEY (its rowid).
BigId = BigInteger().with_variant(Integer(), "sqlite")

Int32Array = npt.NDArray[np.int32]
Float32Array = npt.NDArray[np.float32]


def pack_int32(values: Sequence[int] | npt.NDArray[Any]) -> bytes:
    """Little-endian int32 bytes; OverflowError/ValueError if a value does not fit."""
    return np.asarray(values, dtype=INT32_LE).tobytes()


def pack_float32(values: Sequence[float] | npt.NDArray[Any]) -> bytes:
    """Little-endian float32 bytes (values are rounded to float32, the stored precision)."""
    return np.asarray(values, dtype=FLOAT32_LE).tobytes()


def unpack_int32(data: bytes) -> Int32Array:
    """The int32 array packed by `pack_int32` (read-only view)."""
    return np.frombuffer(data, dtype=INT32_LE).astype(np.int32, copy=False)


def unpack_float32(data: bytes) -> Float32Array:
    """The float32 array packed by `pack_float32` (read-only view)."""
    return np.frombuffer(data, dtype=FLOAT32_LE).astype(np.float32, copy=False)


A = TypeVar("A", Int32Array, Float32Array)


class _PackedArray(TypeDecorator[A]):
    """A 1-D array stored as little-endian bytes (`LargeBinary`: BLOB / bytea)."""

    impl = LargeBinary
    pack: Callable[[Any], bytes]
    unpack: Callable[[bytes], A]

    def process_bind_param(self, value: Any, dialect: Dialect) -> bytes | None:
        if value is None or isinstance(value, bytes):
            return value
        return self.pack(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> A | None:
        return None if value is None else self.unpack(bytes(value))


class PackedInt32Array(_PackedArray[Int32Array]):
    cache_ok = True  # read from each class's own namespace
    pack = staticmethod(pack_int32)
    unpack = staticmethod(unpack_int32)


class PackedFloat32Array(_PackedArray[Float32Array]):
    cache_ok = True
    pack = staticmethod(pack_float32)
    unpack = staticmethod(unpack_float32)


T = TypeVar("T")


class ModelJSON(TypeDecorator[T]):
    """A pydantic type (a model, or e.g. `list[Model]`) stored as JSON: `dump_python(mode=
    "json", by_alias=True)` when written, validated when read, so the attribute holds typed
    objects and the column plain JSON. Bind values may be the typed objects or their JSON form
    (dicts), which are validated first: a malformed value fails at the write, not the read.
    Rows written in an older shape read as long as the model accepts them (defaults for fields
    added since; unknown keys ignored)."""

    impl = JSON
    cache_ok = True

    def __init__(self, model: Any) -> None:
        super().__init__()
        #: The pydantic type (hashable: SQLAlchemy's statement cache keys on it).
        self.model = model
        self._adapter: TypeAdapter[T] = TypeAdapter(model)

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if value is None:
            return None
        return self._adapter.dump_python(
            self._adapter.validate_python(value), mode="json", by_alias=True
        )

    def process_result_value(self, value: Any, dialect: Dialect) -> T | None:
        if value is None:
            return None
        return self._adapter.validate_python(value)
