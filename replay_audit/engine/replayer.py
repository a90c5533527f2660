"""Replay a logged trace in a target configuration and diff the two arms. Torch-free: engines
come from an `EnginePool` through the `Engine` protocol; the comparison is the pure diff engine.

Modes:
    decode            greedy decode of the prompt in the target, compared with the logged output
    scan              one teacher-forced forward over prompt ‖ logged output; t* is the first
                      position whose choice differs from the logged token. A screen: the
                      replayed arm's own continuation after t* is not computed.
    scan_then_decode  scan, then decode only from the scan's first disagreement s (prefill
                      prompt ‖ logged[:s]); none found: the trace replays exactly.

Both arms of a production trace: the logged arm is the trace (its top-k, when logged, gives its
margin at t*; otherwise that margin is reconstructed by re-running the logged format here, and
the result says which); the replay arm is ours. `compare_arms` is the paper's both-arms protocol:
both arms are decoded here from the prompt, each with its target's intervention.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from replay_audit.diff import (
    Category,
    Extractor,
    Margin,
    cascade_length,
    classify,
    first_divergence,
    gate_fires_at_divergence,
    is_tie,
    length_difference,
    margin_from_top_k,
    semantic_agreement,
)
from replay_audit.engine.pool import EnginePool
from replay_audit.engine.protocol import MODES, Engine, Mode, Steps, Target
from replay_audit.exceptions import BadRequest, EngineError, ModelMismatch
from replay_audit.traces.schemas import TraceCreate

LoggedEngineFactory = Callable[[Target], "Engine | None"]
MarginSource = Literal["logged_top_k", "reconstructed", "decode", "unavailable"]


@dataclass(frozen=True)
class TraceReplay:
    """The diff of one trace's logged arm and its replay. `to_dict()` is the result JSON
    (DESIGN.md field names); NaN never appears in it (unknown values are null)."""

    mode: Mode
    exact_match: bool
    first_divergence_step: int | None
    margin_at_divergence: dict[str, Any] | None
    category: Category
    gate_triggers: int
    steps: int
    trigger_rate: float | None
    mean_gap: float | None
    #: Steps where the intervention chose a token other than the native argmax.
    changed_steps: int
    tie: bool
    cascade_length: int | None
    length_difference: int | None
    replay_output_token_ids: list[int]
    single_step: dict[str, Any] | None
    environment: dict[str, Any]
    target: dict[str, Any]
    external_id: str | None = None
    semantic: dict[str, Any] | None = None
    #: Where the logged arm was run here (re-run or both-arms decode): its environment.
    logged_environment: dict[str, Any] | None = None
    #: Both-arms protocol only: arm A's output and statistics.
    logged_arm: dict[str, Any] | None = None
    #: The replayed arm's per-step margins (6 significant digits; None where not finite) and
    #: the steps where its gate fired: the trace page's margin track.
    margins: list[float | None] | None = None
    gate_fired_steps: list[int] | None = None
    #: The replayed output as text, where the checkpoint has a tokenizer.
    replay_text: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "external_id": self.external_id,
            "mode": self.mode,
            "exact_match": self.exact_match,
            "first_divergence_step": self.first_divergence_step,
            "margin_at_divergence": self.margin_at_divergence,
            "category": self.category,
            "gate_triggers": self.gate_triggers,
            "steps": self.steps,
            "trigger_rate": self.trigger_rate,
            "mean_gap": self.mean_gap,
            "changed_steps": self.changed_steps,
            "tie": self.tie,
            "cascade_length": self.cascade_length,
            "length_difference": self.length_difference,
            "replay_output_token_ids": list(self.replay_output_token_ids),
            "single_step": self.single_step,
            "semantic": self.semantic,
            "environment": self.environment,
            "target": self.target,
            "logged_environment": self.logged_environment,
            "logged_arm": self.logged_arm,
            "margins": self.margins,
            "gate_fired_steps": self.gate_fired_steps,
            "replay_text": self.replay_text,
        }


def _plain(x: Any) -> Any:
    """JSON-safe plain types: numpy scalars to Python, non-finite floats to None."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _margin_dict(m: Margin | None, source: MarginSource | None = None) -> dict[str, Any] | None:
    if m is None:
        return {"abs": None, "ulps": None, **({"source": "unavailable"} if source else {})}
    d: dict[str, Any] = {"abs": m.abs, "ulps": m.ulps}
    if source is not None:
        d["source"] = source
    return d


