"""Logs as each engine writes them by default (tests/imports/fixtures/README.md: the fixtures and
the engine source files whose layouts they follow), imported with the checkpoint's tokenizer:
ids read from pieces or re-tokenised text and marked, text-keyed top-k mapped or dropped with
the reason, the whole decoding recipe read, unknowns left unknown."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion

from replay_audit.engine.loading import load_tokenizer
from replay_audit.exceptions import FieldError
from replay_audit.imports.openai_compat import decoding_recipe
from replay_audit.imports.service import traces_from_item
from replay_audit.imports.tokenization import Vocabulary
from replay_audit.traces.schemas import TraceCreate
from tests.imports.conftest import FIXTURES, load_fixture, make_context

CONTEXT = make_context(
    dtype="fp32",
    logprobs_mode=None,
    model={"name": "tiny-llama", "weights_sha256": "cd" * 32, "vocab_size": 4096},
    decoding={"eos_token_ids": [1]},
)


@pytest.fixture(scope="module")
def vocabulary(chat_checkpoint: Path) -> Vocabulary:
    return Vocabulary(load_tokenizer(chat_checkpoint))


def one(name: str, vocabulary: Vocabulary | None, fmt: str = "openai") -> TraceCreate:
    [trace] = traces_from_item(fmt, load_fixture(name), CONTEXT, vocabulary=vocabulary)  # type: ignore[arg-type]
    return trace


def test_the_chat_fixtures_are_what_openai_python_reads() -> None:
    for name in (
        "vllm_chat_default.json",
        "vllm_chat_text_top_k.json",
        "openai_chat_logprobs.json",
    ):
        chat = ChatCompletion.model_validate(load_fixture(name)["response"])
        content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content and content[0].top_logprobs and content[0].bytes is not None


def test_vllm_chat_without_token_ids_reads_them_from_pieces_and_the_chat_template(
    vocabulary: Vocabulary,
) -> None:
    """The same generation logged with and without `return_token_ids`: the ids read from the
    logged pieces and from the prompt rendered by the chat template are the logged ones, and
    the text-keyed top-k maps to the same ids."""
    default = one("vllm_chat_default.json", vocabulary)
    with_ids = one("vllm_chat_text_top_k.json", vocabulary)
    logged = load_fixture("vllm_chat_text_top_k.json")["response"]
    assert default.output_token_ids == logged["choices"][0]["token_ids"]
    assert default.prompt_token_ids == logged["prompt_token_ids"]
    assert with_ids.output_token_ids == default.output_token_ids
    assert default.top_k is not None and default.top_k == with_ids.top_k
    assert default.prompt_text == "<s><|user|>\ndef _convert_num(node):\n</s>\n<|assistant|>\n"
    assert default.prompt_messages is not None
    assert default.prompt_messages[0].content == "def _convert_num(node):\n"
    extras = default.config.extras
    assert extras["token_ids_source"] == "retokenized"  # the prompt's; the output's: pieces
    assert with_ids.config.extras["token_ids_source"] == "logged"
    assert extras["top_k_source"] == "text keys mapped to ids with the checkpoint's tokenizer"
    assert extras["logprobs_mode"] == "raw_logprobs"
    assert extras["logprobs_mode_source"] == "engine_default"
    assert default.config.engine.name == "vllm" and default.decoding.strategy == "greedy"


def test_without_a_tokenizer_nothing_is_dropped_in_silence() -> None:
    """The API has no tokenizer: ids the log lacks fail the item naming the field and how to
    get them; a text-keyed top-k is dropped, the reason stored in the trace."""
    with pytest.raises(FieldError) as err:
        one("vllm_chat_default.json", None)
    assert err.value.field == "item.response.prompt_token_ids"
    assert "return_token_ids" in err.value.message and "--model" in err.value.message
    trace = one("vllm_chat_text_top_k.json", None)
    assert trace.top_k is None
    assert str(trace.config.extras["top_k_source"]).startswith(
        "dropped: the top-k is keyed by token text"
    )


def test_the_openai_api_layout_keeps_ids_and_says_why_its_top_k_is_not_kept(
    vocabulary: Vocabulary,
) -> None:
    trace = one("openai_chat_logprobs.json", vocabulary)
    assert trace.output_token_ids == one("vllm_chat_default.json", vocabulary).output_token_ids
    assert trace.config.engine.name == "unknown" and trace.top_k is None
    assert str(trace.config.extras["top_k_source"]).startswith("dropped: the logprobs mode is")
    with_mode = traces_from_item(
        "openai",
        load_fixture("openai_chat_logprobs.json"),
        CONTEXT.model_copy(update={"logprobs_mode": "raw_logprobs"}),
        vocabulary=vocabulary,
    )
    assert with_mode[0].top_k is not None


def test_ids_are_kept_only_where_they_decode_to_the_logged_text(vocabulary: Vocabulary) -> None:
    item = load_fixture("vllm_chat_default.json")
    item["response"]["choices"][0]["message"]["content"] = "\n\n#\n#\n#\n#\n#!\n"
    with pytest.raises(FieldError) as err:
        traces_from_item("openai", item, CONTEXT, vocabulary=vocabulary)
    assert "does not round-trip" in err.value.message and "character 11" in err.value.message
    item = load_fixture("vllm_chat_default.json")
    item["response"]["choices"][0]["logprobs"]["content"][3]["bytes"] = list(b"no such token!")
    with pytest.raises(FieldError) as err:
        traces_from_item("openai", item, CONTEXT, vocabulary=vocabulary)
    assert err.value.field == "item.response.choices[0].logprobs.content[3]"


def test_without_pieces_the_output_text_is_retokenized(vocabulary: Vocabulary) -> None:
    item = load_fixture("vllm_chat_default.json")
    item["response"]["choices"][0]["logprobs"] = None
    [trace] = traces_from_item("openai", item, CONTEXT, vocabulary=vocabulary)
    text = item["response"]["choices"][0]["message"]["content"]
    assert trace.output_token_ids == vocabulary.encode(text, add_special_tokens=False)
    assert trace.config.extras["token_ids_source"] == "retokenized"
    assert trace.output_token_pieces is not None  # the tokenizer's, for the pages


def test_a_text_top_k_is_cut_at_its_first_entry_that_is_not_one_token(
    vocabulary: Vocabulary,
) -> None:
    item = load_fixture("vllm_chat_text_top_k.json")
    for entry in item["response"]["choices"][0]["logprobs"]["content"]:
        entry["top_logprobs"][3]["token"] = "\ufffd"  # what decode([id]) gives half a character
        entry["top_logprobs"][3]["bytes"] = [239, 191, 189]
    [cut] = traces_from_item("openai", item, CONTEXT, vocabulary=vocabulary)
    assert cut.top_k is not None and len(cut.top_k.ids[0]) == 3
    assert "cut at step 0" in str(cut.config.extras["top_k_source"])
    for entry in item["response"]["choices"][0]["logprobs"]["content"]:
        entry["top_logprobs"][1]["token"] = "\ufffd"
        entry["top_logprobs"][1]["bytes"] = [239, 191, 189]
    [dropped] = traces_from_item("openai", item, CONTEXT, vocabulary=vocabulary)
    assert dropped.top_k is None
    assert str(dropped.config.extras["top_k_source"]).startswith("dropped: text keys that map")


@pytest.mark.parametrize(
    ("params", "strategy", "replayed", "not_replayed"),
    [
        ({"temperature": 0}, "greedy", None, {}),
        ({"temperature": 1e-6}, "greedy", None, {}),  # vLLM and SGLang: below 1e-5 is greedy
        ({"temperature": 1e-5}, "sample", None, {}),
        ({"temperature": 0.7, "top_k": 1}, "greedy", None, {}),
        ({"temperature": 0, "repetition_penalty": 1.0, "logit_bias": {}}, "greedy", None, {}),
        # What a replay applies: greedy, with the processors it runs.
        ({"temperature": 0, "repetition_penalty": 1.1}, "greedy", {"repetition_penalty": 1.1}, {}),
        (
            {"temperature": 0, "logit_bias": {"50256": -100}},
            "greedy",
            {"logit_bias": {"50256": -100.0}},
            {},
        ),
        # vLLM clamps a bias to OpenAI's [-100, 100]: the clamped value is what ran.
        ({"temperature": 0, "logit_bias": {"7": 250}}, "greedy", {"logit_bias": {"7": 100.0}}, {}),
        ({"temperature": 0, "min_tokens": 4}, "greedy", {"min_new_tokens": 4}, {}),
        ({"temperature": 0, "bad_words": ["import"]}, "greedy", {"bad_words": ["import"]}, {}),
        (
            {"sampling_params": {"temperature": 0, "min_new_tokens": 2}},
            "greedy",
            {"min_new_tokens": 2},
            {},
        ),
        (
            {"temperature": 0, "no_repeat_ngram_size": 3, "repetition_penalty": 1.3},
            "greedy",
            {"no_repeat_ngram_size": 3, "repetition_penalty": 1.3},
            {},
        ),
        # What a replay does not apply: `other`, and named.
        ({"temperature": 0, "frequency_penalty": 0.5}, "other", None, {"frequency_penalty": "0.5"}),
        ({"temperature": 0, "presence_penalty": -1}, "other", None, {"presence_penalty": "-1"}),
        (
            {"temperature": 0, "repetition_penalty": 1.2, "presence_penalty": 0.5},
            "other",
            {"repetition_penalty": 1.2},
            {"presence_penalty": "0.5"},
        ),
        (
            {"temperature": 0, "response_format": {"type": "json_object"}},
            "other",
            None,
            {"response_format": '{"type":"json_object"}'},
        ),
        ({"temperature": 0, "response_format": {"type": "text"}}, "greedy", None, {}),
        (
            {"temperature": 0, "guided_regex": "[0-9]+"},
            "other",
            None,
            {"guided_regex": '"[0-9]+"'},
        ),
        # A value of a shape no engine takes is not replayed either.
        (
            {"temperature": 0, "logit_bias": {"x": 1}},
            "other",
            None,
            {"logit_bias": '{"x":1}'},
        ),
        ({"max_tokens": 16}, None, None, {}),  # the server's default temperature: unknown
        (
            {"temperature": 0.8, "repetition_penalty": 1.1},
            "sample",
            {"repetition_penalty": 1.1},
            {},
        ),
    ],
)
def test_greedy_is_judged_from_the_whole_recipe(
    params: dict[str, Any],
    strategy: str | None,
    replayed: dict[str, Any] | None,
    not_replayed: dict[str, str],
) -> None:
    got, processors = decoding_recipe(params)
    assert (got, processors.replayed, processors.not_replayed) == (
        strategy,
        replayed,
        not_replayed,
    )


def test_a_penalised_request_is_never_stored_as_plain_greedy(vocabulary: Vocabulary) -> None:
    """A processor a replay applies is recorded on the trace (greedy, with its processors); one
    it does not makes the trace `other`, naming it."""
    item = load_fixture("vllm_chat_text_top_k.json")
    item["request"]["repetition_penalty"] = 1.2
    [trace] = traces_from_item("openai", item, CONTEXT, vocabulary=vocabulary)
    assert trace.decoding.strategy == "greedy"
    assert trace.decoding.logits_processors is not None
    assert trace.decoding.logits_processors.repetition_penalty == 1.2
    assert "logits_processors" not in trace.config.extras
    item["request"]["frequency_penalty"] = 0.3
    [trace] = traces_from_item("openai", item, CONTEXT, vocabulary=vocabulary)
    assert trace.decoding.strategy == "other"
    assert trace.config.extras["logits_processors"] == "frequency_penalty=0.3"


def test_a_servers_default_processors_come_from_the_context(vocabulary: Vocabulary) -> None:
    """vLLM takes a repetition penalty from the model's generation_config.json when a request
    sets none: the context states it for every trace, and a request's own value wins. The CLI
    reads it from dotted `--config` flags."""
    from replay_audit.cli.imports import build_context

    flags = ["decoding.logits_processors.repetition_penalty=1.05", "dtype=fp32"]
    context = build_context(None, None, flags)
    assert context.decoding.logits_processors.repetition_penalty == 1.05
    context = make_context(
        dtype="fp32",
        logprobs_mode=None,
        model={"name": "tiny-llama", "weights_sha256": "cd" * 32, "vocab_size": 4096},
        decoding={
            "eos_token_ids": [1],
            "logits_processors": {"repetition_penalty": 1.05, "no_repeat_ngram_size": 4},
        },
    )
    item = load_fixture("vllm_chat_text_top_k.json")
    [trace] = traces_from_item("openai", item, context, vocabulary=vocabulary)
    assert trace.decoding.strategy == "greedy"
    assert trace.decoding.logits_processors is not None
    assert trace.decoding.logits_processors.stored() == {
        "repetition_penalty": 1.05,
        "no_repeat_ngram_size": 4,
    }
    item["request"]["repetition_penalty"] = 1.2
    [trace] = traces_from_item("openai", item, context, vocabulary=vocabulary)
    assert trace.decoding.logits_processors is not None
    assert trace.decoding.logits_processors.repetition_penalty == 1.2


def test_sglang_generate_with_default_arguments(vocabulary: Vocabulary) -> None:
    """A batch of three prompts, `logprob_start_len` left at -1 (no prompt ids): each prompt
    re-tokenised from the request's text. The server batches dynamically: the list's length
    is kept as the request's batch, and the batch size that ran stays unknown."""
    item = load_fixture("sglang_generate_default.json")
    traces = traces_from_item("sglang", item, CONTEXT, vocabulary=vocabulary)
    assert [t.config.batch_size for t in traces] == [None, None, None]
    assert [t.config.extras["request_batch"] for t in traces] == [3, 3, 3]
    for trace, answer in zip(traces, item["response"], strict=True):
        meta = answer["meta_info"]
        assert len(trace.prompt_token_ids) == meta["prompt_tokens"]
        assert trace.prompt_token_ids[-1] == meta["input_token_logprobs"][-1][1]
        assert trace.output_token_ids == answer["output_ids"]
        assert trace.config.engine.name == "sglang" and trace.decoding.strategy == "greedy"
        assert trace.config.extras["token_ids_source"] == "retokenized"
        assert "batch_size" in str(trace.config.extras["unknown"]).split(",")
    given = CONTEXT.model_copy(update={"logprobs_mode": "raw_logprobs"})
    assert traces_from_item("sglang", item, given, vocabulary=vocabulary)[0].top_k is not None
    # No logprobs asked for at all: the answer's text, output_ids and meta_info only.
    del item["request"]["return_logprob"], item["request"]["top_logprobs_num"]
    for answer in item["response"]:
        meta = answer["meta_info"]
        for key in [k for k in meta if "logprobs" in k]:
            del meta[key]
    bare = traces_from_item("sglang", item, given, vocabulary=vocabulary)
    assert [t.prompt_token_ids for t in bare] == [t.prompt_token_ids for t in traces]
    assert [t.output_token_ids for t in bare] == [t.output_token_ids for t in traces]
    assert all(t.top_k is None and t.config.extras["top_k_source"] == "none logged" for t in bare)


