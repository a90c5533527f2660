"""transformers `generate(..., return_dict_in_generate=True, output_logits=True)` -> traces, on
the bundled model with transformers' real `generate()`.

Names as in transformers' GenerateDecoderOnlyOutput (huggingface/transformers:
src/transformers/generation/utils.py): `sequences` (prompt + new tokens), `logits` (raw, one
(batch, vocab) per step), `scores` (after the logits processors). The reference is this
project's own producer, `replay-audit generate` (replay_audit/engine/generate.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.engine.generate import TraceGenerator
from replay_audit.exceptions import FieldError
from replay_audit.imports.hf import parse_hf, traces_from_generate
from replay_audit.imports.hf_context import context_from_model
from replay_audit.imports.schemas import ImportContext
from replay_audit.imports.service import traces_from_item

pytestmark = pytest.mark.slow  # real transformers generate() on 2 shared cores

PROMPTS = ["The cat sat on the", "Once upon a time"]


@pytest.fixture(scope="module")
def generator() -> Iterator[TraceGenerator]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield TraceGenerator(BUNDLED_MODEL_DIR, dtype="fp32", attn_kernel="eager", device="cpu")
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def context(generator: TraceGenerator) -> ImportContext:
    return context_from_model(
        generator.model,
        BUNDLED_MODEL_DIR,
        decoding={"strategy": "greedy", "eos_token_ids": generator.eos_ids},
    )


def _generate(gen: TraceGenerator, prompts: list[str], max_new: int = 12) -> tuple[Any, Any]:
    tok = gen.tokenizer
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = gen.model.generate(
            **enc,
            max_new_tokens=max_new,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=tok.pad_token_id,
            eos_token_id=gen.eos_ids,
        )
    return out, enc


def test_one_prompt_gives_exactly_the_trace_of_replay_audit_generate(
    generator: TraceGenerator, context: ImportContext
) -> None:
    out, enc = _generate(generator, PROMPTS[:1])
    [trace] = traces_from_generate(
        out,
        context=context,
        input_ids=enc["input_ids"],
        attention_mask=enc["attention_mask"],
        max_new_tokens=12,
    )
    reference = generator.trace(PROMPTS[0], max_new_tokens=12, top_k=5)
    assert trace.prompt_token_ids == reference["prompt_token_ids"]
    assert trace.output_token_ids == reference["output_token_ids"]
    assert trace.top_k is not None
    # Raw logits, exactly converted to float32, ordered by the same tie rule.
    assert [r[:5] for r in trace.top_k.ids] == reference["top_k"]["ids"]
    assert [r[:5] for r in trace.top_k.logits] == reference["top_k"]["logits"]
    assert trace.decoding.stop_reason == reference["decoding"]["stop_reason"]
    c = trace.config
    assert (c.dtype, c.device, c.attn_kernel, c.engine.name) == (
        "fp32",
        "cpu",
        "eager",
        "transformers",
    )
    assert c.extras["top_k_values"] == "logits" and c.extras["logprobs_mode"] == "raw_logits"
    assert trace.model.weights_sha256 == generator.weights_sha256


def test_a_left_padded_batch_gives_one_trace_per_row(
    generator: TraceGenerator, context: ImportContext
) -> None:
    out, enc = _generate(generator, PROMPTS)
    traces = traces_from_generate(
        out,
        context=context,
        input_ids=enc["input_ids"],
        attention_mask=enc["attention_mask"],
        tokenizer=generator.tokenizer,
        prompt_texts=PROMPTS,
    )
    assert len(traces) == 2
    for trace, text in zip(traces, PROMPTS, strict=True):
        assert trace.prompt_token_ids == generator.encode(text)  # the padding is dropped
        assert trace.prompt_text == text and trace.output_text is not None
        assert trace.config.batch_size == 2  # the batch it ran in
        if generator.eos_ids[0] in trace.output_token_ids:  # a row ends at its first eos
            assert trace.output_token_ids[-1] == generator.eos_ids[0]


def test_scores_alone_are_processed_values_and_give_no_margin(
    generator: TraceGenerator, context: ImportContext
) -> None:
    out, enc = _generate(generator, PROMPTS[:1])
    saved = {"sequences": out.sequences, "scores": out.logits, "input_ids": enc["input_ids"]}
    [trace] = traces_from_generate(saved, context=context)
    assert trace.top_k is None and trace.config.extras["logprobs_mode"] == "processed_logits"


def test_a_saved_output_imports_as_the_live_one(
    generator: TraceGenerator, context: ImportContext, tmp_path: Path
) -> None:
    out, enc = _generate(generator, PROMPTS[:1])
    [live] = traces_from_generate(out, context=context, input_ids=enc["input_ids"])
    saved = {
        "sequences": out.sequences.tolist(),
        "logits": [step.float().tolist() for step in out.logits],
        "prompt_length": int(enc["input_ids"].shape[1]),
        "eos_token_ids": generator.eos_ids,
    }
    path = tmp_path / "out.json"
    path.write_text(json.dumps(saved))
    [from_file] = traces_from_item("hf", json.loads(path.read_text()), context)
    assert from_file.output_token_ids == live.output_token_ids
    assert from_file.top_k == live.top_k
    assert parse_hf(saved)[0].logprobs_mode == "raw_logits"


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda s: s.update(sequences=[[1, 2]]), "item.sequences"),
        (lambda s: s.update(logits=s["logits"][:-1]), "item.logits"),
        (lambda s: [s.pop("prompt_length"), s.pop("logits")], "item.input_ids"),
        (lambda s: s.update(sequences="x"), "item.sequences"),
    ],
)
def test_a_bad_saved_output_is_refused_naming_the_field(
    context: ImportContext, edit: Any, field: str
) -> None:
    rng = np.random.default_rng(0)
    saved: dict[str, Any] = {
        "sequences": [[5, 6, 7, 8, 9]],
        "logits": rng.normal(size=(2, 1, 4096)).tolist(),
        "prompt_length": 3,
    }
    edit(saved)
    with pytest.raises(FieldError) as err:
        traces_from_item("hf", saved, context)
    assert err.value.field == field, err.value.message
