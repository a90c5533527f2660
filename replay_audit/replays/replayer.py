"""Replay a logged trace in a target configuration and diff the two arms. Torch-free: engines
come from an `EnginePool` through the `Engine` protocol; the comparison is the pure diff engine.

Modes:
    decode            greedy decode of the prompt in the target, compared with the logged output
    scan              one teacher-forced forward over prompt ‖ logged output; t* is the first
                      position whose choice differs from the logged token. A screen: the
                      replayed arm's own continuation after t* is not computed.
    scan_then_decode  scan; a trace the scan flags (first disagreement s) is decoded from s
                      (prefill prompt ‖ logged[:s]); one it does not flag is decoded in full
                      when it is in the run's control sample (`control=True`), and otherwise
                      only scanned: its outcome says so (`screen="scanned"`, `exact_match`
                      None), because a flip that needs the decode's KV cache is invisible to a
                      teacher-forced scan. The control sample measures how many that misses.
                      A flagged trace's decode starts at s: a flip before s that only a decode
                      from the prompt would show is not looked for. Such KV-dependent flips
                      sit at near-ties: with `flag_ulps` >= 0, a trace the scan agrees with is
                      also flagged (`screen="near_tie"`) and decoded in full from the prompt
                      when some step's top-2 margin along the logged path (the replay arm's,
                      and the logged arm's where it logged top-k) is at most that many ulps of
                      the arm's format. The control sample is drawn from the traces neither
                      rule flags, so it still estimates what the scan misses.

`replay_traces` replays many traces (a job's) with the single-step re-runs at t* of all the
divergent ones run as batched forwards (`Engine.step_batch`, per engine) instead of one
from-scratch forward each: what a scan job spent most of its time on.

`replay_trace`: arm A is the trace as logged (its top-k, when logged, gives its margin at t*;
otherwise that margin is reconstructed by re-running the logged format here, and the outcome
says which), arm B is ours. `compare_arms` is the paper's both-arms protocol: both arms are
decoded here from the prompt, each with its target's intervention.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from replay_audit.diff import (
    Extractor,
    Margin,
    cascade_length,
    classify,
    first_divergence,
    first_near_tie,
    gate_fires_at_divergence,
    is_tie,
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
    Engine,
    Intervention,
    ScanItem,
    ScanRun,
    StepInfo,
    Steps,
    Target,
)
from replay_audit.exceptions import BadRequest, EngineError, ModelMismatch, ReplayAuditError
from replay_audit.formats import MODES, Category, MarginSource, Mode, Screen
from replay_audit.replays.domain import (
    SCAN_FLAG_OFF,
    ArmMargin,
    ArmOutcome,
    LoggedTrace,
    ReplayOutcome,
    SingleStep,
    SingleStepChoice,
)

LoggedEngineFactory = Callable[[Target], "Engine | None"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScanRequest:
    """A trace to scan in a target, with the checkpoint it was logged with."""

    trace: LoggedTrace
    target: Target
    model_dir: Path


@dataclass(frozen=True)
class BatchedScans:
    """`scan_traces`' answer: each request's scan in order (None: not scanned in a batch; the
    replay scans it alone and reports what went wrong), and what it cost."""

    runs: list[ScanRun | None]
    scanned: int
    forwards: int
    seconds: float


def scan_traces(
    requests: Sequence[ScanRequest],
    pool: EnginePool,
    *,
    top_k: int = 5,
    token_budget: int = DEFAULT_SCAN_TOKEN_BUDGET,
) -> BatchedScans:
    """The scans `replay_trace` would run, several traces per forward: the requests grouped by
    the engine that replays them (`replay_engine`) and the intervention, one `Engine.scan_batch`
    per group (length buckets packed up to `token_budget` tokens). A request that cannot run
    (non-greedy, no engine, another vocabulary) or whose group's batch fails gets None."""
    runs: list[ScanRun | None] = [None] * len(requests)
    groups: dict[tuple[int, Intervention], tuple[Engine, list[int]]] = {}
    for i, r in enumerate(requests):
        if not r.trace.greedy:
            continue
        try:
            engine, resolved = replay_engine(r.trace, r.target, pool, r.model_dir)
        except (ReplayAuditError, RuntimeError, ValueError, MemoryError):
            continue  # the replay of the trace reports it
        groups.setdefault((id(engine), resolved.intervention), (engine, []))[1].append(i)
    scanned = forwards = 0
    seconds = 0.0
    for (_, iv), (engine, members) in groups.items():
        items = [
            ScanItem(
                requests[i].trace.prompt_token_ids.tolist(),
                requests[i].trace.output_token_ids.tolist(),
            )
            for i in members
        ]
        t0 = time.perf_counter()
        try:
            batch = engine.scan_batch(items, iv, top_k, token_budget=token_budget)
        except (ReplayAuditError, RuntimeError, ValueError, MemoryError):
            log.exception("batched scan of %d traces failed; scanning them one by one", len(items))
            continue
        seconds += time.perf_counter() - t0
        scanned += len(items)
        forwards += len(plan_scan(items, token_budget))
        for i, run in zip(members, batch, strict=True):
            runs[i] = run
    return BatchedScans(runs, scanned, forwards, seconds)


