"""A screening over fake engines whose knob effects are known by construction
(`tests/screenings/sweep/fake_screen.py`): the report's numbers and the chosen tier, exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest

from replay_audit.screenings.sweep.analysis import build_report
from replay_audit.screenings.sweep.plan import Platform, ScreenConfig, build_plan
from replay_audit.screenings.sweep.report import ScreeningReport
from replay_audit.screenings.sweep.runner import MemoryStore
from tests.screenings.sweep.fake_screen import (
    BATCH,
    BODY,
    HEAD,
    KV,
    N_PROMPTS,
    STEPS,
    TINY,
    FakeBackend,
    prompts,
)

KNOBS = ("body_dtype", "lm_head", "attn_kernel", "tf32", "batch_size")


def _screen(
    backend: FakeBackend, store: MemoryStore | None = None, cover: float = 0.9, n: int = N_PROMPTS
):
    plan = build_plan(
        Platform(device="cpu", fp8_unavailable="no fp8 on a cpu"),
        reference=ScreenConfig("fp32"),
        knobs=KNOBS,
        max_new_tokens=STEPS,
        cover=cover,
    )
    store = store or MemoryStore()
    out = backend.run(plan, prompts(n), store)
    return plan, build_report(plan, prompts(n), out, model="fake", weights_sha256=None), store


def _value(report: ScreeningReport, knob: str, label: str):
    k = next(k for k in report.knobs if k.name == knob)
    return next(v for v in k.values if v.label == label)


def test_the_pair_counts_categories_and_c_lift_exactly() -> None:
    _, report, _ = _screen(FakeBackend())
    pair = report.head_vs_body
    n_div = len(HEAD | BODY | KV)
    assert pair.baseline.ear.successes == N_PROMPTS - n_div
    assert pair.baseline.ear.n == N_PROMPTS
    cats = {c.category: c for c in pair.categories}
    assert cats["head_reachable"].n == len(HEAD) and cats["head_reachable"].fixed == len(HEAD)
    assert cats["kv_dependent"].n == len(KV) and cats["kv_dependent"].fixed == 0
    assert cats["body_dominated"].n == len(BODY) and cats["body_dominated"].fixed == 0
    assert pair.treated.ear.successes == N_PROMPTS - len(BODY | KV)
    assert pair.lift is not None
    assert pair.lift.lift == pytest.approx(len(HEAD) / N_PROMPTS)
    assert (pair.lift.fixed, pair.lift.broke) == (len(HEAD), 0)
    assert pair.lift.low is not None and pair.lift.low > 0
    # t* of each category as constructed: body at 2, head at 3, kv at 4.
    assert pair.baseline.first_divergence_step is not None
    assert pair.baseline.first_divergence_step.min == 2
    assert pair.baseline.first_divergence_step.max == 4


def test_tier_1_when_c_lifts_a_lot_and_tier_3_when_it_cannot() -> None:
    _, report, _ = _screen(FakeBackend())
    assert report.tier.tier == 1
    assert "gated C" in report.tier.action
    _, body_only, _ = _screen(FakeBackend(head=frozenset()))
    assert body_only.tier.tier == 3
    assert body_only.head_vs_body.lift is not None and body_only.head_vs_body.lift.lift == 0.0
    assert "body-scope" in body_only.tier.action
    _, nothing, _ = _screen(FakeBackend(head=frozenset(), body=frozenset(), kv=frozenset()))
    assert nothing.tier.tier is None


def test_tier_2_when_c_lifts_a_little_but_surely() -> None:
    # 200 prompts, C repairs 20 of them (+10 pp, the paper's Tier 2 range), 20 body-dominated.
    backend = FakeBackend(
        head=frozenset(range(1, 21)), body=frozenset(range(21, 41)), kv=frozenset({150})
    )
    _, report, _ = _screen(backend, n=200)
    lift = report.head_vs_body.lift
    assert lift is not None and lift.lift == pytest.approx(0.10)
    assert lift.low is not None and lift.low > 0
    assert report.tier.tier == 2
    assert "body-scope" in report.tier.action


def test_sweep_values_against_the_reference() -> None:
    _, report, _ = _screen(FakeBackend())
    assert _value(report, "body_dtype", "bf16").comparison.ear.successes == N_PROMPTS
    fp16 = _value(report, "body_dtype", "fp16").comparison
    assert fp16.ear.successes == N_PROMPTS - len(HEAD | BODY | KV)
    bs8 = _value(report, "batch_size", "batch 8")
    assert bs8.comparison.ear.successes == N_PROMPTS - len(BATCH)
    assert bs8.comparison.first_divergence_step.median == 1
    assert bs8.comparison.categories["body_dominated"].successes == len(BATCH)
    assert _value(report, "batch_size", "batch 2").comparison.ear.successes == N_PROMPTS
    # Not available on this platform: listed with the reason, not failed.
    tf32 = _value(report, "tf32", "TF32 on")
    assert tf32.status == "not_available" and "CUDA" in (tf32.reason or "")
    assert _value(report, "attn_kernel", "eager").comparison.ear.successes == N_PROMPTS
    # torch's CPU SDPA has math (and flash); the efficient backend is a CUDA kernel.
    assert _value(report, "attn_kernel", "sdpa (math)").status == "measured"
    efficient = _value(report, "attn_kernel", "sdpa (efficient)")
    assert efficient.status == "not_available" and "CUDA" in (efficient.reason or "")
    # Every run records its whole screening configuration with the engine's environment.
    env = _value(report, "batch_size", "batch 8").environment
    assert env is not None and env["screening_config"]["batch_size"] == 8
    fp8 = _value(report, "lm_head", "head fp8_e4m3")
    assert fp8.status == "not_available" and fp8.reason == "no fp8 on a cpu"
    assert "Batch shape changes outputs" in " ".join(report.tier.caveats)


def test_trigger_density_and_cv_are_exact() -> None:
    _, report, _ = _screen(FakeBackend())
    td = next(d for d in report.trigger_density if d.label.startswith("pair arm A"))
    expected = [1 / STEPS if i % 2 == 0 else 0.0 for i in range(N_PROMPTS)]
    assert td.per_prompt == pytest.approx(expected)
    assert td.mean == pytest.approx(1 / (2 * STEPS))
    assert td.cv == pytest.approx(1.0)
    assert report.cv_td == pytest.approx(1.0)
    ref = next(m for m in report.margins if m.label.startswith("reference"))
    assert ref.steps == N_PROMPTS * STEPS and ref.ties == 0


def test_hidden_gap_and_tau_calibration() -> None:
    _, report, _ = _screen(FakeBackend(), cover=0.8)
    gap = report.head_vs_body.hidden_gap
    assert gap.prompts == len(HEAD | BODY | KV)
    assert gap.t_star is not None and gap.t_star.median == pytest.approx(0.01, rel=1e-6)
    # Gated steps <= t*: step 0 of even prompts and the flip step of head/kv prompts.
    expected_gated = sum((p % 2 == 0) + (p in HEAD or p in KV) for p in sorted(HEAD | BODY | KV))
    assert gap.gated_steps == expected_gated
    cal = next(c for c in report.tau_calibration if c.format == "fp16")
    # fp16 flips: the pair's and the body_dtype knob's (fp32 vs fp16), each 11 prompts.
    assert cal.flips == 2 * len(HEAD | BODY | KV)
    small = np.float32(10.0) - np.float32(10.0 - TINY)
    # 80% of 22 flips -> the 18th smallest: the largest tiny margin (18 of them are tiny).
    assert cal.tau == math.nextafter(float(small), math.inf)
    assert cal.trigger_rate is not None and 0 < cal.trigger_rate < 1


def test_each_configuration_is_loaded_once_and_resume_loads_nothing() -> None:
    backend = FakeBackend()
    plan, report, store = _screen(backend)
    # Every comparison was probed in the first pass (arm A decoded before arm B was probed).
    assert {k for k in store.values if k.startswith("probe/")} == {
        f"probe/{s.name}" for s in plan.comparisons()
    }
    # Values the platform cannot run are not in the plan's configurations at all.
    assert len(backend.loads) == len(set(backend.loads)) == len(plan.configs())
    again = FakeBackend()
    _, report2, _ = _screen(again, store)
    assert again.loads == []
    assert report2 == report


def test_an_unsupported_load_is_not_available_not_failed() -> None:
    ref = ScreenConfig("fp32", batch_size=4)
    backend = FakeBackend(unsupported={ref.key: "no batch 4 here"})
    _, report, _ = _screen(backend)
    v = _value(report, "batch_size", "batch 4")
    assert v.status == "not_available" and v.reason == "no batch 4 here"


def test_a_configuration_that_fails_to_run_is_reported_failed_and_the_rest_goes_on() -> None:
    bad = ScreenConfig("fp32", batch_size=2)
    store = MemoryStore()
    _, report, _ = _screen(FakeBackend(broken={bad.key: "No available kernel"}), store)
    v = _value(report, "batch_size", "batch 2")
    assert v.status == "failed" and "No available kernel" in (v.reason or "")
    assert _value(report, "batch_size", "batch 8").status == "measured"
    assert report.tier.tier == 1
    # Resuming does not retry it (the failure is stored with the outputs).
    again = FakeBackend()
    _, report2, _ = _screen(again, store)
    assert again.loads == [] and report2 == report


def test_when_the_pair_cannot_run_there_is_no_tier() -> None:
    fp16 = ScreenConfig("fp16")
    _, report, _ = _screen(FakeBackend(broken={fp16.key: "fp16 overflow"}))
    assert report.tier.tier is None and report.tier.name == "pair not measured"
