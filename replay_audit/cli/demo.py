"""`replay-audit demo`: the product's main job, end to end, on the embedded default (SQLite,
in-process runner, the API on a free local port). The "production" side is transformers' own
`generate()` on the bundled model; everything after it goes through the HTTP API.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from replay_audit.cli.root import app
from replay_audit.json_value import JsonObject, JsonValue, as_object, as_str
from replay_audit.words import counted

if TYPE_CHECKING:
    from replay_audit.replays.schemas import ReplayRead
    from replay_audit.stats.report import ComparisonReport, ProportionRead

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "assets" / "prompts.jsonl"
#: The demo's admin key, kept (mode 0600) so the next demo reuses it instead of minting another.
KEY_FILE = Path("var/demo-api-key")
DEMO_PROJECT = "demo"


def external_id(prompt_id: object, max_new_tokens: int) -> str:
    """The demo's external id of a bundled prompt's trace: prefixed, so the user's own traces of
    the same prompts (`replay-audit generate` keeps their ids) never collide with the demo's,
    and naming the length, which changes the trace (a 409 otherwise, in a later demo)."""
    return f"demo-{max_new_tokens}tok-{prompt_id}"


def _demo_key(settings: Any, console: Any) -> str:
    """The key kept in KEY_FILE while it still opens project 'demo' as admin in this database;
    else a new one, kept there. Says which, and how many keys the project holds."""
    from replay_audit.auth.repository import get_project
    from replay_audit.auth.service import authenticate, create_api_key, list_api_keys
    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.exceptions import NotAuthenticated

    with session_scope(settings.database_url) as session:
        key = KEY_FILE.read_text().strip() if KEY_FILE.is_file() else None
        if key is not None:
            try:
                who = authenticate(session, key)
                if (who.project, who.role.value) != (DEMO_PROJECT, "admin"):
                    key = None
            except NotAuthenticated:  # another database's key, or revoked
                key = None
        reused = key is not None
        if key is None:
            key = create_api_key(session, DEMO_PROJECT, "admin", name="replay-audit demo").key
        project = get_project(session, DEMO_PROJECT)
        assert project is not None  # it holds the key
        active = sum(k.revoked_at is None for k in list_api_keys(session, project.id))
    if not reused:
        KEY_FILE.parent.mkdir(parents=True, exist_ok=True)
        tmp = KEY_FILE.with_suffix(".tmp")
        tmp.write_text(key + "\n")
        tmp.chmod(0o600)
        tmp.replace(KEY_FILE)
    # At once: an interrupted demo must not leave the user with a key nobody ever saw.
    how = f"reused from {KEY_FILE}" if reused else f"new; kept in {KEY_FILE} for the next demo"
    console.print(f"admin API key of project 'demo' ({how}): {key}", soft_wrap=True)
    if active > 1:
        console.print(
            f"project 'demo' holds {active} active keys; revoke those you no longer use "
            "(GET /v1/keys, DELETE /v1/keys/{id})",
            soft_wrap=True,
        )
    return key


@contextlib.contextmanager
def _serving(settings: Any, port: int) -> Iterator[tuple[threading.Thread, str]]:
    """The API in a thread of this process: (its thread, its base URL); stopped on the way out,
    however the block ends (Ctrl-C included)."""
    import uvicorn

    from replay_audit.api.app import create_app
    from replay_audit.cli.shutdown import own
    from replay_audit.queue import build_runner, stop_runner

    # Owned by the command, as the server thread may not get to its own shutdown.
    runner = build_runner(settings)
    own(lambda timeout_s: stop_runner(runner, timeout_s))
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings, runner=runner), host="127.0.0.1", port=port, log_level="warning"
        )
    )
    thread = threading.Thread(target=server.run, name="replay-audit-demo-api", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the API server did not start")
            time.sleep(0.05)
        sock = server.servers[0].sockets[0]
        yield thread, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _pct(p: ProportionRead | None) -> str:
    if p is None or p.estimate is None:
        return "-"
    return f"{100 * p.estimate:.0f}% [{100 * p.low:.0f}, {100 * p.high:.0f}]"


def _points(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:+.1f}"


_SHORT = {"agreed": "agr", "head_reachable": "head", "kv_dependent": "kv", "body_dominated": "body"}


def _gate(c: ComparisonReport) -> str:
    """Arm B's trigger rate, and arm A's before it where arm A ran here (both arms)."""

    def rate(r: float | None) -> str:
        return "-" if r is None else f"{100 * r:.2f}%"

    b = rate(c.trigger_rate)
    return b if c.steps_a is None else f"A {rate(c.trigger_rate_a)} · B {b}"


def _print_run(console: Any, run: ReplayRead, title: str) -> None:
    """The run's statistics as the API serves them (`statistics`: the same object as /report
    and the UI), with each comparison's and each lift's own label."""
    from rich.markup import escape
    from rich.table import Table

    stats = run.statistics
    table = Table(title=f"{title}\nrun {run.id} ({run.status})", title_justify="left")
    for col in ("comparison", "EAR [95% CI]", "gate trigger rate", "t* med", "categories"):
        table.add_column(col, overflow="fold")
    for c in stats.comparisons if stats else []:
        t = c.first_divergence_step
        t_star = "-" if t is None else f"{t.median:.0f}"
        cats = " ".join(
            f"{_SHORT[k]} {v.successes}" for k, v in c.categories.items() if v.successes
        )
        table.add_row(escape(c.label), _pct(c.ear), _gate(c), t_star, cats or "-")
    console.print(table)
    for lift in stats.lifts if stats is not None else []:
        line = (
            f"  EAR lift of [{lift.label_b}] over [{lift.label_a}]: "
            f"{_points(lift.lift)} pp [{_points(lift.low)}, {_points(lift.high)}]"
            f"; fixed {lift.fixed}, broke {lift.broke}, McNemar p = {lift.mcnemar_p:.3g}"
        )
        console.print(escape(line))  # the brackets are text, not rich markup
    if stats is not None:
        from replay_audit.cli.engine import reproduction_lines

        for line in reproduction_lines(stats):
            console.print(escape(f"  {line}"))


def _requests(ids: list[str]) -> dict[str, JsonObject]:
    c: JsonObject = {"kind": "C", "tau": 1e-3}
    return {
        # The self-replay in the logged configuration must reproduce exactly.
        "logged": {
            "name": "demo: replay vs logged BF16 (FP16, FP16 + C, self)",
            "trace_ids": list[JsonValue](ids),
            "targets": [
                {"dtype": "fp16", "label": "FP16"},
                {"dtype": "fp16", "intervention": c, "label": "FP16 + C"},
            ],
            "compare_with": "self",
        },
        # The paper's both-arms protocol: would C have prevented the divergence?
        "both_arms": {
            "name": "demo: both arms, BF16 vs FP16 with and without C",
            "trace_ids": list[JsonValue](ids),
            "targets": [
                {"dtype": "bf16", "label": "BF16"},
                {"dtype": "fp16", "label": "FP16"},
                {"dtype": "bf16", "intervention": c, "label": "BF16 + C"},
                {"dtype": "fp16", "intervention": c, "label": "FP16 + C"},
            ],
            "compare": "pairwise",
            "pairs": [[0, 1], [2, 3]],
        },
    }


@app.command()
def demo(
    prompts: Annotated[int, typer.Option(min=1, max=64, help="How many bundled prompts.")] = 24,
    max_new_tokens: Annotated[int, typer.Option(min=1, max=512)] = 48,
    port: Annotated[int, typer.Option(help="API port (0: any free port).")] = 0,
    keep_serving: Annotated[
        bool, typer.Option(help="Keep the API running afterwards (Ctrl-C to stop).")
    ] = False,
    json_out: Annotated[
        Path | None, typer.Option(help="Also write the key and both runs as JSON.")
    ] = None,
) -> None:
    """The product end to end: BF16 traces of the bundled model replayed in FP16, C or not.

    Generate BF16 traces with the bundled model, ingest them over HTTP, replay them in FP16
    with and without Intervention C (against the logged tokens, and both arms run here), and
    print what the API reports."""
    import httpx
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from replay_audit.cli.database import ready_database
    from replay_audit.config import BUNDLED_MODEL_DIR, get_settings
    from replay_audit.replays.schemas import ReplayRead

    console = Console()
    settings = get_settings()
    ready_database(settings, migrate=True)
    key = _demo_key(settings, console)
    with _serving(settings, port) as (thread, base):
        console.print(
            f"[bold]API[/] {base}  (database {settings.database_url}, runner {settings.runner})"
        )

        from transformers.utils import logging as hf_logging

        from replay_audit.engine.generate import generate_traces

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # one bar per checkpoint load would drown the demo's own

        lines = PROMPTS_FILE.read_text().splitlines()[:prompts]
        items = [
            (external_id(d.get("id"), max_new_tokens), d["prompt"]) for d in map(json.loads, lines)
        ]
        traces: list[JsonObject] = []
        bar = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
        with Progress(*bar, console=console) as progress:
            task = progress.add_task("generate (BF16, transformers generate())", total=len(items))
            for trace in generate_traces(
                BUNDLED_MODEL_DIR,
                items,
                dtype="bf16",
                max_new_tokens=max_new_tokens,
                device="cpu",
                tags=["demo", "production"],
                model_name="tiny-llama",
                threads=settings.torch_threads,
                leave_free=1,  # the API serves beside it
            ):
                traces.append(trace)
                progress.advance(task)

        with httpx.Client(base_url=base, headers={"X-API-Key": key}, timeout=60) as client:
            r = client.post("/v1/traces:batch", json={"traces": traces})
            r.raise_for_status()
            refused = [item for item in r.json()["results"] if item.get("error")]
            if refused:
                console.print(
                    f"error: the API refused {counted(len(refused), 'trace')}: {refused[0]}"
                )
                raise typer.Exit(2)
            ids = [item["id"] for item in r.json()["results"]]
            console.print(
                f"ingested {counted(len(ids), 'trace')} over HTTP "
                f"(POST /v1/traces:batch: {r.status_code})"
            )
            run_ids = {}
            for name, request in _requests(ids).items():
                r = client.post("/v1/replays", json=request)
                r.raise_for_status()
                run_ids[name] = r.json()["id"]
            finished: dict[str, JsonObject] = {}
            with Progress(*bar, console=console) as progress:
                titles = {
                    "logged": "replay vs logged: FP16, FP16 + C, self",
                    "both_arms": "both arms: BF16|FP16, BF16+C|FP16+C",
                }
                tasks = {k: progress.add_task(t, total=None) for k, t in titles.items()}
                while len(finished) < len(run_ids):
                    for name, run_id in run_ids.items():
                        run = as_object(client.get(f"/v1/replays/{run_id}").json())
                        read = ReplayRead.model_validate(run)
                        p = read.progress
                        progress.update(tasks[name], total=p.total, completed=p.done + p.failed)
                        if read.status in ("done", "failed"):
                            finished[name] = run
                    time.sleep(0.2)

        reads = {k: ReplayRead.model_validate(v) for k, v in finished.items()}
        _print_run(console, reads["logged"], "BF16-logged traces replayed (arm A: logged tokens)")
        _print_run(console, reads["both_arms"], "Both arms run here (the paper's protocol)")
        runs = f"/ui/runs/{run_ids['logged']} and /ui/runs/{run_ids['both_arms']}"
        if keep_serving:
            where = f"{base} (serving until Ctrl-C)"
        else:
            # This API stops with the demo: the URLs are those of `replay-audit serve`.
            where = "http://127.0.0.1:8000 once `replay-audit serve` runs (this API has stopped)"
        console.print(
            f"browse at {where}: sign in at /ui with the key above, then {runs}; "
            f"results at /v1/replays/<id>/results (X-API-Key), API docs at /docs",
            soft_wrap=True,
        )
        if json_out is not None:
            json_out.write_text(json.dumps({"api_key": key, "runs": finished}, indent=2))
        if keep_serving:
            console.print("serving; Ctrl-C to stop")
            with contextlib.suppress(KeyboardInterrupt):
                thread.join()
    if any(as_str(run["status"]) != "done" for run in finished.values()):
        raise typer.Exit(1)