def _arm_margin(m: Margin | None, source: MarginSource) -> ArmMargin:
    return ArmMargin.unavailable() if m is None else ArmMargin(m.abs, m.ulps, source)


def _track(steps: Steps) -> tuple[tuple[float | None, ...], tuple[int, ...]]:
    """Per-step margins (6 significant digits: a display track, not a measurement; the margins
    at t* are kept exactly) and the steps where the gate fired."""
    margins = tuple(float(f"{m:.6g}") if math.isfinite(m) else None for m in steps.margins.tolist())
    return margins, tuple(int(t) for t in np.flatnonzero(steps.gate_fired))


#: An engine's `environment()["extras"]` that describe its last batched scan or batched
#: single-step re-runs (`engine/batch.py`): true of a result only where its trace took part.
SCAN_BATCH_EXTRAS: Final = ("scan_token_budget", "scan_batch_shapes", "scan_padding")
STEP_BATCH_EXTRAS: Final = ("step_token_budget", "step_batch_shapes", "step_padding")


def _environment(engine: Engine, *, scan_batched: bool, step_batched: bool) -> dict[str, Any]:
    """`engine.environment()` as it held for one result: without the batch extras of a batched
    scan or of batched re-runs the result's trace was not part of (the engine keeps its last
    batch's, whatever it ran since)."""
    env: dict[str, Any] = dict(engine.environment())
    extras = env.get("extras")
    drop = (() if scan_batched else SCAN_BATCH_EXTRAS) + (() if step_batched else STEP_BATCH_EXTRAS)
    if isinstance(extras, dict) and any(k in extras for k in drop):
        env = {**env, "extras": {k: v for k, v in extras.items() if k not in drop}}
    return env


def _arm(
    engine: Engine,
    target: Target,
    steps: Steps,
    output: Sequence[int] | None,
    margin: ArmMargin | None,
    text_of: Sequence[int],
    *,
    scan_batched: bool = False,
    step_batched: bool = False,
) -> ArmOutcome:
    """An arm run here: its counts over `steps`, its track and environment (with the batch
    extras of the batched scan and re-runs it took part in)."""
    n = len(steps)
    track, fired = _track(steps)
    return ArmOutcome(
        target=target,
        output_token_ids=tuple(int(x) for x in output) if output is not None else None,
        margin=margin,
        gate_triggers=int(steps.gate_fired.sum()),
        steps=n,
        mean_gap=float(steps.margins.mean()) if n else None,
        changed_steps=int(steps.changed.sum()),
        margins=track,
        gate_fired_steps=fired,
        environment=_environment(engine, scan_batched=scan_batched, step_batched=step_batched),
        text=engine.detokenize(list(text_of)),
        pieces=engine.token_pieces(list(text_of)),
    )


