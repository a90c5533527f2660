"""What an engine is, and what it returns: plain dataclasses of numpy arrays, no torch.

An `Engine` is one checkpoint loaded in one numerical configuration (a `Target`). It decodes
greedily with its own KV-cache loop, scans a logged output teacher-forced in one forward, and
re-runs a single step from scratch. Every step it reports the token it chose, the top-k ids and
logits of its native lm_head output (exactly converted to float32), the top-2 margin (absolute
and in ulps of the lm_head format at the top-1 value), and whether the gate fired.

This module imports no torch, so the API process and a worker's import path stay torch-free
until `replay_audit.engine.load_engine` builds a real engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Final, Literal, Protocol, TypedDict, runtime_checkable

import numpy as np
import numpy.typing as npt

from replay_audit.diff.margin import DEFAULT_TAU, GateRule, Margin, StepNumerics
from replay_audit.diff.pieces import Piece
from replay_audit.formats import (
    BODY_DTYPES,
    CACHE_KINDS,
    HEAD_DTYPES,
    INTERVENTION_KINDS,
    SAMPLERS,
    SDPA_BACKENDS,
    CacheKind,
    InterventionKind,
    NoiseDevice,
    Sampler,
    SamplingJson,
)

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


#: K of intervention B (FP32 recompute of the top-K lm_head rows) when a request names none.
DEFAULT_B_TOP_K: Final = 8
#: Tokens (padding included) one forward of a batched scan runs over when a caller names no
#: budget. What it holds on the device: the body's activations for that many tokens, and the
#: lm_head's logits (float32) of the output positions among them, vocab x 4 bytes each (4 GiB
#: at 32k tokens and a 32k vocabulary): 16k suits a GPU of 24 GB with a 1B model.
DEFAULT_SCAN_TOKEN_BUDGET: Final = 16384


@dataclass(frozen=True)
class Intervention:
    """One of the paper's interventions (§4), applied at the steps where the gate fires.

    kind      none: the native argmax (the gate is still evaluated: `gate_fired` then means
                    "would have fired");
              A: integer logit bins round(z / τ), argmax, smallest token id wins ties;
              B: FP32 recompute of the top-`top_k` lm_head rows, then integer bins of τ and
                 the smallest-id tie-break;
              C: full-vocabulary FP32 lm_head recompute fp32(W_lm) · fp32(h), argmax.
    tau       absolute gate threshold (and A/B bin width); 0 = ungated (every step), < 0 = never.
    tau_ulps  when set, τ at a step is this many ulps of the lm_head format at the top-1 value.
    top_k     K of intervention B.
    """

    kind: InterventionKind = "none"
    tau: float = DEFAULT_TAU
    tau_ulps: float | None = None
    top_k: int = DEFAULT_B_TOP_K

    def __post_init__(self) -> None:
        if self.kind not in INTERVENTION_KINDS:
            raise ValueError(f"intervention must be one of {INTERVENTION_KINDS}, got {self.kind!r}")
        if self.top_k < 1:
            raise ValueError("intervention top_k (K of B) must be at least 1")

    @property
    def gate(self) -> GateRule:
        return GateRule(tau=self.tau, tau_ulps=self.tau_ulps)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: The logits processors this engine applies, by their request names: transformers' own
#: classes run them (`engine.processors`). Any other processor of a logged request (frequency
#: or presence penalties, allowed token ids, guided decoding...) makes a trace unreplayable.
SUPPORTED_PROCESSORS: Final = (
    "repetition_penalty",
    "no_repeat_ngram_size",
    "min_new_tokens",
    "logit_bias",
    "bad_words_ids",
    "bad_words",
)


@dataclass(frozen=True)
class LogitsProcessors:
    """The logits processors a trace's generation ran with, as an arm runs them: each step's
    float32 native logits go through them (transformers' `LogitsProcessor` classes, in
    `generate()`'s order), and the processed logits choose the token, give the top-k, the
    margins and the gate, and are what interventions A, B and C work on (C recomputes the FP32
    head, then applies them). Every probe of the arm (decode, scan, single-step re-run) runs
    them. Part of the resolved arm, so every surface shows them.

    repetition_penalty    transformers' `RepetitionPenaltyLogitsProcessor` over prompt and
                          output (vLLM's `repetition_penalty`: the same rule); None or 1: off
    no_repeat_ngram_size  `NoRepeatNGramLogitsProcessor` over prompt and output; None or 0: off
    min_new_tokens        `MinNewTokensLengthLogitsProcessor`: `eos_token_ids` held back until
                          this many tokens are out (vLLM's `min_tokens`); None or 0: off
    logit_bias            (token id, bias) pairs added to the logits (vLLM's and OpenAI's
                          `logit_bias`; transformers' `SequenceBiasLogitsProcessor` of
                          one-token sequences), sorted by id
    bad_words_ids         transformers' `bad_words_ids` (`NoBadWordsLogitsProcessor` over
                          prompt and output, eos ids exempt as in `generate()`)
    bad_words             vLLM's `bad_words`: texts, encoded by the checkpoint's tokenizer as
                          vLLM encodes them (with and without a leading space) and matched
                          against the output only, as vLLM does
    eos_token_ids         the trace's eos and stop ids (what min_new_tokens holds back)
    """

    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    min_new_tokens: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    bad_words: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        p = self.repetition_penalty
        if p is not None and not (p > 0 and p != float("inf")):
            raise ValueError(f"repetition_penalty must be a positive number, got {p!r}")
        for name in ("no_repeat_ngram_size", "min_new_tokens"):
            n = getattr(self, name)
            if n is not None and n < 0:
                raise ValueError(f"{name} must be at least 0, got {n!r}")
        if any(not seq for seq in self.bad_words_ids):
            raise ValueError("bad_words_ids: every sequence needs at least one id")

    @property
    def active(self) -> bool:
        """Whether any processor changes the logits."""
        return bool(self.names())

    def names(self) -> list[str]:
        """The processors that run (in `SUPPORTED_PROCESSORS` order)."""
        on = {
            "repetition_penalty": self.repetition_penalty not in (None, 1.0),
            "no_repeat_ngram_size": bool(self.no_repeat_ngram_size),
            "min_new_tokens": bool(self.min_new_tokens),
            "logit_bias": bool(self.logit_bias),
            "bad_words_ids": bool(self.bad_words_ids),
            "bad_words": bool(self.bad_words),
        }
        return [name for name in SUPPORTED_PROCESSORS if on[name]]

    def label(self) -> str:
        """`repetition_penalty=1.3, no_repeat_ngram_size=3` (lists by their length)."""
        parts = []
        for name in self.names():
            value = getattr(self, name)
            shown = f"{len(value)} entries" if isinstance(value, tuple) else f"{value:g}"
            parts.append(f"{name}={shown}")
        return ", ".join(parts)

    @classmethod
    def from_json(cls, d: Any) -> LogitsProcessors | None:
        """From a stored form: the trace's `decoding.logits_processors` (`logit_bias` keyed by
        token id, as OpenAI's) or `asdict` of this class (pairs); None for None."""
        if d is None:
            return None
        bias = d.get("logit_bias") or ()
        pairs = bias.items() if isinstance(bias, dict) else bias
        return cls(
            repetition_penalty=d.get("repetition_penalty"),
            no_repeat_ngram_size=d.get("no_repeat_ngram_size"),
            min_new_tokens=d.get("min_new_tokens"),
            logit_bias=tuple(sorted((int(k), float(v)) for k, v in pairs)),
            bad_words_ids=tuple(tuple(int(t) for t in w) for w in d.get("bad_words_ids") or ()),
            bad_words=tuple(str(w) for w in d.get("bad_words") or ()),
            eos_token_ids=tuple(int(t) for t in d.get("eos_token_ids") or ()),
        )


@dataclass(frozen=True)
class SamplingRecipe:
    """How a sampled generation turned logits into a draw, as the sampler applies it after the
    logits processors: temperature, then top-k (0: off), then top-p (1: off), then one
    exponential race over the probabilities (`argmax(p / q)`, q ~ Exp(1) from the seeded
    generator: what `torch.multinomial(p, 1)` and vLLM's `random_sample` both compute).

    sampler  `transformers`: `generate(do_sample=True)` after `torch.manual_seed(seed)`, its
             warpers (`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`), one
             (batch, V) noise draw a step from the device's default generator; `vllm`: vLLM's
             per-request seeded sampler (`vllm/v1/sample/ops/topk_topp_sampler.py`:
             `apply_top_k_top_p`, then `random_sample`, one (V,) draw a step from the request's
             own `torch.Generator`)
    """

    sampler: Sampler
    temperature: float
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if not 0.0 < self.temperature <= 100.0:
            raise ValueError(f"temperature must be in (0, 100], got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be at least 0, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    def label(self) -> str:
        """e.g. `transformers T=0.7 top_k=50`."""
        parts = [self.sampler, f"T={self.temperature:g}"]
        if self.top_k:
            parts.append(f"top_k={self.top_k}")
        if self.top_p < 1.0:
            parts.append(f"top_p={self.top_p:g}")
        return " ".join(parts)

    def to_json(self) -> SamplingJson:
        return SamplingJson(
            sampler=self.sampler, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p
        )

    @classmethod
    def from_json(cls, d: SamplingJson | Mapping[str, Any]) -> SamplingRecipe:
        """The recipe of a `SamplingJson` (a trace's seed and device are not the recipe's)."""
        return cls(
            sampler=d["sampler"],
            temperature=float(d["temperature"]),
            top_k=int(d.get("top_k") or 0),
            top_p=float(d.get("top_p", 1.0)),
        )


@dataclass(frozen=True)
class Sampling:
    """One trace's seeded sampler: its recipe, the seed, the device whose generator drew the
    noise, and (`transformers`) the batch's rows and this trace's row: `generate()` draws the
    noise of the whole batch at once, so a row's draws depend on the batch it ran in."""

    recipe: SamplingRecipe
    seed: int
    device: NoiseDevice = "cpu"
    rows: int = 1
    row: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if not 0 <= self.row < self.rows:
            raise ValueError(f"row {self.row} outside a batch of {self.rows}")


@dataclass(frozen=True)
class Target:
    """A numerical configuration to replay in: everything an engine is loaded with and every
    process-wide switch its probes run under.

    dtype          body dtype (`formats.BODY_DTYPES`)
    lm_head_dtype  the lm_head's format (None: the body's)
    attn_kernel    transformers' attention implementation (None: the engine's default, sdpa)
    batch_size     the row of interest decodes in a batch of this many rows (copies of it, or
                   the logged batch's layout where the trace records it)
    intervention   applied at gated steps (per probe: not part of `format_key`)
    weight_dtype   the dtype the weights are stored in before the cast to `dtype` (None: loaded
                   in `dtype`): the storage-vs-compute ablation
    deterministic  torch's deterministic algorithms during the probes (None: as the process
                   has them; the engine sets no switch the arm does not name)
    tf32           TF32 matrix products during the probes (None: as the process has them)
    sdpa_backend   SDPA limited to one backend (`formats.SDPA_BACKENDS`; None: torch chooses)
    kv_cache       the decode path (`formats.CacheKind`; None: the engine pool's default, the
                   faithful one)
    fp8_linear     every linear layer of the body in FP8-E4M3 (CUDA, SM >= 8.9)
    """

    dtype: str
    lm_head_dtype: str | None = None
    attn_kernel: str | None = None
    batch_size: int = 1
    intervention: Intervention = Intervention()
    weight_dtype: str | None = None
    deterministic: bool | None = None
    tf32: bool | None = None
    sdpa_backend: str | None = None
    kv_cache: CacheKind | None = None
    fp8_linear: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in BODY_DTYPES:
            raise ValueError(f"body dtype must be one of {BODY_DTYPES}, got {self.dtype!r}")
        if self.lm_head_dtype is not None and self.lm_head_dtype not in HEAD_DTYPES:
            raise ValueError(f"lm_head dtype must be one of {HEAD_DTYPES}")
        if self.weight_dtype is not None and self.weight_dtype not in BODY_DTYPES:
            raise ValueError(f"weight dtype must be one of {BODY_DTYPES}")
        if self.sdpa_backend is not None and self.sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"sdpa_backend must be one of {tuple(SDPA_BACKENDS)}")
        if self.kv_cache is not None and self.kv_cache not in CACHE_KINDS:
            raise ValueError(f"kv_cache must be one of {CACHE_KINDS}")
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")

    @property
    def head_dtype(self) -> str:
        return self.lm_head_dtype or self.dtype

    def format_key(self) -> Target:
        """What a loaded engine depends on: all of it but the intervention (per call)."""
        return replace(self, intervention=Intervention())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_config(cls, config: Any, *, intervention: Intervention | None = None) -> Target:
        """The target that reproduces a logged `NumericalConfig` (or its dict): its formats,
        kernel and batch, and the switches it records (deterministic, TF32, an SDPA backend
        it pinned in `extras.sdpa_backend`); what it does not record stays None."""

        def get(key: str) -> Any:
            return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

        dtype, weight = str(get("dtype")), get("weight_dtype")
        pinned = (get("extras") or {}).get("sdpa_backend")
        return cls(
            dtype=dtype,
            lm_head_dtype=get("lm_head_dtype"),
            attn_kernel=get("attn_kernel"),
            batch_size=get("batch_size") or 1,
            intervention=intervention or Intervention(),
            weight_dtype=weight if weight in BODY_DTYPES and weight != dtype else None,
            deterministic=get("deterministic"),
            tf32=get("tf32"),
            sdpa_backend=pinned if isinstance(pinned, str) and pinned in SDPA_BACKENDS else None,
        )


class LoadOptions(TypedDict, total=False):
    """What an engine pool loads every engine with, besides its `Target`: the device (None:
    CUDA when available, else the CPU), the decode path of targets that name none (`cache`,
    `formats.CacheKind`: "piecewise" (None) is bitwise equal to `generate()`; "compiled"
    preallocates the KV cache and captures the step: faster, not bitwise equal) and the
    compiled path's longest cache."""

    device: str | None
    cache: CacheKind | None
    max_cache_len: int


#: A value of `Environment.extras`: what `NumericalConfig.extras` stores.
ExtraValue = str | int | float | bool | None


class GpuName(TypedDict):
    name: str
    #: Compute capability, "major.minor".
    sm: str


class EngineName(TypedDict):
    name: str
    version: str | None


class Environment(TypedDict):
    """The numerical environment an engine actually runs in (`Engine.environment()`): the keys
    of `traces.schemas.NumericalConfig`, so it is stored as one. `lm_head_dtype` and
    `weight_dtype` are spelled out (never None), `device` is "cpu", "cuda", "rocm", "mps" or
    "xpu", and `extras` records the decode path and batch shapes that ran."""

    dtype: str
    lm_head_dtype: str
    weight_dtype: str
    device: str
    gpu: GpuName | None
    attn_kernel: str
    batch_size: int
    tp_degree: int
    engine: EngineName
    torch_version: str | None
    cuda_version: str | None
    cublas_version: str | None
    cudnn_version: str | None
    deterministic: bool
    tf32: bool
    extras: dict[str, ExtraValue]


@dataclass(frozen=True, eq=False)
class Steps:
    """Per-step records of one arm, as arrays over steps t (row t of each array).

    token_ids         the token chosen (after any intervention)
    native_token_ids  the argmax of the native logits (smallest id among equal maxima)
    top_k_ids         (T, k) ids by native logit descending, ties by smaller id
    top_k_logits      (T, k) native logits exactly converted to float32
    margins           Δ_t = top-1 - top-2 of the native logits
    margins_ulps      Δ_t in ulps of the lm_head format at the top-1 value
    gate_fired        whether the gate fired (with intervention none: would have fired)
    """

    token_ids: IntArray
    native_token_ids: IntArray
    top_k_ids: IntArray
    top_k_logits: npt.NDArray[np.float32]
    margins: FloatArray
    margins_ulps: FloatArray
    gate_fired: BoolArray

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def changed(self) -> BoolArray:
        """Steps where the intervention chose a token other than the native argmax."""
        return np.asarray(self.token_ids != self.native_token_ids)

    def margin_at(self, t: int) -> Margin:
        return Margin(
            abs=float(self.margins[t]),
            ulps=float(self.margins_ulps[t]),
            top1=float(self.top_k_logits[t, 0]),
        )

    def slice(self, start: int, stop: int | None = None) -> Steps:
        return Steps(*(getattr(self, f)[start:stop] for f in _STEP_FIELDS))

    @staticmethod
    def concat(parts: Sequence[Steps]) -> Steps:
        return Steps(*(np.concatenate([getattr(p, f) for p in parts]) for f in _STEP_FIELDS))

    @staticmethod
    def empty(k: int) -> Steps:
        ids, values = np.zeros(0, np.int64), np.zeros(0, np.float64)
        top_k = (np.zeros((0, k), np.int64), np.zeros((0, k), np.float32))
        return Steps(ids, ids, *top_k, values, values, np.zeros(0, bool))


_STEP_FIELDS = tuple(f.name for f in fields(Steps))


@dataclass(frozen=True)
class DecodeWindow:
    """Where a decode may stop early: `tokens` tokens after its first output token that
    differs from `reference` (the logged output; a token past the reference's end differs).
    Everything up to and including that first difference (t*, its margins, its re-runs)
    is what the whole decode gives; only the continuation after t* + `tokens` is not computed.

    The decode stays the whole decode's computation: its cache and decode path are sized for
    `max_new_tokens` as without a window, so the output cut here is bitwise the whole
    decode's prefix (a smaller cache could choose another kernel or path)."""

    reference: tuple[int, ...]
    tokens: int

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError("a decode window is 0 tokens or more")

    def first_difference(self, out: Sequence[int], known: int | None, start: int = 0) -> int | None:
        """The first step of `out` that differs from the reference, given `known`, the answer
        for `out[:start]` (checks only the steps from `start`)."""
        if known is not None:
            return known
        ref = self.reference
        for t in range(start, len(out)):
            if t >= len(ref) or out[t] != ref[t]:
                return t
        return None

    def reached(self, first_difference: int | None, n_out: int) -> bool:
        """Whether an output of `n_out` tokens whose first difference is at that step holds
        the difference and `tokens` tokens after it."""
        return first_difference is not None and n_out >= first_difference + 1 + self.tokens


@dataclass(frozen=True)
class BatchLayout:
    """Where a trace's row sat in the batch its `generate()` call ran: every row's prompt
    length before padding and this trace's row; the rows were left-padded to the longest (as
    `generate()` needs them). A row's numbers depend on the batch's shape and on its own
    padding and mask, not on the other rows' tokens: an arm replays the row among filler rows
    of those lengths."""

    prompt_lengths: tuple[int, ...]
    row: int

    def __post_init__(self) -> None:
        if not 0 <= self.row < len(self.prompt_lengths):
            raise ValueError("a batch layout's row is one of its rows")
        if min(self.prompt_lengths, default=0) < 1:
            raise ValueError("every row of a batch has a prompt")

    @property
    def size(self) -> int:
        return len(self.prompt_lengths)

    @property
    def padded(self) -> bool:
        """Whether any row was padded (the batch ran with an attention mask)."""
        return len(set(self.prompt_lengths)) > 1


#: Why a decode stopped: an eos id, `max_new_tokens`, or its `DecodeWindow` (the output is a
#: prefix of the whole decode's).
DecodeStop = Literal["eos", "length", "window"]


@dataclass(frozen=True, eq=False)
class DecodeRun:
    """A greedy decode. `output_token_ids` is the whole output, forced prefix included;
    `steps` covers only the decoded steps, which start at output step `start_step`
    (= the forced prefix's length). `stop_reason` "window": the decode stopped at its
    window, and its output is a prefix of the whole decode's. `rows`: how many rows of its
    logged batch decoded in the same run (`Engine.decode_batch`; 1: alone)."""

    output_token_ids: list[int]
    steps: Steps
    start_step: int
    stop_reason: DecodeStop
    rows: int = 1


@dataclass(frozen=True)
class DecodeRequest:
    """One decode of `Engine.decode_batch`: `Engine.decode`'s arguments for one trace."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    eos_ids: Sequence[int] = ()
    forced_prefix: Sequence[int] = ()
    window: DecodeWindow | None = None
    layout: BatchLayout | None = None


@dataclass(frozen=True, eq=False)
class LoggedEvidence:
    """What the scan's native logits say of each logged token (row t: output step t), the
    evidence of a verification (`diff.deficit`):

    logits  the logged token's native logit, exactly converted to float32
    ranks   its rank among the whole vocabulary: how many tokens argmax would choose before
            it (a larger logit, or an equal one with a smaller id); 0 = the scan's own choice
    """

    logits: npt.NDArray[np.float32]
    ranks: IntArray
    #: A sampled trace's rows (`ScanItem.sampling`; None: greedy): the logged token's deficit
    #: against the reference's own draw under the sampler's noise, in logit units
    #: (`engine.sampling.draw_evidence`), the reference's draw and its logit; `ranks` is then
    #: the logged token's place in that race.
    draw_deficits: npt.NDArray[np.float64] | None = None
    drawn: IntArray | None = None
    drawn_logits: npt.NDArray[np.float32] | None = None

    @staticmethod
    def empty() -> LoggedEvidence:
        return LoggedEvidence(np.zeros(0, np.float32), np.zeros(0, np.int64))

    def slice(self, start: int, stop: int) -> LoggedEvidence:
        if self.draw_deficits is None or self.drawn is None or self.drawn_logits is None:
            return LoggedEvidence(self.logits[start:stop], self.ranks[start:stop])
        return LoggedEvidence(
            self.logits[start:stop],
            self.ranks[start:stop],
            self.draw_deficits[start:stop],
            self.drawn[start:stop],
            self.drawn_logits[start:stop],
        )


@dataclass(frozen=True, eq=False)
class ScanRun:
    """A teacher-forced scan of a logged output: row t of `steps` is what this engine would
    choose at output step t given prompt ‖ logged[:t]; `agrees[t]` compares it with logged[t];
    `evidence` (where the engine measured it) is the logged tokens' logits and ranks."""

    steps: Steps
    agrees: BoolArray
    evidence: LoggedEvidence | None = None

    @property
    def first_disagreement(self) -> int | None:
        bad = np.flatnonzero(~self.agrees)
        return int(bad[0]) if bad.size else None


@dataclass(frozen=True)
class ScanItem:
    """One trace to scan: its prompt and its logged output, as token ids, the logits
    processors its generation ran with (None: none) and its seeded sampler (None: greedy)."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    processors: LogitsProcessors | None = None
    #: The seeded sampler the output was drawn with (None: greedy): the scan then measures
    #: each logged token against the reference's own draw under the same noise.
    sampling: Sampling | None = None


@dataclass(frozen=True, eq=False)
class StepInfo:
    """A single step re-run from scratch (no KV cache) with the arm's whole computation:
    `token` is the token the arm chooses (its intervention applied where its gate fires),
    `native_token` the native argmax; the top-k and the margin are the native logits'."""

    token: int
    native_token: int
    gate_fired: bool
    top_k_ids: IntArray
    top_k_logits: npt.NDArray[np.float32]
    margin: Margin

    @classmethod
    def from_steps(cls, steps: Steps) -> StepInfo:
        """The one row of a single step's `Steps`."""
        return cls(
            token=int(steps.token_ids[0]),
            native_token=int(steps.native_token_ids[0]),
            gate_fired=bool(steps.gate_fired[0]),
            top_k_ids=steps.top_k_ids[0],
            top_k_logits=steps.top_k_logits[0],
            margin=steps.margin_at(0),
        )


@runtime_checkable
class Engine(Protocol):
    """One checkpoint loaded in one numerical configuration."""

    @property
    def target(self) -> Target: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_positions(self) -> int | None:
        """The longest context (prompt and output) the checkpoint is made for
        (`max_position_embeddings`); None: not bounded, or not known."""

    def environment(self) -> Environment:
        """The numerical environment actually in use, with `NumericalConfig`'s keys."""

    def decode(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_ids: Sequence[int] = (),
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        forced_prefix: Sequence[int] = (),
        processors: LogitsProcessors | None = None,
        window: DecodeWindow | None = None,
        layout: BatchLayout | None = None,
    ) -> DecodeRun:
        """Greedy decode with a KV cache from prompt ‖ forced_prefix, up to `max_new_tokens`
        output tokens in all (forced prefix included), stopping after an eos id, or where
        `window` is reached (the rest of the computation unchanged: the output is the whole
        decode's prefix). `intervention` None means the target's; `processors` process every
        step's logits; `layout`: the logged batch the row ran in (None: copies of the row)."""

    def decode_batch(
        self,
        requests: Sequence[DecodeRequest],
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        processors: LogitsProcessors | None = None,
    ) -> list[DecodeRun]:
        """`decode` of each request, in order. Requests that replay rows of one logged batch
        (the same layout's prompt lengths, the same number of tokens past the logged prompt,
        distinct rows) decode together in one run of that batch, each at its own row where
        `decode` of it alone puts filler: the batch's shape and every row's padding are the
        same, and a row's numbers do not depend on the other rows' tokens, so each result is
        `decode`'s for the request alone. The others decode one by one. Each run says how
        many rows ran together (`DecodeRun.rows`)."""

    def scan(
        self,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        processors: LogitsProcessors | None = None,
    ) -> ScanRun:
        """One teacher-forced forward over prompt ‖ output: every output position's choice,
        from its logits processed by `processors` over prompt ‖ output[:t]."""

    def scan_batch(
        self,
        items: Sequence[ScanItem],
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        token_budget: int = DEFAULT_SCAN_TOKEN_BUDGET,
    ) -> list[ScanRun]:
        """`scan` of many traces, in the order of `items`, with several traces per forward:
        traces in length buckets, each bucket packed into forwards of at most `token_budget`
        tokens, padding included (`replay_audit.engine.batch`). Each result is what `scan`
        gives for the trace alone wherever the kernels do not depend on the batch's shape; the
        shapes used are recorded in `environment()["extras"]`."""

    def step(
        self,
        prompt_ids: Sequence[int],
        prefix_ids: Sequence[int],
        intervention: Intervention,
        top_k: int = 5,
        *,
        processors: LogitsProcessors | None = None,
        layout: BatchLayout | None = None,
    ) -> StepInfo:
        """From-scratch forward over prompt ‖ prefix: the arm's choice for the next step, with
        its logits processed by `processors` and `intervention` applied where its gate fires
        (the single-step re-run runs the arm's whole computation, its batch `layout` included;
        there is no default: the caller names the arm's)."""

    def step_batch(
        self,
        contexts: Sequence[Sequence[int]],
        intervention: Intervention,
        top_k: int = 5,
        *,
        token_budget: int = DEFAULT_SCAN_TOKEN_BUDGET,
        processors: LogitsProcessors | None = None,
        prompt_lengths: Sequence[int] | None = None,
        layouts: Sequence[BatchLayout | None] | None = None,
    ) -> list[StepInfo]:
        """`step` over each context (prompt ‖ prefix, with its `layouts` entry), in order,
        several contexts of one length per forward, unpadded (`batch.plan_steps`), the lm_head
        over each row's last hidden state alone. Each result is what `step` gives for the
        context alone wherever the body's kernels do not depend on the number of rows (on CPU,
        bit for bit); a context with a padded layout runs alone. The shapes used are recorded
        in `environment()["extras"]` (`step_batch_shapes`). `processors` process every
        context's logits; they need each context's prompt length (`prompt_lengths`, in
        order)."""

    def detokenize(self, ids: Sequence[int]) -> str | None:
        """The text of `ids`, or None when the checkpoint has no tokenizer."""

    def token_pieces(self, ids: Sequence[int]) -> tuple[Piece, ...] | None:
        """Each token's piece (`diff.pieces`: its text, or its bytes when they are not text
        alone), or None when the checkpoint has no tokenizer."""


def decode_each(
    engine: Engine,
    requests: Sequence[DecodeRequest],
    intervention: Intervention | None,
    top_k: int,
    processors: LogitsProcessors | None,
) -> list[DecodeRun]:
    """`Engine.decode_batch` one request at a time (an engine with no batch to share)."""
    return [
        engine.decode(
            r.prompt_ids,
            r.max_new_tokens,
            r.eos_ids,
            intervention,
            top_k,
            forced_prefix=r.forced_prefix,
            processors=processors,
            window=r.window,
            layout=r.layout,
        )
        for r in requests
    ]


@runtime_checkable
class HiddenStates(Protocol):
    """An engine that can show the hidden states its lm_head reads (the torch engine, the fake):
    what the screening's cross-arm hidden-state gap compares."""

    def hidden_states(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int]
    ) -> npt.NDArray[np.float32]:
        """(len(output_ids) + 1, d) float32: row t is the final normed hidden state that predicts
        output step t in a from-scratch forward over prompt ‖ output_ids."""


def steps_from_numerics(
    token_ids: npt.ArrayLike, native_token_ids: npt.ArrayLike, numerics: StepNumerics, k: int
) -> Steps:
    """`Steps` from the tokens chosen at each step, the native argmax, and what
    `diff.step_numerics` decided from the step's top-k (with a head format and a gate); the
    top-k is cut to the k asked for. Both engines build their steps here."""
    if numerics.margins_ulps is None or numerics.gate_fired is None:
        raise ValueError("steps need margins in ulps and the gate: pass head_format and gate")
    return Steps(
        token_ids=np.array(token_ids, dtype=np.int64),
        native_token_ids=np.array(native_token_ids, dtype=np.int64),
        top_k_ids=numerics.top_k_ids[:, :k],
        top_k_logits=numerics.top_k_logits[:, :k].astype(np.float32, copy=False),
        margins=numerics.margins,
        margins_ulps=numerics.margins_ulps,
        gate_fired=numerics.gate_fired,
    )
