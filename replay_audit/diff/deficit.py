"""The deficit of a logged token: how far below the reference's own choice the reference put it.
Pure: stdlib + numpy.

A verification scans the logged path in the claimed configuration (the reference). At output
step t the reference's top-1 logit is z_t(top-1) and the logged token's is z_t(logged); the
deficit is their difference, exactly 0 where the logged token is the reference's choice (or
ties it). It is measured absolutely and in ulps of the reference's lm_head format at the top-1
value, as margins are (`diff.margin`): a benign flip needs the reference to have seen a near-tie,
so its deficit is a few ulps at most; a different computation (quantised weights, a swapped
checkpoint, a bug) puts logged tokens far below the top-1.

The **tie band** is the deficits a benign platform difference can explain by rounding alone:
at most `TIE_BAND_ULPS` ulps. A token outside it was chosen by a computation that disagrees with
the reference by more than rounding at that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from replay_audit.formats import ulp_array

#: Width of the tie band in ulps of the reference's head format. On a real checkpoint, honest
#: BF16 traces from a GPU scanned in BF16 on a CPU mismatch at 1 ulp or less in 32 of 35
#: mismatching traces and never above 4 (issue 23): 4 ulps holds all of them.
TIE_BAND_ULPS: Final = 4.0


@dataclass(frozen=True, eq=False)
class TokenDeficits:
    """Per logged token (row t: output step t) of one trace:

    deficit       top-1 minus the logged token's logit, float64, >= 0
    deficit_ulps  the deficit in ulps of the reference's head format at the top-1 value
    rank          the logged token's rank in the reference (0: its own choice)
    in_tie_band   deficit_ulps <= the tie band
    """

    deficit: npt.NDArray[np.float64]
    deficit_ulps: npt.NDArray[np.float64]
    rank: npt.NDArray[np.int64]
    in_tie_band: npt.NDArray[np.bool_]

    def __len__(self) -> int:
        return int(self.deficit.shape[0])


def token_deficits(
    top1: npt.ArrayLike,
    logged_logits: npt.ArrayLike,
    ranks: npt.ArrayLike,
    head_format: str,
    tie_band_ulps: float = TIE_BAND_ULPS,
) -> TokenDeficits:
    """The deficits of a trace's logged tokens from the reference's top-1 logits and the logged
    tokens' logits (float32 values: their float64 difference is exact) and ranks."""
    t1 = np.asarray(top1, dtype=np.float64)
    deficit = np.maximum(t1 - np.asarray(logged_logits, dtype=np.float64), 0.0)
    ulps = deficit / ulp_array(t1, head_format)
    rank = np.asarray(ranks, dtype=np.int64)
    return TokenDeficits(deficit, ulps, rank, np.asarray(ulps <= tie_band_ulps))


def draw_deficits(
    deficit: npt.ArrayLike,
    drawn_logits: npt.ArrayLike,
    ranks: npt.ArrayLike,
    head_format: str,
    tie_band_ulps: float = TIE_BAND_ULPS,
) -> TokenDeficits:
    """The deficits of a sampled trace's logged tokens against the reference's own draws under
    the sampler's noise (`engine.sampling`): each a float64 amount in logit units, in ulps of
    the head format at the drawn token's logit (the value a benign rounding moves), with the
    logged token's rank in the race."""
    d = np.maximum(np.asarray(deficit, dtype=np.float64), 0.0)
    ulps = d / ulp_array(np.asarray(drawn_logits, dtype=np.float64), head_format)
    rank = np.asarray(ranks, dtype=np.int64)
    return TokenDeficits(d, ulps, rank, np.asarray(ulps <= tie_band_ulps))
