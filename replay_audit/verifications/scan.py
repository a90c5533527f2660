"""The evidence of logged traces: each scanned in the configuration it claims, on a checkpoint,
several traces per forward (`pipeline.Arm.scan_batch`), the deficits of its logged tokens
computed from the scan's native logits. The claim's arm is resolved by the replay pipeline
(`resolve_arm`, as every replay's), so what the scan ran is recorded as a replay's is.
Torch-free itself: engines come from an `EnginePool` (workers and the CLI only)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from replay_audit.diff.deficit import draw_deficits, token_deficits
from replay_audit.engine.pool import EnginePool
from replay_audit.engine.protocol import (
    DEFAULT_SCAN_TOKEN_BUDGET,
    SamplingRecipe,
    ScanItem,
    Target,
)
from replay_audit.exceptions import ReplayAuditError
from replay_audit.replays.domain import LoggedTrace, ResolvedArm, RunTarget
from replay_audit.replays.pipeline import context_overflow, resolve_arm
from replay_audit.stats.verification import Claim
from replay_audit.verifications.domain import (
    TraceEvidence,
    claim_key,
    claim_label,
    claim_target,
    worst_tokens,
)

log = logging.getLogger(__name__)


def scan_evidence(
    traces: Sequence[LoggedTrace],
    pool: EnginePool,
    model_dir: Path,
    *,
    ids: Sequence[str | None] | None = None,
    token_budget: int = DEFAULT_SCAN_TOKEN_BUDGET,
    arms: dict[str, ResolvedArm] | None = None,
) -> list[TraceEvidence]:
    """Each trace's evidence, in order: greedy traces scanned in one batch per claimed
    configuration (its arm resolved against the group's first trace), sampled ones set apart
    unscanned. `arms`, where given, receives each claim's resolved arm by `claim_label`."""
    names = list(ids) if ids is not None else [t.external_id for t in traces]
    out: list[TraceEvidence | None] = [None] * len(traces)
    by_claim: dict[tuple[Target, SamplingRecipe | None], list[int]] = {}
    for i, trace in enumerate(traces):
        if not trace.greedy and trace.sampling is None:
            out[i] = TraceEvidence(names[i], None, sampled=True)
        elif trace.output_token_ids.size == 0:
            out[i] = TraceEvidence(names[i], None, error="no output tokens")
        else:
            recipe = trace.sampling.recipe if trace.sampling is not None else None
            by_claim.setdefault((claim_target(trace.config), recipe), []).append(i)
    for (claim, recipe), members in by_claim.items():
        try:
            arm = resolve_arm(traces[members[0]], RunTarget(claim), pool, model_dir)
            # A trace of another vocabulary or longer than the context is refused on its own,
            # as a replay refuses it, before any forward reads its ids.
            vocab, positions = arm.engine.vocab_size, arm.engine.max_positions
            for i in members:
                if traces[i].vocab_size != vocab:
                    why = f"the checkpoint's is {vocab}, the trace's {traces[i].vocab_size}"
                    out[i] = TraceEvidence(names[i], None, error=f"model.vocab_size: {why}")
                elif (long := context_overflow(traces[i], positions)) is not None:
                    out[i] = TraceEvidence(names[i], None, error=f"prompt_token_ids: {long}")
                elif (noise := noise_unreachable(traces[i], arm.resolved.device)) is not None:
                    out[i] = TraceEvidence(names[i], None, error=noise)
            members = [i for i in members if out[i] is None]
            # A trace's logits processors are part of the computation its tokens came from.
            items = [
                ScanItem(
                    traces[i].prompt_token_ids.tolist(),
                    traces[i].output_token_ids.tolist(),
                    traces[i].processors,
                    traces[i].sampling,
                )
                for i in members
            ]
            runs = arm.scan_batch(items, 2, token_budget)
            if arms is not None:
                label = claim_label(trace_claim(traces[members[0]])) if members else ""
                arms[label] = arm.resolved.ran(arm.engine.environment())
        except (ReplayAuditError, RuntimeError, ValueError) as e:
            log.exception("scan of %d traces in %s failed", len(members), claim)
            for i in members:
                out[i] = TraceEvidence(names[i], None, error=str(e)[:200])
            continue
        head = arm.resolved.lm_head_dtype
        for i, run in zip(members, runs, strict=True):
            ev = run.evidence
            if ev is None or (recipe is not None and ev.draw_deficits is None):
                out[i] = TraceEvidence(names[i], None, error="the engine measured no evidence")
                continue
            if recipe is not None and ev.draw_deficits is not None and ev.drawn is not None:
                assert ev.drawn_logits is not None
                d = draw_deficits(ev.draw_deficits, ev.drawn_logits, ev.ranks, head)
                reference = ev.drawn.tolist()
            else:
                d = token_deficits(run.steps.top_k_logits[:, 0], ev.logits, ev.ranks, head)
                reference = run.steps.native_token_ids.tolist()
            logged = traces[i].output_token_ids
            out[i] = TraceEvidence(names[i], d, worst_tokens(d, logged.tolist(), reference))
    return [e if e is not None else TraceEvidence(None, None, error="not scanned") for e in out]


def noise_unreachable(trace: LoggedTrace, device: str) -> str | None:
    """Why a sampled trace's noise cannot be drawn on `device` (None: it can): a CUDA
    generator's stream is reproduced on a CUDA device only."""
    sampling = trace.sampling
    if sampling is None or sampling.device != "cuda" or device.startswith("cuda"):
        return None
    return (
        "decoding.sampling: drawn by a CUDA generator, whose noise only a CUDA worker "
        f"reproduces; this scan runs on {device}"
    )


def trace_claim(trace: LoggedTrace) -> Claim:
    """What a trace claims: its configuration as the scan runs it (`claim_key`) and, sampled
    with a seed, its sampler's recipe: each claim has its own null."""
    claim = claim_key(claim_target(trace.config))
    if trace.sampling is not None:
        claim["sampling"] = trace.sampling.recipe.to_json()
    return claim


def deficit_arrays(evidence: Sequence[TraceEvidence]) -> list[np.ndarray]:
    """The per-token deficits in ulps of the traces that have them (not sampled)."""
    return [e.deficits.deficit_ulps for e in evidence if e.deficits is not None and not e.sampled]
