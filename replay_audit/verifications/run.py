"""One verification of logged traces against a checkpoint, as the CLI and the worker's job run
it. Workers and the CLI only."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from replay_audit.engine.pool import EnginePool
from replay_audit.replays.domain import LoggedTrace, ResolvedArm
from replay_audit.stats.verification import Calibration, Claim
from replay_audit.verifications.domain import (
    GroupReport,
    TraceEvidence,
    claim_label,
    group_name,
    judge_group,
)
from replay_audit.verifications.scan import scan_evidence, trace_claim

#: The calibration of a claim (its `claim_key`), found or measured.
CalibrationSource = Callable[[Claim], Calibration]


@dataclass(frozen=True)
class Verification:
    groups: list[GroupReport]
    evidence: list[TraceEvidence]
    calibrations: list[Calibration]
    #: What each claim's scan ran (`ResolvedArm`), by claim label.
    arms: dict[str, ResolvedArm]


def verify(
    traces: Sequence[LoggedTrace],
    model_dir: Path,
    pool: EnginePool,
    calibration_for: CalibrationSource,
    *,
    names: Sequence[str | None] | None = None,
    group_of: Sequence[str] | None = None,
) -> Verification:
    """Each group's verdict (`group_of[i]`: trace i's group; one group "all" by default), split
    by the configuration its traces claim: each claim has its own null."""
    arms: dict[str, ResolvedArm] = {}
    evidence = scan_evidence(traces, pool, model_dir, ids=names, arms=arms)
    labels = list(group_of) if group_of is not None else ["all"] * len(traces)
    members: dict[tuple[str, str], list[int]] = {}
    claims: dict[str, Claim] = {}
    for i, trace in enumerate(traces):
        claim = trace_claim(trace)
        key = claim_label(claim)
        claims[key] = claim
        members.setdefault((labels[i], key), []).append(i)
    cals: dict[str, Calibration] = {}
    groups = []
    for (label, key), idx in sorted(members.items()):
        if key not in cals:
            cals[key] = calibration_for(claims[key])
        name = group_name(label, claims[key])
        groups.append(judge_group(name, [evidence[i] for i in idx], cals[key]))
    return Verification(groups, evidence, list(cals.values()), arms)
