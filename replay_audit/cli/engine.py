"""Engine commands, no server needed: `hash-model`, `generate`, `replay`.

Torch is imported inside the commands that need it, so `replay-audit --help` and `hash-model`
stay fast and torch-free.
"""

from __future__ import annotations

import atexit
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from replay_audit.cli.database import fail
from replay_audit.cli.root import app, option
from replay_audit.config import Settings, get_settings
from replay_audit.formats import (
    CONTROL_FRACTION,
    CONTROL_SEED,
    DECODE_WINDOW,
    FLAGGED_FRACTION,
    SCAN_FLAG_ULPS,
    TOP_K,
    BodyDType,
    CacheKind,
    HeadDType,
    InterventionKind,
    Mode,
    SingleStepKind,
)
from replay_audit.json_value import JsonObject, as_str
from replay_audit.queue.route import MAX_TP_DEGREE
from replay_audit.traces.schemas import MAX_BATCH_ROWS
from replay_audit.words import counted

if TYPE_CHECKING:
    from replay_audit.engine import Target
    from replay_audit.engine.generate import TraceGenerator
    from replay_audit.engine.protocol import LogitsProcessors, SamplingRecipe
    from replay_audit.replays.offline import OfflinePlan, OfflineResult
    from replay_audit.stats.report import (
        ComparisonReport,
        EstimateRead,
        RunStatistics,
        ScreeningReport,
    )


def _threads(threads: int | None) -> int | None:
    """--threads, else the setting REPLAY_AUDIT_TORCH_THREADS (None: torch's default)."""
    return get_settings().torch_threads if threads is None else threads