def _load(
    pool: EnginePool, model_dir: Path, target: Target, requested_kernel: str | None
) -> Engine:
    try:
        return pool.get(model_dir, target)
    except EngineError:
        if requested_kernel is not None or target.attn_kernel is None:
            raise
        # The logged kernel (e.g. flash_attention_2) does not exist here: the engine's default.
        return pool.get(
            model_dir,
            Target(
                target.dtype, target.lm_head_dtype, None, target.batch_size, target.intervention
            ),
        )


def check_replayable(trace: LoggedTrace) -> None:
    """Refuse, before any model loads, a trace no target can replay (`BadRequest` naming the
    field): only greedy generations replay."""
    if not trace.greedy:
        raise BadRequest(
            f"only greedy traces can be replayed; this one is {trace.strategy!r}",
            field="decoding.strategy",
        )


def _check_trace(
    trace: LoggedTrace, pool: EnginePool, model_dir: Path, check_weights: bool
) -> None:
    check_replayable(trace)
    if check_weights:
        sha = pool.weights_sha256(model_dir)
        if sha != trace.weights_sha256:
            raise ModelMismatch(
                f"checkpoint {model_dir} has weights_sha256 {sha}, but the trace "
                f"{trace.external_id or ''} was logged with {trace.weights_sha256}",
                field="model.weights_sha256",
            )


def replay_trace(
    trace: LoggedTrace,
    target: Target,
    pool: EnginePool,
    *,
    model_dir: str | Path,
    mode: Mode = "decode",
    logged_engine_factory: LoggedEngineFactory | None = None,
    extractor: str | Extractor | None = None,
    top_k: int = 5,
    check_weights: bool = True,
    scan: ScanRun | None = None,
    control: bool = False,
    flag_ulps: float = SCAN_FLAG_OFF,
) -> ReplayOutcome:
    """Replay `trace` in `target` (an attention kernel of None means the logged one) and diff it
    against the logged output (arm A).

    In the scan modes, `scan` is the trace's scan already run in `target` (a batched scan of
    many traces, `Engine.scan_batch`); None runs it here. `control` (scan_then_decode): the
    trace is in the run's control sample, so it is decoded in full even when the scan does not
    flag it. `flag_ulps` (scan_then_decode): a trace whose scan agrees at every step is still
    flagged, and decoded in full, when some step's top-2 margin along the logged path is at
    most this many ulps (`first_near_tie`; negative: off).

    Raises `ModelMismatch` when the checkpoint is not the one the trace was logged with,
    `BadRequest` for a non-greedy trace, `UnsupportedFormat` when the target cannot run here.
    `logged_engine_factory(target)` returns an engine for the logged format (for the single-step
    re-run and, without logged top-k, the logged margin), or None where it cannot run here; by
    default it is taken from `pool`.
    """
    replayed = _replay_arm(
        ReplayRequest(trace, target, Path(model_dir), scan, control, extractor),
        pool,
        mode=mode,
        top_k=top_k,
        check_weights=check_weights,
        flag_ulps=flag_ulps,
        factory=logged_engine_factory,
    )
    if isinstance(replayed, ReplayOutcome):
        return replayed
    reruns = {
        key: engine.step(list(context), [], iv, top_k)
        for key, (engine, iv, context) in _rerun_needs(replayed).items()
    }
    return _finish(replayed, reruns)


@dataclass(frozen=True)
class ReplayRequest:
    """One trace to replay against its logged output (`replay_traces`): its target, checkpoint,
    scan already run (None: run it), whether it is in the control sample, its extractor."""

    trace: LoggedTrace
    target: Target
    model_dir: Path
    scan: ScanRun | None = None
    control: bool = False
    extractor: str | Extractor | None = None


