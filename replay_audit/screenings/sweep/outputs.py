"""What a screening stores: each run's decode of each prompt, and the probes (single-step
re-runs and hidden-state gaps) of each comparison's divergent prompts. Every statistic of the
report is computed from these, so no prompt is decoded twice. Pure: stdlib and numpy.

The JSON forms are what `--out` (CLI) and the `screening_outputs` table (service) persist, one
prompt's decode at a time: a stopped screening resumes at the first prompt not yet decoded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from typing_extensions import TypedDict

from replay_audit.diff.margin import Margin
from replay_audit.json_value import JsonObject, JsonValue, as_int, as_list, as_optional_float

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


class PromptRow(TypedDict, total=False):
    """A prompt as given (a line of the CLI's JSONL, an item of the API's `prompts`): its text
    or its token ids (the ids win where both are given), and an id (default: its index)."""

    id: str
    prompt: str
    prompt_token_ids: list[int]


@dataclass(frozen=True)
class ScreenPrompt:
    """A prompt of the screening: an id and its token ids."""

    id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class PromptDecode:
    """One prompt decoded greedily in one run: the output and, per decoded step, the native
    top-2 margin (absolute and in ulps of the run's lm_head format), the top-1 logit and
    whether the gate fired (would have fired, for intervention none)."""

    output_ids: tuple[int, ...]
    margins: FloatArray
    margins_ulps: FloatArray
    top1: FloatArray
    gate_fired: BoolArray

    def __len__(self) -> int:
        return int(self.margins.shape[0])

    def margin_at(self, t: int) -> Margin | None:
        if t >= len(self):
            return None
        return Margin(
            abs=float(self.margins[t]), ulps=float(self.margins_ulps[t]), top1=float(self.top1[t])
        )

    def to_json(self) -> JsonObject:
        return {
            "output_ids": list[JsonValue](self.output_ids),
            "margins": _floats(self.margins),
            "margins_ulps": _floats(self.margins_ulps),
            "top1": _floats(self.top1),
            "gate_fired": [bool(x) for x in self.gate_fired],
        }

    @classmethod
    def from_json(cls, d: JsonObject) -> PromptDecode:
        return cls(
            output_ids=tuple(as_int(x) for x in as_list(d["output_ids"])),
            margins=_array(d["margins"]),
            margins_ulps=_array(d["margins_ulps"]),
            top1=_array(d["top1"]),
            gate_fired=np.asarray(as_list(d["gate_fired"]), dtype=bool),
        )


@dataclass(frozen=True, eq=False)
class RunOutput:
    """A run's decodes, one per prompt in prompt order, and the environment it ran in."""

    run_key: str
    environment: JsonObject
    decodes: tuple[PromptDecode, ...]


@dataclass(frozen=True)
class Probe:
    """A divergent prompt of a comparison, probed along the shared prefix y<t*: each arm's
    from-scratch single-step re-run at t*, and Δh (`hidden_gap`) of the hidden states feeding
    the lm_head at t* (None: an engine shows no hidden states) and at the `gated_steps`
    s <= t* where either arm's gate fired in its decode."""

    prompt: int
    t_star: int
    token_a: int
    token_b: int
    dh_t_star: float | None
    gated_steps: tuple[int, ...]
    dh_gated: tuple[float, ...]

    def to_json(self) -> JsonObject:
        return {
            "prompt": self.prompt,
            "t_star": self.t_star,
            "token_a": self.token_a,
            "token_b": self.token_b,
            "dh_t_star": _finite(self.dh_t_star),
            "gated_steps": list[JsonValue](self.gated_steps),
            "dh_gated": [_finite(x) for x in self.dh_gated],
        }

    @classmethod
    def from_json(cls, d: JsonObject) -> Probe:
        dh_gated = (as_optional_float(x) for x in as_list(d["dh_gated"]))
        return cls(
            prompt=as_int(d["prompt"]),
            t_star=as_int(d["t_star"]),
            token_a=as_int(d["token_a"]),
            token_b=as_int(d["token_b"]),
            dh_t_star=as_optional_float(d.get("dh_t_star")),
            gated_steps=tuple(as_int(x) for x in as_list(d["gated_steps"])),
            dh_gated=tuple(math.nan if x is None else x for x in dh_gated),
        )


def hidden_gap(
    h_a: npt.NDArray[np.float32], h_b: npt.NDArray[np.float32]
) -> npt.NDArray[np.float64]:
    """Δh per row: ||h_A - h_B|| / ||h_A|| (float64; inf where ||h_A|| = 0 and they differ,
    0 where both are zero)."""
    a = np.asarray(h_a, dtype=np.float64)
    b = np.asarray(h_b, dtype=np.float64)
    num = np.linalg.norm(a - b, axis=-1)
    den = np.linalg.norm(a, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(num > 0, math.inf, 0.0))
    return np.asarray(out, dtype=np.float64)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _floats(a: npt.ArrayLike) -> list[JsonValue]:
    return [float(x) if math.isfinite(x) else None for x in np.asarray(a, np.float64).tolist()]


def _array(xs: JsonValue) -> FloatArray:
    values = (as_optional_float(x) for x in as_list(xs))
    return np.asarray([math.nan if x is None else x for x in values], dtype=np.float64)


class ScreenOutputs:
    """What a screening produced: run outputs by run key, probes by comparison name, and by
    configuration key why one could not load here (`unavailable`) or failed to run (`failed`)."""

    def __init__(self) -> None:
        self.runs: dict[str, RunOutput] = {}
        self.probes: dict[str, dict[int, Probe]] = {}
        self.unavailable: dict[str, str] = {}
        self.failed: dict[str, str] = {}
