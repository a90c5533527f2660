"""A real pretrained checkpoint on the CPU: SmolLM2-135M-Instruct (scripts/build_smollm2.py,
the `smollm2_dir` fixture), with chat prompts rendered by its own chat template.

The engine's faithful decode and `replay-audit generate` must compute what a user's plain
`model.generate(**inputs, do_sample=False)` computes on the same checkpoint: the same tokens,
the same top-1 logits bit for bit, and the same SDPA calls (shapes, strides, dtypes, options and
the backend torch picks for them), call for call. The committed 1.45 M-parameter model's tests
(test_engine_piecewise.py) hold the same properties on a model trained here; these hold them
on the geometry of a model users run (30 layers, 9 query heads over 3 key/value heads, tied
embeddings, a 49,152-token vocabulary).

About 1 s a decode of 24 tokens in one torch thread: each test takes a few seconds, most of it
loading (the plain model and the engine once per dtype for the module).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from replay_audit.engine import attention
from replay_audit.engine.protocol import Target
from replay_audit.engine.torch_engine import TorchEngine

pytestmark = pytest.mark.slow

N = 24  # new tokens per decode
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: Chat prompts: the first one's answer ends (eos) before N tokens, the others' run past N.
MESSAGES: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [
        {"role": "system", "content": "You answer in full sentences."},
        {"role": "user", "content": "Explain what a hash table is and why lookups are fast."},
    ],
]


class SdpaCalls(TorchFunctionMode):
    """Every `scaled_dot_product_attention` call in the block, recorded as `attention.observe`
    records one (`attention.SdpaCall`: its arguments but the values, and the backend torch's
    dispatcher picks for them). A torch-function mode sees the calls that go to torch's own
    function directly (`attention.unobserved()`, the piecewise decoder's layers after the
    first) as well as those through the engine's observing wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.observed = attention.Observed(keep_calls=True)

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch._C._nn.scaled_dot_product_attention:
            self.observed.add(args, dict(kwargs))
        return func(*args, **kwargs)

    @property
    def calls(self) -> list[attention.SdpaCall]:
        return self.observed.calls


@dataclass(frozen=True)
class PlainRun:
    """A user's plain greedy `generate()` of one rendered chat prompt: the new tokens (to the
    first eos), the raw logits of those steps (T, V) float32, its SDPA calls in order as
    `attention.observe(keep_calls=True)` saw them, and what `generate()` returned."""

    prompt_ids: list[int]
    tokens: list[int]
    logits: torch.Tensor
    calls: list[attention.SdpaCall]
    output: Any

    @property
    def top1(self) -> np.ndarray[Any, np.dtype[np.float32]]:
        return np.asarray(self.logits.max(dim=-1).values.numpy(), dtype=np.float32)


def backends_of(calls: Sequence[attention.SdpaCall]) -> str | None:
    """What a trace records of these calls (`Observed.backends`: by phase)."""
    observed = attention.Observed()
    for call in calls:
        observed.by_phase.setdefault(call.phase, set()).add(call.backend)
    return observed.backends()


def until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def rendered(tokenizer: Any) -> list[Any]:
    """Each chat as a user renders it: the chat template with the generation prompt, as
    tensors (input ids and attention mask)."""
    return [
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        for messages in MESSAGES
    ]


@pytest.fixture(scope="module")
def plain_model(smollm2_dir: Path) -> Callable[[str], Any]:
    """A user's model: `from_pretrained` in a dtype, nothing else set (one per dtype)."""
    from transformers import AutoModelForCausalLM

    made: dict[str, Any] = {}

    def get(dtype: str) -> Any:
        if dtype not in made:
            made[dtype] = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=DTYPES[dtype])
        return made[dtype]

    return get


@pytest.fixture(scope="module")
def eos_id(plain_model: Callable[[str], Any]) -> int:
    eos = plain_model("bf16").generation_config.eos_token_id
    assert isinstance(eos, int), eos  # SmolLM2's one eos, <|im_end|>
    return eos


