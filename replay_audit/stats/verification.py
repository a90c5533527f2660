"""The statistics of a verification (provider audit): a group's score against the benign null,
the null's calibration per token budget, and the verdict. Pure: stdlib + numpy.

Every statistic is the mean over a group's logged tokens of a per-token score of the token's
deficit in ulps (`diff.deficit`), so a group of n tokens has one score whatever its traces:

    mean_deficit_ulps     the deficit in ulps, clipped at `CLIP_ULPS` (one wild token cannot
                          decide alone; Token-DiFR clips the same way)
    outside_tie_band      1 where the deficit is outside the tie band, else 0: the fraction of
                          tokens no rounding difference explains
    log_likelihood_ratio  log p_alt(bin) / p_null(bin) of the token's deficit bin (`BIN_EDGES`),
                          the bins' probabilities measured on the benign null and on the
                          calibration's alternative (a 4-bit RTN copy of the checkpoint)

`VERDICT_STATISTIC` is the one a verdict uses. The calibration draws groups of exactly n tokens
from each benign variation's traces alone (`draw_group_scores`), `DRAWS` times per budget and
variation, and puts the threshold at the highest of the variations' (1 - false-alarm rate)
quantiles: a provider's group comes from one configuration, so the promise holds for each
benign configuration, not for a mix of them. The same draws from the alternative's traces give
the power curve; the smallest budget whose power reaches `POWER` is the tokens a decision
needs. docs/verify.md says why each choice, with the measurements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, TypedDict, get_args

import numpy as np
import numpy.typing as npt

from replay_audit.diff.deficit import TIE_BAND_ULPS

Statistic = Literal["mean_deficit_ulps", "outside_tie_band", "log_likelihood_ratio"]
STATISTICS: Final[tuple[Statistic, ...]] = get_args(Statistic)
#: The statistic verdicts use (measured best on the bundled model: docs/verify.md).
VERDICT_STATISTIC: Final[Statistic] = "outside_tie_band"
Verdict = Literal["consistent", "inconsistent", "insufficient"]

#: Deficits above this many ulps count as this many in the mean deficit.
CLIP_ULPS: Final = 64.0
#: Upper edges (ulps) of the deficit bins of the likelihood ratio: exactly 0 (the reference's
#: own choice), rounding (<= 1), the tie band (<= 4), then 16, 64 and beyond.
BIN_EDGES: Final = (0.0, 1.0, TIE_BAND_ULPS, 16.0, 64.0)
#: Pseudo-count per bin: a bin the null never showed is rare under it, not impossible.
PSEUDO_COUNT: Final = 0.5
#: The token budgets calibrated.
BUDGETS: Final = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: Null (and alternative) groups drawn per budget.
DRAWS: Final = 1000
#: The power a budget must reach against the alternative to decide `consistent`.
POWER: Final = 0.95
DEFAULT_FALSE_ALARM_RATE: Final = 0.01
#: Null-score quantiles stored per budget (the verification's picture draws them).
QUANTILES: Final = tuple(np.round(np.linspace(0.0, 1.0, 21), 2).tolist())
#: The calibration method: 2 sets thresholds per benign variation, from groups drawn from
#: bootstrap resamples of its traces (1 drew groups from the pooled traces themselves); a
#: stored calibration of an older version is measured again.
CALIBRATION_VERSION: Final = 2

Ulps = npt.NDArray[np.float64]


def deficit_bins(deficit_ulps: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """The bin of each deficit: 0 for exactly 0, then one per `BIN_EDGES` interval."""
    u = np.asarray(deficit_ulps, dtype=np.float64)
    return np.asarray(np.searchsorted(np.asarray(BIN_EDGES), u, side="left"), dtype=np.int64)


def bin_probabilities(traces: Sequence[Ulps]) -> list[float]:
    """The bins' probabilities over all tokens of `traces`, with `PSEUDO_COUNT` per bin."""
    counts = np.full(len(BIN_EDGES) + 1, PSEUDO_COUNT)
    for u in traces:
        counts += np.bincount(deficit_bins(u), minlength=counts.size)
    return [float(x) for x in counts / counts.sum()]


