"""Every bad input gets a 4xx naming the field, and nothing is stored. Single and batch."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replay_audit.config import MAX_TOP_K, MAX_TRACE_TOKENS
from replay_audit.traces.models import NumericalConfigRow, Trace
from tests.factories import DEFAULT_VOCAB, make_top_k, make_trace
from tests.traces.test_ingest import count_rows

Headers = Callable[..., dict[str, str]]
Mutation = Callable[[dict[str, Any]], Any]


def _set(path: str, value: Any) -> Mutation:
    def mutate(trace: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = trace
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _swap_step(step: int) -> Mutation:
    def mutate(trace: dict[str, Any]) -> None:
        trace["top_k"]["logits"][step].reverse()
        trace["top_k"]["logits"][step][0] -= 1.0  # strictly ascending now

    return mutate


def _drop_last_step(field: str) -> Mutation:
    return lambda trace: trace["top_k"][field].pop()


def _widen_step(step: int) -> Mutation:
    def mutate(trace: dict[str, Any]) -> None:
        trace["top_k"]["ids"][step].append(1)
        trace["top_k"]["logits"][step].append(-100.0)

    return mutate


def _batch(lengths: Callable[[int], list[int]], row: int) -> Mutation:
    """`decoding.batch` with rows of `lengths(this trace's prompt length)`, this one at `row`."""

    def mutate(trace: dict[str, Any]) -> None:
        prompt = len(trace["prompt_token_ids"])
        trace["decoding"]["batch"] = {"prompt_lengths": lengths(prompt), "row": row}

    return mutate


def _too_many_tokens(trace: dict[str, Any]) -> None:
    n = MAX_TRACE_TOKENS - len(trace["prompt_token_ids"]) + 1
    trace["output_token_ids"] = [1] * n
    trace["top_k"] = None


def _wide_k(trace: dict[str, Any]) -> None:
    trace["top_k"] = make_top_k(trace["output_token_ids"], MAX_TOP_K + 1)


# (case, mutation, status, field)
ITEM_CASES: list[tuple[str, Mutation, int, str]] = [
    ("unknown dtype", _set("config.dtype", "bf17"), 422, "config.dtype"),
    ("unknown lm_head dtype", _set("config.lm_head_dtype", "fp4"), 422, "config.lm_head_dtype"),
    ("prompt id >= vocab", _set("prompt_token_ids.3", DEFAULT_VOCAB), 422, "prompt_token_ids"),
    ("output id >= vocab", _set("output_token_ids.0", DEFAULT_VOCAB + 5), 422, "output_token_ids"),
    ("top-k id >= vocab", _set("top_k.ids.4.1", DEFAULT_VOCAB), 422, "top_k.ids[4]"),
    (
        "eos id >= vocab",
        _set("decoding.eos_token_ids", [DEFAULT_VOCAB]),
        422,
        "decoding.eos_token_ids",
    ),
    (
        "logit bias id >= vocab",
        _set("decoding.logits_processors", {"logit_bias": {str(DEFAULT_VOCAB): 1.0}}),
        422,
        "decoding.logits_processors.logit_bias",
    ),
    (
        "bad word id >= vocab",
        _set("decoding.logits_processors", {"bad_words_ids": [[1], [2, DEFAULT_VOCAB]]}),
        422,
        "decoding.logits_processors.bad_words_ids[1]",
    ),
    (
        "batch row outside the batch",
        _batch(lambda n: [n], 1),
        422,
        "decoding.batch.row",
    ),
    (
        "batch row's prompt length is not the trace's",
        _batch(lambda n: [n + 1], 0),
        422,
        "decoding.batch.prompt_lengths",
    ),
    (
        "batch rows other than config.batch_size",
        _batch(lambda n: [n, 3], 0),
        422,
        "decoding.batch.prompt_lengths",
    ),
    (
        "batch row without a prompt",
        _batch(lambda n: [n, 0], 0),
        422,
        "decoding.batch.prompt_lengths[1]",
    ),
    (
        "logit bias key not an id",
        _set("decoding.logits_processors", {"logit_bias": {"x7": 1.0}}),
        422,
        "decoding.logits_processors.logit_bias",
    ),
    (
        "repetition penalty 0",
        _set("decoding.logits_processors", {"repetition_penalty": 0}),
        422,
        "decoding.logits_processors.repetition_penalty",
    ),
    (
        "unknown processor",
        _set("decoding.logits_processors", {"frequency_penalty": 0.5}),
        422,
        "decoding.logits_processors.frequency_penalty",
    ),
    ("negative token id", _set("prompt_token_ids.0", -1), 422, "prompt_token_ids[0]"),
    ("top-k ids shorter than output", _drop_last_step("ids"), 422, "top_k.ids"),
    ("top-k logits shorter than output", _drop_last_step("logits"), 422, "top_k.logits"),
    ("one step wider than k", _widen_step(3), 422, "top_k[3]"),
    ("k above the maximum", _wide_k, 422, "top_k.ids"),
    ("top-k not sorted", _swap_step(2), 422, "top_k.logits[2]"),
    ("infinite logit", _set("top_k.logits.1.0", float("inf")), 422, "top_k.logits[1]"),
    ("logit beyond float32", _set("top_k.logits.5.1", 1e39), 422, "top_k.logits[5]"),
    ("empty output", _set("output_token_ids", []), 422, "output_token_ids"),
    ("empty prompt", _set("prompt_token_ids", []), 422, "prompt_token_ids"),
    ("ids not a list", _set("prompt_token_ids", "1 2 3"), 422, "prompt_token_ids"),
    ("fractional token id", _set("output_token_ids.1", 1.5), 422, "output_token_ids[1]"),
    ("vocab size not a number", _set("model.vocab_size", "many"), 422, "model.vocab_size"),
    ("bad weights hash", _set("model.weights_sha256", "xyz"), 422, "model.weights_sha256"),
    ("unknown field", _set("temperature", 0.7), 422, "temperature"),
    ("gpu on a cpu device", _set("config.device", "cpu"), 422, "config"),
    ("bad tag", _set("tags", ["has space"]), 422, "tags[0]"),
    ("oversized trace", _too_many_tokens, 413, "output_token_ids"),
    # Strict types: no conversion between JSON types, a 422 (3.0 is an integer: see below).
    ("token id true", _set("prompt_token_ids.0", True), 422, "prompt_token_ids[0]"),
    ("token id numeric string", _set("prompt_token_ids.1", "3"), 422, "prompt_token_ids[1]"),
    ("logit numeric string", _set("top_k.logits.0.0", "99.0"), 422, "top_k.logits[0][0]"),
    ("vocab size a string", _set("model.vocab_size", "1000"), 422, "model.vocab_size"),
    ("batch size true", _set("config.batch_size", True), 422, "config.batch_size"),
    ("deterministic a string", _set("config.deterministic", "true"), 422, "config.deterministic"),
    ("extras NaN", _set("config.extras", {"x": float("nan")}), 422, "config.extras.x"),
    ("extras Infinity", _set("config.extras", {"x": float("-inf")}), 422, "config.extras.x"),
    ("extras list", _set("config.extras", {"x": [1]}), 422, "config.extras.x"),
    # Numbers a database or JSON library cannot hold exactly.
    ("extras 2^64", _set("config.extras", {"big": 2**64}), 422, "config.extras.big"),
    ("extras 10^30", _set("config.extras", {"big": 10**30}), 422, "config.extras.big"),
    ("extras -2^63", _set("config.extras", {"big": -(2**63)}), 422, "config.extras.big"),
    ("extras -2^63 - 1", _set("config.extras", {"big": -(2**63) - 1}), 422, "config.extras.big"),
    # Text a database cannot store.
    ("NUL in external_id", _set("external_id", "a\x00"), 422, "external_id"),
    ("NUL in model name", _set("model.name", "a\x00"), 422, "model.name"),
    ("NUL in prompt text", _set("prompt_text", "\x00"), 422, "prompt_text"),
    ("NUL in an extras key", _set("config.extras", {"k\x00": 1}), 422, "config.extras"),
    ("NUL in an extras value", _set("config.extras", {"k": "\x00"}), 422, "config.extras.k"),
    # Token pieces: one per output token, each a string or a list of byte values.
    (
        "fewer pieces than tokens",
        _set("output_token_pieces", ["a"] * 5),
        422,
        "output_token_pieces",
    ),
    ("more pieces than tokens", _set("output_token_pieces", ["a"] * 7), 422, "output_token_pieces"),
    (
        "piece byte above 255",
        _set("output_token_pieces", ["a", [256], "b", "c", "d", "e"]),
        422,
        "output_token_pieces[1]",
    ),
    (
        "piece a number",
        _set("output_token_pieces", ["a", "b", 7, "c", "d", "e"]),
        422,
        "output_token_pieces[2]",
    ),
    (
        "NUL in a piece",
        _set("output_token_pieces", ["a", "b", "c", "\x00", "d", "e"]),
        422,
        "output_token_pieces[3]",
    ),
    (
        "empty byte piece",
        _set("output_token_pieces", ["a", [], "b", "c", "d", "e"]),
        422,
        "output_token_pieces[1]",
    ),
]


def _mutated(mutation: Mutation) -> dict[str, Any]:
    trace = make_trace(n_output=6)
    mutation(trace)
    return trace


def _assert_nothing_stored(db_url: str) -> None:
    assert count_rows(db_url, Trace) == 0
    assert count_rows(db_url, NumericalConfigRow) == 0


@pytest.mark.parametrize(
    ("case", "mutation", "status", "field"), ITEM_CASES, ids=[c[0] for c in ITEM_CASES]
)
def test_single_post_names_the_field(
    client: TestClient,
    headers: Headers,
    db_url: str,
    case: str,
    mutation: Mutation,
    status: int,
    field: str,
) -> None:
    # json.dumps, not httpx's json=: it writes the NaN/Infinity literals some clients send.
    body = json.dumps(_mutated(mutation)).encode()
    answer = client.post("/v1/traces", content=body, headers=headers("submitter"))
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["field"] == field, body
    assert set(body) == {"error", "detail", "field"}
    _assert_nothing_stored(db_url)


@pytest.mark.parametrize(
    ("case", "mutation", "status", "field"), ITEM_CASES, ids=[c[0] for c in ITEM_CASES]
)
def test_batch_item_names_the_field(
    client: TestClient,
    headers: Headers,
    db_url: str,
    case: str,
    mutation: Mutation,
    status: int,
    field: str,
) -> None:
    body = json.dumps({"traces": [_mutated(mutation)]}).encode()
    answer = client.post("/v1/traces:batch", content=body, headers=headers("submitter"))
    assert answer.status_code == 207
    (result,) = answer.json()["results"]
    assert (result["status"], result["error"]["field"]) == (status, field), result
    assert "id" not in result
    _assert_nothing_stored(db_url)


def test_nan_logit_literal_is_422_naming_the_step(
    client: TestClient, headers: Headers, db_url: str
) -> None:
    trace = make_trace(n_output=5)
    trace["top_k"]["logits"][3][0] = float("nan")
    body = json.dumps(trace).encode()  # Python writes the NaN literal
    assert b"NaN" in body
    answer = client.post("/v1/traces", content=body, headers=headers("submitter"))
    assert answer.status_code == 422
    assert answer.json()["field"] == "top_k.logits[3]"
    _assert_nothing_stored(db_url)


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        (b"", 400, "body"),
        (b"{", 400, "body"),
        (b'{"model": ', 400, "body"),
        (b"\xff\xfe", 400, "body"),
        (b"[]", 422, "body"),
        (b"42", 422, "body"),
        (b"{}", 422, "model"),
    ],
)
def test_malformed_body_is_4xx_naming_the_body(
    client: TestClient, headers: Headers, db_url: str, body: bytes, status: int, field: str
) -> None:
    answer = client.post("/v1/traces", content=body, headers=headers("submitter"))
    assert answer.status_code == status, answer.text
    assert answer.json()["field"] == field
    _assert_nothing_stored(db_url)


@pytest.mark.parametrize("path", ["/v1/traces", "/v1/traces:batch", "/v1/replays"])
@pytest.mark.parametrize("depth", [2_000, 50_000])
def test_json_nested_past_any_parsers_limit_is_400(
    client: TestClient, headers: Headers, db_url: str, path: str, depth: int
) -> None:
    """Arrays nested deeper than the JSON parsers follow (orjson and pydantic stop at a
    depth, the stdlib's at Python's recursion limit) are malformed input: a 400 naming the
    body, never a RecursionError's 500."""
    nested = b"[" * depth + b"]" * depth
    body = b'{"traces": [' + nested + b"]}" if path.endswith(":batch") else nested
    answer = client.post(path, content=body, headers=headers("admin"))
    assert answer.status_code in (400, 422), answer.text[:300]
    if answer.status_code == 400:
        assert answer.json()["field"] == "body"
    _assert_nothing_stored(db_url)


