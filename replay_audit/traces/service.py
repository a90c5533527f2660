"""Traces: ingest (idempotent, batched), read back, list.

Content identity. A trace's `content_sha256` is the sha256 of, in order: a version line, the
canonical JSON (sorted keys, compact) of everything except the arrays -- external_id, model,
the sha256 of the canonical configuration JSON, decoding, texts, tags, reference answer -- then
each array as stored (prompt and output ids as little-endian int32, top-k k, ids int32 and
logits float32), each preceded by its byte length. Two posts are the same trace iff they hash
the same: logits that differ only below float32 precision are the same trace, since float32 is
what is stored. `UNIQUE(project_id, content_sha256)` makes a repeat a no-op answered with the
existing id; `UNIQUE(project_id, external_id)` makes a reused external_id with different
content a 409 naming `external_id`. Both are on `trace_keys` (`models.TraceKey` says why).
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

import numpy as np
import orjson
from sqlalchemy.orm import Session

from replay_audit.db.base import utcnow
from replay_audit.db.ids import new_public_id
from replay_audit.db.types import pack_int32
from replay_audit.db.unit_of_work import after_commit
from replay_audit.exceptions import Conflict, FieldError, NotFound, ReplayAuditError
from replay_audit.telemetry.metric import BATCH_ITEMS, TRACES_INGESTED
from replay_audit.traces import repository
from replay_audit.traces.models import Trace, TraceKey
from replay_audit.traces.repository import (
    ConfigValues,
    TraceContent,
    TraceKeyValues,
    TraceValues,
)
from replay_audit.traces.schemas import (
    IngestResult,
    ModelRef,
    NumericalConfig,
    TraceCreate,
    TracePage,
    TraceRead,
    TraceSummary,
)
from replay_audit.traces.selection import TraceSelection

TRACE_ID_PREFIX: Final = "tr"
CONFIG_ID_PREFIX: Final = "cfg"
MAX_PAGE_SIZE: Final = 500
_CONTENT_VERSION: Final = b"replay-audit trace content v1\n"


def canonical_config(config: NumericalConfig) -> tuple[str, str]:
    """(canonical JSON, its sha256) of a numerical configuration: defaults filled in, keys
    sorted, no whitespace. Equal configurations give equal bytes."""
    data = orjson.dumps(config.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)
    return data.decode(), hashlib.sha256(data).hexdigest()


def config_public_id(content_sha256: str) -> str:
    """The public id of a configuration: derived from its content, so stable everywhere."""
    return f"{CONFIG_ID_PREFIX}_{content_sha256[:24]}"


@dataclass
class _Prepared:
    index: int
    trace: TraceCreate
    config_sha256: str
    content_sha256: str
    row: TraceContent


def _prepare(index: int, trace: TraceCreate, config_sha256: str) -> _Prepared:
    prompt = pack_int32(trace.prompt_token_ids)
    output = pack_int32(trace.output_token_ids)
    decoding = trace.decoding.stored()
    top_k = trace.top_k.packed if trace.top_k is not None else None
    header: dict[str, object] = {
        "external_id": trace.external_id,
        "model": trace.model.model_dump(mode="json"),
        "config_sha256": config_sha256,
        "decoding": decoding,
        "prompt_text": trace.prompt_text,
        "output_text": trace.output_text,
        "tags": trace.tags,
        "reference_answer": trace.reference_answer,
    }
    if trace.output_token_pieces is not None:
        # Only when given, so the content hash of a trace without pieces is what it was.
        header["output_token_pieces"] = trace.output_token_pieces
    messages = None
    if trace.prompt_messages is not None:  # likewise
        messages = [m.model_dump() for m in trace.prompt_messages]
        header["prompt_messages"] = messages
    digest = hashlib.sha256(_CONTENT_VERSION)
    digest.update(orjson.dumps(header, option=orjson.OPT_SORT_KEYS))
    arrays = [prompt, output]
    if top_k is not None:
        arrays += [struct.pack("<q", top_k.k), top_k.ids, top_k.logits]
    for array in arrays:
        digest.update(struct.pack("<q", len(array)))
        digest.update(array)
    row: TraceContent = {
        "model_name": trace.model.name,
        "model_revision": trace.model.revision,
        "weights_sha256": trace.model.weights_sha256,
        "vocab_size": trace.model.vocab_size,
        "decoding": decoding,
        "prompt_token_ids": prompt,
        "output_token_ids": output,
        "n_prompt_tokens": len(trace.prompt_token_ids),
        "n_output_tokens": len(trace.output_token_ids),
        "top_k": top_k.k if top_k is not None else None,
        "top_k_ids": top_k.ids if top_k is not None else None,
        "top_k_logits": top_k.logits if top_k is not None else None,
        "prompt_text": trace.prompt_text,
        "prompt_messages": messages,
        "output_text": trace.output_text,
        "output_token_pieces": trace.output_token_pieces,
        "tags": trace.tags,
        "external_id": trace.external_id,
        "reference_answer": trace.reference_answer,
    }
    return _Prepared(index, trace, config_sha256, digest.hexdigest(), row)


def _config_row(config: NumericalConfig, config_json: str, sha: str, now: datetime) -> ConfigValues:
    return {
        "public_id": config_public_id(sha),
        "content_sha256": sha,
        "config_json": config_json,
        "dtype": config.dtype,
        "lm_head_dtype": config.head_dtype,
        "attn_kernel": config.attn_kernel,
        "device": config.device,
        "gpu_name": config.gpu.name if config.gpu else None,
        "gpu_sm": config.gpu.sm if config.gpu else None,
        "batch_size": config.batch_size,
        "created_at": now,
    }


def ingest_trace(session: Session, project_id: int, trace: TraceCreate) -> IngestResult:
    """Store one trace: 201 `created: true`, or 200 `created: false` with the id of the trace
    with the same content; Conflict (409, `external_id`) when the external_id is taken by
    different content. Never commits. The common case is one statement on PostgreSQL
    (`repository.insert_one_trace`); anything else takes `ingest_traces`'s general path."""
    now = utcnow()
    config_json, config_sha = canonical_config(trace.config)
    p = _prepare(0, trace, config_sha)
    key: TraceKeyValues = {
        "public_id": new_public_id(TRACE_ID_PREFIX, int(now.timestamp() * 1000)),
        "project_id": project_id,
        "content_sha256": p.content_sha256,
        "external_id": trace.external_id,
        "created_at": now,
    }
    one = repository.insert_one_trace(session, config_sha, p.row, key)
    results: list[IngestResult | ReplayAuditError | None] = [None]
    if one is not None and one.trace is not None:
        results[0] = IngestResult(index=0, status=201, id=one.trace[1], created=True)
    elif one is not None and one.config_id is not None:
        _resolve(session, project_id, [p], {}, {}, results)  # its key was taken
    else:
        config = _config_row(trace.config, config_json, config_sha, now)
        _store(session, project_id, now, {config_sha: config}, [p], results)
    result = results[0]
    assert result is not None
    if isinstance(result, ReplayAuditError):
        raise result
    _count(session, [result], batch=False)
    return result


