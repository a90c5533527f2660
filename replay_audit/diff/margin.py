"""Top-2 margins, their size in ulps of a format, and the gate. Pure: stdlib + numpy.

The margin Δ_t is top-1 minus top-2 of an arm's native logits, exactly converted to float32 (so
the subtraction below, done in float64, is exact). Its size in ulps is Δ_t divided by the spacing
of the arm's lm_head format at the top-1 value (`replay_audit.formats.ulp`).

The gate (paper Algorithm 1) fires at a step when Δ_t < τ, or always when τ = 0 (ungated); a
negative τ never fires. τ is absolute (`tau`, paper default 1e-3) or format-scaled
(`tau_ulps` = k: τ = k ulps of the format at the top-1 value), which is how the gate must widen
for coarse formats such as an FP8 lm_head (paper, FP8 appendix).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from replay_audit.formats import ulp, ulp_array

#: The paper's gate threshold for BF16/FP16 (τ = 1e-3).
DEFAULT_TAU = 1e-3


@dataclass(frozen=True)
class Margin:
    """An arm's top-2 margin at one step: absolute, in ulps of its lm_head format, and the top-1
    value it was measured at."""

    abs: float
    ulps: float
    top1: float

    def to_dict(self) -> dict[str, float]:
        return {"abs": self.abs, "ulps": self.ulps}


@dataclass(frozen=True)
class GateRule:
    """When the gate fires: Δ < τ, or always for τ = 0; never for τ < 0.

    With `tau_ulps` set, τ at a step is `tau_ulps` ulps of the arm's format at the top-1 value and
    `tau` is ignored.
    """

    tau: float = DEFAULT_TAU
    tau_ulps: float | None = None

    def threshold(self, top1: float, fmt: str) -> float:
        """The absolute τ at a step whose top-1 logit is `top1`, for an arm in format `fmt`."""
        if self.tau_ulps is None:
            return self.tau
        return self.tau_ulps * ulp(top1, fmt)

    @property
    def ungated(self) -> bool:
        """τ = 0: the paper's 'or τ = 0' branch, every step fires."""
        return (self.tau_ulps if self.tau_ulps is not None else self.tau) == 0.0

    def fires(self, margin: float, top1: float, fmt: str) -> bool:
        """Whether the gate fires at a step with this margin and top-1 value."""
        if self.ungated:
            return True
        return margin < self.threshold(top1, fmt)

    def fires_array(
        self, margins: npt.ArrayLike, top1: npt.ArrayLike, fmt: str
    ) -> npt.NDArray[np.bool_]:
        """`fires` over arrays of steps."""
        m = np.asarray(margins, dtype=np.float64)
        if self.ungated:
            return np.ones(m.shape, dtype=bool)
        if self.tau_ulps is None:
            return m < self.tau
        return m < self.tau_ulps * ulp_array(top1, fmt)


def margin(top1: float, top2: float, fmt: str) -> Margin:
    """The margin between a top-1 and a top-2 logit (float32 values) of an arm in `fmt`."""
    delta = float(top1) - float(top2)
    return Margin(abs=delta, ulps=delta / ulp(top1, fmt), top1=float(top1))


def margin_from_top_k(logits_row: Sequence[float], fmt: str) -> Margin:
    """The margin of one step from its top-k logits (sorted descending, k ≥ 2)."""
    if len(logits_row) < 2:
        raise ValueError("a margin needs at least the top-2 logits of the step")
    return margin(logits_row[0], logits_row[1], fmt)


def is_tie(*margins: Margin | None) -> bool:
    """True when any of the given margins is exactly 0: the top-2 logits were equal, and which
    token won depended on the implementation's tie-break."""
    return any(m is not None and m.abs == 0.0 for m in margins)


def margins_in_ulps(
    margins: npt.ArrayLike, top1: npt.ArrayLike, fmt: str
) -> npt.NDArray[np.float64]:
    """Margins divided by the ulp of `fmt` at each step's top-1 value."""
    return np.asarray(margins, dtype=np.float64) / ulp_array(top1, fmt)
