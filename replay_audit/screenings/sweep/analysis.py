"""The screening report, computed from stored outputs only (no engine): comparisons through
the one statistics builder (`stats/report.py`), trigger density and CV(TD), margin
distributions, the τ calibration, the hidden-state gap and the tier. Pure.

docs/screening.md says how each number is computed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from replay_audit.diff import first_divergence, judge, length_difference
from replay_audit.formats import CATEGORIES, Category, HeadDType
from replay_audit.screenings.sweep.density import (
    coefficient_of_variation,
    covering_tau,
    trigger_density,
)
from replay_audit.screenings.sweep.outputs import Probe, RunOutput, ScreenOutputs, ScreenPrompt
from replay_audit.screenings.sweep.plan import ComparisonSpec, Run, SweepPlan
from replay_audit.screenings.sweep.report import (
    CategoryLift,
    HiddenGapRead,
    KnobResult,
    KnobValueResult,
    MarginDistributionRead,
    PairResult,
    ScreeningReport,
    TauCalibrationRead,
    TriggerDensityRead,
)
from replay_audit.screenings.sweep.tier import choose_tier
from replay_audit.stats.report import (
    ComparisonInput,
    ComparisonReport,
    ResultFigures,
    log_axis,
    margin_histogram,
    run_statistics,
)
from replay_audit.stats.summary import finite_distribution


def _prompt_figures(
    i: int,
    prompt: ScreenPrompt,
    spec: ComparisonSpec,
    a: RunOutput,
    b: RunOutput,
    probe: Probe | None,
    plan: SweepPlan,
) -> ResultFigures:
    """One prompt of one comparison, as the statistics builder reads a result row."""
    da, db = a.decodes[i], b.decodes[i]
    t = first_divergence(da.output_ids, db.output_ids)
    ma = mb = None
    category: Category | None = "agreed"
    if t is not None:
        # The one outcome rule (the replay pipeline's): each run's single-step re-run at t* ran
        # its whole computation, intervention included (`runner.probe_comparison`).
        ma, mb = da.margin_at(t), db.margin_at(t)
        category = judge(
            ma,
            mb,
            format_a=spec.a.config.head_dtype,
            format_b=spec.b.config.head_dtype,
            gate=plan.gate,
            rerun_a=None if probe is None else probe.token_a,
            rerun_b=None if probe is None else probe.token_b,
        ).category
    # No category where the gate fires and the single-step re-run is missing.
    status = "ok" if category is not None else "failed"
    finite_b = db.margins[np.isfinite(db.margins)]
    return ResultFigures(
        trace_id=i,
        trace_public_id=prompt.id,
        external_id=prompt.id,
        status=status,
        exact_match=t is None,
        first_divergence_step=t,
        category=category,
        margin_a=None if ma is None else ma.abs,
        margin_a_ulps=None if ma is None else ma.ulps,
        margin_b=None if mb is None else mb.abs,
        margin_b_ulps=None if mb is None else mb.ulps,
        gate_triggers=int(db.gate_fired.sum()),
        n_steps=len(db),
        mean_gap=float(finite_b.mean()) if finite_b.size else None,
        gate_triggers_a=int(da.gate_fired.sum()),
        n_steps_a=len(da),
        length_difference=length_difference(list(da.output_ids), list(db.output_ids)),
        answer_extractor=None,
        answer_a=None,
        answer_b=None,
    )


def comparison_figures(
    spec: ComparisonSpec, plan: SweepPlan, prompts: Sequence[ScreenPrompt], out: ScreenOutputs
) -> list[ResultFigures] | None:
    """Every prompt's figures for `spec` (None: one of its runs is missing)."""
    a, b = out.runs.get(spec.a.key), out.runs.get(spec.b.key)
    if a is None or b is None:
        return None
    probes = out.probes.get(spec.name, {})
    return [_prompt_figures(i, p, spec, a, b, probes.get(i), plan) for i, p in enumerate(prompts)]


def _none_runs(plan: SweepPlan, out: ScreenOutputs) -> list[tuple[Run, RunOutput]]:
    return [
        (r, out.runs[r.key]) for r in plan.runs() if r.intervention == "none" and r.key in out.runs
    ]


def _run_label(plan: SweepPlan, run: Run) -> str:
    if run.config == plan.reference:
        return f"reference ({run.config.dtype})"
    if run.config == plan.pair[0]:
        return f"pair arm A ({run.config.dtype})"
    if run.config == plan.pair[1]:
        return f"pair arm B ({run.config.dtype})"
    return run.key