def _read_jsonl(path: Path) -> Iterator[tuple[int, JsonObject]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            fail(f"{path}:{n}: not JSON ({e.msg})")
        if not isinstance(row, dict):
            fail(f"{path}:{n}: each line must be a JSON object")
        yield n, row


def _progress(spinner: bool = False) -> Any:
    """A transient progress display on stderr: a bar with its rate and the time left, or a
    spinner where the total is unknown."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    description = "[progress.description]{task.description}"
    rate = (_rate_column(), TextColumn("left"), TimeRemainingColumn())
    return Progress(
        *((SpinnerColumn(), description) if spinner else (description, BarColumn())),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        *(() if spinner else rate),
        console=Console(stderr=True),
        transient=True,
    )


def _rate_column() -> Any:
    """A column of items a second, once rich has measured a rate (blank before)."""
    from rich.progress import ProgressColumn, Task
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task: Task) -> Text:
            return Text(f"{task.speed:.3g}/s" if task.speed else "")

    return Rate()


def _loading(what: str) -> Any:
    """A spinner on stderr while `what` loads (a checkpoint on a CPU takes minutes)."""
    from rich.console import Console

    return Console(stderr=True).status(f"loading {what}...")


@app.command("hash-model")
def hash_model(
    model_dir: Annotated[Path, typer.Argument(help="Checkpoint directory (*.safetensors).")],
) -> None:
    """Print the checkpoint's weights_sha256 (docs/weights-sha256.md gives the rule)."""
    from replay_audit.engine.hashing import NoWeightsError, weights_sha256

    try:
        typer.echo(weights_sha256(model_dir))
    except NoWeightsError as e:
        fail(e.message)


@app.command()
def generate(
    model: Annotated[Path, typer.Option(help="Local Hugging Face checkpoint directory.")],
    prompts: Annotated[
        Path,
        typer.Option(
            help='JSONL of {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]} '
            "(chat: rendered with the checkpoint's chat template)."
        ),
    ],
    out: Annotated[Path, typer.Option(help="Where to write the traces (JSONL).")],
    dtype: Annotated[BodyDType, typer.Option()] = "bf16",
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    top_k: Annotated[int, typer.Option(min=1, max=20, help="Top-k logged per step.")] = 5,
    attn_kernel: Annotated[str | None, typer.Option(help="eager, sdpa, ...")] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda if any).")] = None,
    tag: Annotated[list[str] | None, typer.Option(help="Tag for every trace (repeatable).")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N prompts.")] = None,
    model_name: Annotated[str | None, typer.Option(help="model.name (default: dir name).")] = None,
    threads: Annotated[
        int | None,
        typer.Option(min=1, help="torch CPU threads (default: REPLAY_AUDIT_TORCH_THREADS)."),
    ] = None,
    repetition_penalty: Annotated[
        float | None, typer.Option(min=0.0, help="generate()'s repetition_penalty.")
    ] = None,
    no_repeat_ngram_size: Annotated[
        int | None, typer.Option(min=0, help="generate()'s no_repeat_ngram_size.")
    ] = None,
    min_new_tokens: Annotated[
        int | None, typer.Option(min=0, help="generate()'s min_new_tokens.")
    ] = None,
    logit_bias: Annotated[
        list[str] | None,
        typer.Option(help="ID=BIAS added to a token's logit (repeatable; a sequence_bias)."),
    ] = None,
    bad_words_ids: Annotated[
        list[str] | None,
        typer.Option(help="Comma-separated ids never generated in a row (repeatable)."),
    ] = None,
    tp: Annotated[
        int,
        typer.Option(
            "--tp",
            min=1,
            max=MAX_TP_DEGREE,
            help="Tensor-parallel degree: k > 1 starts k processes (GPUs cuda:0..k-1, or CPU "
            "processes with gloo where there is no GPU), each loading the checkpoint with "
            "transformers' tp_plan=auto; the traces record tp_degree k. Needs accelerate.",
        ),
    ] = 1,
    batch_size: Annotated[
        int,
        typer.Option(
            min=1,
            max=MAX_BATCH_ROWS,
            help="Prompts per generate() call, left-padded to the longest under an attention "
            "mask, as generate() takes a batch; each trace records its row's place "
            "(decoding.batch), which a replay at that batch size follows.",
        ),
    ] = 1,
    temperature: Annotated[
        float | None,
        typer.Option(
            max=100.0,
            help="Sample at this temperature (above 0) (generate(do_sample=True) after "
            "torch.manual_seed(--seed + the batch's first row)); each trace records its seeded "
            "sampler (decoding.sampling), which `verify` reproduces. Default: greedy.",
        ),
    ] = None,
    sample_top_k: Annotated[
        int, typer.Option("--sample-top-k", min=0, help="Top-k of the sampler (0: off).")
    ] = 0,
    top_p: Annotated[
        float, typer.Option(max=1.0, help="Top-p of the sampler (above 0, 1: off).")
    ] = 1.0,
    seed: Annotated[int, typer.Option(min=0, help="The sampler's base seed.")] = 0,
) -> None:
    """Log generations with transformers' own generate(), as POST /v1/traces JSON: greedy, or
    seeded sampling with --temperature; with its logits processors where asked (recorded in
    each trace's `decoding.logits_processors`, which its replays apply)."""
    from replay_audit.engine.hashing import NoWeightsError, safetensors_files

    processors = _generate_processors(
        repetition_penalty, no_repeat_ngram_size, min_new_tokens, logit_bias, bad_words_ids
    )
    sampling = None
    if temperature is not None and temperature <= 0:
        fail("--temperature must be above 0 (greedy: leave it out)")
    if top_p <= 0:
        fail("--top-p must be above 0")
    if temperature is not None:
        from replay_audit.engine.protocol import SamplingRecipe

        sampling = SamplingRecipe("transformers", temperature, sample_top_k, top_p)
    elif sample_top_k or top_p < 1.0:
        fail("--sample-top-k and --top-p shape sampling: give --temperature too")
    try:
        safetensors_files(model)  # a typo fails here, not as a hub error after torch loads
    except NoWeightsError as e:
        fail(e.message)
    rows = []
    for n, row in _read_jsonl(prompts):
        if "messages" in row:
            messages = row["messages"]
            texts = isinstance(messages, list) and all(
                isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))
                for m in messages
            )
            if not messages or not texts:
                fail(f"{prompts}:{n}: messages: a list of {{role, content}} strings is required")
        elif not isinstance(row.get("prompt"), str):
            fail(f"{prompts}:{n}: prompt: a string (or messages: a list) is required")
        rows.append(row)
    rows = rows[:limit] if limit else rows
    from replay_audit.engine.generate import TraceGenerator
    from replay_audit.exceptions import ReplayAuditError

    try:
        with _loading(f"{model} in {dtype}"):
            gen = TraceGenerator(
                model,
                dtype=dtype,
                attn_kernel=attn_kernel,
                device=device,
                model_name=model_name,
                threads=_threads(threads),
                tp_degree=tp,
            )
    except ReplayAuditError as e:
        fail(e.message)
    with gen:  # at --tp k, the ranks stop with it
        if any("messages" in r for r in rows) and not getattr(gen.tokenizer, "chat_template", None):
            fail(f"{prompts} has chat messages, but {model}'s tokenizer has no chat template")
        n = _write_traces(
            gen,
            rows,
            out,
            max_new_tokens,
            top_k,
            tag or [],
            processors,
            batch_size,
            sampling=sampling,
            seed=seed,
        )
    tp_text = f", TP {tp}" if tp > 1 else ""
    typer.echo(
        f"wrote {counted(n, 'trace')} to {out} ({dtype}, {gen.config['attn_kernel']}, "
        f"{gen.config['device']}{tp_text}, weights_sha256 {gen.weights_sha256[:12]}...)"
    )


