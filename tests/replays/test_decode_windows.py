"""A decode run's job replays the traces of one logged batch together (one window, their decodes
sharing runs of that batch: `Engine.decode_batch`) and every other trace alone; what each stored
result says ran (`extras.decode_rows`) is what ran. Real torch on the committed model, through
the API and the job, on SQLite and PostgreSQL (the `db_url` fixture)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replay_audit.config import Settings
from replay_audit.engine import EnginePool
from replay_audit.engine.protocol import BatchLayout
from replay_audit.replays.tasks import _Pending, _windows
from replay_audit.worker import context
from tests.replays.conftest import HoldingRunner, all_results, ingest


def _pending(i: int, layout: BatchLayout | None) -> _Pending:
    from replay_audit.replays.domain import LoggedTrace

    trace = LoggedTrace.__new__(LoggedTrace)
    object.__setattr__(trace, "batch_layout", layout)
    return _Pending(i, None, trace, [0])


def _logged_batch(real_dir: Path, prompts: list[tuple[str, str]], tokens: int) -> list[Any]:
    """The traces of one batched BF16 `generate()` of `prompts` on the committed model."""
    from replay_audit.engine.generate import TraceGenerator

    with TraceGenerator(real_dir, dtype="bf16", device="cpu") as gen:
        return list(gen.trace_batch(list(prompts), max_new_tokens=tokens))


def test_decode_windows_keep_each_logged_batch_together() -> None:
    a, b = (3, 5, 4), (2, 2)
    layouts = [BatchLayout(a, 0), None, BatchLayout(b, 1), BatchLayout(a, 2), BatchLayout(a, 1)]
    layouts += [BatchLayout((7,), 0), BatchLayout(b, 0)]
    pending = [_pending(i, x) for i, x in enumerate(layouts)]
    # A decode job: each logged batch in one window, every other trace alone.
    assert [[p.trace_id for p in w] for w in _windows(pending, 1)] == [[0, 3, 4], [1], [2, 6], [5]]
    # A scan-then-decode job (windows of 16 otherwise): the others share windows of that size.
    more = [*pending, *[_pending(i, None) for i in range(7, 10)]]
    assert [[p.trace_id for p in w] for w in _windows(more, 2)] == [
        [0, 3, 4],
        [1],
        [2, 6],
        [5, 7],
        [8, 9],
    ]


@pytest.fixture
def real_worker(monkeypatch: pytest.MonkeyPatch, db_url: str, real_dir: Path) -> Iterator[None]:
    """Worker settings on the test database, finding the committed model, with torch engines."""
    monkeypatch.setenv("REPLAY_AUDIT_DATABASE_URL", db_url)
    monkeypatch.setenv("REPLAY_AUDIT_MODEL_DIRS", str(real_dir.parent))
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    context.install_worker_context(context.WorkerContext(settings, EnginePool(device="cpu")))
    yield
    context.install_worker_context(None)


def test_a_decode_run_replays_a_logged_batch_in_one_run_of_it(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    real_worker: None,
    real_dir: Path,
    real_prompts: list[tuple[str, str]],
) -> None:
    """20 rows of one batched generate() (more than a decode job's 16 traces) and a trace
    logged alone: the batch in one job and one run of it (with jobs of 16: two runs, of 16 and
    4 rows), the lone trace in a job of its own."""
    from replay_audit.engine.generate import TraceGenerator

    with TraceGenerator(real_dir, dtype="bf16", device="cpu") as gen:
        batch = gen.trace_batch(list(real_prompts[:20]), max_new_tokens=8)
        single = [gen.trace(real_prompts[20][1], max_new_tokens=8, external_id="alone")]
    h = headers("admin")
    ids = ingest(client, h, [*batch, *single])
    r = client.post(
        "/v1/replays", json={"trace_ids": ids, "compare_with": "self", "mode": "decode"}, headers=h
    )
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    assert runner.run_all() == 2
    results = all_results(client, run_id, h)
    assert len(results) == 21
    by_id: dict[str, dict[str, Any]] = {x["trace_id"]: x for x in results}
    for i in ids:
        x = by_id[i]
        assert x["status"] == "ok" and x["exact_match"] is True, x  # self-replay is exact
        extras = x["arms"]["b"]["environment"]["extras"]
        if i == ids[-1]:  # logged alone: decoded alone, and it says nothing of rows
            assert "decode_rows" not in extras
        else:  # the 20 rows of the logged batch: one run of it
            assert extras["decode_rows"] == 20


def test_a_scan_then_decode_job_decodes_a_logged_batch_in_one_run_of_it(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    real_worker: None,
    real_dir: Path,
    real_prompts: list[tuple[str, str]],
) -> None:
    """Scan-then-decode windows are 16 traces, but a logged batch's traces share one window:
    the control decodes of 32 rows of one batched generate() run as one run of that batch."""
    batch = _logged_batch(real_dir, real_prompts[:32], 8)
    h = headers("admin")
    ids = ingest(client, h, batch)
    body = {
        "trace_ids": ids,
        "compare_with": "self",
        "mode": "scan_then_decode",
        "control_fraction": 1.0,
    }
    r = client.post("/v1/replays", json=body, headers=h)
    assert r.status_code == 201, r.text
    assert runner.run_all() == 1  # 32 traces: one job
    results = all_results(client, r.json()["id"], h)
    from_prompt = [x for x in results if x["screen"] in ("control", "near_tie")]
    assert len(from_prompt) > 16, [x["screen"] for x in results]  # more than one window's worth
    for x in from_prompt:
        assert x["arms"]["b"]["environment"]["extras"]["decode_rows"] == len(from_prompt)


def test_jobs_hold_whole_logged_batches() -> None:
    """A run's jobs: traces logged alone in jobs of the mode's size; traces logged in batches of
    B rows in jobs of B (decode: a batch's rows decode in one run) or 8B (scan-then-decode: its
    few decodes from the prompt share a run); scan jobs as before."""
    from replay_audit.replays.domain import LoggedPlacement, RunTarget
    from replay_audit.replays.service import _chunks, job_traces

    assert job_traces("decode", 1) == 16 and job_traces("decode", 256) == 256
    assert job_traces("decode", 4) == 16  # never smaller than an unbatched job
    assert job_traces("scan_then_decode", 1) == 64
    assert job_traces("scan_then_decode", 256) == 2048
    assert job_traces("scan_then_decode", 256, "cpu") == 64  # a CPU's jobs stay small
    assert job_traces("decode", 256, "cpu") == 256  # one run of the batch, whatever the device
    assert job_traces("scan", 256) == job_traces("scan", 1) == 256
    ids = list(range(100))
    placements = {i: LoggedPlacement(batch_size=40 if i % 2 else 1) for i in ids}
    jobs = _chunks(placements, ids, [RunTarget(None)], "cpu", "decode")
    assert [len(t) for _, t in jobs] == [16, 16, 16, 2, 40, 10]
    assert jobs[4][1] == list(range(1, 80, 2))  # the batched traces, in order
    assert {q for q, _ in jobs} == {"cpu"}
    big = {i: LoggedPlacement(batch_size=32 if i % 2 else 1) for i in range(300)}
    gpu = _chunks(big, list(range(300)), [RunTarget(None)], "gpu", "scan_then_decode")
    assert [len(t) for _, t in gpu] == [64, 64, 22, 150]  # 8 x 32 = 256 a batched job
    assert {q for q, _ in gpu} == {"gpu"}
    cpu = _chunks(big, list(range(300)), [RunTarget(None)], "cpu", "scan_then_decode")
    assert [len(t) for _, t in cpu] == [64, 64, 64, 64, 44]  # one size: one group


def test_jobs_hold_unbatched_sizes_where_no_arm_decodes_the_logged_batch() -> None:
    """Without the reproduction check, a target of another batch size than the logged one
    decodes every row alone (batch 1 here): nothing shares a run of the logged batch, so its
    jobs are the unbatched size and more of them share the workers; a target of the logged
    batch's size, or the check, keeps the batched jobs."""
    from replay_audit.engine.protocol import Target
    from replay_audit.replays.domain import LoggedPlacement, RunTarget
    from replay_audit.replays.service import _chunks, job_traces, run_decodes_logged_batches

    assert job_traces("scan_then_decode", 1) == 64 and job_traces("decode", 1) == 16
    fp16 = RunTarget(Target("fp16"))  # batch 1, the schema's default
    assert not run_decodes_logged_batches([fp16], 32)
    assert run_decodes_logged_batches([fp16, RunTarget(None)], 32)  # the check
    assert run_decodes_logged_batches([RunTarget(Target("fp16", batch_size=32))], 32)
    big = {i: LoggedPlacement(batch_size=32 if i % 2 else 1) for i in range(300)}
    alone = _chunks(big, list(range(300)), [fp16], "gpu", "scan_then_decode")
    assert [len(t) for _, t in alone] == [64, 64, 64, 64, 44]  # one size: one group
    checked = _chunks(big, list(range(300)), [fp16, RunTarget(None)], "gpu", "scan_then_decode")
    assert [len(t) for _, t in checked] == [64, 64, 22, 150]
    decoded = _chunks(big, list(range(300)), [fp16], "gpu", "decode")
    assert {len(t) for _, t in decoded} == {16, 12}  # 300 = 18 x 16 + 12


def test_a_logged_batchs_window_writes_what_its_scans_settled_before_its_decodes(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    real_worker: None,
    real_dir: Path,
    real_prompts: list[tuple[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scan-then-decode window of one logged batch (32 rows, more than the 16 of a window of
    lone traces) with its reproduction check and an fp16 target: the traces whose comparisons
    the scans settled are written in one transaction before the window's decodes run, the
    decoded ones (a trace whose check is decoded waits with it) in the next, and each stored
    result is what a one-pass replay gives."""
    from replay_audit.replays import repository, tasks

    batch = _logged_batch(real_dir, real_prompts[:32], 16)
    h = headers("admin")
    ids = ingest(client, h, batch)
    writes: list[list[int]] = []
    insert = repository.insert_results_of

    def recording(s: Any, run_id: int, rows: Any) -> Any:
        writes.append([trace_id for trace_id, _ in rows])
        return insert(s, run_id, rows)

    monkeypatch.setattr(repository, "insert_results_of", recording)
    body = {
        "trace_ids": ids,
        "targets": [{"dtype": "fp16"}],
        "mode": "scan_then_decode",
        "control_fraction": 0.3,
        "flagged_fraction": 0.5,
    }
    r = client.post("/v1/replays", json=body, headers=h)
    assert r.status_code == 201, r.text
    assert runner.run_all() == 1
    assert [len(w) for w in writes][:1] != [0] and len(writes) == 2, writes
    assert sorted(writes[0] + writes[1]) == sorted(set(writes[0] + writes[1]))  # none twice
    results = all_results(client, r.json()["id"], h)
    assert len(results) == 64 and all(x["status"] == "ok" for x in results)
    settled = {"scanned", "flagged_scanned", "near_tie_scanned"}
    by_trace: dict[str, list[str]] = {}
    for x in results:
        by_trace.setdefault(x["trace_id"], []).append(x["screen"])
    first = {i for i, screens in by_trace.items() if all(s in settled for s in screens)}
    assert len(first) == len(writes[0]) and 0 < len(first) < 32, by_trace
    assert len(writes[1]) == 32 - len(first)
    # The same run in one pass (the window's decodes and its settled traces together).
    monkeypatch.setitem(tasks.RERUN_WINDOW, "scan_then_decode", 64)
    writes.clear()
    r = client.post("/v1/replays", json=body, headers=h)
    assert runner.run_all() == 1 and len(writes) == 1
    again = all_results(client, r.json()["id"], h)

    def key(x: dict[str, Any]) -> tuple[Any, ...]:
        return (x["trace_id"], x["comparison"], x["screen"], x["exact_match"])

    assert sorted(map(key, results)) == sorted(map(key, again))
    assert {key(x): x["first_divergence_step"] for x in results} == {
        key(x): x["first_divergence_step"] for x in again
    }


def test_a_logged_batchs_checks_decode_from_the_prompt_in_one_run_and_their_pairs_reuse_it(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    real_worker: None,
    real_dir: Path,
    real_prompts: list[tuple[str, str]],
    decodes_asked: list[tuple[str, Any]],
) -> None:
    """12 rows of one batched generate() whose logged outputs were changed at steps 2 to 6 (as
    a logging stack this one does not reproduce would leave them): each reproduction check's
    scan flags its trace at its change, and the check decodes from the prompt, so its t* is the
    change, all twelve in one run of the batch (from their flags they would be five runs, one a
    start). Each trace's fp16 comparison is then judged against the reproduced baseline, whose
    arm A from the prompt is the check's own decode: no logged-configuration decode runs
    twice."""
    batch = _logged_batch(real_dir, real_prompts[:12], 10)
    changed_at = [2 + k % 5 for k in range(len(batch))]
    for trace, at in zip(batch, changed_at, strict=True):
        ids = list(trace["output_token_ids"])
        ids[at] = (ids[at] + 1) % trace["model"]["vocab_size"]
        trace.update(output_token_ids=ids, top_k=None)
        trace.pop("output_token_pieces", None)
    h = headers("admin")
    ids = ingest(client, h, batch)
    body = {
        "trace_ids": ids,
        "targets": [{"dtype": "fp16"}],
        "mode": "scan_then_decode",
        "control_fraction": 1.0,
    }
    r = client.post("/v1/replays", json=body, headers=h)
    assert r.status_code == 201, r.text
    assert runner.run_all() == 1
    results = all_results(client, r.json()["id"], h)
    assert len(results) == 24 and all(x["status"] == "ok" for x in results), results
    check = {x["trace_id"]: x for x in results if x["comparison"] == 1}
    for i, at in zip(ids, changed_at, strict=True):
        x = check[i]
        assert x["screen"] == "flagged" and x["exact_match"] is False, x
        assert x["first_divergence_step"] == at  # the decode from the prompt leaves them there
        assert x["arms"]["b"]["environment"]["extras"]["decode_rows"] == len(ids)
    logged_config = [q for dtype, q in decodes_asked if dtype == "bf16"]
    assert len(logged_config) == len(ids)  # the checks' decodes, and no other
    assert all(not q.forced_prefix for q in logged_config)
    pairs = [x for x in results if x["comparison"] == 0]
    assert {x["baseline"] for x in pairs} == {"reproduced"}
    for x in pairs:  # arm A is the check's decode (its tokens, its run of the batch)
        assert (
            x["arms"]["a"]["output_token_ids"]
            == check[x["trace_id"]]["arms"]["b"]["output_token_ids"]
        )