def test_sglang_openai_chat_logs_the_prompt_ids_on_each_choice(vocabulary: Vocabulary) -> None:
    """SGLang's ChatCompletionResponseChoice carries `prompt_token_ids`, `token_ids` and
    `matched_stop` (python/sglang/srt/entrypoints/openai/protocol.py)."""
    item = load_fixture("vllm_chat_text_top_k.json")
    response = item["response"]
    choice = response["choices"][0]
    choice["prompt_token_ids"] = response.pop("prompt_token_ids")
    choice["matched_stop"] = choice.pop("stop_reason")
    for key in ("prompt_logprobs", "kv_transfer_params"):
        del response[key]
    [trace] = traces_from_item("openai", item, CONTEXT)  # no tokenizer needed: ids logged
    assert trace.prompt_token_ids == choice["prompt_token_ids"]
    assert trace.config.engine.name == "sglang"
    assert trace.config.extras["token_ids_source"] == "logged"


def test_vllm_offline_request_outputs(vocabulary: Vocabulary) -> None:
    lines = (FIXTURES / "vllm_offline_request_output.jsonl").read_text().splitlines()
    for n, line in enumerate(lines):
        dumped = json.loads(line)
        [trace] = traces_from_item("openai", dumped, CONTEXT)
        completion = dumped["outputs"][0]
        assert trace.external_id == dumped["request_id"] == str(n)
        assert trace.output_token_ids == completion["token_ids"]
        assert trace.prompt_token_ids == dumped["prompt_token_ids"]
        assert trace.prompt_text == dumped["prompt"] and trace.output_text == completion["text"]
        assert trace.config.engine.name == "vllm" and trace.top_k is not None
        # The top-1 of each step is the logged token (a greedy generation), by id.
        assert [ids[0] for ids in trace.top_k.ids] == completion["token_ids"]
        assert trace.output_token_pieces is not None
        # A dump of the outputs alone does not say how it decoded.
        assert trace.decoding.strategy == "other"
        request = {"temperature": 0.0, "max_tokens": 12}
        [greedy] = traces_from_item("openai", {"request": request, "response": dumped}, CONTEXT)
        assert greedy.decoding.strategy == "greedy" and greedy.decoding.max_new_tokens == 12


