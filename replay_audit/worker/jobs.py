"""The replay job: what a runner executes for one `replay_jobs` row.

Contract (DESIGN.md): the job takes an id, reloads its rows, is idempotent, and writes each
trace's results in one transaction. It may be killed at any point and run again: results already
written are skipped (and `INSERT ... ON CONFLICT DO NOTHING` on the unique (run, trace,
comparison) key makes a race between two copies harmless); the run is finalised by whichever job
finishes last, under a row lock on the run.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import replay_audit.auth.models  # noqa: F401  (mappers resolve related classes by name)
from replay_audit.config import Settings, get_settings
from replay_audit.db.base import utcnow
from replay_audit.db.unit_of_work import session_scope
from replay_audit.engine.pool import EnginePool
from replay_audit.engine.protocol import Intervention, Target
from replay_audit.engine.replayer import TraceReplay, compare_arms, replay_trace
from replay_audit.exceptions import ReplayAuditError
from replay_audit.replays import repository
from replay_audit.replays.models import ReplayJob, ReplayRun
from replay_audit.traces import service as traces_service
from replay_audit.traces.models import Trace
from replay_audit.traces.schemas import TraceCreate
from replay_audit.worker.models import ModelNotFound, find_checkpoint

log = logging.getLogger(__name__)

#: A job started this many times without finishing is failed for good: its remaining traces get
#: failed results saying so, and the run completes instead of looping forever.
MAX_JOB_ATTEMPTS = 5

_pool: EnginePool | None = None
_pool_lock = threading.Lock()


def engine_pool() -> EnginePool:
    """This process's engines: each checkpoint is loaded once per format and kept loaded
    (a GPU worker must not fork after CUDA initialisation, so it never reloads per job)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = EnginePool(max_engines=8)
        return _pool


def set_engine_pool(pool: EnginePool | None) -> None:
    """Replace this process's pool (tests give a pool of fake engines)."""
    global _pool
    with _pool_lock:
        _pool = pool


@dataclass(frozen=True)
class _RunSpec:
    run_id: int
    mode: str
    top_k: int
    targets: list[dict[str, Any]]
    comparisons: list[dict[str, Any]]


def run_replay_job(job_id: int, database_url: str | None = None) -> None:
    """Replay every (trace, comparison) of job `job_id` that has no result yet, then finalise the
    run if this was its last unfinished job."""
    settings = get_settings()
    url = database_url or settings.database_url
    with session_scope(url) as s:
        job = s.get(ReplayJob, job_id)
        if job is None or job.status == "done":
            return
        if job.attempts >= MAX_JOB_ATTEMPTS:
            repository.fail_job(
                s, job_id, f"gave up after {job.attempts} attempts (worker killed or crashing)"
            )
            return
        run = s.get(ReplayRun, job.run_id)
        assert run is not None  # FK
        now = utcnow()
        job.status, job.attempts, job.updated_at = "running", job.attempts + 1, now
        if run.status == "queued":
            run.status, run.started_at = "running", now
        spec = _RunSpec(
            run.id, run.mode, int(run.request.get("top_k", 5)), run.targets, run.comparisons
        )
        trace_ids = list(job.trace_ids)

    for trace_id in trace_ids:
        with session_scope(url) as s:
            missing = repository.missing_comparisons(
                s, spec.run_id, trace_id, len(spec.comparisons)
            )
            trace_row = s.get(Trace, trace_id) if missing else None
            trace = traces_service.to_read(trace_row) if trace_row is not None else None
        if not missing:
            continue
        rows = (
            _replay_one(trace, spec, missing, settings)
            if trace is not None
            else [_failed(c, "trace was deleted") for c in missing]
        )
        with session_scope(url) as s:
            repository.insert_results(s, spec.run_id, trace_id, rows)
            repository.touch_job(s, job_id)  # the heartbeat the reconciler reads

    with session_scope(url) as s:
        repository.finish_job(s, job_id)


