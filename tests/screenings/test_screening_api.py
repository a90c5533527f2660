"""`/v1/screenings`: a screening queued over HTTP, run by its job (fake engines whose effects
are known, tests/screenings/sweep/fake_screen.py),
its report read back; bad input answered 4xx naming
the field; project and role isolation; idempotency; a job that cannot find the checkpoint says
why."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.engine.hashing import weights_sha256
from tests.screenings.conftest import FakeWorkerBackend, JobRunner
from tests.screenings.sweep.fake_screen import HEAD, N_PROMPTS, STEPS
from tests.ui.conftest import settings as settings  # fixture: the session secret
from tests.ui.conftest import ui_client  # noqa: F401  (fixture)


def _body(sha: str, **extra: Any) -> dict[str, Any]:
    prompts = [{"id": f"p{i}", "prompt_token_ids": [i, 50, 60]} for i in range(N_PROMPTS)]
    return {
        "model_sha256": sha,
        "prompts": prompts,
        "knobs": ["body_dtype", "tf32"],
        "max_new_tokens": STEPS,
        **extra,
    }


def test_a_screening_runs_and_its_report_is_read_back(
    client: TestClient,
    job_runner: JobRunner,
    fake_backend: list[FakeWorkerBackend],
    fake_model_dir: Path,
    headers: Callable[..., dict[str, str]],
) -> None:
    admin = headers("admin")
    r = client.post("/v1/screenings", json=_body(weights_sha256(fake_model_dir)), headers=admin)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    got = client.get(f"/v1/screenings/{sid}", headers=admin).json()
    assert got["status"] == "queued" and got["report"] is None
    assert job_runner.run_all() == 1
    got = client.get(f"/v1/screenings/{sid}", headers=headers("auditor")).json()
    assert got["status"] == "done", got["error"]
    report = got["report"]
    assert report["tier"]["tier"] == 1
    lift = report["head_vs_body"]["lift"]
    assert lift["lift"] == pytest.approx(len(HEAD) / N_PROMPTS)
    tf32 = report["knobs"][1]["values"][0]
    assert tf32["status"] == "not_available"
    # Running the job again (a retry, a re-enqueue) changes nothing and loads no engine.
    from replay_audit.screenings.tasks import run_screening_job

    loads = sum(len(b.loads) for b in fake_backend)
    run_screening_job(int(job_runner_id(client, sid)))
    assert sum(len(b.loads) for b in fake_backend) == loads


def test_the_tp_knob_screens_the_degree_the_request_names(
    client: TestClient,
    job_runner: JobRunner,
    fake_backend: list[FakeWorkerBackend],
    fake_model_dir: Path,
    headers: Callable[..., dict[str, str]],
) -> None:
    """`tp_degree` reaches the plan: the `tp` knob's one value loads the reference at that
    degree (named, so it runs on the worker's CPU), and the report labels it so."""
    admin = headers("admin")
    body = _body(weights_sha256(fake_model_dir), knobs=["tp"], tp_degree=3)
    r = client.post("/v1/screenings", json=body, headers=admin)
    assert r.status_code == 201, r.text
    assert job_runner.run_all() == 1
    got = client.get(f"/v1/screenings/{r.json()['id']}", headers=admin).json()
    assert got["status"] == "done", got["error"]
    assert got["request"]["tp_degree"] == 3
    loaded = [key for b in fake_backend for key in b.loads]  # configuration keys
    assert any(k.endswith("_tp3") for k in loaded), loaded
    assert not any("_tp2" in k for k in loaded), loaded
    (knob,) = got["report"]["knobs"]
    assert [v["label"] for v in knob["values"]] == ["TP 3"], knob


def job_runner_id(client: TestClient, public_id: str) -> int:
    from sqlalchemy import select

    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.screenings.models import Screening

    url = client.app.state.settings.database_url  # type: ignore[attr-defined]
    with session_scope(url) as s:
        return int(s.scalar(select(Screening.id).where(Screening.public_id == public_id)))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_sha256": "xyz"}, "model_sha256"),
        ({"prompts": []}, "prompts"),
        ({"prompts": [{"prompt": "a", "prompt_token_ids": [1]}]}, "prompts"),
        ({"prompts": [{"id": "x"}]}, "prompts"),
        ({"knobs": ["warp_drive"]}, "knobs"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"pair": ["bf16", "bf16"]}, "pair"),
        ({"pair": ["bf16", "fp64"]}, "pair"),
        ({"tau": -1}, "tau"),
        ({"cover": 0}, "cover"),
        ({"device": "tpu"}, "device"),
        ({"tp_degree": 1}, "tp_degree"),
        ({"tp_degree": 1025}, "tp_degree"),
        ({"tp_degree": "2"}, "tp_degree"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(
    client: TestClient,
    job_runner: JobRunner,
    headers: Callable[..., dict[str, str]],
    change: dict[str, Any],
    field: str,
) -> None:
    r = client.post("/v1/screenings", json=_body("a" * 64) | change, headers=headers("admin"))
    assert r.status_code == 422, r.text
    assert field in (r.json().get("field") or ""), r.text
    assert job_runner.specs == []


def test_cuda_on_an_embedded_deployment_without_a_gpu_is_refused(
    client: TestClient, job_runner: JobRunner, headers: Callable[..., dict[str, str]]
) -> None:
    if Path("/proc/driver/nvidia/version").exists():
        pytest.skip("this host has a GPU: cuda is accepted")
    r = client.post("/v1/screenings", json=_body("a" * 64, device="cuda"), headers=headers("admin"))
    assert r.status_code == 422 and r.json()["field"] == "device", r.text


def test_isolation_idempotency_and_a_missing_checkpoint(
    client: TestClient,
    job_runner: JobRunner,
    fake_backend: list[FakeWorkerBackend],
    fake_model_dir: Path,
    headers: Callable[..., dict[str, str]],
) -> None:
    admin = headers("admin")
    body = _body(weights_sha256(fake_model_dir), idempotency_key="k1")
    first = client.post("/v1/screenings", json=body, headers=admin)
    again = client.post("/v1/screenings", json=body, headers=admin)
    assert (first.status_code, again.status_code) == (201, 200)
    sid = first.json()["id"]
    assert again.json()["id"] == sid and len(job_runner.specs) == 1
    assert client.get(f"/v1/screenings/{sid}", headers=headers("admin", "beta")).status_code == 404
    assert client.get(f"/v1/screenings/{sid}", headers=headers("submitter")).status_code == 403
    assert client.get("/v1/screenings/sc_nope", headers=admin).status_code == 404
    # A checkpoint the API cannot find is refused: nothing would bound its work.
    r = client.post("/v1/screenings", json=_body("c" * 64), headers=admin)
    assert r.status_code == 422 and r.json()["field"] == "model_sha256", r.text
    assert "c" * 16 in r.json()["detail"] and len(job_runner.specs) == 1


def test_a_worker_without_the_checkpoint_fails_the_screening_saying_why(
    client: TestClient,
    job_runner: JobRunner,
    fake_backend: list[FakeWorkerBackend],
    fake_model_dir: Path,
    headers: Callable[..., dict[str, str]],
) -> None:
    admin = headers("admin")
    r = client.post("/v1/screenings", json=_body(weights_sha256(fake_model_dir)), headers=admin)
    (fake_model_dir / "model.safetensors").write_bytes(b"other weights")  # gone from the worker
    job_runner.run_all()
    got = client.get(f"/v1/screenings/{r.json()['id']}", headers=admin).json()
    assert got["status"] == "failed" and "no checkpoint with weights_sha256" in got["error"]
    assert fake_backend == []  # no engine was built for a checkpoint that is not there


def test_the_worker_checks_the_prompts_again_and_fails_without_retrying(
    client: TestClient,
    job_runner: JobRunner,
    fake_backend: list[FakeWorkerBackend],
    fake_model_dir: Path,
    headers: Callable[..., dict[str, str]],
) -> None:
    admin = headers("admin")
    r = client.post("/v1/screenings", json=_body(weights_sha256(fake_model_dir)), headers=admin)
    config = fake_model_dir / "config.json"  # the worker's copy has a smaller vocabulary
    config.write_text(config.read_text().replace('"vocab_size": 97', '"vocab_size": 10'))
    job_runner.run_all()
    got = client.get(f"/v1/screenings/{r.json()['id']}", headers=admin).json()
    assert got["status"] == "failed", got
    assert "prompt p0: token id 50 is outside the vocabulary (0 to 9)" in got["error"]
    assert fake_backend and not any(b.loads for b in fake_backend)  # no engine was loaded


def test_the_ui_page_shows_the_report_and_the_runs_list_links_it(
    client: TestClient,
    job_runner: JobRunner,
    fake_backend: list[FakeWorkerBackend],
    fake_model_dir: Path,
    headers: Callable[..., dict[str, str]],
    ui_client: Callable[..., TestClient],  # noqa: F811
) -> None:
    r = client.post(
        "/v1/screenings", json=_body(weights_sha256(fake_model_dir)), headers=headers("admin")
    )
    sid = r.json()["id"]
    job_runner.run_all()
    ui = ui_client("auditor")
    page = ui.get(f"/ui/screenings/{sid}")
    assert page.status_code == 200, page.text
    assert "Tier 1: large lift" in page.text and 'id="knobs"' in page.text
    assert "<style" not in page.text  # the served page uses the stylesheet (CSP: no inline)
    assert f"/screenings/{sid}" in ui.get("/ui/runs").text
    other = ui_client("auditor", "beta")
    assert other.get(f"/ui/screenings/{sid}").status_code == 404


def test_a_lost_screening_job_is_enqueued_again(
    client: TestClient,
    job_runner: JobRunner,
    fake_backend: list[FakeWorkerBackend],
    fake_model_dir: Path,
    headers: Callable[..., dict[str, str]],
) -> None:
    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.screenings.reconcile import reconcile_screenings

    r = client.post(
        "/v1/screenings", json=_body(weights_sha256(fake_model_dir)), headers=headers("admin")
    )
    sid = r.json()["id"]
    job_runner.specs.clear()  # the queue lost it (a Redis flush)
    url = client.app.state.settings.database_url  # type: ignore[attr-defined]
    with session_scope(url) as s:
        again = reconcile_screenings(s, job_runner, stale_after_s=900, job_timeout_s=60)
    assert again == [job_runner_id(client, sid)]
    with session_scope(url) as s:  # held now: nothing to do
        assert reconcile_screenings(s, job_runner, stale_after_s=900, job_timeout_s=60) == []
    job_runner.run_all()
    assert client.get(f"/v1/screenings/{sid}", headers=headers("admin")).json()["status"] == "done"


def test_a_running_screening_is_never_started_a_second_time(
    client: TestClient,
    job_runner: JobRunner,
    fake_backend: list[FakeWorkerBackend],
    fake_model_dir: Path,
    headers: Callable[..., dict[str, str]],
) -> None:
    """A screening running on one worker whose queued job Redis lost (a restart) is left
    alone by the reconciler, and a second start of it (enqueued again all the same) sees the
    first one's lease on the row and backs off: one attempt, one run."""
    import contextvars
    import threading

    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.screenings import tasks
    from replay_audit.screenings.models import Screening
    from replay_audit.screenings.reconcile import reconcile_screenings
    from tests.screenings.conftest import install_fake

    entered, release = threading.Event(), threading.Event()

    @dataclasses.dataclass
    class Blocking(FakeWorkerBackend):
        def platform(self) -> Any:  # the first start holds here until released
            if not entered.is_set():
                entered.set()
                release.wait(30)
            return super().platform()

    built: list[FakeWorkerBackend] = []
    install_fake(Blocking(), built)
    admin = headers("admin")
    r = client.post("/v1/screenings", json=_body(weights_sha256(fake_model_dir)), headers=admin)
    sid = r.json()["id"]
    screening_id = job_runner_id(client, sid)
    job_runner.specs.clear()  # Redis restarted: its job is gone
    run = contextvars.copy_context().run  # the thread sees the fakes installed here
    first = threading.Thread(target=run, args=(tasks.run_screening_job, screening_id))
    first.start()
    try:
        assert entered.wait(30)
        url = client.app.state.settings.database_url  # type: ignore[attr-defined]
        with session_scope(url) as s:
            assert reconcile_screenings(s, job_runner, stale_after_s=0, job_timeout_s=60) == []
        tasks.run_screening_job(screening_id)  # a second start while the first runs
        assert len(built) == 1  # it never reached the checkpoint
    finally:
        release.set()
        first.join(30)
    assert client.get(f"/v1/screenings/{sid}", headers=admin).json()["status"] == "done"
    with session_scope(url) as s:
        row = s.get(Screening, screening_id)
        assert row is not None and row.attempts == 1 and row.lease_until is None


def test_of_two_starts_at_the_same_moment_the_second_backs_off(
    client: TestClient,
    job_runner: JobRunner,
    fake_backend: list[FakeWorkerBackend],
    fake_model_dir: Path,
    headers: Callable[..., dict[str, str]],
) -> None:
    """A start that reads the row while another start's claim is not yet committed waits for
    it (the claim locks the row) and then sees its lease: it claims no attempt and never
    reaches the checkpoint. Before, on PostgreSQL it read the row as queued and ran beside the
    first."""
    import contextvars
    import threading

    from replay_audit.db.job_row import claim_row
    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.screenings import tasks
    from replay_audit.screenings.models import Screening

    r = client.post(
        "/v1/screenings", json=_body(weights_sha256(fake_model_dir)), headers=headers("admin")
    )
    screening_id = job_runner_id(client, r.json()["id"])
    url = client.app.state.settings.database_url  # type: ignore[attr-defined]
    run = contextvars.copy_context().run  # the thread sees the fakes installed here
    second = threading.Thread(target=run, args=(tasks.run_screening_job, screening_id))
    with session_scope(url) as s:  # the first start, inside its claiming transaction
        assert claim_row(s, Screening, screening_id, tasks.MAX_ATTEMPTS) is not None
        second.start()
        second.join(1.0)  # it waits on the row (or, before, read it as queued)
    second.join(30)
    assert not second.is_alive()
    assert fake_backend == []  # the second start never reached the checkpoint
    with session_scope(url) as s:
        row = s.get(Screening, screening_id)
        assert row is not None and row.attempts == 1 and row.status == "running"


def _outage(kind: str) -> Exception:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from sqlalchemy.exc import OperationalError

    if kind == "database":
        return OperationalError("SELECT 1", {}, Exception("server closed the connection"))
    return RedisConnectionError("Error 111 connecting to redis:6379. Connection refused.")


@pytest.mark.parametrize("kind", ["database", "redis"])
def test_a_database_or_redis_blip_is_waited_out_without_spending_an_attempt(
    kind: str,
    client: TestClient,
    job_runner: JobRunner,
    fake_backend: list[FakeWorkerBackend],
    fake_model_dir: Path,
    headers: Callable[..., dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The database or Redis away for a moment (twice, here) mid-screening: the job tries
    again after a backoff, in the same attempt, says why, and finishes."""
    from replay_audit.db import job_row
    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.screenings.models import Screening
    from tests.screenings.conftest import install_fake

    monkeypatch.setattr(job_row, "OUTAGE_BACKOFF_S", (0.01,))
    blips = [_outage(kind), _outage(kind)]

    @dataclasses.dataclass
    class Blipping(FakeWorkerBackend):
        def platform(self) -> Any:
            if blips:
                raise blips.pop()
            return super().platform()

    install_fake(Blipping(), [])
    admin = headers("admin")
    r = client.post("/v1/screenings", json=_body(weights_sha256(fake_model_dir)), headers=admin)
    sid = r.json()["id"]
    job_runner.run_all()
    got = client.get(f"/v1/screenings/{sid}", headers=admin).json()
    assert got["status"] == "done", got["error"]
    url = client.app.state.settings.database_url  # type: ignore[attr-defined]
    with session_scope(url) as s:
        row = s.get(Screening, job_runner_id(client, sid))
        assert row is not None and row.attempts == 1
    said = [m for m in caplog.messages if "no attempt spent" in m]
    assert len(said) == 2 and ("database" if kind == "database" else "Redis") in said[0], said


def test_a_stopped_screening_job_resumes_at_the_first_undecoded_prompt(
    client: TestClient,
    job_runner: JobRunner,
    fake_backend: list[FakeWorkerBackend],
    fake_model_dir: Path,
    headers: Callable[..., dict[str, str]],
) -> None:
    import dataclasses

    from sqlalchemy import select

    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.screenings import tasks
    from replay_audit.screenings.models import ScreeningOutput
    from replay_audit.screenings.sweep.plan import ScreenConfig
    from tests.screenings.sweep.test_resume import CountingBackend, Stopped

    @dataclasses.dataclass
    class Counting(CountingBackend, FakeWorkerBackend):
        pass

    from tests.screenings.conftest import install_fake

    fp16, stop_at = ScreenConfig("fp16").key, 7
    built: list[FakeWorkerBackend] = []

    admin = headers("admin")
    r = client.post("/v1/screenings", json=_body(weights_sha256(fake_model_dir)), headers=admin)
    sid = r.json()["id"]
    screening_id = job_runner_id(client, sid)
    install_fake(Counting(stop=(fp16, stop_at)), built)
    with pytest.raises(Stopped):  # the worker stopped while prompt 7 of the fp16 run decoded
        tasks.run_screening_job(screening_id)
    url = client.app.state.settings.database_url  # type: ignore[attr-defined]
    with session_scope(url) as s:
        keys = set(
            s.scalars(
                select(ScreeningOutput.key).where(ScreeningOutput.screening_id == screening_id)
            )
        )
    assert {k for k in keys if k.startswith(f"decode/{fp16}/")} == {
        f"decode/{fp16}/{i}" for i in range(stop_at)
    }
    assert f"run/{fp16}" not in keys
    again = Counting()
    install_fake(again, built)
    tasks.run_screening_job(screening_id)
    got = client.get(f"/v1/screenings/{sid}", headers=admin).json()
    assert got["status"] == "done", got["error"]
    for i in range(N_PROMPTS):
        # fp16 without intervention resumed at prompt 7; fp16+C decoded every prompt.
        n = again.decoded[(fp16, (i, 50, 60))]
        assert n == (1 if i < stop_at else 2), (i, n)
    assert not any(k == ScreenConfig("fp32").key for k, _ in again.decoded)
    assert got["report"]["tier"]["tier"] == 1
    assert got["report"]["head_vs_body"]["lift"]["lift"] == pytest.approx(len(HEAD) / N_PROMPTS)


# -- bounded work (issue 20): the API reads the checkpoint's config.json and tokenizer.json --

TINY = weights_sha256(BUNDLED_MODEL_DIR)  # vocab 4096, context 512


@pytest.mark.parametrize(
    ("prompt", "field", "says"),
    [
        ({"prompt": "a" * 100_000}, "prompts[1].prompt", "context of 512"),  # refused untokenized
        ({"prompt": "hello world " * 300}, "prompts[1].prompt", "exceed the checkpoint's context"),
        ({"prompt_token_ids": [4096, 99999]}, "prompts[1].prompt_token_ids", "token id 4096"),
        ({"prompt_token_ids": [5] * 449}, "prompts[1].prompt_token_ids", "449 prompt tokens"),
    ],
)
def test_a_prompt_past_the_context_or_the_vocabulary_is_a_422_naming_it(
    client: TestClient,
    job_runner: JobRunner,
    headers: Callable[..., dict[str, str]],
    prompt: dict[str, Any],
    field: str,
    says: str,
) -> None:
    body = {"model_sha256": TINY, "prompts": [{"prompt": "fine"}, prompt], "max_new_tokens": 64}
    started = time.perf_counter()
    r = client.post("/v1/screenings", json=body, headers=headers("admin"))
    elapsed = time.perf_counter() - started
    assert r.status_code == 422 and r.json()["field"] == field, r.text
    assert says in r.json()["detail"] and job_runner.specs == []
    assert elapsed < 5, elapsed  # 100k characters: refused in milliseconds, not tokenized


def test_prompts_that_fit_are_accepted_and_the_budget_bounds_the_whole_request(
    client: TestClient, job_runner: JobRunner, headers: Callable[..., dict[str, str]]
) -> None:
    admin = headers("admin")
    fits = [{"prompt_token_ids": [5] * 448}, {"prompt": "hello world " * 50}]
    body = {"model_sha256": TINY, "prompts": fits, "max_new_tokens": 64}
    r = client.post("/v1/screenings", json=body, headers=admin)
    assert r.status_code == 201, r.text
    # 256 prompts of 448 tokens, every knob: far past the budget (the CPU's: this embedded
    # deployment runs it on its CPU).
    body["prompts"] = [{"prompt_token_ids": [5] * 448}] * 256
    r = client.post("/v1/screenings", json=body, headers=admin)
    assert r.status_code == 422 and r.json()["field"] == "prompts", r.text
    assert "REPLAY_AUDIT_SCREENING_CPU_TOKEN_BUDGET" in r.json()["detail"]
    body["knobs"] = ["tf32"]  # a smaller plan: fewer prompts fit
    body["prompts"] = [{"prompt_token_ids": [5] * 448}] * 64
    assert client.post("/v1/screenings", json=body, headers=admin).status_code == 201


def test_a_screening_on_a_cpu_is_bounded_by_the_cpu_budget(
    client: TestClient, job_runner: JobRunner, headers: Callable[..., dict[str, str]]
) -> None:
    """Issue 33: work is bounded by its cost on the device that runs it. A CPU decodes hundreds
    of times slower than a GPU (2,000,000 positions held a 2-core worker for 44 minutes): a
    screening that runs on a CPU (this embedded deployment has no CUDA device) is held to
    REPLAY_AUDIT_SCREENING_CPU_TOKEN_BUDGET, a GPU's to the larger one."""
    from replay_audit.config import WorkBudget
    from replay_audit.queue.runner import Capabilities, JobQueue
    from replay_audit.screenings.schemas import ScreeningCreate
    from replay_audit.screenings.service import check_work
    from replay_audit.worker.checkpoint import CheckpointShape

    admin = headers("admin")
    # 256 prompts of 448 + 64 tokens, two runs of the tf32 plan: 262,144 positions, under the
    # GPU's 2,000,000 and past the CPU's 200,000.
    prompts = [{"prompt_token_ids": [5] * 448}] * 256
    body = {"model_sha256": TINY, "prompts": prompts, "max_new_tokens": 64, "knobs": ["tf32"]}
    r = client.post("/v1/screenings", json=body, headers=admin)
    assert r.status_code == 422 and r.json()["field"] == "prompts", r.text
    assert "REPLAY_AUDIT_SCREENING_CPU_TOKEN_BUDGET (200000)" in r.json()["detail"]
    assert job_runner.specs == []
    # Where it runs on a GPU, the same work is within the GPU's budget.
    request = ScreeningCreate.model_validate(body | {"device": "cuda"})
    gpu_budget = WorkBudget(2_000_000, "REPLAY_AUDIT_SCREENING_TOKEN_BUDGET")
    check_work(request, CheckpointShape.read(BUNDLED_MODEL_DIR), gpu_budget)
    gpu = JobQueue(job_runner, 60, Capabilities("rq", cuda=False), default_queue="gpu")
    cpu = JobQueue(job_runner, 60, Capabilities("inprocess", cuda=False))
    assert not gpu.runs_on_cpu(None) and gpu.runs_on_cpu("cpu") and cpu.runs_on_cpu(None)
    assert not gpu.runs_on_cpu("cuda") and not JobQueue(
        job_runner, 60, Capabilities("inprocess", cuda=True)
    ).runs_on_cpu(None)


@pytest.mark.parametrize("broken", ["config.json", "tokenizer.json"])
def test_a_checkpoint_whose_shape_cannot_be_read_is_a_422_on_model_sha256(
    client: TestClient,
    job_runner: JobRunner,
    fake_model_dir: Path,
    headers: Callable[..., dict[str, str]],
    broken: str,
) -> None:
    (fake_model_dir / broken).write_text("{not json")
    r = client.post("/v1/screenings", json=_body(weights_sha256(fake_model_dir)), headers=headers())
    assert r.status_code == 422 and r.json()["field"] == "model_sha256", r.text
    assert "config.json" in r.json()["detail"] and job_runner.specs == []


def test_a_screening_without_a_device_goes_to_the_default_queue(
    make_client: Callable[..., TestClient], headers: Callable[..., dict[str, str]]
) -> None:
    queues = {}
    for default in ("cpu", "gpu"):
        client = make_client(default_queue=default)
        runner = JobRunner()
        client.app.state.queue = dataclasses.replace(client.app.state.queue, runner=runner)  # type: ignore[attr-defined]
        body = {"model_sha256": TINY, "prompts": [{"prompt_token_ids": [5, 6]}]}
        assert client.post("/v1/screenings", json=body, headers=headers()).status_code == 201
        queues[default] = runner.specs[0].queue
    assert queues == {"cpu": "cpu-long", "gpu": "gpu-long"}


def test_a_screening_failing_every_attempt_gives_up_naming_what_it_raised(
    client: TestClient,
    job_runner: JobRunner,
    fake_backend: list[FakeWorkerBackend],
    fake_model_dir: Path,
    headers: Callable[..., dict[str, str]],
) -> None:
    """Issue 33: an attempt that raises an error the job does not handle is retried; once the
    attempts are spent the screening fails naming the last error, not 'worker killed or
    crashing', which stays for a worker that died without a word."""
    from replay_audit.screenings import tasks

    admin = headers("admin")
    r = client.post("/v1/screenings", json=_body(weights_sha256(fake_model_dir)), headers=admin)
    sid = r.json()["id"]
    screening_id = job_runner_id(client, sid)

    def broken(model_dir: Path, device: str | None) -> Any:
        raise TypeError("a bug in the facts factory")

    tasks.install_facts_factory(broken)
    for _ in range(tasks.MAX_ATTEMPTS):
        with pytest.raises(TypeError):
            tasks.run_screening_job(screening_id)
        got = client.get(f"/v1/screenings/{sid}", headers=admin).json()
        assert got["status"] == "running"
    tasks.run_screening_job(screening_id)  # the next start gives up
    got = client.get(f"/v1/screenings/{sid}", headers=admin).json()
    assert got["status"] == "failed"
    assert got["error"] == (
        f"gave up after {tasks.MAX_ATTEMPTS} attempts; the last said "
        "TypeError: a bug in the facts factory"
    )
