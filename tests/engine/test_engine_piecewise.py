"""The piecewise decode (`engine/piecewise.py`), the faithful default on every device, on the
CPU: the same pieces the GPU captures in CUDA graphs, run without graphs. Its logits must be
the dynamic path's bit for bit, and its tokens and logits those of transformers' `generate()`,
on the committed small model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from replay_audit.engine import Intervention, Target
from replay_audit.engine.decoder import DynamicDecoder, StepOutput
from replay_audit.engine.piecewise import PiecewiseDecoder, unsupported_reason
from replay_audit.engine.torch_engine import TorchEngine

N = 16  # tokens per decode
EOS = 1  # the committed model's eos id
TEXTS = ["def main():\n    ", "import os\n", "class Foo:"]

EngineOf = Callable[..., TorchEngine]


def dynamic_only(engine: TorchEngine) -> TorchEngine:
    """`engine` decoding with its fallback, the dynamic path (as where the piecewise check
    fails): the reference the piecewise decode is held to."""
    engine._piecewise_error = "the tests' dynamic reference"
    return engine


@pytest.fixture(scope="module")
def real_engine(real_dir: Path) -> EngineOf:
    """Engines over the committed model, one per (dtype, kernel, batch size, path): the default
    (piecewise) path, or with `dynamic=True` the dynamic one."""
    made: dict[tuple[object, ...], TorchEngine] = {}

    def get(dtype: str, kernel: str = "sdpa", dynamic: bool = False, b: int = 1) -> TorchEngine:
        key = (dtype, kernel, dynamic, b)
        if key not in made:
            target = Target(dtype, attn_kernel=kernel, batch_size=b)
            made[key] = TorchEngine.load(real_dir, target, device="cpu")
            if dynamic:
                dynamic_only(made[key])
        return made[key]

    return get


def _prompts(engine: TorchEngine) -> list[list[int]]:
    return [[int(i) for i in engine.tokenizer(t)["input_ids"]] for t in TEXTS]


def _greedy(
    decoder: DynamicDecoder | PiecewiseDecoder, prompt: list[int], n: int
) -> tuple[list[int], list[StepOutput]]:
    """Greedy decode of up to n tokens (stopping after eos), every step's output kept (copied:
    a piecewise step's tensors are its buffers)."""
    step = decoder.prefill(prompt, 5)
    tokens: list[int] = []
    outs: list[StepOutput] = []
    while True:
        outs.append(StepOutput(step.hidden.clone(), step.logits.clone(), step.top))
        tokens.append(int(step.top.native[0]))
        if tokens[-1] == EOS or len(tokens) == n:
            return tokens, outs
        step = decoder.step(tokens[-1])


