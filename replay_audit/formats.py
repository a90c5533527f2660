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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Generic, Literal, NotRequired, TypedDict, TypeVar, get_args

import numpy as np
import numpy.typing as npt

# Each name set is spelled once, as a Literal type (for schemas, dataclasses and mypy); its
# tuple is read from the type (`get_args`), for validation, CLI choices and stable iteration.

#: A body (compute) dtype.
BodyDType = Literal["fp32", "bf16", "fp16"]
#: An lm_head format: a body dtype or an FP8 one.
HeadDType = Literal[BodyDType, "fp8_e4m3", "fp8_e5m2"]
#: How a logged checkpoint's weights were stored (integer quantisation only as logged).
WeightDType = Literal[HeadDType, "int8", "int4"]
BODY_DTYPES: Final[tuple[BodyDType, ...]] = get_args(BodyDType)
HEAD_DTYPES: Final[tuple[HeadDType, ...]] = get_args(HeadDType)
WEIGHT_DTYPES: Final[tuple[WeightDType, ...]] = get_args(WeightDType)


@dataclass(frozen=True)
class Format:
    name: HeadDType
    precision: int  # significand bits including the implicit leading one
    min_normal_exponent: int
    #: The format's name in torch (`torch.<torch_name>`), which checkpoints' config.json and
    #: lm-eval's `model_dtype` also write.
    torch_name: str

    @property
    def body_ok(self) -> bool:
        return self.name in BODY_DTYPES


FORMATS: Final[dict[str, Format]] = {
    f.name: f
    for f in (
        Format("fp32", 24, -126, "float32"),
        Format("bf16", 8, -126, "bfloat16"),
        Format("fp16", 11, -14, "float16"),
        Format("fp8_e4m3", 4, -6, "float8_e4m3fn"),
        Format("fp8_e5m2", 3, -14, "float8_e5m2"),
    )
}
assert tuple(FORMATS) == HEAD_DTYPES

#: Other spellings of the body dtypes: torch's names, with or without "torch.", and its
#: aliases `float` and `half`.
_BODY_ALIASES: Final[dict[str, BodyDType]] = {
    **{FORMATS[d].torch_name: d for d in BODY_DTYPES},
    **{d: d for d in BODY_DTYPES},
    "float": "fp32",
    "half": "fp16",
}


def body_dtype(name: object) -> BodyDType | None:
    """The body dtype a checkpoint, torch or a log calls `name` ("torch.bfloat16",
    "bfloat16", "half", "bf16"...); None for anything else."""
    return _BODY_ALIASES.get(str(name).removeprefix("torch."))


def head_dtype(name: object) -> HeadDType | None:
    """`name` as an lm_head format, where it is one (None for anything else)."""
    return name if name in HEAD_DTYPES else None


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

#: How a replay is run (see replays/pipeline.py).
Mode = Literal["decode", "scan", "scan_then_decode"]
MODES: Final[tuple[Mode, ...]] = get_args(Mode)

#: What a comparison with the logged tokens was judged against, per result: the logged tokens;
#: the logged configuration replayed here, for a trace that did not reproduce in it (its
#: reproduction check diverged: no precision flip is counted against its logged tokens); or
#: that replay for a trace of an engine this service cannot run (vLLM, SGLang: pairwise).
Baseline = Literal["logged", "reproduced", "replayed"]
BASELINES: Final[tuple[Baseline, ...]] = get_args(Baseline)

#: What a scan-then-decode run did with a trace, and why it was decoded (replays/pipeline.py):
#: `flagged`, the scan found a mismatch and the trace was decoded from it; `near_tie`, the scan
#: agreed everywhere but some step's top-2 margin along the logged path was at most the run's
#: `scan_flag_ulps` ulps (where a flip that needs the decode's KV cache hides), so the trace was
#: decoded in full; `control`, flagged by neither rule but decoded in full (the random control
#: sample that measures what the scan misses); `scanned`, flagged by neither and only scanned:
#: its exact match is not established, and no statistic counts it as one; `flagged_scanned`,
#: flagged by a mismatch but not in the run's flagged sample (`FLAGGED_FRACTION`), so not
#: decoded: its result is the scan's (t* the first disagreement, exact match False, the
#: category from the probe), as a scan run's is; `near_tie_scanned`, flagged by a near-tie
#: but not in the flagged sample, so only scanned: unknown as a `scanned` one (the scan
#: agrees; a decode might not), counted in no EAR, its divergence estimated from the decoded
#: near-tie traces'.
Screen = Literal["flagged", "near_tie", "control", "scanned", "flagged_scanned", "near_tie_scanned"]
SCREENS: Final[tuple[Screen, ...]] = get_args(Screen)

