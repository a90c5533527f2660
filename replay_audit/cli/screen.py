"""`replay-audit screen`: screen a checkpoint on this platform before deploying it, no server
needed (docs/screening.md). Resumable: what is done is kept in `--out/state/`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from replay_audit.cli.engine import _fail, _progress, _read_jsonl, _threads
from replay_audit.cli.root import app


def _knobs(values: list[str] | None) -> list[str]:
    from replay_audit.screening.plan import KNOB_NAMES

    if not values:
        return list(KNOB_NAMES)
    out = [k.strip() for v in values for k in v.split(",") if k.strip()]
    bad = [k for k in out if k not in KNOB_NAMES]
    if bad:
        _fail(f"--knobs: unknown knob {bad[0]!r}; known: {', '.join(KNOB_NAMES)}")
    return out


@app.command()
def screen(
    model: Annotated[Path, typer.Option(help="Local Hugging Face checkpoint directory.")],
    prompts: Annotated[
        Path, typer.Option(help='JSONL of {"id", "prompt"} (or "prompt_token_ids").')
    ],
    out: Annotated[Path, typer.Option(help="Directory for report.json, report.html, state/.")],
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda if any).")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    knobs: Annotated[
        list[str] | None,
        typer.Option(help="Knobs to sweep (repeatable or comma-separated; default: all)."),
    ] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N prompts.")] = None,
    reference_dtype: Annotated[
        str | None, typer.Option(help="Reference body dtype (default: the checkpoint's).")
    ] = None,
    pair: Annotated[str, typer.Option(help="Head-vs-body pair, A,B.")] = "bf16,fp16",
    tau: Annotated[float, typer.Option(help="Gate threshold τ (absolute).")] = 1e-3,
    tau_ulps: Annotated[float | None, typer.Option(help="Gate threshold in ulps.")] = None,
    cover: Annotated[
        float, typer.Option(min=0.01, max=1.0, help="Share of flips the τ calibration covers.")
    ] = 0.9,
    threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads.")] = None,
) -> None:
    """Sweep the numerical knobs one at a time, measure CV(TD), the hidden-state gap, the
    categories and the both-arms C lift, and recommend an action (report.json, report.html)."""
    from replay_audit.engine.hashing import NoWeightsError, weights_sha256
    from replay_audit.exceptions import ReplayAuditError
    from replay_audit.formats import BODY_DTYPES
    from replay_audit.screening.analysis import build_report
    from replay_audit.screening.plan import ScreenConfig, build_plan
    from replay_audit.screening.runner import DirectoryStore, run_screening
    from replay_audit.screening.worker import TorchBackend, checkpoint_dtype, probe
    from replay_audit.ui.screening_view import standalone_html

    chosen = _knobs(knobs)
    arms = tuple(x.strip() for x in pair.split(","))
    if len(arms) != 2 or any(a not in BODY_DTYPES for a in arms):
        _fail(f"--pair must be two of {', '.join(BODY_DTYPES)}, comma-separated; got {pair!r}")
    if reference_dtype is not None and reference_dtype not in BODY_DTYPES:
        _fail(f"--reference-dtype must be one of {', '.join(BODY_DTYPES)}")
    rows: list[dict[str, Any]] = []
    for n, row in _read_jsonl(prompts):
        if not isinstance(row.get("prompt"), str) and not isinstance(
            row.get("prompt_token_ids"), list
        ):
            _fail(f"{prompts}:{n}: needs a string 'prompt' or a list 'prompt_token_ids'")
        rows.append(row)
    rows = rows[:limit] if limit else rows
    if not rows:
        _fail(f"{prompts} holds no prompt")
    try:
        sha = weights_sha256(model)
    except NoWeightsError as e:
        _fail(e.message)
    from replay_audit.engine.loading import set_torch_threads

    set_torch_threads(_threads(threads))
    try:
        platform = probe(device)
        ref = ScreenConfig(reference_dtype or checkpoint_dtype(model))
        backend = TorchBackend(model, device)
        plan = build_plan(
            platform,
            reference=ref,
            knobs=chosen,
            pair=(arms[0], arms[1]),
            tau=tau,
            tau_ulps=tau_ulps,
            max_new_tokens=max_new_tokens,
            cover=cover,
            probe=backend.availability,
        )
        screen_prompts = backend.prompts(rows)
        out.mkdir(parents=True, exist_ok=True)
        store = DirectoryStore(out / "state")
        with _progress() as bar:
            task = bar.add_task("screen", total=None)

            def progress(done: int, total: int, what: str) -> None:
                bar.update(task, completed=done, total=total, description=what[:48])

            outputs = run_screening(plan, screen_prompts, backend, store, progress=progress)
    except ReplayAuditError as e:
        _fail(e.message)
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
