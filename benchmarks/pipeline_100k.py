"""The whole pipeline at scale on one machine: ingest N synthetic traces into PostgreSQL over
HTTP, then scan every one of them with the committed small model on the CPU through a real RQ
worker; wall times, database size, peak memory of the API and the worker.

    nice -n 10 .venv/bin/python benchmarks/pipeline_100k.py [--traces 100000]
        [--server-url postgresql+psycopg://postgres@127.0.0.1:5432/test]
        [--redis-url redis://127.0.0.1:6379/15] [--prompt-tokens 16] [--output-tokens 16]

What it does:
  1. generates `--base` distinct greedy generations with transformers' own `generate()` on the
     committed model (replay_audit/assets/tiny-llama, FP32, CPU), with their top-2 logits, and
     makes `--traces` distinct traces of them (each its own external_id, so its own content);
  2. creates a fresh database (dropped afterwards), applies the migrations (weekly partitions,
     migration 0010), creates a key, starts `replay-audit serve` (one API process, RQ runner,
     no scheduler) and `replay-audit worker --queue cpu --device cpu` (one RQ SimpleWorker, one
     torch thread) as subprocesses, the commands docker-compose runs;
  3. ingest: POST /v1/traces:batch of 1,000 traces from 2 client threads; wall time;
  4. scan: POST /v1/replays in `mode: scan` (BF16 replay against the logged FP32 tokens) over
     every trace, 10,000 traces a run (the API's limit per run), all runs posted at once, then
     waits until every run is done; wall time from the first POST to the last run finished;
  5. reports the database size (whole database, and traces / results / trace_keys with their
     partitions and indexes), rows per partition, and the peak resident memory (VmHWM) of the
     API process and of the worker process.

Nothing is timed in a test: this is the benchmark BENCHMARKS.md quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ingest import create_database, drop_database, free_port  # noqa: E402
from replay_audit.auth.service import create_api_key  # noqa: E402
from replay_audit.config import BUNDLED_MODEL_DIR, normalise_database_url  # noqa: E402
from replay_audit.db import migration  # noqa: E402
from replay_audit.db.unit_of_work import session_scope  # noqa: E402
from replay_audit.engine.hashing import weights_sha256  # noqa: E402

BATCH = 1000  # MAX_BATCH_TRACES
RUN = 10_000  # MAX_REPLAY_TRACES


def base_generations(n: int, n_prompt: int, n_output: int, seed: int) -> list[dict[str, Any]]:
    """`n` greedy generations of the committed model (FP32, CPU) with their top-2 logits."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR, dtype=torch.float32).eval()
    vocab = int(model.config.vocab_size)
    out = []
    for _ in range(n):
        prompt = torch.randint(3, vocab, (1, n_prompt))
        with torch.no_grad():
            gen = model.generate(
                prompt,
                max_new_tokens=n_output,
                min_new_tokens=n_output,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=int(model.config.pad_token_id),
            )
        logits = torch.stack(gen.logits, dim=1)[0].float()  # (steps, vocab)
        top = torch.topk(logits, 2, dim=-1)
        out.append(
            {
                "prompt_token_ids": prompt[0].tolist(),
                "output_token_ids": gen.sequences[0, n_prompt:].tolist(),
                "top_k": {"ids": top.indices.tolist(), "logits": top.values.double().tolist()},
                "vocab_size": vocab,
            }
        )
    return out


def make_traces(base: list[dict[str, Any]], n: int, sha: str) -> list[dict[str, Any]]:
    traces = []
    for i in range(n):
        b = base[i % len(base)]
        traces.append(
            {
                "external_id": f"bench-{i}",
                "model": {
                    "name": "tiny-llama",
                    "weights_sha256": sha,
                    "vocab_size": b["vocab_size"],
                },
                "config": {"dtype": "fp32", "attn_kernel": "sdpa", "device": "cpu"},
                "decoding": {
                    "strategy": "greedy",
                    "max_new_tokens": len(b["output_token_ids"]),
                    "stop_reason": "length",
                },
                "prompt_token_ids": b["prompt_token_ids"],
                "output_token_ids": b["output_token_ids"],
                "top_k": b["top_k"],
                "tags": ["bench"],
            }
        )
    return traces


