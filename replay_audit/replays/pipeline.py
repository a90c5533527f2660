"""The one replay pipeline: every caller (the replay job, `replay-audit replay`, nightly audits,
the import round trips) replays through these functions, and nothing else assembles an outcome.
Torch-free: engines come from an `EnginePool` through the `Engine` protocol.

    ReplayItem (trace x comparison)
      │ resolve_arm: each arm run here resolved once against the trace into a `ResolvedArm`
      │              (body and head format, kernel and why, batch, TP, device, engine path,
      │              intervention) and the engine that runs all of it
      ▼
    scan_items        the scans of the scan modes, several traces per forward (`scan_batch`)
    replay_items      each item's arms run (decode / scan / scan then decode), t*, then the
      │               single-step probes at t* of every divergent item, batched per engine and
      │               intervention, each with its arm's whole computation: teacher-forced
      │               (the scans' own rows, else `scan_batch`) or from scratch (`step_batch`)
      ▼
    diff.judge        the one outcome rule: both arms' gates at t*, tie, single step, category
      ▼
    ReplayOutcome     -> results.result_values (the row) -> every surface

Modes, near-tie flags, the decode window and a trace's logits processors (which every probe
of every arm applies): docs/replays.md "Modes, and scan-then-decode for large runs". A
comparison of two targets decodes both arms from the prompt, in full (the paper's both-arms
protocol). Arm A against the logged tokens: its margin at t* is the logged top-k's where logged
and no processors ran (the logged top-k holds the logits before them), else the logged format's
re-run here (the outcome says which).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

import numpy as np

from replay_audit.diff import (
    Extractor,
    GateRule,
    Margin,
    cascade_length,
    first_divergence,
    first_near_tie,
    judge,
    length_difference,
    margin_from_logprobs,
    margin_from_top_k,
    margins_ulps_from_top_k,
    semantic_agreement,
)
from replay_audit.diff.answer import SemanticAgreement
from replay_audit.engine.batch import plan_scan
from replay_audit.engine.pool import EnginePool
from replay_audit.engine.protocol import (
    DEFAULT_SCAN_TOKEN_BUDGET,
    BatchLayout,
    DecodeRequest,
    DecodeRun,
    DecodeWindow,
    Engine,
    Intervention,
    LogitsProcessors,
    ScanItem,
    ScanRun,
    StepInfo,
    Steps,
    Target,
)
from replay_audit.exceptions import (
    BadRequest,
    EngineError,
    ModelMismatch,
    ReplayAuditError,
    UnsupportedFormat,
)
from replay_audit.formats import (
    MODES,
    SINGLE_STEP_KINDS,
    Baseline,
    MarginSource,
    Mode,
    Screen,
    SingleStepKind,
)
from replay_audit.replays.domain import (
    ENGINE_CHECK_LABEL,
    SCAN_FLAG_OFF,
    ArmMargin,
    ArmOutcome,
    KernelSource,
    LoggedTrace,
    ReplayOutcome,
    ResolvedArm,
    RunTarget,
    SingleStep,
    SingleStepChoice,
)
from replay_audit.words import counted

log = logging.getLogger(__name__)

#: What an engine raises for one item (besides the domain's errors): the item fails, not the run.
ENGINE_FAILURES: Final = (ReplayAuditError, RuntimeError, ValueError, MemoryError)


@dataclass(frozen=True)
class ReplayItem:
    """One trace and one comparison: arm B against arm A (None: the logged tokens; else both
    decoded here). `control`: in the run's control sample; `decode_flagged`: in its flagged
    sample (decoded from the scan's first disagreement where the scan flags it by a mismatch,
    from the prompt where by a near-tie or where the item is a reproduction check; else the
    scan's result stands, or, for a near-tie, the trace is only scanned); `baseline`: set by
    `replay_traces`."""

    trace: LoggedTrace
    b: RunTarget
    model_dir: Path
    a: RunTarget | None = None
    control: bool = False
    extractor: str | Extractor | None = None
    baseline: Baseline = "logged"
    #: The logged configuration's scan along the logged tokens, where it already ran (the
    #: trace's reproduction check): arm A's teacher-forced probe, and its scan when judged
    #: pairwise in a scan run.
    a_scan: ScanRun | None = None
    decode_flagged: bool = True

    @property
    def against_logged(self) -> bool:
        return self.a is None

    @property
    def is_check(self) -> bool:
        """The trace's reproduction check: its logged configuration replayed here, against its
        logged tokens."""
        return self.a is None and self.b.is_self


@dataclass(frozen=True)
class ReplayOptions:
    """How a run replays (the same for all its items)."""

    mode: Mode = "decode"
    top_k: int = 5
    #: scan then decode: the near-tie flag in ulps (negative: off).
    flag_ulps: float = SCAN_FLAG_OFF
    token_budget: int = DEFAULT_SCAN_TOKEN_BUDGET
    #: Refuse a checkpoint whose weights are not the trace's (a caller that checked them all
    #: once, as the CLI does, turns it off).
    check_weights: bool = True
    #: The GPU kind the worker running the items announced (`queue.route.WorkerKind`),
    #: recorded with every resolved arm; None: not a worker (the offline CLI).
    worker_kind: str | None = None
    #: Decodes compared with the logged tokens stop this many tokens after t* (docs/replays.md
    #: "The decode window"; `engine.DecodeWindow`); None: to eos or the budget.
    decode_window: int | None = None
    single_step: SingleStepKind = "teacher_forced"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise BadRequest(f"mode must be one of {MODES}, got {self.mode!r}", field="mode")
        if self.single_step not in SINGLE_STEP_KINDS:
            raise BadRequest(f"single_step must be one of {SINGLE_STEP_KINDS}", field="single_step")
        if self.decode_window is not None and self.decode_window < 0:
            raise BadRequest("decode_window must be 0 or more", field="decode_window")

    @property
    def arm_facts(self) -> tuple[str | None, SingleStepKind]:
        """What `resolve_arm` records of the run in every arm it resolves: the worker's GPU kind
        and the single-step probe kind."""
        return self.worker_kind, self.single_step

    def window(self, logged: Sequence[int]) -> DecodeWindow | None:
        """The decode window of a decode compared with `logged` (None: decode to the end)."""
        n = self.decode_window
        return DecodeWindow(tuple(logged), n) if n is not None else None


@dataclass(frozen=True)
class Arm:
    """A resolved arm and its engine. Every caller probes through these methods, so every probe
    runs the arm's whole computation: intervention, logits processors, logged batch layout."""

    engine: Engine
    resolved: ResolvedArm

    @property
    def intervention(self) -> Intervention:
        return self.resolved.intervention

    @property
    def processors(self) -> LogitsProcessors | None:
        return self.resolved.logits_processors

    @property
    def layout(self) -> BatchLayout | None:
        """The logged batch the row replays in (None: alone, or among copies of it)."""
        return self.resolved.batch_layout

    def decode(
        self,
        prompt: Sequence[int],
        budget: int,
        eos: Sequence[int],
        top_k: int,
        *,
        forced_prefix: Sequence[int] = (),
        window: DecodeWindow | None = None,
    ) -> DecodeRun:
        return self.engine.decode(
            prompt,
            budget,
            eos,
            self.intervention,
            top_k,
            forced_prefix=forced_prefix,
            processors=self.processors,
            window=window,
            layout=self.layout,
        )

    def request(
        self,
        prompt: Sequence[int],
        budget: int,
        eos: Sequence[int],
        *,
        forced_prefix: Sequence[int] = (),
        window: DecodeWindow | None = None,
    ) -> _Ask:
        """A decode of this arm, asked of `replay_items`' driver (which runs it with others of
        the arm's logged batch): its run comes back where `_run_arms` yields it."""
        return _Ask(self, DecodeRequest(prompt, budget, eos, forced_prefix, window, self.layout))

    def decode_batch(self, requests: Sequence[DecodeRequest], top_k: int) -> list[DecodeRun]:
        return self.engine.decode_batch(
            requests, self.intervention, top_k, processors=self.processors
        )

    def scan(self, prompt: Sequence[int], output: Sequence[int], top_k: int) -> ScanRun:
        return self.engine.scan(
            prompt, output, self.intervention, top_k, processors=self.processors
        )

    def scan_batch(self, items: Sequence[ScanItem], top_k: int, token_budget: int) -> list[ScanRun]:
        return self.engine.scan_batch(items, self.intervention, top_k, token_budget=token_budget)

    def step(
        self, prompt: Sequence[int], prefix: Sequence[int], top_k: int, layout: BatchLayout | None
    ) -> StepInfo:
        """`layout` is the re-run trace's own (one arm re-runs several traces: `_rerun_all`)."""
        return self.engine.step(
            prompt, prefix, self.intervention, top_k, processors=self.processors, layout=layout
        )

    def step_batch(
        self,
        contexts: Sequence[Sequence[int]],
        prompt_lengths: Sequence[int],
        layouts: Sequence[BatchLayout | None],
        top_k: int,
        token_budget: int,
    ) -> list[StepInfo]:
        return self.engine.step_batch(
            contexts,
            self.intervention,
            top_k,
            token_budget=token_budget,
            processors=self.processors,
            prompt_lengths=prompt_lengths,
            layouts=layouts,
        )


def load_arm(
    target: Target,
    pool: EnginePool,
    model_dir: Path,
    *,
    tp_degree: int = 1,
    kernel_source: KernelSource = "requested",
    worker_kind: str | None = None,
    logged: LoggedTrace | None = None,
    single_step: SingleStepKind = "from_scratch",
) -> Arm:
    """The one place an engine is configured: `target` loaded through `pool`, resolved from the
    environment it records (against `logged`, where the arm replays one). `UnsupportedFormat`/
    `EngineError` where it cannot run here."""
    engine = pool.get(model_dir, target, tp_degree)
    resolved = ResolvedArm.from_environment(
        engine.environment(),
        target.intervention,
        kernel_source,
        worker_kind=worker_kind,
        logged=logged,
        layout=logged.layout_for(target.batch_size) if logged is not None else None,
        single_step=single_step,
    )
    return Arm(engine, resolved)


def resolve_arm(
    trace: LoggedTrace,
    run_target: RunTarget,
    pool: EnginePool,
    model_dir: Path,
    worker_kind: str | None = None,
    single_step: SingleStepKind = "from_scratch",
) -> Arm:
    """`run_target` resolved against `trace`: no kernel named runs the logged one, or the
    engine's default where that cannot run here (an imported `unknown`, flash on a CPU).
    `ModelMismatch` when the vocabularies differ; `UnsupportedFormat`/`EngineError` when the
    target cannot run here, its TP degree included (a trace logged at TP 2 replays at TP 1
    only when the target asks for TP 1)."""
    tp = run_target.tp_degree_for(trace)
    asked = "asks" if run_target.tp_degree is not None else "was logged at"

    def other_degree(ran: int) -> str:
        """What a request can do about it (not a reproduction check: it is the logged one)."""
        if run_target.label == ENGINE_CHECK_LABEL:
            return "the reproduction check runs the logged degree only"
        return f"a target's tp_degree: {ran} replays it at TP {ran} (the result says so)"

    if tp > pool.devices:
        raise UnsupportedFormat(
            f"the arm {asked} TP {tp}; this worker owns {counted(pool.devices, 'device')}: "
            + other_degree(pool.devices),
            field="tp_degree",
        )
    requested = run_target.resolve(trace.config)
    source: KernelSource = "requested" if requested.attn_kernel is not None else "logged"
    want = replace(requested, attn_kernel=requested.attn_kernel or trace.config.attn_kernel)

    def load(target: Target, kernel_source: KernelSource) -> Arm:
        return load_arm(
            target,
            pool,
            model_dir,
            tp_degree=tp,
            kernel_source=kernel_source,
            worker_kind=worker_kind,
            logged=trace,
            single_step=single_step,
        )

    try:
        arm = load(want, source)
    except EngineError:
        if source == "requested" or want.attn_kernel is None:
            raise
        arm = load(replace(want, attn_kernel=None), "engine_default")
    if arm.engine.vocab_size != trace.vocab_size:
        raise ModelMismatch(
            f"checkpoint vocabulary is {arm.engine.vocab_size}, the trace's {trace.vocab_size}",
            field="model.vocab_size",
        )
    too_long = context_overflow(trace, arm.engine.max_positions)
    if too_long is not None:
        raise UnsupportedFormat(too_long, field="prompt_token_ids")
    if arm.resolved.tp_degree != tp:
        ran = arm.resolved.tp_degree
        raise UnsupportedFormat(
            f"the arm {asked} TP {tp}; this engine replays at TP {ran}: " + other_degree(ran),
            field="tp_degree",
        )
    return arm


def context_overflow(trace: LoggedTrace, max_positions: int | None) -> str | None:
    """Why `trace` is longer than the checkpoint's context (past it, positions replay
    extrapolated, not as logged); None where it fits."""
    n = trace.prompt_token_ids.size + trace.output_token_ids.size
    if max_positions is None or n <= max_positions:
        return None
    return (
        f"the prompt and the output are {n} tokens; the checkpoint's context is {max_positions}"
        " (max_position_embeddings): this trace was not logged with it"
    )


def check_replayable(trace: LoggedTrace) -> None:
    """Refuse, before any model loads, a trace no target can replay: only greedy ones replay
    (a request with an unsupported processor is stored as `other`, not greedy)."""
    if not trace.greedy:
        raise BadRequest(
            f"only greedy traces can be replayed; this one is {trace.strategy!r}",
            field="decoding.strategy",
        )


def _check(item: ReplayItem, pool: EnginePool, check_weights: bool) -> None:
    check_replayable(item.trace)
    if check_weights:
        sha = pool.weights_sha256(item.model_dir)
        if sha != item.trace.weights_sha256:
            raise ModelMismatch(
                f"checkpoint {item.model_dir} has weights_sha256 {sha}, but the trace "
                f"{item.trace.external_id or ''} was logged with {item.trace.weights_sha256}",
                field="model.weights_sha256",
            )


# -- scans --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scans:
    """Each item's batched scan in order (None: its replay scans it alone), and what it cost."""

    runs: list[ScanRun | None]
    scanned: int = 0
    forwards: int = 0
    seconds: float = 0.0


def scan_items(items: Sequence[ReplayItem], pool: EnginePool, options: ReplayOptions) -> Scans:
    """The scans `replay_items` would run, one `Engine.scan_batch` per engine and intervention
    of arm B."""
    runs: list[ScanRun | None] = [None] * len(items)
    if options.mode == "decode":
        return Scans(runs)
    groups: dict[tuple[int, Intervention], tuple[Arm, list[int]]] = {}
    for i, item in enumerate(items):
        if not item.against_logged or not item.trace.greedy:
            continue
        try:
            arm = resolve_arm(item.trace, item.b, pool, item.model_dir, *options.arm_facts)
        except ENGINE_FAILURES:
            continue  # the item's replay reports it
        groups.setdefault((id(arm.engine), arm.intervention), (arm, []))[1].append(i)
    scanned = forwards = 0
    seconds = 0.0
    for arm, members in groups.values():
        traces = [items[i].trace for i in members]
        batch_items = [
            ScanItem(t.prompt_token_ids.tolist(), t.output_token_ids.tolist(), t.processors)
            for t in traces
        ]
        t0 = time.perf_counter()
        try:
            batch = arm.scan_batch(batch_items, options.top_k, options.token_budget)
        except ENGINE_FAILURES:
            log.exception(
                "batched scan of %d traces failed; scanning them one by one", len(members)
            )
            continue
        seconds += time.perf_counter() - t0
        scanned += len(members)
        forwards += len(plan_scan(batch_items, options.token_budget))
        for i, run in zip(members, batch, strict=True):
            runs[i] = run
    return Scans(runs, scanned, forwards, seconds)


# -- replays ------------------------------------------------------------------------------------

#: What `replay_items` gives for an item: its outcome, or the error its replay raised.
ReplayResult = ReplayOutcome | Exception

#: An engine's `environment()["extras"]` that describe its last batched scan or batched
#: single-step re-runs (`engine/batch.py`): true of a result only where its trace took part.
SCAN_BATCH_EXTRAS: Final = ("scan_token_budget", "scan_batch_shapes", "scan_padding")
STEP_BATCH_EXTRAS: Final = ("step_token_budget", "step_batch_shapes", "step_padding")


@dataclass
class _ArmRun:
    """An arm of an item as it ran: its tokens and steps (None for the logged tokens)."""

    arm: Arm | None
    ids: list[int]
    steps: Steps | None
    #: Where its margins come from: its own decode or scan (batched: `scan_batched`).
    source: MarginSource = "decode"
    scan_batched: bool = False
    #: Its decode stopped at the run's decode window (its output is a prefix).
    window_cut: bool = False
    #: How many rows of its logged batch its decode shared a run with (`DecodeRun.rows`).
    decode_rows: int = 1


@dataclass(eq=False)
class _Replayed:
    """An item's arms run, before its single-step re-runs at t*."""

    item: ReplayItem
    mode: Mode
    a: _ArmRun
    b: _ArmRun
    t_star: int | None
    screen: Screen | None = None
    #: Arm A's engine for its re-run against the logged tokens (None: cannot run here).
    logged_arm: Arm | None = None
    batched: set[str] = field(default_factory=set)

    def rerun_arm(self, side: str) -> Arm | None:
        if side == "b":
            return self.b.arm
        return self.a.arm if self.a.arm is not None else self.logged_arm


def replay_items(
    items: Sequence[ReplayItem],
    pool: EnginePool,
    options: ReplayOptions,
    *,
    scans: Sequence[ScanRun | None] | None = None,
) -> list[ReplayResult]:
    """Each item replayed, in order (see the module's diagram). `scans`: from `scan_items`, None
    to scan each here. The items' decodes run together where they replay rows of one logged
    batch (`_decode_all`). An item whose replay fails (`ENGINE_FAILURES`) gets its exception in
    its place."""
    ran = _replay_some(items, pool, options, scans, decode=True, decodes=_Decodes())
    return [r for r in ran if r is not None]


def _replay_some(
    items: Sequence[ReplayItem],
    pool: EnginePool,
    options: ReplayOptions,
    scans: Sequence[ScanRun | None] | None,
    *,
    decode: bool,
    decodes: _Decodes,
) -> list[ReplayResult | None]:
    """`replay_items`; without `decode`, an item that needs a decode is None in its place.
    `decodes`: the window's decodes so far, which an identical ask reuses."""
    runs: dict[int, _Replayed | ReplayResult | None] = {}
    asked: dict[int, _Ask] = {}
    arms: dict[int, Generator[_Ask, DecodeRun, _Replayed | ReplayOutcome]] = {}

    def advance(i: int, run: DecodeRun | None) -> None:
        try:
            asked[i] = arms[i].send(run)  # type: ignore[arg-type]  # None starts it
        except StopIteration as stop:
            runs[i] = stop.value
        except ENGINE_FAILURES as e:
            runs[i] = e

    for i, item in enumerate(items):
        arms[i] = _run_arms(item, pool, options, scans[i] if scans is not None else None)
        advance(i, None)
    while asked:
        now = dict(asked)
        asked.clear()
        if not decode:
            for i in now:
                arms[i].close()
                runs[i] = None
            break
        for i, got in _decode_all(now, options.top_k, decodes).items():
            if isinstance(got, DecodeRun):
                advance(i, got)
            else:
                arms[i].close()
                runs[i] = got
    ordered = [runs[i] for i in range(len(items))]
    reruns = _rerun_all([r for r in ordered if isinstance(r, _Replayed)], options)
    out: list[ReplayResult | None] = []
    for r in ordered:
        if not isinstance(r, _Replayed):
            out.append(r)
            continue
        try:
            out.append(_outcome(r, reruns.get(id(r), {})))
        except ENGINE_FAILURES as e:
            out.append(e)
    return out


@dataclass(frozen=True)
class _Ask:
    """A decode an item's arms need (`_run_arms` yields it and gets its run back)."""

    arm: Arm
    request: DecodeRequest


class _Decodes:
    """The decodes a window ran, so that an ask identical to one already run (the same arm's
    computation, `_key`, and the same request: prompt, budget, eos, forced prefix, window,
    logged batch layout) takes that run instead of computing it again: a pair's arm A from the
    prompt is its trace's reproduction check's decode, and two pairwise comparisons share a
    target's decode."""

    def __init__(self) -> None:
        self._runs: dict[tuple[_Key, tuple[int, ...]], list[tuple[DecodeRequest, DecodeRun]]] = {}

    @staticmethod
    def key(ask: _Ask) -> tuple[_Key, tuple[int, ...]]:
        return _key(ask.arm), tuple(ask.request.prompt_ids)

    def get(self, ask: _Ask) -> DecodeRun | None:
        runs = self._runs.get(self.key(ask), ())
        return next((run for request, run in runs if request == ask.request), None)

    def put(self, ask: _Ask, run: DecodeRun) -> None:
        self._runs.setdefault(self.key(ask), []).append((ask.request, run))


def _decode_all(
    asked: Mapping[int, _Ask], top_k: int, decodes: _Decodes
) -> dict[int, DecodeRun | Exception]:
    """The decodes asked for, each arm's through one `Engine.decode_batch` (which runs the rows
    of one logged batch together); where a batch fails, its decodes run one by one, so only the
    failing item fails. An ask identical to one run before (`decodes`) or to another of these
    takes its run."""
    out: dict[int, DecodeRun | Exception] = {}
    todo: dict[int, _Ask] = {}
    firsts: dict[tuple[_Key, tuple[int, ...]], list[int]] = {}  # `todo`'s, by `_Decodes.key`
    twin: dict[int, int] = {}  # an ask identical to one in `todo`: that one's index
    for i, ask in asked.items():
        if (run := decodes.get(ask)) is not None:
            out[i] = run
            continue
        alike = firsts.setdefault(_Decodes.key(ask), [])
        j = next((j for j in alike if todo[j].request == ask.request), None)
        if j is None:
            alike.append(i)
            todo[i] = ask
        else:
            twin[i] = j
    groups: dict[_Key, tuple[Arm, list[int]]] = {}  # one arm's computation
    for i, ask in todo.items():
        groups.setdefault(_key(ask.arm), (ask.arm, []))[1].append(i)
    for arm, members in groups.values():
        requests = [todo[i].request for i in members]
        try:
            out.update(zip(members, arm.decode_batch(requests, top_k), strict=True))
        except ENGINE_FAILURES as e:
            if len(members) == 1:
                out[members[0]] = e
                continue
            for i in members:
                try:
                    (out[i],) = arm.decode_batch([todo[i].request], top_k)
                except ENGINE_FAILURES as one:
                    out[i] = one
    for i, ask in todo.items():
        if isinstance(got := out[i], DecodeRun):
            decodes.put(ask, got)
    out.update((i, out[j]) for i, j in twin.items())
    return out


#: The label of arm A where a comparison with the logged tokens is judged against the logged
#: configuration replayed here (`replay_traces`).
BASELINE_LABEL: Final = "logged configuration, replayed here"


def replay_traces(
    items: Sequence[ReplayItem],
    pool: EnginePool,
    options: ReplayOptions,
    *,
    scans: Sequence[ScanRun | None] | None = None,
) -> list[ReplayResult]:
    """`replay_items`, reproducing before comparing (docs/replays.md "Reproduce before
    compare"): a trace with a reproduction check (`ReplayItem.is_check`) has its other
    comparisons with the logged tokens judged pairwise against its logged configuration
    replayed here where it was logged by another engine (baseline "replayed") or where the
    check diverged (baseline "reproduced"), so no flip is counted against logged tokens this
    stack does not give. Results come back in the order of `items`."""
    out = _replay_traces(items, pool, options, scans, decode=True)
    return [r for r in out if r is not None]


def settled_traces(
    items: Sequence[ReplayItem],
    pool: EnginePool,
    options: ReplayOptions,
    *,
    scans: Sequence[ScanRun | None],
) -> list[ReplayResult | None]:
    """`replay_traces` of what needs no decode (scan-then-decode's scans settle most traces):
    each item's result as `replay_traces` gives it, or None where the item, or the reproduction
    check its trace's comparisons wait for, needs a decode. A worker writes these first, so a
    large window shows its progress before its decodes (docs/replays.md "Batched scans")."""
    return _replay_traces(items, pool, options, scans, decode=False)


def _replay_traces(
    items: Sequence[ReplayItem],
    pool: EnginePool,
    options: ReplayOptions,
    scans: Sequence[ScanRun | None] | None,
    *,
    decode: bool,
) -> list[ReplayResult | None]:
    """`replay_traces`, or `settled_traces` without `decode`."""
    checked = {id(it.trace) for it in items if it.is_check}
    # The checks' scans: the logged configuration's teacher-forced forward along the logged
    # tokens, which the comparisons of the same trace reuse as arm A's.
    check_scans = {
        id(it.trace): scan
        for it, scan in zip(items, scans or [None] * len(items), strict=True)
        if it.is_check and scan is not None
    }

    def pending(it: ReplayItem) -> bool:
        return it.against_logged and not it.is_check and id(it.trace) in checked

    def pairwise(it: ReplayItem, baseline: Baseline) -> ReplayItem:
        return replace(it, a=RunTarget(None, label=BASELINE_LABEL), baseline=baseline)

    items = [
        replace(it, a_scan=check_scans.get(id(it.trace))) if pending(it) else it for it in items
    ]
    first = [
        pairwise(it, "replayed") if pending(it) and it.trace.logged_by_another_engine else it
        for it in items
    ]
    later = [
        i for i, it in enumerate(first) if pending(it) and not it.trace.logged_by_another_engine
    ]
    now = [i for i in range(len(items)) if i not in set(later)]
    out: list[ReplayResult | None] = [None] * len(items)
    decodes = _Decodes()  # a check's decode from the prompt is its pair's arm A
    ran = _replay_some(
        [first[i] for i in now],
        pool,
        options,
        None if scans is None else [scans[i] for i in now],
        decode=decode,
        decodes=decodes,
    )
    diverged: set[int] = set()  # the traces whose check did not reproduce them
    waiting: set[int] = set()  # the traces whose check needs a decode (not `decode`)
    for i, result in zip(now, ran, strict=True):
        out[i] = result
        if items[i].is_check and result is None:
            waiting.add(id(items[i].trace))
        if items[i].is_check and isinstance(result, ReplayOutcome) and result.exact_match is False:
            diverged.add(id(items[i].trace))
    later = [i for i in later if id(items[i].trace) not in waiting]
    second = [
        pairwise(items[i], "reproduced") if id(items[i].trace) in diverged else items[i]
        for i in later
    ]
    kept = [None if scans is None else scans[i] for i in later]
    ran = _replay_some(second, pool, options, kept, decode=decode, decodes=decodes)
    for i, result in zip(later, ran, strict=True):
        out[i] = result
    return out


def _run_arms(
    item: ReplayItem, pool: EnginePool, options: ReplayOptions, scan: ScanRun | None
) -> Generator[_Ask, DecodeRun, _Replayed | ReplayOutcome]:
    """Both arms of an item run, and t*; a trace only scanned is finished here. Each decode is
    yielded (`Arm.request`) and its run sent back, so `replay_items` runs the items' decodes
    together where they share a logged batch."""
    _check(item, pool, options.check_weights)
    trace, top_k = item.trace, options.top_k
    prompt = trace.prompt_token_ids.tolist()
    budget, eos = trace.budget()
    b = resolve_arm(trace, item.b, pool, item.model_dir, *options.arm_facts)
    logged = trace.output_token_ids.tolist()
    if item.a is not None:
        a = resolve_arm(trace, item.a, pool, item.model_dir, *options.arm_facts)
        why: Screen | None = None
        if options.mode != "decode" and item.baseline != "logged":
            pair = _scanned_pair(item, a, b, scan, top_k)
            if options.mode == "scan":
                return pair
            why = _pair_screen(pair, options.flag_ulps)
            if why == "control" and not item.control:
                return _scanned_pair_only(pair, "scanned")
            if why != "control" and not item.decode_flagged:
                return _scanned_pair_only(pair, _NOT_IN_SAMPLE[why])
        # The both-arms protocol: both decoded from the prompt (in scan-then-decode, a pair in
        # the run's flagged or control sample: docs/replays.md "Reproduce before compare").
        # With the run's window, A stops that many tokens after leaving the logged tokens and
        # B that many after leaving A's (docs/replays.md "The decode window").
        ra = yield a.request(prompt, budget, eos, window=options.window(logged))
        rb = yield b.request(prompt, budget, eos, window=options.window(ra.output_token_ids))
        if ra.stop_reason == "window" and _extends(rb.output_token_ids, ra.output_token_ids):
            # Both left the logged tokens at one step with one token and still agree where A's
            # window ended: where they part needs A's continuation.
            ra = yield a.request(prompt, budget, eos)
            rb = yield b.request(prompt, budget, eos, window=options.window(ra.output_token_ids))
        run_a, run_b = _decoded(a, ra), _decoded(b, rb)
        t_star = first_divergence(run_a.ids, run_b.ids)
        return _Replayed(item, "decode" if why is None else options.mode, run_a, run_b, t_star, why)

    run_a = _ArmRun(None, logged, None)
    mode = options.mode
    screen: Screen | None = None
    window = options.window(logged)
    if mode == "decode":
        run_b = _decoded(b, (yield b.request(prompt, budget, eos, window=window)))
    else:
        batched = scan is not None
        if scan is None:
            scan = b.scan(prompt, logged, top_k)
        s = scan.first_disagreement
        if s is None and mode == "scan_then_decode":
            near = _near_tie(trace, scan.steps, options.flag_ulps)
            if near is None and not item.control:
                return _scanned_only(item, b, scan.steps, batched)
            if near is not None and not item.decode_flagged:
                # Flagged by a near-tie, outside the flagged sample (docs/replays.md "The
                # flagged sample"): only scanned; the near-tie sample's rate stands for it.
                return _scanned_only(item, b, scan.steps, batched, "near_tie_scanned")
            # A near-tie's flip may need the decode's own KV cache from the prompt on.
            run_b = _decoded(b, (yield b.request(prompt, budget, eos, window=window)))
            screen = "near_tie" if near is not None else "control"
        elif s is None:
            run_b = _ArmRun(b, logged, scan.steps, "scan", batched)
        elif mode == "scan" or not item.decode_flagged:
            # A scan's result; in scan-then-decode, a flagged trace outside the flagged
            # sample (docs/replays.md "The flagged sample"): t* = s, established by the scan.
            ids = [*logged[:s], int(scan.steps.token_ids[s])]
            run_b = _ArmRun(b, ids, scan.steps.slice(0, s + 1), "scan", batched)
            screen = None if mode == "scan" else "flagged_scanned"
        elif item.is_check:
            # The reproduction check decodes from the prompt: whether the logged tokens
            # reproduce is a question about the logged computation, which a prefill of
            # logged[:s] is not. So a window's check decodes share one run of their logged
            # batch, and a pair's arm A is this decode (docs/replays.md "Reproduce before
            # compare").
            run_b = _decoded(b, (yield b.request(prompt, budget, eos, window=window)))
            screen = "flagged"
        else:
            rb = yield b.request(prompt, budget, eos, forced_prefix=logged[:s], window=window)
            steps = Steps.concat([scan.steps.slice(0, s), rb.steps])
            cut = rb.stop_reason == "window"
            run_b = _ArmRun(b, rb.output_token_ids, steps, "decode", batched, cut, rb.rows)
            screen = "flagged"
    t_star = first_divergence(logged, run_b.ids)
    replayed = _Replayed(item, mode, run_a, run_b, t_star, screen)
    if t_star is not None:
        # The logged configuration run here (arm A's single-step re-run and reconstructed
        # margin against the logged tokens); None where it cannot run here.
        with contextlib.suppress(*ENGINE_FAILURES):
            replayed.logged_arm = resolve_arm(
                trace, RunTarget(None), pool, item.model_dir, *options.arm_facts
            )
    return replayed


def _scanned_pair(
    item: ReplayItem, a: Arm, b: Arm, scan_b: ScanRun | None, top_k: int
) -> _Replayed:
    """A scan run's comparison with the logged configuration replayed here (`baseline` not
    "logged"): both arms' scans along the logged tokens, t* the first step whose choices
    differ (docs/replays.md "Reproduce before compare"). No decode: as every scan, it cannot
    see a flip that needs the decode's own KV cache or its own path."""
    trace = item.trace
    prompt, logged = trace.prompt_token_ids.tolist(), trace.output_token_ids.tolist()
    sa, sb = (s or arm.scan(prompt, logged, top_k) for arm, s in ((a, item.a_scan), (b, scan_b)))
    differ = np.flatnonzero(sa.steps.token_ids != sb.steps.token_ids)
    t = int(differ[0]) if differ.size else None

    def run(arm: Arm, scan: ScanRun, given: ScanRun | None) -> _ArmRun:
        if t is None:
            return _ArmRun(arm, logged, scan.steps, "scan", given is not None)
        ids = [*logged[:t], int(scan.steps.token_ids[t])]
        return _ArmRun(arm, ids, scan.steps.slice(0, t + 1), "scan", given is not None)

    return _Replayed(item, "scan", run(a, sa, item.a_scan), run(b, sb, scan_b), t)


#: A flagged pair's screen where its trace is outside the flagged sample.
_NOT_IN_SAMPLE: Final[dict[Screen, Screen]] = {
    "flagged": "flagged_scanned",
    "near_tie": "near_tie_scanned",
}


def _pair_screen(pair: _Replayed, flag_ulps: float) -> Screen:
    """Why a scan-then-decode pair (`_scanned_pair`: both arms' scans along the logged tokens)
    would be decoded, as a trace against its logged tokens would be: `flagged` where the scans
    choose differently, `near_tie` where either arm's scan (or the logged margins) comes within
    the near-tie flag, else `control` (decoded only in the control sample)."""
    if pair.t_star is not None:
        return "flagged"
    trace = pair.item.trace
    for run in (pair.a, pair.b):
        if run.steps is not None and _near_tie(trace, run.steps, flag_ulps) is not None:
            return "near_tie"
    return "control"


def _scanned_pair_only(pair: _Replayed, screen: Screen) -> _Replayed | ReplayOutcome:
    """A scan-then-decode pair not decoded: where the scans differ (`flagged_scanned`), their
    result (t* the first step whose choices differ, as a scan run's); where they agree
    (`scanned`, `near_tie_scanned`), unknown, as `_scanned_only`'s."""
    r = replace(pair, mode="scan_then_decode", screen=screen)
    if screen == "flagged_scanned":
        return r
    arm_a = replace(_arm_outcome(r, "a", None, None), output_token_ids=None)
    return _unknown(r, arm_a)


def _extends(out: Sequence[int], prefix: Sequence[int]) -> bool:
    """Whether `out` starts with all of `prefix`."""
    return len(out) >= len(prefix) and list(out[: len(prefix)]) == list(prefix)


def _decoded(arm: Arm, run: DecodeRun) -> _ArmRun:
    """An arm as a decode from the prompt ran it."""
    cut = run.stop_reason == "window"
    return _ArmRun(arm, run.output_token_ids, run.steps, window_cut=cut, decode_rows=run.rows)


#: The re-runs of one item at t*, by side ("a", "b").
_Reruns = dict[str, StepInfo]


_Key = tuple[int, Intervention, LogitsProcessors | None]


def _key(arm: Arm) -> _Key:
    return id(arm.engine), arm.intervention, arm.processors


def _rerun_all(replayed: Sequence[_Replayed], options: ReplayOptions) -> dict[int, _Reruns]:
    """Every divergent item's single-step probes at t* given prompt ‖ arm A's tokens before t*,
    in arm B and in arm A (against the logged tokens: the logged format, which also gives arm
    A's reconstructed margin), batched per (engine, intervention, processors)."""
    if options.single_step == "teacher_forced":
        return _teacher_forced_all(replayed, options)
    groups: dict[_Key, tuple[Arm, list[tuple[_Replayed, str, list[int]]]]] = {}
    for r in replayed:
        if r.t_star is None:
            continue
        context = [*r.item.trace.prompt_token_ids.tolist(), *r.a.ids[: r.t_star]]
        for side in ("a", "b"):
            arm = r.rerun_arm(side)
            if arm is not None:
                groups.setdefault(_key(arm), (arm, []))[1].append((r, side, context))
    out: dict[int, _Reruns] = {}
    for arm, members in groups.values():
        contexts = [c for _, _, c in members]
        prompts = [len(r.item.trace.prompt_token_ids) for r, _, _ in members]
        layouts = [r.rerun_arm(side).layout for r, side, _ in members]  # type: ignore[union-attr]
        infos: list[StepInfo | None]
        try:
            infos = list(
                arm.step_batch(contexts, prompts, layouts, options.top_k, options.token_budget)
            )
            for r, side, _ in members:
                r.batched.add(side)
        except ENGINE_FAILURES:
            log.exception("batched re-runs of %d steps failed; one at a time", len(contexts))
            infos = [
                _step_or_none(arm, c, n, options.top_k, layout)
                for c, n, layout in zip(contexts, prompts, layouts, strict=True)
            ]
        for (r, side, _), info in zip(members, infos, strict=True):
            if info is not None:
                out.setdefault(id(r), {})[side] = info
    return out


def _teacher_forced_all(
    replayed: Sequence[_Replayed], options: ReplayOptions
) -> dict[int, _Reruns]:
    """Row t* of each arm's teacher-forced forward over prompt ‖ arm A's tokens: the scan
    that already ran where there is one (`_scanned_steps`), else one `scan_batch` per
    (engine, intervention, processors) over the rest, each up to t*."""
    out: dict[int, _Reruns] = {}
    groups: dict[_Key, tuple[Arm, list[tuple[_Replayed, str, ScanItem]]]] = {}
    for r in replayed:
        t = r.t_star
        if t is None:
            continue
        for side in ("a", "b"):
            arm = r.rerun_arm(side)
            if arm is None:
                continue
            steps = _scanned_steps(r, side, arm)
            if steps is not None and t < len(steps):
                out.setdefault(id(r), {})[side] = StepInfo.from_steps(steps.slice(t, t + 1))
                continue
            # Up to t* only: row t* is all the probe reads, and a flip's t* is most often
            # early in the trace. (The rows after it do not enter row t*; the forward's shorter
            # shape can round it otherwise, as another packing of the batch can.)
            path = r.a.ids[: t + 1] if t < len(r.a.ids) else [*r.a.ids, r.b.ids[t]]
            item = ScanItem(r.item.trace.prompt_token_ids.tolist(), path, arm.processors)
            groups.setdefault(_key(arm), (arm, []))[1].append((r, side, item))
    for arm, members in groups.values():
        items = [item for _, _, item in members]
        try:
            runs = arm.scan_batch(items, options.top_k, options.token_budget)
        except ENGINE_FAILURES:
            log.exception("batched probes of %d traces failed", len(items))
            continue
        for (r, side, _), run in zip(members, runs, strict=True):
            t = r.t_star or 0
            out.setdefault(id(r), {})[side] = StepInfo.from_steps(run.steps.slice(t, t + 1))
            r.batched.add(f"scan:{side}")
    return out


def _scanned_steps(r: _Replayed, side: str, arm: Arm) -> Steps | None:
    """The steps of `arm`'s scan along prompt ‖ arm A's tokens where one already ran: its own
    scan, the trace's reproduction check's (`ReplayItem.a_scan`), or arm B's when arm B is
    the logged configuration itself."""
    run = r.a if side == "a" else r.b
    if run.arm is arm and run.source == "scan":
        return run.steps
    if side == "a" and run.arm is None:
        if r.item.a_scan is not None:
            return r.item.a_scan.steps
        if r.b.arm is not None and r.b.source == "scan" and _key(r.b.arm) == _key(arm):
            return r.b.steps
    return None


def _step_or_none(
    arm: Arm, context: list[int], prompt: int, top_k: int, layout: BatchLayout | None
) -> StepInfo | None:
    try:
        return arm.step(context[:prompt], context[prompt:], top_k, layout)
    except ENGINE_FAILURES:
        log.exception("single-step re-run failed")
        return None


def _outcome(r: _Replayed, reruns: _Reruns) -> ReplayOutcome:
    """The one outcome rule over an item's arms and its re-runs at t*."""
    trace, t_star = r.item.trace, r.t_star
    a_ids, b_ids = r.a.ids, r.b.ids
    margin_a = margin_b = None
    single: SingleStep | None = None
    verdict = None
    if t_star is not None:
        if "b" not in reruns:
            raise RuntimeError("the single-step re-run at t* failed")
        mb = _margin_at(r.b.steps, t_star)
        ma, source_a = _margin_a(r, t_star, mb, reruns.get("a"))
        margin_a, margin_b = _arm_margin(ma, source_a), _arm_margin(mb, r.b.source)
        single = _single_step(r, t_star, reruns)
        verdict = judge(
            ma,
            mb,
            format_a=_head_format(r, "a"),
            format_b=_head_format(r, "b"),
            gate=_gate(r),
            rerun_a=single.a.token if single.a is not None else None,
            rerun_b=single.b.token,
        )
    # A scan (a flagged trace not decoded too), or a decode cut at its window, has no
    # continuation after t* to measure.
    scanned = r.mode == "scan" or r.screen == "flagged_scanned"
    cut = r.a.window_cut or r.b.window_cut
    decoded_fully = (not scanned or t_star is None) and not cut
    arm_b = _arm_outcome(r, "b", margin_b, verdict.gate_fired_b if verdict else None)
    arm_a = _arm_outcome(r, "a", margin_a, verdict.gate_fired_a if verdict else None)
    return ReplayOutcome(
        mode=r.mode,
        exact_match=t_star is None,
        first_divergence_step=t_star,
        category="agreed" if verdict is None else verdict.category,
        tie=verdict is not None and verdict.tie,
        cascade_length=cascade_length(a_ids, b_ids) if decoded_fully else None,
        length_difference=length_difference(a_ids, b_ids) if decoded_fully else None,
        a=arm_a,
        b=arm_b,
        single_step=single,
        semantic=_semantic(r, arm_a, arm_b) if decoded_fully else None,
        external_id=trace.external_id,
        screen=r.screen,
        window_cut=cut,
        baseline=r.item.baseline,
    )


def _gate(r: _Replayed) -> GateRule:
    """The comparison's gate: arm B's intervention's (the treatment's; with none, the gate that
    would fire)."""
    return r.b.arm.intervention.gate if r.b.arm is not None else GateRule()


def _head_format(r: _Replayed, side: str) -> str:
    arm = r.a.arm if side == "a" else r.b.arm
    return arm.resolved.lm_head_dtype if arm is not None else r.item.trace.config.head_dtype


def _margin_at(steps: Steps | None, t: int) -> Margin | None:
    return steps.margin_at(t) if steps is not None and t < len(steps) else None


def _margin_a(
    r: _Replayed, t_star: int, replayed: Margin | None, rerun: StepInfo | None
) -> tuple[Margin | None, MarginSource]:
    """Arm A's margin at t* (module docstring). Logged raw logprobs give the absolute margin;
    its ulps are measured at arm B's top-1 logit at t* (the same step over the same prefix)."""
    if r.a.steps is not None:
        return _margin_at(r.a.steps, t_star), r.a.source
    trace = r.item.trace
    if t_star >= len(r.a.ids):
        return None, "unavailable"
    logits = trace.top_k_logits
    # A logged top-k holds the logits before the generation's processors (raw logits or raw
    # logprobs), not what chose its token: with processors, the re-run's margin stands in.
    if logits is not None and logits.shape[1] >= 2 and trace.processors is None:
        row = [float(x) for x in logits[t_star, :2]]
        fmt = trace.config.head_dtype
        if trace.top_k_values == "raw_logprobs":
            top1 = replayed.top1 if replayed is not None else None
            return margin_from_logprobs(row, fmt, top1), "logged_top_k"
        return margin_from_top_k(row, fmt), "logged_top_k"
    if rerun is None:
        return None, "unavailable"
    return rerun.margin, "reconstructed"


def _single_step(r: _Replayed, t_star: int, reruns: _Reruns) -> SingleStep:
    """Both arms' probes at t* given prompt ‖ y<t*: does the flip reproduce?"""
    b = _choice(reruns["b"])
    a: SingleStepChoice | None = None
    if "a" in reruns:
        a = _choice(reruns["a"])
    elif t_star < len(r.a.ids) and r.a.arm is None:
        # The logged format cannot run here: its logged token stands in for its re-run.
        a = SingleStepChoice(r.a.ids[t_star], None, "logged_token")
    disagree = None if a is None else a.token != b.token
    kind = r.b.arm.resolved.single_step if r.b.arm is not None else "from_scratch"
    return SingleStep(t_star, a, b, disagree, kind)


def _choice(info: StepInfo) -> SingleStepChoice:
    return SingleStepChoice(info.token, _arm_margin(info.margin, "reconstructed"), "rerun")


def _arm_margin(m: Margin | None, source: MarginSource) -> ArmMargin:
    return ArmMargin.unavailable() if m is None else ArmMargin(m.abs, m.ulps, source)


def _arm_outcome(
    r: _Replayed, side: str, margin: ArmMargin | None, fired: bool | None
) -> ArmOutcome:
    """One arm's outcome: run here, or the logged tokens."""
    run = r.a if side == "a" else r.b
    trace = r.item.trace
    if run.arm is None or run.steps is None:  # the logged tokens
        return ArmOutcome(
            target=trace.config,
            output_token_ids=None,
            margin=margin,
            gate_fired_at_divergence=fired,
            environment=(
                _environment(r.logged_arm.engine, f"scan:{side}" in r.batched, side in r.batched)
                if r.logged_arm is not None
                else None
            ),
            text=trace.output_text,
            # The trace's own pieces are stored with it; else the tokenizer here reads the
            # logged tokens (the same checkpoint, so the same vocabulary).
            pieces=(
                r.b.arm.engine.token_pieces(run.ids)
                if trace.output_token_pieces is None and r.b.arm is not None
                else None
            ),
        )
    steps, engine = run.steps, run.arm.engine
    scanned = run.scan_batched or f"scan:{side}" in r.batched
    environment = _environment(engine, scanned, side in r.batched, run.decode_rows)
    n = len(steps)
    margins = tuple(float(f"{m:.6g}") if math.isfinite(m) else None for m in steps.margins.tolist())
    return ArmOutcome(
        target=run.arm.resolved.target,
        output_token_ids=tuple(int(x) for x in run.ids),
        margin=margin,
        resolved=run.arm.resolved.ran(environment),
        gate_fired_at_divergence=fired,
        gate_triggers=int(steps.gate_fired.sum()),
        steps=n,
        mean_gap=float(steps.margins.mean()) if n else None,
        changed_steps=int(steps.changed.sum()),
        margins=margins,
        gate_fired_steps=tuple(int(t) for t in np.flatnonzero(steps.gate_fired)),
        environment=environment,
        text=engine.detokenize(run.ids),
        pieces=engine.token_pieces(run.ids),
    )


def _environment(
    engine: Engine, scan_batched: bool, step_batched: bool, decode_rows: int = 1
) -> dict[str, object]:
    """`engine.environment()` as it held for one result: without the batch extras of a batched
    scan or of batched re-runs the result's trace was not part of (the engine keeps its last
    batch's, whatever it ran since); with `decode_rows` where its decode ran as one of that
    many rows of its logged batch (`Engine.decode_batch`)."""
    env = dict(engine.environment())
    extras = env.get("extras")
    drop = (() if scan_batched else SCAN_BATCH_EXTRAS) + (() if step_batched else STEP_BATCH_EXTRAS)
    if isinstance(extras, dict) and any(k in extras for k in drop):
        env["extras"] = extras = {k: v for k, v in extras.items() if k not in drop}
    if decode_rows > 1 and isinstance(extras, dict):
        env["extras"] = {**extras, "decode_rows": decode_rows}
    return env


def _semantic(r: _Replayed, a: ArmOutcome, b: ArmOutcome) -> SemanticAgreement | None:
    extractor, trace = r.item.extractor, r.item.trace
    if extractor is None:
        return None
    text_a = a.text
    if text_a is None and r.b.arm is not None:
        text_a = r.b.arm.engine.detokenize(r.a.ids)
    text_b = text_a if r.b.ids == r.a.ids else b.text
    if text_a is None or text_b is None:
        return None
    return semantic_agreement(text_a, text_b, extractor, reference_answer=trace.reference_answer)


def _near_tie(trace: LoggedTrace, steps: Steps, flag_ulps: float) -> int | None:
    """The first near-tie along the scan's logged path (docs/replays.md "Near-tie flagging"),
    in either arm; None: none, or flagging off."""
    if flag_ulps < 0:
        return None
    found = [first_near_tie(steps.margins_ulps, flag_ulps)]
    logits = trace.top_k_logits
    if logits is not None and logits.shape[1] >= 2 and trace.processors is None:
        n = min(int(logits.shape[0]), len(steps))
        top1 = steps.top_k_logits[:n, 0] if trace.top_k_values == "raw_logprobs" else None
        logged_ulps = margins_ulps_from_top_k(logits[:n, :2], trace.config.head_dtype, top1)
        found.append(first_near_tie(logged_ulps, flag_ulps))
    hits = [t for t in found if t is not None]
    return min(hits) if hits else None


def _scanned_only(
    item: ReplayItem, b: Arm, steps: Steps, batched: bool, screen: Screen = "scanned"
) -> ReplayOutcome:
    """A trace only scanned (`screen`: unflagged, or `near_tie_scanned`, flagged by a near-tie
    outside the flagged sample): unknown (`exact_match` and `category` None), not agreed. Not
    `_outcome`: most traces of a large run end here, and nothing of a decode is computed."""
    trace = item.trace
    logged = trace.output_token_ids.tolist()
    run_b = _ArmRun(b, logged, steps, "scan", batched)
    r = _Replayed(item, "scan_then_decode", _ArmRun(None, logged, None), run_b, None, screen)
    arm_a = ArmOutcome(
        target=trace.config, output_token_ids=None, margin=None, text=trace.output_text
    )
    return _unknown(r, arm_a)


def _unknown(r: _Replayed, arm_a: ArmOutcome) -> ReplayOutcome:
    """The outcome of a scan-then-decode item only scanned (`r.screen`): its exact match and
    category unknown, arm A as given, arm B its scan with no output of its own."""
    arm_b = replace(_arm_outcome(r, "b", None, None), output_token_ids=None)
    return ReplayOutcome(
        mode="scan_then_decode",
        exact_match=None,
        first_divergence_step=None,
        category=None,
        tie=False,
        cascade_length=None,
        length_difference=None,
        a=arm_a,
        b=arm_b,
        external_id=r.item.trace.external_id,
        screen=r.screen,
        baseline=r.item.baseline,
    )


# -- one item -----------------------------------------------------------------------------------


def replay_one(
    item: ReplayItem, pool: EnginePool, options: ReplayOptions, scan: ScanRun | None = None
) -> ReplayOutcome:
    """`replay_items` of one item (`scan`: its scan already run), its failure raised."""
    (result,) = replay_items([item], pool, options, scans=[scan])
    if isinstance(result, Exception):
        raise result
    return result


def replay_trace(
    trace: LoggedTrace,
    target: Target,
    pool: EnginePool,
    *,
    model_dir: str | Path,
    mode: Mode = "decode",
    extractor: str | Extractor | None = None,
    top_k: int = 5,
    check_weights: bool = True,
    scan: ScanRun | None = None,
    control: bool = False,
    flag_ulps: float = SCAN_FLAG_OFF,
    decode_flagged: bool = True,
) -> ReplayOutcome:
    """Replay `trace` in `target` against its logged output (`replay_items` of one item).
    Raises `ModelMismatch` for another checkpoint, `BadRequest` for a non-greedy trace,
    `UnsupportedFormat` when the target cannot run here."""
    item = ReplayItem(
        trace,
        RunTarget(target),
        Path(model_dir),
        None,
        control,
        extractor,
        decode_flagged=decode_flagged,
    )
    options = ReplayOptions(mode, top_k, flag_ulps, check_weights=check_weights)
    return replay_one(item, pool, options, scan)


def compare_arms(
    trace: LoggedTrace,
    target_a: Target,
    target_b: Target,
    pool: EnginePool,
    *,
    model_dir: str | Path,
    extractor: str | Extractor | None = None,
    top_k: int = 5,
    check_weights: bool = True,
) -> ReplayOutcome:
    """The paper's both-arms protocol for one trace: arm B diffed against arm A, both decoded
    from the prompt; the logged output is not used."""
    item = ReplayItem(
        trace, RunTarget(target_b), Path(model_dir), RunTarget(target_a), extractor=extractor
    )
    return replay_one(item, pool, ReplayOptions("decode", top_k, check_weights=check_weights))