@pytest.fixture(scope="module")
def plain_runs(
    plain_model: Callable[[str], Any], rendered: list[Any], eos_id: int
) -> Callable[[str], list[PlainRun]]:
    """Plain `generate()` of every prompt in a dtype (each run once for the module)."""
    made: dict[str, list[PlainRun]] = {}

    def get(dtype: str) -> list[PlainRun]:
        if dtype not in made:
            model, runs = plain_model(dtype), []
            for inputs in rendered:
                width = inputs["input_ids"].shape[1]
                with attention.observe(keep_calls=True) as seen:
                    out = model.generate(
                        **inputs,
                        do_sample=False,
                        max_new_tokens=N,
                        output_logits=True,
                        return_dict_in_generate=True,
                    )
                tokens = until_eos(out.sequences[0, width:].tolist(), eos_id)
                logits = torch.stack([z[0] for z in out.logits]).float()[: len(tokens)]
                prompt = inputs["input_ids"][0].tolist()
                runs.append(PlainRun(prompt, tokens, logits, list(seen.calls), out))
            made[dtype] = runs
        return made[dtype]

    return get


@pytest.fixture(scope="module")
def engine_of(smollm2_dir: Path) -> Callable[[str], TorchEngine]:
    """The engine over the checkpoint in a dtype, SDPA attention (one per dtype)."""
    made: dict[str, TorchEngine] = {}

    def get(dtype: str) -> TorchEngine:
        if dtype not in made:
            target = Target(dtype, attn_kernel="sdpa")
            made[dtype] = TorchEngine.load(smollm2_dir, target, device="cpu")
        return made[dtype]

    return get


@dataclass(frozen=True)
class EngineRuns:
    """The engine's decodes of every prompt in a dtype: the first prompt's first decode (the
    one that builds and checks the piecewise decoder), then every prompt's after the check
    with the SDPA calls it made (`SdpaCalls`)."""

    first: Any
    decoded: list[Any]
    calls: list[list[attention.SdpaCall]]


@pytest.fixture(scope="module")
def engine_runs(
    engine_of: Callable[[str], TorchEngine],
    plain_runs: Callable[[str], list[PlainRun]],
    eos_id: int,
) -> Callable[[str], EngineRuns]:
    """`EngineRuns` of a dtype, decoded once for the module."""
    made: dict[str, EngineRuns] = {}

    def get(dtype: str) -> EngineRuns:
        if dtype not in made:
            engine, runs = engine_of(dtype), plain_runs(dtype)
            assert engine._piecewise is None and engine._piecewise_error is None
            first = engine.decode(runs[0].prompt_ids, N, [eos_id])
            assert engine._piecewise is not None, engine.environment()["extras"]
            decoded, calls = [], []
            for run in runs:
                with SdpaCalls() as mine:
                    decoded.append(engine.decode(run.prompt_ids, N, [eos_id]))
                calls.append(mine.calls)
            made[dtype] = EngineRuns(first, decoded, calls)
        return made[dtype]

    return get


