"""What the screening needs of the torch engine: the hidden states the lm_head reads, weights
stored in one dtype and computed in another, and the platform facts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from replay_audit.engine import Intervention, Target, load_engine
from replay_audit.engine.platform import probe_platform
from replay_audit.engine.protocol import HiddenStates
from replay_audit.engine.torch_engine import TorchEngine


def test_hidden_states_feed_the_head_as_the_single_step_does(tiny_dir: Path) -> None:
    engine = load_engine(tiny_dir, Target("fp32"), device="cpu")
    assert isinstance(engine, HiddenStates) and isinstance(engine, TorchEngine)
    prompt, out = [1, 5, 9, 3], [7, 2, 11]
    h = engine.hidden_states(prompt, out)
    assert h.shape == (len(out) + 1, engine.model.config.hidden_size) and h.dtype == np.float32
    for t in range(len(out) + 1):
        z = engine.head.native(torch.from_numpy(h[t : t + 1]))[0]
        assert int(torch.argmax(z)) == engine.step(prompt, out[:t], Intervention()).token


def test_weights_stored_in_bf16_and_computed_in_fp32(real_dir: Path) -> None:
    # The bundled checkpoint (trained in fp32): its weights are not all bf16 values.
    engine = load_engine(real_dir, Target("fp32", weight_dtype="bf16"), device="cpu")
    assert isinstance(engine, TorchEngine)
    env = engine.environment()
    assert (env["dtype"], env["weight_dtype"]) == ("fp32", "bf16")
    w = engine.model.model.layers[0].mlp.up_proj.weight
    assert w.dtype == torch.float32
    assert torch.equal(w, w.bfloat16().float())  # carries bf16's rounding
    plain = load_engine(real_dir, Target("fp32"), device="cpu")
    assert isinstance(plain, TorchEngine)
    w32 = plain.model.model.layers[0].mlp.up_proj.weight
    assert not torch.equal(w32, w32.bfloat16().float())  # the fp32 checkpoint is not
    assert plain.environment()["weight_dtype"] == "fp32"


def test_platform_facts_on_this_cpu() -> None:
    f = probe_platform("cpu")
    assert f.device == "cpu" and f.sm is None and f.gpu_name is None
    assert f.fp8_unavailable is not None and "cpu" in f.fp8_unavailable


def test_an_arms_switches_hold_during_its_probes_only(tiny_dir: Path) -> None:
    """An arm that pins an SDPA backend and deterministic algorithms runs its probes under
    them and puts the process's switches back after; an arm that names none leaves them as
    the process has them (torch's defaults, every backend on), as a user's plain generate()
    runs; what each records is what ran."""
    from replay_audit.engine import attention

    cuda = torch.backends.cuda
    before = (cuda.math_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.cudnn_sdp_enabled())
    assert before == (True, True, True) and not torch.are_deterministic_algorithms_enabled()
    pinned = load_engine(
        tiny_dir, Target("fp32", attn_kernel="sdpa", sdpa_backend="math", deterministic=True),
        device="cpu",
    )  # fmt: skip
    plain = load_engine(tiny_dir, Target("fp32", attn_kernel="sdpa"), device="cpu")
    for engine, backends in (
        (pinned, "prefill:math;decode:math"),
        (plain, "prefill:flash;decode:flash"),
    ):
        with attention.observe() as seen:
            engine.decode([1, 5, 9], 3, [])
        assert seen.backends() == backends
        assert engine.environment()["extras"]["attention_backends"] == backends
        after = (cuda.math_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.cudnn_sdp_enabled())
        assert after == before and not torch.are_deterministic_algorithms_enabled()
    assert pinned.environment()["extras"]["sdpa_backends"] == "math"
    assert pinned.environment()["deterministic"] is True
    assert plain.environment()["extras"]["sdpa_backends"] == "math,flash"  # a CPU's, all on
    assert plain.environment()["deterministic"] is False
    eager = load_engine(tiny_dir, Target("fp32", attn_kernel="eager"), device="cpu")
    eager.decode([1, 5, 9], 2, [])
    assert "sdpa_backends" not in eager.environment()["extras"]  # SDPA did not run
    assert "attention_backends" not in eager.environment()["extras"]


def test_fp8_linear_layers_approximate_the_float_product() -> None:
    from replay_audit.engine.numerics import Fp8Linear, quantize_body_linears

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=True)
    fp8 = Fp8Linear(linear, torch.float32)
    x = torch.randn(3, 5, 64)
    want = linear(x)
    got = fp8(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    err = (got - want).norm() / want.norm()
    assert 0 < err < 0.1  # FP8-E4M3 keeps 3 mantissa bits: close, never exact
    body = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    assert quantize_body_linears(body, torch.float32) == 2
    assert all(not isinstance(m, torch.nn.Linear) for m in body.modules())


def test_fp8_linear_layers_need_a_recent_gpu(tiny_dir: Path) -> None:
    import pytest

    from replay_audit.exceptions import UnsupportedFormat

    with pytest.raises(UnsupportedFormat, match="fp8 linear layers"):
        load_engine(tiny_dir, Target("bf16", fp8_linear=True), device="cpu")


def test_sdpa_probe_on_this_cpu(real_dir: Path) -> None:
    from replay_audit.engine.platform import AttentionShape, sdpa_refusal
    from replay_audit.screenings.sweep.plan import ScreenConfig
    from replay_audit.screenings.sweep.worker import TorchFacts

    backend = TorchFacts(real_dir, "cpu")
    assert backend._heads() == (4, 2, 32)  # grouped-query: the calls pass enable_gqa
    for b in ("efficient", "cudnn"):
        why = backend.availability(ScreenConfig("fp32", sdpa_backend=b))
        assert why is not None and "CUDA kernel" in why and b in why
    # torch's CPU SDPA has math and flash, in every dtype, with and without a mask.
    for b in ("math", "flash"):
        for dtype in ("fp32", "bf16", "fp16"):
            for cache in ("piecewise", "compiled"):
                config = ScreenConfig(dtype, sdpa_backend=b, kv_cache=cache)
                assert backend.availability(config) is None, (b, dtype, cache)
    assert backend.availability(ScreenConfig("fp32")) is None  # torch chooses: nothing to probe
    assert sdpa_refusal("warp", AttentionShape(4, 2, 32, "fp32"), "cpu") == (
        "unknown SDPA backend 'warp'"
    )


def test_sdpa_refusal_reports_torchs_own_reasons() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from replay_audit.engine.platform import _refusal

    q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # Grouped heads without enable_gqa: the fused kernels turn them down, and torch says why
    # in a UserWarning (what the probe reports instead of "No available kernel").
    why = _refusal(SDPBackend.FLASH_ATTENTION, sdpa_kernel, lambda: sdpa(q, kv, kv))
    assert why is not None and "same num_heads" in why and "Triggered internally" not in why
    ok = _refusal(SDPBackend.FLASH_ATTENTION, sdpa_kernel, lambda: sdpa(q, kv, kv, enable_gqa=True))
    assert ok is None
    # The probe leaves torch's SDPA flags as they were.
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()


def test_a_screening_runs_sdpa_math_and_flash_on_this_cpu(tiny_dir: Path) -> None:
    from replay_audit.engine.pool import EnginePool
    from replay_audit.screenings.sweep.outputs import ScreenPrompt
    from replay_audit.screenings.sweep.plan import Platform, ScreenConfig, build_plan
    from replay_audit.screenings.sweep.runner import MemoryStore, run_screening
    from replay_audit.screenings.sweep.worker import TorchFacts

    backend = TorchFacts(tiny_dir, "cpu")
    plan = build_plan(
        Platform(device="cpu", fp8_unavailable="no fp8 on a cpu"),
        reference=ScreenConfig("fp32"),
        knobs=("attn_kernel",),
        max_new_tokens=3,
        probe=backend.availability,
    )
    values = {v.label: v.unavailable for v in plan.knobs[0].values}
    assert values["sdpa (math)"] is None and values["sdpa (flash)"] is None
    assert values["sdpa (efficient)"] is not None and "CUDA" in values["sdpa (efficient)"]
    pool = EnginePool(device="cpu")
    out = run_screening(plan, [ScreenPrompt("p", (1, 5, 9))], pool, tiny_dir, [], MemoryStore())
    for b in ("math", "flash"):
        key = ScreenConfig("fp32", sdpa_backend=b).key
        assert key in out.runs and key not in out.failed
        env = out.runs[key].environment
        assert env["screening_config"]["sdpa_backend"] == b
        # What ran, resolved by the pipeline: SDPA pinned to that backend, and observed so.
        assert env["resolved"]["sdpa_backend"] == b
        assert env["resolved"]["attention_backends"] == f"prefill:{b};decode:{b}"
    # The switches are the process's again: every backend on.
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
