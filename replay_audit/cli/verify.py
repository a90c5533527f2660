"""`replay-audit verify` and `replay-audit calibrate`: provider audit offline, no server."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from replay_audit.cli.database import fail
from replay_audit.cli.demo import PROMPTS_FILE
from replay_audit.cli.engine import DeviceOpt, ThreadsOpt, _progress, _read_jsonl, _threads
from replay_audit.cli.root import app
from replay_audit.config import (
    DEFAULT_NULL_MAX_NEW_TOKENS,
    DEFAULT_NULL_PROMPTS,
    MAX_NULL_MAX_NEW_TOKENS,
    MAX_NULL_PROMPTS,
)
from replay_audit.formats import BodyDType, HeadDType
from replay_audit.queue.route import MAX_TP_DEGREE
from replay_audit.words import counted

#: The null's prompts: a null of few promises a false-alarm rate its next prompts break.
NULL_HELP = "Prompts per variation (more: a promise the null can keep; docs/verify.md)."

DEVICES_HELP = (
    "CUDA GPUs the null may span: 2 or more adds the benign TP-2 variation (else the "
    "calibration's notes say TP was not covered)."
)
NullPromptsOpt = Annotated[int, typer.Option(min=2, max=MAX_NULL_PROMPTS, help=NULL_HELP)]
NullMaxNewOpt = Annotated[
    int, typer.Option(min=1, max=MAX_NULL_MAX_NEW_TOKENS, help="Null generation length.")
]
FalseAlarmOpt = Annotated[float, typer.Option(min=1e-4, max=0.5)]
DevicesOpt = Annotated[int, typer.Option(min=1, max=MAX_TP_DEGREE, help=DEVICES_HELP)]

if TYPE_CHECKING:
    from replay_audit.engine import EnginePool
    from replay_audit.stats.verification import Calibration, Claim, PlatformKey


def _measure(
    model: Path,
    claim: Claim,
    prompts: Path,
    n_prompts: int,
    max_new: int,
    pool: EnginePool,
    device: str | None,
    false_alarm_rate: float,
) -> Calibration:
    from replay_audit.screenings.sweep.worker import TorchFacts
    from replay_audit.verifications.domain import claimed_target
    from replay_audit.verifications.null import benign_null

    rows = [row for _, row in _read_jsonl(prompts)][:n_prompts]
    screen_prompts = TorchFacts(model, device).prompts(rows)  # type: ignore[arg-type]
    start = time.monotonic()
    with _progress() as bar:
        task = bar.add_task(f"benign null of {claim}", total=None)

        def progress(what: str, done: int, total: int) -> None:
            what = f"benign null of {claim}: {what}"
            bar.update(task, description=what, completed=done, total=total)
            if not bar.console.is_terminal:  # a log, not a terminal: one line a step
                elapsed = time.monotonic() - start
                print(f"{what} ({done}/{total}, {elapsed:.0f} s)", file=sys.stderr, flush=True)

        return benign_null(
            model,
            claimed_target(claim),
            screen_prompts,
            pool=pool,
            device=device,
            max_new_tokens=max_new,
            false_alarm_rate=false_alarm_rate,
            progress=progress,
            sampling=claim.get("sampling"),
        )


@app.command()
def calibrate(
    model: Annotated[Path, typer.Option(help="Local Hugging Face checkpoint directory.")],
    out: Annotated[Path, typer.Option(help="Where to write the calibration (JSON).")],
    dtype: Annotated[BodyDType, typer.Option(help="The claimed body dtype.")] = "bf16",
    lm_head_dtype: Annotated[HeadDType | None, typer.Option(help="Default: dtype.")] = None,
    attn_kernel: Annotated[str, typer.Option(help="The claimed attention kernel.")] = "sdpa",
    prompts: Annotated[Path, typer.Option(help='JSONL of {"id", "prompt"}.')] = PROMPTS_FILE,
    null_prompts: NullPromptsOpt = DEFAULT_NULL_PROMPTS,
    max_new_tokens: NullMaxNewOpt = DEFAULT_NULL_MAX_NEW_TOKENS,
    false_alarm_rate: FalseAlarmOpt = 0.01,
    device: DeviceOpt = None,
    threads: ThreadsOpt = None,
    devices: DevicesOpt = 1,
) -> None:
    """Measure the checkpoint's benign null on this platform for one claimed configuration."""
    from replay_audit.engine import EnginePool
    from replay_audit.stats.verification import Claim

    pool = EnginePool(device=device, threads=_threads(threads), devices=devices)
    claim = Claim(dtype=dtype, lm_head_dtype=lm_head_dtype or dtype, attn_kernel=attn_kernel)
    cal = _measure(
        model, claim, prompts, null_prompts, max_new_tokens, pool, device, false_alarm_rate
    )
    out.write_text(json.dumps([cal.to_json()], indent=1), encoding="utf-8")
    typer.echo(
        f"wrote the null of {dtype} on {cal.platform['device']} to {out}: "
        f"{sum(v.tokens for v in cal.variations)} benign tokens, decision from "
        f"{cal.tokens_needed()} tokens"
    )


