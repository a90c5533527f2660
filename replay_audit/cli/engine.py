"""Engine commands, no server needed: `hash-model`, `generate`, `replay`.

Torch is imported inside the commands that need it, so `replay-audit --help` and `hash-model`
stay fast and torch-free.
"""

from __future__ import annotations

import atexit
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from replay_audit.cli.root import app, option
from replay_audit.formats import (
    CONTROL_FRACTION,
    CONTROL_SEED,
    DECODE_WINDOW,
    EXTRA_PROCESSORS,
    SCAN_FLAG_ULPS,
    TOP_K,
    BodyDType,
    CacheKind,
    HeadDType,
    InterventionKind,
    Mode,
    processors_not_applied,
)
from replay_audit.json_value import JsonObject, as_str
from replay_audit.queue.route import MAX_TP_DEGREE
from replay_audit.words import counted

if TYPE_CHECKING:
    from replay_audit.engine import Target
    from replay_audit.engine.generate import TraceGenerator
    from replay_audit.engine.protocol import LogitsProcessors
    from replay_audit.stats.report import ComparisonReport, EstimateRead, ScreeningReport


def _fail(message: str) -> NoReturn:
    """A clear message on stderr and exit code 2 (no traceback)."""
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code=2)


def _threads(threads: int | None) -> int | None:
    """--threads, else the setting REPLAY_AUDIT_TORCH_THREADS (None: torch's default)."""
    if threads is not None:
        return threads
    from replay_audit.config import get_settings

    return get_settings().torch_threads


def _read_jsonl(path: Path) -> Iterator[tuple[int, JsonObject]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        _fail(f"cannot read {path}: {e.strerror}")
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            _fail(f"{path}:{n}: not JSON ({e.msg})")
        if not isinstance(row, dict):
            _fail(f"{path}:{n}: each line must be a JSON object")
        yield n, row


def _progress() -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )


@app.command("hash-model")
def hash_model(
    model_dir: Annotated[Path, typer.Argument(help="Checkpoint directory (*.safetensors).")],
) -> None:
    """Print the checkpoint's weights_sha256 (docs/weights-sha256.md gives the rule)."""
    from replay_audit.engine.hashing import NoWeightsError, weights_sha256

    try:
        typer.echo(weights_sha256(model_dir))
    except NoWeightsError as e:
        _fail(e.message)


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
) -> None:
    """Log greedy generations with transformers' own generate(), as POST /v1/traces JSON,
    with its logits processors where asked (recorded in each trace's
    `decoding.logits_processors`, which its replays apply)."""
    from replay_audit.engine.hashing import NoWeightsError, safetensors_files

    processors = _generate_processors(
        repetition_penalty, no_repeat_ngram_size, min_new_tokens, logit_bias, bad_words_ids
    )
    try:
        safetensors_files(model)  # a typo fails here, not as a hub error after torch loads
    except NoWeightsError as e:
        _fail(e.message)
    rows = []
    for n, row in _read_jsonl(prompts):
        messages = row.get("messages")
        if "messages" in row:
            strings = ("role", "content")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(
                    isinstance(m, dict) and all(isinstance(m.get(k), str) for k in strings)
                    for m in messages
                )
            ):
                _fail(f"{prompts}:{n}: messages: a list of {{role, content}} strings is required")
        elif not isinstance(row.get("prompt"), str):
            _fail(f"{prompts}:{n}: prompt: a string (or messages: a list) is required")
        rows.append(row)
    rows = rows[:limit] if limit else rows
    from replay_audit.engine.generate import TraceGenerator
    from replay_audit.exceptions import ReplayAuditError

    try:
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
        _fail(e.message)
    with gen:  # at --tp k, the ranks stop with it
        if any("messages" in r for r in rows) and not getattr(gen.tokenizer, "chat_template", None):
            _fail(f"{prompts} has chat messages, but {model}'s tokenizer has no chat template")
        n = _write_traces(gen, rows, out, max_new_tokens, top_k, tag or [], processors)
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
) -> int:
    """`generate`'s traces of `rows` (with `processors`), written to `out` as validated
    `TraceCreate` JSON lines."""
    from replay_audit.traces.schemas import TraceCreate

    n = 0
    with out.open("w", encoding="utf-8") as f, _progress() as bar:
        task = bar.add_task("generate", total=len(rows))
        for row in rows:
            pid = row.get("id")
            messages = row.get("messages")
            trace = gen.trace(
                as_str(row["prompt"]) if messages is None else messages,  # type: ignore[arg-type]
                max_new_tokens=max_new_tokens,
                top_k=top_k,
                external_id=None if pid is None else str(pid),
                tags=tags,
                processors=processors,
            )
            # Exactly what POST /v1/traces accepts (validated here, at the CLI's edge).
            trace = TraceCreate.model_validate(trace).model_dump(mode="json")
            f.write(json.dumps(trace, allow_nan=False) + "\n")
            n += 1
            bar.advance(task)
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
        _fail("--repetition-penalty must be above 0")
    bias: list[tuple[int, float]] = []
    for item in logit_bias or []:
        tid, sep, value = item.partition("=")
        try:
            bias.append((int(tid), float(value)))
        except ValueError:
            sep = ""
        if not sep:
            _fail(f"--logit-bias {item!r}: expected ID=BIAS, e.g. 50256=-100")
    words: list[tuple[int, ...]] = []
    for item in bad_words_ids or []:
        try:
            words.append(tuple(int(t) for t in item.split(",")))
        except ValueError:
            _fail(f"--bad-words-ids {item!r}: expected comma-separated token ids")
    return LogitsProcessors(
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
        min_new_tokens=min_new_tokens,
        logit_bias=tuple(sorted(dict(bias).items())),
        bad_words_ids=tuple(words),
    )