def _write_traces(
    gen: TraceGenerator,
    rows: list[JsonObject],
    out: Path,
    max_new_tokens: int,
    top_k: int,
    tags: list[str],
    processors: LogitsProcessors,
    batch_size: int,
    *,
    sampling: SamplingRecipe | None = None,
    seed: int = 0,
) -> int:
    """Write `generate`'s traces of `rows` to `out`, `batch_size` rows per generate() call
    (sampled with `sampling`: seeded `seed` + the call's first row)."""
    from replay_audit.traces.schemas import TraceCreate

    n = 0
    with out.open("w", encoding="utf-8") as f, _progress() as bar:
        task = bar.add_task("generate", total=len(rows))
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            prompts = [
                (
                    None if r.get("id") is None else str(r.get("id")),
                    as_str(r["prompt"]) if r.get("messages") is None else r["messages"],
                )
                for r in batch
            ]
            for trace in gen.trace_batch(
                prompts,  # type: ignore[arg-type]  # messages checked above
                max_new_tokens=max_new_tokens,
                top_k=top_k,
                tags=tags,
                processors=processors,
                sampling=sampling,
                seed=seed + start,
            ):
                # Exactly what POST /v1/traces accepts (validated here, at the CLI's edge).
                trace = TraceCreate.model_validate(trace).model_dump(mode="json")
                f.write(json.dumps(trace, allow_nan=False) + "\n")
                n += 1
            bar.advance(task, len(batch))
    return n


def _generate_processors(
    repetition_penalty: float | None,
    no_repeat_ngram_size: int | None,
    min_new_tokens: int | None,
    logit_bias: list[str] | None,
    bad_words_ids: list[str] | None,
) -> LogitsProcessors:
    """`generate`'s logits processors from its flags (exit 2 naming a bad flag)."""
    from replay_audit.engine.protocol import LogitsProcessors

    if repetition_penalty is not None and repetition_penalty <= 0:
        fail("--repetition-penalty must be above 0")
    bias: list[tuple[int, float]] = []
    for item in logit_bias or []:
        tid, sep, value = item.partition("=")
        try:
            bias.append((int(tid), float(value)))
        except ValueError:
            sep = ""
        if not sep:
            fail(f"--logit-bias {item!r}: expected ID=BIAS, e.g. 50256=-100")
    words: list[tuple[int, ...]] = []
    for item in bad_words_ids or []:
        try:
            words.append(tuple(int(t) for t in item.split(",")))
        except ValueError:
            fail(f"--bad-words-ids {item!r}: expected comma-separated token ids")
    return LogitsProcessors(
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
        min_new_tokens=min_new_tokens,
        logit_bias=tuple(sorted(dict(bias).items())),
        bad_words_ids=tuple(words),
    )