def ingest_traces(
    session: Session, project_id: int, items: Sequence[TraceCreate | ReplayAuditError]
) -> list[IngestResult]:
    """One result per item, in order, as `ingest_trace` answers (a repeat of an earlier item
    is a 200 too; an item that failed validation is answered with its error). Each table gets
    one INSERT round trip. Never commits."""
    results = [
        IngestResult(index=index, status=r.status_code, error=r.to_dict())
        if isinstance(r, ReplayAuditError)
        else r
        for index, r in enumerate(_ingest(session, project_id, items))
    ]
    _count(session, results, batch=True)
    return results


def _count(session: Session, results: Sequence[IngestResult], *, batch: bool) -> None:
    """Count what was stored once it is committed (and a batch's items by status)."""
    statuses = [r.status for r in results]

    def count() -> None:
        TRACES_INGESTED.labels("created").inc(statuses.count(201))
        TRACES_INGESTED.labels("existing").inc(statuses.count(200))
        if batch:
            for status in set(statuses):
                BATCH_ITEMS.labels(str(status)).inc(statuses.count(status))

    after_commit(session, count)


def _ingest(
    session: Session, project_id: int, items: Sequence[TraceCreate | ReplayAuditError]
) -> list[IngestResult | ReplayAuditError]:
    results: list[IngestResult | ReplayAuditError | None] = [None] * len(items)
    now = utcnow()
    configs: dict[str, ConfigValues] = {}
    prepared: list[_Prepared] = []
    for index, item in enumerate(items):
        if isinstance(item, ReplayAuditError):
            results[index] = item
            continue
        config_json, config_sha = canonical_config(item.config)
        if config_sha not in configs:
            configs[config_sha] = _config_row(item.config, config_json, config_sha, now)
        prepared.append(_prepare(index, item, config_sha))

    if prepared:
        _store(session, project_id, now, configs, prepared, results)
    return [r for r in results if r is not None]