#: The paper's interventions (section 4), applied at gated steps.
InterventionKind = Literal["none", "A", "B", "C"]
INTERVENTION_KINDS: Final[tuple[InterventionKind, ...]] = get_args(InterventionKind)

#: The category of a replayed comparison (the paper's per-prompt stratification).
Category = Literal["agreed", "head_reachable", "kv_dependent", "body_dominated"]
CATEGORIES: Final[tuple[Category, ...]] = get_args(Category)

#: The engine's decode path: piecewise (the default: transformers' growing KV cache with the
#: rest of each step in CUDA graphs, bitwise equal to transformers' generate()) or compiled
#: (opt-in: a static cache, torch.compile and one CUDA graph a step; faster, but it can flip
#: near-ties against generate()).
CacheKind = Literal["piecewise", "compiled"]
CACHE_KINDS: Final[tuple[CacheKind, ...]] = get_args(CacheKind)

#: Where an arm's margin at t* came from: the logged top-k, a re-run of the logged format on
#: the worker, the arm's own decode or scan here, or nowhere.
MarginSource = Literal["logged_top_k", "reconstructed", "decode", "scan", "unavailable"]
MARGIN_SOURCES: Final[tuple[MarginSource, ...]] = get_args(MarginSource)

#: How the single-step probe at t* runs (docs/replays.md "The single-step probe"): the arm's
#: teacher-forced forward over prompt ‖ arm A's tokens (the scan's own, where it ran), or a
#: from-scratch forward over prompt ‖ y<t* alone.
SingleStepKind = Literal["teacher_forced", "from_scratch"]
SINGLE_STEP_KINDS: Final[tuple[SingleStepKind, ...]] = get_args(SingleStepKind)

#: Where a replay target or a screening runs: a CUDA worker or a CPU one (None where a field
#: takes it: wherever the deployment can).
Device = Literal["cpu", "cuda"]
DEVICES: Final[tuple[Device, ...]] = get_args(Device)
#: What a logged configuration's `device` may say (the runtimes logs come from).
LoggedDevice = Literal[Device, "rocm", "mps", "xpu", "other"]
LOGGED_DEVICES: Final[tuple[LoggedDevice, ...]] = get_args(LoggedDevice)

#: The attention kernels this engine runs and a screening sweeps (transformers'
#: `attn_implementation` names). A logged `attn_kernel` may name any other (`ATTN_KERNEL_PATTERN`).
AttnKernel = Literal["eager", "sdpa", "flash_attention_2"]
ATTN_KERNELS: Final[tuple[AttnKernel, ...]] = get_args(AttnKernel)
#: The kernel when none is asked for (transformers' own default).
DEFAULT_ATTN_KERNEL: Final[AttnKernel] = "sdpa"
ATTN_KERNEL_PATTERN: Final = r"^[a-z0-9_\-]{1,64}$"


@dataclass(frozen=True)
class SdpaBackend:
    """One backend of torch's SDPA: its `torch.nn.attention.SDPBackend` member, its
    `torch.backends.cuda` switch (which governs the CPU's choice too), and whether a CPU has it."""

    torch_backend: str
    enable_switch: str
    on_cpu: bool


SdpaBackendName = Literal["math", "flash", "efficient", "cudnn"]
#: The backends `sdpa` can be limited to (a screening knob; None lets torch choose).
SDPA_BACKENDS: Final[dict[SdpaBackendName, SdpaBackend]] = {
    "math": SdpaBackend("MATH", "enable_math_sdp", on_cpu=True),
    "flash": SdpaBackend("FLASH_ATTENTION", "enable_flash_sdp", on_cpu=True),
    "efficient": SdpaBackend("EFFICIENT_ATTENTION", "enable_mem_efficient_sdp", on_cpu=False),
    "cudnn": SdpaBackend("CUDNN_ATTENTION", "enable_cudnn_sdp", on_cpu=False),
}
assert tuple(SDPA_BACKENDS) == get_args(SdpaBackendName)


def sdpa_backend_name(name: object) -> SdpaBackendName | None:
    """`name` as an SDPA backend of `SDPA_BACKENDS`, where it is one (None for anything else)."""
    return name if name in SDPA_BACKENDS else None


CPU_SDPA_BACKENDS: Final[tuple[SdpaBackendName, ...]] = tuple(
    n for n, b in SDPA_BACKENDS.items() if b.on_cpu
)