def test_text_keys_that_are_not_this_tokenizers_pieces_are_dropped_not_misread(
    vocabulary: Vocabulary,
) -> None:
    """A logged token whose text maps to another id than the one logged (a server that writes
    pieces otherwise, as an older vLLM strips SentencePiece's leading space) means the text
    keys cannot be trusted to name ids: the top-k is dropped, saying which step disagreed."""
    item = load_fixture("vllm_chat_text_top_k.json")
    content = item["response"]["choices"][0]["logprobs"]["content"]
    content[1]["token"], content[1]["bytes"] = "#", [35]  # logged: "\n", id 201
    logged = item["response"]["choices"][0]["token_ids"]
    assert vocabulary.id_of("#") not in (None, logged[1])
    [trace] = traces_from_item("openai", item, CONTEXT, vocabulary=vocabulary)
    assert trace.top_k is None and trace.output_token_ids == logged
    source = str(trace.config.extras["top_k_source"])
    assert source.startswith("dropped: the text keys are not this tokenizer's pieces: step 1")


# -- the whole recipe (issue 33): every sampling field of the request kept ---------------------


def test_an_openai_chat_requests_sampling_fields_are_kept_in_extras() -> None:
    # OpenAI's chat request fields (openai.types.chat.CompletionCreateParams) as a client sends
    # them to vLLM's OpenAI server, which reads min_p, top_k and stop_token_ids as extensions.
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0,
        "top_p": 0.9,
        "seed": 7,
        "stop": ["\n\n", "END"],
        "top_k": 1,
        "min_p": 0.05,
        "stop_token_ids": [13, 201],
        "n": 1,
    }
    item = {"request": request, "response": load_fixture("vllm_chat_token_ids.json")}
    [trace] = traces_from_item("openai", item, make_context())
    extras = trace.config.extras
    assert (extras["temperature"], extras["top_p"], extras["seed"]) == (0, 0.9, 7)
    assert (extras["top_k"], extras["min_p"], extras["n"]) == (1, 0.05, 1)
    assert json.loads(str(extras["stop"])) == ["\n\n", "END"]
    assert json.loads(str(extras["stop_token_ids"])) == [13, 201]
    # The server stops on the request's stop token ids as on an eos: so does the replay.
    assert {13, 201} <= set(trace.decoding.eos_token_ids)
    bare = traces_from_item("openai", load_fixture("vllm_chat_token_ids.json"), make_context())[0]
    assert not {"temperature", "seed", "stop"} & set(bare.config.extras)  # nothing invented


