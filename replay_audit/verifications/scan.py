"""The evidence of logged traces: each scanned in the configuration it claims, on a checkpoint,
several traces per forward (`Engine.scan_batch`), the deficits of its logged tokens computed
from the scan's native logits. Torch-free itself: engines come from an `EnginePool` (workers and
the CLI only)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from replay_audit.diff.deficit import token_deficits
from replay_audit.engine.pool import EnginePool
from replay_audit.engine.protocol import DEFAULT_SCAN_TOKEN_BUDGET, Engine, ScanItem, Target
from replay_audit.exceptions import EngineError
from replay_audit.replays.domain import LoggedTrace
from replay_audit.verifications.domain import TraceEvidence, claim_target, worst_tokens

log = logging.getLogger(__name__)


def claim_engine(pool: EnginePool, model_dir: Path, claim: Target) -> Engine:
    """The engine of `claim` on `model_dir`; a kernel that cannot run here falls back to the
    engine's default (the scan's environment records which ran)."""
    try:
        return pool.get(model_dir, claim)
    except EngineError:
        if claim.attn_kernel is None:
            raise
        fallback = Target(claim.dtype, claim.lm_head_dtype, None, 1, claim.intervention)
        return pool.get(model_dir, fallback)


def scan_evidence(
    traces: Sequence[LoggedTrace],
    pool: EnginePool,
    model_dir: Path,
    *,
    ids: Sequence[str | None] | None = None,
    token_budget: int = DEFAULT_SCAN_TOKEN_BUDGET,
) -> list[TraceEvidence]:
    """Each trace's evidence, in order: greedy traces grouped by their claimed configuration
    and scanned in it, a batch per claim; sampled traces set apart unscanned."""
    names = list(ids) if ids is not None else [t.external_id for t in traces]
    out: list[TraceEvidence | None] = [None] * len(traces)
    by_claim: dict[Target, list[int]] = {}
    for i, trace in enumerate(traces):
        if not trace.greedy:
            out[i] = TraceEvidence(names[i], None, sampled=True)
        elif trace.output_token_ids.size == 0:
            out[i] = TraceEvidence(names[i], None, error="no output tokens")
        else:
            by_claim.setdefault(claim_target(trace.config), []).append(i)
    for claim, members in by_claim.items():
        try:
            engine = claim_engine(pool, model_dir, claim)
            # A trace's logits processors are part of the computation its tokens came from.
            items = [
                ScanItem(
                    traces[i].prompt_token_ids.tolist(),
                    traces[i].output_token_ids.tolist(),
                    traces[i].processors,
                )
                for i in members
            ]
            runs = engine.scan_batch(items, claim.intervention, 2, token_budget=token_budget)
        except (EngineError, RuntimeError, ValueError) as e:
            log.exception("scan of %d traces in %s failed", len(members), claim)
            for i in members:
                out[i] = TraceEvidence(names[i], None, error=str(e)[:200])
            continue
        head = engine.environment()["lm_head_dtype"]
        for i, run in zip(members, runs, strict=True):
            if run.evidence is None:
                out[i] = TraceEvidence(names[i], None, error="the engine measured no evidence")
                continue
            d = token_deficits(
                run.steps.top_k_logits[:, 0], run.evidence.logits, run.evidence.ranks, head
            )
            logged = traces[i].output_token_ids
            worst = worst_tokens(d, logged.tolist(), run.steps.native_token_ids.tolist())
            out[i] = TraceEvidence(names[i], d, worst)
    return [e if e is not None else TraceEvidence(None, None, error="not scanned") for e in out]


def deficit_arrays(evidence: Sequence[TraceEvidence]) -> list[np.ndarray]:
    """The per-token deficits in ulps of the traces that have them (not sampled)."""
    return [e.deficits.deficit_ulps for e in evidence if e.deficits is not None and not e.sampled]
