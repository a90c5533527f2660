"""The nightly audit end to end through the service (issue 24): train a model, log its greedy
traces, ingest them over HTTP, run a scan-first cross-precision audit through the API with a
replay worker, fetch each run's report; the wall time of every phase, the audit's traces per
hour with ingest included and excluded, and where the worker's time went.

    # prepare: train a Llama on the Python stdlib (scripts/train_tiny_model.py) unless --model
    # names a checkpoint, then log --unique greedy traces of it in --logged-dtype
    python benchmarks/e2e_audit.py prepare --work .models/e2e --device cuda [--minutes 2 ...]
    # audit: start the service on those traces and audit them
    python benchmarks/e2e_audit.py audit --work .models/e2e --device cuda --backend pg \\
        --database-url postgresql+psycopg://postgres@127.0.0.1:55432/postgres \\
        --redis-url redis://127.0.0.1:56379/0 --traces 20000 --out results/
    python benchmarks/e2e_audit.py all ...           # both, one process after the other

On the CPU with the bundled model (a check of the driver, seconds to minutes):

    python benchmarks/e2e_audit.py all --work /tmp/e2e --model replay_audit/assets/tiny-llama \\
        --device cpu --unique 16 --prompt-tokens 16 --output-tokens 48 --traces 300 \\
        --run-size 100 --backend embedded --out /tmp/e2e/out
    python benchmarks/e2e_audit.py audit --work /tmp/e2e --device cpu --backend pg \\
        --database-url postgresql+psycopg://postgres@127.0.0.1:5432/test \\
        --redis-url redis://127.0.0.1:6379/15 --traces 300 --run-size 100 --out /tmp/e2e/out

`benchmarks/gpu_e2e.sh` runs both steps on a lent GPU with PostgreSQL and Redis carried as
wheels.

**prepare.** Without --model, `scripts/train_tiny_model.py` trains a Llama of the given shape
(default 2048 wide, 24 layers, MLP 5632, 32 heads, 4 KV heads: 1.07 B parameters with its
4,096-token vocabulary) on the Python standard library for --minutes under BF16 autocast, on
512-token windows, and saves it in BF16 (the weights' stored dtype) with its tokenizer. Then
`replay_audit.engine.generate.TraceGenerator` loads it in --logged-dtype (BF16) and
transformers' `generate()` decodes --unique prompts at once, --gen-batch rows a call: each
prompt is <s> and --prompt-tokens - 1 tokens of the held-out files of the corpus (the training
split's held-out tenth, windows spread evenly over it, so the prompts are distinct), each
output --output-tokens greedy tokens with no stop token (the trace records no eos ids and
`stop_reason: length`, so a replay runs to the same length). Each trace is `POST /v1/traces`
JSON with the generator's numerical configuration, the batch it ran in (`config.batch_size`:
the call's rows, other prompts as in production; `decoding.batch`: their prompt lengths and
its row), its texts, and top-k logits when --top-k > 0. They go
to <work>/traces.jsonl; what was done to <work>/prepare.json.

**audit.** A fresh database (--backend pg: a new database on --database-url's server, dropped at
the end unless --keep-database; --backend embedded: a SQLite file in --work and the in-process
runner, the service's embedded default), its migrations, a submitter key (ingest, runs, status)
and an auditor key (reports). Then `replay-audit serve` (--api-workers processes; one with the
embedded runner) and, with pg, --workers `replay-audit worker` processes on --device (worker i
on GPU i; RQ, Redis at --redis-url under a fresh queue prefix); the process that replays (the
first worker, or the embedded server) runs under `benchmarks/_stack_sampler.py`, which records
its Python stacks at --hz. With several workers the warm-up posts one run a worker, and the job
lines are summed over their logs.
Phases, each timed:

1. ingest: --traces traces, the unique ones repeated in order under distinct external ids
   (so distinct traces; the output says how many are unique), POSTed in batches of 1,000 by
   --clients threads (`POST /v1/traces:batch`), each tagged with its run's part;
2. warm-up (none with --warmup-traces 0): a `scan_then_decode` run of --warmup-traces traces
   with a control fraction of 1, so the worker loads the checkpoint in the target's format
   (and in the logged one, for the re-runs at t*, where a warm-up trace diverges) and runs a
   scan and decodes once before anything is timed (its wall time is reported apart: a nightly
   audit's worker is already running). Traces logged in batches decode their whole logged
   batch: ~70 s on an H200 for 256 rows of 512 tokens, counted in --deadline-s;
3. one audit per --modes entry (default `auto`: the request names no mode, and the service's
   large-run rule replays runs of 1,000 traces or more scan-then-decode, with its default
   control fraction and near-tie threshold unless --control-fraction / --scan-flag-ulps are
   given): the traces in runs of --run-size (the API's limit is 10,000 a run), each
   `POST /v1/replays` with `filter: {"tags": [its part]}` and one target in --target-dtype
   (FP16: a cross-precision audit of the BF16 traces), all posted at once; then the run's
   status is polled (submitter key: the status view) until it is done, and its report is read
   (`GET /v1/replays/{id}/report`, auditor key). Per run: the server's POST-to-finished time,
   the report's fetch time, the screening counts (scanned, flagged, near-tie, control,
   decoded) and the EAR. Per audit: the wall time from the first POST to the last report, and
   traces per hour with and without the ingest of those traces (ingest time prorated).

In scan-then-decode the service decodes a flagged trace from its first disagreement (a forced
prefix, then a greedy decode at batch 1), and a near-tie or control-sample trace from its
prompt, each to t* + the run's decode window: a large run that names no mode gets the
deployment's REPLAY_AUDIT_LARGE_RUN_DECODE_WINDOW (32), so `auto` is windowed; a run naming
`mode: scan_then_decode` decodes to the trace's full length unless --run-extra names a
`decode_window`. --run-extra passes any request fields without changing this driver.

Every phase is cut at --deadline-s from the audit command's start: a phase still running then
is reported as it stands (results so far, the rate so far, the time the rest would take at
that rate) and marked incomplete; the JSON goes to --out/e2e.json after every phase. With
several --modes and RQ, each audit gets an equal share of the time left when it starts; one cut
by its share has its queued jobs dropped from Redis (the job the worker is in finishes first)
so that the next audit's runs do not wait behind them. A complete audit's rates are extrapolated
linearly to the issue's 100,000 traces (`extrapolated_100k_s`, with and without ingest); a cut
one's from the rate so far. Linear is an assumption: jobs are independent and the database's
partitions are weekly, but 100,000 traces make the tables five times larger than 20,000 do.

The worker's own job log lines (JSON lines: traces, results, wall time, the batched scan's
traces and seconds) are summed per audit: the scan's share of the job time, and the rest
(decodes, re-runs at t*, reading and writing the database). The stack samples of the replaying
thread are summarised per phase window (`_stack_sampler.summarise`): the share of samples in the
batched scan, decodes, re-runs, the database, results and statistics, model loading, idle; and
the functions with the most samples. The slowest phase is named, with its profile.

Not measured here: the API processes' own profile (ingest is one of the phases, timed; its
throughput is `benchmarks/ingest.py`'s subject), and GPU kernels (`benchmarks/scan.py
--profile` profiles the batched scan).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

BATCH = 1000  # MAX_BATCH_TRACES
MAX_RUN = 10_000  # MAX_REPLAY_TRACES


def _now() -> float:
    return time.perf_counter()


def _write(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def _log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- prepare ------------------------------------------------------------------------------------


def _train(args: argparse.Namespace, model_dir: Path, log: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "train_tiny_model.py"),
        "--device",
        args.device,
        "--threads",
        str(args.threads),
        "--minutes",
        str(args.minutes),
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--intermediate",
        str(args.intermediate),
        "--heads",
        str(args.heads),
        "--kv-heads",
        str(args.kv_heads),
        "--batch-size",
        str(args.batch_size),
        "--lr",
        str(args.lr),
        "--warmup",
        str(args.warmup),
        "--seq-len",
        str(args.seq_len),
        "--max-positions",
        str(args.max_positions),
        "--save-dtype",
        args.save_dtype,
        "--log-every",
        "50",
        "--out",
        str(model_dir),
        "--prompts-out",
        str(model_dir / "prompts.jsonl"),
    ]
    if args.device.startswith("cuda"):
        cmd += ["--amp", "bf16"]
    _log("train: " + " ".join(cmd[2:]))
    with log.open("w") as fh:
        subprocess.run(cmd, check=True, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    text = log.read_text()
    summary = text[text.rindex("\n{") + 1 :] if "\n{" in text else "{}"
    out: dict[str, Any] = json.loads(summary)
    return out


def held_out_prompts(tokenizer: Any, n: int, length: int) -> list[list[int]]:
    """`n` distinct prompts of `length` tokens: <s> (where the tokenizer has one) and windows of
    the corpus's held-out files (`train_tiny_model.load_corpus`), spread evenly over them."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from train_tiny_model import load_corpus

    corpus = load_corpus()
    stream: list[int] = []
    for f in corpus.held_out:
        stream += tokenizer(f.text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    body = length - (1 if bos is not None else 0)
    if len(stream) < n * body:
        raise SystemExit(f"the held-out corpus has {len(stream)} tokens: too few for {n} prompts")
    step = (len(stream) - body) // n
    prompts = []
    for i in range(n):
        window = stream[i * step : i * step + body]
        prompts.append(([bos] if bos is not None else []) + [int(t) for t in window])
    return prompts


def _generate(args: argparse.Namespace, model_dir: Path) -> tuple[list[dict[str, Any]], dict]:
    import numpy as np
    import torch
    from transformers import GenerationConfig

    from replay_audit.engine.generate import TraceGenerator, printable_text, sorted_top_k

    t0 = _now()
    gen = TraceGenerator(model_dir, dtype=args.logged_dtype, device=args.device)
    load_s = _now() - t0
    model, tok = gen.model, gen.tokenizer
    prompts = held_out_prompts(tok, args.unique, args.prompt_tokens)
    # No stop token: every row decodes --output-tokens (transformers fills an unset eos from the
    # model's generation config, so that one is cleared too).
    stop_ids = set(gen.eos_ids)
    model.generation_config.eos_token_id = None
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    config = dict(gen.config)
    extras = dict(config.get("extras") or {})
    extras["producer"] = f"benchmarks/e2e_audit.py: generate() of {args.gen_batch} prompts a call"
    config["extras"] = extras
    traces: list[dict[str, Any]] = []
    t1 = _now()
    for start in range(0, len(prompts), args.gen_batch):
        chunk = prompts[start : start + args.gen_batch]
        x = torch.tensor(chunk, dtype=torch.long, device=gen.device)
        gc = GenerationConfig(
            do_sample=False,
            num_beams=1,
            max_new_tokens=args.output_tokens,
            eos_token_id=None,
            pad_token_id=pad,
            output_logits=args.top_k > 0,
            return_dict_in_generate=True,
        )
        with torch.inference_mode():
            out = model.generate(
                input_ids=x, attention_mask=torch.ones_like(x), generation_config=gc
            )
        seqs = out.sequences[:, x.shape[1] :].tolist()
        logits = torch.stack(out.logits, dim=1).float() if args.top_k > 0 else None
        for r, (prompt, ids) in enumerate(zip(chunk, seqs, strict=True)):
            if len(ids) != args.output_tokens:
                raise SystemExit(f"generate() stopped a row at {len(ids)} tokens")
            for j, t in enumerate(ids[:-1]):  # a row stopped early has only padding after it
                if t in stop_ids and all(u == pad for u in ids[j + 1 :]):
                    raise SystemExit("generate() stopped a row at an eos token: padded after")
            body: dict[str, Any] = {
                "model": {
                    "name": args.model_name,
                    "revision": None,
                    "weights_sha256": gen.weights_sha256,
                    "vocab_size": int(model.config.vocab_size),
                },
                # The batch it ran in: the call's rows (other prompts, all of one length).
                "config": {**config, "batch_size": len(chunk)},
                "decoding": {
                    "strategy": "greedy",
                    "max_new_tokens": args.output_tokens,
                    "eos_token_ids": [],
                    "stop_reason": "length",
                    "batch": {"prompt_lengths": [len(p) for p in chunk], "row": r},
                },
                "prompt_token_ids": prompt,
                "output_token_ids": [int(t) for t in ids],
                "prompt_text": printable_text(tok.decode(prompt, skip_special_tokens=True)),
                "output_text": printable_text(tok.decode(ids, skip_special_tokens=True)),
            }
            if logits is not None:
                top_ids, top_vals = sorted_top_k(logits[r], args.top_k)
                body["top_k"] = {
                    "ids": np.asarray(top_ids).tolist(),
                    "logits": [[float(v) for v in row] for row in top_vals],
                }
            traces.append(body)
        _log(f"generate: {len(traces)}/{len(prompts)} traces")
    if gen.device.type == "cuda":
        torch.cuda.synchronize()
    gen_s = _now() - t1
    from replay_audit.traces.schemas import TraceCreate

    for t in traces[:64]:  # what the API will accept (the rest are alike)
        TraceCreate.model_validate(t)
    outputs = {tuple(t["output_token_ids"]) for t in traces}
    info = {
        "load_s": round(load_s, 2),
        "generate_s": round(gen_s, 2),
        "unique_traces": len(traces),
        "distinct_outputs": len(outputs),
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "gen_batch": args.gen_batch,
        "generated_tokens_per_s": round(len(traces) * args.output_tokens / gen_s, 1),
        "logged_config": {k: config.get(k) for k in ("dtype", "device", "gpu", "attn_kernel")},
        "top_k": args.top_k,
    }
    return traces, info


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    t0 = _now()
    result: dict[str, Any] = {"phase": "prepare", "device": _device_name(args.device)}
    model_dir = args.model or work / "model"
    if args.model is None and not (model_dir / "config.json").exists():
        t = _now()
        result["train"] = _train(args, model_dir, (args.out or work) / "train.log")
        result["train"]["wall_s"] = round(_now() - t, 1)
    elif args.model is None:
        result["train"] = {"reused": str(model_dir)}
    result["model_dir"] = str(model_dir)
    result["parameters"] = _parameters(model_dir)
    traces, info = _generate(args, model_dir)
    result["generate"] = info
    with (work / "traces.jsonl").open("w") as fh:
        for t in traces:
            fh.write(json.dumps(t) + "\n")
    result["wall_s"] = round(_now() - t0, 1)
    _write(work / "prepare.json", result)
    return result


def _parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shape = st.get_slice(k).get_shape()
                n += math.prod(shape)
    return n


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return str(torch.cuda.get_device_name())
    return "cpu"


# -- the service ---------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(
    argv: list[str], env: dict[str, str], log: Path, profile: Path | None = None
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable]
    if profile is not None:
        cmd += [str(BENCH / "_stack_sampler.py"), "--out", str(profile), "--hz", env["E2E_HZ"]]
        cmd += ["--"]
    cmd += ["-m", "replay_audit", *argv]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes] | None, name: str) -> None:
    """SIGTERM (RQ: warm shutdown after the job), again after 10 s (cold: the job is cut), then
    SIGKILL after 10 s more."""
    if proc is None or proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGTERM):
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue
    _log(f"{name} did not stop: killed")
    proc.kill()
    proc.wait(timeout=30)