_TP_HELP = (
    "The tensor-parallel degree to replay at (default: each trace's logged one). A degree k > 1 "
    "starts k processes (GPUs cuda:0..k-1, or CPU processes with gloo where there is no GPU; "
    "needs accelerate); a result at another degree than the trace's logged one says so."
)
_KV_HELP = (
    "The decode path: piecewise (the default: bitwise as generate(), CUDA graphs around the "
    "attention on a GPU) or compiled (torch.compile + CUDA graph: faster, may flip near-ties)."
)
_MODE_HELP = "Default: scan_then_decode from REPLAY_AUDIT_LARGE_RUN_TRACES traces, decode below."
_RESUME_HELP = (
    "Keep the results already in --out and replay only the traces missing there (after a "
    "Ctrl-C). Without it, --out is overwritten."
)
_REPRODUCE_HELP = (
    "Reproduce before comparing: replay each trace in its own logged configuration too (the "
    "reproduction check, comparison 1), and judge a trace that does not reproduce against that "
    "replay rather than its logged tokens. --no-reproduce: against the logged tokens only."
)
TracesArg = Annotated[Path, typer.Argument(help="JSONL of traces (POST /v1/traces JSON).")]
ModelOpt = Annotated[Path, typer.Option(help="Local Hugging Face checkpoint directory.")]
OutOpt = Annotated[Path, typer.Option(help="Where to write the results (JSONL).")]
HeadOpt = Annotated[HeadDType | None, typer.Option(help="Default: dtype.")]
KernelOpt = Annotated[str | None, typer.Option(help="Default: each trace's own.")]
TauOpt = Annotated[float | None, typer.Option(help="Gate threshold (default 1e-3).")]
TauUlpsOpt = Annotated[float | None, typer.Option(help="Gate threshold in ulps.")]
ModeOpt = Annotated[Mode | None, typer.Option(help=_MODE_HELP)]
TpOpt = Annotated[int | None, typer.Option(min=1, max=MAX_TP_DEGREE, help=_TP_HELP)]
DeviceOpt = Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda if any).")]
KvOpt = Annotated[CacheKind | None, typer.Option(help=_KV_HELP)]
_PROBE_HELP = (
    "The single-step probe at t*: teacher_forced (row t* of each arm's forward over prompt and "
    "arm A's tokens, the scan's own where it ran) or from_scratch (a forward over y<t* alone)."
)
ProbeOpt = Annotated[SingleStepKind, typer.Option(help=_PROBE_HELP)]
SummaryOpt = Annotated[Path | None, typer.Option(help="Also write the summary here.")]
ThreadsOpt = Annotated[int | None, typer.Option(min=1, help="torch CPU threads.")]