@dataclass(frozen=True, eq=False)
class _Replayed:
    """A trace's replayed arm, before the single-step re-runs at t* and arm A's margin."""

    request: ReplayRequest
    mode: Mode
    engine: Engine
    target: Target
    logged_engine: Engine | None
    prompt: list[int]
    logged: list[int]
    replay_ids: list[int]
    steps: Steps
    screen: Screen | None
    t_star: int | None
    top_k: int


#: The key of a re-run: (which trace of the batch, "a" or "b").
_RerunKey = tuple[int, str]


def _near_tie(trace: LoggedTrace, steps: Steps, flag_ulps: float) -> int | None:
    """The first step of a scan along the logged path where either arm's top-2 margin is at
    most `flag_ulps` ulps of its own format: the replayed arm's from the scan, the logged arm's
    from its logged top-k where there is one (raw logprobs: in ulps at the scan's top-1 logit,
    the same step over the same prefix). None: no near-tie, or flagging off."""
    if flag_ulps < 0:
        return None
    found = [first_near_tie(steps.margins_ulps, flag_ulps)]
    logits = trace.top_k_logits
    if logits is not None and logits.shape[1] >= 2:
        n = min(int(logits.shape[0]), len(steps))
        top1 = steps.top_k_logits[:n, 0] if trace.top_k_values == "raw_logprobs" else None
        logged_ulps = margins_ulps_from_top_k(logits[:n, :2], trace.config.head_dtype, top1)
        found.append(first_near_tie(logged_ulps, flag_ulps))
    hits = [t for t in found if t is not None]
    return min(hits) if hits else None


def _replay_arm(
    request: ReplayRequest,
    pool: EnginePool,
    *,
    mode: Mode,
    top_k: int,
    check_weights: bool,
    flag_ulps: float,
    factory: LoggedEngineFactory | None,
) -> _Replayed | ReplayOutcome:
    """Arm B of a replay against the logged output (decode, scan, or scan then decode), its t*
    and the logged format's engine; a trace a scan-then-decode run only scans is finished
    here (a `ReplayOutcome`)."""
    if mode not in MODES:
        raise BadRequest(f"mode must be one of {MODES}, got {mode!r}", field="mode")
    trace, d = request.trace, request.model_dir
    _check_trace(trace, pool, d, check_weights)
    engine, target = replay_engine(trace, request.target, pool, d)
    iv = target.intervention
    prompt = trace.prompt_token_ids.tolist()
    logged = trace.output_token_ids.tolist()
    budget, eos = trace.budget()

    screen: Screen | None = None
    if mode == "decode":
        run = engine.decode(prompt, budget, eos, iv, top_k)
        replay_ids, steps = run.output_token_ids, run.steps
    else:
        scan = request.scan
        if scan is None:
            scan = engine.scan(prompt, logged, iv, top_k)
        s = scan.first_disagreement
        near = (
            _near_tie(trace, scan.steps, flag_ulps)
            if s is None and mode == "scan_then_decode"
            else None
        )
        if s is None and mode == "scan_then_decode" and (near is not None or request.control):
            # A near-tie's flip may need the decode's own KV cache from the prompt on (a decode
            # from the near-tie would prefill it as the scan does): decoded in full, as the
            # control sample is. A near-tie trace is not in the control sample.
            run = engine.decode(prompt, budget, eos, iv, top_k)
            replay_ids, steps = run.output_token_ids, run.steps
            screen = "near_tie" if near is not None else "control"
        elif s is None and mode == "scan_then_decode":
            batched = request.scan is not None
            return _scanned_only(trace, engine, target, scan.steps, logged, batched)
        elif s is None:
            replay_ids, steps = logged, scan.steps
        elif mode == "scan":
            replay_ids = [*logged[:s], int(scan.steps.token_ids[s])]
            steps = scan.steps.slice(0, s + 1)
        else:
            run = engine.decode(prompt, budget, eos, iv, top_k, forced_prefix=logged[:s])
            replay_ids = run.output_token_ids
            steps = Steps.concat([scan.steps.slice(0, s), run.steps])
            screen = "flagged"

    t_star = first_divergence(logged, replay_ids)
    logged_engine: Engine | None = None
    if t_star is not None:
        logged_engine = (factory or _default_logged_factory(pool, d))(trace.config)
    return _Replayed(
        request,
        mode,
        engine,
        target,
        logged_engine,
        prompt,
        logged,
        replay_ids,
        steps,
        screen,
        t_star,
        top_k,
    )