def peak_rss_mib(pid: int) -> float:
    """VmHWM: the peak resident set size of a process so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    handle = log.open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "replay_audit", *args],
        cwd=ROOT,
        env=env,
        stdout=handle,
        stderr=subprocess.STDOUT,
    )


def wait_healthy(base: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the API process exited")
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the API did not start")


def database_sizes(url: str) -> dict[str, Any]:
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            total = c.scalar(text("SELECT pg_database_size(current_database())"))
            tables = {}
            for parent in ("traces", "trace_tags", "replay_results", "trace_keys"):
                tables[parent] = c.scalar(
                    text(
                        "SELECT coalesce(sum(pg_total_relation_size(inhrelid)), 0)"
                        " + pg_total_relation_size(to_regclass(:t))"
                        " FROM pg_inherits WHERE inhparent = to_regclass(:t)"
                    ),
                    {"t": parent},
                )
            rows = c.execute(
                text("SELECT tableoid::regclass::text, count(*) FROM traces GROUP BY 1 ORDER BY 1")
            ).all()
    finally:
        engine.dispose()
    return {
        "database_mib": round(int(total) / 2**20, 1),
        "table_mib": {k: round(int(v) / 2**20, 1) for k, v in tables.items()},
        "traces_per_partition": {name: int(n) for name, n in rows},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server-url",
        default=os.environ.get(
            "REPLAY_AUDIT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--traces", type=int, default=100_000)
    parser.add_argument(
        "--scan-traces",
        type=int,
        default=None,
        help="scan only the first N ingested traces (default: all); on a loaded 2-core machine"
        " the CPU scan of 100,000 does not fit a time budget the ingest does",
    )
    parser.add_argument("--base", type=int, default=64, help="distinct generations")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--poll-s", type=float, default=15.0, help="seconds between checks of the scan runs"
    )
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        help="profile the worker during the scan with py-spy (collapsed stacks to this file)",
    )
    args = parser.parse_args()

    server_url = normalise_database_url(args.server_url)
    t0 = time.perf_counter()
    sha = weights_sha256(BUNDLED_MODEL_DIR)
    base = base_generations(args.base, args.prompt_tokens, args.output_tokens, args.seed)
    traces = make_traces(base, args.traces, sha)
    bodies = [orjson.dumps({"traces": traces[i : i + BATCH]}) for i in range(0, len(traces), BATCH)]
    print(f"prepared {len(traces)} traces in {time.perf_counter() - t0:.1f} s", flush=True)

    database_url = create_database(server_url)
    prefix = f"bench{secrets.token_hex(3)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_AUDIT_")}
    env |= {
        "REPLAY_AUDIT_DATABASE_URL": database_url,
        "REPLAY_AUDIT_RUNNER": "rq",
        "REPLAY_AUDIT_REDIS_URL": args.redis_url,
        "REPLAY_AUDIT_QUEUE_PREFIX": prefix,
        "REPLAY_AUDIT_SCHEDULER": "off",
        "REPLAY_AUDIT_MODEL_DIRS": str(BUNDLED_MODEL_DIR),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",  # the worker's torch: one core (2 cores, API + PostgreSQL)
    }
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"pipeline_{prefix}"
    logs.mkdir(parents=True, exist_ok=True)
    api = worker = None
    try:
        migration.upgrade(database_url)
        with session_scope(database_url) as session:
            key = create_api_key(session, "bench", "admin").key
        port = free_port()
        api = start(
            [
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--no-migrate",
                "--log-level",
                "warning",
            ],
            env,
            logs / "api.log",
        )
        worker = start(
            ["worker", "--queue", "cpu", "--device", "cpu", "--name", prefix],
            env,
            logs / "worker.log",
        )
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, api)
        headers = {"X-API-Key": key, "Content-Type": "application/json"}
        timeout = httpx.Timeout(300.0)

        # Ingest.
        clients = [
            httpx.Client(base_url=base_url, headers=headers, timeout=timeout) for _ in range(2)
        ]
        ids: list[list[str]] = [[] for _ in bodies]

        def send(i: int) -> None:
            answer = clients[i % 2].post("/v1/traces:batch", content=bodies[i])
            assert answer.status_code == 207, answer.text
            items = answer.json()["results"]
            assert {r["status"] for r in items} == {201}, items[:3]
            ids[i] = [r["id"] for r in items]

        start_ingest = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(send, range(len(bodies))))
        ingest_s = time.perf_counter() - start_ingest
        for c in clients:
            c.close()
        all_ids = [i for chunk in ids for i in chunk]
        print(
            f"ingest: {len(all_ids)} traces in {ingest_s:.1f} s"
            f" ({len(all_ids) / ingest_s:,.0f} traces/s)",
            flush=True,
        )
        sizes_after_ingest = database_sizes(database_url)

        # Scan.
        scan_ids = all_ids[: args.scan_traces] if args.scan_traces else all_ids
        with httpx.Client(base_url=base_url, headers=headers, timeout=timeout) as client:
            start_scan = time.perf_counter()
            runs = []
            for i in range(0, len(scan_ids), RUN):
                answer = client.post(
                    "/v1/replays",
                    json={
                        "trace_ids": scan_ids[i : i + RUN],
                        "mode": "scan",
                        "targets": [{"dtype": "bf16", "device": "cpu"}],
                    },
                )
                assert answer.status_code in (201, 202), answer.text
                runs.append(answer.json()["id"])
            post_s = time.perf_counter() - start_scan
            spy_cmd = [str(Path(sys.executable).parent / "py-spy"), "record", "--format", "raw"]
            spy_cmd += ["--rate", "50", "--output", str(args.py_spy), "--nonblocking"]
            spy = (
                subprocess.Popen(
                    [*spy_cmd, "--pid", str(worker.pid)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                if args.py_spy
                else None
            )
            done: dict[str, dict[str, Any]] = {}
            while len(done) < len(runs):
                time.sleep(args.poll_s)
                if worker.poll() is not None:
                    raise RuntimeError("the worker exited; see " + str(logs / "worker.log"))
                for run_id in runs:
                    if run_id in done:
                        continue
                    run = client.get(f"/v1/replays/{run_id}").json()
                    if run["status"] in ("done", "failed"):
                        done[run_id] = run
                n_done = sum(r["progress"]["done"] for r in done.values())
                print(
                    f"  scan: {len(done)}/{len(runs)} runs done ({n_done} traces),"
                    f" {time.perf_counter() - start_scan:.0f} s",
                    flush=True,
                )
            scan_s = time.perf_counter() - start_scan
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                spy.wait(timeout=60)

        api_rss, worker_rss = peak_rss_mib(api.pid), peak_rss_mib(worker.pid)
        stats = [r["statistics"]["comparisons"][0] for r in done.values()]
        result = {
            "traces": len(all_ids),
            "tokens_per_trace": args.prompt_tokens + args.output_tokens,
            "ingest_s": round(ingest_s, 1),
            "ingest_traces_per_s": round(len(all_ids) / ingest_s, 1),
            "scanned": len(scan_ids),
            "scan_s": round(scan_s, 1),
            "scan_post_s": round(post_s, 1),
            "scan_traces_per_s": round(len(scan_ids) / scan_s, 1),
            "scan_ok": sum(r["progress"]["done"] - r["progress"]["failed"] for r in done.values()),
            "scan_failed": sum(r["progress"]["failed"] for r in done.values()),
            "runs": len(runs),
            "run_status": sorted({r["status"] for r in done.values()}),
            "ear_per_run": [s["ear"]["estimate"] if s.get("ear") else None for s in stats],
            "after_ingest": sizes_after_ingest,
            "after_scan": database_sizes(database_url),
            "peak_rss_mib": {"api": round(api_rss, 1), "worker": round(worker_rss, 1)},
            "load_average_1m": os.getloadavg()[0],
            "cpu_count": os.cpu_count(),
        }
        print(json.dumps(result, indent=1))
    finally:
        for proc in (worker, api):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        drop_database(server_url, database_url)


if __name__ == "__main__":
    main()
