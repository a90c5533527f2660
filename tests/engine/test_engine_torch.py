"""The torch engine on CPU, with the tiny random checkpoint (fast) — exact properties only;
numerics differ across CPUs, so no machine-specific numbers are asserted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from replay_audit.diff import first_divergence
from replay_audit.engine import EnginePool, Intervention, Target
from replay_audit.engine.protocol import Engine
from replay_audit.engine.testing import TINY_EOS_ID
from replay_audit.exceptions import UnsupportedFormat
from replay_audit.formats import ulp

EngineOf = Callable[..., Engine]
N = 32  # tokens per decode


def test_environment_is_the_actual_one(
    tiny_engine: EngineOf, tiny_prompts: list[list[int]]
) -> None:
    env = tiny_engine("bf16", attn_kernel="eager").environment()
    assert env["dtype"] == "bf16" and env["lm_head_dtype"] == "bf16"
    assert env["attn_kernel"] == "eager" and env["device"] == "cpu" and env["gpu"] is None
    # The target names no switch: the process's, torch's defaults, which the engine left alone.
    assert env["deterministic"] is False and env["tf32"] is False
    assert not torch.are_deterministic_algorithms_enabled()
    # A target that names one runs its probes under it, and puts the process's back after.
    strict = tiny_engine("bf16", attn_kernel="sdpa", deterministic=True, sdpa_backend="math")
    seen: list[tuple[bool, bool]] = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(
            (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.flash_sdp_enabled())
        )
        return original(*args, **kwargs)  # type: ignore[arg-type]

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        strict.decode(tiny_prompts[0], 3, [TINY_EOS_ID])
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    assert seen and set(seen) == {(True, False)}
    assert (
        not torch.are_deterministic_algorithms_enabled() and torch.backends.cuda.flash_sdp_enabled()
    )
    env = strict.environment()
    assert env["deterministic"] is True and env["extras"]["sdpa_backends"] == "math"
    assert env["extras"]["attention_backends"] == "prefill:math;decode:math"
    assert env["torch_version"] == torch.__version__
    from replay_audit.traces.schemas import NumericalConfig

    NumericalConfig.model_validate(env)  # storable as a numerical configuration
    assert tiny_engine("fp16").environment()["attn_kernel"] == "sdpa"  # the default, recorded


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_our_loop_equals_transformers_generate(
    tiny_engine: EngineOf, tiny_prompts: list[list[int]], dtype: str
) -> None:
    engine = tiny_engine(dtype, attn_kernel="eager")
    model = engine.model  # type: ignore[attr-defined]
    for p in tiny_prompts[:6]:
        x = torch.tensor([p])
        with torch.inference_mode():
            g = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=N,
                eos_token_id=TINY_EOS_ID,
                pad_token_id=TINY_EOS_ID,
            )
        ours = engine.decode(p, N, [TINY_EOS_ID])
        assert ours.output_token_ids == g[0, len(p) :].tolist()


def test_per_step_records_are_consistent(
    tiny_engine: EngineOf, tiny_prompts: list[list[int]]
) -> None:
    run = tiny_engine("bf16").decode(tiny_prompts[0], N, [TINY_EOS_ID], top_k=4)
    s = run.steps
    assert len(s) == len(run.output_token_ids) and run.start_step == 0
    assert s.top_k_ids.shape == (len(s), 4) and s.top_k_logits.dtype == np.float32
    assert np.all(s.top_k_logits[:, :-1] >= s.top_k_logits[:, 1:])  # sorted descending
    assert np.array_equal(s.margins, s.top_k_logits[:, 0].astype(float) - s.top_k_logits[:, 1])
    # BF16 logits are BF16 values: the margin is a whole number of the smaller value's ulps
    from replay_audit.diff import ulp_array

    finer = np.minimum(
        ulp_array(s.top_k_logits[:, 0], "bf16"), ulp_array(s.top_k_logits[:, 1], "bf16")
    )
    assert np.array_equal(s.margins / finer, np.round(s.margins / finer))
    assert np.array_equal(s.token_ids, s.native_token_ids)  # no intervention
    assert np.array_equal(s.native_token_ids, s.top_k_ids[:, 0]) or np.any(s.margins == 0)


@pytest.mark.parametrize("tau", [0.0, -1.0])
def test_gate_fires_on_every_step_at_tau_0_and_never_below(
    tiny_engine: EngineOf, tiny_prompts: list[list[int]], tau: float
) -> None:
    engine = tiny_engine("fp16")
    for kind in ("A", "B", "C"):
        run = engine.decode(tiny_prompts[1], 16, [], Intervention(kind, tau=tau))
        assert run.steps.gate_fired.all() if tau == 0 else not run.steps.gate_fired.any()
        if tau < 0:
            assert np.array_equal(run.steps.token_ids, run.steps.native_token_ids)
    run = engine.decode(tiny_prompts[1], 16, [], Intervention("C", tau_ulps=0.0))
    assert run.steps.gate_fired.all()


def test_c_logits_are_bitwise_identical_from_identical_hidden_states(
    tiny_engine: EngineOf,
) -> None:
    heads = [tiny_engine(d).head for d in ("fp32", "bf16", "fp16")]  # type: ignore[attr-defined]
    # the fixture's weights are BF16- and FP16-exact: all arms hold the same lm_head values
    assert all(torch.equal(heads[0].weight, h.weight.float()) for h in heads)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, heads[0].weight.shape[1], generator=g).to(torch.bfloat16)
    ref = heads[0].fp32(h.float())
    for head in heads[1:]:
        same_h = h.to(head.weight.dtype)  # the same values, held in the arm's format
        assert torch.equal(head.fp32(same_h), ref)
    # and C is not the arm's native product
    assert not torch.equal(heads[1].native(h).float(), ref)


def test_b_with_k_equal_to_the_vocabulary_picks_what_c_picks(
    tiny_engine: EngineOf, tiny_prompts: list[list[int]]
) -> None:
    engine = tiny_engine("bf16")
    vocab = engine.vocab_size
    for p in tiny_prompts[:8]:
        # τ = 0: every step is gated and B does no binning, so B(K = |V|) must be C exactly
        b = engine.decode(p, N, [TINY_EOS_ID], Intervention("B", tau=0.0, top_k=vocab))
        c = engine.decode(p, N, [TINY_EOS_ID], Intervention("C", tau=0.0))
        assert b.steps.gate_fired.all() and c.steps.gate_fired.all()
        assert b.output_token_ids == c.output_token_ids


def test_b_bins_the_fp32_values_of_c_at_tau(tiny_engine: EngineOf) -> None:
    """With τ > 0, B(K = |V|) is the integer argmax of C's FP32 logits in bins of τ (the smallest
    id winning a shared bin): it equals C wherever C's top two fall in different bins."""
    from replay_audit.engine.numerics import integer_argmax, intervene

    engine = tiny_engine("fp16")
    head = engine.head  # type: ignore[attr-defined]
    with torch.inference_mode():  # final normed hidden states of a from-scratch forward
        hs = engine.body.forward(list(range(40, 100)), None, 0)[0]  # type: ignore[attr-defined]
    tau = 0.05
    b_iv = Intervention("B", tau=tau, top_k=engine.vocab_size)
    widths = np.full(hs.shape[0], tau)
    same = 0
    for h in hs:  # one gated step at a time, as a decode step is
        z32 = head.native(h[None]).float()
        c32 = head.fp32(h[None])
        b = int(intervene(head, z32, h[None], b_iv, widths[:1])[0])
        assert b == int(integer_argmax(c32, torch.tensor([tau], dtype=torch.float64))[0])
        c = int(intervene(head, z32, h[None], Intervention("C"), widths[:1])[0])
        top2 = torch.topk(c32[0], 2).values.double()
        if torch.round(top2[0] / tau) != torch.round(top2[1] / tau):
            assert b == c
            same += 1
    assert same > 0
    # all the steps at once (a scan's gated steps) choose what each chooses alone
    z32 = head.native(hs).float()
    for iv in (b_iv, Intervention("C"), Intervention("A", tau=tau)):
        alone = [
            int(intervene(head, z32[i : i + 1], hs[i : i + 1], iv, widths[:1])[0])
            for i in range(len(hs))
        ]
        assert intervene(head, z32, hs, iv, widths).tolist() == alone