@app.command()
def verify(
    traces: Annotated[Path, typer.Argument(help="JSONL of traces (POST /v1/traces JSON).")],
    model: Annotated[Path, typer.Option(help="The claimed checkpoint (local directory).")],
    calibration: Annotated[
        Path | None,
        typer.Option(help="Calibration JSON from `calibrate` (default: measure the null now)."),
    ] = None,
    save_calibration: Annotated[
        Path | None, typer.Option(help="Write the calibrations used here (JSON).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    group_by: Annotated[Literal["none", "tag", "engine"], typer.Option()] = "none",
    prompts: Annotated[Path, typer.Option(help="Prompts of a null measured now.")] = PROMPTS_FILE,
    null_prompts: NullPromptsOpt = DEFAULT_NULL_PROMPTS,
    max_new_tokens: NullMaxNewOpt = DEFAULT_NULL_MAX_NEW_TOKENS,
    false_alarm_rate: FalseAlarmOpt = 0.01,
    device: DeviceOpt = None,
    threads: ThreadsOpt = None,
    devices: DevicesOpt = 1,
) -> None:
    """Are these logged tokens consistent with the claimed checkpoint and configuration?

    Exit code 0: consistent; 1: inconsistent; 3: insufficient evidence."""
    from pydantic import ValidationError

    from replay_audit.engine import EnginePool
    from replay_audit.engine.hashing import NoWeightsError
    from replay_audit.replays.domain import LoggedTrace
    from replay_audit.stats.verification import CALIBRATION_VERSION, Calibration
    from replay_audit.traces.schemas import TraceCreate
    from replay_audit.verifications.domain import (
        cover_platforms,
        group_name,
        platform_label,
        report_json,
    )
    from replay_audit.verifications.run import verify as run_verify
    from replay_audit.verifications.scan import trace_claim

    parsed: list[tuple[str, LoggedTrace, str]] = []
    platforms: list[str] = []
    for n, row in _read_jsonl(traces):
        try:
            tr = TraceCreate.model_validate(row)
        except ValidationError as e:
            err = e.errors()[0]
            fail(f"{traces}:{n}: not a valid trace: {'.'.join(map(str, err['loc']))}: {err['msg']}")
        logged = LoggedTrace.from_json(tr.model_dump())
        group = {"tag": ",".join(sorted(tr.tags)) or "untagged", "engine": logged.engine_name}
        parsed.append((tr.external_id or f"line {n}", logged, group.get(group_by, "all")))
        gpu = tr.config.gpu.name if tr.config.gpu is not None else None
        platforms.append(platform_label(tr.config.device, gpu))
    if not parsed:
        fail(f"{traces} holds no trace")
    pool = EnginePool(device=device, threads=_threads(threads), devices=devices)
    try:
        sha = pool.weights_sha256(model)
    except NoWeightsError as e:
        fail(e.message)
    for name, logged, _ in parsed:
        if logged.weights_sha256 != sha:
            fail(
                f"trace {name} claims weights_sha256 {logged.weights_sha256}, but {model} has "
                f"{sha}: verify against the checkpoint the traces claim"
            )
    given: list[Calibration] = []
    if calibration is not None:
        try:
            data = json.loads(calibration.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            fail(f"cannot read {calibration}: {e}")
        given = [Calibration.from_json(c) for c in (data if isinstance(data, list) else [data])]
        if any(c.version < 2 for c in given):
            typer.echo(
                f"note: {calibration} holds a calibration of an older method (thresholds from "
                "the benign variations' pooled traces, which a noisier variation can trip); "
                "measure it again with --save-calibration",
                err=True,
            )
        elif any(c.version < CALIBRATION_VERSION for c in given):
            typer.echo(
                f"note: {calibration} holds a calibration of an older method (the tie band "
                "decides at every budget, where a null's few out-of-band tokens can set a "
                "threshold that honest groups trip at large budgets; a new one chooses the "
                "decision per budget on held-out traces); measure it again with "
                "--save-calibration",
                err=True,
            )

    def calibration_for(claim: Claim) -> Calibration:
        for c in given:
            if c.claim == claim and c.weights_sha256 == sha:
                return c
        if calibration is not None:
            fail(f"{calibration} has no null of {sha[:12]}... for the claim {claim}")
        typer.echo(f"measuring the benign null of {claim} on this machine...", err=True)
        return _measure(
            model, claim, prompts, null_prompts, max_new_tokens, pool, device, false_alarm_rate
        )

    result = run_verify(
        [p[1] for p in parsed],
        model,
        pool,
        calibration_for,
        names=[p[0] for p in parsed],
        group_of=[p[2] for p in parsed],
    )
    if save_calibration is not None:
        cals = [c.to_json() for c in result.calibrations]
        save_calibration.write_text(json.dumps(cals, indent=1), encoding="utf-8")
    by_group: dict[str, list[str]] = {}
    for (_, trace, label), where in zip(parsed, platforms, strict=True):
        by_group.setdefault(group_name(label, trace_claim(trace)), []).append(where)
    scanning = _scanning_platform(model, device, pool)
    groups = cover_platforms(
        result.groups, by_group, platform_label(scanning["device"], scanning["gpu_name"])
    )
    report = report_json(groups, result.evidence, result.arms)
    report["scanning_platform"] = scanning
    report["claimed_platforms"] = sorted(set(platforms))
    if as_json:
        typer.echo(json.dumps(report, allow_nan=False))
    else:
        _print(report)
    raise typer.Exit(code={"consistent": 0, "inconsistent": 1}.get(report["verdict"], 3))


def _scanning_platform(model: Path, device: str | None, pool: EnginePool) -> PlatformKey:
    """This machine as a calibration names its platform (`null.platform_key`)."""
    import torch

    from replay_audit.screenings.sweep.worker import TorchFacts
    from replay_audit.verifications.null import platform_key

    facts = TorchFacts(model, device, devices=pool.devices)
    return platform_key(facts.platform(), str(torch.__version__))


def _print(report: dict[str, Any]) -> None:
    typer.echo(f"verdict: {report['verdict']} ({counted(report['tokens'], 'token')})")
    for g in report["groups"]:
        typer.echo(
            f"  {g['group']}: {g['verdict']}  {g['statistic']} {g['score']:.4g} vs threshold "
            f"{g['threshold']:.4g} at {counted(g['budget'], 'token')} (false-alarm rate "
            f"{g['false_alarm_rate']:.0%}); {counted(g['tokens'], 'token')} in "
            f"{counted(g['traces'], 'trace')}, "
            f"{g['fraction_outside_tie_band']:.2%} outside the tie band"
        )
        if g["verdict"] == "inconsistent":
            typer.echo(
                f"    effect size {g['effect_size']:.4g}; closest benign configuration "
                f"{g['closest_benign']} ({g['closest_benign_score']:.4g})"
            )
        if g["verdict"] == "insufficient":
            typer.echo(
                f"    {g['more_tokens']} more tokens needed (decision from {g['tokens_needed']})"
            )
        if g.get("decided_by") and g.get("decision", "outside_tie_band") != "outside_tie_band":
            typer.echo(f"    decided by {g['decided_by']} (rule {g['decision']})")
        if g.get("logged_platforms"):
            covered = {True: "covers", False: "does NOT cover", None: "may not cover"}
            typer.echo(
                f"    logged on {', '.join(g['logged_platforms'])}; the null, measured on "
                f"{g['null_platform']}, {covered[g.get('null_covers_platform')]} that pair"
            )
        if g["sampled"]:
            typer.echo(f"    {g['sampled']} sampled traces set apart (not verified)")
        for note in g["notes"]:
            typer.echo(f"    note: {note}")