def trigger_densities(plan: SweepPlan, out: ScreenOutputs) -> list[TriggerDensityRead]:
    """TD per prompt and CV(TD) of every run without intervention."""
    reads = []
    for run, o in _none_runs(plan, out):
        fmt = run.config.head_dtype
        tds = [
            td
            for d in o.decodes
            if (td := trigger_density(d.margins, plan.gate.thresholds(d.top1, fmt))) is not None
        ]
        mean, std, cv = coefficient_of_variation(tds)
        reads.append(
            TriggerDensityRead(
                run=run.key,
                label=_run_label(plan, run),
                head_format=fmt,
                per_prompt=tds,
                mean=mean,
                std=std,
                cv=cv,
            )
        )
    return reads


def margin_distributions(plan: SweepPlan, out: ScreenOutputs) -> list[MarginDistributionRead]:
    """Every decoded step's margin per run without intervention, on one shared log axis."""
    runs = _none_runs(plan, out)
    margins = [np.concatenate([d.margins for d in o.decodes] or [np.zeros(0)]) for _, o in runs]
    ulps = [np.concatenate([d.margins_ulps for d in o.decodes] or [np.zeros(0)]) for _, o in runs]
    axis, axis_ulps = log_axis(margins), log_axis(ulps)
    reads = []
    for (run, _), m, u in zip(runs, margins, ulps, strict=True):
        finite = m[np.isfinite(m)]
        ties = int((finite == 0).sum())
        reads.append(
            MarginDistributionRead(
                run=run.key,
                label=_run_label(plan, run),
                head_format=run.config.head_dtype,
                steps=int(finite.size),
                ties=ties,
                tie_share=ties / finite.size if finite.size else None,
                histogram=margin_histogram(m, axis),
                histogram_ulps=margin_histogram(u, axis_ulps),
                distribution=finite_distribution(finite.tolist()),
            )
        )
    return reads


def tau_calibration(
    plan: SweepPlan,
    figures: dict[str, list[ResultFigures]],
    out: ScreenOutputs,
) -> list[TauCalibrationRead]:
    """Flip margins per arm-B head format (comparisons without intervention), the τ covering
    `plan.cover` of them and its trigger-rate cost on that format's runs."""
    flips: dict[HeadDType, tuple[list[float], list[float]]] = {}
    for spec in plan.comparisons():
        if spec.b.intervention != "none" or spec.name not in figures:
            continue
        fmt = spec.b.config.head_dtype
        abs_, ulps = flips.setdefault(fmt, ([], []))
        for f in figures[spec.name]:
            if not f.diverged:
                continue
            a_vals = [x for x in (f.margin_a, f.margin_b) if x is not None]
            u_vals = [x for x in (f.margin_a_ulps, f.margin_b_ulps) if x is not None]
            if a_vals:
                abs_.append(min(a_vals))
            if u_vals:
                ulps.append(min(u_vals))
    reads = []
    runs = _none_runs(plan, out)
    for fmt in sorted(flips):
        abs_, ulps = flips[fmt]
        tau = covering_tau(abs_, plan.cover)
        tau_u = covering_tau(ulps, plan.cover)
        m = [d.margins for r, o in runs if r.config.head_dtype == fmt for d in o.decodes]
        u = [d.margins_ulps for r, o in runs if r.config.head_dtype == fmt for d in o.decodes]
        steps_m = np.concatenate(m) if m else np.zeros(0)
        steps_u = np.concatenate(u) if u else np.zeros(0)
        n = int(steps_m.size)
        reads.append(
            TauCalibrationRead(
                format=fmt,
                flips=len(abs_),
                flip_margin=finite_distribution(abs_),
                flip_margin_ulps=finite_distribution(ulps),
                cover=plan.cover,
                tau=tau,
                tau_ulps=tau_u,
                steps=n,
                trigger_rate=float((steps_m < tau).sum() / n) if n and tau is not None else None,
                trigger_rate_ulps=(
                    float((steps_u < tau_u).sum() / n) if n and tau_u is not None else None
                ),
            )
        )
    return reads


def _hidden_gap(figs: list[ResultFigures], probes: dict[int, Probe]) -> HiddenGapRead:
    div = [f for f in figs if f.diverged and f.trace_id in probes]
    at_t = [(f.category, probes[f.trace_id].dh_t_star) for f in div]
    gated = [x for f in div for x in probes[f.trace_id].dh_gated]
    return HiddenGapRead(
        prompts=len(div),
        t_star=finite_distribution([v for _, v in at_t if v is not None]),
        gated=finite_distribution(gated),
        gated_steps=len(gated),
        by_category={
            c: finite_distribution([v for k, v in at_t if k == c and v is not None])
            for c in CATEGORIES[1:]
        },
    )


def _category_lifts(base: list[ResultFigures], treated: list[ResultFigures]) -> list[CategoryLift]:
    exact_t = {f.trace_id: f.exact for f in treated if f.ok}
    ids = {c: [f.trace_id for f in base if f.ok and f.category == c] for c in CATEGORIES[1:]}
    return [
        CategoryLift(category=c, n=len(i), fixed=sum(1 for t in i if exact_t.get(t)))
        for c, i in ids.items()
    ]