def test_intervention_a_bins_and_breaks_ties_by_smallest_id() -> None:
    from replay_audit.engine.numerics import integer_argmax

    z = torch.tensor([[1.0, 3.0004, 2.0, 3.0001, 3.0009]] * 3)
    # width 0: plain argmax; 1e-3: bins 3000, 3000, 3001, id 4 still wins; 1e-2: all of 1, 3
    # and 4 in bin 300, the smallest id wins
    widths = torch.tensor([0.0, 1e-3, 1e-2], dtype=torch.float64)
    assert integer_argmax(z, widths).tolist() == [4, 4, 1]


def test_scan_matches_the_decode_on_its_own_path(
    tiny_engine: EngineOf, tiny_prompts: list[list[int]]
) -> None:
    engine = tiny_engine("fp32")
    for p in tiny_prompts[:6]:
        run = engine.decode(p, N, [TINY_EOS_ID])
        scan = engine.scan(p, run.output_token_ids)
        assert len(scan.steps) == len(run.output_token_ids)
        # one batched forward vs a KV-cache loop: only a near-tie could differ
        assert np.all(scan.agrees | (run.steps.margins < 1e-4))
        np.testing.assert_allclose(scan.steps.margins, run.steps.margins, atol=1e-3)


def test_single_step_rerun_is_the_scan_at_that_position(
    tiny_engine: EngineOf, tiny_prompts: list[list[int]]
) -> None:
    engine = tiny_engine("bf16")
    p = tiny_prompts[2]
    out = engine.decode(p, 12, []).output_token_ids
    scan = engine.scan(p, out)
    for t in (0, 5, 11):
        s = engine.step(p, out[:t], Intervention())
        assert s.token == int(scan.steps.native_token_ids[t])
        assert s.margin.abs == pytest.approx(float(scan.steps.margins[t]), abs=0.2)