def _generate(engine: TorchEngine, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    from transformers import GenerationConfig

    config_cls: Any = GenerationConfig
    config = config_cls(
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=EOS,
        pad_token_id=EOS,
        output_logits=True,
        return_dict_in_generate=True,
    )
    x = torch.tensor([prompt])
    out = engine.model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
    return out.sequences[0, len(prompt) :].tolist(), torch.stack([z[0] for z in out.logits])


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@torch.inference_mode()
def test_logits_are_the_dynamic_paths_and_generates_bit_for_bit(
    real_engine: EngineOf, dtype: str, kernel: str
) -> None:
    engine = real_engine(dtype, kernel)
    piecewise = PiecewiseDecoder(engine.body, engine.head)
    assert not piecewise.graphs  # the CPU runs the pieces without graphs
    for prompt in _prompts(engine):
        tokens, outs = _greedy(piecewise, prompt, N)
        ref_tokens, ref_outs = _greedy(DynamicDecoder(engine.body, engine.head), prompt, N)
        assert tokens == ref_tokens
        for t, (a, b) in enumerate(zip(outs, ref_outs, strict=True)):
            assert torch.equal(a.logits, b.logits), (prompt, t)
            assert torch.equal(a.hidden, b.hidden), (prompt, t)
            assert (a.top.ids == b.top.ids).all() and (a.top.logits == b.top.logits).all()
        gen_tokens, gen_logits = _generate(engine, prompt, N)
        assert tokens == gen_tokens
        # generate()'s raw logits, exactly converted to float32, are ours
        assert torch.equal(torch.stack([o.logits for o in outs]), gen_logits.float())


@torch.inference_mode()
def test_a_decoder_is_reused_across_decodes_and_batch_copies(real_engine: EngineOf) -> None:
    """One decoder decodes prompt after prompt (a new cache each); with batch copies the row
    of interest is the dynamic path's among its copies too."""
    engine = real_engine("bf16", b=3)
    piecewise = PiecewiseDecoder(engine.body, engine.head)
    for prompt in _prompts(engine)[:2] * 2:
        _, outs = _greedy(piecewise, prompt, 12)
        _, ref = _greedy(DynamicDecoder(engine.body, engine.head), prompt, 12)
        assert outs[-1].hidden.shape[0] == 3
        assert all(torch.equal(a.logits, b.logits) for a, b in zip(outs, ref, strict=True))


@pytest.mark.parametrize(
    "iv", [Intervention(), Intervention("C", tau=0.0), Intervention("B", tau=0.05)]
)
def test_engine_decode_equals_the_dynamic_engine(real_engine: EngineOf, iv: Intervention) -> None:
    """The whole decode (choice, gate, intervention, top-k, forced prefix) is the dynamic
    engine's, and the environment says which path ran and that its check passed."""
    piecewise, dynamic = real_engine("bf16"), real_engine("bf16", dynamic=True)
    options: list[dict[str, Any]] = [{}, {"forced_prefix": [40, 41]}, {"top_k": 25}]
    for prompt, kw in zip(_prompts(piecewise), options, strict=True):
        a = piecewise.decode(prompt, N, [EOS], iv, **kw)
        b = dynamic.decode(prompt, N, [EOS], iv, **kw)
        assert a.output_token_ids == b.output_token_ids
        assert (a.steps.top_k_ids == b.steps.top_k_ids).all()
        assert (a.steps.top_k_logits == b.steps.top_k_logits).all()
        assert (a.steps.gate_fired == b.steps.gate_fired).all()
    extras = piecewise.environment()["extras"]
    assert extras["decoder"] == "piecewise" and extras["piecewise_check"] == "bitwise"
    assert extras["kv_cache"] == "dynamic" and extras["cuda_graph"] is False
    assert dynamic.environment()["extras"]["decoder"] == "dynamic"
    from replay_audit.traces.schemas import NumericalConfig

    NumericalConfig.model_validate(piecewise.environment())


def test_a_failed_check_decodes_dynamically_and_says_why(
    real_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A piece that rounds differently (here: one ulp-sized nudge of the residual stream) fails
    the check; the engine then decodes with the dynamic path, token-identical to it."""
    finish = PiecewiseDecoder._finish_layer

    def nudged(self: PiecewiseDecoder, i: int, residual: torch.Tensor) -> torch.Tensor:
        out = finish(self, i, residual)
        return out * (1 + torch.finfo(out.dtype).eps) if i == 0 else out

    monkeypatch.setattr(PiecewiseDecoder, "_finish_layer", nudged)
    engine = TorchEngine.load(real_dir, Target("fp32"), device="cpu")
    dynamic = dynamic_only(TorchEngine.load(real_dir, Target("fp32"), device="cpu"))
    prompt = _prompts(engine)[0]
    assert (
        engine.decode(prompt, N, [EOS]).output_token_ids
        == dynamic.decode(prompt, N, [EOS]).output_token_ids
    )
    extras = engine.environment()["extras"]
    assert extras["decoder"] == "dynamic"
    assert extras["piecewise_error"].startswith("check failed: step 1 differs")


def test_a_check_that_raises_decodes_dynamically_and_says_why(
    real_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transformers version whose functions do not fit the pieces raises in the check: the
    engine decodes dynamically and records what was raised."""

    def broken(self: PiecewiseDecoder, token: int) -> StepOutput:
        raise TypeError("create_causal_mask() got an unexpected keyword argument")

    monkeypatch.setattr(PiecewiseDecoder, "step", broken)
    engine = TorchEngine.load(real_dir, Target("bf16"), device="cpu")
    dynamic = dynamic_only(TorchEngine.load(real_dir, Target("bf16"), device="cpu"))
    prompt = _prompts(engine)[1]
    a, b = engine.decode(prompt, N, [EOS]), dynamic.decode(prompt, N, [EOS])
    assert a.output_token_ids == b.output_token_ids
    extras = engine.environment()["extras"]
    assert extras["decoder"] == "dynamic"
    assert extras["piecewise_error"].startswith("check raised TypeError: create_causal_mask")


@torch.inference_mode()
def test_a_failed_capture_runs_the_pieces_uncaptured(real_engine: EngineOf) -> None:
    """Asked for graphs where none can be captured (no CUDA here), the decoder records why and
    runs the same pieces uncaptured: still the dynamic path's bits."""
    engine = real_engine("bf16")
    piecewise = PiecewiseDecoder(engine.body, engine.head, graphs=True)
    prompt = _prompts(engine)[2]
    _, outs = _greedy(piecewise, prompt, 8)
    _, ref = _greedy(DynamicDecoder(engine.body, engine.head), prompt, 8)
    assert piecewise.capture_error is not None and not piecewise.graphs
    assert all(torch.equal(a.logits, b.logits) for a, b in zip(outs, ref, strict=True))


def test_models_it_does_not_follow_decode_dynamically(tmp_path: Path) -> None:
    """A body of other classes (here Mistral's) is refused by name, and the engine decodes it
    with the dynamic path, saying why."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=None,
    )
    torch.manual_seed(0)
    model: Any = MistralForCausalLM(config)
    model.eval()
    reason = unsupported_reason(model)
    assert reason is not None and "MistralDecoderLayer" in reason
    engine = TorchEngine(model, None, Target("fp32"), torch.device("cpu"))
    run = engine.decode([3, 4, 5], 6, [])
    assert len(run.output_token_ids) == 6
    extras = engine.environment()["extras"]
    assert extras["decoder"] == "dynamic" and "MistralDecoderLayer" in extras["piecewise_error"]


def test_the_default_path_is_piecewise_on_the_cpu_too(real_engine: EngineOf) -> None:
    """No path is chosen by device: the CPU decodes with the piecewise pieces uncaptured,
    checked against the dynamic path like a GPU's."""
    engine = TorchEngine(real_engine("bf16").model, None, Target("bf16"), torch.device("cpu"))
    assert engine.cache_kind == "piecewise"
    assert engine.environment()["extras"]["decoder"] == "piecewise"  # before any decode
    engine.decode([5, 6, 7], 4, [])
    extras = engine.environment()["extras"]
    assert extras["decoder"] == "piecewise" and extras["piecewise_check"] == "bitwise"
    assert extras["cuda_graph"] is False and "piecewise_error" not in extras


@pytest.mark.parametrize("headroom", [1, 3, 256])
@torch.inference_mode()
def test_sdpa_steps_keep_the_cache_in_buffers_that_grow(
    real_engine: EngineOf, monkeypatch: pytest.MonkeyPatch, headroom: int
) -> None:
    """With SDPA (no mask for one query token) the steps read the keys and values from the
    decoder's own buffers, grown by doubling as the decode goes (a headroom of 1 or 3 grows
    them several times in 16 tokens): still the dynamic path's logits and hidden states, bit
    for bit, on the model's GQA heads (2 key/value heads for 4 query heads)."""
    import replay_audit.engine.piecewise as piecewise_module

    monkeypatch.setattr(piecewise_module, "CACHE_HEADROOM", headroom)
    engine = real_engine("fp32")
    assert engine.model.config.num_key_value_heads < engine.model.config.num_attention_heads
    piecewise = PiecewiseDecoder(engine.body, engine.head)
    prompt = _prompts(engine)[0]
    _, outs = _greedy(piecewise, prompt, N)
    _, ref = _greedy(DynamicDecoder(engine.body, engine.head), prompt, N)
    assert piecewise.buffered and piecewise.cache is None
    # the buffers grew past their first size and hold every position decoded
    assert piecewise.buffers[0].shape[3] >= len(prompt) + len(outs) - 1
    for a, b in zip(outs, ref, strict=True):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)


@torch.inference_mode()
def test_eager_attention_steps_on_the_dynamic_cache(real_engine: EngineOf) -> None:
    """Eager attention has a mask at every step: the steps keep transformers' `DynamicCache`
    and build the mask as the model's forward does, with no buffers."""
    engine = real_engine("fp32", kernel="eager")
    piecewise = PiecewiseDecoder(engine.body, engine.head)
    _greedy(piecewise, _prompts(engine)[1], 6)
    assert not piecewise.buffered and not piecewise.buffers
    assert piecewise.cache is not None


def test_threads_sharing_an_engine_decode_one_at_a_time(real_engine: EngineOf) -> None:
    """A pool hands one engine to every thread, and its piecewise decoder (buffers, cache) is
    reused by every decode: concurrent decodes must each get what a decode alone gets."""
    from concurrent.futures import ThreadPoolExecutor

    engine = real_engine("fp32")
    prompts = _prompts(engine)
    alone = [engine.decode(p, N, [EOS]).output_token_ids for p in prompts]
    with ThreadPoolExecutor(max_workers=3) as ex:
        runs = list(ex.map(lambda p: engine.decode(p, N, [EOS]).output_token_ids, prompts * 3))
    assert runs == alone * 3
