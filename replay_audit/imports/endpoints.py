"""`POST /v1/traces:import?format=...`: raw logged responses in, traces stored. Thin.

Who may: submitter, admin (as `POST /v1/traces:batch`). The answer is the batch endpoint's:
207 with one result per trace in item order (`index` the item, `choice` the trace within it),
or the item's 4xx `error` naming the field (`item.choices[0].token_ids`); idempotent by
content, so a gateway may forward the same responses again.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response

from replay_audit.api.deps import DBSession, RawBody, require_role
from replay_audit.api.parsing import gc_paused, parse_model
from replay_audit.auth.models import Role
from replay_audit.auth.schemas import Principal
from replay_audit.formats import ImportFormat
from replay_audit.imports import service
from replay_audit.imports.schemas import ImportBatchResult, ImportRequest
from replay_audit.imports.service import PARSERS
from replay_audit.json_value import JsonObject

router = APIRouter(tags=["traces"])

Submitter = Annotated[Principal, Depends(require_role(Role.submitter, Role.admin))]

_ERRORS: dict[int | str, JsonObject] = {
    400: {"description": "Malformed JSON (`field`: `body`)"},
    401: {"description": "Missing or invalid API key"},
    403: {"description": "The key's role may not do this"},
    413: {"description": "Body or number of traces over its limit"},
    422: {"description": "Invalid context or format; `field` names it, e.g. `dtype`"},
}


@router.post(
    "/v1/traces:import",
    status_code=207,
    response_model=ImportBatchResult,
    response_model_exclude_none=True,
    summary="Import logged responses (vLLM, SGLang, transformers) as traces, one result each",
    responses=_ERRORS,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ImportRequest"}}
            },
        }
    },
)
def import_traces(
    principal: Submitter,
    session: DBSession,
    body: RawBody,
    # lm-eval is the CLI's only (its samples need the checkpoint's tokenizer): the document
    # leaves it out, and the service's 422 says where to import it.
    format: Annotated[
        ImportFormat,
        Query(description="openai, sglang or hf", json_schema_extra={"enum": [*PARSERS]}),
    ],
) -> Response:
    """Body `{"context": ImportContext, "items": [response | {"request", "response"}]}`;
    answer 207 `{"results": [...]}` (see the module docstring). A context without `dtype`,
    `model.weights_sha256` or `model.vocab_size` is a 422 for the whole request."""
    with gc_paused():
        # Strict over HTTP, as every request body (the context's models are lax for the CLI's
        # hand-written files): `"eos_token_ids": ["1"]` is a 422, as the document says.
        request = parse_model(body, ImportRequest, strict=True)
        results = service.import_items(
            session, principal.project_id, format, request.context, request.items
        )
        answer = ImportBatchResult(results=results)
    return Response(
        answer.model_dump_json(exclude_none=True), status_code=207, media_type="application/json"
    )