@app.command()
def replay(
    traces: TracesArg,
    model: ModelOpt,
    dtype: Annotated[BodyDType, typer.Option(help="Body dtype to replay in.")],
    out: OutOpt,
    lm_head_dtype: HeadOpt = None,
    attn_kernel: KernelOpt = None,
    intervention: Annotated[InterventionKind, typer.Option()] = "none",
    tau: TauOpt = None,
    tau_ulps: TauUlpsOpt = None,
    top_k_b: Annotated[int, typer.Option(min=1, help="K of intervention B.")] = 8,
    mode: ModeOpt = None,
    control_fraction: Annotated[float, option(CONTROL_FRACTION)] = CONTROL_FRACTION.default,
    control_seed: Annotated[int, option(CONTROL_SEED)] = CONTROL_SEED.default,
    flagged_fraction: Annotated[float | None, option(FLAGGED_FRACTION)] = None,
    scan_flag_ulps: Annotated[float | None, option(SCAN_FLAG_ULPS)] = None,
    decode_window: Annotated[int | None, option(DECODE_WINDOW)] = None,
    batch_size: Annotated[int, typer.Option(min=1)] = 1,
    tp_degree: TpOpt = None,
    device: DeviceOpt = None,
    top_k: Annotated[int, option(TOP_K)] = TOP_K.default,
    extractor: Annotated[str | None, typer.Option(help="Answer extractor, e.g. gsm8k.")] = None,
    kv_cache: KvOpt = None,
    summary_json: SummaryOpt = None,
    threads: ThreadsOpt = None,
    resume: Annotated[bool, typer.Option(help=_RESUME_HELP)] = False,
    reproduce: Annotated[bool, typer.Option(help=_REPRODUCE_HELP)] = True,
    single_step: ProbeOpt = "teacher_forced",
) -> None:
    """Replay each trace in the target configuration and diff it with the logged output (its
    own logged configuration replayed first: reproduce before compare). Ctrl-C stops after the
    trace being replayed: the results so far stay in --out, their summary is printed (and
    written to --summary-json), and --resume goes on from there."""
    plan = _replay_plan(
        dtype, lm_head_dtype, attn_kernel, intervention, tau, tau_ulps, top_k_b, mode,
        control_fraction, control_seed, scan_flag_ulps, decode_window, batch_size, tp_degree,
        top_k, extractor, reproduce, single_step, flagged_fraction,
    )  # fmt: skip
    from replay_audit.cli.shutdown import signals_deferred
    from replay_audit.engine import EnginePool
    from replay_audit.exceptions import ReplayAuditError
    from replay_audit.replays.offline import parse_traces, replay_file

    try:
        parsed = parse_traces(traces, _read_jsonl(traces))
        devices = max([tp_degree or 1, *(p.logged.tp_degree or 1 for p in parsed)])
        pool = EnginePool(device=device, cache=kv_cache, threads=_threads(threads), devices=devices)
        atexit.register(pool.close)  # a tensor-parallel group's ranks stop with the command
        with _progress() as bar:
            task = bar.add_task(f"replay in {dtype}", total=len(parsed))
            result = replay_file(
                parsed, model, pool, plan, out, resume=resume, deferred=signals_deferred,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )  # fmt: skip
    except ReplayAuditError as e:
        named = str(traces) in e.message or str(out) in e.message  # the file and line at fault
        fail(e.message if named else f"{traces}: {e.message}")
    _report_replay(result, plan, out, summary_json)


def _replay_plan(
    dtype: BodyDType,
    lm_head_dtype: HeadDType | None,
    attn_kernel: str | None,
    intervention: InterventionKind,
    tau: float | None,
    tau_ulps: float | None,
    top_k_b: int,
    mode: Mode | None,
    control_fraction: float,
    control_seed: int,
    scan_flag_ulps: float | None,
    decode_window: int | None,
    batch_size: int,
    tp_degree: int | None,
    top_k: int,
    extractor: str | None,
    reproduce: bool,
    single_step: SingleStepKind,
    flagged_fraction: float | None = None,
) -> OfflinePlan:
    """`replay`'s options as an offline plan (exit 2 naming a bad option): the command keeps
    to parsing, printing and signals (docs/architecture.md)."""
    from replay_audit.engine import Intervention, Target
    from replay_audit.replays.domain import ControlSample, RunTarget
    from replay_audit.replays.offline import OfflinePlan

    if scan_flag_ulps is not None and not math.isfinite(scan_flag_ulps):
        fail("--scan-flag-ulps must be a finite number")
    if flagged_fraction is not None and not 0.0 < flagged_fraction <= 1.0:  # NaN too
        fail("--flagged-fraction must be more than 0 and at most 1")
    if decode_window is not None and mode == "scan":
        fail("--decode-window: mode scan decodes nothing to cut")
    if tau is not None and tau_ulps is not None:
        fail("give --tau or --tau-ulps, not both")
    settings = Settings()
    flag = settings.scan_flag_ulps if scan_flag_ulps is None else scan_flag_ulps
    iv = Intervention(intervention, 1e-3 if tau is None else tau, tau_ulps, top_k_b)
    return OfflinePlan(
        RunTarget(Target(dtype, lm_head_dtype, attn_kernel, batch_size, iv), tp_degree=tp_degree),
        mode,
        ControlSample(control_fraction, control_seed, flag),
        decode_window,
        top_k,
        extractor,
        reproduce,
        settings.scan_token_budget,
        settings.large_run_traces,
        settings.large_run_decode_window,
        single_step,
        flagged_fraction,
        settings.large_run_flagged_fraction,
    )


