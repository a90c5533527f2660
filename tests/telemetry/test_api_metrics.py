"""/metrics, request ids, 5xx bodies and /readyz of the API on the embedded default: SQLite, the
in-process runner, the committed tiny-llama checkpoint (a real replay, on the CPU)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from replay_audit.api.app import create_app
from replay_audit.api.metrics import serve_metrics
from replay_audit.auth.service import create_api_key
from replay_audit.config import BUNDLED_MODEL_DIR, Settings
from replay_audit.db.unit_of_work import session_scope
from tests.conftest import empty_all_tables
from tests.telemetry.scrape import samples, value


@pytest.fixture
def sqlite_url(sqlite_database_url: str) -> Iterator[str]:
    yield sqlite_database_url
    empty_all_tables(sqlite_database_url)


def _settings(url: str, **overrides: Any) -> Settings:
    return Settings(_env_file=None, database_url=url, **overrides)  # type: ignore[call-arg]


def _key(url: str, project: str = "acme-secret-project") -> dict[str, str]:
    with session_scope(url) as s:
        return {"X-API-Key": create_api_key(s, project, "admin").key}


@pytest.fixture(scope="module")
def bundled_traces() -> list[dict[str, Any]]:
    """Two traces logged in BF16 by transformers' generate() on the committed checkpoint."""
    from replay_audit.engine.generate import generate_traces

    prompts = [("m0", "def add(a, b):\n    return "), ("m1", "import os\n")]
    return list(
        generate_traces(BUNDLED_MODEL_DIR, prompts, dtype="bf16", max_new_tokens=6, device="cpu")
    )


