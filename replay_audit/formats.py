"""The vocabulary of the product (numerical formats and the ulp of each; modes, intervention
kinds, categories, cache kinds, margin sources, statuses), defined here once. Pure: stdlib and
numpy.

The names are the ones used everywhere in the API (`config.dtype`, `config.lm_head_dtype`):

    fp32      IEEE binary32          24-bit significand
    bf16      bfloat16               8-bit significand, fp32's exponent range
    fp16      IEEE binary16          11-bit significand
    fp8_e4m3  OCP FP8 E4M3 (fn)      4-bit significand (lm_head only)
    fp8_e5m2  OCP FP8 E5M2           3-bit significand (lm_head only)

ulp(x) is the spacing of the format's representable numbers at |x|: 2**(e - (p - 1)) where
e = floor(log2 |x|) clamped below at the format's smallest normal exponent, and p is the
significand precision. BF16 at 16.0 has p = 8, e = 4: ulp = 0.125, so a BF16 margin near 16 is
either 0 or at least 0.125. The values agree with torch.finfo(dtype).eps * 2**e (tested).
`ulp_array` is the one implementation; `ulp` is it at one value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

BodyDType = Literal["fp32", "bf16", "fp16"]
HeadDType = Literal["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]


@dataclass(frozen=True)
class Format:
    name: str
    precision: int  # significand bits including the implicit leading one
    min_normal_exponent: int
    max_finite: float
    body_ok: bool

    @property
    def eps(self) -> float:
        return 2.0 ** (1 - self.precision)


FORMATS: Final[dict[str, Format]] = {
    "fp32": Format("fp32", 24, -126, 3.4028234663852886e38, True),
    "bf16": Format("bf16", 8, -126, 3.3895313892515355e38, True),
    "fp16": Format("fp16", 11, -14, 65504.0, True),
    "fp8_e4m3": Format("fp8_e4m3", 4, -6, 448.0, False),
    "fp8_e5m2": Format("fp8_e5m2", 3, -14, 57344.0, False),
}
BODY_DTYPES: Final[tuple[str, ...]] = tuple(n for n, f in FORMATS.items() if f.body_ok)
HEAD_DTYPES: Final[tuple[str, ...]] = tuple(FORMATS)


def get_format(name: str) -> Format:
    """The format called `name`; KeyError naming the known ones otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise KeyError(f"unknown numerical format {name!r}; known: {', '.join(FORMATS)}") from None


def ulp_array(x: npt.ArrayLike, fmt: str | Format) -> npt.NDArray[np.float64]:
    """Spacing of `fmt`'s representable numbers at each magnitude |x| (subnormal spacing near 0,
    inf where x is not finite), as float64 of x's shape."""
    f = get_format(fmt) if isinstance(fmt, str) else fmt
    ax = np.abs(np.asarray(x, dtype=np.float64))
    _, e = np.frexp(ax)
    exp = np.where(ax == 0.0, f.min_normal_exponent, np.maximum(e - 1, f.min_normal_exponent))
    out = np.ldexp(1.0, (exp - (f.precision - 1)).astype(np.int64))
    return np.where(np.isfinite(ax), out, math.inf)


def ulp(x: float, fmt: str | Format) -> float:
    """Spacing of `fmt`'s representable numbers at magnitude |x| (subnormal spacing near 0)."""
    return float(ulp_array(x, fmt))


# -- the rest of the vocabulary ---------------------------------------------------------------
# Every other module spells these through the names below (Literal types for schemas and
# dataclasses, tuples for validation and for iterating in a stable order).

#: How a replay is run (see replays/pipeline.py).
Mode = Literal["decode", "scan", "scan_then_decode"]
MODES: Final[tuple[Mode, ...]] = ("decode", "scan", "scan_then_decode")

#: What a scan-then-decode run did with a trace, and why it was decoded (replays/pipeline.py):
#: `flagged`, the scan found a mismatch and the trace was decoded from it; `near_tie`, the scan
#: agreed everywhere but some step's top-2 margin along the logged path was at most the run's
#: `scan_flag_ulps` ulps (where a flip that needs the decode's KV cache hides), so the trace was
#: decoded in full; `control`, flagged by neither rule but decoded in full (the random control
#: sample that measures what the scan misses); `scanned`, flagged by neither and only scanned:
#: its exact match is not established, and no statistic counts it as one.
Screen = Literal["flagged", "near_tie", "control", "scanned"]
SCREENS: Final[tuple[Screen, ...]] = ("flagged", "near_tie", "control", "scanned")

#: The paper's interventions (section 4), applied at gated steps.
InterventionKind = Literal["none", "A", "B", "C"]
INTERVENTION_KINDS: Final[tuple[InterventionKind, ...]] = ("none", "A", "B", "C")

#: The category of a replayed comparison (the paper's per-prompt stratification).
Category = Literal["agreed", "head_reachable", "kv_dependent", "body_dominated"]
CATEGORIES: Final[tuple[Category, ...]] = (
    "agreed",
    "head_reachable",
    "kv_dependent",
    "body_dominated",
)

#: The engine's decode path: piecewise (the default: transformers' growing KV cache with the
#: rest of each step in CUDA graphs, bitwise equal to transformers' generate()) or compiled
#: (opt-in: a static cache, torch.compile and one CUDA graph a step; faster, but it can flip
#: near-ties against generate()).
CacheKind = Literal["piecewise", "compiled"]
CACHE_KINDS: Final[tuple[CacheKind, ...]] = ("piecewise", "compiled")

#: Where an arm's margin at t* came from: the logged top-k, a re-run of the logged format on
#: the worker, the arm's own decode or scan here, or nowhere.
MarginSource = Literal["logged_top_k", "reconstructed", "decode", "scan", "unavailable"]
MARGIN_SOURCES: Final[tuple[MarginSource, ...]] = (
    "logged_top_k",
    "reconstructed",
    "decode",
    "scan",
    "unavailable",
)

#: Where a replay target runs: a CUDA worker or a CPU one (None: wherever the deployment can).
Device = Literal["cpu", "cuda"]

#: An arm of a run: "logged" (the trace as logged) or the index of one of the run's targets.
ArmKey = Literal["logged"] | int

RunStatus = Literal["queued", "running", "done", "failed"]
ResultStatus = Literal["ok", "failed"]

#: Where the values of a trace's logged `top_k.logits` come from (its
#: `config.extras["top_k_values"]`, written by the importers; absent: logits): the logits
#: themselves, or raw logprobs (the logits less the log-softmax normaliser: their top-1 minus
#: top-2 is the logit margin to float32 rounding, but they are not logits and have no ulp of
#: their own).
TopKValues = Literal["logits", "raw_logprobs"]
EXTRA_TOP_K_VALUES: Final = "top_k_values"

#: The engines (a trace's `config.engine.name`) whose traces this project's engine replays in
#: the same software: transformers' modules (`replay-audit generate`, `generate()` logs, and the
#: engine's own name). A trace logged by any other engine (vLLM, SGLang, "unknown") can diverge
#: here because of the engine (kernels, CUDA graphs, attention) and not the format: a replay run
#: reproduces it in its own logged configuration first (the engine-reproduction check).
REPLAY_ENGINE_NAMES: Final = frozenset({"transformers", "replay-audit"})


def logged_by_another_engine(engine_name: object) -> bool:
    """Whether a trace logged by `engine_name` needs the engine-reproduction check."""
    return engine_name not in REPLAY_ENGINE_NAMES