def _report_replay(
    result: OfflineResult, plan: OfflinePlan, out: Path, summary_json: Path | None
) -> None:
    """`replay`'s notes, summary (and --summary-json), and an interrupted replay's exit code."""
    target = plan.target.target
    assert target is not None
    for note in result.notes:
        typer.echo(note, err=True)
    stats = result.statistics
    if stats is not None:
        main = stats.comparisons[0]
        _print_summary(main, target)
        for line in reproduction_lines(stats):
            typer.echo(line)
        if result.processors:  # what ran besides the target: each result's resolved arm has them
            typer.echo(
                f"{counted(result.processed, 'trace')} replayed with their logits processors "
                f"({'; '.join(result.processors)})"
            )
        if summary_json is not None:
            summary = {
                **main.model_dump(mode="json"),
                "target": target.to_dict(),
                "mode": result.mode,
                "traces": result.traces,
                "interrupted": result.interrupted,
                "reproduction": (
                    stats.engine_reproduction.model_dump(mode="json")
                    if stats.engine_reproduction is not None
                    else None
                ),
                "comparisons": [c.model_dump(mode="json") for c in stats.comparisons],
            }
            summary_json.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    if result.interrupted:
        typer.secho(
            f"interrupted: {counted(result.written, 'trace')} written to {out} "
            f"({result.traces - result.written} of {counted(result.traces, 'trace')} left; "
            "run again with --resume to replay them)",
            err=True,
            fg=typer.colors.YELLOW,
        )
        raise typer.Exit(130)
    typer.echo(f"wrote the results of {counted(result.written, 'trace')} to {out}")


def reproduction_lines(stats: RunStatistics) -> list[str]:
    """How many traces reproduced in their own logged configuration, and what the target's
    comparison was judged against (`baseline`): for `replay` and `demo` alike."""
    r = stats.engine_reproduction
    if r is None:
        return []
    p = r.reproduced
    engines = ", ".join(f"{k}: {v}" for k, v in r.engines.items())
    scanned = f"; {r.scanned_only} of them by the scan alone" if r.scanned_only else ""
    lines = [
        f"reproduced in their own logged configuration: {p.successes} of "
        f"{counted(p.n, 'trace')} ({engines}){scanned}"
    ]
    other = {k: v for k, v in stats.comparisons[0].baselines.items() if k != "logged"}
    if other:
        lines.append(
            "judged against the logged configuration replayed here, not the logged tokens: "
            + ", ".join(f"{v} {k}" for k, v in other.items())
        )
    return lines


def _fmt(x: float | int | str | None, spec: str = "") -> str:
    return "-" if x is None else format(x, spec)


def _rate(rate: float | None, triggers: int | None, steps: int | None) -> str:
    return f"{_fmt(rate, '.2%')} ({_fmt(triggers)}/{_fmt(steps)})"


def _gate_rows(c: ComparisonReport) -> list[tuple[str, str]]:
    """Both arms' gate trigger rates where both ran here, else arm B's."""
    b = ("trigger rate, arm B", _rate(c.trigger_rate, c.gate_triggers, c.steps))
    if c.steps_a is None:  # arm A is the logged tokens: no gate of ours ran on it
        return [b]
    return [("trigger rate, arm A", _rate(c.trigger_rate_a, c.gate_triggers_a, c.steps_a)), b]


def _sar_text(c: ComparisonReport) -> str:
    """SAR with its counts, or why there is none (a scan has no replay text)."""
    if c.sar is None:
        return c.sar_note or "- (no answers extracted)"
    text = (
        f"{_fmt(c.sar.estimate, '.1%')} ({c.sar.successes}/{c.sar.n}; "
        f"{c.sar_neither_answered} with no answer in either arm)"
    )
    return f"{text}; {c.sar_note}" if c.sar_note else text


