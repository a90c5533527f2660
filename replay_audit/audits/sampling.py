"""Which traces a scheduled audit replays: reproducible sampling of a window's candidates
(the policies: docs/audits.md, "Sampling"). Pure (stdlib and numpy).

Every candidate gets a uniform number u in (0, 1) from sha256(seed, due time, trace id): no
random generator state, so the same seed and the same data select the same traces on any
machine and any Python or NumPy version, and a trace added to or removed from the window does
not reshuffle the others. low_margin_first gives a trace logged without top-k the median weight
of the others (neutral: no evidence either way).
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, Literal, TypeVar

import numpy as np
import numpy.typing as npt

from replay_audit.diff.margin import step_numerics

Policy = Literal["uniform", "stratified", "low_margin_first"]

#: Added to the min margin before inverting it: a tie (margin 0) weighs 1 / MARGIN_FLOOR, and
#: margins below the paper's gate threshold (1e-3) all count as "about to flip".
MARGIN_FLOOR: Final = 1e-3

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Candidate:
    """A trace in the window. `stratum` is (model name, numerical configuration id)."""

    trace_id: int
    public_id: str
    stratum: tuple[str, str]
    #: Smallest top-1 minus top-2 logit over the logged steps; None without logged top-k.
    min_margin: float | None = None


def sample_seed(seed: int, due_at: datetime) -> str:
    """The material every u of one audit run derives from: (schedule seed, due time)."""
    return f"{seed}:{due_at.astimezone(UTC).isoformat()}"


def unit(seed_material: str, public_id: str) -> float:
    """A uniform number in (0, 1), a pure function of (seed material, trace id)."""
    digest = hashlib.sha256(f"{seed_material}|{public_id}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") + 0.5) / 2.0**64


def min_logged_margin(top_k_logits: npt.NDArray[np.float32] | None, k: int | None) -> float | None:
    """The smallest top-1 minus top-2 logit over a trace's logged steps (row-major (step, rank)
    logits, as stored); None when fewer than two logits per step were logged."""
    if top_k_logits is None or k is None or k < 2 or top_k_logits.size < k:
        return None
    # Sorted descending on ingest, but do not rely on it: step_numerics orders each row.
    margins = step_numerics(np.asarray(top_k_logits).reshape(-1, k)).margins
    margins = margins[np.isfinite(margins)]
    return float(margins.min()) if margins.size else None


def largest_remainder(counts: Mapping[K, int], size: int) -> dict[K, int]:
    """Split `size` across strata in proportion to `counts` (Hamilton's method): each gets the
    floor of its exact share, and the seats left go to the largest remainders (ties: the larger
    stratum, then key order). Quotas never exceed a stratum's count; with size >= the total,
    every stratum is taken whole."""
    total = sum(counts.values())
    if size >= total:
        return dict(counts)
    quotas = {key: size * n // total for key, n in counts.items()}
    left = size - sum(quotas.values())
    order = sorted(counts, key=lambda key: (-(size * counts[key] % total), -counts[key], str(key)))
    for key in order[:left]:
        quotas[key] += 1
    return quotas


def _smallest(keyed: Sequence[tuple[float, Candidate]], k: int) -> list[Candidate]:
    return [c for _, c in sorted(keyed, key=lambda kc: (kc[0], kc[1].public_id))[:k]]


def weight(min_margin: float) -> float:
    """low_margin_first's weight of a trace whose smallest logged margin is `min_margin`."""
    return 1.0 / (max(min_margin, 0.0) + MARGIN_FLOOR)


def sample(
    candidates: Sequence[Candidate], size: int, policy: Policy, seed_material: str
) -> list[Candidate]:
    """`size` candidates (all of them if fewer), chosen by `policy`, in trace-id order."""
    if size <= 0 or not candidates:
        return []
    u = {c.public_id: unit(seed_material, c.public_id) for c in candidates}
    if policy == "uniform":
        chosen = _smallest([(u[c.public_id], c) for c in candidates], size)
    elif policy == "stratified":
        strata: dict[tuple[str, str], list[Candidate]] = defaultdict(list)
        for c in candidates:
            strata[c.stratum].append(c)
        quotas = largest_remainder({s: len(cs) for s, cs in strata.items()}, size)
        chosen = []
        for s, cs in strata.items():
            chosen += _smallest([(u[c.public_id], c) for c in cs], quotas[s])
    elif policy == "low_margin_first":
        known = [weight(c.min_margin) for c in candidates if c.min_margin is not None]
        neutral = float(np.median(known)) if known else 1.0
        keyed = []
        for c in candidates:
            w = weight(c.min_margin) if c.min_margin is not None else neutral
            keyed.append((-math.log(u[c.public_id]) / w, c))
        chosen = _smallest(keyed, size)
    else:
        raise ValueError(f"unknown sampling policy {policy!r}")
    return sorted(chosen, key=lambda c: c.public_id)


def presample(candidates: Sequence[Candidate], size: int, seed_material: str) -> list[Candidate]:
    """A uniform subset of at most `size`: how low_margin_first bounds the number of traces
    whose logits it must load. Its u are drawn apart from `sample`'s (another seed suffix), so
    the pool's membership says nothing about a trace's key inside the pool."""
    if len(candidates) <= size:
        return list(candidates)
    material = f"{seed_material}:pool"
    return sorted(
        _smallest([(unit(material, c.public_id), c) for c in candidates], size),
        key=lambda c: c.public_id,
    )