def test_the_checkpoint_is_smollm2_with_its_chat_template(
    smollm2_dir: Path, tokenizer: Any
) -> None:
    import json

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152 and config["dtype"] == "bfloat16"
    text = tokenizer.apply_chat_template(MESSAGES[0], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_engine_decode_is_plain_generate(
    engine_of: Callable[[str], TorchEngine],
    engine_runs: Callable[[str], EngineRuns],
    plain_runs: Callable[[str], list[PlainRun]],
    eos_id: int,
    dtype: str,
) -> None:
    """The engine's decode (generate()'s prefill, then the piecewise steps, checked on the
    first decode) gives plain generate()'s tokens, to and with the first eos, and at every
    step its top-1 logit: the maximum of generate()'s raw logits, exactly; the first decode
    (the check's) and every one after it."""
    engine, mine = engine_of(dtype), engine_runs(dtype)
    pairs = [(mine.first, plain_runs(dtype)[0]), *zip(mine.decoded, plain_runs(dtype), strict=True)]
    for decoded, run in pairs:
        assert decoded.output_token_ids == run.tokens
        assert decoded.steps.top_k_logits.dtype == np.float32
        np.testing.assert_array_equal(decoded.steps.top_k_logits[:, 0], run.top1)
    # Both ends of a decode ran: an answer that stopped at eos, and one that used up N tokens.
    assert plain_runs(dtype)[0].tokens[-1] == eos_id and len(plain_runs(dtype)[0].tokens) < N
    assert any(len(run.tokens) == N for run in plain_runs(dtype))
    extras = engine.environment()["extras"]
    assert extras["decoder"] == "piecewise"
    assert extras["piecewise_check"] == "bitwise"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_engine_decode_calls_sdpa_as_plain_generate(
    engine_of: Callable[[str], TorchEngine],
    engine_runs: Callable[[str], EngineRuns],
    plain_runs: Callable[[str], list[PlainRun]],
    dtype: str,
) -> None:
    """The test that fails if the engine's attention kernels differ from generate()'s: a decode
    after the check (its steps' SDPA called directly with the options it learned) makes the
    very SDPA calls plain generate() makes, in order, prefill and decode steps, each with the
    backend torch picks for it."""
    layers = engine_of(dtype).model.config.num_hidden_layers
    for calls, run in zip(engine_runs(dtype).calls, plain_runs(dtype), strict=True):
        steps = len(run.tokens)
        assert len(calls) == layers * steps  # a prefill, then a forward per later step
        assert [c for c in calls if c.phase == "decode"] == [
            c for c in run.calls if c.phase == "decode"
        ]
        assert calls == run.calls
    backends = {c.backend for run in plain_runs(dtype) for c in run.calls}
    assert backends and all(not b.startswith("none") for b in backends)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_recorder_sees_what_attention_observe_sees(
    plain_model: Callable[[str], Any], plain_runs: Callable[[str], list[PlainRun]], dtype: str
) -> None:
    """The torch-function recorder of these tests and the engine's `attention.observe` record
    generate()'s calls alike (so the comparison above is `observe`'s own)."""
    run = plain_runs(dtype)[1]
    model = plain_model(dtype)
    ids = torch.tensor([run.prompt_ids])
    with SdpaCalls() as recorded, attention.observe(keep_calls=True) as seen:
        model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4
        )
    assert recorded.calls == seen.calls
    assert seen.calls == run.calls[: len(seen.calls)]


def test_attention_observe_around_engine_decode_sees_what_the_engine_observed(
    engine_of: Callable[[str], TorchEngine],
    engine_runs: Callable[[str], EngineRuns],
    plain_runs: Callable[[str], list[PlainRun]],
    eos_id: int,
) -> None:
    """An outer `observe(keep_calls=True)` receives the calls the engine observed: every
    call of the prefill, and one call per decode step (layer 0's: the piecewise decoder sends
    the other layers' same call straight to torch, and its check compares that one with
    generate()'s), each equal to plain generate()'s call at that place."""
    engine_runs("bf16")  # the piecewise decoder built and checked
    engine, run = engine_of("bf16"), plain_runs("bf16")[1]
    layers = engine.model.config.num_hidden_layers
    with attention.observe(keep_calls=True) as seen:
        engine.decode(run.prompt_ids, N, [eos_id])
    prefill = [c for c in seen.calls if c.phase == "prefill"]
    decode = [c for c in seen.calls if c.phase == "decode"]
    assert prefill == run.calls[:layers]
    assert decode == run.calls[layers::layers]
    assert len(decode) == len(run.tokens) - 1