#: The log formats `replay-audit import` and `POST /v1/traces:import` read.
ImportFormat = Literal["openai", "sglang", "hf", "lm-eval"]
IMPORT_FORMATS: Final[tuple[ImportFormat, ...]] = get_args(ImportFormat)

#: How a trace was decoded (only greedy traces replay) and why its generation stopped.
Strategy = Literal["greedy", "sample", "beam", "other"]
#: The samplers whose seeded draws a verification reproduces (`engine.sampling`).
Sampler = Literal["transformers", "vllm"]
SAMPLERS: Final[tuple[Sampler, ...]] = get_args(Sampler)
#: The device kinds whose random generators a sampler's noise can come from.
NoiseDevice = Literal["cpu", "cuda"]


class SamplingJson(TypedDict):
    """A seeded sampler as JSON: a trace's `decoding.sampling` (`traces.schemas.SamplingSpec`
    validates it), or without `seed` and `device` a recipe (`engine.SamplingRecipe.to_json`,
    a sampled claim's `sampling`; an import's before its device is known). `top_k` 0 and
    `top_p` 1 are off."""

    sampler: Sampler
    temperature: float
    top_k: int
    top_p: float
    seed: NotRequired[int]
    device: NotRequired[NoiseDevice]


StopReason = Literal["eos", "length", "stop_string", "other"]

#: An arm of a run: "logged" (the trace as logged) or the index of one of the run's targets.
ArmKey = Literal["logged"] | int
#: What a run compares: each target with the logged tokens, or the targets with each other.
Compare = Literal["logged", "pairwise"]
#: `compare_with: "self"`: a target per trace equal to its own logged configuration.
CompareWith = Literal["self"]

# -- run options -------------------------------------------------------------------------------
# The options a replay run shares between `POST /v1/replays`, `replay-audit replay`, audit
# schedules and screenings: each defined once, with its default and limits; the pydantic fields
# (`input.option_field`) and the CLI flags (`cli.option`) are built from it.

N = TypeVar("N", int, float)


@dataclass(frozen=True)
class RunOption(Generic[N]):
    """A numeric run option: default, inclusive bounds (`gt`: an exclusive lower one; None:
    unbounded) and help (the OpenAPI description and the CLI help, so its only documentation)."""

    default: N
    help: str
    ge: N | None = None
    le: N | None = None
    gt: N | None = None


