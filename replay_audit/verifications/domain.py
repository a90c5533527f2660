"""What a verification works on, torch-free: each trace's evidence (its deficits along the
logged path), the claim it is scanned in, and the verdict of a group of them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Final

import numpy as np

from replay_audit.diff.deficit import TokenDeficits
from replay_audit.engine.protocol import Intervention, SamplingRecipe, Target
from replay_audit.replays.domain import ResolvedArm
from replay_audit.stats.verification import Calibration, Claim, GroupVerdict, verdict

#: Worst tokens kept per trace for the report (largest deficits first).
WORST_TOKENS: Final = 5
#: Why sampled traces are set apart rather than verified.
SAMPLED_NOTE: Final = (
    "sampled traces that record no seeded sampler we reproduce (decoding.sampling: "
    "transformers' or vLLM's, with its seed) are counted and set apart: without the "
    "provider's noise their tokens are not evidence about the claimed computation"
)


def claim_target(logged: Target) -> Target:
    """The configuration a trace claims, as the scan runs it: the logged one, one row, no
    intervention (the deficits are the native logits')."""
    return replace(logged, batch_size=1, intervention=Intervention(), kv_cache=None)


def claim_key(target: Target) -> Claim:
    """The claim a calibration is for: body and head formats and attention kernel."""
    return Claim(
        dtype=target.dtype, lm_head_dtype=target.head_dtype, attn_kernel=target.attn_kernel
    )


def claimed_target(claim: Claim) -> Target:
    """The configuration `claim` names, as the scan runs it (see `claim_target`)."""
    return Target(claim["dtype"], claim["lm_head_dtype"], claim["attn_kernel"], 1, Intervention())


@dataclass(frozen=True)
class WorstToken:
    """One of a trace's largest deficits: step, logged token, the reference's choice, deficit."""

    step: int
    logged: int
    reference: int
    deficit: float
    deficit_ulps: float
    rank: int


@dataclass(frozen=True, eq=False)
class TraceEvidence:
    """One trace scanned in its claimed configuration: its deficits, or why it has none."""

    trace_id: str | None
    deficits: TokenDeficits | None
    worst: tuple[WorstToken, ...] = ()
    sampled: bool = False
    error: str | None = None

    @property
    def tokens(self) -> int:
        return len(self.deficits) if self.deficits is not None else 0


def worst_tokens(
    deficits: TokenDeficits, logged: Sequence[int], reference: Sequence[int], n: int = WORST_TOKENS
) -> tuple[WorstToken, ...]:
    """The `n` steps with the largest nonzero deficits, largest first."""
    order = np.argsort(-deficits.deficit_ulps, kind="stable")[:n]
    return tuple(
        WorstToken(
            step=int(t),
            logged=int(logged[t]),
            reference=int(reference[t]),
            deficit=float(deficits.deficit[t]),
            deficit_ulps=float(deficits.deficit_ulps[t]),
            rank=int(deficits.rank[t]),
        )
        for t in order
        if deficits.deficit_ulps[t] > 0
    )


@dataclass(frozen=True)
class GroupReport:
    """A group's verdict, with its traces counted: verified, sampled (set apart), failed."""

    group: str
    result: GroupVerdict
    sampled: int
    failed: int
    notes: tuple[str, ...] = ()
    #: Where its null was measured (`platform_label`), where its traces were logged (set by
    #: `cover_platforms`), and whether the null covers each (logged, scanning) pair (None: not
    #: known, before `cover_platforms`).
    null_platform: str | None = None
    logged_platforms: tuple[str, ...] = ()
    null_covers_platform: bool | None = None


def platform_label(device: str, gpu_name: str | None) -> str:
    """A platform as the report names it: `cpu`, `cuda (NVIDIA H200)`."""
    return device + (f" ({gpu_name})" if gpu_name else "")


def group_name(label: str, claim: Claim) -> str:
    """The name of the group of traces labelled `label` ("all": no grouping) that claim
    `claim`: e.g. `provider-x · bf16 / head bf16 / sdpa`."""
    key = claim_label(claim)
    return key if label == "all" else f"{label} · {key}"


def cover_platforms(
    groups: Sequence[GroupReport],
    logged: Mapping[str, Sequence[str]],
    scanning: str | None,
) -> list[GroupReport]:
    """`groups` with the platforms their traces were logged on (`logged`: group name -> each
    trace's `platform_label`) and whether their null covers them: a null is measured where it
    was generated and scanned, so it covers traces logged on that platform and scanned there
    (`scanning`), and says nothing of another device kind or GPU, whose numerics it never ran.
    An uncovered group says so in a note naming both platforms."""
    out = []
    for g in groups:
        seen = tuple(sorted(set(logged.get(g.group, ()))))
        if g.null_platform is None:
            out.append(replace(g, logged_platforms=seen))
            continue
        other = [p for p in seen if p != g.null_platform]
        scanned_elsewhere = scanning is not None and scanning != g.null_platform
        covered = not other and not scanned_elsewhere
        notes = list(g.notes)
        if other:
            notes.append(
                f"traces logged on {', '.join(other)} are verified against a null measured on "
                f"{g.null_platform}: the null did not measure that pair, so the false-alarm rate "
                "is not promised for it (numerics of another device or GPU may differ by more "
                "than the null's benign variations); measure the null on the logged platform"
            )
        if scanned_elsewhere:
            notes.append(
                f"scanned on {scanning} against a null measured on {g.null_platform}: the null "
                "did not measure this scan's numerics; measure it here"
            )
        out.append(
            replace(g, logged_platforms=seen, null_covers_platform=covered, notes=tuple(notes))
        )
    return out


def judge_group(
    group: str, evidence: Sequence[TraceEvidence], calibration: Calibration
) -> GroupReport:
    """The verdict on one group: its greedy traces' deficits against `calibration`; sampled
    traces and traces that could not be scanned are counted, not judged."""
    verified = [
        e.deficits.deficit_ulps for e in evidence if e.deficits is not None and not e.sampled
    ]
    sampled = sum(e.sampled for e in evidence)
    failed = sum(e.deficits is None and not e.sampled for e in evidence)
    notes = [SAMPLED_NOTE] if sampled else []
    notes += calibration.notes
    result = verdict(verified, calibration)
    if result.beyond_null_reach:
        notes.append(reach_note(result.tokens, calibration.reach))
    elif result.decided_by is not None and result.decided_by != "outside_tie_band":
        notes.append(
            f"decided by {result.decided_by} ({result.score:.4g} above its threshold "
            f"{result.threshold:.4g}): a rounding-level difference (8-bit weights, an FP8 KV "
            "cache, another TP degree) more often than tampering; read the worst tokens"
        )
    null_platform = platform_label(calibration.platform["device"], calibration.platform["gpu_name"])
    return GroupReport(group, result, sampled, failed, tuple(notes), null_platform=null_platform)


def reach_note(tokens: int, reach: int | None) -> str:
    """What a group larger than its null backs is told."""
    backed = f"{reach:,} tokens" if reach is not None else "no calibrated budget"
    return (
        f"this group holds {tokens:,} tokens, more than the null backs ({backed}: every benign "
        "variation holds at least that many): judged at that budget's threshold, the cautious "
        "one, but its false-alarm rate is not measured at this size; measure the null on more "
        "prompts (--null-prompts, REPLAY_AUDIT_VERIFY_NULL_PROMPTS)"
    )


def claim_label(claim: Claim) -> str:
    """e.g. `bf16 / head bf16 / sdpa`, and a sampled claim's recipe: `... / sampled
    transformers T=0.7`."""
    label = (
        f"{claim['dtype']} / head {claim['lm_head_dtype']} / {claim['attn_kernel'] or 'default'}"
    )
    sampling = claim.get("sampling")
    if sampling is None:
        return label
    return f"{label} / sampled {SamplingRecipe.from_json(sampling).label()}"


def overall(groups: Sequence[GroupReport]) -> str:
    """One verdict for several groups: inconsistent if any is, else insufficient if any is."""
    verdicts = {g.result.verdict for g in groups}
    for v in ("inconsistent", "insufficient"):
        if v in verdicts:
            return v
    return "consistent" if verdicts else "insufficient"


def _finite(x: float | np.floating[Any] | None) -> float | None:
    return None if x is None or not np.isfinite(x) else float(x)


def group_json(g: GroupReport) -> dict[str, Any]:
    """The group's verdict figures (a non-finite one as null), then its counts and notes."""
    figures = {
        k: _finite(v) if isinstance(v, float | np.floating) else v
        for k, v in asdict(g.result).items()
    }
    counts = {
        "sampled": g.sampled,
        "failed": g.failed,
        "null_platform": g.null_platform,
        "logged_platforms": list(g.logged_platforms),
        "null_covers_platform": g.null_covers_platform,
        "notes": list(g.notes),
    }
    return {"group": g.group, **figures, **counts}


def evidence_json(e: TraceEvidence) -> dict[str, Any]:
    d = e.deficits
    return {
        "trace": e.trace_id,
        "tokens": e.tokens,
        "sampled": e.sampled,
        "error": e.error,
        "mismatches": int((d.deficit > 0).sum()) if d is not None else None,
        "outside_tie_band": int((~d.in_tie_band).sum()) if d is not None else None,
        "max_deficit_ulps": _finite(float(d.deficit_ulps.max()))
        if d is not None and len(d)
        else None,
        "worst": [w.__dict__ for w in e.worst],
    }


def report_json(
    groups: Sequence[GroupReport],
    evidence: Sequence[TraceEvidence],
    arms: Mapping[str, ResolvedArm] | None = None,
) -> dict[str, Any]:
    """A verification as the CLI prints it with --json and the service stores it; the figures
    at the top are the most suspicious group's (the largest score over threshold)."""
    out: dict[str, Any] = {"verdict": overall(groups)}
    if groups:
        top = max(
            groups,
            key=lambda g: (g.result.score - g.result.threshold) if g.result.tokens else -np.inf,
        )
        head = group_json(top)
        out.update({k: head[k] for k in ("score", "threshold", "false_alarm_rate", "statistic")})
    out["tokens"] = sum(g.result.tokens for g in groups)
    out["sampled"] = sum(g.sampled for g in groups)
    out["groups"] = [group_json(g) for g in groups]
    out["traces"] = [evidence_json(e) for e in evidence]
    out["resolved"] = {
        claim: json.loads(json.dumps(arm.to_json())) for claim, arm in (arms or {}).items()
    }
    return out