#: A re-run to make: the arm's engine, its intervention and the context.
_Rerun = tuple[Engine, Intervention, list[int]]


def _rerun_needs(r: _Replayed, index: int = 0) -> dict[_RerunKey, _Rerun]:
    """The from-scratch forwards a divergent replay needs, each over prompt ‖ logged[:t*] and
    each with its arm's whole computation, intervention included: the replay arm's (b) and the
    logged arm's (a), where it runs here. Arm A's reconstructed margin at t* (no logged top-k)
    is the same forward as its single-step re-run (the margin is the native logits')."""
    if r.t_star is None:
        return {}
    context = [*r.prompt, *r.logged[: r.t_star]]
    needs: dict[_RerunKey, _Rerun] = {(index, "b"): (r.engine, r.target.intervention, context)}
    if r.logged_engine is not None:
        iv_a = r.request.trace.config.intervention
        needs[(index, "a")] = (r.logged_engine, iv_a, context)
    return needs


def _finish(
    r: _Replayed,
    reruns: dict[_RerunKey, StepInfo],
    index: int = 0,
    batched: frozenset[_RerunKey] = frozenset(),
) -> ReplayOutcome:
    """The outcome of a replayed arm, with its re-runs at t* (`_rerun_needs`' forwards;
    `batched`: those that ran in a `step_batch`)."""
    trace, mode, engine, target = r.request.trace, r.mode, r.engine, r.target
    logged, replay_ids, steps, t_star = r.logged, r.replay_ids, r.steps, r.t_star
    logged_target = trace.config
    margin_a = margin_b = None
    single: SingleStep | None = None
    category: Category = "agreed"
    tie = False
    if t_star is not None:
        mb = steps.margin_at(t_star) if t_star < len(steps) else None
        rerun_a = reruns.get((index, "a"))
        ma, source_a = _logged_margin(trace, t_star, logged, logged_target, mb, rerun_a)
        margin_a = _arm_margin(ma, source_a)
        margin_b = _arm_margin(mb, "scan" if mode == "scan" else "decode")
        tie = is_tie(ma, mb)
        fired = gate_fires_at_divergence(
            ma,
            mb,
            logged_format=logged_target.head_dtype,
            replay_format=target.head_dtype,
            gate=target.intervention.gate,
        )
        single = _single_step(
            reruns[(index, "b")],
            rerun_a,
            t_star,
            logged_token=logged[t_star] if t_star < len(logged) else None,
        )
        # Unknown (the logged arm cannot run here and had stopped): the flip is not shown to
        # reproduce from scratch, so C is not claimed to reach it.
        category = classify(t_star, gate_fired=fired, single_step_disagrees=bool(single.disagree))

    decoded_fully = mode != "scan" or t_star is None
    arm_b = _arm(
        engine,
        target,
        steps,
        replay_ids,
        margin_b,
        replay_ids,
        scan_batched=mode != "decode" and r.request.scan is not None,
        step_batched=(index, "b") in batched,
    )
    logged_engine = r.logged_engine
    arm_a = ArmOutcome(
        target=logged_target,
        output_token_ids=None,
        margin=margin_a,
        environment=(
            _environment(logged_engine, scan_batched=False, step_batched=(index, "a") in batched)
            if logged_engine is not None
            else None
        ),
        text=trace.output_text,
        # The trace's own pieces are stored with it; else the tokenizer here reads the logged
        # tokens (the same checkpoint, so the same vocabulary).
        pieces=engine.token_pieces(logged) if trace.output_token_pieces is None else None,
    )
    extractor = r.request.extractor
    return ReplayOutcome(
        mode=mode,
        exact_match=t_star is None,
        first_divergence_step=t_star,
        category=category,
        tie=tie,
        cascade_length=cascade_length(logged, replay_ids) if decoded_fully else None,
        length_difference=length_difference(logged, replay_ids) if decoded_fully else None,
        a=arm_a,
        b=arm_b,
        single_step=single,
        semantic=_semantic(trace, engine, logged, replay_ids, extractor) if decoded_fully else None,
        external_id=trace.external_id,
        screen=r.screen,
    )


