"""Input checks shared by the statistics modules: one clear ValueError per misuse."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

# Per-item outcomes (agreed / correct) as Python bools or a numpy array of bools or 0/1 ints.
Flags: TypeAlias = Sequence[bool] | Sequence[int] | npt.NDArray[Any]
# Numeric observations (t*, margins, length differences).
Values: TypeAlias = Sequence[float] | Sequence[int] | npt.NDArray[Any]


def count(value: int, name: str) -> int:
    """`value` as a non-negative Python int (numpy integers accepted, bools and floats refused)."""
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be an integer count, not a bool")
    try:
        result = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer count, got {value!r}") from None
    if result < 0:
        raise ValueError(f"{name} must be >= 0, got {result}")
    return result


def probability_level(value: float, name: str) -> float:
    """A confidence level or significance level strictly inside (0, 1)."""
    level = float(value)
    if not 0.0 < level < 1.0:
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value!r}")
    return level


def flags(values: Flags, name: str) -> npt.NDArray[np.bool_]:
    """A 1-d bool array; refuses anything but bools or 0/1 so that a stray 2 or 0.5 is not
    silently read as True."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.dtype == np.bool_:
        return array
    if array.size == 0:
        return np.zeros(0, dtype=np.bool_)
    if not np.issubdtype(array.dtype, np.number) or not np.isin(array, (0, 1)).all():
        raise ValueError(f"{name} must contain only booleans (or 0/1)")
    return array.astype(np.bool_)


def paired_flags(
    baseline: Flags, treated: Flags, names: tuple[str, str]
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """Two flag arrays of the same non-zero length: outcomes of the same items under two arms."""
    first, second = flags(baseline, names[0]), flags(treated, names[1])
    if first.shape != second.shape:
        raise ValueError(
            f"{names[0]} and {names[1]} must describe the same items: "
            f"lengths {first.size} and {second.size} differ"
        )
    if first.size == 0:
        raise ValueError(f"{names[0]} and {names[1]} are empty: a paired statistic needs items")
    return first, second


def finite_values(
    values: Values, name: str, *, allow_empty: bool = False
) -> npt.NDArray[np.float64]:
    """A 1-d float64 array of finite numbers (NaN or inf would poison every summary)."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.size == 0 and not allow_empty:
        raise ValueError(f"{name} is empty: nothing to summarise")
    if not np.isfinite(array).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return array


def finite_float(value: float, name: str) -> float:
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return result
