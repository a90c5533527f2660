"""What a screening runs: the reference configuration, the knobs changed one at a time, the
head-vs-body pair, and which configurations this platform cannot run (with the reason). Pure.

`SweepPlan` is the screening's input, `Run` its unit of work.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Final, Literal, get_args

from replay_audit.diff.margin import DEFAULT_TAU, GateRule
from replay_audit.engine.protocol import Intervention, Target
from replay_audit.formats import (
    ATTN_KERNELS,
    BODY_DTYPES,
    CACHE_KINDS,
    COVER,
    CPU_SDPA_BACKENDS,
    DEFAULT_ATTN_KERNEL,
    DEFAULT_PAIR,
    HEAD_DTYPES,
    MAX_NEW_TOKENS,
    SDPA_BACKENDS,
    TOP_K,
    BodyDType,
    CacheKind,
    Device,
    HeadDType,
    SdpaBackendName,
    body_dtype,
    head_dtype,
    sdpa_backend_name,
)
from replay_audit.json_value import JsonObject, JsonValue

#: The knobs of the sweep, in report order (`--knobs` names).
KnobName = Literal[
    "body_dtype",
    "lm_head",
    "weight_storage",
    "attn_kernel",
    "deterministic",
    "tf32",
    "batch_size",
    "kv_cache",
    "fp8_linear",
    "tp",
]
KNOB_NAMES: Final[tuple[KnobName, ...]] = get_args(KnobName)
BATCH_SIZES: Final = (1, 2, 4, 8)
#: The degree the `tp` knob screens unless told otherwise (one degree per screening).
DEFAULT_TP_DEGREE: Final = 2
#: A screening's runs decode with no intervention (the gate still evaluated) or gated C.
ScreenIntervention = Literal["none", "C"]


@dataclass(frozen=True)
class ScreenConfig:
    """A numerical configuration of the screening. `deterministic`, `tf32`: torch's switches
    (off in the reference, as a plain deployment runs); `fp8_linear`: every linear layer of
    the body in FP8 (the paper's end-to-end FP8 boundary case)."""

    dtype: BodyDType
    lm_head_dtype: HeadDType | None = None
    weight_dtype: BodyDType | None = None
    attn_kernel: str = DEFAULT_ATTN_KERNEL
    batch_size: int = 1
    deterministic: bool = False
    tf32: bool = False
    kv_cache: CacheKind = "piecewise"
    fp8_linear: bool = False
    #: Limit `sdpa` to one of its CUDA backends (None: torch chooses).
    sdpa_backend: SdpaBackendName | None = None
    #: Tensor-parallel degree: k > 1 runs on the engine pool's group of k ranks.
    tp_degree: int = 1

    def __post_init__(self) -> None:
        if self.sdpa_backend is not None and self.sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"sdpa_backend must be one of {tuple(SDPA_BACKENDS)}")
        if self.dtype not in BODY_DTYPES:
            raise ValueError(f"body dtype must be one of {BODY_DTYPES}, got {self.dtype!r}")
        if self.lm_head_dtype is not None and self.lm_head_dtype not in HEAD_DTYPES:
            raise ValueError(f"lm_head dtype must be one of {HEAD_DTYPES}")
        if self.weight_dtype is not None and self.weight_dtype not in BODY_DTYPES:
            raise ValueError(f"weight dtype must be one of {BODY_DTYPES}")
        if self.kv_cache not in CACHE_KINDS:
            raise ValueError(f"kv_cache must be one of {CACHE_KINDS}")
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if self.tp_degree < 1:
            raise ValueError("tp_degree must be at least 1")

    @property
    def head_dtype(self) -> HeadDType:
        return self.lm_head_dtype or self.dtype

    @property
    def stored_dtype(self) -> BodyDType:
        return self.weight_dtype or self.dtype

    @property
    def key(self) -> str:
        """A stable name, used as the file name of its outputs (TP 1 unsaid: the keys of
        screenings stored before the TP knob stay theirs)."""
        parts = [
            self.dtype,
            f"head-{self.head_dtype}",
            f"w-{self.stored_dtype}",
            self.attn_kernel,
            f"bs{self.batch_size}",
            "det" if self.deterministic else "nondet",
            "tf32" if self.tf32 else "ieee",
            self.kv_cache,
        ]
        if self.fp8_linear:
            parts.append("fp8lin")
        if self.sdpa_backend is not None:
            parts.append(f"sdpa-{self.sdpa_backend}")
        if self.tp_degree > 1:
            parts.append(f"tp{self.tp_degree}")
        return "_".join(parts)

    def target(self, intervention: Intervention | None = None) -> Target:
        """The engine `Target` the replay pipeline loads (`replays.pipeline.load_arm`, as for
        every arm); the TP degree is the pipeline's `tp_degree`."""
        return Target(
            self.dtype,
            self.lm_head_dtype,
            self.attn_kernel,
            self.batch_size,
            intervention or Intervention(),
            weight_dtype=self.weight_dtype,
            deterministic=self.deterministic,
            tf32=self.tf32,
            sdpa_backend=self.sdpa_backend,
            kv_cache=self.kv_cache,
            fp8_linear=self.fp8_linear,
        )

    @classmethod
    def of_target(cls, target: Target, tp_degree: int = 1) -> ScreenConfig:
        """The configuration whose `target()` is `target` (less its intervention)."""
        return cls(
            body_dtype(target.dtype) or "fp32",
            head_dtype(target.lm_head_dtype),
            body_dtype(target.weight_dtype) if target.weight_dtype is not None else None,
            attn_kernel=target.attn_kernel or DEFAULT_ATTN_KERNEL,
            batch_size=target.batch_size,
            deterministic=bool(target.deterministic),
            tf32=bool(target.tf32),
            kv_cache=target.kv_cache or "piecewise",
            fp8_linear=target.fp8_linear,
            sdpa_backend=sdpa_backend_name(target.sdpa_backend),
            tp_degree=tp_degree,
        )

    def to_json(self) -> JsonObject:
        return asdict(self)


