"""Bad keys, project isolation, key storage and the keys API, over HTTP (roles x routes:
test_route_matrix.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from replay_audit.auth.models import ApiKey
from replay_audit.auth.service import PrincipalCache, revoke_api_key
from replay_audit.db.unit_of_work import session_scope
from tests.factories import make_trace

Headers = Callable[..., dict[str, str]]
ApiKeyFactory = Callable[..., str]

#: Endpoints tried with malformed and unknown keys. Every route x every role, no key and another
#: project's key is in test_route_matrix.py (generated from the app's routes).
ENDPOINTS = [
    "POST /v1/traces",
    "POST /v1/traces:batch",
    "GET /v1/traces/{trace_id}",
    "GET /v1/traces",
    "POST /v1/keys",
    "GET /v1/keys",
    "DELETE /v1/keys/{key_id}",
]


def _call(client: TestClient, endpoint: str, h: dict[str, str], ids: dict[str, str]) -> Any:
    method, path = endpoint.split(" ")
    path = path.format(**ids)
    bodies: dict[str, Any] = {
        "POST /v1/traces": make_trace(),
        "POST /v1/traces:batch": {"traces": [make_trace()]},
        "POST /v1/keys": {"role": "auditor", "name": "ci"},
    }
    return client.request(method, path, json=bodies.get(endpoint), headers=h)


@pytest.fixture
def existing_ids(client: TestClient, headers: Headers) -> dict[str, str]:
    admin = headers("admin")
    trace_id = client.post("/v1/traces", json=make_trace(), headers=admin).json()["id"]
    key_id = client.post("/v1/keys", json={"role": "submitter"}, headers=admin).json()["id"]
    return {"trace_id": trace_id, "key_id": key_id}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize(
    "key", [None, "", "ra_000000000000_wrong", "not-a-key", "ra_short_x"], ids=repr
)
def test_missing_or_unknown_key_is_401(
    client: TestClient, existing_ids: dict[str, str], endpoint: str, key: str | None
) -> None:
    h = {} if key is None else {"X-API-Key": key}
    answer = _call(client, endpoint, h, existing_ids)
    assert answer.status_code == 401
    assert answer.json()["error"] == "NotAuthenticated"


def test_right_lookup_wrong_secret_is_401(client: TestClient, api_key: ApiKeyFactory) -> None:
    key = api_key("admin")
    forged = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    assert client.get("/v1/traces", headers={"X-API-Key": forged}).status_code == 401
    assert client.get("/v1/traces", headers={"X-API-Key": key}).status_code == 200


def test_another_projects_trace_is_404(client: TestClient, headers: Headers) -> None:
    trace_id = client.post(
        "/v1/traces", json=make_trace(), headers=headers("submitter", "alpha")
    ).json()["id"]
    own = client.get(f"/v1/traces/{trace_id}", headers=headers("auditor", "alpha"))
    assert own.status_code == 200
    other = client.get(f"/v1/traces/{trace_id}", headers=headers("admin", "beta"))
    assert other.status_code == 404 and other.json()["error"] == "NotFound"
    # ...exactly what an id that does not exist gets: nothing leaks.
    unknown = "tr_01ARZ3NDEKTSV4RRFFQ69G5FAV"
    absent = client.get(f"/v1/traces/{unknown}", headers=headers("admin", "beta"))
    assert absent.status_code == 404


def test_another_projects_key_cannot_be_revoked(client: TestClient, headers: Headers) -> None:
    made = client.post("/v1/keys", json={"role": "auditor"}, headers=headers("admin", "a"))
    key_id = made.json()["id"]
    answer = client.delete(f"/v1/keys/{key_id}", headers=headers("admin", "b"))
    assert answer.status_code == 404


def test_keys_are_stored_hashed(client: TestClient, api_key: ApiKeyFactory, db_url: str) -> None:
    key = api_key("auditor", "hashing")
    with session_scope(db_url) as session:
        rows = session.execute(select(ApiKey)).scalars().all()
        stored = [(r.lookup, r.key_sha256) for r in rows]
    assert len(stored) == 1
    lookup, digest = stored[0]
    assert key.startswith(f"ra_{lookup}_") and digest == hashlib.sha256(key.encode()).hexdigest()
    secret = key.split("_", 2)[2]
    assert all(secret not in field for field in stored[0])


def test_keys_api_create_list_revoke(client: TestClient, headers: Headers) -> None:
    admin = headers("admin", "keys")
    created = client.post("/v1/keys", json={"role": "submitter", "name": "ingest"}, headers=admin)
    assert created.status_code == 201
    new = created.json()
    assert new["role"] == "submitter" and new["project"] == "keys" and new["key"].startswith("ra_")
    new_headers = {"X-API-Key": new["key"]}
    assert client.post("/v1/traces", json=make_trace(), headers=new_headers).status_code == 201

    listed = client.get("/v1/keys", headers=admin).json()["items"]
    assert new["id"] in [k["id"] for k in listed]
    assert all("key" not in k for k in listed)

    revoked = client.delete(f"/v1/keys/{new['id']}", headers=admin)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert client.post("/v1/traces", json=make_trace(), headers=new_headers).status_code == 401
    # Revoking again is a no-op.
    assert client.delete(f"/v1/keys/{new['id']}", headers=admin).status_code == 200


def test_keys_api_rejects_unknown_role(client: TestClient, headers: Headers) -> None:
    answer = client.post("/v1/keys", json={"role": "root"}, headers=headers("admin"))
    assert answer.status_code == 422 and answer.json()["field"] == "role"


@pytest.mark.parametrize("cache_s", [5.0, 0.0])
def test_a_key_revoked_by_another_process_is_refused_within_the_cache_lifetime(
    make_client: Callable[..., TestClient], api_key: ApiKeyFactory, db_url: str, cache_s: float
) -> None:
    """An API process remembers a key that passed for `api_key_cache_s` seconds (no query for
    it meanwhile): a revocation made elsewhere (another API process, the CLI) is honoured once
    that has passed; with 0 at once. The process that revokes forgets the key at once
    (`test_keys_api_create_list_revoke`)."""
    client = make_client(api_key_cache_s=cache_s)
    now = [1000.0]
    client.app.state.principals = PrincipalCache(cache_s, clock=lambda: now[0])  # type: ignore[attr-defined]
    key = api_key("submitter")
    h = {"X-API-Key": key}
    assert client.post("/v1/traces", json=make_trace(), headers=h).status_code == 201
    with session_scope(db_url) as session:
        lookup = key.split("_")[1]
        project_id = session.execute(select(ApiKey.project_id)).scalar_one()
        revoke_api_key(session, project_id, f"key_{lookup}")  # not through this app

    now[0] += cache_s - 0.1
    within = client.post("/v1/traces", json=make_trace(), headers=h).status_code
    assert within == (201 if cache_s else 401)
    now[0] += 0.2
    assert client.post("/v1/traces", json=make_trace(), headers=h).status_code == 401


def test_only_keys_that_pass_are_remembered(client: TestClient, api_key: ApiKeyFactory) -> None:
    key = api_key("submitter")
    wrong = key[:-4] + ("aaaa" if not key.endswith("aaaa") else "bbbb")
    cache: PrincipalCache = client.app.state.principals  # type: ignore[attr-defined]
    assert (
        client.post("/v1/traces", json=make_trace(), headers={"X-API-Key": wrong}).status_code
        == 401
    )
    assert cache_size(cache) == 0
    assert (
        client.post("/v1/traces", json=make_trace(), headers={"X-API-Key": key}).status_code == 201
    )
    assert cache_size(cache) == 1
    # The key itself is not what the cache holds: its sha256 is.
    assert key not in repr(vars(cache))


def cache_size(cache: PrincipalCache) -> int:
    return len(vars(cache)["_entries"])
