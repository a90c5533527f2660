"""`replay-audit screen`: screen a checkpoint on this platform before deploying it, no server
needed (docs/screening.md). Resumable: what is done is kept in `--out/state/`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from replay_audit.cli.database import fail
from replay_audit.cli.engine import _progress, _read_jsonl, _threads
from replay_audit.cli.root import app, option
from replay_audit.diff.margin import DEFAULT_TAU
from replay_audit.formats import (
    BODY_DTYPES,
    COVER,
    DEFAULT_PAIR,
    DEVICES,
    MAX_NEW_TOKENS,
    body_dtype,
)
from replay_audit.queue.route import MAX_TP_DEGREE

if TYPE_CHECKING:
    from replay_audit.screenings.sweep.outputs import PromptRow
    from replay_audit.screenings.sweep.plan import SweepPlan


def _knobs(values: list[str] | None) -> list[str] | None:
    """The knobs named (None: none named, every knob; `build_plan` runs `tp` on a CPU only
    when named)."""
    from replay_audit.screenings.sweep.plan import KNOB_NAMES

    if not values:
        return None
    out = [k.strip() for v in values for k in v.split(",") if k.strip()]
    bad = [k for k in out if k not in KNOB_NAMES]
    if bad:
        fail(f"--knobs: unknown knob {bad[0]!r}; known: {', '.join(KNOB_NAMES)}")
    return out


def _devices(plan: SweepPlan) -> int:
    """The devices the screening's engine pool owns: the TP knob's degree where it runs here."""
    tp = [k for k in plan.knobs if k.name == "tp"]
    return max([1, *(v.config.tp_degree for k in tp for v in k.values if v.unavailable is None)])


@app.command()
def screen(
    model: Annotated[Path, typer.Option(help="Local Hugging Face checkpoint directory.")],
    prompts: Annotated[
        Path, typer.Option(help='JSONL of {"id", "prompt"} (or "prompt_token_ids").')
    ],
    out: Annotated[Path, typer.Option(help="Directory for report.json, report.html, state/.")],
    device: Annotated[
        str | None, typer.Option(help=f"{' or '.join(DEVICES)} (default: cuda if any).")
    ] = None,
    max_new_tokens: Annotated[int, option(MAX_NEW_TOKENS)] = MAX_NEW_TOKENS.default,
    knobs: Annotated[
        list[str] | None,
        typer.Option(
            help="Knobs to sweep (repeatable or comma-separated; default: all, but tp runs on"
            " a CPU only when named)."
        ),
    ] = None,
    tp_degree: Annotated[
        int,
        typer.Option(
            min=2,
            max=MAX_TP_DEGREE,
            help="The TP degree the tp knob screens: needs that many CUDA GPUs (gloo processes"
            " on a CPU). One degree per screening.",
        ),
    ] = 2,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N prompts.")] = None,
    reference_dtype: Annotated[
        str | None, typer.Option(help="Reference body dtype (default: the checkpoint's).")
    ] = None,
    pair: Annotated[str, typer.Option(help="Head-vs-body pair, A,B.")] = ",".join(DEFAULT_PAIR),
    tau: Annotated[float, typer.Option(min=0.0, help="Gate threshold τ (absolute).")] = DEFAULT_TAU,
    tau_ulps: Annotated[float | None, typer.Option(min=0.0, help="Gate threshold in ulps.")] = None,
    cover: Annotated[float, option(COVER)] = COVER.default,
    threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads.")] = None,
) -> None:
    """Sweep the numerical knobs one at a time, measure CV(TD), the hidden-state gap, the
    categories and the both-arms C lift, and recommend an action (report.json, report.html)."""
    from replay_audit.engine.hashing import NoWeightsError, weights_sha256
    from replay_audit.engine.pool import EnginePool
    from replay_audit.exceptions import ReplayAuditError
    from replay_audit.screenings.sweep.analysis import build_report
    from replay_audit.screenings.sweep.plan import ScreenConfig, build_plan
    from replay_audit.screenings.sweep.runner import DirectoryStore, run_screening
    from replay_audit.screenings.sweep.worker import TorchFacts
    from replay_audit.ui.screening_view import standalone_html

    chosen = _knobs(knobs)
    names = pair.split(",")
    arm_a, arm_b = (body_dtype(n.strip()) for n in names) if len(names) == 2 else (None, None)
    if arm_a is None or arm_b is None:
        fail(f"--pair must be two of {', '.join(BODY_DTYPES)}, comma-separated; got {pair!r}")
    reference = body_dtype(reference_dtype) if reference_dtype is not None else None
    if reference_dtype is not None and reference is None:
        fail(f"--reference-dtype must be one of {', '.join(BODY_DTYPES)}")
    if not cover > 0:
        fail("--cover must be above 0")
    rows: list[PromptRow] = []
    for n, row in _read_jsonl(prompts):
        text, ids = row.get("prompt"), row.get("prompt_token_ids")
        if isinstance(ids, list) and all(isinstance(x, int) for x in ids):
            token_ids = [x for x in ids if isinstance(x, int)]
            rows.append({"id": str(row.get("id", len(rows))), "prompt_token_ids": token_ids})
        elif isinstance(text, str):
            rows.append({"id": str(row.get("id", len(rows))), "prompt": text})
        else:
            fail(f"{prompts}:{n}: needs a string 'prompt' or a list 'prompt_token_ids'")
    rows = rows[:limit] if limit else rows
    if not rows:
        fail(f"{prompts} holds no prompt")
    try:
        sha = weights_sha256(model)
    except NoWeightsError as e:
        fail(e.message)
    from replay_audit.engine.loading import set_torch_threads

    set_torch_threads(_threads(threads))
    backend = TorchFacts(model, device)
    pool: EnginePool | None = None
    try:
        plan = build_plan(
            backend.platform(),
            reference=ScreenConfig(reference or backend.reference_dtype()),
            knobs=chosen,
            pair=(arm_a, arm_b),
            tau=tau,
            tau_ulps=tau_ulps,
            max_new_tokens=max_new_tokens,
            cover=cover,
            probe=backend.availability,
            tp_degree=tp_degree,
        )
        screen_prompts = backend.prompts(rows)
        out.mkdir(parents=True, exist_ok=True)
        store = DirectoryStore(out / "state")
        # Three engines: the anchors and the configuration in hand stay loaded.
        pool = EnginePool(device=device, max_engines=3, devices=_devices(plan))
        with _progress() as bar:
            task = bar.add_task("screen", total=None)

            def progress(done: int, total: int, what: str) -> None:
                bar.update(task, completed=done, total=total, description=what[:48])

            outputs = run_screening(
                plan, screen_prompts, pool, model, backend.eos_ids(), store, progress=progress
            )
    except ReplayAuditError as e:
        fail(e.message)
    finally:
        if pool is not None:
            pool.close()  # its TP group's ranks, if the tp knob ran
    report = build_report(plan, screen_prompts, outputs, model=model.name, weights_sha256=sha)
    (out / "report.json").write_text(
        json.dumps(report.model_dump(mode="json"), indent=2, allow_nan=False) + "\n",
        encoding="utf-8",
    )
    (out / "report.html").write_text(standalone_html(report), encoding="utf-8")
    t = report.tier
    typer.echo(f"{t.name}: {t.action}")
    typer.echo(f"evidence: {t.evidence}")
    typer.echo(f"wrote {out / 'report.json'} and {out / 'report.html'}")
