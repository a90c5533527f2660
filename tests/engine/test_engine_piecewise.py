"""The faithful decode on the CPU: the piecewise pieces (uncaptured here, as the GPU's CUDA graphs
capture them) and transformers' own `generate()` (`GenerateDecoder`) must give, token for token
and logit for logit, what a user's plain `model.generate()` gives, on the committed small
model; the piecewise decoder's check holds it to `generate()`'s SDPA calls, argument for
argument."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from replay_audit.engine import Intervention, Target, attention
from replay_audit.engine.decoder import StepOutput
from replay_audit.engine.piecewise import PiecewiseDecoder, unsupported_reason
from replay_audit.engine.protocol import BatchLayout
from replay_audit.engine.torch_engine import TorchEngine

N = 16  # tokens per decode
EOS = 1  # the committed model's eos id
TEXTS = ["def main():\n    ", "import os\n", "class Foo:"]

EngineOf = Callable[..., TorchEngine]


def generate_only(engine: TorchEngine) -> TorchEngine:
    """`engine` decoding with `generate()` itself (as where the piecewise check fails)."""
    engine._piecewise_error = "the tests' generate() reference"
    return engine


@pytest.fixture(scope="module")
def real_engine(real_dir: Path) -> EngineOf:
    """Engines over the committed model, one per (dtype, kernel, batch size, path): the default
    (piecewise) path, or with `reference=True` generate()'s."""
    made: dict[tuple[object, ...], TorchEngine] = {}

    def get(dtype: str, kernel: str = "sdpa", reference: bool = False, b: int = 1) -> TorchEngine:
        key = (dtype, kernel, reference, b)
        if key not in made:
            target = Target(dtype, attn_kernel=kernel, batch_size=b)
            made[key] = TorchEngine.load(real_dir, target, device="cpu")
            if reference:
                generate_only(made[key])
        return made[key]

    return get


def _prompts(engine: TorchEngine) -> list[list[int]]:
    return [[int(i) for i in engine.tokenizer(t)["input_ids"]] for t in TEXTS]


def _steps(engine: TorchEngine, prompt: list[int], n: int) -> tuple[list[int], list[StepOutput]]:
    """The engine's decode of up to n tokens (stopping after eos), every step's output kept
    (copied: a piecewise step's tensors are its buffers)."""
    tokens: list[int] = []
    outs: list[StepOutput] = []

    def choose(out: StepOutput) -> tuple[int, bool]:
        outs.append(StepOutput(out.hidden.clone(), out.logits.clone(), out.top))
        tokens.append(int(out.top.native[0]))
        return tokens[-1], tokens[-1] == EOS or len(tokens) == n

    with torch.inference_mode(), engine._probe():
        engine._decoder(prompt, len(prompt) + n, None).run(prompt, n, choose, 5)
    return tokens, outs


