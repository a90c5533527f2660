"""The paper's tiers and the recommended action, from the pair's both-arms C lift and its
paired interval. Pure.

The paper's cross-model table (Appendix, Table `tab:cross_model_sweep`) groups models by
Intervention C's EAR lift: Tier 1 large (+22 to +36 pp), Tier 2 small but non-zero (+3 to
+10 pp), Tier 3 zero (BF16-saturated, body-dominated). Here the measured lift and its 95%
paired bootstrap interval decide: Tier 3 where the interval reaches 0 (C is not shown to help
at this n), else Tier 1 from `LARGE_LIFT` (0.15, midway between the paper's Tier 2 top and
Tier 1 bottom), else Tier 2. With no divergence in the pair's baseline: no tier.
"""

from __future__ import annotations

from typing import Final

from replay_audit.screenings.sweep.density import format_tau
from replay_audit.screenings.sweep.report import CategoryLift, TauCalibrationRead, TierRead
from replay_audit.stats.report import ComparisonReport, LiftReport
from replay_audit.words import counted

LARGE_LIFT: Final = 0.15
#: A calibrated τ that gates more steps than this is not recommended (the paper's gated C
#: triggers on a few percent of steps; ungated recompute hurts, §"Why ungated recomputation
#: hurts").
MAX_TRIGGER_RATE: Final = 0.1
#: Batch sizes above this are outside C's scope in the paper (Appendix on batch size).
C_MAX_BATCH: Final = 4


def _pp(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f} pp"


def choose_tier(
    baseline: ComparisonReport,
    lift: LiftReport | None,
    categories: list[CategoryLift],
    calibration: list[TauCalibrationRead],
    *,
    pair_format: str,
    tau: float,
    body_remedy_ear: float | None,
    batch_divergence: bool,
) -> TierRead:
    """The tier, the action and its evidence. `body_remedy_ear`: EAR of the storage-vs-compute
    knob (BF16-stored, FP32 compute) against the reference where measured; `batch_divergence`:
    whether some batch size > 1 diverged from the reference."""
    n = baseline.ok
    diverged = n - baseline.ear.successes
    caveats = [
        "Tiers are the paper's empirical regimes on its models and GPUs (A10G, L4, A100), "
        "not a guaranteed taxonomy; the lift and CV(TD) must be recalibrated per platform.",
    ]
    if batch_divergence:
        caveats.append(
            f"Batch shape changes outputs here; in the paper C alone helps only at batch size <= "
            f"{C_MAX_BATCH} (composition with a body-scope method at 8)."
        )
    cal = next((c for c in calibration if c.format == pair_format), None)
    tau_text = ""
    if cal is not None and cal.tau is not None and (cal.trigger_rate or 0.0) > MAX_TRIGGER_RATE:
        tau_text = (
            f" The τ covering {cal.cover:.0%} of the {pair_format} flips here "
            f"({format_tau(cal.tau)}) would gate {cal.trigger_rate:.0%} of steps: those flips "
            f"include body-dominated ones no gate should chase; keep τ = {tau:g} or calibrate "
            "on more prompts."
        )
    elif cal is not None and cal.tau is not None:
        rate = "-" if cal.trigger_rate is None else f"{cal.trigger_rate:.2%}"
        tau_text = (
            f" τ = {format_tau(cal.tau)} (absolute) covers {cal.cover:.0%} of the {cal.flips} "
            f"{pair_format} flips measured here at a trigger rate of {rate}"
        )
        if cal.tau_ulps is not None:
            tau_text += (
                f"; format-scaled: τ = {format_tau(cal.tau_ulps)} ulps (use this for FP8 heads)"
            )
        tau_text += "."
    if n == 0:
        return TierRead(
            tier=None,
            name="pair not measured",
            lift=None,
            low=None,
            high=None,
            n=0,
            diverged=0,
            evidence="The pair's runs did not complete on this platform (see the knobs' "
            "reasons): C's lift is unknown here.",
            action="Pin the serving precision; screen the pair where both of its formats run.",
            caveats=caveats,
        )
    if diverged == 0 or lift is None or lift.lift is None:
        return TierRead(
            tier=None,
            name="no divergence measured",
            lift=None if lift is None else lift.lift,
            low=None if lift is None else lift.low,
            high=None if lift is None else lift.high,
            n=n,
            diverged=diverged,
            evidence=(
                f"None of the {n} prompts diverged between the pair's arms "
                f"(divergence rate 95% upper bound {1 - baseline.ear.low:.1%}): there is nothing "
                "for C to repair at this n."
            ),
            action="Pin the serving precision anyway; screen with more prompts and longer "
            "outputs before relying on cross-precision replay.",
            caveats=caveats,
        )
    by = {c.category: c for c in categories}
    head, body, kv = (by.get(k) for k in ("head_reachable", "body_dominated", "kv_dependent"))
    shares = ", ".join(
        f"{c.category.replace('_', ' ')} {c.n} (C fixed {c.fixed})" for c in categories
    )
    evidence = (
        f"Both-arms C lift {_pp(lift.lift)} (95% paired bootstrap [{_pp(lift.low)}, "
        f"{_pp(lift.high)}], n = {lift.n}, fixed {lift.fixed}, broke {lift.broke}, McNemar "
        f"p = {lift.mcnemar_p:.3g}); {diverged} of {n} prompts diverged at baseline: {shares}."
    )
    low = lift.low if lift.low is not None else 0.0
    if low > 0 and lift.lift >= LARGE_LIFT:
        tier, name = 1, "Tier 1: large lift"
        action = (
            "Pin the serving precision; where cross-precision replay must agree, enable gated C."
        )
    elif low > 0:
        tier, name = 2, "Tier 2: small but positive lift"
        action = (
            "Pin the serving precision; gated C repairs a minority of divergences (enable it "
            "where replay must agree); the rest needs a body-scope remedy (FP32 compute of the "
            "stored weights, LayerCast-style) to be evaluated."
        )
    else:
        tier, name = 3, "Tier 3: C not shown to help"
        action = (
            "Pin the serving precision. Gated C did not measurably raise agreement here; if "
            "cross-precision reproducibility is required, evaluate a body-scope remedy (FP32 "
            "compute of the stored weights, LayerCast-style) or training-time precision."
        )
        if (body is None or body.n == 0) and head is not None and head.n > 0:
            caveats.append(
                "The divergences are head-reachable but the interval reaches 0: more prompts "
                "may show a lift (the interval is wide at this n)."
            )
    if tier in (1, 2) and tau_text:
        action += tau_text
    if body_remedy_ear is not None:
        evidence += (
            f" Storage vs compute (16-bit-stored weights computed in FP32) agrees with the "
            f"reference on {body_remedy_ear:.0%} of prompts."
        )
    if kv is not None and kv.n:
        caveats.append(
            f"{counted(kv.n, 'divergence')} {'is' if kv.n == 1 else 'are'} KV-dependent: the gate "
            "fires but the flip needs the precision-specific KV cache, so C may not reach them."
        )
    return TierRead(
        tier=tier,
        name=name,
        lift=lift.lift,
        low=lift.low,
        high=lift.high,
        n=n,
        diverged=diverged,
        evidence=evidence,
        action=action,
        caveats=caveats,
    )
