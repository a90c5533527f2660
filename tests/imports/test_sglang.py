"""SGLang's native `/generate` answers with `return_logprob` -> traces.

The fixture (tests/imports/fixtures/sglang_generate.json) was written field by field from
SGLang's own source (sgl-project/sglang):
- python/sglang/srt/managers/tokenizer_manager.py (`_handle_batch_output`,
  `add_logprob_to_meta_info`, `detokenize_logprob_tokens`): the answer `{"text", "output_ids",
  "meta_info"}`; `meta_info` `id`, `finish_reason`, `prompt_tokens`, `completion_tokens`,
  `cached_tokens`, `input_token_logprobs`, `output_token_logprobs`,
  `output_token_logprobs_length`, `input_top_logprobs`, `output_top_logprobs`, each entry a
  `(logprob, token_id, text or None)` tuple (JSON: a list);
- python/sglang/srt/managers/schedule_batch.py: FINISH_MATCHED_TOKEN / FINISH_LENGTH
  `to_json()` -> `{"type": "stop", "matched": id}` / `{"type": "length", "length": n}`;
- python/sglang/srt/managers/io_struct.py (GenerateReqInput): the request fields `text`,
  `input_ids`, `sampling_params`, `return_logprob`, `logprob_start_len`, `top_logprobs_num`.
"""

from __future__ import annotations

from typing import Any

import pytest

from replay_audit.exceptions import FieldError
from replay_audit.imports.schemas import ImportContext
from replay_audit.imports.service import traces_from_item
from tests.imports.conftest import load_fixture, make_context

REQUEST = {
    "text": "The cat sat on the",
    "sampling_params": {"temperature": 0, "max_new_tokens": 32},
    "return_logprob": True,
    "logprob_start_len": 0,
    "top_logprobs_num": 2,
}


def test_generate_answer_becomes_a_trace_field_by_field(context: ImportContext) -> None:
    item = {"request": REQUEST, "response": load_fixture("sglang_generate.json")}
    [trace] = traces_from_item("sglang", item, context)
    assert trace.external_id == "4b6f2d1c8e9a4f0b9c1d2e3f4a5b6c7d"
    # logprob_start_len 0: input_token_logprobs cover the whole prompt and give its ids.
    assert trace.prompt_token_ids == [1, 450, 3290, 373, 278]
    assert trace.output_token_ids == [278, 6635, 3290, 2]
    assert trace.prompt_text == "The cat sat on the" and trace.output_text == " the cat sat"
    assert trace.decoding.strategy == "greedy" and trace.decoding.max_new_tokens == 32
    assert trace.decoding.stop_reason == "eos" and trace.decoding.eos_token_ids == [2]
    assert trace.config.engine.name == "sglang"  # the native API is SGLang's
    assert trace.top_k is not None
    assert trace.top_k.ids == [[278, 263], [6635, 11203], [338, 3290], [2, 29889]]
    assert trace.top_k.logits[1] == [-0.0625, -3.25]


def test_prompt_ids_come_from_prompt_token_ids_or_the_request(context: ImportContext) -> None:
    answer = load_fixture("sglang_generate.json")
    answer["meta_info"]["input_token_logprobs"] = answer["meta_info"]["input_token_logprobs"][-1:]
    with pytest.raises(FieldError) as err:
        traces_from_item("sglang", answer, context)  # logprob_start_len -1: only the last
    assert err.value.field == "item.prompt_token_ids"
    [trace] = traces_from_item(
        "sglang", {"request": {"input_ids": [1, 2, 3]}, "response": answer}, context
    )
    assert trace.prompt_token_ids == [1, 2, 3]
    answer["prompt_token_ids"] = [4, 5]
    [trace] = traces_from_item("sglang", answer, context)
    assert trace.prompt_token_ids == [4, 5]


def test_a_batch_answer_gives_one_trace_per_prompt(context: ImportContext) -> None:
    one, two = load_fixture("sglang_generate.json"), load_fixture("sglang_generate.json")
    two["meta_info"]["id"] = "other"
    two["meta_info"]["finish_reason"] = {"type": "length", "length": 4}
    request: dict[str, Any] = {
        "text": ["a", "b"],
        "sampling_params": [{"temperature": 0, "max_new_tokens": 4}, {"temperature": 0.7}],
    }
    first, second = traces_from_item(
        "sglang", {"request": request, "response": [one, two]}, context
    )
    assert first.prompt_text == "a" and first.decoding.strategy == "greedy"
    assert second.prompt_text == "b" and second.decoding.strategy == "sample"
    assert second.decoding.stop_reason == "length"


def test_a_stop_string_and_an_abort() -> None:
    answer = load_fixture("sglang_generate.json")
    answer["meta_info"]["finish_reason"] = {"type": "stop", "matched": "\n\n"}
    [trace] = traces_from_item("sglang", answer, make_context())
    assert trace.decoding.stop_reason == "stop_string" and trace.decoding.eos_token_ids == []
    answer["meta_info"]["finish_reason"] = {"type": "abort", "message": "client gone"}
    [trace] = traces_from_item("sglang", answer, make_context())
    assert trace.decoding.stop_reason == "other"


def test_processed_or_unknown_logprobs_give_no_margin() -> None:
    answer = load_fixture("sglang_generate.json")
    [trace] = traces_from_item("sglang", answer, make_context(logprobs_mode=None))
    assert trace.top_k is None and trace.config.extras["logprobs_mode"] == "unknown"


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda a: a.update(output_ids=[278, 6635]), "item.output_ids"),
        (lambda a: a.pop("meta_info"), "item.meta_info"),
        (
            lambda a: a["meta_info"]["output_top_logprobs"][2].__setitem__(0, [-0.5]),
            "item.meta_info.output_top_logprobs[2][0]",
        ),
        (
            lambda a: a["meta_info"]["output_token_logprobs"][0].__setitem__(1, "x"),
            "item.meta_info.output_token_logprobs[0][1]",
        ),
        (
            lambda a: [a.pop("output_ids"), a["meta_info"].pop("output_token_logprobs")],
            "item.output_ids",
        ),
    ],
)
def test_bad_answers_are_refused_naming_the_field(
    context: ImportContext, edit: Any, field: str
) -> None:
    answer = load_fixture("sglang_generate.json")
    edit(answer)
    with pytest.raises(FieldError) as err:
        traces_from_item("sglang", answer, context)
    assert err.value.field == field, err.value.message


def test_token_texts_in_the_logprobs_become_the_traces_pieces(context: ImportContext) -> None:
    """With `return_text_in_logprobs` each (logprob, id, text) tuple carries the token's text:
    the pieces. Without it (text null) the trace has none."""
    answer = load_fixture("sglang_generate.json")
    [trace] = traces_from_item("sglang", {"request": REQUEST, "response": answer}, context)
    assert trace.output_token_pieces is None
    texts = [" the", " cat", " sat", "\x00"]
    for entry, text in zip(answer["meta_info"]["output_token_logprobs"], texts, strict=True):
        entry[2] = text
    [trace] = traces_from_item("sglang", {"request": REQUEST, "response": answer}, context)
    # A NUL (no database stores it in text) is kept as its byte.
    assert trace.output_token_pieces == [" the", " cat", " sat", [0]]