#: What `replay_traces` gives for a trace: its outcome, or the error its replay raised.
ReplayResult = ReplayOutcome | Exception


def replay_traces(
    requests: Sequence[ReplayRequest],
    pool: EnginePool,
    *,
    mode: Mode,
    top_k: int = 5,
    flag_ulps: float = SCAN_FLAG_OFF,
    token_budget: int = DEFAULT_SCAN_TOKEN_BUDGET,
    check_weights: bool = True,
) -> list[ReplayResult]:
    """`replay_trace` of each request (against its logged output), in order, with the
    single-step re-runs at t* of all the divergent ones (and arm A's reconstructed margins,
    the same forwards) run as batched forwards, one `Engine.step_batch` per engine, instead
    of one forward each. A trace whose replay fails gets its exception (a `ReplayAuditError`,
    or the engine's RuntimeError, ValueError, MemoryError) in its place; a group whose batch
    fails is re-run one forward at a time."""
    results: list[ReplayResult | _Replayed] = []
    for r in requests:
        try:
            results.append(
                _replay_arm(
                    r,
                    pool,
                    mode=mode,
                    top_k=top_k,
                    check_weights=check_weights,
                    flag_ulps=flag_ulps,
                    factory=None,
                )
            )
        except (ReplayAuditError, RuntimeError, ValueError, MemoryError) as e:
            results.append(e)
    groups: dict[
        tuple[int, Intervention], tuple[Engine, Intervention, list[tuple[_RerunKey, list[int]]]]
    ] = {}
    for i, res in enumerate(results):
        if isinstance(res, _Replayed):
            for key, (engine, iv, context) in _rerun_needs(res, i).items():
                groups.setdefault((id(engine), iv), (engine, iv, []))[2].append((key, context))
    reruns: dict[_RerunKey, StepInfo] = {}
    batched: set[_RerunKey] = set()
    for engine, iv, members in groups.values():
        contexts = [c for _, c in members]
        infos: list[StepInfo | None]
        try:
            infos = list(engine.step_batch(contexts, iv, top_k, token_budget=token_budget))
            batched.update(key for key, _ in members)
        except (ReplayAuditError, RuntimeError, ValueError, MemoryError):
            log.exception("batched re-runs of %d steps failed; one at a time", len(contexts))
            infos = [_step_or_error(engine, c, iv, top_k) for c in contexts]
        for (key, _), info in zip(members, infos, strict=True):
            if info is not None:
                reruns[key] = info
    ran_batched = frozenset(batched)
    out: list[ReplayResult] = []
    for i, res in enumerate(results):
        if not isinstance(res, _Replayed):
            out.append(res)
            continue
        try:
            out.append(_finish(res, reruns, i, ran_batched))
        except KeyError:
            out.append(RuntimeError("the single-step re-run at t* failed"))
        except (ReplayAuditError, RuntimeError, ValueError, MemoryError) as e:
            out.append(e)
    return out


def _step_or_error(
    engine: Engine, context: list[int], iv: Intervention, top_k: int
) -> StepInfo | None:
    try:
        return engine.step(context, [], iv, top_k)
    except (ReplayAuditError, RuntimeError, ValueError, MemoryError):
        log.exception("single-step re-run failed")
        return None


