"""The tensor-parallel knob: one degree per screening, run where the process owns that many
CUDA GPUs, on a CPU only when named (its gloo ranks check the TP path, not a production
numeric). On the CPU, named, its configuration is decoded by the replay pipeline's TP engine:
two gloo ranks of the bundled model, loaded through the engine pool."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.engine.pool import EnginePool
from replay_audit.exceptions import UnsupportedFormat
from replay_audit.json_value import as_object
from replay_audit.replays.pipeline import load_arm
from replay_audit.screenings.sweep.analysis import build_report
from replay_audit.screenings.sweep.plan import Platform, ScreenConfig, build_plan
from replay_audit.screenings.sweep.runner import MemoryStore, run_screening
from replay_audit.screenings.sweep.worker import TorchFacts
from replay_audit.ui.screening_view import standalone_html

CPU = Platform(device="cpu")
REF = ScreenConfig("bf16")


def _tp_value(platform: Platform, knobs: tuple[str, ...] | None) -> tuple[str, str | None]:
    plan = build_plan(platform, reference=REF, knobs=knobs)
    (knob,) = [k for k in plan.knobs if k.name == "tp"]
    (value,) = knob.values
    return value.config.key, value.unavailable


def test_tp_1_stays_out_of_the_key_and_tp_k_says_so() -> None:
    assert REF.key == "bf16_head-bf16_w-bf16_sdpa_bs1_nondet_ieee_piecewise"
    assert ScreenConfig("bf16", tp_degree=2).key == REF.key + "_tp2"


def test_the_tp_knob_runs_where_the_process_owns_k_gpus_and_on_a_cpu_only_when_named() -> None:
    key, why = _tp_value(CPU, None)  # every knob, tp not named
    assert key.endswith("_tp2") and why is not None and "gloo" in why and "--knobs tp" in why
    assert _tp_value(CPU, ("tp",))[1] is None
    one_gpu = Platform(device="cuda", gpu_name="fake H100", sm="9.0", devices=1)
    assert _tp_value(one_gpu, None)[1] == "TP 2 needs 2 CUDA GPUs; this process owns 1"
    assert _tp_value(one_gpu, ("tp",))[1] is not None  # naming it adds no GPU
    assert _tp_value(Platform(device="cuda", sm="9.0", devices=2), None)[1] is None
    plan = build_plan(Platform(device="cuda", sm="9.0", devices=4), reference=REF, tp_degree=4)
    assert [v.label for k in plan.knobs if k.name == "tp" for v in k.values] == ["TP 4"]


@pytest.fixture
def pool() -> Iterator[EnginePool]:
    """The engine pool a CLI screening of the TP knob gets: two devices (gloo ranks here)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # each gloo rank takes as many: two on this machine's two cores
    p = EnginePool(device="cpu", devices=2)
    yield p
    p.close()
    torch.set_num_threads(before)


@pytest.mark.slow
def test_a_named_tp_knob_on_a_cpu_decodes_with_the_tp_engine(pool: EnginePool) -> None:
    backend = TorchFacts(BUNDLED_MODEL_DIR, "cpu")
    platform = backend.platform()
    plan = build_plan(platform, reference=REF, knobs=("tp",), max_new_tokens=8)
    prompts = backend.prompts([{"id": "a", "prompt": "def main():"}, {"id": "b", "prompt": "1 +"}])
    out = run_screening(plan, prompts, pool, BUNDLED_MODEL_DIR, backend.eos_ids(), MemoryStore())
    tp2 = ScreenConfig("bf16", tp_degree=2)
    env = out.runs[tp2.key].environment
    # What ran is the TP engine: two gloo ranks of transformers' tensor-parallel plan.
    assert env["tp_degree"] == 2
    extras = as_object(env["extras"])
    assert (extras["tp_plan"], extras["tp_backend"]) == ("auto", "gloo")
    assert out.runs[REF.key].environment["tp_degree"] == 1
    # Each prompt decoded once at TP 2, the same as the pool's engine decodes it again, and the
    # run records the arm that ran (resolved by the replay pipeline, as a replay's).
    assert as_object(env["resolved"])["tp_degree"] == 2
    arm = load_arm(tp2.target(plan.intervention("none")), pool, BUNDLED_MODEL_DIR, tp_degree=2)
    engine = arm.engine
    for p, d in zip(prompts, out.runs[tp2.key].decodes, strict=True):
        again = arm.decode(list(p.token_ids), 8, backend.eos_ids(), plan.top_k)
        assert list(d.output_ids) == list(again.output_token_ids)
    report = build_report(plan, prompts, out, model="tiny-llama", weights_sha256=None)
    (value,) = next(k for k in report.knobs if k.name == "tp").values
    assert (value.status, value.tp_degree) == ("measured", 2)
    assert value.comparison is not None and value.comparison.ear.n == len(prompts)
    assert "ran at TP 2" in standalone_html(report)
    # A degree that does not divide the heads (4) is refused before any rank starts, and the
    # group that ran stays loaded.
    ranks = engine.group.pids  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedFormat, match="TP 3"):
        load_arm(ScreenConfig("bf16").target(), pool, BUNDLED_MODEL_DIR, tp_degree=3)
    again = load_arm(tp2.target(), pool, BUNDLED_MODEL_DIR, tp_degree=2).engine
    assert again is engine and engine.group.pids == ranks  # type: ignore[attr-defined]
