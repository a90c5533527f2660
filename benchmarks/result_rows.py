"""Issue 32: the CPU cost of a scan job's results, per result: building the rows of a window's
outcomes (`results.result_values`) and writing them (`repository.insert_results_of`, in the
transaction a replay job writes a window in), on SQLite and on PostgreSQL.

    python benchmarks/result_rows.py [--prompts 16] [--tokens 448] [--windows 8] \\
        [--server-url postgresql+psycopg://postgres@127.0.0.1:5432/test] [--profile] [--out F]
        [--cache F]

What it does:
  1. logs `--prompts` greedy BF16 generations of the bundled prompts with the bundled model
     (`replay_audit/assets/tiny-llama`, CPU) and replays each through the one pipeline in scan
     mode as a replay job does (`scan_items`, then `replay_items` with its scans), twice: FP16
     against the logged tokens and BF16 against them (the reproduction check's comparison), so
     every outcome is a real scan-mode `ReplayOutcome`;
  2. on a fresh SQLite file and a fresh PostgreSQL database (dropped afterwards), both migrated,
     stores `--windows` x 256 distinct traces (the generations under new external ids) and one
     run;
  3. per window of 256 traces (a scan job's `RERUN_WINDOW`), 2 results each: builds the rows
     (`result_values`, the outcomes reused round-robin) then writes them in one transaction
     (`session_scope` + `insert_results_of`, as `tasks._run_job` does, the commit included);
     the first window is a warm-up, the rest timed. Reports CPU ms of this process per result
     for building and for writing (and the write's wall ms, the database's time in it), the
     least of `--rounds` rounds (each on fresh trace ids: nothing conflicts), and with
     `--profile` cProfile's top functions of the writing.

Measured, never asserted: BENCHMARKS.md quotes it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pickle
import pstats
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy import func, select  # noqa: E402

from benchmarks.ingest import create_database, drop_database  # noqa: E402
from replay_audit.auth.service import create_api_key  # noqa: E402
from replay_audit.config import BUNDLED_MODEL_DIR  # noqa: E402
from replay_audit.db import migration  # noqa: E402
from replay_audit.db.engine import dispose_engines  # noqa: E402
from replay_audit.db.unit_of_work import session_scope  # noqa: E402
from replay_audit.engine import EnginePool, Target  # noqa: E402
from replay_audit.replays import repository  # noqa: E402
from replay_audit.replays.domain import LoggedTrace, ReplayOutcome, RunTarget  # noqa: E402
from replay_audit.replays.models import ReplayResult, ReplayRun  # noqa: E402
from replay_audit.replays.pipeline import (  # noqa: E402
    ReplayItem,
    ReplayOptions,
    replay_items,
    scan_items,
)
from replay_audit.replays.results import ResultRow, result_values  # noqa: E402
from replay_audit.traces import service as traces_service  # noqa: E402
from replay_audit.traces.models import Trace  # noqa: E402
from replay_audit.traces.schemas import TraceCreate  # noqa: E402

WINDOW = 256  # tasks.RERUN_WINDOW["scan"]
COMPARISONS = 2  # against the logged tokens, and the reproduction check's


def outcomes(n_prompts: int, tokens: int) -> tuple[list[dict[str, Any]], list[ReplayOutcome]]:
    """The logged generations (trace bodies) and, per generation, its two scan outcomes."""
    import torch

    from replay_audit.engine.generate import generate_traces

    torch.set_num_threads(1)
    path = ROOT / "replay_audit/assets/prompts.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()][:n_prompts]
    prompts = [(str(r["id"]), str(r["prompt"])) for r in rows]
    bodies = list(
        generate_traces(
            BUNDLED_MODEL_DIR, prompts, dtype="bf16", max_new_tokens=tokens, device="cpu"
        )
    )
    traces = [LoggedTrace.from_json(TraceCreate.model_validate(b).model_dump()) for b in bodies]
    pool = EnginePool(device="cpu")
    options = ReplayOptions("scan", check_weights=False)
    out: list[ReplayOutcome] = []
    per_target = []
    for dtype in ("fp16", "bf16"):
        items = [ReplayItem(t, RunTarget(Target(dtype)), BUNDLED_MODEL_DIR) for t in traces]
        scans = scan_items(items, pool, options).runs
        done = replay_items(items, pool, options, scans=scans)
        errors = [repr(o) for o in done if not isinstance(o, ReplayOutcome)]
        assert not errors, errors[:3]
        per_target.append(done)
    for fp16, bf16 in zip(*per_target, strict=True):
        out += [fp16, bf16]  # type: ignore[list-item]
    return bodies, out


def setup(url: str, bodies: list[dict[str, Any]], n_traces: int) -> tuple[int, list[int]]:
    """A migrated database holding `n_traces` traces (copies of `bodies` under new external
    ids) and one scan run: (run id, trace ids)."""
    migration.upgrade(url)
    with session_scope(url) as s:
        project_id = create_api_key(s, "bench", "admin").api_key.project_id
    for start in range(0, n_traces, 500):
        items = []
        for i in range(start, min(n_traces, start + 500)):
            body = dict(bodies[i % len(bodies)], external_id=f"bench-{i}")
            items.append(TraceCreate.model_validate(body))
        with session_scope(url) as s:
            traces_service.ingest_traces(s, project_id, items)
    with session_scope(url) as s:
        run = ReplayRun(
            public_id="rr_bench",
            project_id=project_id,
            status="running",
            mode="scan",
            compare="against_logged",
            request={},
            targets=[],
            comparisons=[],
            n_traces=n_traces,
            n_items=n_traces * COMPARISONS,
        )
        s.add(run)
        s.flush()
        run_id = run.id
        ids = sorted(s.scalars(Trace.__table__.select().with_only_columns(Trace.id)).all())
    return run_id, ids


def build(outs: list[ReplayOutcome], trace_ids: list[int]) -> list[tuple[int, list[ResultRow]]]:
    """A window's rows: each trace's two results, from the outcomes round-robin."""
    n = len(outs) // COMPARISONS
    return [
        (
            t,
            [result_values(c, outs[(k % n) * COMPARISONS + c]) for c in range(COMPARISONS)],
        )
        for k, t in enumerate(trace_ids)
    ]


def write(url: str, run_id: int, rows: list[tuple[int, list[ResultRow]]]) -> None:
    with session_scope(url) as s:  # a window's results in one transaction, as _run_job
        repository.insert_results_of(s, run_id, rows)


def measure(
    url: str, outs: list[ReplayOutcome], run_id: int, ids: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    windows = [ids[i : i + WINDOW] for i in range(0, len(ids), WINDOW)]
    per_round = len(windows) // args.rounds
    best: dict[str, float] = {}
    profiles = {"build": cProfile.Profile(), "write": cProfile.Profile()} if args.profile else {}
    for r in range(args.rounds):
        mine = windows[r * per_round : (r + 1) * per_round]
        write(url, run_id, build(outs, mine[0]))  # warm-up window
        build_s = write_s = write_wall = 0.0
        n = 0
        for w in mine[1:]:
            last = r == args.rounds - 1
            t0 = time.process_time()
            with _profiled(profiles.get("build") if last else None):
                rows = build(outs, w)
            t1, w1 = time.process_time(), time.perf_counter()
            with _profiled(profiles.get("write") if last else None):
                write(url, run_id, rows)
            t2, w2 = time.process_time(), time.perf_counter()
            build_s += t1 - t0
            write_s += t2 - t1
            write_wall += w2 - w1
            n += sum(len(x) for _, x in rows)
        for key, value in (
            ("build_ms", build_s),
            ("write_ms", write_s),
            ("write_wall_ms", write_wall),
        ):
            best[key] = min(best.get(key, float("inf")), 1000 * value / n)
    with session_scope(url) as s:
        stored = s.scalar(
            select(func.count()).select_from(ReplayResult).where(ReplayResult.run_id == run_id)
        )
    result: dict[str, Any] = {k: round(v, 4) for k, v in best.items()}
    result["total_ms"] = round(best["build_ms"] + best["write_ms"], 4)
    result["results_stored"] = stored
    for name, profile in profiles.items():
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(args.top)
        result[f"profile_{name}"] = text.getvalue()
    return result


@contextlib.contextmanager
def _profiled(profile: cProfile.Profile | None) -> Iterator[None]:
    if profile is None:
        yield
        return
    profile.enable()
    try:
        yield
    finally:
        profile.disable()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=448)
    ap.add_argument("--windows", type=int, default=6, help="windows of 256 traces a round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--server-url",
        default=os.environ.get(
            "REPLAY_AUDIT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
    )
    ap.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--cache", type=Path, help="the outcomes pickled here, read back if there (same inputs)"
    )
    args = ap.parse_args()

    t0 = time.perf_counter()
    if args.cache is not None and args.cache.exists():
        bodies, outs = pickle.loads(args.cache.read_bytes())
    else:
        bodies, outs = outcomes(args.prompts, args.tokens)
        if args.cache is not None:
            args.cache.write_bytes(pickle.dumps((bodies, outs)))
    report: dict[str, Any] = {
        "prompts": args.prompts,
        "tokens": args.tokens,
        "outcomes": len(outs),
        "mean_output_tokens": round(
            sum(len(b["output_token_ids"]) for b in bodies) / len(bodies), 1
        ),
        "outcomes_s": round(time.perf_counter() - t0, 1),
        "results_timed": (args.windows - 1) * args.rounds * WINDOW * COMPARISONS,
    }
    n_traces = args.windows * args.rounds * WINDOW
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends:
            if backend == "sqlite":
                url = f"sqlite:///{tmp}/bench.db"
            else:
                url = create_database(args.server_url)
            try:
                run_id, ids = setup(url, bodies, n_traces)
                report[backend] = measure(url, outs, run_id, ids, args)
            finally:
                if backend == "sqlite":
                    dispose_engines()
                else:
                    drop_database(args.server_url, url)
    profiles = {
        f"{b} {k[len('profile_') :]}": report[b].pop(k)
        for b in args.backends
        for k in list(report[b])
        if k.startswith("profile_")
    }
    print(json.dumps(report, indent=2))
    for name, text in profiles.items():
        print(f"--- {name}: cProfile of the last round ---\n{text}")
    if args.out is not None:
        args.out.write_text(json.dumps(report | {"profiles": profiles}, indent=2))


if __name__ == "__main__":
    main()