def _scanned_only(
    trace: LoggedTrace,
    engine: Engine,
    target: Target,
    steps: Steps,
    logged: list[int],
    scan_batched: bool,
) -> ReplayOutcome:
    """A trace a scan-then-decode run only scanned: the scan agreed with the logged output at
    every step, and no decode says whether the replay does. Not an exact match, not agreed:
    unknown (`exact_match` and `category` None), with the scan's steps as arm B's."""
    return ReplayOutcome(
        mode="scan_then_decode",
        exact_match=None,
        first_divergence_step=None,
        category=None,
        tie=False,
        cascade_length=None,
        length_difference=None,
        a=ArmOutcome(
            target=trace.config, output_token_ids=None, margin=None, text=trace.output_text
        ),
        b=_arm(engine, target, steps, None, None, logged, scan_batched=scan_batched),
        external_id=trace.external_id,
        screen="scanned",
    )


def replay_engine(
    trace: LoggedTrace, target: Target, pool: EnginePool, model_dir: Path
) -> tuple[Engine, Target]:
    """The engine `replay_trace` replays `trace` in, and `target` with the kernel it loaded: an
    attention kernel of None means the logged one, or the engine's default where that cannot
    run here. `ModelMismatch` when the vocabularies differ. The job groups a batched scan's
    traces by this engine."""
    requested_kernel = target.attn_kernel
    if target.attn_kernel is None:
        target = Target(
            target.dtype,
            target.lm_head_dtype,
            trace.config.attn_kernel,
            target.batch_size,
            target.intervention,
        )
    engine = _load(pool, model_dir, target, requested_kernel)
    # The kernel that was loaded (the engine's default when the logged one cannot run here).
    target = Target(
        target.dtype,
        target.lm_head_dtype,
        engine.target.attn_kernel,
        target.batch_size,
        target.intervention,
    )
    if engine.vocab_size != trace.vocab_size:
        raise ModelMismatch(
            f"checkpoint vocabulary is {engine.vocab_size}, the trace's {trace.vocab_size}",
            field="model.vocab_size",
        )
    return engine, target


def _default_logged_factory(pool: EnginePool, model_dir: Path) -> LoggedEngineFactory:
    def factory(target: Target) -> Engine | None:
        try:
            return _load(pool, model_dir, target, None)
        except EngineError:
            return None

    return factory


def _logged_margin(
    trace: LoggedTrace,
    t_star: int,
    logged: list[int],
    logged_target: Target,
    replayed: Margin | None,
    rerun: StepInfo | None,
) -> tuple[Margin | None, MarginSource]:
    """Arm A's margin at t*: from the logged top-k when it has two values, else from the logged
    format's re-run over prompt ‖ logged[:t*] (`rerun`, None where it cannot run here).
    Logged raw logprobs give the absolute margin; its ulps are measured at the replayed arm's
    top-1 logit at t* (`replayed`), the same step over the same prefix."""
    if t_star >= len(logged):
        return None, "unavailable"
    logits = trace.top_k_logits
    if logits is not None and logits.shape[1] >= 2:
        row = [float(x) for x in logits[t_star, :2]]
        fmt = logged_target.head_dtype
        if trace.top_k_values == "raw_logprobs":
            top1 = replayed.top1 if replayed is not None else None
            return margin_from_logprobs(row, fmt, top1), "logged_top_k"
        return margin_from_top_k(row, fmt), "logged_top_k"
    if rerun is None:
        return None, "unavailable"
    return rerun.margin, "reconstructed"


