"""The fast validation path builds exactly pydantic's model, and never accepts what pydantic
refuses (it says "don't know" instead)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pydantic_core
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from replay_audit.traces.fast_validation import validate_trace_fast
from replay_audit.traces.schemas import TraceCreate
from tests.factories import make_config, make_trace
from tests.traces.test_validation import ITEM_CASES, Mutation, _mutated


def _as_parsed(trace: dict[str, Any]) -> Any:
    """What a batch item looks like after JSON parsing (orjson, as the batch path uses)."""
    return orjson.loads(json.dumps(trace, allow_nan=False))


def _assert_same_model(raw: Any) -> None:
    fast = validate_trace_fast(raw)
    reference = TraceCreate.model_validate(raw)
    assert fast is not None
    assert fast == reference
    assert fast.model_dump_json() == reference.model_dump_json()
    assert fast.model_fields_set == reference.model_fields_set
    if reference.top_k is not None:
        assert fast.top_k is not None and fast.top_k.packed == reference.top_k.packed


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"top_k": None},
        {"top_k": 1},
        {"top_k": 20},
        {"n_prompt": 1, "n_output": 1},
        {"external_id": "x-1", "tags": [], "prompt_text": None, "output_text": None},
        {"config": make_config(lm_head_dtype=None, device="cpu", gpu=None, extras={"a": 1.5})},
        {"vocab": 2**31 - 1},
    ],
    ids=repr,
)
def test_valid_traces_give_the_same_model(overrides: dict[str, Any]) -> None:
    _assert_same_model(_as_parsed(make_trace(**overrides)))


def test_defaults_left_out_give_the_same_model() -> None:
    trace = make_trace()
    for field in ("decoding", "tags", "prompt_text", "output_text", "reference_answer"):
        del trace[field]
    _assert_same_model(_as_parsed(trace))


@pytest.mark.parametrize(
    ("case", "mutation", "status", "field"), ITEM_CASES, ids=[c[0] for c in ITEM_CASES]
)
def test_invalid_traces_are_left_to_pydantic(
    case: str, mutation: Mutation, status: int, field: str
) -> None:
    # pydantic-core's parser: orjson refuses the Infinity literal (that body takes the general
    # path before it gets here), but the fast path must refuse it whatever the parser.
    raw = pydantic_core.from_json(json.dumps(_mutated(mutation)), allow_inf_nan=True)
    assert validate_trace_fast(raw) is None


@pytest.mark.parametrize(
    "mutate",
    [
        lambda t: t["top_k"]["logits"][0].__setitem__(0, 30),  # int logit: pydantic makes 30.0
    ],
)
def test_unusual_but_valid_input_is_left_to_pydantic(mutate: Any) -> None:
    trace = make_trace()
    mutate(trace)
    raw = orjson.loads(json.dumps(trace))
    assert validate_trace_fast(raw) is None
    TraceCreate.model_validate(raw)  # ...which accepts it


json_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**30]),
    st.floats(),  # NaN and infinities included: the body is written by json.dumps
    st.sampled_from([3.0, 0.0, -1.0]),  # integral floats where ints go
    st.text(max_size=3),
    st.sampled_from(["3", "99.0", "true", "\x00", "a\x00"]),
    st.lists(st.integers(min_value=0, max_value=5), max_size=3),
)

#: Where one value is replaced: the arrays (the fast path's own checks) and header fields
#: (validated by the header model: strict types, extras, storable text).
_PATHS = [
    "prompt_token_ids", "output_token_ids", "top_k.ids", "top_k.logits", "top_k.row",
    "model.vocab_size", "model.name", "config.batch_size", "config.deterministic",
    "config.extras.v", "config.extras.key", "decoding.max_new_tokens",
    "decoding.eos_token_ids", "external_id", "prompt_text",
]


def _replace(trace: dict[str, Any], path: str, position: int, value: Any) -> None:
    if path == "top_k.row":
        trace["top_k"]["ids"][position] = value
    elif path in ("top_k.ids", "top_k.logits"):
        trace["top_k"][path.split(".")[1]][position][position % 2] = value
    elif path in ("prompt_token_ids", "output_token_ids"):
        trace[path][position] = value
    elif path == "decoding.eos_token_ids":
        trace["decoding"]["eos_token_ids"] = [value]
    elif path == "config.extras.key":
        trace["config"]["extras"] = {str(value): 1}
    else:
        *parents, last = path.split(".")
        node = trace
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value


@settings(max_examples=600, deadline=None)
@given(
    path=st.sampled_from(_PATHS),
    position=st.integers(min_value=0, max_value=5),
    value=json_values,
)
def test_fast_path_is_sound_under_any_single_change(path: str, position: int, value: Any) -> None:
    trace = make_trace(seed=position, n_output=6)
    _replace(trace, path, position, value)
    # Parsed as the batch endpoint parses: orjson, or pydantic-core for NaN/Infinity literals.
    body = json.dumps(trace)
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError:
        raw = pydantic_core.from_json(body, allow_inf_nan=True)
    fast = validate_trace_fast(raw)
    try:
        reference = TraceCreate.model_validate(raw)
    except ValidationError:
        assert fast is None
        return
    if fast is not None:
        assert fast == reference and fast.model_dump_json() == reference.model_dump_json()
        assert fast.model_fields_set == reference.model_fields_set