def _empty_comparison(label: str) -> ComparisonReport:
    return run_statistics("screening", [ComparisonInput(0, 0, 1, label, False, [])]).comparisons[0]


def build_report(
    plan: SweepPlan,
    prompts: Sequence[ScreenPrompt],
    out: ScreenOutputs,
    *,
    model: str,
    weights_sha256: str | None,
) -> ScreeningReport:
    """The screening report from what `run_screening` produced (or a store holds)."""
    specs = plan.comparisons()
    run_index = {r.key: i for i, r in enumerate(plan.runs())}
    figures = {
        s.name: f for s in specs if (f := comparison_figures(s, plan, prompts, out)) is not None
    }
    inputs: list[ComparisonInput] = []
    names = []
    pair, pair_c = specs[0], specs[1]
    # The pair's both-arms C treatment is the only lift: each knob is against the reference.
    for s in specs:
        figs = figures.get(s.name, [] if s.name in (pair.name, pair_c.name) else None)
        if figs is None:
            continue
        inputs.append(
            ComparisonInput(
                len(inputs),
                run_index[s.a.key],
                run_index[s.b.key],
                s.label,
                s.name == pair_c.name,
                figs,
            )
        )
        names.append(s.name)
    stats = run_statistics("screening", inputs)
    by_name = dict(zip(names, stats.comparisons, strict=True))
    lift = stats.lifts[0] if stats.lifts and figures.get(pair.name) else None

    knobs = []
    body_remedy_ear: float | None = None
    batch_divergence = False
    for knob in plan.knobs:
        values = []
        for v in knob.values:
            name = f"{knob.name}:{v.config.key}"
            reason = v.unavailable or out.unavailable.get(v.config.key)
            cmp = by_name.get(name)
            if reason is not None:
                status = "not_available"
            elif v.config.key in out.failed:
                status, reason, cmp = "failed", out.failed[v.config.key], None
            elif cmp is None:
                status, reason = "failed", "not run (the screening stopped before it)"
            else:
                status = "measured"
            dh = None
            if cmp is not None:
                vals = [p.dh_t_star for p in out.probes.get(name, {}).values()]
                finite = [x for x in vals if x is not None and math.isfinite(x)]
                dh = statistics.median(finite) if finite else None
                if knob.name == "weight_storage" and body_remedy_ear is None:
                    body_remedy_ear = cmp.ear.estimate
                if knob.name == "batch_size" and cmp.ear.successes < cmp.ear.n:
                    batch_divergence = True
            run_out = out.runs.get(v.config.key)
            ran = run_out.environment.get("tp_degree") if run_out is not None else None
            values.append(
                KnobValueResult(
                    label=v.label,
                    config=v.config.to_json(),
                    status=status,
                    reason=reason,
                    comparison=cmp,
                    median_dh_t_star=dh,
                    environment=run_out.environment if run_out is not None else None,
                    tp_degree=ran if isinstance(ran, int) else v.config.tp_degree,
                )
            )
        knobs.append(KnobResult(name=knob.name, title=knob.title, values=values))

    base_figs = figures.get(pair.name, [])
    categories = _category_lifts(base_figs, figures.get(pair_c.name, []))
    head_vs_body = PairResult(
        label=pair.label,
        baseline=by_name.get(pair.name) or _empty_comparison(pair.label),
        treated=by_name.get(pair_c.name) or _empty_comparison(pair_c.label),
        lift=lift,
        categories=categories,
        hidden_gap=_hidden_gap(base_figs, out.probes.get(pair.name, {})),
    )
    densities = trigger_densities(plan, out)
    cv_run = next((d for d in densities if d.run == pair.a.key), None)
    calibration = tau_calibration(plan, figures, out)
    tier = choose_tier(
        head_vs_body.baseline,
        lift,
        categories,
        calibration,
        pair_format=plan.pair[1].head_dtype,
        tau=plan.tau,
        body_remedy_ear=body_remedy_ear,
        batch_divergence=batch_divergence,
    )
    return ScreeningReport(
        model=model,
        weights_sha256=weights_sha256,
        platform=plan.platform,
        reference=plan.reference.to_json(),
        pair=[plan.pair[0].to_json(), plan.pair[1].to_json()],
        tau=plan.tau,
        tau_ulps=plan.tau_ulps,
        max_new_tokens=plan.max_new_tokens,
        prompts=len(prompts),
        prompt_ids=[q.id for q in prompts],
        knobs=knobs,
        head_vs_body=head_vs_body,
        trigger_density=densities,
        cv_td=None if cv_run is None else cv_run.cv,
        margins=margin_distributions(plan, out),
        tau_calibration=calibration,
        tier=tier,
        environments={k: o.environment for k, o in out.runs.items()},
    )