def test_body_over_the_byte_limit_is_413_by_content_length(
    make_client: Callable[..., TestClient], headers: Headers, db_url: str
) -> None:
    client = make_client(max_request_bytes=2_000)
    body = json.dumps(make_trace(n_prompt=400)).encode()
    assert len(body) > 2_000
    answer = client.post("/v1/traces", content=body, headers=headers("submitter"))
    assert answer.status_code == 413 and answer.json()["field"] == "body"
    _assert_nothing_stored(db_url)


def test_body_over_the_byte_limit_is_413_when_streamed(
    make_client: Callable[..., TestClient], headers: Headers, db_url: str
) -> None:
    client = make_client(max_request_bytes=2_000)
    body = json.dumps({"traces": [make_trace(n_prompt=400)]}).encode()

    def chunks() -> Any:  # no Content-Length: the limit must hold while reading
        for start in range(0, len(body), 500):
            yield body[start : start + 500]

    answer = client.post("/v1/traces:batch", content=chunks(), headers=headers("submitter"))
    assert answer.status_code == 413 and answer.json()["field"] == "body"
    _assert_nothing_stored(db_url)


def test_any_endpoint_refuses_a_declared_body_over_the_limit(
    make_client: Callable[..., TestClient], headers: Headers
) -> None:
    client = make_client(max_request_bytes=100)
    answer = client.post(
        "/v1/keys",
        content=b'{"role": "auditor", "name": "' + b"x" * 200 + b'"}',
        headers=headers("admin") | {"Content-Type": "application/json"},
    )
    assert answer.status_code == 413 and answer.json()["field"] == "body"