@app.command()
def replay(
    traces: Annotated[Path, typer.Argument(help="JSONL of traces (POST /v1/traces JSON).")],
    model: Annotated[Path, typer.Option(help="Local Hugging Face checkpoint directory.")],
    dtype: Annotated[BodyDType, typer.Option(help="Body dtype to replay in.")],
    out: Annotated[Path, typer.Option(help="Where to write one result per trace (JSONL).")],
    lm_head_dtype: Annotated[HeadDType | None, typer.Option(help="Default: dtype.")] = None,
    attn_kernel: Annotated[str | None, typer.Option(help="Default: each trace's own.")] = None,
    intervention: Annotated[InterventionKind, typer.Option()] = "none",
    tau: Annotated[float | None, typer.Option(help="Gate threshold (default 1e-3).")] = None,
    tau_ulps: Annotated[float | None, typer.Option(help="Gate threshold in ulps.")] = None,
    top_k_b: Annotated[int, typer.Option(min=1, help="K of intervention B.")] = 8,
    mode: Annotated[
        Mode | None,
        typer.Option(
            help="Default: scan_then_decode from REPLAY_AUDIT_LARGE_RUN_TRACES traces, "
            "decode below."
        ),
    ] = None,
    control_fraction: Annotated[float, option(CONTROL_FRACTION)] = CONTROL_FRACTION.default,
    control_seed: Annotated[int, option(CONTROL_SEED)] = CONTROL_SEED.default,
    scan_flag_ulps: Annotated[float | None, option(SCAN_FLAG_ULPS)] = None,
    decode_window: Annotated[int | None, option(DECODE_WINDOW)] = None,
    batch_size: Annotated[int, typer.Option(min=1)] = 1,
    tp_degree: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=MAX_TP_DEGREE,
            help="The tensor-parallel degree to replay at (default: each trace's logged one). "
            "A degree k > 1 starts k processes (GPUs cuda:0..k-1, or CPU processes with gloo "
            "where there is no GPU; needs accelerate); a result at another degree than the "
            "trace's logged one says the degrees differ.",
        ),
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda if any).")] = None,
    top_k: Annotated[int, option(TOP_K)] = TOP_K.default,
    extractor: Annotated[str | None, typer.Option(help="Answer extractor, e.g. gsm8k.")] = None,
    kv_cache: Annotated[
        CacheKind | None,
        typer.Option(
            help="The decode path: piecewise (the default: bitwise as generate(), CUDA graphs "
            "around the attention on a GPU) or compiled (torch.compile + CUDA graph: faster, "
            "may flip near-ties)."
        ),
    ] = None,
    summary_json: Annotated[Path | None, typer.Option(help="Also write the summary here.")] = None,
    threads: Annotated[
        int | None,
        typer.Option(min=1, help="torch CPU threads (default: REPLAY_AUDIT_TORCH_THREADS)."),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            help="Keep the results already in --out and replay only the traces missing there "
            "(after a Ctrl-C). Without it, --out is overwritten."
        ),
    ] = False,
) -> None:
    """Replay each trace in the target configuration and diff it with the logged output.

    Ctrl-C stops after the trace being replayed: the results so far stay in --out, their
    summary is printed (and written to --summary-json), and --resume goes on from there."""
    from pydantic import ValidationError

    from replay_audit.cli.shutdown import signals_deferred
    from replay_audit.config import Settings
    from replay_audit.engine import EnginePool, Intervention, Target
    from replay_audit.engine.hashing import NoWeightsError
    from replay_audit.exceptions import ReplayAuditError
    from replay_audit.replays.domain import (
        SCAN_FLAG_OFF,
        Comparison,
        ControlSample,
        LoggedTrace,
        RunTarget,
        comparison_label,
        resolve_mode,
    )
    from replay_audit.replays.models import ReplayResult
    from replay_audit.replays.pipeline import (
        ReplayItem,
        ReplayOptions,
        check_replayable,
        replay_items,
        scan_items,
    )
    from replay_audit.replays.results import (
        figures,
        figures_from_json,
        result_read,
        result_values,
        token_ids_source,
    )
    from replay_audit.stats.report import ComparisonInput, run_statistics
    from replay_audit.traces.schemas import TraceCreate

    if scan_flag_ulps is not None and not math.isfinite(scan_flag_ulps):
        _fail("--scan-flag-ulps must be a finite number")
    if decode_window is not None and mode == "scan":
        _fail("--decode-window: mode scan decodes nothing to cut")
    flag = Settings().scan_flag_ulps if scan_flag_ulps is None else scan_flag_ulps
    sample = ControlSample(control_fraction, control_seed, flag)
    if tau is not None and tau_ulps is not None:
        _fail("give --tau or --tau-ulps, not both")
    iv = Intervention(
        kind=intervention,
        tau=1e-3 if tau is None else tau,
        tau_ulps=tau_ulps,
        top_k=top_k_b,
    )
    target = Target(dtype, lm_head_dtype, attn_kernel, batch_size, iv)

    # Every line is checked before the checkpoint is hashed or loaded; an error names it.
    parsed: list[tuple[int, TraceCreate, LoggedTrace]] = []
    for n, row in _read_jsonl(traces):
        try:
            tr = TraceCreate.model_validate(row)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            _fail(f"{traces}:{n}: not a valid trace: {where}: {err['msg']}")
        logged = LoggedTrace.from_json(tr.model_dump())
        try:
            check_replayable(logged)
        except ReplayAuditError as e:
            why = processors_not_applied(tr.config.extras.get(EXTRA_PROCESSORS))
            _fail(f"{traces}:{n}: {e.field}: {e.message}{why}")
        parsed.append((n, tr, logged))
    if not parsed:
        _fail(f"{traces} holds no trace")
    # The degrees asked or logged (arm A's single-step re-runs run the logged one): a pool
    # owning that many devices starts a group of processes for the first TP > 1 engine.
    devices = max([tp_degree or 1, *(logged.tp_degree or 1 for _, _, logged in parsed)])
    pool = EnginePool(device=device, cache=kv_cache, threads=_threads(threads), devices=devices)
    atexit.register(pool.close)  # a tensor-parallel group's ranks stop with the command
    try:
        sha = pool.weights_sha256(model)
    except NoWeightsError as e:
        _fail(e.message)
    for n, tr, _ in parsed:
        if tr.model.weights_sha256 != sha:
            _fail(
                f"{traces}:{n}: model.weights_sha256: checkpoint {model} has weights_sha256 "
                f"{sha}, but trace {tr.external_id or '(no external_id)'} was logged with "
                f"{tr.model.weights_sha256}: refusing to replay it against other weights"
            )

    settings = Settings()
    run_mode = resolve_mode(mode, len(parsed), settings.large_run_traces)
    names = [tr.external_id or f"line {n}" for n, tr, _ in parsed]
    done: dict[str, JsonObject] = {}
    if resume:
        done = _results_written(out, names, target, run_mode)
    rows = [
        figures_from_json(done[name], i, tr.external_id)
        for i, (name, (_, tr, _)) in enumerate(zip(names, parsed, strict=True))
        if name in done
    ]
    todo = [i for i, name in enumerate(names) if name not in done]
    # The job's pipeline: the same items, options, batched scans and outcome rule.
    screening = run_mode == "scan_then_decode"
    options = ReplayOptions(
        run_mode,
        top_k,
        sample.flag_ulps if screening else SCAN_FLAG_OFF,
        settings.scan_token_budget,
        check_weights=False,  # checked above, once for all traces
        decode_window=decode_window,
    )
    items = {
        i: ReplayItem(
            parsed[i][2],
            RunTarget(target, tp_degree=tp_degree),
            model,
            control=screening and sample.includes(names[i]),
            extractor=extractor,
        )
        for i in todo
    }
    scans = dict.fromkeys(todo, None)
    if run_mode != "decode" and todo:  # every trace's scan first, several per forward
        batched = scan_items(list(items.values()), pool, options)
        scans = dict(zip(todo, batched.runs, strict=True))
        rate = batched.scanned / batched.seconds if batched.seconds > 0 else 0.0
        typer.echo(
            f"scanned {counted(batched.scanned, 'trace')} in "
            f"{counted(batched.forwards, 'forward')}, "
            f"{batched.seconds:.2f} s ({rate:.1f} traces/s)",
            err=True,
        )
    interrupted = False
    with out.open("a" if resume else "w", encoding="utf-8") as f, _progress() as bar:
        task = bar.add_task(f"replay in {dtype}", total=len(parsed), completed=len(rows))
        try:
            for i, (n, tr, _) in enumerate(parsed):
                name = names[i]
                if name in done:
                    continue
                (r,) = replay_items([items[i]], pool, options, scans=[scans[i]])
                if isinstance(r, ReplayAuditError):
                    _fail(f"{traces}:{n}: " + (f"{r.field}: " if r.field else "") + r.message)
                if isinstance(r, Exception):
                    raise r
                # The same mappings as a stored result: the row, then the API's view of it.
                stored = ReplayResult(trace_id=i, **result_values(0, r))
                ids_source = token_ids_source(tr.config.model_dump())
                read = result_read(stored, name, "offline", token_ids_source=ids_source)
                line = read.model_dump(mode="json", exclude={"run_id", "created_at"})
                text = json.dumps(line, allow_nan=False) + "\n"
                with signals_deferred():  # a Ctrl-C lands after the line and its count
                    f.write(text)
                    f.flush()
                    rows.append(figures(stored, name, tr.external_id))
                bar.advance(task)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (cli/shutdown.py): say what was done
            interrupted = True
    if rows:
        rows.sort(key=lambda x: x.trace_id)
        # One comparison, T0 against the logged tokens, labelled as a run's would be.
        label = comparison_label(
            Comparison(0, "logged", 0), [RunTarget(target, tp_degree=tp_degree)]
        )
        comparison = ComparisonInput(
            0,
            "logged",
            0,
            label,
            False,
            rows,
            control_fraction=sample.fraction if screening else None,
            control_seed=sample.seed if screening else None,
            scan_flag_ulps=sample.flag_ulps if screening else None,
            mode=run_mode,
            decode_window=decode_window,
        )
        stats = run_statistics("offline", [comparison])
        summary = {
            **stats.comparisons[0].model_dump(mode="json"),
            "target": target.to_dict(),
            "mode": run_mode,
            "traces": len(parsed),
            "interrupted": interrupted,
        }
        _print_summary(stats.comparisons[0], target)
        processed = [lt.processors for _, _, lt in parsed if lt.processors is not None]
        if processed:  # what ran besides the target: each result's resolved arm has them
            labels = "; ".join(sorted({p.label() for p in processed}))
            typer.echo(
                f"{counted(len(processed), 'trace')} replayed with their logits processors "
                f"({labels})"
            )
        if summary_json is not None:
            summary_json.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    if interrupted:
        typer.secho(
            f"interrupted: {counted(len(rows), 'result')} written to {out} "
            f"({len(parsed) - len(rows)} of {counted(len(parsed), 'trace')} left; "
            "run again with --resume to replay them)",
            err=True,
            fg=typer.colors.YELLOW,
        )
        raise typer.Exit(130)
    typer.echo(f"wrote {counted(len(rows), 'result')} to {out}")