@dataclass(frozen=True)
class Platform:
    """Where the screening runs and what it supports. `fp8_unavailable`: why an FP8 lm_head
    cannot run here (None: it can). `devices`: how many CUDA GPUs a tensor-parallel group may
    span here (1 on a CPU, whose TP group is gloo processes on the same cores)."""

    device: Device
    gpu_name: str | None = None
    sm: str | None = None
    fp8_unavailable: str | None = None
    flash_attn_installed: bool = False
    devices: int = 1


#: probe(config): why `config` cannot run here, found by trying it on the device (None: it
#: can): `sweep.worker.TorchFacts.availability`, or a test's fake.
AvailabilityProbe = Callable[[ScreenConfig], str | None]


def unavailable_reason(
    config: ScreenConfig, platform: Platform, *, cpu_tp: bool = False
) -> str | None:
    """Why `config` cannot run on `platform` (None: it can), from the platform's facts alone:
    "not available here", never a failure. `cpu_tp`: the user named the tp knob."""
    k = config.tp_degree
    if k > 1 and platform.device == "cuda" and platform.devices < k:
        return f"TP {k} needs {k} CUDA GPUs; this process owns {platform.devices}"
    if k > 1 and platform.device != "cuda" and not cpu_tp:
        return (
            f"TP {k} on a CPU runs as {k} gloo processes: a check of the tensor-parallel path, "
            "not a production numeric, run only when asked for by name (--knobs tp)"
        )
    if config.lm_head_dtype == "fp8_e5m2":
        return "the engine has no fp8_e5m2 lm_head (only fp8_e4m3)"
    if config.lm_head_dtype == "fp8_e4m3" and platform.fp8_unavailable:
        return platform.fp8_unavailable
    if config.fp8_linear:
        if platform.device != "cuda":
            return "end-to-end FP8 linear layers need a CUDA GPU of compute capability >= 8.9"
        if platform.fp8_unavailable:
            return platform.fp8_unavailable
    if config.attn_kernel == "flash_attention_2":
        if platform.device != "cuda":
            return "flash_attention_2 runs on CUDA only"
        if not platform.flash_attn_installed:
            return "flash_attention_2 needs the flash-attn package, which is not installed"
    if (
        config.sdpa_backend is not None
        and platform.device != "cuda"
        and config.sdpa_backend not in CPU_SDPA_BACKENDS
    ):
        return (
            f"the SDPA {config.sdpa_backend} backend is a CUDA kernel (torch's SDPA has only"
            f" {' and '.join(CPU_SDPA_BACKENDS)} on a CPU)"
        )
    if config.tf32 and platform.device != "cuda":
        return "TF32 is a CUDA matmul mode: it changes nothing on a CPU"
    if config.kv_cache == "compiled" and platform.device != "cuda":
        return (
            "the compiled decode path compiles its step and captures it in a CUDA graph: "
            "on a CPU it would run uncompiled"
        )
    return None


@dataclass(frozen=True)
class KnobValue:
    """One value of a knob (the reference's own value is left out)."""

    label: str
    config: ScreenConfig
    #: Why this value cannot run here (None: it runs).
    unavailable: str | None = None