def test_a_batch_stores_its_good_items_beside_an_out_of_range_number(
    client: TestClient, headers: Headers, db_url: str
) -> None:
    bad = make_trace(config={"extras": {"big": 10**30}})
    good = make_trace()
    body = json.dumps({"traces": [good, bad, make_trace()]}).encode()
    answer = client.post("/v1/traces:batch", content=body, headers=headers("submitter"))
    assert answer.status_code == 207, answer.text
    statuses = [r["status"] for r in answer.json()["results"]]
    assert statuses == [201, 422, 201]
    assert answer.json()["results"][1]["error"]["field"] == "config.extras.big"
    assert count_rows(db_url, Trace) == 2


@pytest.mark.parametrize("path", ["/v1/traces", "/v1/traces:batch"])
def test_extras_read_back_exactly_as_sent(client: TestClient, headers: Headers, path: str) -> None:
    extras = {
        "none": None,
        "true": True,
        "zero": 0,
        "int_max": 2**63 - 1,
        "int_min": -(2**63) + 1,
        "float": 0.1,
        "integral_float": 3.0,
        "tiny": 5e-324,
        "huge": 1.5e18,
        "text": "3",
    }
    trace = make_trace(config={"extras": extras})
    body = {"traces": [trace]} if path.endswith("batch") else trace
    answer = client.post(path, content=json.dumps(body), headers=headers("submitter"))
    assert answer.status_code in (201, 207), answer.text
    result = answer.json()["results"][0] if path.endswith("batch") else answer.json()
    assert result["status"] == 201, result
    read = client.get(f"/v1/traces/{result['id']}", headers=headers("auditor")).json()
    stored = read["config"]["extras"]
    assert stored == extras
    assert {k: type(v) for k, v in stored.items()} == {k: type(v) for k, v in extras.items()}


