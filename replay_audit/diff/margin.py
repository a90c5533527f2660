"""Top-2 margins, their size in ulps of a format, and the gate. Pure: stdlib + numpy.

The margin Δ_t is top-1 minus top-2 of an arm's native logits, exactly converted to float32 (so
the subtraction below, done in float64, is exact whenever the two are fewer than 29 binades
apart, as neighbouring logits are). Its size in ulps is Δ_t divided by the spacing of the arm's
lm_head format at the top-1 value (`replay_audit.formats.ulp`).

The gate (paper Algorithm 1) fires at a step when Δ_t < τ, or always when τ = 0 (ungated); a
negative τ never fires. τ is absolute (`tau`, paper default 1e-3) or format-scaled
(`tau_ulps` = k: τ = k ulps of the format at the top-1 value), which is how the gate must widen
for coarse formats such as an FP8 lm_head (paper, FP8 appendix).

`step_numerics` decides all of this once, over (steps, k) arrays of top-k ids and logits (with
`sort_top_k`, the one tie rule), so that every place that reports a margin reports the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from replay_audit.formats import ulp_array

#: The paper's gate threshold for BF16/FP16 (τ = 1e-3).
DEFAULT_TAU = 1e-3

IdArray = npt.NDArray[np.int64]
LogitArray = npt.NDArray[np.floating[Any]]


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
    """When the gate fires (module docstring). With `tau_ulps` set, `tau` is ignored."""

    tau: float = DEFAULT_TAU
    tau_ulps: float | None = None

    def thresholds(self, top1: npt.ArrayLike, fmt: str) -> npt.NDArray[np.float64]:
        """The absolute τ at steps whose top-1 logits are `top1`, for an arm in format `fmt`."""
        t1 = np.asarray(top1, dtype=np.float64)
        if self.tau_ulps is None:
            return np.full(t1.shape, self.tau, dtype=np.float64)
        return self.tau_ulps * ulp_array(t1, fmt)

    def threshold(self, top1: float, fmt: str) -> float:
        """The absolute τ at a step whose top-1 logit is `top1`, for an arm in format `fmt`."""
        return float(self.thresholds(top1, fmt))

    @property
    def ungated(self) -> bool:
        """τ = 0: the paper's 'or τ = 0' branch, every step fires."""
        return (self.tau_ulps if self.tau_ulps is not None else self.tau) == 0.0

    def fires(self, margin: float, top1: float, fmt: str) -> bool:
        """Whether the gate fires at a step with this margin and top-1 value."""
        return bool(self.fires_array(margin, top1, fmt))

    def fires_array(
        self, margins: npt.ArrayLike, top1: npt.ArrayLike, fmt: str
    ) -> npt.NDArray[np.bool_]:
        """`fires` over arrays of steps."""
        m = np.asarray(margins, dtype=np.float64)
        if self.ungated:
            return np.ones(m.shape, dtype=bool)
        return np.asarray(m < self.thresholds(top1, fmt))


def _rows(logits: npt.ArrayLike, ids: npt.ArrayLike | None) -> tuple[IdArray, LogitArray]:
    """(steps, k) ids and logits as given (a 1-D input is one step); logits keep a float dtype,
    and without ids a row's positions stand in for them."""
    values = np.asarray(logits)
    if values.dtype.kind != "f":
        values = values.astype(np.float64)
    values = np.atleast_2d(values)
    if ids is None:
        return np.broadcast_to(np.arange(values.shape[-1], dtype=np.int64), values.shape), values
    keys = np.atleast_2d(np.asarray(ids, dtype=np.int64))
    if keys.shape != values.shape:
        raise ValueError(f"top-k ids {keys.shape} and logits {values.shape} differ in shape")
    return keys, values


def sort_top_k(
    logits: npt.ArrayLike, ids: npt.ArrayLike | None = None
) -> tuple[IdArray, LogitArray]:
    """Each row of (steps, k) top-k `ids` and `logits` ordered by logit descending, then by id
    ascending: the one tie rule, so equal logits are listed in a platform-independent order
    (the smaller id first, as argmax breaks ties). Without ids, equal logits keep their order.
    Logits keep their float dtype."""
    keys, values = _rows(logits, ids)
    order = np.lexsort((keys, -values.astype(np.float64)), axis=-1)
    return np.take_along_axis(keys, order, axis=-1), np.take_along_axis(values, order, axis=-1)


@dataclass(frozen=True, eq=False)
class StepNumerics:
    """What `step_numerics` decided for each step t (row t of each array).

    top_k_ids     (T, k) ids by logit descending, ties by smaller id
    top_k_logits  (T, k) the logits in that order, in the dtype given (float32 from an engine)
    top1          (T,) the top-1 logit in float64
    margins       (T,) Δ_t = top-1 - top-2 in float64 (of float32 logits: exact, see above)
    margins_ulps  (T,) Δ_t in ulps of the head format at the top-1 value; None without a format
    gate_fired    (T,) whether the gate rule fires; None without a gate rule
    """

    top_k_ids: IdArray
    top_k_logits: LogitArray
    top1: npt.NDArray[np.float64]
    margins: npt.NDArray[np.float64]
    margins_ulps: npt.NDArray[np.float64] | None
    gate_fired: npt.NDArray[np.bool_] | None

    def margin_at(self, t: int) -> Margin:
        """Step t's margin (needs the head format)."""
        if self.margins_ulps is None:
            raise ValueError("margins in ulps need the head format: pass head_format")
        return Margin(
            abs=float(self.margins[t]), ulps=float(self.margins_ulps[t]), top1=float(self.top1[t])
        )


