"""The fields this release added (a target's `gpu_kind` and `tp_degree`, a verification's
`filter.trace_ids`, a trace's `decoding.logits_processors` and `decoding.batch`, a
schedule's `verify`, a run's `decode_window`, a screening's `tp_degree`) refuse NUL, huge
numbers, oversize values and wrong types with a 422 naming the field, on both databases, before
any work starts."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from tests.audits.conftest import schedule_body
from tests.factories import make_trace

HUGE = 10**20


@pytest.mark.parametrize(
    ("target", "field"),
    [
        ({"dtype": "fp16", "tp_degree": HUGE}, "tp_degree"),
        ({"dtype": "fp16", "tp_degree": 0}, "tp_degree"),
        ({"dtype": "fp16", "tp_degree": "two"}, "tp_degree"),
        ({"dtype": "fp16", "gpu_kind": "h" * 5000}, "gpu_kind"),
        ({"dtype": "fp16", "gpu_kind": 7}, "gpu_kind"),
    ],
)
def test_a_bad_target_placement_is_422_naming_it(
    client: TestClient,
    headers: Callable[..., dict[str, str]],
    target: dict[str, object],
    field: str,
) -> None:
    body = {"trace_ids": ["tr_1"], "targets": [target]}
    r = client.post("/v1/replays", json=body, headers=headers("admin"))
    assert r.status_code == 422, r.text
    assert field in r.text


@pytest.mark.parametrize(
    ("trace_ids", "why"),
    [(["tr_1"] * 100_001, "oversize"), ([HUGE], "a number"), ("tr_1", "not a list")],
)
def test_a_bad_verification_selection_is_422_naming_it(
    client: TestClient, headers: Callable[..., dict[str, str]], trace_ids: object, why: str
) -> None:
    body = {"filter": {"trace_ids": trace_ids}}
    r = client.post("/v1/verifications", json=body, headers=headers("admin"))
    assert r.status_code == 422, (why, r.text[:300])
    assert "trace_ids" in r.text


@pytest.mark.parametrize(
    ("processors", "field"),
    [
        ({"logit_bias": {str(HUGE): 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1e400}}, "logit_bias"),
        ({"no_repeat_ngram_size": HUGE}, "no_repeat_ngram_size"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"bad_words": ["x" * 5000]}, "bad_words"),
        ({"bad_words_ids": [[1]] * 100_000}, "bad_words_ids"),
        ({"logit_bias": "all"}, "logit_bias"),
    ],
)
def test_bad_logits_processors_are_422_naming_them(
    client: TestClient,
    headers: Callable[..., dict[str, str]],
    processors: dict[str, object],
    field: str,
) -> None:
    trace = make_trace()
    trace["decoding"] = {**trace["decoding"], "logits_processors": processors}
    r = client.post("/v1/traces", content=_json(trace), headers=headers("submitter"))
    assert r.status_code == 422, r.text[:300]
    assert field in r.text
    assert client.get("/v1/traces", headers=headers("admin")).json()["items"] == []


@pytest.mark.parametrize(
    ("batch", "field"),
    [
        ({"prompt_lengths": [HUGE], "row": 0}, "prompt_lengths"),
        ({"prompt_lengths": [3], "row": HUGE}, "row"),
        ({"prompt_lengths": [3], "row": -1}, "row"),
        ({"prompt_lengths": [3] * 100_000, "row": 0}, "prompt_lengths"),
        ({"prompt_lengths": ["3"], "row": 0}, "prompt_lengths"),
        ({"prompt_lengths": [3.5], "row": 0}, "prompt_lengths"),
        ({"prompt_lengths": "3", "row": 0}, "prompt_lengths"),
        ({"prompt_lengths": [3], "row": 0, "pad": "\u0000"}, "pad"),
        ({"row": 0}, "prompt_lengths"),
    ],
)
def test_a_bad_batch_layout_is_422_naming_it(
    client: TestClient,
    headers: Callable[..., dict[str, str]],
    batch: dict[str, object],
    field: str,
) -> None:
    trace = make_trace()
    trace["decoding"] = {**trace["decoding"], "batch": batch}
    r = client.post("/v1/traces", content=_json(trace), headers=headers("submitter"))
    assert r.status_code == 422, r.text[:300]
    assert f"decoding.batch.{field}" in r.text
    assert client.get("/v1/traces", headers=headers("admin")).json()["items"] == []


def _json(value: object) -> bytes:
    # 1e400 is not JSON a library writes: put it in as text, as a hostile client would.
    import json

    return json.dumps(value).replace("Infinity", "1e400").encode()


def test_a_bad_schedule_verify_is_422_naming_it(
    client: TestClient, headers: Callable[..., dict[str, str]]
) -> None:
    for verify in ({"false_alarm_rate": "many"}, {"false_alarm_rate": 0.9}, {"group_by": 5}):
        body = schedule_body(verify=verify)
        r = client.post("/v1/audits/schedules", json=body, headers=headers("admin"))
        assert r.status_code == 422, r.text[:300]
        assert "verify" in r.text


@pytest.mark.parametrize("bad", [HUGE, -1, "\u0000", "4", 1.5, True, [4]])
def test_a_bad_decode_window_or_screening_tp_degree_is_422_naming_it(
    client: TestClient, headers: Callable[..., dict[str, str]], bad: object
) -> None:
    run = {"trace_ids": ["tr_1"], "targets": [{"dtype": "fp16"}], "decode_window": bad}
    r = client.post("/v1/replays", json=run, headers=headers("admin"))
    assert r.status_code == 422 and r.json()["field"] == "decode_window", r.text[:300]
    screening = {
        "model_sha256": "a" * 64,
        "prompts": [{"prompt_token_ids": [1, 2]}],
        "knobs": ["tp"],
        "tp_degree": bad,
    }
    r = client.post("/v1/screenings", json=screening, headers=headers("admin"))
    assert r.status_code == 422 and r.json()["field"] == "tp_degree", r.text[:300]