@dataclass(frozen=True)
class TokenScorer:
    """The per-token score of each statistic; the likelihood ratio needs the bins' null and
    alternative probabilities."""

    null_bins: tuple[float, ...]
    alt_bins: tuple[float, ...]
    tie_band_ulps: float = TIE_BAND_ULPS

    def scores(self, deficit_ulps: npt.ArrayLike, statistic: Statistic) -> Ulps:
        u = np.asarray(deficit_ulps, dtype=np.float64)
        if statistic == "mean_deficit_ulps":
            return np.minimum(u, CLIP_ULPS)
        if statistic == "outside_tie_band":
            return np.asarray(u > self.tie_band_ulps, dtype=np.float64)
        llr = np.log(np.asarray(self.alt_bins)) - np.log(np.asarray(self.null_bins))
        return np.asarray(llr[deficit_bins(u)], dtype=np.float64)

    def score(self, traces: Sequence[Ulps], statistic: Statistic) -> float:
        """A group's score: the mean token score over all its tokens (NaN without tokens)."""
        u: Ulps = (
            np.concatenate([np.asarray(t, dtype=np.float64) for t in traces])
            if traces
            else np.zeros(0)
        )
        s = self.scores(u, statistic)
        return float(s.mean()) if s.size else float("nan")


def draw_group_scores(
    token_scores: Sequence[Ulps], budget: int, draws: int, rng: np.random.Generator
) -> Ulps:
    """Scores of `draws` groups of exactly `budget` tokens, each made of whole traces drawn at
    random (with replacement, the last one cut) from a bootstrap resample of `token_scores` (per
    trace) drawn anew for each group, so that the groups' spread holds the uncertainty of the
    traces' own mean (docs/verify.md, "The null and the threshold", says why)."""
    sums = [np.concatenate([[0.0], np.cumsum(s)]) for s in token_scores if len(s)]
    if not sums:
        raise ValueError("a null needs at least one trace with tokens")
    k = len(sums)
    out = np.empty(draws)
    for d in range(draws):
        population = rng.integers(k, size=k)
        left, total = budget, 0.0
        while left > 0:
            c = sums[int(population[rng.integers(k)])]
            take = min(left, c.size - 1)
            total += c[take]
            left -= take
        out[d] = total / budget
    return out


@dataclass(frozen=True)
class BudgetCalibration:
    """One statistic at one token budget: the threshold, the null's mean and quantiles (over
    every variation's draws), the highest share of one variation's draws above the threshold
    (the measured false-alarm rate), the power against the alternative, and the variation whose
    quantile set the threshold (None in calibrations of version 1, which drew from the pooled
    traces)."""

    tokens: int
    threshold: float
    null_mean: float
    null_quantiles: list[float]
    false_alarm: float
    power: float | None
    set_by: str | None = None


@dataclass(frozen=True)
class Variation:
    """One benign variation of the null (or the alternative): its traces, tokens and the mean
    token score of each statistic."""

    name: str
    traces: int
    tokens: int
    scores: dict[str, float]


class Claim(TypedDict):
    """The configuration a calibration is for: body and head formats and attention kernel
    (None: the engine's default)."""

    dtype: str
    lm_head_dtype: str
    attn_kernel: str | None


class PlatformKey(TypedDict):
    """The scanning platform a calibration was measured on. `devices`: the CUDA GPUs the
    measuring worker owned (1 on a CPU): a null measured with two holds the TP-2 variation, one
    measured with one does not, so they are different nulls."""

    device: str
    gpu_name: str | None
    sm: str | None
    torch_version: str | None
    devices: int