def test_replay_audit_generate_is_plain_generate(
    smollm2_dir: Path, rendered: list[Any], plain_runs: Callable[[str], list[PlainRun]]
) -> None:
    """`replay-audit generate` (`TraceGenerator`) renders each chat with the checkpoint's chat
    template into the ids a user's `apply_chat_template` gives, and logs plain generate()'s
    tokens and top-1 logits for them, with the SDPA backends the call ran."""
    from replay_audit.engine.generate import TraceGenerator

    generator = TraceGenerator(smollm2_dir, dtype="bf16", device="cpu")
    for messages, inputs, run in zip(MESSAGES, rendered, plain_runs("bf16"), strict=True):
        trace = generator.trace(messages, max_new_tokens=N)
        assert trace["prompt_token_ids"] == inputs["input_ids"][0].tolist()
        assert trace["prompt_messages"] == messages
        assert trace["output_token_ids"] == run.tokens
        top1 = [row[0] for row in trace["top_k"]["logits"]]
        assert top1 == [float(x) for x in run.top1]
        backends = trace["config"]["extras"]["attention_backends"]
        assert isinstance(backends, str) and backends == backends_of(run.calls)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_plain_generate_traces_self_replay_exactly_through_the_hf_import(
    smollm2_dir: Path,
    plain_model: Callable[[str], Any],
    plain_runs: Callable[[str], list[PlainRun]],
    tokenizer: Any,
    dtype: str,
    tmp_path: Path,
) -> None:
    """Issue 31 on the CPU, in CI: a user's plain generate() outputs saved with torch.save
    (each chat alone, as `generate()` returns it; then the three chats as one left-padded
    batch, with the call's inputs), imported with `replay-audit import --format hf`, replay in
    their logged configuration exactly through `replay-audit replay` (the batch at its logged
    size and layout), with the reproduction check exact too. Fails where the engine's kernels
    or attention calls differ from generate()'s in a way that moves a token."""
    from typer.testing import CliRunner

    from replay_audit.cli import app

    tokenizer.padding_side = "left"
    enc = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True, padding=True
    )
    out = plain_model(dtype).generate(
        **enc, max_new_tokens=N, do_sample=False, return_dict_in_generate=True, output_logits=True
    )
    # Each chat alone, as generate() returned it (`plain_runs`: the same call); the batch, with
    # the call's inputs.
    saved = {1: [run.output for run in plain_runs(dtype)], len(MESSAGES): [{**out, **enc}]}
    runner = CliRunner()
    for size, outputs in saved.items():
        folder = tmp_path / f"b{size}"
        folder.mkdir()
        for i, output in enumerate(outputs):
            torch.save(output, folder / f"{i}.pt")
        traces, results = tmp_path / f"traces-{size}.jsonl", tmp_path / f"results-{size}.jsonl"
        files = sorted(str(p) for p in folder.glob("*.pt"))
        model_args = ["--model", str(smollm2_dir)]
        r = runner.invoke(
            app,
            ["import", "--format", "hf", *files, *model_args, "--config", f"dtype={dtype}",
             "--config", "decoding.strategy=greedy", "--out", str(traces)],
        )  # fmt: skip
        assert r.exit_code == 0, r.output
        imported = [json.loads(x) for x in traces.read_text().splitlines()]
        assert len(imported) == len(MESSAGES)
        assert {t["config"].get("batch_size") for t in imported} == {size}
        assert all(("batch" in t["decoding"]) == (size > 1) for t in imported)
        r = runner.invoke(
            app,
            ["replay", str(traces), *model_args, "--dtype", dtype, "--batch-size", str(size),
             "--mode", "decode", "--device", "cpu", "--threads", "1", "--out", str(results)],
        )  # fmt: skip
        assert r.exit_code == 0, r.output
        rows = [json.loads(x) for x in results.read_text().splitlines()]
        assert len(rows) == 2 * len(MESSAGES)  # the target (the logged dtype) and the check
        assert all(x["status"] == "ok" and x["exact_match"] for x in rows), [
            (x["trace_id"], x["comparison"], x["first_divergence_step"]) for x in rows
        ]
        assert all(x["arms"]["b"]["resolved"]["batch_size"] == size for x in rows)
        assert f"reproduced in their own logged configuration: {len(MESSAGES)} of" in r.output
