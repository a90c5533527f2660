"""Imports: logged responses -> traces -> the traces store, with the batch endpoint's semantics.

`traces_from_item` is pure (the CLI's `--out` path uses it without a database);
`import_items` stores what it gives through `traces.service.ingest_traces`, so an import is
idempotent by content exactly as `POST /v1/traces:batch` is. Never commits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from sqlalchemy.orm import Session

from replay_audit.config import MAX_BATCH_TRACES
from replay_audit.exceptions import FieldError, PayloadTooLarge, ReplayAuditError
from replay_audit.formats import ImportFormat
from replay_audit.imports.generation import Generation, build_trace, check_context, dropped_top_k
from replay_audit.imports.hf import parse_hf
from replay_audit.imports.openai_compat import parse_openai
from replay_audit.imports.schemas import ImportContext, ImportResult
from replay_audit.imports.sglang import parse_sglang
from replay_audit.imports.sniff import format_hint
from replay_audit.imports.tokenization import Vocabulary
from replay_audit.traces import service as traces_service
from replay_audit.traces.schemas import TraceCreate

Parser = Callable[[Any, str], list[Generation]]

#: The formats whose items are parsed without a tokenizer (lm-eval needs the checkpoint's).
PARSERS: Final[dict[str, Parser]] = {
    "openai": parse_openai,
    "sglang": parse_sglang,
    "hf": parse_hf,
}


def traces_from_item(
    fmt: ImportFormat,
    item: Any,
    context: ImportContext,
    path: str = "item",
    vocabulary: Vocabulary | None = None,
) -> list[TraceCreate]:
    """The traces of one logged item (a response; several traces for several choices), with
    the checkpoint's `vocabulary` for what the item logged only as text (the CLI's `--model`;
    the API has none). Raises FieldError naming the field (relative to `path`)."""
    return [build_trace(g, context, fmt, vocabulary) for g in _parser(fmt)(item, path)]


def _parser(fmt: ImportFormat) -> Parser:
    parser = PARSERS.get(fmt)
    if parser is None:
        raise FieldError(
            f"format {fmt!r} cannot be imported here: lm-eval samples carry text and need the "
            "checkpoint's tokenizer (use `replay-audit import --format lm-eval --model DIR`)",
            field="format",
        )
    return parser


def import_items(
    session: Session,
    project_id: int,
    fmt: ImportFormat,
    context: ImportContext,
    items: Sequence[Any],
) -> list[ImportResult]:
    """Parse and store each item's traces: one result per trace (`ImportResult`), or one error
    result for an item that gives none; good items are stored even when others fail. Raises
    PayloadTooLarge past MAX_BATCH_TRACES traces in all."""
    _parser(fmt)
    check_context(context)
    parsed: list[tuple[int, int | None, TraceCreate | ReplayAuditError]] = []
    for index, item in enumerate(items):
        try:
            traces = traces_from_item(fmt, item, context, path="item")
        except ReplayAuditError as error:
            hint = format_hint(item, fmt, "format=")  # the item may be another server's
            if hint and isinstance(error, FieldError):
                error = FieldError(error.message + hint, field=error.field)
            parsed.append((index, None, error))
            continue
        parsed.extend((index, choice, trace) for choice, trace in enumerate(traces))
    n_traces = sum(1 for _, _, t in parsed if isinstance(t, TraceCreate))
    if n_traces > MAX_BATCH_TRACES:
        raise PayloadTooLarge(
            f"the items give {n_traces} traces; at most {MAX_BATCH_TRACES} per request",
            field="items",
        )
    stored = traces_service.ingest_traces(session, project_id, [t for _, _, t in parsed])
    return [
        ImportResult(
            **r.model_dump(exclude={"index"}),
            index=index,
            choice=choice,
            warning=dropped_top_k(t) if isinstance(t, TraceCreate) else None,
        )
        for (index, choice, t), r in zip(parsed, stored, strict=True)
    ]