def test_forced_prefix_decodes_from_the_given_step(
    tiny_engine: EngineOf, tiny_prompts: list[list[int]]
) -> None:
    engine = tiny_engine("fp32")
    p = tiny_prompts[3]
    full = engine.decode(p, 20, [])
    part = engine.decode(p, 20, [], forced_prefix=full.output_token_ids[:7])
    assert part.start_step == 7 and len(part.steps) == 13
    assert part.output_token_ids == full.output_token_ids
    done = engine.decode(p, 20, [], forced_prefix=full.output_token_ids)
    assert len(done.steps) == 0 and done.output_token_ids == full.output_token_ids


def test_batch_size_runs_the_row_among_copies(
    tiny_engine: EngineOf, tiny_prompts: list[list[int]]
) -> None:
    engine = tiny_engine("fp32", batch_size=3)
    assert engine.environment()["batch_size"] == 3
    run = engine.decode(tiny_prompts[0], 12, [])
    ref = tiny_engine("fp32").decode(tiny_prompts[0], 12, [])
    # fp32 on the same CPU: copies in a batch do not change a greedy choice of this model
    assert first_divergence(run.output_token_ids, ref.output_token_ids) is None


def test_fp8_head_is_refused_off_gpu(pool: EnginePool, tiny_dir: Path) -> None:
    with pytest.raises(UnsupportedFormat, match="compute capability"):
        pool.get(tiny_dir, Target("bf16", lm_head_dtype="fp8_e4m3"))
    with pytest.raises(UnsupportedFormat, match="fp8_e5m2"):
        pool.get(tiny_dir, Target("bf16", lm_head_dtype="fp8_e5m2"))


def test_fp8_head_and_fp8_body_layers_share_one_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FP8 lm_head and the end-to-end FP8 body's linear layers are one product
    (`numerics.fp8_matmul`): the head's logits are an `Fp8Linear` of the same weight, bit for
    bit, one activation scale over a decode step's rows, one per step in a scan. Run on the
    CPU's `_scaled_mm` with the GPU check waived (the head needs SM >= 8.9 for real)."""
    from replay_audit.engine import numerics

    monkeypatch.setattr(numerics, "fp8_supported", lambda *_: (True, ""))
    torch.manual_seed(0)
    weight = (torch.randn(48, 64) * 0.05).to(torch.bfloat16)
    head = numerics.LmHead(weight, "fp8_e4m3", torch.bfloat16)
    linear = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(weight)
    layer = numerics.Fp8Linear(linear, torch.bfloat16)
    hs = torch.randn(5, 64).to(torch.bfloat16)
    assert torch.equal(head.native(hs), layer(hs))
    per_step = torch.cat([layer(hs[i : i + 1]) for i in range(5)]).float()
    assert torch.equal(head.native_steps(hs), per_step)
    assert not torch.equal(per_step, layer(hs).float())  # the scale is per step: it matters
    # C recomputes from the stored BF16 weight, not from its FP8 copy
    assert torch.equal(head.fp32(hs), torch.nn.functional.linear(hs.float(), weight.float()))