@dataclass(frozen=True)
class Knob:
    name: KnobName
    title: str
    values: tuple[KnobValue, ...]


def _value_configs(
    name: KnobName, ref: ScreenConfig, tp_degree: int
) -> list[tuple[str, ScreenConfig]]:
    """(label, configuration) of each value of knob `name`, the reference's own value left out."""
    out: list[tuple[str, ScreenConfig]] = []
    if name == "body_dtype":
        out = [(d, replace(ref, dtype=d, weight_dtype=None)) for d in BODY_DTYPES]
    elif name == "lm_head":
        out = [
            (f"head {h}", replace(ref, lm_head_dtype=h))
            for h in HEAD_DTYPES
            if h != "fp8_e5m2"  # the engine has none (`unavailable_reason`)
        ]
    elif name == "weight_storage":
        # The paper's storage-vs-compute ablation: weights rounded to 16 bits, every product in
        # FP32 (also the LayerCast-style body-scope baseline).
        out = [
            (f"{w}-stored, fp32 compute", replace(ref, dtype="fp32", weight_dtype=w))
            for w in BODY_DTYPES
            if w != "fp32"
        ]
    elif name == "attn_kernel":
        out = [(k, replace(ref, attn_kernel=k, sdpa_backend=None)) for k in ATTN_KERNELS]
        out += [
            (f"sdpa ({b})", replace(ref, attn_kernel="sdpa", sdpa_backend=b)) for b in SDPA_BACKENDS
        ]
    elif name == "deterministic":
        out = [
            (f"deterministic {'on' if v else 'off'}", replace(ref, deterministic=v))
            for v in (True, False)
        ]
    elif name == "tf32":
        out = [(f"TF32 {'on' if v else 'off'}", replace(ref, tf32=v)) for v in (True, False)]
    elif name == "batch_size":
        out = [(f"batch {b}", replace(ref, batch_size=b)) for b in BATCH_SIZES]
    elif name == "kv_cache":
        out = [(f"{k} cache", replace(ref, kv_cache=k)) for k in CACHE_KINDS]
    elif name == "fp8_linear":
        out = [("end-to-end fp8 linear", replace(ref, fp8_linear=True))]
    elif name == "tp":
        out = [(f"TP {tp_degree}", replace(ref, tp_degree=tp_degree))]
    return [(label, c) for label, c in out if _normal(c) != _normal(ref)]


def _normal(c: ScreenConfig) -> ScreenConfig:
    """The configuration with defaults spelled out (head = body, storage = compute)."""
    return replace(c, lm_head_dtype=c.head_dtype, weight_dtype=c.stored_dtype)


_TITLES: Final[dict[str, str]] = {
    "body_dtype": "Body dtype",
    "lm_head": "lm_head format",
    "weight_storage": "Weight storage vs compute",
    "attn_kernel": "Attention kernel",
    "deterministic": "Deterministic algorithms",
    "tf32": "TF32 matmuls",
    "batch_size": "Batch size (batch-shape emulation)",
    "kv_cache": "KV cache",
    "fp8_linear": "End-to-end FP8 linear layers",
    "tp": "Tensor-parallel degree",
}


@dataclass(frozen=True)
class Run:
    """A configuration decoded with an intervention: "none" (the gate is still evaluated, so
    its firings are the would-fire steps) or "C" (gated FP32 lm_head recompute)."""

    config: ScreenConfig
    intervention: ScreenIntervention = "none"

    @property
    def key(self) -> str:
        return self.config.key + ("+C" if self.intervention == "C" else "")


@dataclass(frozen=True)
class ComparisonSpec:
    """Arm B against arm A, both runs of the screening."""

    name: str
    label: str
    a: Run
    b: Run
    knob: KnobName | None = None


