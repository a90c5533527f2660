"""The replay domain's values, defined once and used from the request to the row and back.

    RunTarget      one target of a run: an engine `Target` (dtype, head format, kernel, batch
                   size, intervention), where it runs and its label; or `self`, the trace's own
                   logged configuration. `to_json`/`from_json` are its stored form.
    Comparison     arm A vs arm B of a run; A is "logged" (the trace as logged) or a target.
    LoggedTrace    what a replay needs of a stored trace, as numpy arrays (no HTTP schema).
    ArmMargin      an arm's top-2 margin at t*, absolute and in ulps, and where it came from.
    ArmOutcome     one arm of a replayed comparison: tokens, margins, gate firings, environment.
    SingleStep     the from-scratch re-run at t* in both formats.
    ReplayOutcome  the answer for one (trace, comparison): t*, category, both arms.
    ControlSample  which unflagged traces a scan-then-decode run decodes anyway (seeded).

Arms are `a` and `b` everywhere; "logged" is only the name of a source (arm A of a comparison
against the logged tokens). The engine's own values (`Target`, `Intervention`) live in
`replay_audit.engine.protocol`, torch-free, because the engine takes them and may not import
this package. Pure: stdlib and numpy.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from replay_audit.diff.answer import SemanticAgreement
from replay_audit.diff.margin import DEFAULT_TAU
from replay_audit.diff.pieces import Piece, PieceJson, from_json
from replay_audit.engine.protocol import (
    DEFAULT_B_TOP_K,
    BatchLayout,
    Intervention,
    LogitsProcessors,
    Sampling,
    SamplingRecipe,
    Target,
)
from replay_audit.formats import (
    CONTROL_FRACTION,
    CONTROL_SEED,
    EXTRA_TOP_K_VALUES,
    FLAGGED_FRACTION,
    SCAN_FLAG_ULPS,
    ArmKey,
    Baseline,
    Category,
    Device,
    MarginSource,
    Mode,
    Screen,
    SingleStepKind,
    StopReason,
    TopKValues,
    logged_by_another_engine,
)
from replay_audit.formats import MAX_SCAN_FLAG_ULPS as MAX_SCAN_FLAG_ULPS
from replay_audit.formats import SCAN_FLAG_OFF as SCAN_FLAG_OFF
from replay_audit.json_value import JsonObject
from replay_audit.queue.route import ANY_KIND
from replay_audit.traces.selection import is_greedy

#: A run selecting at least this many traces and naming no `mode` is replayed scan-then-decode
#: (`resolve_mode`; why 1,000: docs/replays.md "Large runs"). `REPLAY_AUDIT_LARGE_RUN_TRACES`
#: changes it per deployment.
LARGE_RUN_TRACES: Final = 1000
#: A large run that names neither its mode nor a `decode_window` decodes a flagged or sampled
#: trace only to t* + this many tokens (`resolve_window`): t*, the margins and the category are
#: those of a whole decode, and a nightly audit does not pay for the cascade after them
#: (docs/replays.md "Large runs"). `REPLAY_AUDIT_LARGE_RUN_DECODE_WINDOW` changes it per
#: deployment; a request that names its mode decodes to the end unless it names a window.
LARGE_RUN_DECODE_WINDOW: Final = 32
#: A large run that names neither its mode nor a `flagged_fraction` decodes this share of the
#: traces its scan flags (by a mismatch or a near-tie), and keeps the scan's result for the
#: others (`resolve_flagged_fraction`; why 5%: `formats.FLAGGED_FRACTION`).
#: `REPLAY_AUDIT_LARGE_RUN_FLAGGED_FRACTION` changes it per deployment.
LARGE_RUN_FLAGGED_FRACTION: Final = 0.05
# The run options' defaults and limits (defined with the vocabulary).
DEFAULT_CONTROL_FRACTION: Final = CONTROL_FRACTION.default
DEFAULT_FLAGGED_FRACTION: Final = FLAGGED_FRACTION.default
DEFAULT_CONTROL_SEED: Final = CONTROL_SEED.default
DEFAULT_SCAN_FLAG_ULPS: Final = SCAN_FLAG_ULPS.default


def resolve_mode(requested: Mode | None, n_traces: int, large_run_traces: int) -> Mode:
    """The mode requested, else scan-then-decode for a large run and decode for a smaller one."""
    if requested is not None:
        return requested
    return "scan_then_decode" if n_traces >= large_run_traces else "decode"


def resolve_window(
    requested_mode: Mode | None,
    requested_window: int | None,
    mode: Mode,
    *,
    pairwise: bool,
    large_run_window: int,
) -> int | None:
    """The window requested, else `large_run_window` for a large run (one that named no mode
    and resolved to scan-then-decode, compared with its logged tokens), else none."""
    if requested_window is not None or requested_mode is not None or pairwise:
        return requested_window
    return large_run_window if mode == "scan_then_decode" else None


def resolve_flagged_fraction(
    requested_mode: Mode | None,
    requested_fraction: float | None,
    mode: Mode,
    *,
    pairwise: bool,
    large_run_fraction: float,
) -> float:
    """The flagged fraction requested, else `large_run_fraction` for a large run (the rule of
    `resolve_window`: one that named no mode and resolved to scan-then-decode, compared with
    its logged tokens), else 1 (every flagged trace decoded)."""
    if requested_fraction is not None:
        return requested_fraction
    if requested_mode is not None or pairwise or mode != "scan_then_decode":
        return DEFAULT_FLAGGED_FRACTION
    return large_run_fraction


#: The label of the self target a run adds to reproduce its traces before comparing them.
ENGINE_CHECK_LABEL: Final = "self: reproduction check"


@dataclass(frozen=True)
class ControlSample:
    """The control sample of a scan-then-decode run (docs/replays.md "The control sample"):
    decided per trace by a hash of (`seed`, its id), so every job decides alone and alike."""

    fraction: float = DEFAULT_CONTROL_FRACTION
    seed: int = DEFAULT_CONTROL_SEED
    #: The run's near-tie flag (`pipeline.ReplayOptions.flag_ulps`): traces it flags are
    #: decoded for that reason and are not in the sample; negative: off (mismatches only).
    flag_ulps: float = DEFAULT_SCAN_FLAG_ULPS
    #: The flagged sample's share (docs/replays.md "The flagged sample"): a trace the scan
    #: flags by a mismatch is decoded from its first disagreement when `decodes_flagged`, else
    #: it keeps the scan's result; one flagged by a near-tie is decoded from the prompt when
    #: `decodes_flagged`, else only scanned. 1: every flagged trace decoded. The same `seed`.
    flagged_fraction: float = DEFAULT_FLAGGED_FRACTION

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError("the control fraction is a share: 0 to 1")
        if not self.flag_ulps <= MAX_SCAN_FLAG_ULPS:  # NaN too
            raise ValueError(f"the near-tie flag is at most {MAX_SCAN_FLAG_ULPS} ulps")
        if not 0.0 < self.flagged_fraction <= 1.0:  # NaN too
            raise ValueError("the flagged fraction is a share: more than 0, at most 1")

    def includes(self, trace_key: str) -> bool:
        """Whether the trace named `trace_key` (its public id) is in the control sample."""
        return _drawn(f"control:{self.seed}:{trace_key}", self.fraction)

    def decodes_flagged(self, trace_key: str) -> bool:
        """Whether the trace named `trace_key` is in the flagged sample: decoded where the scan
        flags it (from its first disagreement for a mismatch, from the prompt for a near-tie;
        one draw for either reason). Its own salt, so it is drawn independently of the control
        sample."""
        return self.flagged_fraction >= 1.0 or _drawn(
            f"flagged:{self.seed}:{trace_key}", self.flagged_fraction
        )


def _drawn(salted_key: str, fraction: float) -> bool:
    """A draw with probability `fraction` decided by a hash of `salted_key`: the same key
    draws alike in every process and on every retry."""
    digest = hashlib.sha256(salted_key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < fraction


def logging_engine(config_json: str) -> str:
    """The engine a stored configuration names (`config.engine.name`; "unknown" if none)."""
    engine = json.loads(config_json).get("engine") or {}
    return str(engine.get("name") or "unknown")


def logged_tp_degree(config: Mapping[str, Any]) -> int | None:
    """The TP degree a stored configuration was logged at (None: it does not say)."""
    tp = config.get("tp_degree", 1)
    return int(tp) if tp is not None else None


def logged_gpu_name(config: Mapping[str, Any]) -> str | None:
    """The GPU a stored configuration was logged on (`gpu.name`; None: a CPU, or not said)."""
    gpu = config.get("gpu")
    name = gpu.get("name") if isinstance(gpu, Mapping) else None
    return str(name) if name else None


@dataclass(frozen=True)
class LoggedPlacement:
    """Where a trace was logged: on which GPU (None: a CPU, or not logged), at which
    tensor-parallel degree (None: not logged) and in a batch of how many rows. What routes its
    replay by default, and how many traces share a job (`service.job_traces`)."""

    gpu_name: str | None = None
    tp_degree: int | None = 1
    batch_size: int = 1

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> LoggedPlacement:
        """The placement a stored configuration records."""
        batch = config.get("batch_size")
        return cls(
            logged_gpu_name(config),
            logged_tp_degree(config),
            batch if isinstance(batch, int) and batch > 1 else 1,
        )


@dataclass(frozen=True)
class RunTarget:
    """A target of a run. `target` None means `self`: each trace replayed in its own logged
    configuration (a reproducibility check, not a treatment: it never gets a lift)."""

    target: Target | None
    device: Device | None = None
    label: str | None = None
    #: The GPU kind to replay on (`queue.route.gpu_kind`, or `any`: any GPU); None: the
    #: trace's logged GPU kind (`route_of`).
    gpu_kind: str | None = None
    #: The tensor-parallel degree to replay at; None: the trace's logged degree.
    tp_degree: int | None = None

    @property
    def is_self(self) -> bool:
        return self.target is None

    def tp_degree_for(self, trace: LoggedTrace) -> int:
        """The TP degree this target replays `trace` at: the one it names, else the trace's
        logged degree (1 where the trace does not say)."""
        if self.tp_degree is not None:
            return self.tp_degree
        return trace.tp_degree or 1

    def resolve(self, logged: Target) -> Target:
        """The engine target for a trace logged in `logged`. A self target leaves the kernel
        unrequested, as any target that names none (`pipeline.resolve_arm` picks it). A target
        keeps the logged process switches it leaves open: one knob at a time."""
        if self.target is None:
            return replace(logged, attn_kernel=None)
        t = self.target
        return replace(
            t,
            deterministic=logged.deterministic if t.deterministic is None else t.deterministic,
            tf32=logged.tf32 if t.tf32 is None else t.tf32,
            sdpa_backend=t.sdpa_backend or logged.sdpa_backend,
        )

    def display_label(self) -> str:
        """A short human name: the label, else e.g. `fp16 / head fp32 + C(τ=0.001)`."""
        if self.label:
            return self.label
        if self.target is None:
            return "self"
        where = self.gpu_kind and ("any GPU" if self.gpu_kind == ANY_KIND else self.gpu_kind)
        return config_label(self.target, self.tp_degree or 1, where)

    def to_json(self) -> JsonObject:
        """The stored form (the run's `targets` column, as the API returns it)."""
        if self.target is None:
            return {"self": True, "label": self.label or "self (logged configuration)"}
        return {
            **self.target.to_dict(),
            "device": self.device,
            "gpu_kind": self.gpu_kind,
            "tp_degree": self.tp_degree,
            "label": self.label,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RunTarget:
        """The inverse of `to_json` (defaults as `Intervention`'s for keys a row lacks)."""
        if d.get("self"):
            return cls(None, label=d.get("label"))
        return cls(
            Target(
                dtype=str(d["dtype"]),
                lm_head_dtype=d.get("lm_head_dtype"),
                attn_kernel=d.get("attn_kernel"),
                batch_size=int(d.get("batch_size") or 1),
                intervention=intervention_from_json(d.get("intervention") or {}),
                weight_dtype=d.get("weight_dtype"),
                deterministic=d.get("deterministic"),
                tf32=d.get("tf32"),
                sdpa_backend=d.get("sdpa_backend"),
                kv_cache=d.get("kv_cache"),
                fp8_linear=bool(d.get("fp8_linear")),
            ),
            device=d.get("device"),
            label=d.get("label"),
            gpu_kind=d.get("gpu_kind"),
            tp_degree=d.get("tp_degree"),
        )


def routing_conflict(targets: Sequence[RunTarget]) -> tuple[int, str] | None:
    """The first target whose GPU kind cannot be met, and why (None: none): a run's targets
    name one GPU kind or none (one worker runs every arm of a trace), and only on the GPU."""
    first: tuple[int, str] | None = None
    for i, t in enumerate(targets):
        if t.gpu_kind is None:
            continue
        if t.device == "cpu":
            return i, "a GPU kind with device cpu"
        if first is not None and t.gpu_kind != first[1]:
            return i, (
                f"{t.gpu_kind!r}, but targets[{first[0]}] names {first[1]!r}: one worker runs "
                "every arm of a trace, so a run's targets name one GPU kind (compare kinds "
                "across runs)"
            )
        first = first or (i, t.gpu_kind)
    return None


#: Why a resolved arm runs the attention kernel it runs: the target named it; the target named
#: none and the trace's logged kernel runs here; or neither could run here (the logged kernel is
#: `unknown` or not available on this device) and the engine's default ran.
KernelSource = Literal["requested", "logged", "engine_default"]


#: The libraries whose versions a resolved arm records, and compares with the logged ones.
STACK_VERSIONS: Final = ("torch", "transformers", "cuda", "cudnn")


def stack_versions(config: Mapping[str, Any]) -> dict[str, str]:
    """The library versions a configuration (a trace's, or an engine's environment) records:
    torch, CUDA, cuDNN, and transformers where transformers ran (its `extras`, or the engine's
    own version when the engine is transformers)."""
    extras = config.get("extras") or {}
    engine = config.get("engine") or {}
    found = {
        "torch": config.get("torch_version"),
        "transformers": extras.get("transformers_version")
        or (engine.get("version") if engine.get("name") == "transformers" else None),
        "cuda": config.get("cuda_version"),
        "cudnn": config.get("cudnn_version"),
    }
    return {k: str(v) for k, v in found.items() if v is not None}


@dataclass(frozen=True)
class ResolvedArm:
    """An arm resolved against one trace into the complete computation that runs (from its
    engine's recorded environment): what every surface shows of it, stored with the result."""

    dtype: str
    lm_head_dtype: str
    weight_dtype: str | None
    attn_kernel: str
    kernel_source: KernelSource
    batch_size: int
    tp_degree: int
    device: str
    #: The GPU's name and compute capability, e.g. `NVIDIA H100 80GB HBM3 (sm 9.0)`; None on a CPU.
    gpu: str | None
    #: The engine's decode path (e.g. `piecewise`, `generate`, `compiled`), as its environment
    #: records it.
    engine_path: str | None
    intervention: Intervention
    #: The GPU kind the worker that ran it announced (`queue.route.WorkerKind`: `cpu` on a CPU
    #: worker); None where not recorded (rows of earlier releases).
    worker_kind: str | None = None
    #: The trace's logged TP degree (None: the trace does not say): where it differs from
    #: `tp_degree`, the request asked for another degree and this one ran.
    logged_tp_degree: int | None = None
    #: The trace's logits processors, applied to every step's logits (None: none ran).
    logits_processors: LogitsProcessors | None = None
    #: torch's switches the probes ran under (as the logging stack had them, or as the target
    #: named them; the process's where neither says): deterministic algorithms, TF32.
    deterministic: bool | None = None
    tf32: bool | None = None
    #: The SDPA backend the arm pinned (None: torch chose, see `attention_backends`).
    sdpa_backend: str | None = None
    #: The SDPA backends torch picked for the probes' calls, by phase (`prefill:cudnn;decode:
    #: flash`); None where no SDPA call ran (eager attention) or not recorded.
    attention_backends: str | None = None
    #: Every linear layer of the body in FP8 (the screening's end-to-end FP8 knob).
    fp8_linear: bool = False
    #: The library versions that ran (torch, transformers, CUDA, cuDNN).
    versions: Mapping[str, str] = field(default_factory=dict)
    #: What differs from the stack that logged the trace (`torch 2.11.0 (logged 2.9.1)`, ...):
    #: a replay under other versions or on another GPU says so on every surface.
    stack_differs: tuple[str, ...] = ()
    #: The logged batch the row replayed in (None: alone, or among copies of itself).
    batch_layout: BatchLayout | None = None
    #: How its single-step probe at t* ran (rows of earlier releases: from scratch).
    single_step: SingleStepKind = "from_scratch"

    @property
    def tp_differs(self) -> bool:
        """Ran at a TP degree other than the logged one (asked for by the request)."""
        return self.logged_tp_degree is not None and self.logged_tp_degree != self.tp_degree

    @property
    def target(self) -> Target:
        """The engine target this arm runs (the kernel resolved)."""
        head = None if self.lm_head_dtype == self.dtype else self.lm_head_dtype
        weight = None if self.weight_dtype in (None, self.dtype) else self.weight_dtype
        return Target(
            self.dtype,
            head,
            self.attn_kernel,
            self.batch_size,
            self.intervention,
            weight_dtype=weight,
            deterministic=self.deterministic,
            tf32=self.tf32,
            sdpa_backend=self.sdpa_backend,
            fp8_linear=self.fp8_linear,
        )

    def label(self) -> str:
        """A short human name of what ran, e.g. `bf16 / eager / cpu [worker a10g] + C(τ=0.05)
        [stack differs: torch ...]`."""
        where = self.gpu or self.device
        if self.gpu is None and self.worker_kind not in (None, self.device):
            where = f"{where} [worker {self.worker_kind}]"
        logged = self.logged_tp_degree if self.tp_differs else None
        label = config_label(self.target, self.tp_degree, where, logged_tp_degree=logged)
        if self.logits_processors is not None:
            label += f" + {self.logits_processors.label()}"
        if self.batch_layout is not None:
            b = self.batch_layout
            label += f" [row {b.row + 1} of a logged batch of {b.size}]"
        if self.stack_differs:
            label += f" [stack differs: {'; '.join(self.stack_differs)}]"
        return label

    def to_json(self) -> dict[str, object]:
        """The stored form (a result's `resolved_a`/`resolved_b`, the API's `arms.*.resolved`)."""
        return asdict(self)

    def ran(self, environment: Mapping[str, Any]) -> ResolvedArm:
        """This arm with what only its probes can say, from its engine's environment after
        them: the decode paths they took and the SDPA backends torch picked."""
        extras = environment.get("extras") or {}
        path = extras.get("decoder") or extras.get("kv_cache") or self.engine_path
        backends = extras.get("attention_backends") or self.attention_backends
        return replace(self, engine_path=path, attention_backends=backends)

    @classmethod
    def from_environment(
        cls,
        environment: Mapping[str, Any],
        intervention: Intervention,
        kernel_source: KernelSource,
        *,
        worker_kind: str | None = None,
        logged: LoggedTrace | None = None,
        layout: BatchLayout | None = None,
        single_step: SingleStepKind = "from_scratch",
    ) -> ResolvedArm:
        """The arm an engine runs, from its `Engine.environment()`, for the trace `logged`."""
        gpu = environment.get("gpu")
        extras = environment.get("extras") or {}
        path = extras.get("decoder") or extras.get("kv_cache")
        versions = stack_versions(environment)
        gpu_label = f"{gpu['name']} (sm {gpu['sm']})" if isinstance(gpu, Mapping) else None
        gpu_name = gpu.get("name") if isinstance(gpu, Mapping) else None
        return cls(
            dtype=str(environment["dtype"]),
            lm_head_dtype=str(environment.get("lm_head_dtype") or environment["dtype"]),
            weight_dtype=environment.get("weight_dtype"),
            attn_kernel=str(environment.get("attn_kernel")),
            kernel_source=kernel_source,
            batch_size=int(environment.get("batch_size") or 1),
            tp_degree=int(environment.get("tp_degree") or 1),
            device=str(environment.get("device") or "cpu"),
            gpu=gpu_label,
            engine_path=str(path) if path is not None else None,
            intervention=intervention,
            worker_kind=worker_kind,
            logged_tp_degree=logged.tp_degree if logged is not None else 1,
            logits_processors=logged.processors if logged is not None else None,
            deterministic=environment.get("deterministic"),
            tf32=environment.get("tf32"),
            sdpa_backend=extras.get("sdpa_backend"),
            attention_backends=extras.get("attention_backends"),
            fp8_linear=bool(extras.get("fp8_linear")),
            versions=versions,
            stack_differs=(
                stack_differences(logged, versions, gpu_name) if logged is not None else ()
            ),
            batch_layout=layout,
            single_step=single_step,
        )

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ResolvedArm:
        """The inverse of `to_json`."""
        return cls(
            **{
                **d,
                "intervention": intervention_from_json(d.get("intervention") or {}),
                "logits_processors": LogitsProcessors.from_json(d.get("logits_processors")),
                "stack_differs": tuple(d.get("stack_differs") or ()),
                "batch_layout": batch_layout_from_json(d.get("batch_layout")),
            }
        )


def stack_differences(
    logged: LoggedTrace, versions: Mapping[str, str], gpu_name: str | None
) -> tuple[str, ...]:
    """What of the stack that ran differs from the one that logged `logged`: library versions
    (`torch 2.11.0 (logged 2.9.1)`) and the GPU (a replay on the CPU of a GPU trace too)."""
    out = [
        f"{name} {versions[name]} (logged {logged.versions[name]})"
        for name in STACK_VERSIONS
        if name in logged.versions and versions.get(name) != logged.versions[name]
    ]
    if logged.gpu_name is not None and gpu_name != logged.gpu_name:
        out.append(f"{gpu_name or 'no GPU'} (logged {logged.gpu_name})")
    return tuple(out)


def config_label(
    t: Target,
    tp_degree: int = 1,
    where: str | None = None,
    *,
    logged_tp_degree: int | None = None,
) -> str:
    """`fp16 / head fp32 / eager / bs 8 / tp 2 / cpu + C(τ=0.05)`: what is not the default
    (`tp 1 (logged tp 2)` where another TP degree than the logged one ran)."""
    head = t.lm_head_dtype and f"head {t.lm_head_dtype}"
    tp = (tp_degree != 1 or logged_tp_degree is not None) and f"tp {tp_degree}"
    if tp and logged_tp_degree is not None:
        tp += f" (logged tp {logged_tp_degree})"
    parts = [t.dtype, head, t.attn_kernel, t.batch_size != 1 and f"bs {t.batch_size}"]
    parts += [tp, where]
    return " / ".join(p for p in parts if p) + intervention_suffix(t.intervention)


def intervention_suffix(iv: Intervention) -> str:
    """` + C(τ=0.05)`, ` + A(2 ulps)`; empty for none."""
    if iv.kind == "none":
        return ""
    gate = f"{iv.tau_ulps:g} ulps" if iv.tau_ulps is not None else f"τ={iv.tau:g}"
    return f" + {iv.kind}({gate})"


def batch_layout_from_json(d: Mapping[str, Any] | None) -> BatchLayout | None:
    """A batch layout from its stored form (a trace's `decoding.batch`, or `asdict`)."""
    return BatchLayout(tuple(int(n) for n in d["prompt_lengths"]), int(d["row"])) if d else None


def sampling_from_json(
    d: Mapping[str, Any] | None, batch: Mapping[str, Any] | None = None
) -> Sampling | None:
    """A sampled trace's seeded sampler from its `decoding.sampling` and `decoding.batch` (the
    batch's rows and this trace's row: transformers draws the noise per batch); None for none."""
    if not d:
        return None
    recipe = SamplingRecipe.from_json(d)
    rows, row = (len(batch["prompt_lengths"]), int(batch["row"])) if batch else (1, 0)
    return Sampling(recipe, int(d["seed"]), d.get("device", "cpu"), rows, row)


def intervention_from_json(iv: Mapping[str, Any]) -> Intervention:
    """An intervention from its stored form (`Intervention.to_dict`; defaults for missing keys)."""
    return Intervention(
        kind=iv.get("kind", "none"),
        tau=float(iv.get("tau", DEFAULT_TAU)),
        tau_ulps=iv.get("tau_ulps"),
        top_k=int(iv.get("top_k", DEFAULT_B_TOP_K)),
    )


@dataclass(frozen=True)
class Comparison:
    """Comparison `index` of a run: arm B (a target) against arm A (the logged tokens or a
    target). A comparison whose arm B is a `self` target is a reproducibility check."""

    index: int
    a: ArmKey
    b: int

    @property
    def against_logged(self) -> bool:
        return self.a == "logged"

    def to_json(self) -> JsonObject:
        return {"index": self.index, "a": self.a, "b": self.b}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Comparison:
        return cls(int(d["index"]), "logged" if d["a"] == "logged" else int(d["a"]), int(d["b"]))


def arm_label(arm: ArmKey, targets: Sequence[RunTarget]) -> str:
    """`logged`, or `T<i>: <target label>`."""
    return "logged" if arm == "logged" else f"T{arm}: {targets[arm].display_label()}"


def comparison_label(c: Comparison, targets: Sequence[RunTarget]) -> str:
    return f"{arm_label(c.a, targets)} vs {arm_label(c.b, targets)}"


def is_treatment(c: Comparison, targets: Sequence[RunTarget]) -> bool:
    """Whether the comparison measures a treatment, so that it gets a lift over the baseline:
    every comparison but comparison 0 and self-replays (a reproducibility check)."""
    return c.index != 0 and not targets[c.b].is_self


def c_against_logged(c: Comparison, targets: Sequence[RunTarget]) -> bool:
    """Whether the comparison applies Intervention C to the replay arm only, against the logged
    tokens: C moves that arm toward FP32, not toward the logged arm, so its lift there is
    about zero by construction (the both-arms protocol, `compare: "pairwise"`, measures it)."""
    target = targets[c.b].target
    return c.against_logged and target is not None and target.intervention.kind == "C"


@dataclass(frozen=True, eq=False)
class LoggedTrace:
    """What a replay needs of a logged trace, as numpy arrays and a `Target`; built at the
    edge from a stored row or an input file."""

    external_id: str | None
    weights_sha256: str
    vocab_size: int
    config: Target
    prompt_token_ids: npt.NDArray[np.int64]
    output_token_ids: npt.NDArray[np.int64]
    top_k_logits: npt.NDArray[np.float32] | None
    strategy: str
    max_new_tokens: int | None
    eos_token_ids: tuple[int, ...]
    stop_reason: StopReason | None
    output_text: str | None = None
    reference_answer: str | None = None
    #: What `top_k_logits` holds: logits, or raw logprobs (an import from a server's logprobs).
    top_k_values: TopKValues = "logits"
    #: The engine that logged the trace (`config.engine.name`).
    engine_name: str = "transformers"
    #: Each logged output token's piece, when the producer stored them (`diff.pieces`).
    output_token_pieces: tuple[Piece, ...] | None = None
    #: The tensor-parallel degree it was logged at (None: the log does not say).
    tp_degree: int | None = 1
    #: The GPU it was logged on (`config.gpu.name`; None: a CPU, or not logged).
    gpu_name: str | None = None
    #: The logits processors the generation ran with (`decoding.logits_processors`).
    logits_processors: LogitsProcessors | None = None
    #: The row's place in the batch it was generated in (`decoding.batch`; None: not logged).
    batch_layout: BatchLayout | None = None
    #: The library versions the logging stack recorded (`stack_versions`).
    versions: Mapping[str, str] = field(default_factory=dict)
    #: The seeded sampler of a sampled trace (`decoding.sampling`; None: greedy, or a sampler
    #: not logged): what a verification reproduces.
    sampling: Sampling | None = None

    @property
    def greedy(self) -> bool:
        return is_greedy({"strategy": self.strategy})

    @cached_property
    def processors(self) -> LogitsProcessors | None:
        """What every probe of an arm applies to this trace's logits: its logged processors,
        with its eos ids (`budget`: what min_new_tokens holds back); None where none ran."""
        p = self.logits_processors
        if p is None or not p.active:
            return None
        # Only the processors that read eos ids get them (one resolved arm for a run's traces).
        needs_eos = bool(p.min_new_tokens or p.bad_words_ids)
        return replace(p, eos_token_ids=tuple(self.budget()[1]) if needs_eos else ())

    @classmethod
    def from_parts(
        cls,
        *,
        external_id: str | None,
        weights_sha256: str,
        vocab_size: int,
        config: Mapping[str, Any],
        decoding: Mapping[str, Any],
        prompt_token_ids: npt.ArrayLike,
        output_token_ids: npt.ArrayLike,
        top_k_logits: npt.NDArray[np.float32] | None,
        output_text: str | None = None,
        reference_answer: str | None = None,
        output_token_pieces: Sequence[PieceJson] | None = None,
    ) -> LoggedTrace:
        """A logged trace from its stored or posted parts, as the trace JSON has them."""
        extras = config.get("extras") or {}
        engine = config.get("engine") or {}
        return cls(
            external_id=external_id,
            weights_sha256=weights_sha256,
            vocab_size=int(vocab_size),
            config=Target.from_config(dict(config)),
            prompt_token_ids=np.asarray(prompt_token_ids, np.int64),
            output_token_ids=np.asarray(output_token_ids, np.int64),
            top_k_logits=top_k_logits,
            strategy=str(decoding.get("strategy", "greedy")),
            max_new_tokens=decoding.get("max_new_tokens"),
            eos_token_ids=tuple(int(x) for x in decoding.get("eos_token_ids") or ()),
            stop_reason=decoding.get("stop_reason"),
            output_text=output_text,
            reference_answer=reference_answer,
            top_k_values=(
                "raw_logprobs" if extras.get(EXTRA_TOP_K_VALUES) == "raw_logprobs" else "logits"
            ),
            engine_name=str(engine.get("name") or "unknown"),
            output_token_pieces=(
                from_json(output_token_pieces) if output_token_pieces is not None else None
            ),
            tp_degree=logged_tp_degree(config),
            gpu_name=logged_gpu_name(config),
            logits_processors=LogitsProcessors.from_json(decoding.get("logits_processors")),
            batch_layout=batch_layout_from_json(decoding.get("batch")),
            versions=stack_versions(config),
            sampling=sampling_from_json(decoding.get("sampling"), decoding.get("batch")),
        )

    def layout_for(self, batch_size: int) -> BatchLayout | None:
        """The logged batch an arm of `batch_size` rows replays this row in: the logged one
        where the sizes agree (None: another size, or none logged: the row among copies)."""
        b = self.batch_layout
        return b if b is not None and b.size == batch_size else None

    @property
    def logged_by_another_engine(self) -> bool:
        """Logged by an engine other than this project's (see `formats.REPLAY_ENGINE_NAMES`)."""
        return logged_by_another_engine(self.engine_name)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> LoggedTrace:
        """A logged trace from `POST /v1/traces` JSON that has already been validated (the
        CLI's input files, the tests)."""
        top_k = body.get("top_k")
        logits = None
        if top_k is not None and top_k.get("logits"):
            logits = np.asarray(top_k["logits"], np.float32)
        model = body["model"]
        return cls.from_parts(
            external_id=body.get("external_id"),
            weights_sha256=model["weights_sha256"],
            vocab_size=model["vocab_size"],
            config=body["config"],
            decoding=body.get("decoding") or {},
            prompt_token_ids=body["prompt_token_ids"],
            output_token_ids=body["output_token_ids"],
            top_k_logits=logits,
            output_text=body.get("output_text"),
            reference_answer=body.get("reference_answer"),
            output_token_pieces=body.get("output_token_pieces"),
        )

    def budget(self) -> tuple[int, list[int]]:
        """How long a replay may run and which ids stop it: the logged max_new_tokens (so a
        replay may run longer or shorter), or the logged length where it stopped for a reason
        we cannot replay (a stop string). Without logged eos ids, an eos-stopped trace's last
        token is its eos."""
        out = self.output_token_ids
        if self.stop_reason in ("stop_string", "other"):
            budget = len(out)
        else:
            budget = max(self.max_new_tokens or 0, len(out))
        eos = list(self.eos_token_ids)
        if not eos and self.stop_reason == "eos" and len(out):
            eos = [int(out[-1])]
        return budget, eos


@dataclass(frozen=True)
class ArmMargin:
    """An arm's top-2 margin at t*: absolute and in ulps of its lm_head format (None where
    unknown), and its source."""

    abs: float | None
    ulps: float | None
    source: MarginSource

    @property
    def is_tie(self) -> bool:
        return self.abs == 0.0

    @classmethod
    def unavailable(cls) -> ArmMargin:
        return cls(None, None, "unavailable")


@dataclass(frozen=True)
class ArmOutcome:
    """One arm of a replayed comparison. An arm that was not run here (the logged tokens of a
    comparison against the trace) has no output, step counts or track: None, never zero."""

    #: The configuration the arm stands for: the run's target, or the logged configuration.
    target: Target | None
    #: The arm's output (None: the trace's logged output, not stored again).
    output_token_ids: tuple[int, ...] | None
    margin: ArmMargin | None
    #: What ran for this arm here (None: the logged tokens, not run here).
    resolved: ResolvedArm | None = None
    #: Whether the comparison's gate fires at t* on this arm's margin (None: no divergence, or
    #: the margin is unknown).
    gate_fired_at_divergence: bool | None = None
    gate_triggers: int | None = None
    steps: int | None = None
    mean_gap: float | None = None
    #: Steps where the intervention chose a token other than the native argmax.
    changed_steps: int | None = None
    #: Per-step margins (6 significant digits, a display track; None where not finite).
    margins: tuple[float | None, ...] | None = None
    gate_fired_steps: tuple[int, ...] | None = None
    #: The numerical environment the arm ran in here (JSON: the engine's recorded settings).
    environment: Mapping[str, Any] | None = None
    text: str | None = None
    #: Each output token's piece (`diff.pieces`), from the tokenizer that ran here; for the
    #: logged arm, the pieces of the logged tokens where the trace has none stored.
    pieces: tuple[Piece, ...] | None = None

    @property
    def trigger_rate(self) -> float | None:
        if self.steps is None or self.gate_triggers is None or self.steps == 0:
            return None
        return self.gate_triggers / self.steps


@dataclass(frozen=True)
class SingleStepChoice:
    token: int
    margin: ArmMargin | None
    #: "rerun": the arm's probe here (`SingleStep.kind`); "logged_token": the logged token
    #: stands in for a re-run of a format that cannot run here.
    source: Literal["rerun", "logged_token"]


@dataclass(frozen=True)
class SingleStep:
    """Both arms' choices at t* given prompt ‖ y<t* (`kind`): does the flip reproduce?"""

    step: int
    a: SingleStepChoice | None
    b: SingleStepChoice
    #: None when arm A could not be re-run and had no token at t*.
    disagree: bool | None
    kind: SingleStepKind = "from_scratch"


@dataclass(frozen=True)
class ReplayOutcome:
    """The answer for one trace and one comparison (DESIGN.md field names)."""

    mode: Mode
    #: None where no decode established it: a trace a scan-then-decode run only scanned.
    exact_match: bool | None
    first_divergence_step: int | None
    category: Category | None
    #: Either arm's margin at t* is exactly 0 (a tie in that arm's format).
    tie: bool
    cascade_length: int | None
    length_difference: int | None
    a: ArmOutcome
    b: ArmOutcome
    single_step: SingleStep | None = None
    semantic: SemanticAgreement | None = None
    external_id: str | None = None
    #: What a scan-then-decode run did with the trace (None in the other modes).
    screen: Screen | None = None
    #: An arm's decode stopped at the run's `decode_window` tokens after t* (arm B's, or
    #: either of a pair decoded from the prompt): its output is a prefix of the whole
    #: continuation (no cascade length, length difference or answers).
    window_cut: bool = False
    #: What a comparison with the logged tokens was judged against (`formats.Baseline`): the
    #: logged tokens, or the logged configuration replayed here (arm A) for a trace that did
    #: not reproduce in it or that an engine this service cannot run logged.
    baseline: Baseline = "logged"

    @property
    def gate_triggers(self) -> int:
        """Gate firings of arm B (the replayed arm): the result's `gate_triggers`."""
        return self.b.gate_triggers or 0
