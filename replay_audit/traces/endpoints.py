"""HTTP endpoints for traces. Thin: parse, call one service function, answer.

Submitters post but cannot read traces back (`Reader`): an ingest key leaked from a production
host exposes no logged prompts or outputs. They do learn the id of a trace they re-post.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from replay_audit.api.deps import DBSession, RawBody, Reader, Writer
from replay_audit.api.parsing import gc_paused, parse_items, parse_model
from replay_audit.config import MAX_BATCH_TRACES
from replay_audit.formats import BodyDType, HeadDType
from replay_audit.input import UtcDatetime
from replay_audit.json_value import JsonObject
from replay_audit.traces import service
from replay_audit.traces.fast_validation import validate_trace_fast
from replay_audit.traces.schemas import (
    IngestResult,
    TraceBatchResult,
    TraceCreate,
    TracePage,
    TraceRead,
)
from replay_audit.traces.selection import TraceSelection

router = APIRouter(tags=["traces"])


_ERRORS: dict[int | str, JsonObject] = {
    400: {"description": "Malformed JSON (`field`: `body`)"},
    401: {"description": "Missing or invalid API key"},
    403: {"description": "The key's role may not do this"},
    413: {"description": "Body, trace or batch over its size limit"},
    422: {"description": "Invalid input; `field` names it, e.g. `top_k.logits[3]`"},
}


def _json_body(schema: str) -> JsonObject:
    # The body is read raw (size limit, fast parse); this documents it in the OpenAPI schema.
    ref: JsonObject = {"$ref": f"#/components/schemas/{schema}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _json(model: IngestResult | TraceBatchResult | TraceRead, status_code: int) -> Response:
    return Response(
        model.model_dump_json(exclude_none=not isinstance(model, TraceRead)),
        status_code=status_code,
        media_type="application/json",
    )


@router.post(
    "/v1/traces",
    status_code=201,
    response_model=IngestResult,
    response_model_exclude_none=True,
    summary="Store one trace (idempotent)",
    responses={
        200: {"model": IngestResult, "description": "Same content already stored: its id"},
        409: {"description": "`external_id` already used by different content"},
        **_ERRORS,
    },
    openapi_extra=_json_body("TraceCreate"),
)
def create_trace(principal: Writer, session: DBSession, body: RawBody) -> Response:
    """201 `{"id", "created": true}` for a new trace; 200 `created: false` with the existing id
    when the project already holds the same content; 409 when `external_id` is taken by
    different content."""
    trace = parse_model(body, TraceCreate)
    result = service.ingest_trace(session, principal.project_id, trace)
    return _json(result.model_copy(update={"index": None}), result.status)


@router.post(
    "/v1/traces:batch",
    status_code=207,
    response_model=TraceBatchResult,
    response_model_exclude_none=True,
    summary=f"Store up to {MAX_BATCH_TRACES} traces, one result each",
    responses=_ERRORS,
    openapi_extra=_json_body("TraceBatchCreate"),
)
def create_traces(principal: Writer, session: DBSession, body: RawBody) -> Response:
    """Body `{"traces": [TraceCreate, ...]}`; answer 207 `{"results": [...]}` with one result
    per item in order: `status` 201/200 with `id` and `created`, or the item's 4xx `status` and
    `error` (`field` relative to the item). Good items are stored even when others fail."""
    # The collector stays off until the batch's objects are gone: they die by refcount, and a
    # collection in the middle would rescan hundreds of thousands of them (see api.parsing).
    with gc_paused():
        items = parse_items(
            body, TraceCreate, key="traces", max_items=MAX_BATCH_TRACES, fast=validate_trace_fast
        )
        results = service.ingest_traces(session, principal.project_id, items)
        del items
        return _json(TraceBatchResult(results=results), 207)


@router.get(
    "/v1/traces/{trace_id}",
    response_model=TraceRead,
    summary="Read one trace back, exactly as sent",
    responses={404: {"description": "No such trace in this key's project"}, **_ERRORS},
)
def read_trace(trace_id: str, principal: Reader, session: DBSession) -> Response:
    """Every field as sent: token ids bit-exact, logits as their float32 values."""
    return _json(service.get_trace(session, principal.project_id, trace_id), 200)


_AFTER = "created at or after this time (UTC when no zone is given)"
_BEFORE = "created strictly before this time (UTC when no zone is given)"
_TAG = "traces carrying this tag; repeat it for traces carrying all of them"
_GREEDY = "true: greedy traces only (what replays and audits select); false: the others only"


@router.get(
    "/v1/traces",
    response_model=TracePage,
    summary="List traces, newest first, filtered and cursor-paginated",
    responses=_ERRORS,
)
def list_traces(
    principal: Reader,
    session: DBSession,
    model: Annotated[str | None, Query(description="model.name")] = None,
    model_name: Annotated[
        str | None, Query(description="model.name (the replay filter's name for `model`)")
    ] = None,
    weights_sha256: Annotated[str | None, Query(pattern=r"^[0-9a-f]{64}$")] = None,
    config_id: Annotated[str | None, Query()] = None,
    dtype: Annotated[BodyDType | None, Query(description="config.dtype")] = None,
    lm_head_dtype: Annotated[
        HeadDType | None,
        Query(description="effective config.lm_head_dtype (the body dtype when unset)"),
    ] = None,
    attn_kernel: Annotated[str | None, Query(description="config.attn_kernel")] = None,
    tag: Annotated[list[str] | None, Query(description=_TAG)] = None,
    external_id: Annotated[str | None, Query()] = None,
    created_after: Annotated[UtcDatetime | None, Query(description=_AFTER)] = None,
    created_before: Annotated[UtcDatetime | None, Query(description=_BEFORE)] = None,
    greedy: Annotated[bool | None, Query(description=_GREEDY)] = None,
    cursor: Annotated[
        str | None, Query(pattern=service.CURSOR, description="`next_cursor` of the previous page")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=service.MAX_PAGE_SIZE)] = 100,
) -> TracePage:
    if model is not None and model_name is not None and model != model_name:
        return TracePage(items=[], next_cursor=None)  # both apply, and no trace has two names
    selection = TraceSelection(
        model_name=model_name if model_name is not None else model,
        weights_sha256=weights_sha256,
        config_id=config_id,
        dtype=dtype,
        lm_head_dtype=lm_head_dtype,
        attn_kernel=attn_kernel,
        tags=tuple(tag or ()),
        external_id=external_id,
        created_after=created_after,
        created_before=created_before,
        greedy=greedy,
    )
    return service.list_traces(session, principal.project_id, selection, limit=limit, cursor=cursor)