def step_numerics(
    logits: npt.ArrayLike,
    ids: npt.ArrayLike | None = None,
    *,
    head_format: str | None = None,
    gate: GateRule | None = None,
    sort: bool = True,
) -> StepNumerics:
    """The `StepNumerics` of (steps, k) top-k logits (k >= 2) and their ids, rows ordered by
    `sort_top_k` (`sort=False`: taken as ordered, first column the top-1); a 1-D input is one
    step. The only place these are computed: a decode step is a (1, k) call, a scan one call
    over all its steps."""
    top_ids, values = sort_top_k(logits, ids) if sort else _rows(logits, ids)
    if values.shape[-1] < 2:
        raise ValueError("a margin needs at least the top-2 logits of each step")
    if gate is not None and head_format is None:
        raise ValueError("the gate needs the head format (τ may be in its ulps)")
    top1 = values[:, 0].astype(np.float64)
    margins = top1 - values[:, 1].astype(np.float64)
    ulps = None if head_format is None else margins / ulp_array(top1, head_format)
    fired = None
    if gate is not None and head_format is not None:
        fired = gate.fires_array(margins, top1, head_format)
    return StepNumerics(top_ids, values, top1, margins, ulps, fired)


def margin(top1: float, top2: float, fmt: str) -> Margin:
    """The margin between a top-1 and a top-2 logit (float32 values) of an arm in `fmt`."""
    return step_numerics([[top1, top2]], head_format=fmt, sort=False).margin_at(0)


def margin_from_top_k(logits_row: Sequence[float], fmt: str) -> Margin:
    """The margin of one step from its top-k logits (sorted descending, k ≥ 2)."""
    if len(logits_row) < 2:
        raise ValueError("a margin needs at least the top-2 logits of the step")
    return margin(logits_row[0], logits_row[1], fmt)


def margin_from_logprobs(
    logprobs_row: Sequence[float], fmt: str, top1_logit: float | None
) -> Margin:
    """The margin of one step from its top-k raw logprobs (sorted descending, k ≥ 2).

    The log-softmax normaliser cancels in top-1 minus top-2, so the absolute margin is the logit
    margin to float32 rounding. A logprob is not a logit, though: its size in ulps is measured
    at `top1_logit`, the top-1 logit of the same step over the same prefix (the replayed arm's
    at t*, whose tokens before t* are the logged ones), and is NaN (unknown) without one."""
    m = margin_from_top_k(logprobs_row, fmt)
    if top1_logit is None or not np.isfinite(top1_logit):
        return Margin(m.abs, float("nan"), float("nan"))
    return Margin(m.abs, m.abs / float(ulp_array(top1_logit, fmt)), float(top1_logit))


def is_tie(*margins: Margin | None) -> bool:
    """True when any of the given margins is exactly 0: the top-2 logits were equal, and which
    token won depended on the implementation's tie-break."""
    return any(m is not None and m.abs == 0.0 for m in margins)


def margins_ulps_from_top_k(
    top_k: npt.ArrayLike, fmt: str, top1_logits: npt.ArrayLike | None = None
) -> npt.NDArray[np.float64]:
    """Per-step margins in ulps of `fmt` from (steps, k ≥ 2) logged top-k values, sorted
    descending: logits (their own top-1 gives the ulp), or raw logprobs with `top1_logits`,
    the top-1 logits of the same steps over the same prefixes (NaN, unknown, without them)."""
    values = np.asarray(top_k, dtype=np.float64)
    if values.ndim != 2 or values.shape[1] < 2:
        raise ValueError("per-step margins need the top-2 values of every step")
    margins = values[:, 0] - values[:, 1]
    if top1_logits is None:
        return margins / ulp_array(values[:, 0], fmt)
    return margins / ulp_array(np.asarray(top1_logits, dtype=np.float64), fmt)


def first_near_tie(margins_ulps: npt.ArrayLike, threshold_ulps: float) -> int | None:
    """The first step whose margin is at most `threshold_ulps` ulps (a near-tie: a flip there
    can need no more than the KV cache's rounding), None when there is none or the threshold is
    negative (near-tie flagging off). A NaN margin (unknown) is never a near-tie."""
    if threshold_ulps < 0:
        return None
    m = np.asarray(margins_ulps, dtype=np.float64)
    hits = np.flatnonzero(m <= threshold_ulps)  # NaN compares False
    return int(hits[0]) if hits.size else None
