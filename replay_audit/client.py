"""The Python client for serving processes: log traces without slowing the server down.

    from replay_audit.client import Client, from_openai_response
    from replay_audit.imports.schemas import ImportContext

    context = ImportContext(dtype="bf16", logprobs_mode="raw_logprobs", ...)
    with Client("http://audit:8000", key) as audit:        # flushes on exit
        response = openai_client.chat.completions.create(...)
        for trace in from_openai_response(response, context, request=params):
            audit.log(trace)                                 # never blocks

`Client.log` puts the trace in a bounded in-memory buffer and returns at once; a background
thread sends the buffer in batches to `POST /v1/traces:batch`, retrying with exponential
backoff (and jitter) while the server cannot be reached or answers 5xx/429. Posting is
idempotent by content (the server keeps one copy of a trace, answering a repeat with the id it
has), so a batch whose answer was lost is simply sent again. When the buffer is full, `log`
drops the trace and counts it (`stats.dropped`) rather than blocking the serving thread. The
buffer is flushed by `flush()`, `close()`, the `with` block's end and at interpreter exit.

`post_traces` is the synchronous form (the CLI's `import --post`).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
import orjson

from replay_audit.config import MAX_BATCH_TRACES
from replay_audit.imports.generation import build_trace
from replay_audit.imports.openai_compat import parse_openai
from replay_audit.imports.schemas import ImportContext
from replay_audit.imports.sglang import parse_sglang
from replay_audit.imports.tokenization import Vocabulary
from replay_audit.json_value import JsonObject, as_list, as_object
from replay_audit.traces.schemas import TraceCreate
from replay_audit.words import counted

logger = logging.getLogger(__name__)

#: Traces per POST (the server takes at most MAX_BATCH_TRACES).
DEFAULT_BATCH_SIZE: Final = 500
#: Traces the buffer holds before `log` drops (a 256+256-token trace with top-2 is ~10 KB as
#: an object graph: the default bounds the buffer near 100 MB).
DEFAULT_MAX_BUFFER: Final = 10_000
#: Seconds the sender waits for more traces before sending a partial batch.
DEFAULT_FLUSH_INTERVAL_S: Final = 0.5
#: First and largest wait between retries, in seconds (doubling, with jitter).
BACKOFF_INITIAL_S: Final = 0.2
BACKOFF_MAX_S: Final = 10.0
#: Seconds `close()` (and interpreter exit) keeps trying to send what is buffered.
DEFAULT_CLOSE_TIMEOUT_S: Final = 30.0


class SendError(Exception):
    """A batch could not be delivered before the deadline (the server stayed unreachable)."""


@dataclass
class ClientStats:
    """What happened to the traces given to `log` (counts; read them any time)."""

    #: Stored as new traces (201).
    created: int = 0
    #: Already stored: the same content was sent before (200, `created: false`).
    duplicates: int = 0
    #: Refused by the server (4xx for the item, e.g. a 409 external_id conflict): not retried.
    rejected: int = 0
    #: Not accepted by `log` because the buffer was full.
    dropped: int = 0
    #: Given up on at close, the server being unreachable until the deadline.
    undelivered: int = 0
    #: Batch posts retried after a network error, 5xx or 429.
    retries: int = 0
    #: The first 100 refusals: each item's error body (or its status), or the request's.
    errors: list[JsonObject] = field(default_factory=list)


def _body(traces: Sequence[TraceCreate]) -> bytes:
    return (
        b'{"traces":[' + b",".join(orjson.dumps(t.model_dump(mode="json")) for t in traces) + b"]}"
    )


def send_batch(
    http: httpx.Client,
    traces: Sequence[TraceCreate],
    *,
    deadline: Callable[[], bool],
    stats: ClientStats,
    sleep: Callable[[float], None] = time.sleep,
    unreachable_fails: bool = False,
) -> list[JsonObject] | None:
    """POST `traces` to /v1/traces:batch until the server answers (retrying with backoff while
    it cannot be reached or answers 5xx/429) or `deadline()` says to stop (None then). The
    item results, in order; a 413 batch is split in halves. Raises SendError on a 4xx for the
    whole request (a bad key, a bad role): retrying would not help, nor, `unreachable_fails`,
    on a connection the server refuses (no server there: a wrong URL or port)."""
    wait = BACKOFF_INITIAL_S
    while True:
        try:
            answer = http.post(
                "/v1/traces:batch",
                content=_body(traces),
                headers={"Content-Type": "application/json"},
            )
        except httpx.TransportError as exc:
            status, detail = None, f"{type(exc).__name__}: {exc}"
            if unreachable_fails and isinstance(exc, httpx.ConnectError):
                raise SendError(f"cannot reach {http.base_url}: {detail}") from None
        else:
            status, detail = answer.status_code, answer.text[:500]
            if status == 207:
                return [as_object(r) for r in as_list(as_object(answer.json())["results"])]
            if status == 413 and len(traces) > 1:
                half = len(traces) // 2
                first = send_batch(http, traces[:half], deadline=deadline, stats=stats, sleep=sleep)
                if first is None:
                    return None
                rest = send_batch(http, traces[half:], deadline=deadline, stats=stats, sleep=sleep)
                return None if rest is None else first + rest
            if status < 500 and status != 429:
                raise SendError(f"POST /v1/traces:batch answered {status}: {detail}")
        if deadline():
            logger.warning("giving up on %s: %s", counted(len(traces), "trace"), detail)
            return None
        stats.retries += 1
        logger.info(
            "retrying %s in %.1f s (%s)", counted(len(traces), "trace"), wait, status or detail
        )
        sleep(wait * (0.5 + random.random() / 2))
        wait = min(wait * 2, BACKOFF_MAX_S)


def _count(results: Iterable[JsonObject], stats: ClientStats) -> None:
    for r in results:
        if r.get("status") == 201:
            stats.created += 1
        elif r.get("status") == 200:
            stats.duplicates += 1
        else:
            stats.rejected += 1
            if len(stats.errors) < 100:
                error = r.get("error")
                if isinstance(error, dict) and error:
                    stats.errors.append(dict(error))
                else:
                    stats.errors.append({"status": r.get("status")})


def post_traces(
    url: str,
    key: str,
    traces: Iterable[TraceCreate],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    timeout_s: float = 60.0,
    give_up_after_s: float = 300.0,
    on_batch: Callable[[Sequence[JsonObject]], None] | None = None,
    transport: httpx.BaseTransport | None = None,
) -> ClientStats:
    """Send `traces` synchronously in batches (idempotent: a repeat is answered with the id
    the server holds). Retries each batch for up to `give_up_after_s` seconds; `on_batch`
    gets each batch's item results. Raises SendError when the server refuses the request or
    stays unreachable, and at once when the first batch finds no server to connect to."""
    stats = ClientStats()
    size = max(1, min(batch_size, MAX_BATCH_TRACES))
    with httpx.Client(
        base_url=url, headers={"X-API-Key": key}, timeout=timeout_s, transport=transport
    ) as http:
        batch: list[TraceCreate] = []
        delivered: list[int] = []  # each delivered batch's size

        def send() -> None:
            start = time.monotonic()
            results = send_batch(
                http,
                batch,
                stats=stats,
                deadline=lambda: time.monotonic() - start > give_up_after_s,
                unreachable_fails=not delivered,
            )
            if results is None:
                raise SendError(f"the server stayed unreachable for {give_up_after_s:.0f} s")
            _count(results, stats)
            delivered.append(len(results))
            if on_batch is not None:
                on_batch(results)
            batch.clear()

        for trace in traces:
            batch.append(trace)
            if len(batch) >= size:
                send()
        if batch:
            send()
    return stats


#: The API key's environment variable, as the CLI (`import --post`) and the README spell it.
API_KEY_ENV: Final = "REPLAY_AUDIT_API_KEY"


class Client:
    """Buffered, batched, idempotent trace logging (module docstring); thread-safe. The key is
    `key`, else `$REPLAY_AUDIT_API_KEY`."""

    def __init__(
        self,
        url: str,
        key: str | None = None,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_buffer: int = DEFAULT_MAX_BUFFER,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        timeout_s: float = 30.0,
        close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        key = key or os.environ.get(API_KEY_ENV)
        if not key:
            raise ValueError(f"no API key: give key= or set {API_KEY_ENV}")
        self.stats = ClientStats()
        self._batch_size = max(1, min(batch_size, MAX_BATCH_TRACES))
        self._flush_interval_s = flush_interval_s
        self._close_timeout_s = close_timeout_s
        self._queue: queue.Queue[TraceCreate] = queue.Queue(maxsize=max_buffer)
        #: Traces accepted by `log` and not yet answered (or given up on).
        self._pending = 0
        self._done = threading.Condition()
        self._closing = threading.Event()
        self._close_deadline = float("inf")
        self._http = httpx.Client(
            base_url=url, headers={"X-API-Key": key}, timeout=timeout_s, transport=transport
        )
        self._thread = threading.Thread(target=self._run, name="replay-audit-client", daemon=True)
        self._thread.start()
        # Flush at interpreter exit without keeping the client alive until then.
        ref = weakref.ref(self)

        def close_at_exit() -> None:
            client = ref()
            if client is not None:
                client.close()

        self._atexit = close_at_exit
        atexit.register(close_at_exit)

    def log(self, trace: TraceCreate | Mapping[str, Any]) -> bool:
        """Buffer one trace (a `TraceCreate`, or its JSON as a mapping: validated here, so a
        bad trace raises pydantic's ValidationError in the caller). Never blocks: False when
        the buffer is full and the trace was dropped (counted in `stats.dropped`)."""
        if not isinstance(trace, TraceCreate):
            trace = TraceCreate.model_validate(trace)
        if self._closing.is_set():
            raise RuntimeError("the client is closed")
        with self._done:
            self._pending += 1
        try:
            self._queue.put_nowait(trace)
        except queue.Full:
            with self._done:
                self._pending -= 1
                self.stats.dropped += 1
                self._done.notify_all()
            return False
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every trace logged so far is answered by the server (or given up on at
        close). False when `timeout_s` passed first."""
        with self._done:
            return self._done.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Send what is buffered (retrying for up to `timeout_s`, default the client's
        close_timeout_s), then stop. Traces still unsent then are counted as undelivered."""
        if self._closing.is_set():
            return
        limit = self._close_timeout_s if timeout_s is None else timeout_s
        self._close_deadline = time.monotonic() + limit
        self._closing.set()
        self._thread.join(limit + 5.0)
        self._http.close()
        atexit.unregister(self._atexit)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self) -> list[TraceCreate]:
        batch: list[TraceCreate] = []
        try:
            batch.append(self._queue.get(timeout=self._flush_interval_s))
        except queue.Empty:
            return batch
        end = time.monotonic() + self._flush_interval_s
        while len(batch) < self._batch_size:
            try:
                batch.append(self._queue.get(timeout=max(0.0, end - time.monotonic())))
            except queue.Empty:
                break
        return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                if self._closing.is_set() and self._queue.empty():
                    return
                continue
            results = None
            try:
                results = send_batch(
                    self._http,
                    batch,
                    stats=self.stats,
                    deadline=lambda: time.monotonic() > self._close_deadline,
                )
            except SendError as exc:
                logger.error("%s; %s not stored", exc, counted(len(batch), "trace"))
                self.stats.rejected += len(batch)
                self.stats.errors.append({"detail": str(exc)})
            except Exception:  # never let the sender die with traces pending
                logger.exception("unexpected error sending %s", counted(len(batch), "trace"))
                self.stats.undelivered += len(batch)
            else:
                if results is None:
                    self.stats.undelivered += len(batch)
                else:
                    _count(results, self.stats)
            with self._done:
                self._pending -= len(batch)
                self._done.notify_all()


def from_openai_response(
    response: Any,
    context: ImportContext,
    *,
    request: Mapping[str, Any] | None = None,
    vocabulary: Vocabulary | None = None,
) -> list[TraceCreate]:
    """The traces of one OpenAI-compatible response (vLLM, SGLang, the OpenAI API: an `openai`
    package object, e.g. `ChatCompletion`, or its JSON dict), one per choice. Pass the
    request's parameters (`temperature`, `max_tokens`, `messages`, ...) as `request`: a
    response does not say whether it was greedy. With `vocabulary` (`Vocabulary(tokenizer)`
    of the checkpoint, built once), ids and a text-keyed top-k the response lacks are read from
    its text (docs/import.md). Raises FieldError naming what is missing (e.g. token ids
    without a vocabulary: ask vLLM for `return_token_ids`)."""
    body = response.model_dump() if hasattr(response, "model_dump") else response
    item = {"request": dict(request), "response": body} if request is not None else body
    return [build_trace(g, context, "openai", vocabulary) for g in parse_openai(item, "item")]


def from_sglang_response(
    response: Any,
    context: ImportContext,
    *,
    request: Mapping[str, Any] | None = None,
    vocabulary: Vocabulary | None = None,
) -> list[TraceCreate]:
    """The traces of one SGLang `/generate` answer (its JSON; a batch answer gives one per
    prompt). Pass the request (its `sampling_params` say whether decoding was greedy; its
    `text` is the prompt re-tokenised with `vocabulary` where the answer has no prompt ids)."""
    item = {"request": dict(request), "response": response} if request is not None else response
    return [build_trace(g, context, "sglang", vocabulary) for g in parse_sglang(item, "item")]
