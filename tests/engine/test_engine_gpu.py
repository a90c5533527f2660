"""The engine's properties on CUDA, plus the FP8-E4M3 lm_head (compute capability >= 8.9).
Run with the device tool: `pytest -m gpu tests/engine --confcutdir=tests/engine`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from replay_audit.engine import EnginePool, Intervention, Target
from replay_audit.engine.protocol import Engine, ScanItem
from replay_audit.engine.testing import TINY_EOS_ID
from replay_audit.replays.domain import LoggedTrace
from replay_audit.replays.pipeline import compare_arms, replay_trace
from replay_audit.traces.schemas import TraceCreate

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
N = 32
TEXTS = [
    "The quick brown fox",
    "def main():",
    "Once upon a time",
    "import os\n",
    "1 + 1 = ",
    "class Foo:",
    "SELECT * FROM",
    "Hello, world",
    "# Copyright",
    "for i in range(3):",
]


def _sm() -> tuple[int, int]:
    return torch.cuda.get_device_capability()  # type: ignore[no-any-return]


fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or _sm() < (8, 9), reason="FP8 needs compute capability >= 8.9"
)


@pytest.fixture(scope="module")
def gpool() -> EnginePool:
    return EnginePool(device="cuda")


@pytest.fixture(scope="module")
def cuda_engine(gpool: EnginePool, tiny_dir: Path) -> Callable[..., Engine]:
    def get(dtype: str, **kw: object) -> Engine:
        return gpool.get(tiny_dir, Target(dtype, **kw))  # type: ignore[arg-type]

    return get


def _traces(model_dir: Path, dtype: str) -> list[LoggedTrace]:
    from replay_audit.engine.generate import TraceGenerator

    gen = TraceGenerator(model_dir, dtype=dtype, attn_kernel="sdpa", device="cuda")
    return [
        LoggedTrace.from_json(
            TraceCreate.model_validate(
                gen.trace(t, max_new_tokens=N, external_id=f"p{i}")
            ).model_dump()
        )
        for i, t in enumerate(TEXTS)
    ]


def test_environment_on_cuda(cuda_engine: Callable[..., Engine]) -> None:
    env = cuda_engine("bf16").environment()
    assert env["device"] == "cuda" and env["gpu"]["sm"] == "{}.{}".format(*_sm())
    assert env["cuda_version"] and env["tf32"] is False and env["deterministic"] is True
    from replay_audit.traces.schemas import NumericalConfig

    NumericalConfig.model_validate(env)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_self_replay_exact_on_cuda(gpool: EnginePool, tiny_dir: Path, dtype: str) -> None:
    for tr in _traces(tiny_dir, dtype):
        r = replay_trace(tr, Target(dtype), gpool, model_dir=tiny_dir)
        assert r.exact_match, (tr.external_id, r.first_divergence_step)


def test_bf16_vs_fp16_on_cuda_and_scan_then_decode(gpool: EnginePool, tiny_dir: Path) -> None:
    traces = _traces(tiny_dir, "bf16")
    full = [replay_trace(t, Target("fp16"), gpool, model_dir=tiny_dir) for t in traces]
    fast = [
        replay_trace(t, Target("fp16"), gpool, model_dir=tiny_dir, mode="scan_then_decode")
        for t in traces
    ]
    assert [r.first_divergence_step for r in full] == [r.first_divergence_step for r in fast]
    assert any(not r.exact_match for r in full)  # BF16 and FP16 do part on this prompt set


def test_gate_tau_zero_and_negative_on_cuda(cuda_engine: Callable[..., Engine]) -> None:
    e = cuda_engine("fp16")
    assert e.decode([5, 6, 7], 16, [], Intervention("C", tau=0.0)).steps.gate_fired.all()
    run = e.decode([5, 6, 7], 16, [], Intervention("C", tau=-1.0))
    assert not run.steps.gate_fired.any()


def test_b_full_vocab_equals_c_on_cuda(cuda_engine: Callable[..., Engine]) -> None:
    e = cuda_engine("bf16")
    for p in ([1, 2, 3], [40, 50, 60, 70], [200, 3, 9]):
        b = e.decode(p, N, [TINY_EOS_ID], Intervention("B", tau=0.0, top_k=e.vocab_size))
        c = e.decode(p, N, [TINY_EOS_ID], Intervention("C", tau=0.0))
        assert b.output_token_ids == c.output_token_ids


@pytest.mark.parametrize("head", ["bf16", "fp16", pytest.param("fp8_e4m3", marks=fp8)])
def test_c_bitwise_identical_from_identical_hidden_states(
    cuda_engine: Callable[..., Engine], head: str
) -> None:
    ref = cuda_engine("bf16").head  # type: ignore[attr-defined]
    other = cuda_engine("bf16", lm_head_dtype=head).head  # type: ignore[attr-defined]
    h = torch.randn(4, ref.weight.shape[1], device="cuda").to(torch.bfloat16)
    assert torch.equal(ref.fp32(h), other.fp32(h))


def _uncaptured(engine: Any, length: int = 256) -> Any:
    """`engine` (compiled path) with its decoder of cache `length` run eagerly: neither compiled
    nor captured (the static-cache step as the CPU runs it)."""
    from replay_audit.engine.decoder import CompiledDecoder

    eager = CompiledDecoder(engine.body, engine.head, length)
    eager._capture_failed = True
    engine._compiled[length] = eager
    return engine


def test_compiled_cache_buckets(tiny_dir: Path) -> None:
    """A compiled decode gets the smallest power-of-two cache (from 256) that holds it; a
    longer one than `max_cache_len` takes the faithful path."""
    from replay_audit.engine.torch_engine import TorchEngine

    e = TorchEngine.load(tiny_dir, Target("bf16"), device="cuda", cache="compiled")
    e.max_cache_len = 1000
    assert len(e.decode([1, 2, 3], 200, []).steps) == 200
    assert e.environment()["extras"]["static_cache_lens_used"] == "256"
    assert len(e.decode([1, 2, 3], 300, []).steps) == 300
    assert e.environment()["extras"]["static_cache_lens_used"] == "256,512"
    assert len(e.decode([1, 2, 3], 700, []).steps) == 700  # 1024 rounds down to the maximum
    assert e.environment()["extras"]["static_cache_lens_used"] == "256,512,1000"
    assert len(e.decode([1, 2, 3], 1100, []).steps) == 1100  # longer: the piecewise path
    assert e.environment()["extras"]["static_cache_lens_used"] == "256,512,1000"


def test_compiled_step_matches_eager_static_step(real_dir: Path) -> None:
    """The torch.compile'd step (captured in the graph) against the same static-cache step run
    eagerly, uncaptured, on the committed small model. Inductor fuses RMSNorm, RoPE and SiLU,
    so bitwise equality is not promised; what is: the first step (both from the same eager
    prefill) is bitwise equal, the logits agree to BF16 rounding while the tokens agree, a
    token differs only where the eager step's top two were within a few BF16 ulps, and the
    compiled replay is reproducible."""
    from replay_audit.engine.torch_engine import TorchEngine

    eager = _uncaptured(TorchEngine.load(real_dir, Target("bf16"), device="cuda", cache="compiled"))
    comp = TorchEngine.load(real_dir, Target("bf16"), device="cuda", cache="compiled")
    diverged = 0
    for text in TEXTS:
        p = list(eager.tokenizer.encode(text))
        a, b = eager.decode(p, N, []), comp.decode(p, N, [])
        assert eager.environment()["extras"]["cuda_graph"] is False
        extras = comp.environment()["extras"]
        assert extras["compiled"] is True, extras.get("compile_error")
        assert extras["cuda_graph"] is True
        np.testing.assert_array_equal(a.steps.top_k_logits[0], b.steps.top_k_logits[0])
        again = comp.decode(p, N, [])
        assert again.output_token_ids == b.output_token_ids
        np.testing.assert_array_equal(again.steps.top_k_logits, b.steps.top_k_logits)
        n = min(len(a.steps), len(b.steps))
        same = [i for i in range(n) if a.output_token_ids[i] != b.output_token_ids[i]]
        d = same[0] if same else n
        np.testing.assert_allclose(
            a.steps.top_k_logits[:d, 0], b.steps.top_k_logits[:d, 0], rtol=2**-5, atol=2**-5
        )
        if d < n:
            diverged += 1
            from replay_audit.formats import ulp

            top1 = float(a.steps.top_k_logits[d, 0])
            assert b.output_token_ids[d] in a.steps.top_k_ids[d, :2].tolist()
            assert a.steps.margins[d] <= 4 * ulp(top1, "bf16"), (text, d)
    assert diverged <= len(TEXTS) // 5


@fp8
def test_fp8_head(gpool: EnginePool, tiny_dir: Path) -> None:
    e = gpool.get(tiny_dir, Target("bf16", lm_head_dtype="fp8_e4m3"))
    env = e.environment()
    assert env["lm_head_dtype"] == "fp8_e4m3" and env["dtype"] == "bf16"
    run = e.decode([1, 2, 3, 4], N, [])
    s = run.steps
    assert len(s) == N and np.all(s.top_k_logits[:, :-1] >= s.top_k_logits[:, 1:])
    from replay_audit.diff import ulp_array

    np.testing.assert_allclose(
        s.margins_ulps, s.margins / ulp_array(s.top_k_logits[:, 0], "fp8_e4m3")
    )
    # τ in ulps of the FP8 format fires at least as often as the BF16-calibrated 1e-3
    wide = e.decode([1, 2, 3, 4], N, [], Intervention("C", tau_ulps=1.0))
    narrow = e.decode([1, 2, 3, 4], N, [], Intervention("C", tau=1e-3))
    assert wide.steps.gate_fired.sum() >= narrow.steps.gate_fired.sum()
    # both-arms protocol, BF16 head vs FP8 head, identical BF16 bodies
    trace = _traces(tiny_dir, "bf16")[0]
    iv = Intervention("C", tau=0.0)
    r = compare_arms(
        trace,
        Target("bf16", intervention=iv),
        Target("bf16", lm_head_dtype="fp8_e4m3", intervention=iv),
        gpool,
        model_dir=tiny_dir,
    )
    # ungated C makes both heads compute the same FP32 logits from the same BF16 body
    assert r.exact_match


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_batched_scan_is_bs1_within_the_tolerance_on_cuda(
    cuda_engine: Callable[..., Engine], tiny_dir: Path, dtype: str
) -> None:
    """The batched scan against bs=1 `scan` on CUDA. cuBLAS chooses its GEMM kernel by the row
    count and the attention kernels split by length, so bits may differ (as sdpa's do on CPU,
    tests/engine/test_engine_torch_scan_batch.py); what must hold: margins and top-1 logits
    within 4 ulps of the format at bs=1's top-1 (fp32: 1e-4), tokens different only at
    near-ties within that tolerance, and so the same first disagreement elsewhere."""
    from replay_audit.formats import ulp_array

    engine = cuda_engine(dtype)
    items = [
        ScanItem(t.prompt_token_ids.tolist(), t.output_token_ids[: 12 + 2 * i].tolist())
        for i, t in enumerate(_traces(tiny_dir, "bf16"))
    ]
    batched = engine.scan_batch(items, token_budget=256)
    assert "x" in engine.environment()["extras"]["scan_batch_shapes"]
    same_t_star = 0
    for it, b in zip(items, batched, strict=True):
        a = engine.scan(it.prompt_ids, it.output_ids)
        tol = 4 * ulp_array(a.steps.top_k_logits[:, 0], dtype)
        if dtype == "fp32":
            tol = np.maximum(tol, 1e-4)
        assert np.all(np.abs(a.steps.margins - b.steps.margins) <= tol)
        top1 = a.steps.top_k_logits[:, 0].astype(float) - b.steps.top_k_logits[:, 0]
        assert np.all(np.abs(top1) <= tol)
        flips = np.flatnonzero(a.steps.native_token_ids != b.steps.native_token_ids)
        assert np.all(a.steps.margins[flips] <= tol[flips])
        same_t_star += a.first_disagreement == b.first_disagreement
    assert same_t_star >= len(items) - 1


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_piecewise_graphs_are_the_dynamic_path_bit_for_bit(real_dir: Path, dtype: str) -> None:
    """The piecewise decode on CUDA: every piece captured in a CUDA graph, the attention eager
    between them; each step's hidden state and float32 logits equal the dynamic path's with
    `torch.equal`, its tokens and logits generate()'s, with one batch row and with copies."""
    from transformers import GenerationConfig

    from replay_audit.engine.decoder import DynamicDecoder
    from replay_audit.engine.piecewise import PiecewiseDecoder
    from replay_audit.engine.torch_engine import TorchEngine

    def greedy(decoder: Any, prompt: list[int], n: int) -> tuple[list[int], list[Any]]:
        step = decoder.prefill(prompt, 5)
        tokens, outs = [], []
        while True:
            outs.append((step.hidden.clone(), step.logits.clone()))
            tokens.append(int(step.top.native[0]))
            if tokens[-1] == eos or len(tokens) == n:
                return tokens, outs
            step = decoder.step(tokens[-1])

    eos = 1  # the committed model's
    for b in (1, 2):
        engine = TorchEngine.load(real_dir, Target(dtype, batch_size=b), device="cuda")
        piecewise = PiecewiseDecoder(engine.body, engine.head)
        for text in TEXTS[:4]:
            p = list(engine.tokenizer.encode(text))
            with torch.inference_mode():
                tokens, outs = greedy(piecewise, p, N)
                ref_tokens, ref = greedy(DynamicDecoder(engine.body, engine.head), p, N)
            assert len(piecewise.graphs) == len(piecewise.layers) + 1, piecewise.capture_error
            assert tokens == ref_tokens, text
            for t, ((h, z), (rh, rz)) in enumerate(zip(outs, ref, strict=True)):
                assert torch.equal(z, rz) and torch.equal(h, rh), (text, t)
            if b == 1:
                config: Any = GenerationConfig
                x = torch.tensor([p], device="cuda")
                g = engine.model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    generation_config=config(
                        do_sample=False,
                        max_new_tokens=N,
                        eos_token_id=eos,
                        pad_token_id=eos,
                        output_logits=True,
                        return_dict_in_generate=True,
                    ),
                )
                assert g.sequences[0, len(p) :].tolist() == tokens
                assert all(
                    torch.equal(z, gz[0].float()) for (_, z), gz in zip(outs, g.logits, strict=True)
                )
        dynamic = TorchEngine(engine.model, None, engine.target, engine.device)
        dynamic._piecewise_error = "the test's dynamic reference"  # its fallback path
        p = list(engine.tokenizer.encode(TEXTS[0]))
        a, d = engine.decode(p, N, [eos]), dynamic.decode(p, N, [eos])
        assert a.output_token_ids == d.output_token_ids
        np.testing.assert_array_equal(a.steps.top_k_logits, d.steps.top_k_logits)
        extras = engine.environment()["extras"]
        assert extras["decoder"] == "piecewise" and extras["piecewise_check"] == "bitwise"
        assert extras["cuda_graph"] is True, extras.get("capture_error")
