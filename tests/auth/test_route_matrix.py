"""Every route of the app x every caller: admin, auditor, submitter, no key, another project.

The routes are read from the app (`create_app(...).routes`, the `/ui` mount included, down to
its static files); `ROUTES` states the outcome class each caller gets on each of them, and
`test_every_route_has_a_row` fails when the app has a route the table does not list (or the
table lists one the app no longer has): a new route cannot ship without its row.

Every request is real, through the TestClient, with real path parameters: a trace, a replay run
replayed to the end (with results, so the trace page exists), an audit schedule with a run and a
webhook alert, an API key. API callers send `X-API-Key`; UI callers carry the session cookie a
real sign-in gave them (a submitter cannot sign in, so it carries a validly signed cookie naming
its key: the UI must still refuse it on every page). "Another project" is an admin of project
`beta`: the most a key of another project could do.

Outcome classes:
    OK        allowed: a 2xx, or a redirect that is not to the sign-in page
    PUBLIC    allowed without any key (health, the OpenAPI document, the sign-in page, ...)
    DENIED    403 (`PermissionDenied` on the API, the 403 page in the UI)
    ANON      401 on the API (`NotAuthenticated`); in the UI, a redirect to the sign-in page (or
              the sign-in form answered 401)
    NOT_FOUND 404: another project's object answers exactly like one that does not exist
    UNKNOWN   422 naming the field: the request names ids (traces) this project does not have

An allowed answer to another project's key, to a submitter or to no key must not contain any
id of the project's objects (a submitter reads no traces, results or trace lists).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any, Final

import pytest
from fastapi import FastAPI
from fastapi import routing as fastapi_routing
from fastapi.testclient import TestClient
from httpx import Response
from sqlalchemy import select
from starlette.routing import BaseRoute, Mount
from starlette.staticfiles import StaticFiles

from replay_audit.api.app import create_app
from replay_audit.audits.models import AuditAlert, AuditRun, AuditSchedule
from replay_audit.config import BUNDLED_MODEL_DIR, Settings
from replay_audit.db.unit_of_work import session_scope
from replay_audit.engine.hashing import weights_sha256
from replay_audit.ui import session as ui_session
from tests.audits.conftest import schedule_body
from tests.factories import make_trace
from tests.imports.conftest import load_fixture
from tests.reports.conftest import (  # noqa: F401  (fixtures)
    HoldingRunner,
    fake_model_dir,
    logged_trace,
    runner,
    worker_env,
)
from tests.ui.conftest import SESSION_SECRET, form_token
from tests.ui.conftest import settings as settings  # fixture: the session secret

OK: Final = "allowed"
PUBLIC: Final = "public"
DENIED: Final = "403"
ANON: Final = "401"
NOT_FOUND: Final = "404"
UNKNOWN: Final = "422"

CALLERS: Final = ("admin", "auditor", "submitter", "none", "other")
#: The order callers are tried in on one route: whoever may change or delete the object (an
#: admin of its project) comes last, so the others all meet it as the fixture left it.
ORDER: Final = ("none", "submitter", "auditor", "other", "admin")

Row = tuple[str, str, str, str, str]
_ALL_PUBLIC: Final[Row] = (PUBLIC, PUBLIC, PUBLIC, PUBLIC, PUBLIC)
_READ: Final[Row] = (OK, OK, DENIED, ANON, NOT_FOUND)  # auditors read their project's objects
_READ_LIST: Final[Row] = (OK, OK, DENIED, ANON, OK)  # another project lists its own (none)
_ADMIN: Final[Row] = (OK, DENIED, DENIED, ANON, NOT_FOUND)
_UI_PAGE: Final[Row] = (OK, OK, DENIED, ANON, NOT_FOUND)
_UI_LIST: Final[Row] = (OK, OK, DENIED, ANON, OK)

#: method + path -> the outcome for (admin, auditor, submitter, no key, another project's admin).
ROUTES: Final[dict[str, Row]] = {
    # Public: no key needed, nothing of any project in them.
    "GET /": _ALL_PUBLIC,  # a redirect to /ui/
    "GET /healthz": _ALL_PUBLIC,
    "HEAD /healthz": _ALL_PUBLIC,
    "GET /readyz": _ALL_PUBLIC,
    "HEAD /readyz": _ALL_PUBLIC,
    "GET /metrics": _ALL_PUBLIC,
    "HEAD /metrics": _ALL_PUBLIC,
    "GET /openapi.json": _ALL_PUBLIC,
    "HEAD /openapi.json": _ALL_PUBLIC,
    "GET /docs": _ALL_PUBLIC,
    "HEAD /docs": _ALL_PUBLIC,
    "GET /docs/assets/{path}": _ALL_PUBLIC,  # Swagger UI and ReDoc, served locally
    "HEAD /docs/assets/{path}": _ALL_PUBLIC,
    "GET /redoc": _ALL_PUBLIC,
    "HEAD /redoc": _ALL_PUBLIC,
    # Traces: submitters write, auditors read.
    "POST /v1/traces": (OK, DENIED, OK, ANON, OK),
    "POST /v1/traces:batch": (OK, DENIED, OK, ANON, OK),
    "POST /v1/traces:import": (OK, DENIED, OK, ANON, OK),
    "GET /v1/traces": _READ_LIST,
    "GET /v1/traces/{trace_id}": _READ,
    # Replays: submitters start runs and poll their status (the status view), nothing more.
    "POST /v1/replays": (OK, DENIED, OK, ANON, UNKNOWN),
    "GET /v1/replays": _READ_LIST,
    "GET /v1/replays/{run_id}": (OK, OK, OK, ANON, NOT_FOUND),
    "GET /v1/replays/{run_id}/results": _READ,
    "GET /v1/replays/{run_id}/report": _READ,
    "GET /v1/replays/{run_id}/export": _READ,
    # Screenings: submitters start them, auditors read them.
    "POST /v1/screenings": (OK, DENIED, OK, ANON, OK),
    "GET /v1/screenings/{screening_id}": _READ,
    # Verifications: as screenings (another project's filter matches none of its traces).
    "POST /v1/verifications": (OK, DENIED, OK, ANON, UNKNOWN),
    "GET /v1/verifications/{verification_id}": _READ,
    # Keys: admins of the project.
    "POST /v1/keys": (OK, DENIED, DENIED, ANON, OK),
    "GET /v1/keys": (OK, DENIED, DENIED, ANON, OK),
    "DELETE /v1/keys/{key_id}": _ADMIN,
    # Audit schedules: admins change, auditors read.
    "POST /v1/audits/schedules": (OK, DENIED, DENIED, ANON, OK),
    "GET /v1/audits/schedules": _READ_LIST,
    "GET /v1/audits/schedules/{schedule_id}": _READ,
    "PATCH /v1/audits/schedules/{schedule_id}": _ADMIN,
    "DELETE /v1/audits/schedules/{schedule_id}": _ADMIN,
    "POST /v1/audits/schedules/{schedule_id}/runs": _ADMIN,
    "GET /v1/audits/schedules/{schedule_id}/runs": _READ,
    "GET /v1/audits/schedules/{schedule_id}/trend": _READ,
    "GET /v1/audits/schedules/{schedule_id}/missed": _READ,
    "POST /v1/audits/schedules/{schedule_id}/catch-up": _ADMIN,
    "GET /v1/audits/schedules/{schedule_id}/alerts": _READ,
    # The web UI: auditors and admins, through a signed-in session.
    "GET /ui/": _ALL_PUBLIC,  # a redirect to /ui/runs
    "GET /ui/sign-in": _ALL_PUBLIC,
    "HEAD /ui/sign-in": _ALL_PUBLIC,
    "POST /ui/sign-in": (OK, OK, DENIED, ANON, OK),
    "POST /ui/sign-out": _ALL_PUBLIC,
    "GET /ui/runs": _UI_LIST,
    "GET /ui/runs/{run_id}": _UI_PAGE,
    "GET /ui/runs/{run_id}/accuracy": _UI_PAGE,
    "GET /ui/runs/{run_id}/flips": _UI_PAGE,
    "GET /ui/runs/{run_id}/export.{fmt}": _UI_PAGE,
    "GET /ui/runs/{run_id}/traces/{trace_id}": _UI_PAGE,
    "GET /ui/compare": _UI_PAGE,
    "GET /ui/traces": _UI_LIST,
    "GET /ui/traces/{trace_id}": _UI_PAGE,
    "GET /ui/screenings/{screening_id}": _UI_PAGE,
    "GET /ui/verifications/{verification_id}": _UI_PAGE,
    "GET /ui/schedules": _UI_LIST,
    "GET /ui/schedules/{schedule_id}": _UI_PAGE,
    "GET /ui/static/{path}": _ALL_PUBLIC,
    "HEAD /ui/static/{path}": _ALL_PUBLIC,
}

#: Path parameters of routes that need other values than `World.ids` (a file that exists).
PATHS: Final[dict[str, dict[str, str]]] = {
    "GET /docs/assets/{path}": {"path": "swagger-init.js"},
    "HEAD /docs/assets/{path}": {"path": "swagger-ui.css"},
}

#: Query strings some routes need to do their work.
QUERIES: Final[dict[str, Callable[[dict[str, str]], dict[str, Any]]]] = {
    "GET /ui/compare": lambda ids: {"run": [ids["run_id"], ids["run_id"]], "cb": 1},
    "GET /ui/runs/{run_id}/flips": lambda ids: {"a": 0, "b": 1},
    "GET /v1/replays/{run_id}/export": lambda ids: {"format": "jsonl"},
    "POST /v1/traces:import": lambda ids: {"format": "sglang"},
}


def _iter_routes(routes: list[BaseRoute], prefix: str = "") -> Iterator[str]:
    """ "METHOD /path" of every route, recursing into mounts (a static files mount is one
    `{path}` route). FastAPI >= 0.160 wraps included routers; `iter_route_contexts` unwraps
    them (older releases list the routes themselves)."""
    unwrap = getattr(fastapi_routing, "iter_route_contexts", None)
    for context in unwrap(routes) if unwrap is not None else routes:
        route = getattr(context, "original_route", context)
        if isinstance(route, Mount):
            if isinstance(route.app, StaticFiles):
                yield from (f"{m} {prefix}{route.path}/{{path}}" for m in ("GET", "HEAD"))
            else:
                yield from _iter_routes(route.routes, prefix + route.path)
            continue
        for method in sorted(getattr(context, "methods", None) or ()):
            yield f"{method} {prefix}{context.path}"


def app_routes(app: FastAPI) -> set[str]:
    return set(_iter_routes(app.routes))


def test_every_route_has_a_row(settings: Settings) -> None:
    routes = app_routes(create_app(settings))
    assert routes - set(ROUTES) == set(), "routes without a row in ROUTES: add them"
    assert set(ROUTES) - routes == set(), "rows of ROUTES that name no route: remove them"


# -- the project's objects and the callers -----------------------------------------------------


@dataclasses.dataclass
class Caller:
    name: str
    key: str | None
    #: The UI session cookie (None: not signed in).
    cookie: str | None


@dataclasses.dataclass
class World:
    ids: dict[str, str]
    callers: dict[str, Caller]
    #: Ids that must not appear in what a submitter, no key or another project reads.
    secrets: list[str]


def _sign_in(client: TestClient, key: str) -> str | None:
    client.cookies.clear()
    page = client.get("/ui/sign-in")
    r = client.post(
        "/ui/sign-in",
        data={"api_key": key, "form_token": form_token(page.text), "next": ""},
        follow_redirects=False,
    )
    cookie = r.cookies.get(ui_session.COOKIE_NAME) if r.status_code == 303 else None
    client.cookies.clear()
    return cookie


@pytest.fixture
def world(
    client: TestClient,
    runner: HoldingRunner,  # noqa: F811
    api_key: Callable[..., str],
    logged_trace: Callable[..., dict[str, Any]],  # noqa: F811
    worker_env: Any,  # noqa: F811
    db_url: str,
) -> World:
    keys = {
        "admin": api_key("admin"),
        "auditor": api_key("auditor"),
        "submitter": api_key("submitter"),
        "other": api_key("admin", "beta"),
    }
    admin = {"X-API-Key": keys["admin"]}
    trace = logged_trace([1, 5, 3]) | {"external_id": "matrix-ext-1"}
    r = client.post("/v1/traces", json=trace, headers=admin)
    assert r.status_code == 201, r.text
    trace_id = r.json()["id"]
    targets = [{"dtype": "fp16"}, {"dtype": "fp16", "intervention": {"kind": "C"}}]
    body = {"trace_ids": [trace_id], "targets": targets}
    r = client.post("/v1/replays", json=body, headers=admin)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    runner.run_all()
    r = client.post(
        "/v1/audits/schedules",
        json=schedule_body(webhook_url="https://hooks.example.com/matrix"),
        headers=admin,
    )
    assert r.status_code == 201, r.text
    schedule_id = r.json()["id"]
    key_id = client.post("/v1/keys", json={"role": "submitter"}, headers=admin).json()["id"]
    # A screening, left queued (its page shows its status).
    r = client.post("/v1/screenings", json=_screening_body(), headers=admin)
    assert r.status_code == 201, r.text
    screening_id = r.json()["id"]
    # A verification of the project's traces, left queued.
    r = client.post("/v1/verifications", json={"filter": {}}, headers=admin)
    assert r.status_code == 201, r.text
    verification_id = r.json()["id"]
    now = datetime(2026, 1, 2, 2, tzinfo=UTC)
    with session_scope(db_url) as s:
        schedule = s.scalar(select(AuditSchedule).where(AuditSchedule.public_id == schedule_id))
        assert schedule is not None
        audit_run = AuditRun(
            public_id="ar_matrix",
            schedule_id=schedule.id,
            due_at=now,
            trigger="scheduled",
            status="done",
            window_start=now,
            window_end=now,
            metrics={"ear": 0.5},
            flags=[{"kind": "ear_drop", "comparison": 0, "message": "EAR fell 50 points"}],
        )
        s.add(audit_run)
        s.flush()
        s.add(
            AuditAlert(
                public_id="al_matrix",
                audit_run_id=audit_run.id,
                url="https://hooks.example.com/matrix",
                payload={},
                status="failed",
                attempts=1,
                attempt_log=[],
            )
        )
    callers = {"none": Caller("none", None, None)}
    for name, key in keys.items():
        cookie = _sign_in(client, key)
        if name == "submitter":
            # A submitter cannot sign in; give it a validly signed session naming its key.
            assert cookie is None
            lookup = key.split("_")[1]
            cookie = ui_session.issue(SESSION_SECRET.encode(), lookup, 3600)
        assert cookie is not None, name
        callers[name] = Caller(name, key, cookie)
    ids = {
        "trace_id": trace_id,
        "run_id": run_id,
        "schedule_id": schedule_id,
        "key_id": key_id,
        "screening_id": screening_id,
        "verification_id": verification_id,
        "fmt": "csv",
        "path": "ui.css",
    }
    secrets = [
        trace_id,
        run_id,
        schedule_id,
        key_id,
        screening_id,
        verification_id,
        "ar_matrix",
        "al_matrix",
        "matrix-ext-1",
    ]
    return World(ids=ids, callers=callers, secrets=secrets)


def _screening_body() -> dict[str, Any]:
    """A screening of the bundled checkpoint: the API must find it to bound the work."""
    sha = weights_sha256(BUNDLED_MODEL_DIR)
    return {"model_sha256": sha, "prompts": [{"prompt_token_ids": [1, 2, 3]}]}


# -- one request ---------------------------------------------------------------------------------


def _body(route: str, ids: dict[str, str], caller: Caller) -> dict[str, Any]:
    """Keyword arguments of the request (json / data) that make `route` do its work."""
    match route:
        case "POST /v1/traces":
            return {"json": make_trace()}
        case "POST /v1/traces:batch":
            return {"json": {"traces": [make_trace()]}}
        case "POST /v1/traces:import":
            # One SGLang /generate answer, imported into the caller's project.
            context = {
                "model": {"name": "m", "weights_sha256": "b" * 64, "vocab_size": 32000},
                "dtype": "bf16",
                "engine": {"name": "sglang"},
            }
            return {"json": {"context": context, "items": [load_fixture("sglang_generate.json")]}}
        case "POST /v1/replays":
            return {"json": {"trace_ids": [ids["trace_id"]], "targets": [{"dtype": "fp16"}]}}
        case "POST /v1/screenings":
            return {"json": _screening_body()}
        case "POST /v1/verifications":
            return {"json": {"filter": {}}}
        case "POST /v1/keys":
            return {"json": {"role": "auditor", "name": "matrix"}}
        case "POST /v1/audits/schedules":
            return {"json": schedule_body(name=f"matrix {caller.name}")}
        case "PATCH /v1/audits/schedules/{schedule_id}":
            return {"json": {"sample_size": 9}}
        case "POST /v1/audits/schedules/{schedule_id}/catch-up":
            return {"json": {"limit": 1}}
        case "POST /ui/sign-in":
            return {"data": {"api_key": caller.key or ""}}
        case "POST /ui/sign-out":
            s = ui_session.verify(SESSION_SECRET.encode(), caller.cookie)
            token = s.csrf_token(SESSION_SECRET.encode()) if s is not None else ""
            return {"data": {"csrf_token": token}}
    return {}


def request(client: TestClient, route: str, world: World, caller: Caller) -> Response:
    method, path = route.split(" ", 1)
    url = path.format(**(world.ids | PATHS.get(route, {})))
    params = QUERIES[route](world.ids) if route in QUERIES else None
    kwargs = _body(route, world.ids, caller)
    client.cookies.clear()
    if route == "POST /ui/sign-in":  # the form's double-submit token, as a browser has it
        kwargs["data"]["form_token"] = form_token(client.get("/ui/sign-in").text)
    headers: dict[str, str] = {}
    if path.startswith("/ui"):
        if caller.cookie is not None and route != "POST /ui/sign-in":
            client.cookies.set(ui_session.COOKIE_NAME, caller.cookie)
    elif caller.key is not None:
        headers["X-API-Key"] = caller.key
    try:
        return client.request(
            method, url, params=params, headers=headers, follow_redirects=False, **kwargs
        )
    finally:
        client.cookies.clear()


def outcome(route: str, r: Response) -> str:
    """The outcome class of an answer (see the module docstring)."""
    ui = route.split(" ", 1)[1].startswith("/ui")
    location = r.headers.get("location", "")
    if r.status_code in (302, 303, 307) and "/sign-in" in location and route != "POST /ui/sign-out":
        return ANON
    if r.status_code < 400:
        return OK
    if r.status_code == 401:
        assert ui or r.json()["error"] == "NotAuthenticated", r.text
        return ANON
    if r.status_code == 403:
        assert ui or r.json()["error"] == "PermissionDenied", r.text
        return DENIED
    if r.status_code == 404:
        assert ui or r.json()["error"] == "NotFound", r.text
        return NOT_FOUND
    if r.status_code == 422 and not ui:
        return UNKNOWN
    return f"unexpected {r.status_code}"


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_route_matrix(client: TestClient, world: World, route: str) -> None:
    expected = dict(zip(CALLERS, ROUTES[route], strict=True))
    for name in ORDER:
        caller = world.callers[name]
        r = request(client, route, world, caller)
        want = OK if expected[name] == PUBLIC else expected[name]
        got = outcome(route, r)
        assert got == want, f"{route} as {name}: {r.status_code} {r.text[:300]}"
        if got == UNKNOWN:  # another project's ids are unknown to it; its filter matches none
            field = "filter" if route == "POST /v1/verifications" else "trace_ids"
            assert r.json()["field"] == field, r.text
        if got == OK and name in ("submitter", "none", "other"):
            # An allowed answer to these callers reveals none of the project's objects.
            body = r.text if not route.startswith("HEAD") else ""
            leaked = [s for s in world.secrets if s in body]
            if route == "POST /v1/replays" or route == "GET /v1/replays/{run_id}":
                leaked = [s for s in leaked if s != world.ids["run_id"]]  # its own run's id
            if route == "GET /metrics":
                # By design: the last-run gauge names each audit schedule by its id (never its
                # name or project); docs/operations.md says to bind /metrics internally.
                leaked = [s for s in leaked if s != world.ids["schedule_id"]]
            assert leaked == [], f"{route} as {name} shows {leaked}"
