"""OpenAI-compatible responses as vLLM returns them -> traces.

The fixtures (tests/imports/fixtures/vllm_*.json) were written field by field from vLLM's own
source (vllm-project/vllm):
- vllm/entrypoints/openai/chat_completion/protocol.py: ChatCompletionResponse (top-level
  `prompt_token_ids`, `prompt_logprobs`, `prompt_text`, `kv_transfer_params`),
  ChatCompletionResponseChoice (`token_ids`, `stop_reason`, `routed_experts`),
  ChatCompletionLogProbsContent (`token`, `logprob`, `bytes`, `top_logprobs`);
- vllm/entrypoints/openai/completion/protocol.py: CompletionResponseChoice (`token_ids`,
  `prompt_token_ids` per choice), CompletionLogProbs (`text_offset`, `token_logprobs`,
  `tokens`, `top_logprobs` as {token string: logprob});
- vllm/entrypoints/openai/chat_completion/serving.py and completion/serving.py: logprobs are
  `max(logprob, -9999.0)`, tokens are "token_id:{id}" with `return_tokens_as_token_ids`
  (`format_token_id_placeholder`).
They also parse with the `openai` package's typed models (openai/openai-python:
src/openai/types/chat/chat_completion.py, chat_completion_token_logprob.py,
src/openai/types/completion.py, completion_choice.py), which is what users' code holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from replay_audit.exceptions import FieldError
from replay_audit.imports.generation import build_trace
from replay_audit.imports.openai_compat import parse_openai
from replay_audit.imports.schemas import ImportContext
from replay_audit.imports.service import traces_from_item
from tests.imports.conftest import WEIGHTS, load_fixture, make_context

GREEDY = {"temperature": 0, "max_tokens": 16, "logprobs": True, "top_logprobs": 3}


def chat_item(**response_edits: object) -> dict[str, object]:
    response = load_fixture("vllm_chat_token_ids.json")
    response.update(response_edits)
    return {"request": dict(GREEDY), "response": response}


def test_the_fixtures_parse_with_the_openai_typed_models() -> None:
    chat = ChatCompletion.model_validate(load_fixture("vllm_chat_token_ids.json"))
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    assert chat.choices[0].logprobs.content[0].top_logprobs[0].token == "token_id:278"
    # vLLM's extra fields are kept by the typed models (extra="allow").
    assert chat.model_extra is not None and chat.model_extra["prompt_token_ids"] == [
        1,
        450,
        3290,
        373,
        278,
    ]
    assert chat.choices[0].model_extra == {
        "stop_reason": None,
        "token_ids": [278, 6635, 3290, 2],
        "routed_experts": None,
    }
    completion = Completion.model_validate(load_fixture("vllm_completion_token_ids.json"))
    assert completion.choices[1].logprobs is not None
    assert completion.choices[1].logprobs.top_logprobs == [
        {"token_id:29871": -0.25, "token_id:29906": -1.5},
        {"token_id:29955": -0.5, "token_id:29947": -1.25},
        {"token_id:13": -0.0625, "token_id:29889": -2.75},
    ]


def test_chat_response_becomes_one_trace_field_by_field(context: ImportContext) -> None:
    [trace] = traces_from_item("openai", chat_item(), context)
    assert trace.external_id == "chatcmpl-7f3c2a9e4b1d4c8e9a0b1c2d3e4f5a6b"
    assert trace.model.name == "tiny-llama" and trace.model.weights_sha256 == WEIGHTS
    assert trace.prompt_token_ids == [1, 450, 3290, 373, 278]
    assert trace.output_token_ids == [278, 6635, 3290, 2]
    assert trace.output_text == " the cat sat"
    assert trace.decoding.strategy == "greedy" and trace.decoding.max_new_tokens == 16
    assert trace.decoding.stop_reason == "eos"
    assert trace.top_k is not None
    # -9999.0 (a clamped -inf) at step 0 is absent, so every step keeps k = 2; equal values
    # (step 2) are ordered by the smaller id, as argmax breaks ties.
    assert trace.top_k.ids == [[278, 263], [6635, 11203], [338, 3290], [2, 29889]]
    assert trace.top_k.logits == [[-0.3125, -1.8125], [-0.0625, -3.25], [-0.5, -0.5], [-0.01, -5.5]]
    extras = trace.config.extras
    assert extras["logprobs_mode"] == "raw_logprobs" and extras["top_k_values"] == "raw_logprobs"
    assert extras["import_format"] == "openai"


def test_raw_logprob_margins_are_logit_margins() -> None:
    # log_softmax(z) = z - logsumexp(z): the normaliser cancels in top-1 minus top-2.
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 50)).astype(np.float32) * 4
    logprobs = logits - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    content = []
    for t in range(4):
        order = np.argsort(-logits[t], kind="stable")[:3]
        content.append(
            {
                "token": f"token_id:{order[0]}",
                "logprob": float(logprobs[t, order[0]]),
                "top_logprobs": [
                    {"token": f"token_id:{i}", "logprob": float(logprobs[t, i])} for i in order
                ],
            }
        )
    response = load_fixture("vllm_chat_token_ids.json")
    response["choices"][0]["logprobs"] = {"content": content}
    response["choices"][0]["token_ids"] = [int(np.argmax(logits[t])) for t in range(4)]
    [trace] = traces_from_item("openai", {"request": GREEDY, "response": response}, make_context())
    assert trace.top_k is not None
    stored = np.asarray(trace.top_k.logits, dtype=np.float32)
    top2 = -np.sort(-logits, axis=1)[:, :2]
    np.testing.assert_allclose(
        stored[:, 0] - stored[:, 1],
        top2[:, 0] - top2[:, 1],
        rtol=0,
        atol=4 * np.finfo(np.float32).eps * 16,
    )


def test_completions_response_gives_one_trace_per_choice(context: ImportContext) -> None:
    item = {
        "request": {
            "prompt": [1, 1724, 338, 29871, 29953, 29930],
            "temperature": 0.8,
            "n": 2,
            "logprobs": 2,
            "return_tokens_as_token_ids": True,
            "max_tokens": 3,
        },
        "response": load_fixture("vllm_completion_token_ids.json"),
    }
    first, second = traces_from_item("openai", item, context)
    assert first.external_id == "cmpl-0d1e2f3a4b5c4d6e8f9a0b1c2d3e4f5a#0"
    assert second.external_id == "cmpl-0d1e2f3a4b5c4d6e8f9a0b1c2d3e4f5a#1"
    assert first.prompt_token_ids == second.prompt_token_ids == [1, 1724, 338, 29871, 29953, 29930]
    assert first.output_token_ids == [29871, 29946, 29889]
    assert first.decoding.stop_reason == "length" and first.decoding.strategy == "sample"
    # The stop token id vLLM matched (stop_reason 13) ends the replay like an eos.
    assert second.decoding.stop_reason == "eos" and second.decoding.eos_token_ids == [13]
    assert first.top_k is not None and first.top_k.ids[1] == [29946, 29941]


def test_completions_string_keys_collide_so_only_ids_give_a_top_k(
    context: ImportContext,
) -> None:
    response = load_fixture("vllm_completion_token_ids.json")
    choice = response["choices"][0]
    choice["token_ids"] = [29871, 29946, 29889]
    choice["prompt_token_ids"] = [1, 2, 3]
    choice["logprobs"]["tokens"] = [" ", "4", "."]
    choice["logprobs"]["top_logprobs"] = [
        {" ": -0.125, "  ": -2.375},
        {"4": -0.75, "3": -1.0},
        {".": -0.03125, "\n": -3.5},
    ]
    response["choices"] = [choice]
    [trace] = traces_from_item("openai", response, context)
    assert trace.top_k is None
    assert trace.output_token_ids == [29871, 29946, 29889]


def test_completions_echo_drops_the_prompt_logprobs(context: ImportContext) -> None:
    response = load_fixture("vllm_completion_token_ids.json")
    choice = response["choices"][0]
    lp = choice["logprobs"]
    choice["prompt_token_ids"] = [1, 7]
    lp["tokens"] = ["token_id:1", "token_id:7", *lp["tokens"]]
    lp["top_logprobs"] = [None, {"token_id:7": -3.0, "token_id:8": -4.0}, *lp["top_logprobs"]]
    choice["text"] = "<s> hi 42."
    response["choices"] = [choice]
    [trace] = traces_from_item("openai", response, context)
    assert trace.prompt_token_ids == [1, 7]
    assert trace.output_token_ids == [29871, 29946, 29889]
    assert trace.top_k is not None and len(trace.top_k.ids) == 3
    assert trace.output_text is None  # the echoed text holds the prompt too


def test_chat_top_logprobs_without_ids_give_no_logged_margin(context: ImportContext) -> None:
    response = load_fixture("vllm_chat_token_ids.json")
    for entry in response["choices"][0]["logprobs"]["content"]:
        entry["token"] = "x"
        for top in entry["top_logprobs"]:
            top["token"] = "x"
    [trace] = traces_from_item("openai", response, context)
    assert trace.output_token_ids == [278, 6635, 3290, 2]  # from return_token_ids
    assert trace.top_k is None


@pytest.mark.parametrize(
    ("mode", "values", "has_top_k"),
    [
        ("raw_logprobs", "raw_logprobs", True),
        ("raw_logits", "logits", True),
        ("processed_logprobs", "none", False),
        ("processed_logits", "none", False),
    ],
)
def test_the_logprobs_mode_decides_the_margin_source(
    mode: str | None, values: str, has_top_k: bool
) -> None:
    [trace] = traces_from_item("openai", chat_item(), make_context(logprobs_mode=mode))
    assert (trace.top_k is not None) is has_top_k
    assert trace.config.extras["top_k_values"] == values
    assert trace.config.extras["logprobs_mode"] == mode
    assert trace.config.extras["logprobs_mode_source"] == "context"
    assert (trace.config.extras["top_k_source"] == "logged ids") is has_top_k


def test_vllms_default_logprobs_mode_is_taken_for_vllm_sources_only() -> None:
    """vLLM's `--logprobs-mode` defaults to raw_logprobs: a vLLM response (`prompt_logprobs`,
    its choices' `stop_reason`) imported without the mode keeps its top-k, saying whence the
    mode came; a response that shows no engine keeps none, and says why."""
    [trace] = traces_from_item("openai", chat_item(), make_context(logprobs_mode=None))
    assert trace.top_k is not None and trace.config.engine.name == "vllm"
    extras = trace.config.extras
    assert extras["logprobs_mode"] == "raw_logprobs" and extras["top_k_values"] == "raw_logprobs"
    assert extras["logprobs_mode_source"] == "engine_default"
    item = chat_item()
    response: dict[str, Any] = item["response"]  # type: ignore[assignment]
    del response["prompt_logprobs"]  # vLLM's fields gone: an OpenAI-shaped response
    for choice in response["choices"]:
        del choice["stop_reason"]
    [other] = traces_from_item("openai", item, make_context(logprobs_mode=None))
    assert other.top_k is None and other.config.engine.name == "unknown"
    assert other.config.extras["logprobs_mode"] == "unknown"
    assert str(other.config.extras["top_k_source"]).startswith("dropped: the logprobs mode is")


def test_top_k_below_two_gives_no_logged_margin(context: ImportContext) -> None:
    response = load_fixture("vllm_chat_token_ids.json")
    for entry in response["choices"][0]["logprobs"]["content"]:
        entry["top_logprobs"] = entry["top_logprobs"][:1]
    [trace] = traces_from_item("openai", response, context)
    assert trace.top_k is None


def test_unknown_configuration_is_recorded_as_unknown_never_guessed() -> None:
    [trace] = traces_from_item("openai", load_fixture("vllm_chat_token_ids.json"), make_context())
    c = trace.config
    # The response shows vLLM (its choices' `stop_reason`); nothing else is guessed.
    assert c.attn_kernel == "unknown" and c.engine.name == "vllm" and c.device == "other"
    assert c.batch_size is None and c.tp_degree is None
    unknown = set(str(c.extras["unknown"]).split(","))
    assert "engine.name" not in unknown
    assert {
        "attn_kernel",
        "batch_size",
        "tp_degree",
        "device",
        "gpu",
        "engine.version",
        "decoding.strategy",
        "deterministic",
        "tf32",
    } <= unknown
    # Without the request, the strategy is unknown: stored, but not replayable as greedy.
    assert trace.decoding.strategy == "other"
    given = make_context(
        device="cuda",
        gpu={"name": "NVIDIA H100", "sm": "9.0"},
        attn_kernel="flash_attention_2",
        batch_size=8,
        engine={"name": "vllm", "version": "0.11.0"},
        decoding={"strategy": "greedy"},
    )
    [trace] = traces_from_item("openai", load_fixture("vllm_chat_token_ids.json"), given)
    unknown = set(str(trace.config.extras["unknown"]).split(","))
    assert not unknown & {
        "attn_kernel",
        "batch_size",
        "device",
        "gpu",
        "engine.name",
        "engine.version",
        "decoding.strategy",
    }
    assert trace.config.gpu is not None and trace.config.gpu.sm == "9.0"
    assert trace.decoding.strategy == "greedy"


def test_a_greedy_trace_whose_token_is_not_the_top_1_is_refused(
    context: ImportContext,
) -> None:
    item = chat_item()
    step = item["response"]["choices"][0]["logprobs"]["content"][1]  # type: ignore[index]
    step["top_logprobs"][1]["logprob"] = -0.01  # 11203 now above the logged 6635
    with pytest.raises(FieldError) as err:
        traces_from_item("openai", item, context)
    assert err.value.field == "item.response.choices[0].logprobs.content[1]"
    assert "not a greedy decode" in err.value.message


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda r: r.pop("prompt_token_ids"), "item.prompt_token_ids"),
        (
            lambda r: [
                r["choices"][0].pop("token_ids"),
                r["choices"][0]["logprobs"]["content"][0].update(token="the"),
            ],
            "item.choices[0].token_ids",
        ),
        (
            lambda r: r["choices"][0].update(token_ids=[278, 6635, 3290, 9]),
            "item.choices[0].token_ids",
        ),
        (
            lambda r: r["choices"][0].update(token_ids=[278, -1, 3290, 2]),
            "item.choices[0].token_ids[1]",
        ),
        (
            lambda r: r["choices"][0]["logprobs"]["content"][2]["top_logprobs"][0].update(
                logprob="x"
            ),
            "item.choices[0].logprobs.content[2].top_logprobs[0]",
        ),
        (lambda r: r.update(choices=[]), "item.choices"),
        (lambda r: r.update(choices={"0": 1}), "item.choices"),
    ],
)
def test_bad_responses_are_refused_naming_the_field(
    context: ImportContext, edit: object, field: str
) -> None:
    response = load_fixture("vllm_chat_token_ids.json")
    edit(response)  # type: ignore[operator]
    with pytest.raises(FieldError) as err:
        traces_from_item("openai", response, context)
    assert err.value.field == field, err.value.message


def test_a_token_outside_the_vocabulary_is_refused_naming_the_field() -> None:
    small = make_context(model={"name": "m", "weights_sha256": WEIGHTS, "vocab_size": 1000})
    with pytest.raises(FieldError) as err:
        traces_from_item("openai", load_fixture("vllm_chat_token_ids.json"), small)
    assert err.value.field == "prompt_token_ids"


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"model": {"weights_sha256": WEIGHTS, "vocab_size": 32000}, "dtype": None}, "dtype"),
        ({"dtype": "bf16", "model": {"vocab_size": 32000}}, "model.weights_sha256"),
        ({"dtype": "bf16", "model": {"weights_sha256": WEIGHTS}}, "model.vocab_size"),
    ],
)
def test_what_no_response_carries_must_be_given(values: dict[str, object], field: str) -> None:
    gen = parse_openai(load_fixture("vllm_chat_token_ids.json"))[0]
    with pytest.raises(FieldError) as err:
        build_trace(gen, ImportContext.model_validate(values), "openai")
    assert err.value.field == field


def test_chat_token_bytes_become_the_traces_pieces(context: ImportContext) -> None:
    """`logprobs.content[].bytes` are each token's bytes (vLLM writes them with "token_id:"
    tokens too): they become the pieces, bytes that are not text alone kept as bytes."""
    response = load_fixture("vllm_chat_token_ids.json")
    content = response["choices"][0]["logprobs"]["content"]
    content[1]["bytes"] = [226, 130]  # the first two bytes of "€": not text alone
    [trace] = traces_from_item("openai", response, context)
    assert trace.output_token_pieces is not None
    assert len(trace.output_token_pieces) == len(trace.output_token_ids)
    assert trace.output_token_pieces[0] == " the"
    assert trace.output_token_pieces[1] == [226, 130]
    assert trace.output_token_pieces[3] == ""  # eos: no bytes


def test_chat_token_strings_are_pieces_and_placeholders_are_not(
    context: ImportContext,
) -> None:
    response = load_fixture("vllm_chat_token_ids.json")
    content = response["choices"][0]["logprobs"]["content"]
    for entry, text in zip(content, [" the", " cat", " sat", "bytes:\\xe2\\x82"], strict=True):
        entry["token"] = text
        del entry["bytes"]
    [trace] = traces_from_item("openai", response, context)
    # OpenAI's legacy spelling of a partial character is read as its bytes.
    assert trace.output_token_pieces == [" the", " cat", " sat", [226, 130]]

    response = load_fixture("vllm_chat_token_ids.json")
    for entry in response["choices"][0]["logprobs"]["content"]:
        entry["bytes"] = list(entry["token"].encode())  # bytes of the placeholder itself
    [trace] = traces_from_item("openai", response, context)
    assert trace.output_token_pieces is None  # a placeholder is no text: ids are shown

    response = load_fixture("vllm_chat_token_ids.json")
    del response["choices"][0]["logprobs"]["content"][2]["bytes"]  # one token without text
    [trace] = traces_from_item("openai", response, context)
    assert trace.output_token_pieces is None  # a partial record is not stored


def test_completion_token_strings_become_pieces(context: ImportContext) -> None:
    response = load_fixture("vllm_completion_token_ids.json")
    choice = response["choices"][1]
    choice["token_ids"] = [29871, 29955, 13]
    choice["prompt_token_ids"] = [1, 7]
    choice["logprobs"]["tokens"] = [" ", "7", "\n"]
    response["choices"] = [choice]
    [trace] = traces_from_item("openai", response, context)
    assert trace.output_token_pieces == [" ", "7", "\n"]