@dataclass(frozen=True)
class SweepPlan:
    """The screening's input (besides the prompts): reference, knobs, pair, gate, budget."""

    reference: ScreenConfig
    knobs: tuple[Knob, ...]
    pair: tuple[ScreenConfig, ScreenConfig]
    platform: Platform
    tau: float = DEFAULT_TAU
    tau_ulps: float | None = None
    max_new_tokens: int = MAX_NEW_TOKENS.default
    top_k: int = TOP_K.default
    cover: float = COVER.default
    extra: JsonObject = field(default_factory=dict)

    @property
    def gate(self) -> GateRule:
        return GateRule(tau=self.tau, tau_ulps=self.tau_ulps)

    def intervention(self, kind: ScreenIntervention) -> Intervention:
        return Intervention(kind=kind, tau=self.tau, tau_ulps=self.tau_ulps)

    def comparisons(self) -> list[ComparisonSpec]:
        """Comparison 0: the pair (baseline); 1: the pair, both arms with gated C; then every
        available knob value against the reference (one at a time)."""
        a, b = self.pair
        out = [
            ComparisonSpec("pair", f"{a.dtype} vs {b.dtype}", Run(a), Run(b)),
            ComparisonSpec(
                "pair_c", f"{a.dtype}+C vs {b.dtype}+C (both arms)", Run(a, "C"), Run(b, "C")
            ),
        ]
        return out + [
            ComparisonSpec(
                f"{knob.name}:{v.config.key}",
                f"{_TITLES[knob.name]}: {v.label}",
                Run(self.reference),
                Run(v.config),
                knob.name,
            )
            for knob in self.knobs
            for v in knob.values
            if v.unavailable is None
        ]

    def runs(self) -> list[Run]:
        """Every run, each once, anchors first (arm A of some comparison: the reference and the
        pair's arm A), so that a comparison's arm A is decoded before its arm B."""
        seen: dict[str, Run] = {}
        specs = self.comparisons()
        for run in [s.a for s in specs] + [s.b for s in specs]:
            seen.setdefault(run.key, run)
        return list(seen.values())

    def configs(self) -> list[ScreenConfig]:
        """The configurations to load, each once, in the order of `runs`."""
        out: dict[str, ScreenConfig] = {}
        for r in self.runs():
            out.setdefault(r.config.key, r.config)
        return list(out.values())

    def fingerprint(self, prompts: Sequence[Sequence[int]]) -> str:
        """What the stored outputs depend on (another plan or prompt set starts over)."""
        body: JsonObject = {
            "runs": list[JsonValue](r.key for r in self.runs()),
            "tau": self.tau,
            "tau_ulps": self.tau_ulps,
            "max_new_tokens": self.max_new_tokens,
            "top_k": self.top_k,
            "prompts": [list[JsonValue](p) for p in prompts],
            # Outputs of another device are not this platform's.
            "platform": [self.platform.device, self.platform.gpu_name, self.platform.sm],
            "extra": self.extra,
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def build_plan(
    platform: Platform,
    *,
    reference: ScreenConfig,
    knobs: Sequence[str] | None = None,
    pair: tuple[BodyDType, BodyDType] = DEFAULT_PAIR,
    tau: float = DEFAULT_TAU,
    tau_ulps: float | None = None,
    max_new_tokens: int = MAX_NEW_TOKENS.default,
    top_k: int = TOP_K.default,
    cover: float = COVER.default,
    probe: AvailabilityProbe | None = None,
    tp_degree: int = DEFAULT_TP_DEGREE,
) -> SweepPlan:
    """The one-knob-at-a-time plan from `reference`. ValueError on an unknown knob. Naming `tp`
    in `knobs` runs it on a CPU too (`unavailable_reason`); `tp_degree` is its one degree (a
    process keeps one TP group). A value the platform allows is still "not available here"
    when `probe` gives a reason: a kernel that turns the inputs down is no knob failure."""
    if tp_degree < 2:
        raise ValueError("the tp knob's degree must be at least 2")
    cpu_tp = knobs is not None and "tp" in knobs
    knobs = KNOB_NAMES if knobs is None else knobs
    unknown = [k for k in knobs if k not in KNOB_NAMES]
    if unknown:
        raise ValueError(f"unknown knob {unknown[0]!r}; known: {', '.join(KNOB_NAMES)}")
    if not 0 < cover <= 1:
        raise ValueError("cover must be in (0, 1]")

    def value(label: str, c: ScreenConfig) -> KnobValue:
        reason = unavailable_reason(c, platform, cpu_tp=cpu_tp)
        return KnobValue(label, c, reason or (probe(c) if probe else None))

    built = []
    for name in KNOB_NAMES:
        if name in knobs:
            configs = _value_configs(name, reference, tp_degree)
            built.append(Knob(name, _TITLES[name], tuple(value(*v) for v in configs)))
    pa, pb = (replace(reference, dtype=d, lm_head_dtype=None, weight_dtype=None) for d in pair)
    return SweepPlan(
        reference=reference,
        knobs=tuple(built),
        pair=(pa, pb),
        platform=platform,
        tau=tau,
        tau_ulps=tau_ulps,
        max_new_tokens=max_new_tokens,
        top_k=top_k,
        cover=cover,
    )