@pytest.mark.parametrize("path", ["/v1/traces", "/v1/traces:batch"])
def test_an_integer_written_as_an_integral_float_is_that_integer(
    client: TestClient, headers: Headers, path: str
) -> None:
    """JSON Schema's integer is a value: 3.0 is 3, so the document's schema-valid trace with
    `3.0` token ids is accepted and reads back as 3 (issue 33; it was a 422)."""
    trace = make_trace(n_output=6)
    expected = json.loads(json.dumps(trace))
    trace["output_token_ids"][2] = float(trace["output_token_ids"][2])
    trace["top_k"]["ids"][1][0] = float(trace["top_k"]["ids"][1][0])
    trace["model"]["vocab_size"] = float(trace["model"]["vocab_size"])
    body = {"traces": [trace]} if path.endswith("batch") else trace
    answer = client.post(path, content=json.dumps(body), headers=headers("submitter"))
    result = answer.json()["results"][0] if path.endswith("batch") else answer.json()
    assert result["status"] == 201, result
    read = client.get(f"/v1/traces/{result['id']}", headers=headers("auditor")).json()
    assert read["output_token_ids"] == expected["output_token_ids"]
    assert all(type(i) is int for i in read["output_token_ids"])
    assert read["top_k"]["ids"] == expected["top_k"]["ids"]
    assert read["model"]["vocab_size"] == expected["model"]["vocab_size"]