def _wait_healthy(base: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    import httpx

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the API exited: see {log}\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise SystemExit("the API did not answer /healthz in 180 s")


def _peak_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


# -- the audit ---------------------------------------------------------------------------------


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def passed(self) -> bool:
        return self.left() <= 0


def _drain(redis_url: str, prefix: str, timeout_s: float = 90.0) -> dict[str, Any]:
    """Drop the jobs still queued under queue prefix `prefix` (an audit cut by its time share:
    the next audit's runs would wait behind them), then wait for the job a worker is running
    to end. The dropped jobs' runs stay unfinished in the database."""
    import redis
    from rq import Queue
    from rq.registry import StartedJobRegistry

    r = redis.Redis.from_url(redis_url)
    names = [
        m.decode().removeprefix("rq:queue:")
        for m in r.smembers("rq:queues")
        if prefix in m.decode()
    ]
    dropped = 0
    for name in names:
        q = Queue(name, connection=r)
        dropped += q.count
        q.empty()
    t0 = _now()
    while _now() - t0 < timeout_s and any(
        StartedJobRegistry(name, connection=r).count for name in names
    ):
        time.sleep(0.5)
    return {"jobs_dropped": dropped, "waited_for_running_job_s": round(_now() - t0, 1)}


def _part_tag(tag: str, part: int) -> str:
    return f"e2e-{tag}-p{part}"


def _bodies(unique: list[dict[str, Any]], n: int, run_size: int, tag: str) -> list[bytes]:
    import orjson

    out = []
    for start in range(0, n, BATCH):
        batch = []
        for i in range(start, min(n, start + BATCH)):
            t = dict(unique[i % len(unique)])
            t["external_id"] = f"e2e-{tag}-{i}"
            t["tags"] = [_part_tag(tag, i // run_size)]
            batch.append(t)
        out.append(orjson.dumps({"traces": batch}))
    return out


def _ingest(base: str, key: str, bodies: list[bytes], clients: int) -> tuple[list[str], float]:
    import httpx

    headers = {"X-API-Key": key, "Content-Type": "application/json"}
    ids: list[list[str]] = [[] for _ in bodies]
    pool = [
        httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(600.0))
        for _ in range(clients)
    ]

    def send(i: int) -> None:
        answer = pool[i % clients].post("/v1/traces:batch", content=bodies[i])
        if answer.status_code != 207:
            raise RuntimeError(f"ingest batch {i}: {answer.status_code} {answer.text[:500]}")
        items = answer.json()["results"]
        bad = [r for r in items if r["status"] not in (200, 201)]
        if bad:
            raise RuntimeError(f"ingest batch {i}: {len(bad)} refused, e.g. {bad[0]}")
        ids[i] = [r["id"] for r in items]

    t0 = _now()
    try:
        with ThreadPoolExecutor(clients) as ex:
            list(ex.map(send, range(len(bodies))))
    finally:
        for c in pool:
            c.close()
    return [i for chunk in ids for i in chunk], _now() - t0


def _run_request(args: argparse.Namespace, mode: str, selection: dict[str, Any]) -> dict:
    target: dict[str, Any] = {"dtype": args.target_dtype, "label": args.target_dtype.upper()}
    target["device"] = "cpu" if args.device == "cpu" else "cuda"
    body: dict[str, Any] = {**selection, "targets": [target]}
    if mode != "auto":
        body["mode"] = mode
    if args.control_fraction is not None:
        body["control_fraction"] = args.control_fraction
    if args.scan_flag_ulps is not None:
        body["scan_flag_ulps"] = args.scan_flag_ulps
    if args.run_extra:
        body.update(json.loads(args.run_extra))
    if mode == "scan":  # a scan decodes nothing: the service refuses a window for it
        body.pop("decode_window", None)
    return body


def _parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _comparison_summary(report: dict[str, Any]) -> dict[str, Any]:
    """Comparison 0's figures, its results by baseline (how many traces the reproduction check
    did not reproduce, so were judged against its replay) and the check's reproduction rate."""
    comps = report.get("comparisons") or []
    if not comps:
        return {}
    c = comps[0]
    keep = ("label", "mode", "n", "exact", "failed", "ear", "categories", "screening", "baselines")
    out = {k: c.get(k) for k in keep if k in c}
    check = report.get("engine_reproduction") or {}
    if check.get("reproduced") is not None:
        out["engine_reproduced"] = check["reproduced"]
    return out


def _audit(
    args: argparse.Namespace,
    base: str,
    keys: dict[str, str],
    mode: str,
    parts: list[int],
    tag: str,
    deadline: Deadline,
) -> dict[str, Any]:
    """One audit: a run per part posted at once, polled until done (or the deadline), then
    each run's report."""
    import httpx

    sub = httpx.Client(base_url=base, headers={"X-API-Key": keys["submitter"]}, timeout=600.0)
    aud = httpx.Client(base_url=base, headers={"X-API-Key": keys["auditor"]}, timeout=600.0)
    runs: list[dict[str, Any]] = []
    t_first = time.time()
    t0 = _now()
    for part in parts:
        body = _run_request(args, mode, {"filter": {"tags": [_part_tag(tag, part)]}})
        body["name"] = f"e2e {tag} {mode} part {part}"
        t = _now()
        answer = sub.post("/v1/replays", json=body)
        if answer.status_code not in (200, 201):
            raise RuntimeError(f"POST /v1/replays: {answer.status_code} {answer.text[:800]}")
        runs.append({"id": answer.json()["id"], "part": part, "post_s": round(_now() - t, 3)})
    post_s = _now() - t0
    _log(f"audit {mode}: {len(runs)} run(s) posted in {post_s:.2f} s")
    pending = {r["id"]: r for r in runs}
    last_print = 0.0
    while pending and not deadline.passed():
        time.sleep(args.poll_s)
        for run_id, r in list(pending.items()):
            view = sub.get(f"/v1/replays/{run_id}").json()
            r["status"], r["progress"], r["mode"] = view["status"], view["progress"], view["mode"]
            r["pending_reason"] = view.get("pending_reason")
            if view["status"] in ("done", "failed"):
                r["seen_done_s"] = round(_now() - t0, 2)
                created, finished = (
                    _parse_time(view["created_at"]),
                    _parse_time(view["finished_at"]),
                )
                if created is not None and finished is not None:
                    r["server_post_to_finished_s"] = round(finished - created, 2)
                t = _now()
                rep = aud.get(f"/v1/replays/{run_id}/report")
                r["report_s"] = round(_now() - t, 3)
                r["report_status"] = rep.status_code
                if rep.status_code == 200:
                    r["report"] = _comparison_summary(rep.json())
                r["report_at_s"] = round(_now() - t0, 2)
                del pending[run_id]
        if _now() - last_print > 15:
            done = sum(r.get("progress", {}).get("done", 0) for r in runs)
            total = sum(r.get("progress", {}).get("total", 0) for r in runs)
            _log(f"audit {mode}: {len(runs) - len(pending)}/{len(runs)} runs, {done}/{total}")
            last_print = _now()
    wall = _now() - t0
    sub.close()
    aud.close()
    total = sum(r.get("progress", {}).get("total", 0) for r in runs)
    done = sum(r.get("progress", {}).get("done", 0) for r in runs)
    out: dict[str, Any] = {
        "mode_asked": mode,
        "runs": runs,
        "complete": not pending,
        "start_time": t_first,
        "end_time": time.time(),
        "post_s": round(post_s, 3),
        "wall_s": round(wall, 2),
        "results": total,
        "results_done": done,
    }
    if not pending:
        out["wall_post_to_last_report_s"] = round(max(r["report_at_s"] for r in runs), 2)
    elif done:
        out["estimated_wall_s_at_this_rate"] = round(wall * total / done, 1)
    return out


# -- the worker's own account ---------------------------------------------------------------------

_JOB = re.compile(
    r"replay job (\d+) \(run (\d+), (\w+)\): (\d+) traces, (\d+) results in ([\d.]+) s"
    r" \([\d.]+ traces/s\)(?:; scanned (\d+) in (\d+) forwards?, ([\d.]+) s)?"
)


def job_lines(logs: list[Path], start: float, end: float) -> dict[str, Any]:
    """The workers' job lines (JSON logs) whose time is in [start, end]: jobs, traces, the job
    seconds (summed over the workers), the batched scan's traces and seconds, and what is left
    for the rest."""
    jobs = traces = scanned = forwards = 0
    job_s = scan_s = 0.0
    per_job: list[float] = []
    lines = [
        x for log in logs if log.exists() for x in log.read_text(errors="replace").splitlines()
    ]
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        m = _JOB.search(rec.get("message", ""))
        when = _parse_time(rec.get("time"))
        if m is None or when is None or not start <= when <= end:
            continue
        jobs += 1
        traces += int(m.group(4))
        job_s += float(m.group(6))
        per_job.append(float(m.group(6)))
        if m.group(7):
            scanned += int(m.group(7))
            forwards += int(m.group(8))
            scan_s += float(m.group(9))
    if not jobs:
        return {"jobs": 0}
    per_job.sort()
    return {
        "jobs": jobs,
        "traces": traces,
        "job_s": round(job_s, 2),
        "job_s_median": round(per_job[len(per_job) // 2], 3),
        "traces_per_job_s": round(traces / job_s, 1) if job_s else None,
        "scanned": scanned,
        "scan_forwards": forwards,
        "scan_s": round(scan_s, 2),
        "scan_traces_per_s": round(scanned / scan_s, 1) if scan_s else None,
        "scan_share_of_job_time": round(scan_s / job_s, 4) if job_s else None,
        "rest_s": round(job_s - scan_s, 2),
    }


# -- audit command -----------------------------------------------------------------------------


def audit(args: argparse.Namespace, prepared: dict[str, Any] | None = None) -> dict[str, Any]:
    from replay_audit.auth.service import create_api_key
    from replay_audit.config import normalise_database_url
    from replay_audit.db import migration
    from replay_audit.db.unit_of_work import session_scope

    deadline = Deadline(args.deadline_s)
    work: Path = args.work
    out_dir: Path = args.out or work
    out_dir.mkdir(parents=True, exist_ok=True)
    result_path = out_dir / "e2e.json"
    model_dir = args.model or work / "model"
    unique = [json.loads(line) for line in (work / "traces.jsonl").read_text().splitlines()]
    if prepared is None and (work / "prepare.json").exists():
        prepared = json.loads((work / "prepare.json").read_text())
    n = args.traces
    run_size = min(args.run_size, MAX_RUN)
    tag = secrets.token_hex(3)
    tokens = len(unique[0]["prompt_token_ids"]) + len(unique[0]["output_token_ids"])
    result: dict[str, Any] = {
        "device": _device_name(args.device),
        "backend": (
            "PostgreSQL + Redis, RQ worker process"
            if args.backend == "pg"
            else "embedded default: SQLite file + in-process runner in the API process"
        ),
        "model_dir": str(model_dir),
        "prepare": prepared,
        "traces": n,
        "unique_traces": len(unique),
        "replicated": n > len(unique),
        "tokens_per_trace": tokens,
        "run_size": run_size,
        "target_dtype": args.target_dtype,
        "logged_dtype": unique[0]["config"]["dtype"],
        "api_workers": args.api_workers if args.backend == "pg" else 1,
        "replay_workers": args.workers if args.backend == "pg" else 1,
        # The workers' processes share each GPU's SMs under CUDA MPS where its control daemon
        # runs for them (`gpu_e2e.sh MPS=1`), else the GPU time-slices their contexts.
        "cuda_mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
        # REPLAY_AUDIT_SCAN_TOKEN_BUDGET of the workers (None: the service's default).
        "scan_token_budget": args.scan_token_budget,
        "clients": args.clients,
        "deadline_s": args.deadline_s,
        "phases": {},
    }
    _log(f"{n} traces of {tokens} tokens from {len(unique)} unique; backend {args.backend}")
    bodies = _bodies(unique, n, run_size, tag)

    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_AUDIT_")}
    env |= {
        "REPLAY_AUDIT_SCHEDULER": "off",
        "REPLAY_AUDIT_MODEL_DIRS": str(model_dir.resolve()),
        "REPLAY_AUDIT_LOG_FORMAT": "json",
        "REPLAY_AUDIT_METRICS_ENABLED": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "E2E_HZ": str(args.hz),
    }
    if args.scan_token_budget:
        env["REPLAY_AUDIT_SCAN_TOKEN_BUDGET"] = str(args.scan_token_budget)
    if args.device == "cpu":
        env["REPLAY_AUDIT_DEFAULT_QUEUE"] = "cpu"
    server_url = database_url = None
    if args.backend == "pg":
        from ingest import create_database

        server_url = normalise_database_url(args.database_url)
        database_url = args.database_url if args.use_database else create_database(server_url)
        database_url = normalise_database_url(database_url)
        env |= {
            "REPLAY_AUDIT_DATABASE_URL": database_url,
            "REPLAY_AUDIT_RUNNER": "rq",
            "REPLAY_AUDIT_REDIS_URL": args.redis_url,
            "REPLAY_AUDIT_QUEUE_PREFIX": f"e2e{tag}",
        }
    else:
        db = (work / f"e2e-{tag}.db").resolve()
        database_url = f"sqlite:///{db}"
        env |= {"REPLAY_AUDIT_DATABASE_URL": database_url, "REPLAY_AUDIT_RUNNER": "inprocess"}
    api = None
    workers: list[subprocess.Popen[bytes]] = []
    profile = out_dir / "worker_profile.json"
    api_log = out_dir / "api.log"
    worker_logs = [
        out_dir / ("worker.log" if i == 0 else f"worker-{i}.log") for i in range(args.workers)
    ]
    windows: dict[str, tuple[float, float]] = {}
    try:
        migration.upgrade(database_url)
        with session_scope(database_url) as session:
            keys = {
                role: create_api_key(session, "e2e", role).key for role in ("submitter", "auditor")
            }
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        serve = ["serve", "--host", "127.0.0.1", "--port", str(port), "--no-migrate"]
        serve += ["--log-level", "warning"]
        t = _now()
        if args.backend == "pg":
            api = _start([*serve, "--workers", str(args.api_workers)], env, api_log)
            queue = "cpu" if args.device == "cpu" else "gpu"
            # Worker i on GPU i // --workers-per-gpu; the first one sampled. Each one process
            # (`--processes 1`, not a GPU worker's default 2): N of them on a GPU are what one
            # `worker --processes N` runs, each with a log of its own.
            for i, log in enumerate(worker_logs):
                argv = ["worker", "--queue", queue, "--device", args.device, "--processes", "1"]
                argv += ["--name", f"e2e-{tag}-{i}", "--metrics-port", "0"]
                card = str(i // args.workers_per_gpu)
                gpu = {"CUDA_VISIBLE_DEVICES": card} if args.device == "cuda" else {}
                workers.append(_start(argv, env | gpu, log, profile if i == 0 else None))
        else:
            api = _start([*serve, "--workers", "1"], env, api_log, profile)
            worker_logs = [api_log]
        _wait_healthy(base, api, api_log)
        result["phases"]["start_service_s"] = round(_now() - t, 2)

        # 1. ingest
        _log(f"ingest: {len(bodies)} batches from {args.clients} clients")
        t0 = time.time()
        ids, ingest_s = _ingest(base, keys["submitter"], bodies, args.clients)
        windows["ingest"] = (t0, time.time())
        result["phases"]["ingest"] = {
            "traces": len(ids),
            "wall_s": round(ingest_s, 2),
            "traces_per_s": round(len(ids) / ingest_s, 1),
        }
        _log(f"ingest: {len(ids)} traces in {ingest_s:.1f} s")
        _write(result_path, result)

        # 2. warm-up
        if args.warmup_traces > 0:  # 0: none (the first jobs load the checkpoints)
            t0 = time.time()
            tw = _now()
            warm = _run_request(args, "scan_then_decode", {"trace_ids": ids[: args.warmup_traces]})
            warm["control_fraction"] = 1.0
            warm["name"] = f"e2e {tag} warm-up"
            import httpx

            with httpx.Client(
                base_url=base, headers={"X-API-Key": keys["submitter"]}, timeout=600.0
            ) as c:
                # One warm-up run a worker, posted together: each idle worker takes one job and
                # loads the checkpoint before anything is timed.
                wids = []
                for w in range(max(1, len(workers))):
                    answer = c.post("/v1/replays", json=warm | {"name": f"{warm['name']} {w}"})
                    if answer.status_code not in (200, 201):
                        raise RuntimeError(
                            f"warm-up POST: {answer.status_code} {answer.text[:800]}"
                        )
                    wids.append(answer.json()["id"])
                status = "queued"
                while not deadline.passed():
                    states = [c.get(f"/v1/replays/{wid}").json()["status"] for wid in wids]
                    status = "failed" if "failed" in states else max(states, key=states.count)
                    if all(x in ("done", "failed") for x in states):
                        break
                    # The processes that replay: the RQ workers, or (embedded) the API itself.
                    for proc, log in zip(workers or [api], worker_logs, strict=True):
                        if proc.poll() is not None:
                            raise RuntimeError(f"a replaying process exited; see {log}")
                    time.sleep(0.5)
            windows["warm-up"] = (t0, time.time())
            result["phases"]["warmup"] = {
                "traces": args.warmup_traces,
                "status": status,
                "wall_s": round(_now() - tw, 2),
            }
            _log(f"warm-up: {status} in {_now() - tw:.1f} s")
            _write(result_path, result)

        # 3. the audits
        parts = list(range(math.ceil(n / run_size)))
        for i, mode in enumerate(args.modes):
            if deadline.passed():
                result["phases"][f"audit {mode}"] = {"skipped": "deadline"}
                continue
            # With RQ, each audit gets an equal share of the time left (what it has not done
            # by then is dropped from the queue); the embedded runner's queue cannot be
            # emptied from here, so there each audit may use all of it.
            share = deadline
            if args.backend == "pg" and i < len(args.modes) - 1:
                share = Deadline(deadline.left() / (len(args.modes) - i))
            a = _audit(args, base, keys, mode, parts, tag, share)
            if not a["complete"] and args.backend == "pg" and not deadline.passed():
                a["drained"] = _drain(args.redis_url, f"e2e{tag}")
            label = f"audit {mode}"
            windows[label] = (a["start_time"], a["end_time"])
            a["worker_jobs"] = job_lines(worker_logs, a["start_time"], a["end_time"] + 5)
            # A run's results are its traces x its comparisons (the reproduction check is one):
            # traces are counted as traces, results apart.
            per = a["results"] / n
            a["results_per_trace"] = per
            done = a["results_done"] / per
            per_trace_ingest = ingest_s / max(1, len(ids))
            if a["complete"]:
                wall = a["wall_post_to_last_report_s"]
                share = per_trace_ingest * n
                a["traces_per_hour"] = round(n / wall * 3600)
                a["results_per_hour"] = round(a["results"] / wall * 3600)
                a["traces_per_hour_with_ingest"] = round(n / (wall + share) * 3600)
                a["ingest_share_s"] = round(share, 2)
                # Linear extrapolation to the 100,000 traces at the measured rates.
                a["extrapolated_100k_s"] = round(wall / n * 100_000, 1)
                a["extrapolated_100k_with_ingest_s"] = round(
                    (wall / n + per_trace_ingest) * 100_000, 1
                )
            elif done:
                a["traces_per_hour_so_far"] = round(done / a["wall_s"] * 3600)
                a["results_per_hour_so_far"] = round(a["results_done"] / a["wall_s"] * 3600)
                a["extrapolated_100k_s_at_this_rate"] = round(a["wall_s"] / done * 100_000, 1)
            screen = [r["report"].get("screening") for r in a["runs"] if r.get("report")]
            if screen and all(screen):
                keys_sum = ("scanned", "flagged", "near_tie", "decoded", "control")
                a["screening_total"] = {k: sum(s.get(k) or 0 for s in screen) for k in keys_sum}
            result["phases"][label] = a
            _log(
                f"{label}: {'complete' if a['complete'] else 'INCOMPLETE'}, "
                f"{done}/{a['results']} results in {a['wall_s']:.1f} s"
            )
            _write(result_path, result)
    finally:
        if workers:
            result["worker_peak_rss_mib"] = max(_peak_rss_mib(w.pid) or 0 for w in workers)
        if api is not None:
            result["api_peak_rss_mib"] = _peak_rss_mib(api.pid)
        for w in workers:
            _stop(w, "worker")
        _stop(api, "api")
        if args.backend == "pg":  # this run's RQ keys (its jobs, queues, results)
            try:
                import redis

                r = redis.Redis.from_url(args.redis_url)
                for pattern in (f"*e2e{tag}*", f"*e2e-{tag}*"):
                    for k in r.scan_iter(pattern, count=1000):
                        r.delete(k)
                for member in r.smembers("rq:queues"):
                    if f"e2e{tag}".encode() in member:
                        r.srem("rq:queues", member)
            except Exception as e:  # best effort: the keys are under a prefix of their own
                _log(f"Redis keys of queue prefix e2e{tag} left: {e}")
        if args.backend == "embedded" and not args.keep_database:
            db_file = str(database_url).removeprefix("sqlite:///")
            for suffix in ("", "-wal", "-shm", "-journal"):
                Path(db_file + suffix).unlink(missing_ok=True)
        fresh = server_url is not None and not args.use_database
        if fresh and database_url is not None and not args.keep_database:
            from ingest import drop_database

            drop_database(str(server_url), database_url)
        _write(result_path, result)

    # Where the time went: the slowest of the audit's own phases (ingest and the audits; the
    # warm-up is the worker's start, reported apart), and the replaying thread's profile.
    timed = {
        k: float(v["wall_s"])
        for k, v in result["phases"].items()
        if isinstance(v, dict) and "wall_s" in v and k != "warmup"
    }
    slowest = max(timed, key=lambda k: timed[k]) if timed else None
    result["slowest_phase"] = slowest
    if profile.exists():
        from _stack_sampler import summarise

        result["worker_profile"] = summarise(profile, windows)
        result["profile_of_slowest_phase"] = (
            "ingest runs in the API processes, which are not sampled (benchmarks/ingest.py and"
            " ingest_profile.py profile them)"
            if slowest == "ingest"
            else result["worker_profile"].get("windows", {}).get(slowest or "")
        )
    _write(result_path, result)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("command", choices=["prepare", "audit", "all"])
    ap.add_argument("--work", type=Path, required=True, help="model, traces.jsonl, prepare.json")
    ap.add_argument("--out", type=Path, default=None, help="results and logs (default --work)")
    ap.add_argument("--device", default="cuda", help="cuda or cpu")
    ap.add_argument("--model", type=Path, default=None, help="a checkpoint: no training")
    ap.add_argument("--model-name", default="e2e-llama")
    g = ap.add_argument_group("training (prepare, without --model)")
    g.add_argument("--minutes", type=float, default=2.0)
    g.add_argument("--hidden", type=int, default=2048)
    g.add_argument("--layers", type=int, default=24)
    g.add_argument("--intermediate", type=int, default=5632)
    g.add_argument("--heads", type=int, default=32)
    g.add_argument("--kv-heads", type=int, default=4)
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--warmup", type=int, default=50)
    g.add_argument("--seq-len", type=int, default=512)
    g.add_argument("--max-positions", type=int, default=1024)
    g.add_argument("--save-dtype", choices=("fp32", "bf16"), default="bf16")
    g.add_argument("--threads", type=int, default=8)
    g = ap.add_argument_group("traces (prepare)")
    g.add_argument("--unique", type=int, default=512, help="distinct prompts")
    g.add_argument("--prompt-tokens", type=int, default=32)
    g.add_argument("--output-tokens", type=int, default=480)
    g.add_argument("--gen-batch", type=int, default=256, help="prompts a generate() call")
    g.add_argument("--logged-dtype", default="bf16")
    g.add_argument("--top-k", type=int, default=0, help="logged top-k logits (0: none)")
    g = ap.add_argument_group("the audit")
    g.add_argument("--backend", choices=["pg", "embedded"], default="pg")
    g.add_argument(
        "--database-url",
        default=os.environ.get(
            "REPLAY_AUDIT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
        help="pg: the server (a fresh database is created on it and dropped)",
    )
    g.add_argument("--use-database", action="store_true", help="pg: use --database-url as is")
    g.add_argument("--keep-database", action="store_true")
    g.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    g.add_argument("--traces", type=int, default=20_000)
    g.add_argument("--run-size", type=int, default=MAX_RUN, help="traces a run (<= 10,000)")
    g.add_argument(
        "--modes",
        nargs="+",
        default=["auto"],
        choices=["auto", "scan", "scan_then_decode", "decode"],
        help="one audit per mode, in order (auto: the request names none)",
    )
    g.add_argument("--target-dtype", default="fp16")
    g.add_argument("--control-fraction", type=float, default=None)
    g.add_argument("--scan-flag-ulps", type=float, default=None)
    g.add_argument("--run-extra", default=None, help="JSON merged into each POST /v1/replays")
    g.add_argument("--scan-token-budget", type=int, default=None)
    g.add_argument("--warmup-traces", type=int, default=4)
    g.add_argument("--api-workers", type=int, default=2)
    g.add_argument(
        "--workers",
        type=int,
        default=1,
        help="pg: replay worker processes (on CUDA, worker i on GPU i: the several-GPU ratio)",
    )
    g.add_argument(
        "--workers-per-gpu",
        type=int,
        default=1,
        help="pg on CUDA: workers sharing a GPU (worker i on GPU i // N: one's CPU work overlaps "
        "another's GPU work), each started with --processes 1: as `worker --processes N`",
    )
    g.add_argument("--clients", type=int, default=4)
    g.add_argument("--poll-s", type=float, default=0.5)
    g.add_argument("--hz", type=float, default=50.0, help="stack samples a second")
    g.add_argument("--deadline-s", type=float, default=480.0, help="audit command's time limit")
    args = ap.parse_args()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    prepared = None
    if args.command in ("prepare", "all"):
        prepared = prepare(args)
        _log(f"prepare: {prepared['wall_s']} s")
        if args.out is not None:
            _write(args.out / "prepare.json", prepared)
    if args.command in ("audit", "all"):
        result = audit(args, prepared)
        print(json.dumps(result, indent=1, default=str))
    elif prepared is not None:
        print(json.dumps(prepared, indent=1, default=str))


if __name__ == "__main__":
    main()