def _single_step(
    rerun_b: StepInfo,
    rerun_a: StepInfo | None,
    t_star: int,
    *,
    logged_token: int | None,
) -> SingleStep:
    """From-scratch forwards over prompt ‖ y<t* in both formats: does the flip reproduce?"""
    b = SingleStepChoice(rerun_b.token, _arm_margin(rerun_b.margin, "reconstructed"), "rerun")
    a: SingleStepChoice | None
    if rerun_a is not None:
        a = SingleStepChoice(rerun_a.token, _arm_margin(rerun_a.margin, "reconstructed"), "rerun")
    elif logged_token is not None:
        # The logged format cannot run here: its logged token stands in for its re-run.
        a = SingleStepChoice(logged_token, None, "logged_token")
    else:
        a = None
    return SingleStep(step=t_star, a=a, b=b, disagree=None if a is None else a.token != b.token)


def _semantic(
    trace: LoggedTrace,
    engine: Engine,
    logged: list[int],
    replay_ids: list[int],
    extractor: str | Extractor | None,
) -> SemanticAgreement | None:
    if extractor is None:
        return None
    logged_text = trace.output_text if trace.output_text is not None else engine.detokenize(logged)
    replay_text = logged_text if replay_ids == logged else engine.detokenize(replay_ids)
    if logged_text is None or replay_text is None:
        return None
    return semantic_agreement(
        logged_text, replay_text, extractor, reference_answer=trace.reference_answer
    )


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
    """The paper's both-arms protocol: decode the trace's prompt in `target_a` and in `target_b`
    (each with its own intervention) and diff arm B against arm A. The logged output is not
    used; the trace gives the prompt, the length budget and the eos ids."""
    d = Path(model_dir)
    _check_trace(trace, pool, d, check_weights)
    ea, eb = pool.get(d, target_a), pool.get(d, target_b)
    prompt = trace.prompt_token_ids.tolist()
    budget, eos = trace.budget()
    ra = ea.decode(prompt, budget, eos, target_a.intervention, top_k)
    rb = eb.decode(prompt, budget, eos, target_b.intervention, top_k)
    a_ids, b_ids = ra.output_token_ids, rb.output_token_ids
    t_star = first_divergence(a_ids, b_ids)
    margin_a = margin_b = None
    single: SingleStep | None = None
    category: Category = "agreed"
    tie = False
    if t_star is not None:
        ma = ra.steps.margin_at(t_star) if t_star < len(ra.steps) else None
        mb = rb.steps.margin_at(t_star) if t_star < len(rb.steps) else None
        margin_a, margin_b = _arm_margin(ma, "decode"), _arm_margin(mb, "decode")
        tie = is_tie(ma, mb)
        # Both arms' gates count: each arm applies its own intervention at its own firings.
        fired = gate_fires_at_divergence(
            ma,
            mb,
            logged_format=target_a.head_dtype,
            replay_format=target_b.head_dtype,
            gate=target_b.intervention.gate,
        )
        prefix = a_ids[:t_star]
        single = _single_step(
            eb.step(prompt, prefix, target_b.intervention, top_k),
            ea.step(prompt, prefix, target_a.intervention, top_k),
            t_star,
            logged_token=a_ids[t_star] if t_star < len(a_ids) else None,
        )
        category = classify(t_star, gate_fired=fired, single_step_disagrees=bool(single.disagree))
    semantic = None
    arm_a = _arm(ea, target_a, ra.steps, a_ids, margin_a, a_ids)
    arm_b = _arm(eb, target_b, rb.steps, b_ids, margin_b, b_ids)
    if extractor is not None and arm_a.text is not None and arm_b.text is not None:
        semantic = semantic_agreement(
            arm_a.text, arm_b.text, extractor, reference_answer=trace.reference_answer
        )
    return ReplayOutcome(
        mode="decode",
        exact_match=t_star is None,
        first_divergence_step=t_star,
        category=category,
        tie=tie,
        cascade_length=cascade_length(a_ids, b_ids),
        length_difference=length_difference(a_ids, b_ids),
        a=arm_a,
        b=arm_b,
        single_step=single,
        semantic=semantic,
        external_id=trace.external_id,
    )