@pytest.mark.slow
def test_a_replay_on_the_embedded_default_moves_the_counters(
    sqlite_url: str, bundled_traces: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The in-process runner's job reads its settings from the environment, as in `serve`.
    monkeypatch.setenv("REPLAY_AUDIT_DATABASE_URL", sqlite_url)
    h = _key(sqlite_url)
    with TestClient(create_app(_settings(sqlite_url))) as client:
        before = samples(client.get("/metrics").text)
        r = client.post("/v1/traces:batch", json={"traces": bundled_traces}, headers=h)
        assert r.status_code == 207, r.text
        ids = [i["id"] for i in r.json()["results"]]
        r = client.post(
            "/v1/replays", json={"trace_ids": ids, "targets": [{"dtype": "fp16"}]}, headers=h
        )
        assert r.status_code == 201, r.text
        run_id = r.json()["id"]
        deadline = time.monotonic() + 120
        while (run := client.get(f"/v1/replays/{run_id}", headers=h).json())["status"] != "done":
            assert run["status"] in ("queued", "running"), run
            assert time.monotonic() < deadline, "the replay did not finish"
            time.sleep(0.2)
        text = client.get("/metrics").text
    after = samples(text)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # Requests, by route template (not the run's id) and status.
    assert moved("replay_audit_http_requests_total", route="/v1/traces:batch", status="207") == 1
    assert moved("replay_audit_http_requests_total", route="/v1/replays", status="201") == 1
    assert (
        moved("replay_audit_http_requests_total", route="/v1/replays/{run_id}", status="200") >= 1
    )
    assert run_id not in text
    # The latency histogram has its buckets, and its +Inf bucket counts every request.
    batch = {"method": "POST", "route": "/v1/traces:batch", "status": "207"}
    buckets = [
        (dict(ls)["le"], v)
        for (n, ls), v in after.items()
        if n == "replay_audit_http_request_duration_seconds_bucket" and set(batch.items()) <= ls
    ]
    assert len(buckets) > 5
    assert dict(buckets)["+Inf"] == value(
        after, "replay_audit_http_request_duration_seconds_count", **batch
    )
    # What was stored, and the replay job the in-process runner ran.
    assert moved("replay_audit_traces_ingested_total", outcome="created") == 2
    assert moved("replay_audit_trace_batch_items_total", status="201") == 2
    assert moved("replay_audit_jobs_started_total", kind="replay", gpu_kind="cpu") == 1
    assert moved("replay_audit_jobs_finished_total", kind="replay", gpu_kind="cpu") == 1
    assert moved("replay_audit_jobs_failed_total", kind="replay") == 0
    assert moved("replay_audit_job_duration_seconds_count", kind="replay", gpu_kind="cpu") == 1
    assert value(after, "replay_audit_job_duration_seconds_bucket", kind="replay", le="+Inf") >= 1
    # Two traces decoded in FP16 and in their logged configuration (the reproduction check).
    assert moved("replay_audit_replay_traces_total", stage="decoded", gpu_kind="cpu") == 4
    assert moved("replay_audit_replay_tokens_total", stage="decoded", gpu_kind="cpu") > 0
    # Ids only: nothing names the project, or carries a key or a trace's text.
    assert "acme-secret-project" not in text
    assert h["X-API-Key"] not in text
    assert "def add" not in text


def test_auth_failures_are_counted_by_reason(client: TestClient, headers: Any) -> None:
    before = samples(client.get("/metrics").text)
    assert client.get("/v1/traces").status_code == 401
    assert client.get("/v1/traces", headers={"X-API-Key": "ra_nope"}).status_code == 401
    assert client.post("/v1/traces", json={}, headers=headers("auditor")).status_code == 403
    after = samples(client.get("/metrics").text)
    for reason in ("missing", "invalid", "forbidden"):
        moved = value(after, "replay_audit_auth_failures_total", reason=reason)
        assert moved - value(before, "replay_audit_auth_failures_total", reason=reason) == 1


def test_metrics_need_no_key_and_can_be_turned_off_or_moved(
    make_client: Any, client: TestClient
) -> None:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "replay_audit_http_requests_total" in r.text
    assert make_client(metrics_enabled=False).get("/metrics").status_code == 404
    # Served on its own port by `serve` instead: not on the API's.
    assert make_client(api_metrics_port=9109).get("/metrics").status_code == 404


def test_the_request_id_is_answered_and_a_sane_incoming_one_kept(client: TestClient) -> None:
    mine = client.get("/healthz", headers={"X-Request-ID": "abc-123.x:y"})
    assert mine.headers["X-Request-ID"] == "abc-123.x:y"
    for insane in ("has space", "x" * 200, "<script>"):
        r = client.get("/healthz", headers={"X-Request-ID": insane})
        assert r.headers["X-Request-ID"] != insane
        assert len(r.headers["X-Request-ID"]) == 32
    a, b = client.get("/healthz"), client.get("/healthz")
    assert a.headers["X-Request-ID"] != b.headers["X-Request-ID"]


def test_every_5xx_body_names_the_request(settings: Settings) -> None:
    app = create_app(settings)

    def boom() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/v1/boom", boom)
    with TestClient(app, raise_server_exceptions=False) as client:
        before = samples(client.get("/metrics").text)
        r = client.get("/v1/boom", headers={"X-Request-ID": "req-500"})
        assert r.status_code == 500
        assert r.json() == {
            "error": "InternalError",
            "detail": "internal server error",
            "request_id": "req-500",
        }
        assert r.headers["X-Request-ID"] == "req-500"
        samples_now = samples(client.get("/metrics").text)
    boom = {"route": "/v1/boom", "status": "500"}
    assert (
        value(samples_now, "replay_audit_http_requests_total", **boom)
        - value(before, "replay_audit_http_requests_total", **boom)
        == 1
    )


def test_readyz_reports_each_component(make_client: Any) -> None:
    ok = make_client().get("/readyz")
    assert ok.status_code == 200
    assert ok.json() == {"status": "ok", "database": "ok", "queue": "ok", "workers": {"cpu": 1}}

    down = make_client(database_url="postgresql+psycopg://nobody@127.0.0.1:1/none")
    r = down.get("/readyz", headers={"X-Request-ID": "req-503"})
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "unavailable" and body["database"] == "OperationalError"
    assert body["queue"] == "ok" and body["request_id"] == "req-503"

    no_redis = make_client(runner="rq", redis_url="redis://127.0.0.1:1/0")
    r = no_redis.get("/readyz")
    assert r.status_code == 503 and r.json()["database"] == "ok"
    assert "unreachable" in r.json()["queue"] and r.json()["workers"] == {}
    # /healthz stays liveness of the process and its database and queue, as before.
    assert make_client().get("/healthz").json() == {
        "status": "ok",
        "database": "ok",
        "queue": "ok",
        # The in-process runner: this process, one device, its host's kind.
        "worker_kinds": [{"kind": "cpu", "gpu": None, "sm": None, "devices": 1, "workers": 1}],
    }


def test_serve_can_answer_metrics_on_an_internal_port_instead(settings: Settings) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    assert serve_metrics(settings) is None  # not asked for: /metrics is on the API's port
    stop = serve_metrics(settings.model_copy(update={"api_metrics_port": port}))
    assert stop is not None
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        stop()
    assert "replay_audit_http_requests_total" in text
    assert "replay_audit_audit_last_run_timestamp_seconds" in text  # read from the database


def test_a_5xx_page_of_the_ui_names_the_request(settings: Settings) -> None:
    from starlette.routing import Mount

    app = create_app(settings)
    [ui] = [r.app for r in app.routes if isinstance(r, Mount) and r.path == "/ui"]

    def boom() -> None:
        raise RuntimeError("a bug")

    ui.add_api_route("/boom", boom)  # type: ignore[attr-defined]
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/ui/boom", headers={"X-Request-ID": "ui-req-500"})
        assert r.status_code == 500
        assert 'id="error-request-id"' in r.text and "ui-req-500" in r.text
        assert "a bug" not in r.text
        # A 4xx page does not need it.
        missing = client.get("/ui/nothing-here")
        assert missing.status_code == 404 and 'id="error-message"' in missing.text
        assert "error-request-id" not in missing.text


def test_a_metrics_token_guards_the_apis_metrics(sqlite_url: str) -> None:
    """With REPLAY_AUDIT_METRICS_TOKEN set, /metrics answers a scrape with that bearer token
    and a 401 saying what it needs to any other (none, another token, another scheme, an API
    key); unset, it answers anyone, as before."""
    token = "s3cret-metrics-token"
    with TestClient(create_app(_settings(sqlite_url, metrics_token=token))) as client:
        ok = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and "replay_audit_" in ok.text
        assert (
            client.head("/metrics", headers={"Authorization": f"bearer {token}"}).status_code == 200
        )
        for headers in (
            {},
            {"Authorization": "Bearer not-it"},
            {"Authorization": f"Basic {token}"},
            {"Authorization": f"Bearer {token}x"},
            _key(sqlite_url),
        ):
            r = client.get("/metrics", headers=headers)
            assert r.status_code == 401, headers
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
            assert "REPLAY_AUDIT_METRICS_TOKEN" in r.json()["detail"] and token not in r.text
    with TestClient(create_app(_settings(sqlite_url))) as client:
        assert client.get("/metrics").status_code == 200