def test_a_vllm_sampling_params_recipe_is_kept_with_a_request_output() -> None:
    # vllm.SamplingParams' own field names, dumped beside the RequestOutput.
    dumped = json.loads((FIXTURES / "vllm_offline_request_output.jsonl").read_text().split("\n")[0])
    params = {"temperature": 0.0, "max_tokens": 12, "seed": 3, "min_p": 0.0, "top_k": -1}
    params |= {"stop": "###", "stop_token_ids": [2], "ignore_eos": False, "min_tokens": 1}
    [trace] = traces_from_item("openai", {"request": params, "response": dumped}, CONTEXT)
    extras = trace.config.extras
    assert extras["seed"] == 3 and extras["stop"] == "###" and extras["ignore_eos"] is False
    assert (extras["top_k"], extras["min_p"], extras["min_tokens"]) == (-1, 0.0, 1)
    assert 2 in trace.decoding.eos_token_ids and trace.decoding.strategy == "greedy"


def test_an_sglang_sampling_params_recipe_is_kept() -> None:
    # SGLang's /generate `sampling_params` (python/sglang/srt/sampling/sampling_params.py).
    sampling = {"temperature": 0, "max_new_tokens": 32, "top_p": 1.0, "top_k": -1}
    sampling |= {"min_p": 0.0, "stop": ["END"], "stop_token_ids": [29889], "sampling_seed": 11}
    request = {"text": "The cat sat on the", "sampling_params": sampling, "return_logprob": True}
    item = {"request": request, "response": load_fixture("sglang_generate.json")}
    [trace] = traces_from_item("sglang", item, make_context())
    extras = trace.config.extras
    assert extras["sampling_seed"] == 11 and json.loads(str(extras["stop"])) == ["END"]
    assert (extras["temperature"], extras["top_p"], extras["top_k"]) == (0, 1.0, -1)
    assert 29889 in trace.decoding.eos_token_ids and 2 in trace.decoding.eos_token_ids