def _store(
    session: Session,
    project_id: int,
    now: datetime,
    configs: dict[str, ConfigValues],
    prepared: list[_Prepared],
    results: list[IngestResult | ReplayAuditError | None],
) -> None:
    """Store `prepared` (and their `configs`), answering each in `results` at its index."""
    config_ids = repository.ensure_configs(session, configs)
    # One timestamp per call; sorted ULIDs keep the ids in request order.
    ms = int(now.timestamp() * 1000)
    public_ids = iter(sorted(new_public_id(TRACE_ID_PREFIX, ms) for _ in prepared))
    first: dict[str, _Prepared] = {}
    external_ids: set[str] = set()
    rows: list[TraceValues] = []
    for p in prepared:
        if p.content_sha256 in first:
            continue  # a repeat within this call: answered with the first one's id below
        if p.trace.external_id is not None:
            if p.trace.external_id in external_ids:
                # Taken by an earlier item of this call with other content: that one wins
                # (rows are inserted in hash order, not request order), this one gets 409.
                continue
            external_ids.add(p.trace.external_id)
        first[p.content_sha256] = p
        rows.append(
            {
                **p.row,
                "public_id": next(public_ids),
                "project_id": project_id,
                "config_id": config_ids[p.config_sha256],
                "content_sha256": p.content_sha256,
                "created_at": now,
            }
        )
    keyed = repository.insert_trace_keys(
        session,
        [
            {
                "public_id": row["public_id"],
                "project_id": project_id,
                "content_sha256": row["content_sha256"],
                "external_id": row["external_id"],
                "created_at": now,
            }
            for row in rows
        ],
    )
    inserted = repository.insert_traces(
        session, [row for row in rows if row["content_sha256"] in keyed]
    )
    repository.insert_trace_tags(
        session,
        [
            {"trace_id": inserted[sha][0], "trace_created_at": now, "tag": tag}
            for sha, p in first.items()
            if sha in inserted
            for tag in dict.fromkeys(p.trace.tags)
        ],
    )
    _resolve(session, project_id, prepared, first, inserted, results)


def _resolve(
    session: Session,
    project_id: int,
    prepared: Iterable[_Prepared],
    first: dict[str, _Prepared],
    inserted: dict[str, tuple[int, str]],
    results: list[IngestResult | ReplayAuditError | None],
) -> None:
    not_inserted = [p for p in prepared if p.content_sha256 not in inserted]
    existing = repository.public_ids_by(
        session, project_id, TraceKey.content_sha256, {p.content_sha256 for p in not_inserted}
    )
    taken = repository.public_ids_by(
        session,
        project_id,
        TraceKey.external_id,
        {
            p.trace.external_id
            for p in not_inserted
            if p.trace.external_id is not None and p.content_sha256 not in existing
        },
    )
    for p in prepared:
        sha = p.content_sha256
        if sha in inserted:
            created = first[sha] is p
            results[p.index] = IngestResult(
                index=p.index, status=201 if created else 200, id=inserted[sha][1], created=created
            )
        elif sha in existing:
            results[p.index] = IngestResult(
                index=p.index, status=200, id=existing[sha], created=False
            )
        elif p.trace.external_id is not None and p.trace.external_id in taken:
            results[p.index] = Conflict(
                f"external_id {p.trace.external_id!r} is already used by trace "
                f"{taken[p.trace.external_id]} with different content",
                field="external_id",
            )
        else:  # pragma: no cover - the conflicting row vanished between INSERT and SELECT
            results[p.index] = Conflict("conflicting concurrent write; retry the request")


