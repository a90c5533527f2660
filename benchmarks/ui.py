"""Web UI page times on a large run: a replay run of 10,000 traces (two comparisons, so 20,000
result rows) in the embedded SQLite database.

    .venv/bin/python benchmarks/ui.py [--traces 10000] [--steps 256] [--repeat 7] [--db PATH]
                                      [--no-reference]

What it does: builds a fresh SQLite file (the migrations), ingests `--traces` traces through
the real ingest service (256 prompt + `--steps` output tokens, top-2 logits, a reference
answer each), stores one replay run over them with two comparisons (logged vs FP16 with about
60% divergent, logged vs FP16 + C with about 10%) whose result rows are written directly, as a
worker would have written them (per-step margin track of `--steps` floats, gate firings,
semantic answers, replayed tokens, environment), finalises the run (which builds and stores its
statistics), signs an auditor in, then times each page through the ASGI app in process (FastAPI
TestClient: the whole request, routing, SQL, statistics, templates; no network):

  cold   the first request of each page in this process (the run's statistics are read from
         the database: nothing is memoised in the process; another pair costs one lift from
         the result figures, another TOST margin one accuracy)
  warm   median and max of `--repeat` further requests

Pages: the run page (statistics, charts, lifts with fixed/broke lists, the first results
page), the run page with another pair and a results filter, the task accuracy page (and with
another TOST margin), a trace page, the runs list, `GET /v1/replays/{id}/report` (everything,
accuracy included); and the CSV / JSONL exports (rows/s, streamed).
The target (issue 5): the run page of a 10,000-trace run in well under a second.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import insert, select

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastapi.testclient import TestClient  # noqa: E402

from replay_audit.api.app import create_app  # noqa: E402
from replay_audit.auth.service import create_api_key  # noqa: E402
from replay_audit.config import Settings  # noqa: E402
from replay_audit.db import migration  # noqa: E402
from replay_audit.db.base import utcnow  # noqa: E402
from replay_audit.db.ids import new_public_id  # noqa: E402
from replay_audit.db.unit_of_work import session_scope  # noqa: E402
from replay_audit.replays import service as replays_service  # noqa: E402
from replay_audit.replays.models import ReplayResult, ReplayRun  # noqa: E402
from replay_audit.traces import service as traces_service  # noqa: E402
from replay_audit.traces.models import Trace  # noqa: E402
from replay_audit.traces.schemas import TraceCreate  # noqa: E402

VOCAB = 32_000
SHA = "ab" * 32
CATEGORY_WEIGHTS = {"head_reachable": 0.7, "kv_dependent": 0.1, "body_dominated": 0.2}


def make_trace(rng: np.random.Generator, i: int, steps: int, reference: bool = True) -> TraceCreate:
    output = rng.integers(0, VOCAB, steps)
    top1 = rng.uniform(5.0, 25.0, steps).astype(np.float32)
    second = (output + 1) % VOCAB
    return TraceCreate.model_validate(
        {
            "external_id": f"bench-{i}",
            "model": {"name": "bench-model", "weights_sha256": SHA, "vocab_size": VOCAB},
            "config": {"dtype": "bf16", "attn_kernel": "sdpa", "device": "cpu"},
            "decoding": {"strategy": "greedy", "max_new_tokens": steps, "stop_reason": "length"},
            "prompt_token_ids": rng.integers(0, VOCAB, 256).tolist(),
            "output_token_ids": output.tolist(),
            "top_k": {
                "ids": np.stack([output, second], 1).tolist(),
                "logits": np.stack([top1, top1 - rng.uniform(0, 2, steps)], 1)
                .astype(np.float32)
                .astype(float)
                .tolist(),
            },
            "output_text": f"... so the answer is #### {i % 50}",
            "reference_answer": f"#### {i % 50 if i % 4 else 999}" if reference else None,
            "tags": ["bench", f"shard-{i % 8}"],
        }
    )


def result_row(
    rng: np.random.Generator, run_id: int, trace_id: int, comparison: int, i: int, steps: int
) -> dict[str, Any]:
    diverged = rng.random() < (0.6 if comparison == 0 else 0.1)
    margins = np.exp(rng.uniform(math.log(1e-6), math.log(10.0), steps))
    fired = np.flatnonzero(margins < 1e-3)
    t_star = int(rng.integers(0, steps)) if diverged else None
    category = (
        str(rng.choice(list(CATEGORY_WEIGHTS), p=list(CATEGORY_WEIGHTS.values())))
        if diverged
        else "agreed"
    )
    m_replay = 0.0 if diverged and rng.random() < 0.1 else float(margins[t_star or 0])
    m_logged = float(np.exp(rng.uniform(math.log(1e-5), 0.0)))
    answer = str(i % 50) if not diverged or rng.random() < 0.7 else "7"
    return {
        "run_id": run_id,
        "trace_id": trace_id,
        "comparison": comparison,
        "status": "ok",
        "error": None,
        "exact_match": not diverged,
        "first_divergence_step": t_star,
        "category": category,
        "margin_a": m_logged if diverged else None,
        "margin_a_ulps": m_logged * 8 if diverged else None,
        "margin_a_source": "logged_top_k" if diverged else None,
        "margin_b": m_replay if diverged else None,
        "margin_b_ulps": m_replay * 16 if diverged else None,
        "gate_triggers": len(fired),
        "n_steps": steps,
        "trigger_rate": len(fired) / steps,
        "mean_gap": float(margins.mean()),
        "tie": diverged and m_replay == 0.0,
        "cascade_length": steps - t_star if t_star is not None else None,
        "length_difference": int(rng.integers(-3, 4)) if diverged else None,
        "semantic_agree": answer == str(i % 50),
        "answer_extractor": "gsm8k",
        "answer_a": str(i % 50),
        "answer_b": answer,
        "output_b": rng.integers(0, VOCAB, steps).astype(np.int32),
        "output_a": None,
        "detail": {
            "mode": "decode",
            "external_id": None,
            "single_step": None,
            "semantic": {
                "extractor": "gsm8k",
                "answer_a": str(i % 50),
                "answer_b": answer,
                "agree": answer == str(i % 50),
            },
            "arms": {
                "a": {"target": None, "environment": None, "text": None},
                "b": {
                    "target": {
                        "dtype": "fp16",
                        "intervention": {"kind": "C" if comparison else "none", "tau": 0.001},
                    },
                    "changed_steps": 0,
                    "margins": [float(f"{m:.6g}") for m in margins],
                    "gate_fired_steps": fired.tolist(),
                    "environment": {"dtype": "fp16", "device": "cpu", "engine": {"name": "bench"}},
                    "text": None,
                },
            },
        },
        "created_at": utcnow(),
    }


def seed(url: str, n: int, steps: int, reference: bool) -> tuple[str, str]:
    """(the run's public id, an auditor key)."""
    rng = np.random.default_rng(0)
    with session_scope(url) as s:
        key = create_api_key(s, "bench", "auditor").key
        project_id = create_api_key(s, "bench", "admin").api_key.project_id
    public_ids: list[str] = []
    for start in range(0, n, 1000):
        batch = [make_trace(rng, i, steps, reference) for i in range(start, min(n, start + 1000))]
        with session_scope(url) as s:
            results = traces_service.ingest_traces(s, project_id, batch)
            assert all(r.status == 201 for r in results), results[:3]
            public_ids += [str(r.id) for r in results]
    with session_scope(url) as s:
        by_public = {
            str(p): int(i)
            for p, i in s.execute(
                select(Trace.public_id, Trace.id).where(Trace.project_id == project_id)
            )
        }
        run = ReplayRun(
            public_id=new_public_id("rr"),
            project_id=project_id,
            status="running",
            mode="decode",
            compare="logged",
            request={"trace_ids": "(bench)", "targets": []},
            targets=[
                {"dtype": "fp16", "intervention": {"kind": "none", "tau": 0.001}},
                {"dtype": "fp16", "intervention": {"kind": "C", "tau": 0.001}},
            ],
            comparisons=[{"index": 0, "a": "logged", "b": 0}, {"index": 1, "a": "logged", "b": 1}],
            n_traces=n,
            n_items=2 * n,
        )
        s.add(run)
        s.flush()
        run_db_id, run_public = run.id, run.public_id
    internal = [by_public[p] for p in public_ids]
    for start in range(0, n, 500):
        rows = [
            result_row(rng, run_db_id, internal[i], c, i, steps)
            for i in range(start, min(n, start + 500))
            for c in (0, 1)
        ]
        with session_scope(url) as s:
            s.execute(insert(ReplayResult), rows)
    with session_scope(url) as s:
        run = s.get(ReplayRun, run_db_id)
        assert run is not None
        replays_service.finalise_run(s, run)
    return run_public, key


def timed(client: TestClient, url: str, repeat: int) -> dict[str, float]:
    t0 = time.perf_counter()
    r = client.get(url)
    cold = time.perf_counter() - t0
    assert r.status_code == 200, (url, r.status_code, r.text[:300])
    warm = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = client.get(url)
        warm.append(time.perf_counter() - t0)
        assert r.status_code == 200
    return {
        "cold_ms": cold * 1000,
        "warm_median_ms": statistics.median(warm) * 1000,
        "warm_max_ms": max(warm) * 1000,
        "bytes": len(r.content),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--db", type=Path, default=None, help="SQLite file (default: temporary)")
    parser.add_argument(
        "--no-reference", action="store_true", help="traces without reference answers"
    )
    args = parser.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="ra-bench-ui-")
    path = args.db or Path(tmp.name) / "bench.db"
    url = f"sqlite:///{path}"
    migration.upgrade(url)
    t0 = time.perf_counter()
    run_id, key = seed(url, args.traces, args.steps, not args.no_reference)
    seed_s = time.perf_counter() - t0
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        database_url=url,
        session_secret="benchmark-session-secret-0123456789",
        session_secret_file=Path(tmp.name) / "secret",
    )
    client = TestClient(create_app(settings))
    page = client.get("/ui/sign-in")
    token = page.text.split('name="form_token" value="')[1].split('"')[0]
    r = client.post(
        "/ui/sign-in", data={"api_key": key, "form_token": token}, follow_redirects=False
    )
    assert r.status_code == 303, r.text
    # A trace that diverged in comparison 0 (found in SQL: a report would warm the memo).
    with session_scope(url) as s:
        trace_id = s.scalar(
            select(Trace.public_id)
            .join(ReplayResult, ReplayResult.trace_id == Trace.id)
            .where(ReplayResult.comparison == 0, ReplayResult.exact_match.is_(False))
            .limit(1)
        )

    pages = {
        "run page": f"/ui/runs/{run_id}",
        "run page, pair 1 vs 0 + filter": f"/ui/runs/{run_id}?a=1&b=0&comparison=0"
        "&outcome=diverged&category=head_reachable",
        "accuracy page": f"/ui/runs/{run_id}/accuracy",
        "accuracy page, TOST margin 0.1": f"/ui/runs/{run_id}/accuracy?margin=0.1",
        "trace page": f"/ui/runs/{run_id}/traces/{trace_id}?comparison=0",
        "runs list": "/ui/runs",
        "runs list, model + dtype filter": "/ui/runs?model=bench-model&dtype=fp16",
        "GET /v1/replays/{id}/report": f"/v1/replays/{run_id}/report",
    }
    client.headers["X-API-Key"] = key
    out: dict[str, Any] = {
        "traces": args.traces,
        "reference_answers": not args.no_reference,
        "results": 2 * args.traces,
        "steps": args.steps,
        "seed_s": round(seed_s, 1),
        "db_mb": round(path.stat().st_size / 2**20, 1),
        "pages": {},
    }
    for name, url_ in pages.items():
        out["pages"][name] = {k: round(v, 1) for k, v in timed(client, url_, args.repeat).items()}
    for fmt in ("csv", "jsonl"):
        t0 = time.perf_counter()
        size, rows = 0, 0
        with client.stream("GET", f"/ui/runs/{run_id}/export.{fmt}") as r:
            for chunk in r.iter_raw():
                size += len(chunk)
                rows += chunk.count(b"\n")
        dt = time.perf_counter() - t0
        out["pages"][f"export {fmt}"] = {
            "s": round(dt, 2),
            "rows_per_s": round((rows - (fmt == "csv")) / dt),
            "mb": round(size / 2**20, 1),
        }
    print(json.dumps(out, indent=2))
    print(f"\n{'page':42} {'cold ms':>9} {'warm p50':>9} {'warm max':>9}")
    for name, v in out["pages"].items():
        if "cold_ms" in v:
            cold, p50, top = v["cold_ms"], v["warm_median_ms"], v["warm_max_ms"]
            print(f"{name:42} {cold:9.1f} {p50:9.1f} {top:9.1f}")
    client.close()
    tmp.cleanup()


if __name__ == "__main__":
    main()