TOP_K: Final = RunOption(5, "Top-k kept per replayed step.", ge=2, le=20)
CONTROL_FRACTION: Final = RunOption(
    0.05,
    "scan_then_decode: share of the traces the scan does not flag that are decoded anyway "
    "(the control sample that estimates the scan's miss rate).",
    ge=0.0,
    le=1.0,
)
#: Why a large run decodes 5% of its flagged traces (`config.Settings.large_run_flagged_fraction`,
#: docs/replays.md "The flagged sample"): the scan already gives each one's t*, margins and
#: category; the decode from t* only says whether it truly diverges there (false flags happen
#: only at exact ties) and gives the continuation text, so a sample measures the false-flag
#: rate, as the control sample (also 5%) measures the miss rate, at a twentieth of the decodes.
#: The same sample covers the near-tie flags: each is a decode in full from the prompt (the
#: costliest kind), and a sample of them measures their divergence rate for the rest.
FLAGGED_FRACTION: Final = RunOption(
    1.0,
    "scan_then_decode: share of the traces the scan flags that are decoded (the flagged "
    "sample, one draw per trace for both reasons): a mismatch-flagged one from its first "
    "disagreement (measuring the false-flag rate), the others keeping the scan's result "
    "(screen flagged_scanned); a near-tie-flagged one from the prompt (measuring the near-tie "
    "divergence rate), the others only scanned (screen near_tie_scanned). Default: 1 (all), "
    "but a large run naming no mode: the deployment's REPLAY_AUDIT_LARGE_RUN_FLAGGED_FRACTION "
    "(0.05).",
    gt=0.0,
    le=1.0,
)
#: The near-tie flag that turns near-tie flagging off, and the largest one a request may name.
SCAN_FLAG_OFF: Final = -1.0
MAX_SCAN_FLAG_ULPS: Final = 1024.0
CONTROL_SEED: Final = RunOption(0, "Seed of the control sample.", ge=0, le=2**53)
#: Why 0 ulps (exact ties only) by default: there the scan's choice was the tie-break's and any
#: rounding of the decode's own KV path can take the other token. Wider flags catch more
#: KV-dependent flips but cost fast: the rule looks at every step, so the share of traces it
#: decodes grows with their length (on the bundled model's 24-token traces in BF16, 31% at 0
#: ulps and 75% at 1 ulp; near `MAX_SCAN_FLAG_ULPS`, nearly all). On an H100 with a trained
#: model (BENCHMARKS.md) 0 ulps took the scan's recall of decode divergences from 94.9% to 100%.
SCAN_FLAG_ULPS: Final = RunOption(
    0.0,
    "scan_then_decode: also decode a trace the scan agrees with when some step's top-2 margin "
    "along the logged path is at most this many ulps (a near-tie); negative: off. "
    "Default: REPLAY_AUDIT_SCAN_FLAG_ULPS.",
    ge=SCAN_FLAG_OFF,
    le=MAX_SCAN_FLAG_ULPS,
)
#: The widest decode window: a trace's most output tokens (`config.MAX_TRACE_TOKENS`).
MAX_DECODE_WINDOW: Final = 65_536
#: 0 stops right after the token at t*; its fields default to None (no window).
DECODE_WINDOW: Final = RunOption(
    0,
    "decode and scan_then_decode: a decode compared with the logged tokens stops this many "
    "tokens after its first divergence t* (its output is then a prefix: no cascade, length "
    "difference or answers for it; t*, margins and categories unchanged). Default: none, "
    "decoded to eos or max_new_tokens; a large run naming no mode: the deployment's "
    "REPLAY_AUDIT_LARGE_RUN_DECODE_WINDOW (32).",
    ge=0,
    le=MAX_DECODE_WINDOW,
)
MAX_NEW_TOKENS: Final = RunOption(64, "Tokens decoded per prompt.", ge=1, le=512)
COVER: Final = RunOption(0.9, "Share of flips the τ calibration covers.", gt=0.0, le=1.0)
#: The paper's main pair for a screening's head-vs-body analysis and C lift (BF16 vs FP16).
DEFAULT_PAIR: Final[tuple[BodyDType, BodyDType]] = ("bf16", "fp16")

RunStatus = Literal["queued", "running", "done", "failed"]
ResultStatus = Literal["ok", "failed"]

#: Where the values of a trace's logged `top_k.logits` come from (its
#: `config.extras["top_k_values"]`, written by the importers; absent: logits): the logits
#: themselves, or raw logprobs (the logits less the log-softmax normaliser: their top-1 minus
#: top-2 is the logit margin to float32 rounding, but they are not logits and have no ulp of
#: their own).
TopKValues = Literal["logits", "raw_logprobs"]
EXTRA_TOP_K_VALUES: Final = "top_k_values"

#: Where an imported trace's token ids come from (its `config.extras["token_ids_source"]`,
#: absent: logged): logged by the source, read from its logged per-token pieces, or its text
#: re-tokenised with the checkpoint's tokenizer (a non-canonical split of the logged text then
#: replays as a divergence). Every replay result of the trace says it.
TokenIdsSource = Literal["logged", "pieces", "retokenized"]
EXTRA_TOKEN_IDS_SOURCE: Final = "token_ids_source"
#: The logits processors an imported request ran with that a replay does not apply
#: (`frequency_penalty=0.5,...`): a greedy request with any is strategy `other`, and this says
#: why. Those a replay applies are the trace's `decoding.logits_processors`.
EXTRA_PROCESSORS: Final = "logits_processors"


def processors_not_applied(value: object) -> str:
    """` (logits processors a replay does not apply: frequency_penalty=0.5)` of a trace's
    `EXTRA_PROCESSORS`, or "" where it has none: what a refusal of the trace adds."""
    if not value:
        return ""
    return f" (logits processors a replay does not apply: {value})"


#: The engines (a trace's `config.engine.name`) whose traces this project's engine replays in
#: the same software: transformers' modules (`replay-audit generate`, `generate()` logs, and the
#: engine's own name). A trace logged by any other engine (vLLM, SGLang, "unknown") can diverge
#: here because of the engine (kernels, CUDA graphs, attention) and not the format: a replay run
#: reproduces it in its own logged configuration first (the engine-reproduction check).
REPLAY_ENGINE_NAMES: Final = frozenset({"transformers", "replay-audit"})


def logged_by_another_engine(engine_name: object) -> bool:
    """Whether a trace logged by `engine_name` needs the engine-reproduction check."""
    return engine_name not in REPLAY_ENGINE_NAMES
