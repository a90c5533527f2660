"""Turning raw request bodies into validated models, fast, with errors that name the field.

Bodies are parsed by pydantic-core straight from bytes (no intermediate `json.loads`), which
also accepts the NaN/Infinity literals Python's `json.dumps` writes, so a NaN logit gets a 422
naming the step instead of a parse error. Python's cyclic garbage collector is paused while a
large body is turned into objects: a 500-trace batch makes hundreds of thousands of small lists
and the collector would otherwise rescan them over and over (4-5x the parse time, measured);
none of them can be part of a cycle, so reference counting frees them all the same.
"""

from __future__ import annotations

import contextlib
import gc
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

import orjson
import pydantic_core
from pydantic import BaseModel, ValidationError

from replay_audit.api.errors import error_from_validation
from replay_audit.exceptions import BadRequest, FieldError, PayloadTooLarge, ReplayAuditError

M = TypeVar("M", bound=BaseModel)


class _GcPause:
    """The pause of `gc_paused`: it nests and is safe across threads (the collector runs again
    once the last block ends, if it ran before the first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._was_enabled = True

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._was_enabled:
                    gc.enable()


_gc_pause = _GcPause()


def gc_paused() -> AbstractContextManager[None]:
    """Pause the cyclic GC for the block (a process-wide pause, as the collector is)."""
    return _gc_pause()


def parse_model(body: bytes, model: type[M], *, strict: bool | None = None) -> M:
    """`model` validated from the JSON `body`; a domain error (400 malformed JSON, 413 too
    large, 422 naming the field) otherwise. `strict`: strict types in every nested model too,
    lax ones included."""
    if not body:
        raise BadRequest("empty request body; expected JSON", field="body")
    try:
        with gc_paused():
            return model.model_validate_json(body, strict=strict)
    except ValidationError as exc:
        raise error_from_validation(exc.errors()) from None


def parse_items(
    body: bytes,
    model: type[M],
    *,
    key: str,
    max_items: int,
    fast: Callable[[Any], M | None] | None = None,
) -> list[M | ReplayAuditError]:
    """Each element of the list `body[key]` validated as `model` on its own: an element's error
    is its entry (the field named relative to it); the envelope's fail the whole request.

    `fast(raw)` may build an element without pydantic (None: it cannot vouch, pydantic
    validates). Its documents are parsed by orjson, the fastest parser at hand; a body orjson
    refuses (e.g. with NaN literals) takes the general path.
    """
    if not body:
        raise BadRequest("empty request body; expected JSON", field="body")
    with gc_paused():
        document: Any = _NOT_PARSED
        if fast is not None:
            with contextlib.suppress(orjson.JSONDecodeError):
                document = orjson.loads(body)
        if document is _NOT_PARSED:
            try:
                document = pydantic_core.from_json(body, allow_inf_nan=True)
            except ValueError as exc:
                document = _lenient(body, exc)
        if not isinstance(document, dict) or not isinstance(document.get(key), list):
            raise FieldError(f"{key}: expected an object with a list {key!r}", field=key)
        raw_items: list[Any] = document[key]
        extra = sorted(set(document) - {key})
        if extra:
            raise FieldError(f"{extra[0]}: unexpected field", field=extra[0])
        if len(raw_items) > max_items:
            raise PayloadTooLarge(
                f"{len(raw_items)} items in one request; at most {max_items}", field=key
            )
        results: list[M | ReplayAuditError] = []
        for raw in raw_items:
            item = fast(raw) if fast is not None else None
            if item is None:
                try:
                    item = model.model_validate(raw)
                except ValidationError as exc:
                    results.append(error_from_validation(exc.errors()))
                    continue
            results.append(item)
        return results


_NOT_PARSED: Any = object()


def _lenient(body: bytes, error: ValueError) -> Any:
    """The document by the stdlib parser, which keeps a lone surrogate escape (`"\\ud800"`)
    that the fast parsers refuse: the element holding it is then refused on its own (the
    storability check of `InputModel`), not the whole batch. 400 when it is not JSON at all."""
    try:
        return json.loads(body)
    except ValueError:
        raise BadRequest(f"malformed JSON: {error}", field="body") from None
    except RecursionError:  # nested deeper than any parser follows
        raise BadRequest(f"malformed JSON: nested too deep ({error})", field="body") from None