def test_mixed_head_format(tiny_engine: EngineOf, tiny_prompts: list[list[int]]) -> None:
    engine = tiny_engine("bf16", lm_head_dtype="fp32")
    env = engine.environment()
    assert env["dtype"] == "bf16" and env["lm_head_dtype"] == "fp32"
    run = engine.decode(tiny_prompts[0], 8, [])
    # an FP32 head's margins are measured in FP32 ulps: far more of them than in BF16's
    assert np.all(run.steps.margins_ulps[run.steps.margins > 0] > 1000)


def test_compiled_path_off_cuda_decodes_like_the_faithful_one(
    tiny_dir: Path, tiny_prompts: list[list[int]]
) -> None:
    """The compiled path's preallocated cache attends over masked unwritten positions (off
    CUDA its step runs uncompiled and uncaptured, and says so); with the eager kernel in fp32
    that changes no choice of this model away from near-ties."""
    from replay_audit.engine import load_engine

    compiled = load_engine(
        tiny_dir, Target("fp32", attn_kernel="eager"), device="cpu", cache="compiled"
    )
    faithful = load_engine(tiny_dir, Target("fp32", attn_kernel="eager"), device="cpu")
    for p in tiny_prompts[:6]:
        d, s = faithful.decode(p, N, []), compiled.decode(p, N, [])
        t = first_divergence(d.output_token_ids, s.output_token_ids)
        assert t is None or d.steps.margins[t] < 1e-3
    extras = compiled.environment()["extras"]
    assert extras["kv_cache"] == "static" and extras["decoder"] == "compiled"
    assert extras["compiled"] is False and extras["cuda_graph"] is False
    assert extras["static_cache_lens_used"] == "256"


def test_trace_generation_logs_the_engines_top_k(real_dir: Path) -> None:
    """`generate` logs generate()'s top-k with the engine's own top-k (`numerics.top_k_on_host`):
    the same ids and logits, in the same order, as the engine's decode of the same prompt in
    the same format, ties at the k-th place included (smallest ids first). On the committed
    model "for i in range(10):" in bf16 has one: two ids share the 5th logit at step 3."""
    from replay_audit.engine import load_engine
    from replay_audit.engine.generate import TraceGenerator

    gen = TraceGenerator(real_dir, dtype="bf16", device="cpu")
    engine = load_engine(real_dir, Target("bf16"), device="cpu")
    tied = 0
    for text in ("for i in range(10):", "class Foo:"):
        trace = gen.trace(text, max_new_tokens=16, top_k=5)
        run = engine.decode(trace["prompt_token_ids"], 16, gen.eos_ids, top_k=5)
        assert run.output_token_ids == trace["output_token_ids"]
        np.testing.assert_array_equal(run.steps.top_k_ids, trace["top_k"]["ids"])
        np.testing.assert_array_equal(run.steps.top_k_logits, trace["top_k"]["logits"])
        logits = np.asarray(trace["top_k"]["logits"])
        tied += int(np.sum(logits[:, 4] == logits[:, 3]))
    assert tied >= 1


@pytest.mark.parametrize(
    "iv", [Intervention("C"), Intervention("A", tau_ulps=2.0), Intervention("B", tau=0.05)]
)
def test_scan_gate_is_the_per_step_gate(
    tiny_engine: EngineOf, tiny_prompts: list[list[int]], iv: Intervention
) -> None:
    """The scan decides all positions at once on the host; it must be the decode's rule."""
    engine = tiny_engine("bf16")
    p = tiny_prompts[4]
    out = engine.decode(p, N, []).output_token_ids
    s = engine.scan(p, out, iv).steps
    for t in range(len(s)):
        top1 = float(s.top_k_logits[t, 0])
        assert s.gate_fired[t] == iv.gate.fires(float(s.margins[t]), top1, "bf16")
        assert s.margins_ulps[t] == s.margins[t] / ulp(top1, "bf16")
    assert np.all(s.token_ids[~s.gate_fired] == s.native_token_ids[~s.gate_fired])