def plain_generate(
    model: Any, rows: list[list[int]], n: int
) -> tuple[list[list[int]], torch.Tensor]:
    """A user's plain `generate()` of `rows` (left-padded, with the attention mask): every
    row's new tokens and the raw logits (B, T, V)."""
    width = max(len(r) for r in rows)
    x = torch.tensor([[EOS] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = model.generate(
        x,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=EOS,
        pad_token_id=EOS,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[:, width:].tolist(), torch.stack(list(out.logits), dim=1)


def _until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("reference", [False, True], ids=["piecewise", "generate"])
@torch.inference_mode()
def test_decodes_are_plain_generates_bit_for_bit(
    real_engine: EngineOf, dtype: str, kernel: str, reference: bool
) -> None:
    engine = real_engine(dtype, kernel, reference)
    for prompt in _prompts(engine):
        tokens, outs = _steps(engine, prompt, N)
        (gen_tokens,), gen_logits = plain_generate(engine.model, [prompt], N)
        assert tokens == _until_eos(gen_tokens)
        # generate()'s raw logits, exactly converted to float32, are ours
        assert torch.equal(torch.stack([o.logits for o in outs]), gen_logits[0, : len(tokens)])
    path = engine.environment()["extras"]["decoder"]
    assert path == ("generate" if reference else "piecewise")


@torch.inference_mode()
def test_batch_copies_and_a_logged_left_padded_layout(real_engine: EngineOf) -> None:
    """Among 3 copies, the row is plain generate()'s of 3 copies; in a logged left-padded
    layout (the row among rows of other lengths), plain generate()'s row of that batch, which
    a batch-of-one or copies decode need not give."""
    piecewise = real_engine("bf16", b=3)
    prompts = _prompts(piecewise)
    for prompt in prompts[:2] * 2:
        tokens, outs = _steps(piecewise, prompt, 12)
        (row, *_), logits = plain_generate(piecewise.model, [prompt] * 3, 12)
        assert tokens == _until_eos(row)
        assert torch.equal(torch.stack([o.logits for o in outs]), logits[0, : len(tokens)])
    rows = [prompts[0], prompts[1] + prompts[2], prompts[2]]
    gen_rows, gen_logits = plain_generate(piecewise.model, rows, 10)
    for r, prompt in enumerate(rows):
        layout = BatchLayout(tuple(len(p) for p in rows), r)
        run = piecewise.decode(prompt, 10, [EOS], layout=layout)
        assert run.output_token_ids == _until_eos(gen_rows[r])
        steps = len(run.output_token_ids)
        top1 = gen_logits[r, :steps].max(dim=-1).values.numpy()
        assert (run.steps.top_k_logits[:, 0] == top1).all()
    assert set(piecewise.environment()["extras"]["decoder"].split(",")) == {
        "generate",
        "piecewise",
    }


@pytest.mark.parametrize(
    "iv", [Intervention(), Intervention("C", tau=0.0), Intervention("B", tau=0.05)]
)
def test_engine_decode_equals_generates(real_engine: EngineOf, iv: Intervention) -> None:
    """The whole decode (choice, gate, intervention, top-k, forced prefix) is the same on both
    paths, and the environment says which path ran and that its check passed."""
    piecewise, reference = real_engine("bf16"), real_engine("bf16", reference=True)
    options: list[dict[str, Any]] = [{}, {"forced_prefix": [40, 41]}, {"top_k": 25}]
    for prompt, kw in zip(_prompts(piecewise), options, strict=True):
        a = piecewise.decode(prompt, N, [EOS], iv, **kw)
        b = reference.decode(prompt, N, [EOS], iv, **kw)
        assert a.output_token_ids == b.output_token_ids
        assert (a.steps.top_k_ids == b.steps.top_k_ids).all()
        assert (a.steps.top_k_logits == b.steps.top_k_logits).all()
        assert (a.steps.gate_fired == b.steps.gate_fired).all()
    extras = piecewise.environment()["extras"]
    assert extras["decoder"] == "piecewise" and extras["piecewise_check"] == "bitwise"
    assert extras["kv_cache"] == "dynamic" and extras["cuda_graph"] is False
    assert extras["attention_backends"] == "prefill:flash;decode:flash"
    assert reference.environment()["extras"]["decoder"] == "generate"
    from replay_audit.traces.schemas import NumericalConfig

    NumericalConfig.model_validate(piecewise.environment())


def test_a_step_that_rounds_otherwise_fails_the_check(
    real_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A piece that rounds differently (here: one ulp-sized nudge of the residual stream) fails
    the check; the engine then decodes with generate(), and says why."""
    finish = PiecewiseDecoder._finish_layer

    def nudged(self: PiecewiseDecoder, i: int, residual: torch.Tensor) -> torch.Tensor:
        out = finish(self, i, residual)
        return out * (1 + torch.finfo(out.dtype).eps) if i == 0 else out

    monkeypatch.setattr(PiecewiseDecoder, "_finish_layer", nudged)
    engine = TorchEngine.load(real_dir, Target("fp32"), device="cpu")
    prompt = _prompts(engine)[0]
    (gen,), _ = plain_generate(engine.model, [prompt], N)
    assert engine.decode(prompt, N, [EOS]).output_token_ids == _until_eos(gen)
    extras = engine.environment()["extras"]
    assert extras["decoder"] == "generate"
    assert extras["piecewise_error"].startswith("check failed: step 1 differs from generate()")


def test_an_attention_call_other_than_generates_fails_the_check(
    real_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check compares the SDPA calls themselves: a step that calls attention otherwise than
    generate() (here without `enable_gqa`, its keys and values repeated per query head: the
    same numbers on this CPU, another call) fails it, naming the call."""
    import replay_audit.engine.piecewise as piecewise_module

    learned = piecewise_module.direct_options

    def other_call(calls: Any, layers: int) -> attention.SdpaOptions | None:
        options = learned(calls, layers)
        return None if options is None else dataclasses.replace(options, scale=0.125000001)

    monkeypatch.setattr(piecewise_module, "direct_options", other_call)
    engine = TorchEngine.load(real_dir, Target("bf16"), device="cpu")
    engine.decode(_prompts(engine)[1], 6, [EOS])
    error = engine.environment()["extras"]["piecewise_error"]
    assert error.startswith("check failed: step 1 calls SDPA otherwise than generate()")
    assert "0.125000001" in error


def test_a_check_that_raises_decodes_with_generate_and_says_why(
    real_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transformers version whose functions do not fit the pieces raises in the check: the
    engine decodes with generate() and records what was raised."""

    def broken(self: PiecewiseDecoder, token: int) -> StepOutput:
        raise TypeError("create_causal_mask() got an unexpected keyword argument")

    monkeypatch.setattr(PiecewiseDecoder, "step", broken)
    engine = TorchEngine.load(real_dir, Target("bf16"), device="cpu")
    prompt = _prompts(engine)[1]
    (gen,), _ = plain_generate(engine.model, [prompt], N)
    assert engine.decode(prompt, N, [EOS]).output_token_ids == _until_eos(gen)
    extras = engine.environment()["extras"]
    assert extras["decoder"] == "generate"
    assert extras["piecewise_error"].startswith("check raised TypeError: create_causal_mask")


@torch.inference_mode()
def test_a_failed_capture_runs_the_pieces_uncaptured(real_engine: EngineOf) -> None:
    """Asked for graphs where none can be captured (no CUDA here), the decoder records why and
    runs the same pieces uncaptured: still generate()'s bits."""
    engine = real_engine("bf16")
    piecewise = PiecewiseDecoder(engine.body, engine.head, engine.generate, graphs=True)
    assert piecewise.check(_prompts(engine)[2])
    assert piecewise.capture_error is not None and not piecewise.graphs


def test_models_it_does_not_follow_decode_with_generate(tmp_path: Path) -> None:
    """A body of other classes (here Mistral's) is refused by name, and the engine decodes it
    with generate(), saying why."""
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
    assert extras["decoder"] == "generate" and "MistralDecoderLayer" in extras["piecewise_error"]


def test_the_default_path_is_piecewise_on_the_cpu_too(real_engine: EngineOf) -> None:
    """No path is chosen by device: the CPU decodes with the piecewise pieces uncaptured,
    checked against generate() like a GPU's."""
    engine = TorchEngine(real_engine("bf16").model, None, Target("bf16"), torch.device("cpu"))
    assert engine.cache_kind == "piecewise"
    assert engine.environment()["extras"]["decoder"] == "piecewise"  # before any decode
    engine.decode([5, 6, 7], 4, [])
    extras = engine.environment()["extras"]
    assert extras["decoder"] == "piecewise" and extras["piecewise_check"] == "bitwise"
    assert extras["cuda_graph"] is False and "piecewise_error" not in extras


@torch.inference_mode()
def test_sdpa_steps_call_sdpa_directly_eager_steps_use_the_cache(real_engine: EngineOf) -> None:
    """With SDPA, generate()'s decode steps pass no mask: the check learns their options
    (`enable_gqa` on this GQA model) and the steps call SDPA directly on keys and values grown
    as `DynamicCache` grows them. Eager attention has a mask at every step: its steps run
    transformers' attention function on the `DynamicCache`."""
    sdpa, eager = real_engine("fp32"), real_engine("fp32", kernel="eager")
    assert sdpa.model.config.num_key_value_heads < sdpa.model.config.num_attention_heads
    for engine in (sdpa, eager):
        engine.decode(_prompts(engine)[1], 6, [EOS])
    direct = sdpa._piecewise and sdpa._piecewise.direct
    assert direct and direct.enable_gqa is True
    assert eager._piecewise is not None and eager._piecewise.direct is None
    assert "attention_backends" not in eager.environment()["extras"]  # no SDPA call ran


def test_threads_sharing_an_engine_decode_one_at_a_time(real_engine: EngineOf) -> None:
    """A pool hands one engine to every thread, and its decoders are reused by every decode:
    concurrent decodes must each get what a decode alone gets."""
    from concurrent.futures import ThreadPoolExecutor

    engine = real_engine("fp32")
    prompts = _prompts(engine)
    alone = [engine.decode(p, N, [EOS]).output_token_ids for p in prompts]
    with ThreadPoolExecutor(max_workers=3) as ex:
        runs = list(ex.map(lambda p: engine.decode(p, N, [EOS]).output_token_ids, prompts * 3))
    assert runs == alone * 3