def _results_written(out: Path, names: list[str], target: Any, mode: str) -> dict[str, JsonObject]:
    """`--resume`: the results an earlier run wrote to `out`, by trace name (external_id, or
    `line N`). Refuses a file of another target or mode, or of traces not in the input (its
    statistics would mix them); a last line cut short (the process killed mid-write) is
    dropped, and its trace replayed again."""
    if not out.exists():
        return {}
    if len(set(names)) != len(names):
        dup = sorted({x for x in names if names.count(x) > 1})
        _fail(f"--resume needs one trace per external_id; repeated: {', '.join(dup[:5])}")
    text = out.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        out.write_text(text, encoding="utf-8")

    def key(t: Mapping[str, object]) -> tuple[object, ...]:
        return (t.get("dtype"), t.get("lm_head_dtype") or t.get("dtype"), t.get("intervention"))

    def target_b(row: JsonObject) -> JsonObject:
        arms, b = row.get("arms"), None
        b = arms.get("b") if isinstance(arms, dict) else None
        target = b.get("target") if isinstance(b, dict) else None
        return target if isinstance(target, dict) else {}

    want = key(target.to_dict())
    done: dict[str, JsonObject] = {}
    for n, row in _read_jsonl(out):
        got = key(target_b(row))
        if got != want or row.get("mode") != mode:
            _fail(
                f"{out}:{n}: a result of another target or mode ({got}, {row.get('mode')}); "
                "--resume takes the options of the run it resumes (or give another --out)"
            )
        if row.get("trace_id") not in names:
            _fail(f"{out}:{n}: trace {row.get('trace_id')!r} is not in the traces given")
        done[str(row["trace_id"])] = row
    return done