def _print_summary(c: ComparisonReport, target: Target) -> None:
    """The comparison's table, as the API serves the run statistics."""
    from rich.console import Console
    from rich.table import Table

    iv = target.intervention
    gate = f"tau_ulps={iv.tau_ulps}" if iv.tau_ulps is not None else f"tau={iv.tau}"
    title = (
        f"replay in {target.dtype}"
        + (f" (lm_head {target.lm_head_dtype})" if target.lm_head_dtype else "")
        + f", intervention {iv.kind} ({gate}), mode {c.mode}"
    )
    table = Table(title=title, show_header=True)
    table.add_column("measure")
    table.add_column("value", justify="right")
    ear, ts = c.ear, c.first_divergence_step
    rows = [
        ("traces (n)", str(c.n)),
        (
            "exact agreement (EAR)",
            f"{_fmt(ear.estimate, '.1%')} [{ear.low:.1%}, {ear.high:.1%}] "
            f"({ear.successes}/{ear.n})",
        ),
        *_gate_rows(c),
        ("mean gap", _fmt(c.mean_gap, ".4g")),
        (
            "t* min / median / max",
            " / ".join(_fmt(getattr(ts, k) if ts else None, "g") for k in ("min", "median", "max")),
        ),
    ]
    rows += [(f"category {k}", str(v.successes)) for k, v in c.categories.items()]
    rows.append(("answer agreement (SAR)", _sar_text(c)))
    if c.decode_window is not None:
        cut = f"t* + {c.decode_window}: {c.window_cut} of {c.ok} results cut there"
        rows.append(("decode window", f"{cut} (no SAR or length difference for them)"))
    if c.screening is not None:
        rows += _screening_rows(c.screening)
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


def _screening_rows(sc: ScreeningReport) -> list[tuple[str, str]]:
    """A scan-then-decode summary: what was scanned and decoded, and the scan's miss rate."""

    def est(e: EstimateRead) -> str:
        return f"{_fmt(e.estimate, '.1%')} [{_fmt(e.low, '.1%')}, {_fmt(e.high, '.1%')}]"

    flag = sc.scan_flag_ulps
    mismatch = sc.decoded_by_reason.get("mismatch", sc.flagged)
    near = sc.decoded_by_reason.get("near_tie", sc.near_tie)
    rows = [
        ("scanned", str(sc.scanned)),
        (
            "decoded (mismatch + near-tie + control)",
            f"{sc.decoded} ({mismatch} + {near} + {sc.control})",
        ),
        (
            "near-tie flag",
            "off"
            if flag is None or flag < 0
            else f"<= {_fmt(flag)} ulps ({sc.near_tie_diverged} of {near} decoded diverged)",
        ),
        ("only scanned (not in EAR)", str(sc.scanned_only)),
        (
            "control sample",
            f"{sc.control} ({sc.control_diverged} diverged; fraction "
            f"{_fmt(sc.control_fraction)}, seed {_fmt(sc.control_seed)})",
        ),
        ("estimated miss rate", est(sc.miss_rate)),
        ("estimated EAR, all scanned", est(sc.ear)),
    ]
    if sc.flagged_decoded is not None and sc.false_flag_rate is not None:
        ff = sc.false_flag_rate
        rows.insert(
            -2,
            (
                "flagged sample",
                f"{sc.flagged_decoded} of {sc.flagged} (fraction {_fmt(sc.flagged_fraction)}; "
                f"false flags {_fmt(ff.estimate, '.1%')} [{ff.low:.1%}, {ff.high:.1%}], "
                f"{sc.false_flags}/{ff.n}; {sc.flagged_scanned} kept as scanned)",
            ),
        )
    nd = sc.near_tie_divergence
    if sc.near_tie_decoded is not None and nd is not None and sc.near_tie:
        rows.insert(
            -2,
            (
                "near-tie sample",
                f"{sc.near_tie_decoded} of {sc.near_tie} (diverged {_fmt(nd.estimate, '.1%')} "
                f"[{nd.low:.1%}, {nd.high:.1%}], {sc.near_tie_diverged}/{nd.n}; "
                f"{sc.near_tie_scanned} only scanned)",
            ),
        )
    return rows