def _replay_one(
    trace: TraceCreate, spec: _RunSpec, comparisons: list[int], settings: Settings
) -> list[dict[str, Any]]:
    pool = engine_pool()
    try:
        model_dir = find_checkpoint(trace.model.weights_sha256, settings.model_dirs, pool)
    except ModelNotFound as e:
        return [_failed(c, str(e)) for c in comparisons]
    out = []
    for c in comparisons:
        comp = spec.comparisons[c]
        try:
            replay = _compare(trace, spec, comp, pool, model_dir)
        except ReplayAuditError as e:
            out.append(_failed(c, e.message))
            continue
        except (RuntimeError, ValueError, MemoryError) as e:  # engine-side failure of this item
            log.exception("replay of trace %s comparison %d failed", trace.external_id, c)
            out.append(_failed(c, f"{type(e).__name__}: {e}"))
            continue
        out.append(_result_row(c, replay))
    return out


def resolve_target(spec: dict[str, Any], trace: TraceCreate) -> Target:
    """A stored target spec as an engine `Target`; `{"self": true}` is the trace's own logged
    configuration (no intervention)."""
    if spec.get("self"):
        return Target.from_config(trace.config)
    iv = spec.get("intervention") or {}
    return Target(
        dtype=spec["dtype"],
        lm_head_dtype=spec.get("lm_head_dtype"),
        attn_kernel=spec.get("attn_kernel"),
        batch_size=int(spec.get("batch_size") or 1),
        intervention=Intervention(
            kind=iv.get("kind", "none"),
            tau=float(iv.get("tau", 1e-3)),
            tau_ulps=iv.get("tau_ulps"),
            top_k=int(iv.get("top_k", 8)),
        ),
    )


def _compare(
    trace: TraceCreate,
    spec: _RunSpec,
    comp: dict[str, Any],
    pool: EnginePool,
    model_dir: Path,
) -> TraceReplay:
    target_b = resolve_target(spec.targets[comp["b"]], trace)
    extractor = "gsm8k" if trace.reference_answer is not None else None
    if comp["a"] == "logged":
        return replay_trace(
            trace,
            target_b,
            pool,
            model_dir=model_dir,
            mode=spec.mode,  # type: ignore[arg-type]
            top_k=spec.top_k,
            extractor=extractor,
        )
    target_a = resolve_target(spec.targets[comp["a"]], trace)
    return compare_arms(
        trace, target_a, target_b, pool, model_dir=model_dir, top_k=spec.top_k, extractor=extractor
    )


def _failed(comparison: int, reason: str) -> dict[str, Any]:
    return {"comparison": comparison, "status": "failed", "error": reason[:4000], "detail": {}}


def _result_row(comparison: int, r: TraceReplay) -> dict[str, Any]:
    d = r.to_dict()
    m = d["margin_at_divergence"] or {}
    logged, replay = m.get("logged") or {}, m.get("replay") or {}
    semantic = d.get("semantic") or {}
    logged_arm = d.get("logged_arm") or {}
    detail = {
        k: d[k]
        for k in (
            "mode",
            "single_step",
            "semantic",
            "environment",
            "target",
            "logged_environment",
            "changed_steps",
            "external_id",
            "margins",
            "gate_fired_steps",
            "replay_text",
        )
    }
    detail["margin_at_divergence"] = d["margin_at_divergence"]
    if logged_arm:
        detail["logged_arm"] = {k: v for k, v in logged_arm.items() if k != "output_token_ids"}
    return {
        "comparison": comparison,
        "status": "ok",
        "error": None,
        "exact_match": d["exact_match"],
        "first_divergence_step": d["first_divergence_step"],
        "category": d["category"],
        "margin_logged": logged.get("abs"),
        "margin_logged_ulps": logged.get("ulps"),
        "margin_logged_source": logged.get("source"),
        "margin_replay": replay.get("abs"),
        "margin_replay_ulps": replay.get("ulps"),
        "gate_triggers": d["gate_triggers"],
        "n_steps": d["steps"],
        "trigger_rate": d["trigger_rate"],
        "mean_gap": d["mean_gap"],
        "tie": d["tie"],
        "cascade_length": d["cascade_length"],
        "length_difference": d["length_difference"],
        "semantic_agree": semantic.get("agree"),
        "answer_extractor": semantic.get("extractor"),
        "answer_a": semantic.get("logged_answer"),
        "answer_b": semantic.get("replay_answer"),
        "output_b": np.asarray(d["replay_output_token_ids"], np.int32),
        "output_a": (
            np.asarray(logged_arm["output_token_ids"], np.int32)
            if logged_arm.get("output_token_ids") is not None
            else None
        ),
        "detail": detail,
    }