@dataclass(frozen=True)
class Calibration:
    """A checkpoint's benign null on one scanning platform, for one claimed configuration:
    per statistic, the calibration at each budget. Stored as JSON (`to_json`) for the offline
    CLI and in the database for the service."""

    weights_sha256: str
    claim: Claim
    platform: PlatformKey
    false_alarm_rate: float
    scorer: TokenScorer
    budgets: dict[str, list[BudgetCalibration]]
    variations: list[Variation]
    alternative: Variation | None = None
    statistic: Statistic = VERDICT_STATISTIC
    version: int = CALIBRATION_VERSION
    notes: list[str] = field(default_factory=list)
    #: The null's prompts and new tokens a prompt (None: not recorded, before they were).
    null_prompts: int | None = None
    null_max_new_tokens: int | None = None

    def at(self, tokens: int, statistic: Statistic | None = None) -> BudgetCalibration:
        """The calibration of the largest budget <= tokens (the smallest for fewer tokens):
        every statistic is a mean, whose null spreads less with more tokens, so a smaller
        budget's threshold is the cautious one."""
        rows = self.budgets[statistic or self.statistic]
        fit = [b for b in rows if b.tokens <= tokens]
        return fit[-1] if fit else rows[0]

    def tokens_needed(self, statistic: Statistic | None = None) -> int | None:
        """The smallest budget whose power against the alternative reaches `POWER` (None:
        none calibrated does)."""
        for b in self.budgets[statistic or self.statistic]:
            if b.power is not None and b.power >= POWER:
                return b.tokens
        return None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["scorer"] = asdict(self.scorer)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Calibration:
        def variation(v: Mapping[str, Any] | None) -> Variation | None:
            return None if v is None else Variation(**v)

        return cls(
            weights_sha256=str(data["weights_sha256"]),
            claim=Claim(
                dtype=str(data["claim"]["dtype"]),
                lm_head_dtype=str(data["claim"]["lm_head_dtype"]),
                attn_kernel=data["claim"]["attn_kernel"],
            ),
            platform=PlatformKey(
                device=str(data["platform"]["device"]),
                gpu_name=data["platform"].get("gpu_name"),
                sm=data["platform"].get("sm"),
                torch_version=data["platform"].get("torch_version"),
                devices=int(data["platform"].get("devices", 1)),
            ),
            false_alarm_rate=float(data["false_alarm_rate"]),
            scorer=TokenScorer(
                tuple(data["scorer"]["null_bins"]),
                tuple(data["scorer"]["alt_bins"]),
                float(data["scorer"]["tie_band_ulps"]),
            ),
            budgets={
                k: [BudgetCalibration(**b) for b in rows] for k, rows in data["budgets"].items()
            },
            variations=[Variation(**v) for v in data["variations"]],
            alternative=variation(data.get("alternative")),
            statistic=data.get("statistic", VERDICT_STATISTIC),
            version=int(data.get("version", 1)),
            notes=list(data.get("notes", [])),
            null_prompts=data.get("null_prompts"),
            null_max_new_tokens=data.get("null_max_new_tokens"),
        )


def calibrate(
    null: Mapping[str, Sequence[Ulps]],
    alternative: Sequence[Ulps],
    *,
    weights_sha256: str,
    claim: Claim,
    platform: PlatformKey,
    false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE,
    budgets: Sequence[int] = BUDGETS,
    draws: int = DRAWS,
    seed: int = 0,
    alternative_name: str = "rtn4_g128",
) -> Calibration:
    """The calibration from the null's per-token deficits in ulps (variation name -> one array
    per trace) and the alternative's: each statistic's threshold per budget at
    `false_alarm_rate` for every variation (groups drawn from one variation's traces at a
    time), with its measured false-alarm rate, power, and the variation that set it."""
    if not 0.0 < false_alarm_rate < 1.0:
        raise ValueError("the false-alarm rate is between 0 and 1")
    pooled = [u for traces in null.values() for u in traces]
    scorer = TokenScorer(tuple(bin_probabilities(pooled)), tuple(bin_probabilities(alternative)))
    rng = np.random.default_rng(seed)
    table: dict[str, list[BudgetCalibration]] = {}
    for statistic in STATISTICS:
        per_variation = {
            name: [scorer.scores(u, statistic) for u in traces if len(u)]
            for name, traces in null.items()
        }
        per_variation = {name: scores for name, scores in per_variation.items() if scores}
        if not per_variation:
            raise ValueError("a null needs at least one trace with tokens")
        alt_scores = [scorer.scores(u, statistic) for u in alternative]
        rows = []
        for n in budgets:
            drawn = {
                name: draw_group_scores(scores, n, draws, rng)
                for name, scores in per_variation.items()
            }
            quantiles = {
                name: float(np.quantile(d, 1.0 - false_alarm_rate, method="higher"))
                for name, d in drawn.items()
            }
            set_by = max(quantiles, key=lambda name: quantiles[name])
            threshold = quantiles[set_by]
            every = np.concatenate(list(drawn.values()))
            power = None
            if alt_scores:
                power = float((draw_group_scores(alt_scores, n, draws, rng) > threshold).mean())
            rows.append(
                BudgetCalibration(
                    tokens=n,
                    threshold=threshold,
                    null_mean=float(every.mean()),
                    null_quantiles=[float(q) for q in np.quantile(every, QUANTILES)],
                    false_alarm=max(float((d > threshold).mean()) for d in drawn.values()),
                    power=power,
                    set_by=set_by,
                )
            )
        table[statistic] = rows

    def summary(name: str, traces: Sequence[Ulps]) -> Variation:
        return Variation(
            name=name,
            traces=len(traces),
            tokens=int(sum(len(u) for u in traces)),
            scores={s: scorer.score(traces, s) for s in STATISTICS},
        )

    return Calibration(
        weights_sha256=weights_sha256,
        claim=claim,
        platform=platform,
        false_alarm_rate=false_alarm_rate,
        scorer=scorer,
        budgets=table,
        variations=[summary(name, traces) for name, traces in null.items()],
        alternative=summary(alternative_name, alternative) if alternative else None,
    )