def _fmt(x: float | int | str | None, spec: str = "") -> str:
    return "-" if x is None else format(x, spec)


def _rate(rate: float | None, triggers: int | None, steps: int | None) -> str:
    return f"{_fmt(rate, '.2%')} ({_fmt(triggers)}/{_fmt(steps)})"


def _gate_rows(c: ComparisonReport) -> list[tuple[str, str]]:
    """Both arms' gate trigger rates where both ran here (a both-arms comparison), else arm
    B's, as the run statistics have them."""
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
    """The `replay` summary: the run statistics' comparison, as the API serves it."""
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
            " / ".join(_fmt(getattr(ts, k) if ts else None) for k in ("min", "median", "max")),
        ),
    ]
    rows += [(f"category {k}", str(v.successes)) for k, v in c.categories.items()]
    rows.append(("answer agreement (SAR)", _sar_text(c)))
    if c.decode_window is not None:
        rows.append(
            (
                "decode window",
                f"t* + {c.decode_window}: {c.window_cut} of {c.ok} results cut there "
                "(no SAR or length difference for them)",
            )
        )
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
    return [
        ("scanned", str(sc.scanned)),
        (
            "decoded (mismatch + near-tie + control)",
            f"{sc.decoded} ({sc.flagged} + {sc.near_tie} + {sc.control})",
        ),
        (
            "near-tie flag",
            "off"
            if flag is None or flag < 0
            else f"<= {_fmt(flag)} ulps ({sc.near_tie_diverged} of {sc.near_tie} diverged)",
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
