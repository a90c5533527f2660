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

What a verdict decides by is chosen per budget (`BudgetChoice`: the tie band, `VERDICT_STATISTIC`,
unless the null's held-out split shows it failing or another keeping the rate with more power).
The calibration draws groups of exactly n tokens
from each benign variation's traces alone (`draw_group_scores`), `DRAWS` times per budget and
variation, and puts the threshold at the highest of the variations' (1 - false-alarm rate)
quantiles: a provider's group comes from one configuration, so the promise holds for each
benign configuration, not for a mix of them. The same draws from the alternative's traces give
the power curve; the smallest budget whose power reaches `POWER` is the tokens a decision
needs. docs/verify.md says why each choice, with the measurements.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, NotRequired, TypedDict, TypeVar, get_args

import numpy as np
import numpy.typing as npt

from replay_audit.diff.deficit import TIE_BAND_ULPS
from replay_audit.formats import SamplingJson
from replay_audit.stats.binomial import binom_cdf

Statistic = Literal["mean_deficit_ulps", "outside_tie_band", "log_likelihood_ratio"]
STATISTICS: Final[tuple[Statistic, ...]] = get_args(Statistic)
#: The statistic verdicts use (measured best on the bundled model: docs/verify.md).
VERDICT_STATISTIC: Final[Statistic] = "outside_tie_band"
Verdict = Literal["consistent", "inconsistent", "insufficient"]
#: What decides a verdict at a budget: one statistic over its threshold; the combined rule:
#: either of `RULE_STATISTICS` over its own threshold, each set at the false-alarm rate divided
#: among them (Bonferroni), so the rule keeps the rate by construction; the tie band at the
#: higher of its threshold and its rare-event floor (`rare_event_floor`); or the floored tie
#: band or the mean deficit, each at half the rate (its floor too).
Decision = Literal[
    "outside_tie_band",
    "mean_deficit_ulps",
    "log_likelihood_ratio",
    "tie_band_or_mean_deficit",
    "outside_tie_band_floored",
    "floored_or_mean_deficit",
]
RULE_STATISTICS: Final[tuple[Statistic, ...]] = ("outside_tie_band", "mean_deficit_ulps")
#: The decisions a calibration chooses among per budget (`BudgetChoice`), in the order a tie
#: goes (equal power and equal held-out false alarms): the tie band first, the statistic that
#: holds on benign configurations the null did not see (docs/verify.md). Version 3 had the
#: combined rule (`tie_band_or_mean_deficit`) where version 4 has it with the tie band floored:
#: its plain tie band at half the rate is what the rare-event guard (`choose`) keeps off.
CANDIDATES: Final[tuple[Decision, ...]] = (
    "outside_tie_band",
    "outside_tie_band_floored",
    "floored_or_mean_deficit",
    "mean_deficit_ulps",
)
#: What a calibration's verdicts use: one decision at every budget, or `per_budget`: at each
#: budget the decision its held-out split chose (`Calibration.choices`).
CalibrationDecision = Literal[
    "outside_tie_band",
    "mean_deficit_ulps",
    "log_likelihood_ratio",
    "tie_band_or_mean_deficit",
    "outside_tie_band_floored",
    "per_budget",
]
#: The decision new calibrations' verdicts use (docs/verify.md, "The decision per budget").
DECISION: Final[CalibrationDecision] = "per_budget"

#: Deficits above this many ulps count as this many in the mean deficit.
CLIP_ULPS: Final = 64.0
#: Upper edges (ulps) of the deficit bins of the likelihood ratio: exactly 0 (the reference's
#: own choice), rounding (<= 1), the tie band (<= 4), then 16, 64 and beyond.
BIN_EDGES: Final = (0.0, 1.0, TIE_BAND_ULPS, 16.0, 64.0)
#: Pseudo-count per bin: a bin the null never showed is rare under it, not impossible.
PSEUDO_COUNT: Final = 0.5
#: The token budgets calibrated (a null backs those up to its `Calibration.reach`).
BUDGETS: Final = tuple(2**i for i in range(4, 18))  # 16 ... 131,072
#: Null (and alternative) groups drawn per budget.
DRAWS: Final = 1000
#: The power a budget must reach against the alternative to decide `consistent`.
POWER: Final = 0.95
DEFAULT_FALSE_ALARM_RATE: Final = 0.01
#: Null-score quantiles stored per budget (the verification's picture draws them).
QUANTILES: Final = tuple(np.round(np.linspace(0.0, 1.0, 21), 2).tolist())
#: The calibration method: 2 sets thresholds per benign variation, from groups drawn from
#: bootstrap resamples of its traces (1 drew groups from the pooled traces themselves); 3 also
#: chooses per budget the decision verdicts use, by a held-out split of the null's traces
#: (`BudgetChoice`); 4 adds the floored tie band or the mean deficit to the candidates, keeps the
#: plain tie band off where the null's rare events cannot back its threshold (the rare-event
#: guard), breaks power ties by the power curve and never lets the choice lose power as the
#: budget grows (`choose`). A stored calibration of an older version is measured again by the
#: service; read back, it keeps its verdicts (its stored choices, or the tie band at every
#: budget before version 3).
CALIBRATION_VERSION: Final = 4
#: The one-sided confidence of the allowance on a held-out false-alarm rate (`allowance`): a
#: candidate passes when its held-out false alarms are within what `draws` groups at exactly
#: the promised rate would show this often.
HELD_OUT_CONFIDENCE: Final = 0.95
#: How far a held-out split can be trusted is counted in disjoint groups: a variation's held-out
#: half of T tokens in traces of L tokens on average holds T / max(budget, L) groups of the
#: budget that share no trace (a group is whole traces, the last cut). A choice is trusted
#: (`BudgetChoice.trusted`) where every variation's half holds at least 1 / rate of them, as many
#: as one false alarm needs to show at the promised rate; below that, resampled groups repeat
#: the same few traces and the held-out estimate is the bootstrap's guess: it can show a
#: candidate failing, not that one holds, so the tie band keeps deciding unless it failed.
#: The confidence of the upper bound on a variation's rate of traces holding a token outside
#: the tie band (`rare_event_floor`): a null that saw none of k such traces in N allows
#: about (k + 3) / N.
RARE_EVENT_CONFIDENCE: Final = 0.95

Ulps = npt.NDArray[np.float64]
_Name = TypeVar("_Name", bound=str)


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


#: Most picks (draws x traces) held in memory at once while drawing groups.
_CHUNK_PICKS: Final = 4_000_000


def _draw_layouts(
    lengths: npt.NDArray[np.int64], budget: int, draws: int, rng: np.random.Generator
) -> list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
    """The groups of `draw_group_scores`, as chunks of (picks (d, m): the traces each group
    takes in order, last (d,): the position of its last, cut, trace, take (d,): the tokens it
    takes of that one). Vectorised: each chunk's bootstrap populations and picks at once."""
    k = lengths.size
    block = int(np.ceil(budget / float(lengths.mean()) * 1.25)) + 8
    per_chunk = max(1, _CHUNK_PICKS // max(k, block))
    out = []
    for start in range(0, draws, per_chunk):
        d = min(per_chunk, draws - start)
        population = rng.integers(k, size=(d, k))
        picks = np.take_along_axis(population, rng.integers(k, size=(d, block)), axis=1)
        reach = np.cumsum(lengths[picks], axis=1)
        while (reach[:, -1] < budget).any():  # a group not filled yet: more picks for all
            more = np.take_along_axis(population, rng.integers(k, size=(d, block)), axis=1)
            picks = np.concatenate([picks, more], axis=1)
            reach = np.cumsum(lengths[picks], axis=1)
        last = (reach < budget).sum(axis=1)
        rows = np.arange(d)
        before = np.where(last > 0, reach[rows, np.maximum(last - 1, 0)], 0)
        out.append((picks, last, budget - before))
    return out


def _distinct_layouts(
    lengths: npt.NDArray[np.int64], budget: int, draws: int, rng: np.random.Generator
) -> list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
    """`_draw_layouts` of groups of distinct traces: each group takes the traces in a random
    order of its own, none twice, until it holds the budget (the traces must hold it)."""
    k = lengths.size
    if int(lengths.sum()) < budget:
        raise ValueError(f"groups of {budget} distinct traces' tokens from {lengths.sum()} tokens")
    per_chunk = max(1, _CHUNK_PICKS // k)
    out = []
    for start in range(0, draws, per_chunk):
        d = min(per_chunk, draws - start)
        picks = rng.permuted(np.tile(np.arange(k), (d, 1)), axis=1)
        reach = np.cumsum(lengths[picks], axis=1)
        last = (reach < budget).sum(axis=1)
        rows = np.arange(d)
        before = np.where(last > 0, reach[rows, np.maximum(last - 1, 0)], 0)
        out.append((picks, last, budget - before))
    return out


def draw_groups(
    token_scores: Mapping[_Name, Sequence[Ulps]],
    budget: int,
    draws: int,
    rng: np.random.Generator,
    *,
    distinct: bool = False,
) -> dict[_Name, Ulps]:
    """`draw_group_scores` of several per-token scores of the same traces (name -> one array
    per trace, the same lengths under every name): each name's scores of the same groups, so
    a rule over several statistics is measured on the groups it judges. `distinct`: groups as
    a provider's are, of distinct traces (no bootstrap, no trace twice in a group; the traces
    must hold the budget): held-out groups to measure false alarms on, not a null's draws."""
    names = list(token_scores)
    if not names:
        return {}
    first = token_scores[names[0]]
    keep = [i for i, s in enumerate(first) if len(s)]
    if not keep:
        raise ValueError("a null needs at least one trace with tokens")
    lengths = np.asarray([len(first[i]) for i in keep], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    prefix = {
        name: np.concatenate(
            [[0.0], np.cumsum(np.concatenate([np.asarray(token_scores[name][i]) for i in keep]))]
        )
        for name in names
    }
    totals = {name: c[starts + lengths] - c[starts] for name, c in prefix.items()}
    out: dict[_Name, list[Ulps]] = {name: [] for name in names}
    layouts = _distinct_layouts if distinct else _draw_layouts
    for picks, last, take in layouts(lengths, budget, draws, rng):
        rows = np.arange(picks.shape[0])
        whole = np.arange(picks.shape[1])[None, :] < last[:, None]
        cut = picks[rows, last]
        for name in names:
            c = prefix[name]
            full = np.where(whole, totals[name][picks], 0.0).sum(axis=1)
            part = c[starts[cut] + take] - c[starts[cut]]
            out[name].append((full + part) / budget)
    return {name: np.concatenate(chunks) for name, chunks in out.items()}


def draw_group_scores(
    token_scores: Sequence[Ulps], budget: int, draws: int, rng: np.random.Generator
) -> Ulps:
    """Scores of `draws` groups of exactly `budget` tokens, each made of whole traces drawn at
    random (with replacement, the last one cut) from a bootstrap resample of `token_scores` (per
    trace) drawn anew for each group, so that the groups' spread holds the uncertainty of the
    traces' own mean (docs/verify.md, "The null and the threshold", says why)."""
    return draw_groups({"score": token_scores}, budget, draws, rng)["score"]


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
    #: The tie band's rare-event floor at this budget (`rare_event_floor`): the least threshold
    #: the null can promise for rare, clustered out-of-band tokens. Measured, not applied to
    #: `threshold` yet (docs/verify.md); None for the other statistics and older calibrations.
    rare_event_floor: float | None = None


@dataclass(frozen=True)
class RuleBudget:
    """The combined rule (`Decision`) at one budget: each of `RULE_STATISTICS`' threshold at
    the false-alarm rate divided among them (the highest of the variations' quantiles), the
    measured false-alarm rate (the highest share of one variation's groups over any of the
    thresholds), the power against the alternative, and the variation that set each threshold."""

    tokens: int
    thresholds: dict[str, float]
    false_alarm: float
    power: float | None
    set_by: dict[str, str]


@dataclass(frozen=True)
class BudgetChoice:
    """The decision verdicts use at one budget (`CANDIDATES`), chosen by a held-out split of
    the null's traces (`choose`): each candidate's thresholds set on one half, its false alarms
    measured on the other half's groups, and the reverse (`held_out_false_alarm`: the worse of
    the two, the worst benign variation's); the most powerful candidate whose held-out false
    alarms are within `allowance` (the promised rate plus the sampling error of `draws`
    groups); the most conservative (fewest held-out false alarms) where none is (`passed`
    False). Where the halves cannot measure the budget (`trusted` False: `supply`, the
    disjoint groups of the budget that the worst supplied variation's held-out half holds, is
    below 1 / rate; under 1 that half does not hold one group), the tie band decides if it is
    within the allowance (a split too small to show a candidate holding still shows one
    failing), else the same rule among the others. `thresholds` and `power` are the chosen
    decision's, set on the whole null; `powers` every candidate's.

    From version 4 (`choose` says the rule): the plain tie band is eligible only where its
    threshold is at least `rare_event_guard` (the rare-event floor of the variations large
    enough to bound their rate of out-of-band traces below the rate); power ties go to the
    candidate with the higher mean power over the budgets up to this one; a candidate less
    powerful than the previous budget's choice is not taken where that one still passes; and
    where no held-out half holds the budget's tokens, the previous budget's decision carries
    on. `rare_event_guard` is None in older choices."""

    tokens: int
    decision: Decision
    thresholds: dict[str, float]
    power: float | None
    held_out_false_alarm: dict[str, float]
    powers: dict[str, float | None]
    allowance: float
    passed: bool
    supply: float
    trusted: bool
    rare_event_guard: float | None = None


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
    (None: the engine's default), and for sampled traces the sampler's recipe
    (`SamplingRecipe.to_json`: a `SamplingJson` without seed and device; absent: greedy, so a
    greedy claim's key is what it was before sampled traces were verified)."""

    dtype: str
    lm_head_dtype: str
    attn_kernel: str | None
    sampling: NotRequired[SamplingJson]


def claim_from_json(d: Mapping[str, Any]) -> Claim:
    """A stored claim (its `sampling` only where it has one)."""
    claim = Claim(
        dtype=str(d["dtype"]), lm_head_dtype=str(d["lm_head_dtype"]), attn_kernel=d["attn_kernel"]
    )
    if d.get("sampling") is not None:
        claim["sampling"] = d["sampling"]
    return claim


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
    #: The largest budget the null backs (`null_reach`; None: not even the smallest).
    reach: int | None = None
    #: The combined rule per budget (empty in calibrations made before it).
    rule: list[RuleBudget] = field(default_factory=list)
    #: What its verdicts use: `decision_of` (`per_budget` where `choices` are measured; older
    #: calibrations: the tie band at every budget, as they decided).
    decision: CalibrationDecision = "outside_tie_band"
    #: The decision per budget and its held-out false alarms (empty before version 3).
    choices: list[BudgetChoice] = field(default_factory=list)

    def backs(self, tokens: int) -> bool:
        """Whether the null backs a group of `tokens` tokens (`null_reach` says the rule)."""
        return self.reach is not None and tokens <= self.reach

    def _fit(self, tokens: int) -> int:
        """The budget a group of `tokens` is judged at: the largest calibrated budget <= tokens
        and within the null's reach (every statistic is a mean, whose null spreads less with
        more tokens, so a smaller budget's threshold is the cautious one); the smallest for
        fewer tokens."""
        return min(tokens, self.reach) if self.reach is not None else 0

    def at(self, tokens: int, statistic: Statistic | None = None) -> BudgetCalibration:
        """The calibration of `statistic` at the budget a group of `tokens` is judged at."""
        rows = self.budgets[statistic or self.statistic]
        fit = [b for b in rows if b.tokens <= self._fit(tokens)]
        return fit[-1] if fit else rows[0]

    def rule_at(self, tokens: int) -> RuleBudget:
        """The combined rule at the budget a group of `tokens` is judged at."""
        fit = [b for b in self.rule if b.tokens <= self._fit(tokens)]
        return fit[-1] if fit else self.rule[0]

    def _per_budget(self) -> bool:
        return self.decision == "per_budget" and bool(self.choices)

    def decision_at(self, tokens: int) -> tuple[Decision, dict[str, float]]:
        """What decides a group of `tokens` and its thresholds (statistic -> threshold; over
        any of them is inconsistent), at the budget the group is judged at."""
        if self._per_budget():
            fit = [c for c in self.choices if c.tokens <= self._fit(tokens)]
            choice = fit[-1] if fit else self.choices[0]
            return choice.decision, dict(choice.thresholds)
        fixed = self.decision if self.decision != "per_budget" else "outside_tie_band"
        if fixed == "tie_band_or_mean_deficit" and not self.rule:
            fixed = "outside_tie_band"  # stored before the rule was measured
        if fixed == "tie_band_or_mean_deficit":
            return fixed, dict(self.rule_at(tokens).thresholds)
        if fixed == "outside_tie_band_floored":
            row = self.at(tokens, "outside_tie_band")
            return fixed, {"outside_tie_band": max(row.threshold, row.rare_event_floor or 0.0)}
        return fixed, {fixed: self.at(tokens, fixed).threshold}

    def tokens_needed(self, statistic: Statistic | None = None) -> int | None:
        """The smallest budget whose power against the alternative reaches `POWER` (None:
        none calibrated does): of `statistic`, else of what verdicts decide by (per budget:
        the decision chosen there)."""
        rows: Sequence[BudgetCalibration | RuleBudget | BudgetChoice]
        if statistic is None and self._per_budget():
            rows = self.choices
        elif statistic is None and self.decision == "tie_band_or_mean_deficit" and self.rule:
            rows = self.rule
        else:
            rows = self.budgets[statistic or self.statistic]
        for b in rows:
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

        variations = [Variation(**v) for v in data["variations"]]
        budgets = {k: [BudgetCalibration(**b) for b in rows] for k, rows in data["budgets"].items()}
        calibrated = [b.tokens for b in next(iter(budgets.values()), [])]
        return cls(
            weights_sha256=str(data["weights_sha256"]),
            claim=claim_from_json(data["claim"]),
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
            budgets=budgets,
            variations=variations,
            alternative=variation(data.get("alternative")),
            statistic=data.get("statistic", VERDICT_STATISTIC),
            version=int(data.get("version", 1)),
            notes=list(data.get("notes", [])),
            null_prompts=data.get("null_prompts"),
            null_max_new_tokens=data.get("null_max_new_tokens"),
            # Stored before the reach was: the same rule on what they stored.
            reach=data["reach"] if "reach" in data else null_reach(variations, calibrated),
            rule=[RuleBudget(**r) for r in data.get("rule", [])],
            decision=data.get("decision", "outside_tie_band"),
            choices=[BudgetChoice(**c) for c in data.get("choices", [])],
        )


def poisson_upper(k: int, confidence: float) -> float:
    """The exact upper confidence bound on a Poisson mean that showed `k` events: the mean
    whose probability of k events or fewer is 1 - `confidence` (k = 0 at 95%: 3.0)."""
    if k < 0 or not 0.0 < confidence < 1.0:
        raise ValueError("k >= 0 and a confidence between 0 and 1")

    def cdf(lam: float) -> float:  # P(Poisson(lam) <= k), summed in log space
        logs = [i * math.log(lam) - lam - math.lgamma(i + 1) for i in range(k + 1)]
        top = max(logs)
        return math.exp(top) * sum(math.exp(x - top) for x in logs)

    lo, hi = 0.0, k + 10.0 * math.sqrt(k + 1.0) + 10.0
    for _ in range(100):  # cdf falls with lam: bisect to cdf = 1 - confidence
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if cdf(mid) > 1.0 - confidence else (lo, mid)
    return hi


def rare_event_floor(
    null: Mapping[str, Sequence[Ulps]],
    budget: int,
    rate: float,
    draws: int,
    rng: np.random.Generator,
) -> tuple[float, str]:
    """The tie band's threshold that a null of few out-of-band tokens can promise at `budget`
    (per-token tie-band scores, 0 or 1, variation -> one array per trace), and the variation
    that sets it.

    Tokens outside the band come rarely and in clusters (a trace that goes off holds several),
    so at a large budget a group's score is the few such traces it happens to hold, and a
    null's bootstrap sees only the clusters it drew: 1.6 M benign SmolLM2 tokens held 8, and a
    threshold from half of them false-alarmed on 5.5% of the other half's groups of 131,072
    (BENCHMARKS.md). Here, per variation, a group of `budget` tokens holds a Poisson number of
    such traces at the upper `RARE_EVENT_CONFIDENCE` bound of the variation's rate of them
    (`poisson_upper`: a variation that showed none still allows some), each holding as many as
    one of the null's own such traces, of any variation, drawn at random (one token where the
    null shows none); the floor is the highest of the (1 - `rate`) quantiles of the variations
    that hold the budget's tokens (`rare_event_draws`). At a small budget it is 0 and the
    draws' quantile sets the threshold alone."""
    floors = {
        name: float(np.quantile(s, 1.0 - rate, method="higher"))
        for name, s in rare_event_draws(null, budget, draws, rng).items()
    }
    set_by = max(floors, key=lambda name: floors[name])
    return floors[set_by], set_by


def rare_event_draws(
    null: Mapping[str, Sequence[Ulps]], budget: int, draws: int, rng: np.random.Generator
) -> dict[str, Ulps]:
    """The draws of `rare_event_floor` per variation (the scores of `draws` groups of `budget`
    tokens holding the rare out-of-band traces its upper rate allows), so that floors at
    several rates, and over some of the variations, come from the same draws. Only the
    variations that hold at least the budget's tokens are drawn (all where none does), as only
    they are measured at that budget (`held_out_false_alarms`, `null_reach`): a variation of a
    few traces allows a high rate (3 / N with none seen), which would set the floor at budgets
    it cannot back anyway (calibrations before version 4 drew every variation)."""
    counts = {
        name: np.asarray([float(np.sum(u)) for u in traces if len(u)])
        for name, traces in null.items()
    }
    counts = {name: c for name, c in counts.items() if c.size}
    clusters = np.concatenate([c[c > 0] for c in counts.values()] or [np.zeros(0)])
    sizes, seen = np.unique(clusters if clusters.size else np.ones(1), return_counts=True)
    holding = {n: c for n, c in counts.items() if sum(len(u) for u in null[n]) >= budget}
    out: dict[str, Ulps] = {}
    for name, c in (holding or counts).items():
        tokens = sum(len(u) for u in null[name])
        per_trace = poisson_upper(int(np.count_nonzero(c)), RARE_EVENT_CONFIDENCE) / c.size
        held = rng.poisson(per_trace * budget / (tokens / c.size), size=draws)
        # how many of each size the held traces are (a multinomial per draw), then their tokens
        sums = rng.multinomial(held, seen / seen.sum()) @ sizes
        out[name] = np.asarray(sums / budget, dtype=np.float64)
    return out


def guard_traces(rate: float) -> int:
    """The fewest traces a variation needs for the rare-event guard (`RareEvents`): the
    fewest whose upper bound on a rate of out-of-band traces, having seen none, is within
    `rate` per trace (`poisson_upper`(0) / rate: 300 at 1%). A smaller variation's floor is
    above 0 at every budget whatever it holds: it cannot tell where the tie band's threshold
    stops being backed."""
    return math.ceil(poisson_upper(0, RARE_EVENT_CONFIDENCE) / rate)


@dataclass(frozen=True)
class RareEvents:
    """The tie band's rare-event figures at one budget, from one set of draws
    (`rare_event_draws`): the floor at the rate (`rare_event_floor`), at half the rate (the
    floored tie band's share in `floored_or_mean_deficit`), and the guard: the floor at the
    rate over the variations of at least `guard_traces` traces (0 where none is that large).
    Where the plain tie band's threshold is below the guard, a group holds more out-of-band
    traces than the threshold allows in more than `rate` of groups at the upper bound of the
    rate such traces came at in those variations: the null cannot back that threshold."""

    floor: float
    half: float
    guard: float

    @classmethod
    def measure(
        cls,
        null: Mapping[str, Sequence[Ulps]],
        budget: int,
        rate: float,
        draws: int,
        rng: np.random.Generator,
    ) -> RareEvents:
        drawn = rare_event_draws(null, budget, draws, rng)

        def q(names: Sequence[str], r: float) -> float:
            return max(
                (float(np.quantile(drawn[n], 1.0 - r, method="higher")) for n in names),
                default=0.0,
            )

        need = guard_traces(rate)
        large = [n for n in drawn if sum(1 for u in null[n] if len(u)) >= need]
        return cls(floor=q(list(drawn), rate), half=q(list(drawn), rate / 2), guard=q(large, rate))


def null_reach(variations: Sequence[Variation], budgets: Sequence[int]) -> int | None:
    """The largest of `budgets` the null backs: one that every benign variation holds at least
    as many tokens as (None: no budget is backed, or no variation was measured). Beyond it a
    group's tokens would outnumber one variation's: its groups would be resamples of the same
    few traces, their spread the bootstrap's guess of how far the null's own mean may be off,
    not measured on other prompts (docs/verify.md, "How far a null reaches")."""
    if not variations:
        return None
    least = min(v.tokens for v in variations)
    fit = [b for b in budgets if b <= least]
    return max(fit) if fit else None


def decision_of(choices: Sequence[BudgetChoice]) -> CalibrationDecision:
    """What a new calibration's verdicts use: `DECISION`, the tie band alone where no decision
    per budget was chosen."""
    return DECISION if choices else "outside_tie_band"


def allowance(rate: float, draws: int, confidence: float = HELD_OUT_CONFIDENCE) -> float:
    """The largest held-out false-alarm rate a candidate passes with (`BudgetChoice`): the
    share of `draws` groups that groups at exactly `rate` stay within with probability
    `confidence` (the binomial quantile: 15 of 1,000 at 1%), so a candidate that keeps the
    rate is rejected for its sampling error about 1 time in 20, per variation and half."""
    if draws < 1 or not 0.0 < rate < 1.0:
        raise ValueError("draws >= 1 and a rate between 0 and 1")
    k = 0
    while binom_cdf(k, draws, rate) < confidence:
        k += 1
    return k / draws


def candidate_thresholds(
    drawn: Mapping[str, Mapping[Statistic, Ulps]], events: RareEvents, rate: float
) -> dict[Decision, dict[str, float]]:
    """Each of `CANDIDATES`' thresholds (statistic -> threshold) from groups drawn per
    variation (variation -> statistic -> group scores) and the tie band's rare-event floors
    (`RareEvents`): the highest of the variations' (1 - rate) quantiles; the two-statistic
    rule's at rate / 2 each, its tie band at the floor at rate / 2."""

    def q(stat: Statistic, r: float) -> float:
        return max(float(np.quantile(d[stat], 1.0 - r, method="higher")) for d in drawn.values())

    band = q("outside_tie_band", rate)
    split = rate / len(RULE_STATISTICS)
    return {
        "outside_tie_band": {"outside_tie_band": band},
        "outside_tie_band_floored": {"outside_tie_band": max(band, events.floor)},
        "floored_or_mean_deficit": {
            "outside_tie_band": max(q("outside_tie_band", split), events.half),
            "mean_deficit_ulps": q("mean_deficit_ulps", split),
        },
        "mean_deficit_ulps": {"mean_deficit_ulps": q("mean_deficit_ulps", rate)},
    }


def flags(
    thresholds: Mapping[str, float], groups: Mapping[Statistic, Ulps]
) -> npt.NDArray[np.bool_]:
    """Which groups a decision's thresholds call inconsistent: any statistic over its own."""
    over = [groups[stat] > t for stat, t in thresholds.items()]  # type: ignore[index]
    return np.asarray(np.logical_or.reduce(over), dtype=bool)


TokenScores = Mapping[str, Mapping[Statistic, Sequence[Ulps]]]


def split_halves(
    null: Mapping[str, Sequence[Ulps]], rng: np.random.Generator
) -> tuple[dict[str, list[Ulps]], dict[str, list[Ulps]]]:
    """The null's traces in two halves at random by position, the same positions in every
    variation (a null generates each variation from the same prompts in the same order, so a
    prompt's traces fall in one half); traces without tokens left out."""
    longest = max((len(t) for t in null.values()), default=0)
    side = rng.permutation(longest) % 2
    a: dict[str, list[Ulps]] = {}
    b: dict[str, list[Ulps]] = {}
    for name, traces in null.items():
        a[name] = [u for i, u in enumerate(traces) if len(u) and side[i] == 0]
        b[name] = [u for i, u in enumerate(traces) if len(u) and side[i] == 1]
    return a, b


def held_out_false_alarms(
    fit: TokenScores,
    test: TokenScores,
    budget: int,
    rate: float,
    draws: int,
    rng: np.random.Generator,
) -> tuple[dict[Decision, float], float]:
    """Each candidate's false-alarm rate on `test`'s groups of `budget` tokens at thresholds set
    on `fit`'s (both variation -> statistic -> per-trace token scores; groups drawn as the
    calibration draws them, `draw_groups`, one variation at a time): the worst of the
    variations whose `test` traces hold at least the budget's tokens (all where none does);
    and the supply: the fewest disjoint groups of the budget a variation's `test` traces hold
    (its tokens over the larger of the budget and its mean trace length)."""
    drawn = {name: draw_groups(v, budget, draws, rng) for name, v in fit.items()}
    band = {name: v["outside_tie_band"] for name, v in fit.items()}
    thresholds = candidate_thresholds(
        drawn, RareEvents.measure(band, budget, rate, draws, rng), rate
    )
    lengths = {name: [len(u) for u in v["outside_tie_band"]] for name, v in test.items()}
    tokens = {name: sum(x) for name, x in lengths.items()}
    measured = [name for name, t in tokens.items() if t >= budget] or list(tokens)
    held = {name: draw_groups(test[name], budget, draws, rng) for name in measured}
    fa = {
        c: max(float(flags(t, groups).mean()) for groups in held.values())
        for c, t in thresholds.items()
    }
    supply = min(t / max(budget, t / len(lengths[name])) for name, t in tokens.items())
    return fa, supply


def choose(
    tokens: int,
    thresholds: Mapping[Decision, dict[str, float]],
    powers: Mapping[Decision, float | None],
    held_out: Mapping[Decision, float],
    rate: float,
    limit: float,
    supply: float,
    *,
    guard: float | None = None,
    curve: Mapping[Decision, float] | None = None,
    previous: Decision | None = None,
    measured: bool = True,
) -> BudgetChoice:
    """The decision at one budget (`BudgetChoice` says the rule): `thresholds` and `powers` on
    the whole null, `held_out` each candidate's held-out false alarms, `limit` the allowance,
    `supply` the held-out halves' (`held_out_false_alarms`).

    Version 4's rules, each off where its argument is None:

    - `guard` (`RareEvents.guard`): the plain tie band is eligible only where its threshold is
      at least the guard;
    - `curve`: each candidate's mean power over the budgets up to this one, which breaks ties
      of power here (against the 4-bit alternative every candidate reaches 1.0 at large
      budgets; the one that got there with fewer tokens sees weaker changes at this budget);
    - `previous`: the decision chosen at the budget below; where it is eligible and passes
      here, nothing of less power (then curve) is chosen; where the split cannot measure this
      budget at all (`measured` False: no variation's held-out half holds its tokens, so every
      held-out group would be a resample of fewer traces than the budget, the bootstrap's
      guess, worst on the smallest variations), it carries on.
    """
    order = {c: i for i, c in enumerate(CANDIDATES)}
    trusted = supply >= 1.0 / rate

    def eligible(c: Decision) -> bool:
        return guard is None or c != "outside_tie_band" or thresholds[c][c] >= guard

    def strength(c: Decision) -> tuple[float, float]:
        return (powers[c] or 0.0, curve[c] if curve is not None else 0.0)

    candidates = [c for c in CANDIDATES if eligible(c)]
    ok = [c for c in candidates if held_out[c] <= limit]
    if previous is not None and previous in ok:
        ok = [c for c in ok if strength(c) >= strength(previous)]
    if previous is not None and not measured and previous in candidates:
        chosen = previous
    elif not trusted and CANDIDATES[0] in ok:
        chosen = CANDIDATES[0]
    elif ok:
        chosen = max(ok, key=lambda c: (*strength(c), -held_out[c], -order[c]))
    else:
        chosen = min(candidates, key=lambda c: (held_out[c], order[c]))
    return BudgetChoice(
        tokens=tokens,
        decision=chosen,
        thresholds=dict(thresholds[chosen]),
        power=powers[chosen],
        held_out_false_alarm={c: held_out[c] for c in CANDIDATES},
        powers={c: powers[c] for c in CANDIDATES},
        allowance=limit,
        passed=held_out[chosen] <= limit,
        supply=supply,
        trusted=trusted,
        rare_event_guard=guard,
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
    time), with its measured false-alarm rate, power, and the variation that set it; the
    combined rule's (`RuleBudget`) on the same groups. Budgets beyond the null's reach
    (`null_reach`) are calibrated too (their power is the power curve's) but verdicts never
    use their thresholds (`Calibration.at`)."""
    if not 0.0 < false_alarm_rate < 1.0:
        raise ValueError("the false-alarm rate is between 0 and 1")
    pooled = [u for traces in null.values() for u in traces]
    scorer = TokenScorer(tuple(bin_probabilities(pooled)), tuple(bin_probabilities(alternative)))
    rng = np.random.default_rng(seed)
    per_variation = {
        name: {stat: [scorer.scores(u, stat) for u in traces if len(u)] for stat in STATISTICS}
        for name, traces in null.items()
    }
    per_variation = {name: v for name, v in per_variation.items() if v[VERDICT_STATISTIC]}
    if not per_variation:
        raise ValueError("a null needs at least one trace with tokens")
    alt_scores = {
        stat: [scorer.scores(u, stat) for u in alternative if len(u)] for stat in STATISTICS
    }
    split = false_alarm_rate / len(RULE_STATISTICS)
    table: dict[str, list[BudgetCalibration]] = {stat: [] for stat in STATISTICS}
    rule: list[RuleBudget] = []
    choices: list[BudgetChoice] = []
    # The held-out split that chooses each budget's decision: variations with traces in both.
    halves = split_halves(null, rng)
    both = [n for n in per_variation if halves[0].get(n) and halves[1].get(n)]
    fit, test = (
        {name: {s: [scorer.scores(u, s) for u in h[name]] for s in STATISTICS} for name in both}
        for h in halves
    )
    limit = allowance(false_alarm_rate, draws)
    # The largest budget both halves can measure: some variation's half holds its tokens.
    holds = min(
        max((sum(len(u) for u in v["outside_tie_band"]) for v in h.values()), default=0)
        for h in (fit, test)
    )
    history: dict[Decision, list[float]] = {c: [] for c in CANDIDATES}  # each one's power curve
    for n in budgets:
        # Every statistic scores the same groups: the rule is measured on the groups it judges.
        drawn = {name: draw_groups(v, n, draws, rng) for name, v in per_variation.items()}
        alt = draw_groups(alt_scores, n, draws, rng) if alt_scores[VERDICT_STATISTIC] else None
        band = {name: v["outside_tie_band"] for name, v in per_variation.items()}
        events = RareEvents.measure(band, n, false_alarm_rate, draws, rng)
        floor = events.floor
        for statistic in STATISTICS:
            one = {name: d[statistic] for name, d in drawn.items()}
            quantiles = {
                name: float(np.quantile(d, 1.0 - false_alarm_rate, method="higher"))
                for name, d in one.items()
            }
            set_by = max(quantiles, key=lambda name: quantiles[name])
            threshold = quantiles[set_by]
            every = np.concatenate(list(one.values()))
            table[statistic].append(
                BudgetCalibration(
                    tokens=n,
                    threshold=threshold,
                    null_mean=float(every.mean()),
                    null_quantiles=[float(q) for q in np.quantile(every, QUANTILES)],
                    false_alarm=max(float((d > threshold).mean()) for d in one.values()),
                    power=None if alt is None else float((alt[statistic] > threshold).mean()),
                    set_by=set_by,
                    rare_event_floor=floor if statistic == "outside_tie_band" else None,
                )
            )
        thresholds: dict[str, float] = {}
        setters: dict[str, str] = {}
        for statistic in RULE_STATISTICS:
            q = {
                name: float(np.quantile(d[statistic], 1.0 - split, method="higher"))
                for name, d in drawn.items()
            }
            setters[statistic] = max(q, key=lambda name: q[name])
            thresholds[statistic] = q[setters[statistic]]

        def over(
            d: Mapping[Statistic, Ulps], t: dict[str, float] = thresholds
        ) -> npt.NDArray[np.bool_]:
            return np.asarray(
                np.logical_or.reduce([d[stat] > t[stat] for stat in RULE_STATISTICS]), dtype=bool
            )

        rule.append(
            RuleBudget(
                tokens=n,
                thresholds=thresholds,
                false_alarm=max(float(over(d).mean()) for d in drawn.values()),
                power=None if alt is None else float(over(alt).mean()),
                set_by=setters,
            )
        )
        if both:
            whole = candidate_thresholds(drawn, events, false_alarm_rate)
            powers = {
                c: None if alt is None else float(flags(t, alt).mean()) for c, t in whole.items()
            }
            for c in CANDIDATES:
                history[c].append(powers[c] or 0.0)
            ab = held_out_false_alarms(fit, test, n, false_alarm_rate, draws, rng)
            ba = held_out_false_alarms(test, fit, n, false_alarm_rate, draws, rng)
            worse = {c: max(ab[0][c], ba[0][c]) for c in CANDIDATES}
            supply = min(ab[1], ba[1])
            choice = choose(
                n,
                whole,
                powers,
                worse,
                false_alarm_rate,
                limit,
                supply,
                guard=events.guard,
                curve={c: float(np.mean(history[c])) for c in CANDIDATES},
                previous=choices[-1].decision if choices else None,
                measured=holds >= n,
            )
            choices.append(choice)

    def summary(name: str, traces: Sequence[Ulps]) -> Variation:
        return Variation(
            name=name,
            traces=len(traces),
            tokens=int(sum(len(u) for u in traces)),
            scores={s: scorer.score(traces, s) for s in STATISTICS},
        )

    variations = [summary(name, traces) for name, traces in null.items()]
    return Calibration(
        weights_sha256=weights_sha256,
        claim=claim,
        platform=platform,
        false_alarm_rate=false_alarm_rate,
        scorer=scorer,
        budgets=table,
        variations=variations,
        alternative=summary(alternative_name, alternative) if alternative else None,
        reach=null_reach([v for v in variations if v.tokens], budgets),
        rule=rule,
        decision=decision_of(choices),
        choices=choices,
    )


@dataclass(frozen=True)
class GroupVerdict:
    """The verdict on one group's logged tokens against a calibration.

    score / threshold      the group's statistic and the threshold at its budget
    effect_size            score minus the null's mean at that budget (the statistic's units)
    closest_benign         the benign variation whose mean token score is nearest the group's
    tokens_needed          tokens the calibration needs for a decision (power >= POWER)
    more_tokens            for `insufficient`: how many more tokens that is
    decision               what decided at the group's budget (`Decision`): a statistic
                           alone, the combined rule, or the tie band at its rare-event floor;
                           with a per-budget calibration, the decision chosen at that budget
    decided_by             the statistic over its threshold (None: none was); with the combined
                           rule, `statistic`, `score` and `threshold` are its figures
    null_reach             the largest budget the null backs (`Calibration.reach`)
    beyond_null_reach      the group holds more tokens than that: judged at the reach's
                           threshold (the cautious one), its false-alarm rate not measured at
                           its own size
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
    decision: Decision = "outside_tie_band"
    decided_by: Statistic | None = None
    null_reach: int | None = None
    beyond_null_reach: bool = False


def verdict(
    traces: Sequence[Ulps], calibration: Calibration, statistic: Statistic | None = None
) -> GroupVerdict:
    """The verdict on a group (its traces' per-token deficits in ulps): `inconsistent` when the
    score exceeds the threshold of what decides at the group's budget
    (`Calibration.decision_at`: with the combined rule, when either of its statistics exceeds
    its own); else `consistent` when the group has at least the tokens a decision needs,
    `insufficient` (with how many more) otherwise. A group beyond the null's reach is judged at
    the reach's budget and says so (`beyond_null_reach`). `statistic`: judge by that statistic
    alone."""
    n = int(sum(len(u) for u in traces))
    scorer = calibration.scorer
    scores = {s: scorer.score(traces, s) if n else float("nan") for s in STATISTICS}
    decision: Decision
    thresholds: dict[str, float]
    if statistic is not None:
        decision, thresholds = statistic, {statistic: calibration.at(n, statistic).threshold}
        needed = calibration.tokens_needed(statistic)
    else:
        decision, thresholds = calibration.decision_at(n)
        needed = calibration.tokens_needed()
    # In the decision's own order (the combined rule: the tie band first).
    judged = [x for s in thresholds for x in STATISTICS if x == s]
    over = [s for s in judged if n and scores[s] > thresholds[s]]
    stat: Statistic = over[0] if over else judged[0]
    threshold = thresholds[stat]
    cal = calibration.at(n, stat)
    score = scores[stat]
    closest = None
    if n and calibration.variations:
        closest = min(calibration.variations, key=lambda v: abs(v.scores[stat] - score))
    if over:
        result: Verdict = "inconsistent"
    elif n and needed is not None and n >= needed:
        result = "consistent"
    else:
        result = "insufficient"
    return GroupVerdict(
        verdict=result,
        statistic=stat,
        score=score,
        threshold=threshold,
        false_alarm_rate=calibration.false_alarm_rate,
        tokens=n,
        traces=len(traces),
        budget=cal.tokens,
        effect_size=score - cal.null_mean if n else float("nan"),
        fraction_outside_tie_band=scores["outside_tie_band"],
        mean_deficit_ulps=scores["mean_deficit_ulps"],
        closest_benign=closest.name if closest else None,
        closest_benign_score=closest.scores[stat] if closest else None,
        tokens_needed=needed,
        more_tokens=None if result != "insufficient" or needed is None else max(needed - n, 0),
        null_quantiles=cal.null_quantiles,
        decision=decision,
        decided_by=over[0] if over else None,
        null_reach=calibration.reach,
        beyond_null_reach=bool(n) and not calibration.backs(n),
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
