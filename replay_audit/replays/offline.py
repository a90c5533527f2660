"""An offline replay (`replay-audit replay`): a file of traces replayed against a local
checkpoint with no server, through the same pipeline (`pipeline.replay_traces`: reproduce
before compare), row mapping (`results`) and statistics (`stats.report.run_statistics`) as a
run, so its output file and summary say what the API would. The CLI calls `replay_file` as the
endpoints call `service`; it parses, prints and handles signals, nothing else.

Each trace is two comparisons, as a run with `engine_check: auto`: 0, the target against the
logged tokens (judged against the trace's reproduced baseline where it does not reproduce),
and 1, the reproduction check (its logged configuration replayed here); `reproduce=False`
leaves only comparison 0, judged against the logged tokens. One JSON line per result, both
lines of a trace written together: `resume` keeps a file's whole traces and replays the rest.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path

from pydantic import ValidationError

from replay_audit.engine.pool import EnginePool
from replay_audit.engine.protocol import ScanRun
from replay_audit.exceptions import FieldError, ReplayAuditError
from replay_audit.formats import EXTRA_PROCESSORS, Mode, SingleStepKind, processors_not_applied
from replay_audit.json_value import JsonObject, as_int
from replay_audit.replays.domain import (
    ENGINE_CHECK_LABEL,
    LARGE_RUN_DECODE_WINDOW,
    LARGE_RUN_FLAGGED_FRACTION,
    LARGE_RUN_TRACES,
    SCAN_FLAG_OFF,
    Comparison,
    ControlSample,
    LoggedTrace,
    RunTarget,
    comparison_label,
    is_treatment,
    resolve_flagged_fraction,
    resolve_mode,
    resolve_window,
)
from replay_audit.replays.models import ReplayResult
from replay_audit.replays.pipeline import (
    ReplayItem,
    ReplayOptions,
    check_replayable,
    replay_traces,
    scan_items,
)
from replay_audit.replays.results import (
    figures,
    figures_from_json,
    result_read,
    result_values,
    token_ids_source,
)
from replay_audit.stats.report import (
    ComparisonInput,
    EngineCheckInput,
    ResultFigures,
    RunStatistics,
    run_statistics,
)
from replay_audit.traces.schemas import READ_ONLY_FIELDS, TraceCreate


@dataclass(frozen=True)
class ParsedTrace:
    """A line of the traces file: where it is (`FILE:LINE`, what an error names), its number,
    the trace as posted and as the pipeline reads it."""

    where: str
    line: int
    trace: TraceCreate
    logged: LoggedTrace

    @property
    def name(self) -> str:
        """What names its results (`trace_id` in the output): its external id, or its line."""
        return self.trace.external_id or f"line {self.line}"


def parse_traces(path: Path, rows: Iterator[tuple[int, JsonObject]]) -> list[ParsedTrace]:
    """Every line of the traces file, checked before a checkpoint is hashed or loaded (a
    `FieldError` naming the line and field): valid trace JSON (as posted, or as the API reads
    it back: its read-only fields are dropped), replayable."""
    parsed = []
    for n, row in rows:
        try:
            trace = TraceCreate.model_validate(
                {k: v for k, v in row.items() if k not in READ_ONLY_FIELDS}
            )
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise FieldError(f"{path}:{n}: not a valid trace: {where}: {err['msg']}") from None
        logged = LoggedTrace.from_json(trace.model_dump())
        try:
            check_replayable(logged)
        except ReplayAuditError as e:
            why = processors_not_applied(trace.config.extras.get(EXTRA_PROCESSORS))
            raise FieldError(f"{path}:{n}: {e.field}: {e.message}{why}", field=e.field) from None
        parsed.append(ParsedTrace(f"{path}:{n}", n, trace, logged))
    if not parsed:
        raise FieldError(f"{path} holds no trace")
    return parsed


@dataclass(frozen=True)
class OfflinePlan:
    """How the file is replayed (the options of a run)."""

    target: RunTarget
    mode: Mode | None = None
    sample: ControlSample = field(default_factory=ControlSample)
    decode_window: int | None = None
    top_k: int = 5
    extractor: str | None = None
    #: Reproduce before comparing (a run's `engine_check: auto`).
    reproduce: bool = True
    scan_token_budget: int = 16384
    large_run_traces: int = LARGE_RUN_TRACES
    large_run_decode_window: int = LARGE_RUN_DECODE_WINDOW
    single_step: SingleStepKind = "teacher_forced"
    #: The flagged sample's share (None: 1, but a large run naming no mode gets
    #: `large_run_flagged_fraction`: `resolve_flagged_fraction`); `sample`'s own is replaced.
    flagged_fraction: float | None = None
    large_run_flagged_fraction: float = LARGE_RUN_FLAGGED_FRACTION

    def targets(self) -> list[RunTarget]:
        check = RunTarget(None, label=ENGINE_CHECK_LABEL)
        return [self.target, check] if self.reproduce else [self.target]


@dataclass
class OfflineResult:
    """What the replay wrote: its statistics (as a run's), the mode it ran in, and whether a
    signal stopped it (what was written stays)."""

    statistics: RunStatistics | None
    mode: Mode
    traces: int
    written: int
    interrupted: bool = False
    #: What the traces replayed with their logged logits processors ran (labels), and how
    #: many they were.
    processors: list[str] = field(default_factory=list)
    processed: int = 0
    #: One line per batched scan: how many traces in how many forwards, how fast.
    notes: list[str] = field(default_factory=list)


def replay_file(
    parsed: Sequence[ParsedTrace],
    model_dir: Path,
    pool: EnginePool,
    plan: OfflinePlan,
    out: Path,
    *,
    resume: bool = False,
    progress: Callable[[int, int], None] | None = None,
    deferred: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
) -> OfflineResult:
    """Replay every trace of `parsed` (against `model_dir`, whose weights each must have been
    logged with) as `plan` says, its results appended to `out` as they come (overwritten
    unless `resume`), a trace's lines written under `deferred()` (the CLI defers its signals
    there, so a stop lands between traces). `progress(done, total)` after each trace."""
    sha = pool.weights_sha256(model_dir)
    for p in parsed:
        if p.trace.model.weights_sha256 != sha:
            raise FieldError(
                f"{p.where}: model.weights_sha256: checkpoint {model_dir} has "
                f"weights_sha256 {sha}, but trace {p.trace.external_id or '(no external_id)'} "
                f"was logged with {p.trace.model.weights_sha256}: refusing to replay it against "
                "other weights",
                field="model.weights_sha256",
            )
    mode = resolve_mode(plan.mode, len(parsed), plan.large_run_traces)
    window = resolve_window(
        plan.mode,
        plan.decode_window,
        mode,
        pairwise=False,
        large_run_window=plan.large_run_decode_window,
    )
    sample = replace(
        plan.sample,
        flagged_fraction=resolve_flagged_fraction(
            plan.mode,
            plan.flagged_fraction,
            mode,
            pairwise=False,
            large_run_fraction=plan.large_run_flagged_fraction,
        ),
    )
    targets = plan.targets()
    comparisons = [Comparison(c, "logged", c) for c in range(len(targets))]
    done = _written(out, [p.name for p in parsed], plan, mode) if resume else {}
    rows: dict[int, list[ResultFigures]] = {c.index: [] for c in comparisons}
    for i, p in enumerate(parsed):
        for line in done.get(p.name, []):
            rows[as_int(line["comparison"])].append(figures_from_json(line, i, p.trace.external_id))
    screening = mode == "scan_then_decode"
    options = ReplayOptions(
        mode,
        plan.top_k,
        sample.flag_ulps if screening else SCAN_FLAG_OFF,
        plan.scan_token_budget,
        check_weights=False,  # checked above, once for all traces
        decode_window=window,
        single_step=plan.single_step,
    )
    todo = [i for i, p in enumerate(parsed) if p.name not in done]
    items = {
        i: [
            ReplayItem(
                parsed[i].logged,
                targets[c.b],
                model_dir,
                control=screening and sample.includes(parsed[i].name),
                extractor=plan.extractor,
                decode_flagged=sample.decodes_flagged(parsed[i].name),
            )
            for c in comparisons
        ]
        for i in todo
    }
    result = OfflineResult(None, mode, len(parsed), len(done))
    # Every trace's scans first, several per forward (none in decode mode).
    batched = scan_items([it for i in todo for it in items[i]], pool, options)
    runs = iter(batched.runs)
    scans = {i: [next(runs) for _ in comparisons] for i in todo}
    if mode != "decode" and todo:
        rate = batched.scanned / batched.seconds if batched.seconds > 0 else 0.0
        result.notes.append(
            f"scanned {batched.scanned} items in {batched.forwards} forwards, "
            f"{batched.seconds:.2f} s ({rate:.1f} per s)"
        )
    with out.open("a" if resume else "w", encoding="utf-8") as f:
        try:
            for i in todo:
                p = parsed[i]
                lines, figs = _replayed(p, i, items[i], scans[i], pool, options, plan.reproduce)
                with deferred():  # a stop lands after the trace's lines and their counts
                    f.write("".join(json.dumps(x, allow_nan=False) + "\n" for x in lines))
                    f.flush()
                    for c, fig in figs:
                        rows[c].append(fig)
                    result.written += 1
                if progress is not None:
                    progress(result.written, len(parsed))
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (cli/shutdown.py): keep what was done
            result.interrupted = True
    inputs = [
        ComparisonInput(
            c.index,
            "logged",
            c.b,
            comparison_label(c, targets),
            is_treatment(c, targets),
            sorted(rows[c.index], key=lambda x: x.trace_id),
            control_fraction=sample.fraction if screening else None,
            control_seed=sample.seed if screening else None,
            scan_flag_ulps=sample.flag_ulps if screening else None,
            flagged_fraction=sample.flagged_fraction if screening else None,
            mode=mode,
            decode_window=window,
        )
        for c in comparisons
    ]
    if any(rows.values()):
        engines = {i: p.logged.engine_name for i, p in enumerate(parsed)}
        check = EngineCheckInput(1, engines) if plan.reproduce else None
        result.statistics = run_statistics("offline", inputs, engine_check=check)
    processed = [p.logged.processors for p in parsed if p.logged.processors is not None]
    result.processors, result.processed = sorted({x.label() for x in processed}), len(processed)
    return result


def _replayed(
    p: ParsedTrace,
    index: int,
    items: list[ReplayItem],
    scans: list[ScanRun | None],
    pool: EnginePool,
    options: ReplayOptions,
    reproduce: bool,
) -> tuple[list[JsonObject], list[tuple[int, ResultFigures]]]:
    """A trace's comparisons replayed (its reproduction check first): each result as its
    output line (with the check's outcome, `engine_reproduced`, as the API serves it) and its
    figures. A domain error (the trace cannot run here) is raised."""
    stored: list[ReplayResult] = []
    for c, r in enumerate(replay_traces(items, pool, options, scans=scans)):
        if isinstance(r, ReplayAuditError):
            where = f"{r.field}: " if r.field else ""
            raise FieldError(f"{p.where}: {where}{r.message}", field=r.field)
        if isinstance(r, Exception):
            raise r
        stored.append(ReplayResult(trace_id=index, **result_values(c, r)))
    # The same mappings as a stored result: the row, then the API's view of it.
    reproduced = stored[1].exact_match if reproduce else None
    ids_source = token_ids_source(p.trace.config.model_dump())
    lines = [
        result_read(
            row, p.name, "offline", engine_reproduced=reproduced, token_ids_source=ids_source
        ).model_dump(mode="json", exclude={"run_id", "created_at"})
        for row in stored
    ]
    return lines, [(c, figures(row, p.name, p.trace.external_id)) for c, row in enumerate(stored)]


def _written(
    out: Path, names: list[str], plan: OfflinePlan, mode: str
) -> dict[str, list[JsonObject]]:
    """`resume`: the results an earlier replay wrote to `out`, by trace name, whole traces
    only. Refuses a file of another target, mode or reproduction, or of traces not in the
    input (its statistics would mix them); a last line cut short (the process killed
    mid-write) is dropped with the rest of its trace, which is replayed again."""
    if not out.exists():
        return {}
    if len(set(names)) != len(names):
        dup = sorted({x for x in names if names.count(x) > 1})
        raise FieldError(f"resume needs one trace per external_id; repeated: {', '.join(dup[:5])}")
    text = out.read_text(encoding="utf-8")
    lines = [json.loads(x) for x in text[: text.rfind("\n") + 1].splitlines() if x.strip()]
    want = _key(plan.target.target.to_dict() if plan.target.target is not None else {})
    per_trace = len(plan.targets())
    done: dict[str, list[JsonObject]] = {}
    for n, row in enumerate(lines, start=1):
        comparison = row.get("comparison")
        if not isinstance(comparison, int) or comparison >= per_trace or row.get("mode") != mode:
            raise FieldError(
                f"{out}:{n}: a result of another mode or reproduction setting; resume takes "
                "the options of the replay it resumes (or give another output file)"
            )
        got = _key(_arm_target(row, "b"))
        if comparison == 0 and got != want:
            raise FieldError(
                f"{out}:{n}: a result of another target ({got}); resume takes the options of "
                "the replay it resumes (or give another output file)"
            )
        if row.get("trace_id") not in names:
            raise FieldError(f"{out}:{n}: trace {row.get('trace_id')!r} is not in the traces given")
        done.setdefault(str(row["trace_id"]), []).append(row)
    whole = {name: rows for name, rows in done.items() if len(rows) == per_trace}
    kept = [row for name in names for row in whole.get(name, [])]
    out.write_text("".join(json.dumps(x, allow_nan=False) + "\n" for x in kept), encoding="utf-8")
    return whole


def _key(t: Mapping[str, object]) -> tuple[object, ...]:
    return (t.get("dtype"), t.get("lm_head_dtype") or t.get("dtype"), t.get("intervention"))


def _arm_target(row: JsonObject, side: str) -> JsonObject:
    arms = row.get("arms")
    arm = arms.get(side) if isinstance(arms, dict) else None
    target = arm.get("target") if isinstance(arm, dict) else None
    return target if isinstance(target, dict) else {}