def margin_track(steps: Steps) -> tuple[list[float | None], list[int]]:
    """Per-step margins (6 significant digits: a display track, not a measurement; the margins
    at t* are kept exactly) and the steps where the gate fired."""
    margins = [float(f"{m:.6g}") if math.isfinite(m) else None for m in steps.margins.tolist()]
    return margins, [int(t) for t in np.flatnonzero(steps.gate_fired)]


def _stats(steps: Steps) -> tuple[int, int, float | None, float | None, int]:
    n = len(steps)
    triggers = int(steps.gate_fired.sum())
    return (
        triggers,
        n,
        triggers / n if n else None,
        float(steps.margins.mean()) if n else None,
        int(steps.changed.sum()),
    )


def replay_budget(trace: TraceCreate) -> tuple[int, list[int]]:
    """How long the replay may run and which ids stop it, from the trace's decoding record.

    The logged max_new_tokens when the logged arm stopped on eos or length (so a replay may run
    longer or shorter); the logged length when it stopped for a reason we cannot replay (a stop
    string). Without logged eos ids, an eos-stopped trace's last token is its eos.
    """
    dec, out = trace.decoding, trace.output_token_ids
    if dec.stop_reason in ("stop_string", "other"):
        budget = len(out)
    else:
        budget = max(dec.max_new_tokens or 0, len(out))
    eos = list(dec.eos_token_ids)
    if not eos and dec.stop_reason == "eos":
        eos = [out[-1]]
    return budget, eos


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


def _check_trace(
    trace: TraceCreate, pool: EnginePool, model_dir: Path, check_weights: bool
) -> None:
    if trace.decoding.strategy != "greedy":
        raise BadRequest(
            f"only greedy traces can be replayed; this one is {trace.decoding.strategy!r}",
            field="decoding.strategy",
        )
    if check_weights:
        sha = pool.weights_sha256(model_dir)
        if sha != trace.model.weights_sha256:
            raise ModelMismatch(
                f"checkpoint {model_dir} has weights_sha256 {sha}, but the trace "
                f"{trace.external_id or ''} was logged with {trace.model.weights_sha256}",
                field="model.weights_sha256",
            )


def replay_trace(
    trace: TraceCreate,
    target: Target,
    pool: EnginePool,
    *,
    model_dir: str | Path,
    mode: Mode = "decode",
    logged_engine_factory: LoggedEngineFactory | None = None,
    extractor: str | Extractor | None = None,
    top_k: int = 5,
    check_weights: bool = True,
) -> TraceReplay:
    """Replay `trace` in `target` (an attention kernel of None means the logged one) and diff it
    against the logged output.

    Raises `ModelMismatch` when the checkpoint is not the one the trace was logged with,
    `BadRequest` for a non-greedy trace, `UnsupportedFormat` when the target cannot run here.
    `logged_engine_factory(target)` returns an engine for the logged format (for the single-step
    re-run and, without logged top-k, the logged margin), or None where it cannot run here; by
    default it is taken from `pool`.
    """
    if mode not in MODES:
        raise BadRequest(f"mode must be one of {MODES}, got {mode!r}", field="mode")
    d = Path(model_dir)
    _check_trace(trace, pool, d, check_weights)
    requested_kernel = target.attn_kernel
    if target.attn_kernel is None:
        target = Target(
            target.dtype,
            target.lm_head_dtype,
            trace.config.attn_kernel,
            target.batch_size,
            target.intervention,
        )
    engine = _load(pool, d, target, requested_kernel)
    if engine.vocab_size != trace.model.vocab_size:
        raise ModelMismatch(
            f"checkpoint vocabulary is {engine.vocab_size}, the trace's {trace.model.vocab_size}",
            field="model.vocab_size",
        )
    iv = target.intervention
    prompt, logged = list(trace.prompt_token_ids), list(trace.output_token_ids)
    budget, eos = replay_budget(trace)

    if mode == "decode":
        run = engine.decode(prompt, budget, eos, iv, top_k)
        replay_ids, steps = run.output_token_ids, run.steps
    else:
        scan = engine.scan(prompt, logged, iv, top_k)
        s = scan.first_disagreement
        if s is None:
            replay_ids, steps = logged, scan.steps
        elif mode == "scan":
            replay_ids = [*logged[:s], int(scan.steps.token_ids[s])]
            steps = scan.steps.slice(0, s + 1)
        else:
            run = engine.decode(prompt, budget, eos, iv, top_k, forced_prefix=logged[:s])
            replay_ids = run.output_token_ids
            steps = Steps.concat([scan.steps.slice(0, s), run.steps])

    factory = logged_engine_factory or _default_logged_factory(pool, d)
    logged_target = Target.from_config(trace.config)
    t_star = first_divergence(logged, replay_ids)
    logged_engine: Engine | None = None
    margins: dict[str, Any] | None = None
    single: dict[str, Any] | None = None
    category: Category = "agreed"
    tie = False
    if t_star is not None:
        logged_margin, source, logged_engine = _logged_margin(
            trace, t_star, prompt, logged, logged_target, factory, top_k
        )
        replay_margin = steps.margin_at(t_star) if t_star < len(steps) else None
        margins = {
            "logged": _margin_dict(logged_margin, source),
            "replay": _margin_dict(replay_margin),
        }
        tie = is_tie(logged_margin, replay_margin)
        fired = gate_fires_at_divergence(
            logged_margin,
            replay_margin,
            logged_format=logged_target.head_dtype,
            replay_format=target.head_dtype,
            gate=iv.gate,
        )
        if logged_engine is None:
            logged_engine = factory(logged_target)
        single, disagrees = _single_step(
            engine,
            logged_engine,
            prompt,
            logged,
            t_star,
            top_k,
            logged_token=logged[t_star] if t_star < len(logged) else None,
        )
        # Unknown (the logged arm cannot run here and had stopped): the flip is not shown to
        # reproduce from scratch, so C is not claimed to reach it.
        category = classify(t_star, gate_fired=fired, single_step_disagrees=bool(disagrees))

    triggers, n, rate, gap, changed = _stats(steps)
    track, fired_steps = margin_track(steps)
    exact = t_star is None
    decoded_fully = mode != "scan" or exact
    return TraceReplay(
        mode=mode,
        exact_match=exact,
        first_divergence_step=t_star,
        margin_at_divergence=_plain(margins),
        category=category,
        gate_triggers=triggers,
        steps=n,
        trigger_rate=rate,
        mean_gap=gap,
        changed_steps=changed,
        tie=tie,
        cascade_length=cascade_length(logged, replay_ids) if decoded_fully else None,
        length_difference=length_difference(logged, replay_ids) if decoded_fully else None,
        replay_output_token_ids=[int(x) for x in replay_ids],
        single_step=_plain(single),
        environment=_plain(engine.environment()),
        target=_plain(target.to_dict()),
        external_id=trace.external_id,
        semantic=_semantic(trace, engine, logged, replay_ids, extractor) if decoded_fully else None,
        logged_environment=_plain(logged_engine.environment()) if logged_engine else None,
        margins=track,
        gate_fired_steps=fired_steps,
        replay_text=engine.detokenize(replay_ids),
    )


