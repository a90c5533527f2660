"""Knob values a platform cannot run are "not available here" (with the reason), decided before
anything runs: from the platform's facts, or by the backend's probe on the device (an SDPA
backend that turns the model's attention calls down). A value that passes and then fails at run
time is "failed", with its message, and the sweep goes on."""

from __future__ import annotations

from replay_audit.screenings.sweep.analysis import build_report
from replay_audit.screenings.sweep.plan import Platform, ScreenConfig, build_plan
from replay_audit.screenings.sweep.report import ScreeningReport
from replay_audit.screenings.sweep.runner import MemoryStore
from tests.screenings.sweep.fake_screen import STEPS, FakeBackend, prompts

GPU = Platform(device="cuda", gpu_name="fake H100", sm="9.0", fp8_unavailable="no fp8 here")
REF = ScreenConfig("fp32")
FLASH = ScreenConfig("fp32", sdpa_backend="flash")
CUDNN = ScreenConfig("fp32", sdpa_backend="cudnn")
EFFICIENT = ScreenConfig("fp32", sdpa_backend="efficient")
MATH = ScreenConfig("fp32", sdpa_backend="math")


def _screen(backend: FakeBackend, platform: Platform = GPU) -> ScreeningReport:
    plan = build_plan(
        platform,
        reference=REF,
        knobs=("attn_kernel",),
        max_new_tokens=STEPS,
        probe=backend.availability,
    )
    out = backend.run(plan, prompts(6), MemoryStore())
    return build_report(plan, prompts(6), out, model="fake", weights_sha256=None)


def _values(report: ScreeningReport) -> dict[str, tuple[str, str | None]]:
    knob = next(k for k in report.knobs if k.name == "attn_kernel")
    return {v.label: (v.status, v.reason) for v in knob.values}


def test_a_refused_backend_is_not_available_and_never_loaded() -> None:
    no_fp32 = "torch's SDPA flash backend refuses the mask-free prefill: no fp32 kernel"
    backend = FakeBackend(refuses={FLASH.key: no_fp32, CUDNN.key: "cuDNN needs fp16 or bf16"})
    values = _values(_screen(backend))
    assert values["sdpa (flash)"] == ("not_available", no_fp32)
    assert values["sdpa (cudnn)"] == ("not_available", "cuDNN needs fp16 or bf16")
    assert values["sdpa (efficient)"][0] == "measured"
    assert values["sdpa (math)"][0] == "measured"
    assert FLASH.key not in backend.loads and CUDNN.key not in backend.loads
    assert EFFICIENT.key in backend.loads
    # Each value the platform's facts allow was probed once; eager was probed too (and ran).
    assert FLASH.key in backend.probed and len(backend.probed) == len(set(backend.probed))


def test_the_platforms_facts_come_before_the_probe() -> None:
    backend = FakeBackend()
    values = _values(_screen(backend, Platform(device="cpu", fp8_unavailable="no fp8")))
    for b in ("efficient", "cudnn"):
        status, reason = values[f"sdpa ({b})"]
        assert status == "not_available" and reason is not None and "CUDA kernel" in reason
    assert values["flash_attention_2"][0] == "not_available"
    assert values["sdpa (math)"][0] == "measured" and values["sdpa (flash)"][0] == "measured"
    assert EFFICIENT.key not in backend.probed and MATH.key in backend.probed


def test_a_backend_that_passes_the_probe_but_fails_at_run_time_is_failed() -> None:
    backend = FakeBackend(broken={EFFICIENT.key: "Invalid backend"})
    values = _values(_screen(backend))
    status, reason = values["sdpa (efficient)"]
    assert status == "failed" and reason is not None and "RuntimeError: Invalid backend" in reason
    # The sweep went on past it.
    assert values["sdpa (cudnn)"][0] == "measured" and values["sdpa (math)"][0] == "measured"
