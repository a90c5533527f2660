"""A fast path for validating a trace already parsed from JSON (a batch item).

pydantic spends most of a trace's validation time on its big arrays (~1,500 values for 256
prompt and output tokens with top-2, each checked and copied one by one). Here the arrays are
checked with C-level passes instead, the small rest goes through pydantic, then the same
model-level checks run (`TraceCreate._check`).

The fast path only ever says "exactly the model pydantic would have built" or "don't know"
(None: anything unusual, and every failed check); pydantic then validates the item. So what is
accepted, and every error answer, is pydantic's; tests check the two paths build equal models.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Final, cast

import numpy as np
from pydantic import ValidationError, create_model

from replay_audit.traces.schemas import PackedTopK, TopK, TraceCreate, TraceInput

_ARRAY_FIELDS: Final = frozenset({"prompt_token_ids", "output_token_ids", "top_k"})
_TOKEN_ID_LIMIT: Final = 2**31

#: TraceCreate without the arrays, derived from it so the two cannot drift apart.
_TraceHeader = create_model(  # type: ignore[call-overload]
    "_TraceHeader",
    __base__=TraceInput,
    **{
        name: (info.annotation, info)
        for name, info in TraceCreate.model_fields.items()
        if name not in _ARRAY_FIELDS
    },
)


def _token_ids(value: Any) -> list[int] | None:
    # Exactly Python ints (bool is its own type, so True/False do not pass), in range.
    if type(value) is not list or not value or set(map(type, value)) != {int}:
        return None
    if min(value) < 0 or max(value) >= _TOKEN_ID_LIMIT:
        return None
    return value


class _Unknown(Exception):
    """The fast path cannot vouch for this input."""


def _top_k(value: Any) -> TopK:
    if type(value) is not dict or value.keys() != {"ids", "logits"}:
        raise _Unknown
    ids, logits = value["ids"], value["logits"]
    if type(ids) is not list or type(logits) is not list or not ids or len(ids) != len(logits):
        raise _Unknown
    k = len(ids[0]) if type(ids[0]) is list else 0
    try:
        if k == 0 or set(map(len, ids)) != {k} or set(map(len, logits)) != {k}:
            raise _Unknown
    except TypeError:  # an element without a length (a number, null)
        raise _Unknown from None
    # Checking the flattened element types also checks the rows: a row that is a string or an
    # object flattens to strings, which fail.
    flat_ids = list(chain.from_iterable(ids))
    flat_logits = list(chain.from_iterable(logits))
    if set(map(type, flat_ids)) != {int}:
        raise _Unknown
    # JSON floats only: pydantic would turn an int logit into a float, which we do not copy.
    if set(map(type, flat_logits)) != {float}:
        raise _Unknown
    if min(flat_ids) < 0 or max(flat_ids) >= _TOKEN_ID_LIMIT:
        raise _Unknown
    ids32 = np.fromiter(flat_ids, dtype="<i4", count=len(flat_ids))
    logits64 = np.fromiter(flat_logits, dtype=np.float64, count=len(flat_logits))
    with np.errstate(over="ignore", invalid="ignore"):
        logits32 = logits64.astype("<f4")
    top_k = TopK.model_construct(ids=ids, logits=logits)
    # What TopK.packed would compute, already at hand (cached_property reads __dict__).
    top_k.__dict__["packed"] = PackedTopK(k, ids32.tobytes(), logits32.tobytes())
    return top_k


def validate_trace_fast(raw: Any) -> TraceCreate | None:
    """The TraceCreate pydantic would build from `raw` (a parsed JSON object), or None when the
    fast path cannot vouch for it (then validate with `TraceCreate.model_validate`)."""
    if type(raw) is not dict:
        return None
    try:
        prompt = _token_ids(raw.get("prompt_token_ids"))
        output = _token_ids(raw.get("output_token_ids"))
        if prompt is None or output is None:
            return None
        raw_top_k = raw.get("top_k")
        top_k = _top_k(raw_top_k) if raw_top_k is not None else None
        header = _TraceHeader.model_validate(
            {k: v for k, v in raw.items() if k not in _ARRAY_FIELDS}
        )
        fields = {name: getattr(header, name) for name in _TraceHeader.model_fields}
        trace = TraceCreate.model_construct(
            _fields_set=header.model_fields_set | (_ARRAY_FIELDS & raw.keys()),
            prompt_token_ids=prompt,
            output_token_ids=output,
            top_k=top_k,
            **fields,
        )
        # The model-level checks (vocabulary, sizes, top-k), exactly as validation runs them;
        # pydantic leaves the decorated method a plain function, which mypy cannot see.
        cast(Any, trace)._check()
    except (_Unknown, ValidationError, ValueError):
        return None
    return trace