def _default_logged_factory(pool: EnginePool, model_dir: Path) -> LoggedEngineFactory:
    def factory(target: Target) -> Engine | None:
        try:
            return _load(pool, model_dir, target, None)
        except EngineError:
            return None

    return factory


def _logged_margin(
    trace: TraceCreate,
    t_star: int,
    prompt: list[int],
    logged: list[int],
    logged_target: Target,
    factory: LoggedEngineFactory,
    top_k: int,
) -> tuple[Margin | None, MarginSource, Engine | None]:
    if t_star >= len(logged):
        return None, "unavailable", None
    if trace.top_k is not None and len(trace.top_k.logits[t_star]) >= 2:
        m = margin_from_top_k(trace.top_k.logits[t_star], logged_target.head_dtype)
        return m, "logged_top_k", None
    engine = factory(logged_target)
    if engine is None:
        return None, "unavailable", None
    return engine.step(prompt, logged[:t_star], top_k).margin, "reconstructed", engine


def _single_step(
    replay_engine: Engine,
    logged_engine: Engine | None,
    prompt: list[int],
    prefix_source: Sequence[int],
    t_star: int,
    top_k: int,
    *,
    logged_token: int | None,
) -> tuple[dict[str, Any], bool | None]:
    """From-scratch forwards over prompt ‖ y<t* in both formats: does the flip reproduce?"""
    prefix = list(prefix_source[:t_star])
    r = replay_engine.step(prompt, prefix, top_k)
    out: dict[str, Any] = {
        "step": t_star,
        "replay": {"token": r.token, "margin": r.margin.to_dict()},
    }
    if logged_engine is not None:
        lg = logged_engine.step(prompt, prefix, top_k)
        out["logged"] = {"token": lg.token, "margin": lg.margin.to_dict(), "source": "rerun"}
        disagrees: bool | None = lg.token != r.token
    elif logged_token is not None:
        # The logged format cannot run here: its logged token stands in for its re-run.
        out["logged"] = {"token": logged_token, "margin": None, "source": "logged_token"}
        disagrees = logged_token != r.token
    else:
        out["logged"] = None
        disagrees = None
    out["disagree"] = disagrees
    return out, disagrees