@dataclass(frozen=True)
class GroupVerdict:
    """The verdict on one group's logged tokens against a calibration.

    score / threshold      the group's statistic and the threshold at its budget
    effect_size            score minus the null's mean at that budget (the statistic's units)
    closest_benign         the benign variation whose mean token score is nearest the group's
    tokens_needed          tokens the calibration needs for a decision (power >= POWER)
    more_tokens            for `insufficient`: how many more tokens that is
    """

    verdict: Verdict
    statistic: Statistic
    score: float
    threshold: float
    false_alarm_rate: float
    tokens: int
    traces: int
    budget: int
    effect_size: float
    fraction_outside_tie_band: float
    mean_deficit_ulps: float
    closest_benign: str | None
    closest_benign_score: float | None
    tokens_needed: int | None
    more_tokens: int | None
    null_quantiles: list[float]


def verdict(
    traces: Sequence[Ulps], calibration: Calibration, statistic: Statistic | None = None
) -> GroupVerdict:
    """The verdict on a group (its traces' per-token deficits in ulps): `inconsistent` when the
    score exceeds the threshold at the group's budget; else `consistent` when the group has at
    least the tokens a decision needs, `insufficient` (with how many more) otherwise."""
    stat = statistic or calibration.statistic
    n = int(sum(len(u) for u in traces))
    cal = calibration.at(n, stat)
    scorer = calibration.scorer
    score = scorer.score(traces, stat) if n else float("nan")
    needed = calibration.tokens_needed(stat)
    closest = None
    if n and calibration.variations:
        closest = min(calibration.variations, key=lambda v: abs(v.scores[stat] - score))
    if n and score > cal.threshold:
        result: Verdict = "inconsistent"
    elif n and needed is not None and n >= needed:
        result = "consistent"
    else:
        result = "insufficient"
    return GroupVerdict(
        verdict=result,
        statistic=stat,
        score=score,
        threshold=cal.threshold,
        false_alarm_rate=calibration.false_alarm_rate,
        tokens=n,
        traces=len(traces),
        budget=cal.tokens,
        effect_size=score - cal.null_mean if n else float("nan"),
        fraction_outside_tie_band=scorer.score(traces, "outside_tie_band") if n else float("nan"),
        mean_deficit_ulps=scorer.score(traces, "mean_deficit_ulps") if n else float("nan"),
        closest_benign=closest.name if closest else None,
        closest_benign_score=closest.scores[stat] if closest else None,
        tokens_needed=needed,
        more_tokens=None if result != "insufficient" or needed is None else max(needed - n, 0),
        null_quantiles=cal.null_quantiles,
    )


def auc(null: npt.ArrayLike, alternative: npt.ArrayLike) -> float:
    """The area under the ROC curve of scores (higher = more suspicious): the probability that
    an alternative score exceeds a null one, ties counting half."""
    a = np.asarray(null, dtype=np.float64)
    b = np.asarray(alternative, dtype=np.float64)
    if not a.size or not b.size:
        return float("nan")
    greater = (b[:, None] > a[None, :]).mean()
    ties = (b[:, None] == a[None, :]).mean()
    return float(greater + 0.5 * ties)
