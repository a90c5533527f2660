"""Statistics for replay reports. Pure: stdlib and numpy only (import-linter enforces it), so
reports, the CLI and tests can use it without torch, a database or a server.

Every function validates its input and raises ValueError (TypeError for a non-integer count)
with a message naming the argument. Results are frozen dataclasses.
"""

from replay_audit.stats.binomial import binom_cdf, binom_pmf
from replay_audit.stats.equivalence import TostResult, tost_noninferiority
from replay_audit.stats.fisher import FisherResult, fisher_exact, hypergeom_cdf
from replay_audit.stats.mcnemar import McNemarResult, mcnemar_exact
from replay_audit.stats.paired import (
    CorrectnessFlips,
    FlipIndices,
    LiftResult,
    correctness_flips,
    flip_indices,
    paired_bootstrap_lift,
)
from replay_audit.stats.proportion import Interval, Proportion, proportion, rate, wilson_interval
from replay_audit.stats.summary import (
    Distribution,
    Histogram,
    LogHistogram,
    breakdown,
    distribution,
    histogram,
    log_histogram,
    quantiles,
)

__all__ = [
    "CorrectnessFlips",
    "Distribution",
    "FisherResult",
    "FlipIndices",
    "Histogram",
    "Interval",
    "LiftResult",
    "LogHistogram",
    "McNemarResult",
    "Proportion",
    "TostResult",
    "binom_cdf",
    "binom_pmf",
    "breakdown",
    "correctness_flips",
    "distribution",
    "fisher_exact",
    "flip_indices",
    "histogram",
    "hypergeom_cdf",
    "log_histogram",
    "mcnemar_exact",
    "paired_bootstrap_lift",
    "proportion",
    "quantiles",
    "rate",
    "tost_noninferiority",
    "wilson_interval",
]