def _semantic(
    trace: TraceCreate,
    engine: Engine,
    logged: list[int],
    replay_ids: list[int],
    extractor: str | Extractor | None,
) -> dict[str, Any] | None:
    if extractor is None:
        return None
    logged_text = trace.output_text if trace.output_text is not None else engine.detokenize(logged)
    replay_text = logged_text if replay_ids == logged else engine.detokenize(replay_ids)
    if logged_text is None or replay_text is None:
        return None
    return semantic_agreement(
        logged_text, replay_text, extractor, reference_answer=trace.reference_answer
    ).to_dict()


def compare_arms(
    trace: TraceCreate,
    target_a: Target,
    target_b: Target,
    pool: EnginePool,
    *,
    model_dir: str | Path,
    extractor: str | Extractor | None = None,
    top_k: int = 5,
    check_weights: bool = True,
) -> TraceReplay:
    """The paper's both-arms protocol: decode the trace's prompt in `target_a` and in `target_b`
    (each with its own intervention) and diff arm B against arm A. The logged output is not
    used; the trace gives the prompt, the length budget and the eos ids."""
    d = Path(model_dir)
    _check_trace(trace, pool, d, check_weights)
    ea, eb = pool.get(d, target_a), pool.get(d, target_b)
    prompt = list(trace.prompt_token_ids)
    budget, eos = replay_budget(trace)
    ra = ea.decode(prompt, budget, eos, target_a.intervention, top_k)
    rb = eb.decode(prompt, budget, eos, target_b.intervention, top_k)
    a_ids, b_ids = ra.output_token_ids, rb.output_token_ids
    t_star = first_divergence(a_ids, b_ids)
    margins: dict[str, Any] | None = None
    single: dict[str, Any] | None = None
    category: Category = "agreed"
    tie = False
    if t_star is not None:
        ma = ra.steps.margin_at(t_star) if t_star < len(ra.steps) else None
        mb = rb.steps.margin_at(t_star) if t_star < len(rb.steps) else None
        margins = {"logged": _margin_dict(ma, "decode"), "replay": _margin_dict(mb)}
        tie = is_tie(ma, mb)
        fired = gate_fires_at_divergence(
            ma,
            mb,
            logged_format=target_a.head_dtype,
            replay_format=target_b.head_dtype,
            gate=target_b.intervention.gate,
        )
        single, disagrees = _single_step(
            eb,
            ea,
            prompt,
            a_ids,
            t_star,
            top_k,
            logged_token=a_ids[t_star] if t_star < len(a_ids) else None,
        )
        category = classify(t_star, gate_fired=fired, single_step_disagrees=bool(disagrees))
    triggers, n, rate, gap, changed = _stats(rb.steps)
    a_triggers, a_n, _, a_gap, a_changed = _stats(ra.steps)
    track, fired_steps = margin_track(rb.steps)
    a_track, a_fired_steps = margin_track(ra.steps)
    semantic = None
    if extractor is not None:
        ta, tb = ea.detokenize(a_ids), eb.detokenize(b_ids)
        if ta is not None and tb is not None:
            semantic = semantic_agreement(
                ta, tb, extractor, reference_answer=trace.reference_answer
            ).to_dict()
    return TraceReplay(
        mode="decode",
        exact_match=t_star is None,
        first_divergence_step=t_star,
        margin_at_divergence=_plain(margins),
        category=category,
        gate_triggers=triggers,
        steps=n,
        trigger_rate=rate,
        mean_gap=gap,
        changed_steps=changed,
        tie=tie,
        cascade_length=cascade_length(a_ids, b_ids),
        length_difference=length_difference(a_ids, b_ids),
        replay_output_token_ids=list(b_ids),
        single_step=_plain(single),
        environment=_plain(eb.environment()),
        target=_plain(target_b.to_dict()),
        external_id=trace.external_id,
        semantic=semantic,
        logged_environment=_plain(ea.environment()),
        logged_arm=_plain(
            {
                "target": target_a.to_dict(),
                "output_token_ids": list(a_ids),
                "gate_triggers": a_triggers,
                "steps": a_n,
                "mean_gap": a_gap,
                "changed_steps": a_changed,
                "margins": a_track,
                "gate_fired_steps": a_fired_steps,
                "text": ea.detokenize(a_ids),
            }
        ),
        margins=track,
        gate_fired_steps=fired_steps,
        replay_text=eb.detokenize(b_ids),
    )
