"""`imports.sniff`: each engine's own layout (the fixtures, written from each engine's source) is
recognised by a field only that engine writes."""

from __future__ import annotations

import json

import pytest

from replay_audit.imports.sniff import format_hint, sniff_format
from tests.imports.conftest import FIXTURES, load_fixture


@pytest.mark.parametrize(
    ("fixture", "fmt"),
    [
        ("vllm_chat_default.json", "openai"),
        ("vllm_completion_token_ids.json", "openai"),
        ("openai_chat_logprobs.json", "openai"),
        ("sglang_generate.json", "sglang"),
        ("sglang_generate_default.json", "sglang"),  # {"request", "response": [...]}
    ],
)
def test_each_engines_layout_is_recognised(fixture: str, fmt: str) -> None:
    assert sniff_format(load_fixture(fixture)) == fmt


def test_vllm_offline_output_lm_eval_samples_and_generate_outputs() -> None:
    line = (FIXTURES / "vllm_offline_request_output.jsonl").read_text().splitlines()[0]
    assert sniff_format(json.loads(line)) == "openai"
    sample = (FIXTURES / "samples_gsm8k_2026-01-05T00-00-00.000000.jsonl").read_text()
    assert sniff_format(json.loads(sample.splitlines()[0])) == "lm-eval"
    assert sniff_format({"sequences": [[1, 2]], "logits": []}) == "hf"
    for unknown in ({"id": "x"}, [], "text", None, {"response": 3}):
        assert sniff_format(unknown) is None


def test_the_hint_names_another_format_only() -> None:
    answer = load_fixture("sglang_generate.json")
    assert format_hint(answer, "sglang") == ""
    assert format_hint({"id": "x"}, "openai") == ""
    assert format_hint(answer, "openai", "format=") == (
        " (this looks like an SGLang /generate answer: use format=sglang)"
    )