def to_read(trace: Trace) -> TraceRead:
    """The API view of a stored trace: as sent (logits as their float32 values)."""
    top_k = None
    if trace.top_k is not None and trace.top_k_ids is not None and trace.top_k_logits is not None:
        k = trace.top_k
        top_k = {
            "ids": trace.top_k_ids.reshape(-1, k).tolist(),
            "logits": trace.top_k_logits.reshape(-1, k).astype(np.float64).tolist(),
        }
    return TraceRead.model_validate(
        {
            "id": trace.public_id,
            "project": trace.project.name,
            "config_id": trace.config.public_id,
            "content_sha256": trace.content_sha256,
            "created_at": trace.created_at,
            "external_id": trace.external_id,
            "model": _model_ref(trace),
            "config": orjson.loads(trace.config.config_json),
            "decoding": trace.decoding,
            "prompt_token_ids": trace.prompt_token_ids.tolist(),
            "output_token_ids": trace.output_token_ids.tolist(),
            "prompt_text": trace.prompt_text,
            "prompt_messages": trace.prompt_messages,
            "output_text": trace.output_text,
            "output_token_pieces": trace.output_token_pieces,
            "top_k": top_k,
            "tags": trace.tags,
            "reference_answer": trace.reference_answer,
        }
    )


def get_trace(session: Session, project_id: int, trace_id: str) -> TraceRead:
    """The project's trace `trace_id`; NotFound if absent or another project's."""
    traces = repository.get_traces(session, project_id, [trace_id])
    if not traces:
        raise NotFound(f"no trace {trace_id!r}", field="trace_id")
    return to_read(traces[0])


def export_traces(
    session: Session,
    project_id: int,
    selection: TraceSelection,
    public_ids: Collection[str] = (),
    *,
    limit: int | None = None,
) -> Iterator[TraceRead]:
    """Up to `limit` of the project's traces in `selection` (and among `public_ids` if any),
    oldest first, as GET /v1/traces/{id} reads them (`TraceRead.posted_json`: as posted)."""
    for trace in repository.stored_traces(session, project_id, selection, public_ids, limit=limit):
        yield to_read(trace)


def _summary(trace: Trace, config: NumericalConfig) -> TraceSummary:
    return TraceSummary.model_construct(
        id=trace.public_id,
        external_id=trace.external_id,
        model=_model_ref(trace),
        config_id=trace.config.public_id,
        config=config,
        n_prompt_tokens=trace.n_prompt_tokens,
        n_output_tokens=trace.n_output_tokens,
        tags=list(trace.tags),
        created_at=trace.created_at,
    )


def _model_ref(trace: Trace) -> ModelRef:
    return ModelRef(
        name=trace.model_name,
        revision=trace.model_revision,
        weights_sha256=trace.weights_sha256,
        vocab_size=trace.vocab_size,
    )


#: The trace list's cursor: the last trace's id (a pattern the OpenAPI document states).
CURSOR: Final = rf"^{TRACE_ID_PREFIX}_[0-9A-HJKMNP-TV-Z]{{26}}$"


def list_traces(
    session: Session,
    project_id: int,
    selection: TraceSelection,
    *,
    limit: int = 100,
    cursor: str | None = None,
) -> TracePage:
    """One page of the project's traces in `selection`, newest first. `next_cursor` is None
    on the last page."""
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise FieldError(f"limit: must be between 1 and {MAX_PAGE_SIZE}", field="limit")
    if cursor is not None and not re.fullmatch(CURSOR, cursor):
        raise FieldError("cursor: not a cursor returned by this endpoint", field="cursor")
    rows = repository.list_traces(
        session, project_id, selection, limit=limit + 1, before_public_id=cursor
    )
    more = len(rows) > limit
    rows = rows[:limit]
    # Each distinct configuration parsed once.
    configs = {row.config_id: row.config.config_json for row in rows}
    parsed = {id_: NumericalConfig.model_validate_json(json) for id_, json in configs.items()}
    items = [_summary(row, parsed[row.config_id]) for row in rows]
    return TracePage(items=items, next_cursor=rows[-1].public_id if more and rows else None)
