"""Worker-side commands: worker, scheduler, reconcile."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Annotated, Any, Final

import typer

from replay_audit.cli.root import app
from replay_audit.config import get_settings
from replay_audit.formats import CACHE_KINDS
from replay_audit.queue.route import CPU_KIND, WorkerKind
from replay_audit.words import counted

log = logging.getLogger(__name__)

#: `replay-audit worker`'s exit status when its work loop ended without a stop asked for
#: (Redis failed it): a supervisor's `Restart=on-failure` starts it again. 0: asked to stop.
EXIT_LOOP_FAILED: Final = 1


@app.command()
def worker(
    queue: Annotated[
        list[str],
        typer.Option(
            "--queue",
            "-q",
            help="Queue(s) to serve: gpu, cpu. Targets with device cuda go to gpu, cpu to cpu, "
            "and those naming no device to REPLAY_AUDIT_DEFAULT_QUEUE (gpu unless set): on a "
            "deployment with CPU workers only, set it to cpu. A GPU worker serving gpu also "
            "serves its own kind's queue first (gpu:KIND, e.g. gpu:a10g: replays of traces "
            "logged on that kind). Screenings and verifications (long "
            "jobs) wait on gpu-long and cpu-long: a worker serves the long queue of each queue "
            "named, after every short one, so a replay run never waits behind them; name a "
            "-long queue and it serves exactly the queues named.",
        ),
    ] = ["gpu"],  # noqa: B006 (typer reads the default, never mutates it)
    burst: Annotated[bool, typer.Option(help="Exit when the queues are empty.")] = False,
    device: Annotated[
        str | None, typer.Option(help="cpu, cuda or cuda:N (default: CUDA when available).")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Worker name shown by `rq info`.")] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help="Port of this worker's Prometheus metrics on REPLAY_AUDIT_METRICS_HOST "
            "(default REPLAY_AUDIT_WORKER_METRICS_PORT, 9101; 0: none). One per worker of a host."
        ),
    ] = None,
    gpu_name: Annotated[
        str | None,
        typer.Option(
            help="Announce this GPU name (and its kind: `NVIDIA A10G` -> a10g) instead of the "
            "device's: routing tests on a CPU, or a GPU whose driver name should group with "
            "another's. The results record the announced kind as the one that ran.",
        ),
    ] = None,
    gpu_sm: Annotated[
        str | None,
        typer.Option(help="The compute capability announced with --gpu-name (e.g. 8.6)."),
    ] = None,
    kv_cache: Annotated[
        str | None,
        typer.Option(
            help="The decode path: piecewise (the default: bitwise as transformers generate(), "
            "CUDA graphs around the attention on a GPU) or compiled (torch.compile + CUDA "
            "graph: faster, may flip near-ties); recorded per result."
        ),
    ] = None,
    devices: Annotated[
        int,
        typer.Option(
            min=1,
            help="Devices this worker owns, announced with its kind: it serves the TP queues "
            "up to this degree (gpu:KIND:tp2, ...) and replays a TP k job on a group of k "
            "processes it starts, one per GPU (cuda:0..k-1 of CUDA_VISIBLE_DEVICES, NCCL), or "
            "on the CPU k processes (gloo; a host without CUDA). Needs accelerate when above 1.",
        ),
    ] = 1,
    processes: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="Worker processes on this device, each taking jobs of its own and holding its "
            "own copy of the checkpoints (default REPLAY_AUDIT_WORKER_PROCESSES, else 2 on a GPU "
            "of one device: one's CPU and database work overlaps the other's GPU work, 1.25x "
            "measured on an H200; 1 on a CPU or with --devices above 1). Above 1, this process "
            "supervises them: it passes SIGTERM/SIGINT on, and exits 1 when one exits non-zero "
            "unasked, after stopping the others. Under CUDA MPS more help decodes (3.2x at 8).",
        ),
    ] = None,
    member: Annotated[
        str | None,
        typer.Option(hidden=True, help="i/K: process i of a group of K (set by its supervisor)."),
    ] = None,
) -> None:
    """Run an RQ worker that replays traces (`REPLAY_AUDIT_RUNNER=rq`).

    One process per GPU (`CUDA_VISIBLE_DEVICES`), or per group of GPUs for tensor-parallel
    replays (--devices N: this process is rank 0 and starts ranks 1..k-1 for a TP k job, kept
    while it replays at that degree). It is a SimpleWorker: jobs run in this process, so each
    checkpoint is loaded once and stays loaded (forking after CUDA initialisation is unsafe,
    and reloading per job would dominate the time). With --processes K above 1 this process
    starts K such workers (`python -m replay_audit worker ... --processes 1`) and supervises
    them (`cli.worker_group`)."""
    from redis import Redis
    from redis.exceptions import RedisError
    from rq import Queue

    from replay_audit.cli.database import fail, ready_database
    from replay_audit.engine.pool import EnginePool
    from replay_audit.queue import rq_name
    from replay_audit.queue.runner import served_queues
    from replay_audit.queue.state import (
        announce_worker,
        forget_worker,
        keep_alive,
        register_again,
    )
    from replay_audit.telemetry.log import configure_logging
    from replay_audit.telemetry.metric import MODEL_LOADS, start_metrics_server
    from replay_audit.worker.context import MAX_ENGINES, WorkerContext, install_worker_context

    settings = get_settings()
    if kv_cache is not None and kv_cache not in CACHE_KINDS:
        raise typer.BadParameter(", ".join(CACHE_KINDS), param_hint="--kv-cache")
    ready_database(settings)  # every job opens it: an unusable one fails here, once
    configure_logging(settings.log_format, process=member)
    if gpu_sm is not None and gpu_name is None:
        raise typer.BadParameter("give --gpu-name with it", param_hint="--gpu-sm")
    count = processes if processes is not None else settings.worker_processes
    if member is None and count != 1:
        from replay_audit.cli.worker_group import default_processes, run_group

        gpu = _uses_cuda(device)
        count = count if count is not None else default_processes(gpu, devices)
        if count > 1:
            # The group's own options; each process gets its name, place and metrics from it.
            common = [f"--queue={q}" for q in queue] + ["--burst" if burst else "--no-burst"]
            common += [f"--devices={devices}"]
            for option, value in (
                ("--device", device),
                ("--gpu-name", gpu_name),
                ("--gpu-sm", gpu_sm),
                ("--kv-cache", kv_cache),
            ):
                if value is not None:
                    common.append(f"{option}={value}")
            port = settings.worker_metrics_port if metrics_port is None else metrics_port
            log.info(
                "worker group: %d worker processes on %s, each serving %s",
                count,
                device or ("cuda" if gpu else "cpu"),
                ", ".join(queue),
            )
            ok = run_group(
                common,
                count,
                name=name,
                gpu=gpu,
                torch_threads=settings.torch_threads,
                metrics=(settings.metrics_host, port)
                if settings.metrics_enabled and port
                else None,
            )
            raise typer.Exit(0 if ok else EXIT_LOOP_FAILED)
    announced, cuda_device = _worker_kind(device, devices)
    if gpu_name is not None:
        try:
            announced = WorkerKind.gpu(gpu_name, gpu_sm, announced.devices)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--gpu-name") from e
    gpu_kind = announced.kind
    pool = EnginePool(
        max_engines=MAX_ENGINES,
        device=device,
        cache=kv_cache,
        threads=settings.torch_threads,
        on_load=MODEL_LOADS.inc,
        devices=announced.devices,
    )
    install_worker_context(WorkerContext(settings, pool, gpu_kind))
    if settings.default_queue not in queue:
        # Said once, where a CPU-only deployment looks: its runs would wait on `gpu` forever.
        logging.getLogger(__name__).warning(
            "replay targets that name no device go to the %r queue "
            "(REPLAY_AUDIT_DEFAULT_QUEUE), which this worker does not serve (--queue %s); "
            "on a deployment without GPU workers set REPLAY_AUDIT_DEFAULT_QUEUE=%s for the API",
            settings.default_queue,
            " --queue ".join(queue),
            queue[0],
        )
    port = settings.worker_metrics_port if metrics_port is None else metrics_port
    if settings.metrics_enabled and port:
        try:
            start_metrics_server(settings.metrics_host, port)  # a daemon thread, ends with us
        except OSError as e:
            fail(
                f"cannot serve metrics on {settings.metrics_host}:{port} ({e.strerror}): each "
                "worker of a host needs its own --metrics-port (0: none)"
            )
        logging.getLogger(__name__).info(
            "metrics on http://%s:%d/metrics", settings.metrics_host, port
        )
    connection = Redis.from_url(settings.redis_url)
    served = served_queues(queue, announced)
    queues = [Queue(rq_name(settings, q), connection=connection) for q in served]
    w = _worker_class(gpu_kind, cuda_device)(queues, connection=connection, name=name)
    announce_worker(connection, settings.queue_prefix, w.name, announced)
    logging.getLogger(__name__).info(
        "worker %s: %s; serves %s", w.name, announced.describe(), ", ".join(served)
    )
    stop_alive = threading.Event()

    def announce() -> None:  # again, after Redis lost its records (a restart, a flush)
        announce_worker(connection, settings.queue_prefix, w.name, announced)
        register_again(w)

    keep_alive(connection, settings.queue_prefix, w.name, stop_alive, announce)
    _children_die_with_us()
    failure = None
    try:
        # with_scheduler: RQ's Retry intervals need a scheduler to move retries back.
        w.work(burst=burst, with_scheduler=True)
    except RedisError as e:  # RQ's goodbye to a Redis still away
        failure = f"{type(e).__name__}: {e}"
    finally:
        stop_alive.set()
        with contextlib.suppress(RedisError):  # Redis may be what ended it: nothing to forget
            forget_worker(connection, settings.queue_prefix, w.name)
        pool.close()  # a tensor-parallel group's ranks stop with the worker
    if failure is not None or not (w.stop_asked or w.drained):
        # RQ's work loop returns, as if asked to stop, when Redis fails it (a timeout, a lost
        # connection) or anything else it did not expect: a supervisor restarting on failure
        # (systemd's Restart=on-failure) must see one.
        log.error(
            "worker %s: its work loop ended on an error (%s), not asked to stop; exiting %d "
            "for a supervisor to start it again",
            w.name,
            failure or "RQ's log above says which",
            EXIT_LOOP_FAILED,
        )
        raise typer.Exit(EXIT_LOOP_FAILED)


#: prctl(2)'s option: the signal a process gets when its parent dies.
_PR_SET_PDEATHSIG = 1


def _children_die_with_us() -> None:
    """Every process this one forks from now on (RQ's scheduler) gets SIGTERM when this process
    dies, however it dies: Linux's PR_SET_PDEATHSIG, set in the child right after the fork. A
    scheduler left running would hold its queues' scheduler locks, and no other worker's
    scheduler would move their retries back. Elsewhere than Linux, nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    parent = [os.getpid()]

    def before() -> None:
        parent[0] = os.getpid()  # the forking process, whichever generation it is

    def in_child() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent[0]:  # the parent died before the prctl took hold
            os.kill(os.getpid(), signal.SIGTERM)

    os.register_at_fork(before=before, after_in_child=in_child)


def _uses_cuda(device: str | None) -> bool:
    """Whether a worker given `device` replays on a GPU (`_worker_kind` chooses it so), asked
    without initialising CUDA: a supervisor of worker processes initialises none."""
    if device is not None:
        return device != "cpu" and device.startswith("cuda")
    import torch

    return bool(torch.cuda.is_available())


def _worker_kind(device: str | None, devices: int = 1) -> tuple[WorkerKind, str | None]:
    """What the worker announces (its GPU, or `cpu`, and `devices` checked against this host)
    and its CUDA device, if any. N > 1 devices are cuda:0..N-1, all of one kind, or N CPU
    processes on a host without CUDA."""
    if devices > 1:
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            raise typer.BadParameter(
                "tensor parallel needs the accelerate package (transformers' tp_plan "
                "loading): pip install 'replay-audit[tp]'",
                param_hint="--devices",
            )
    if device == "cpu":
        return _cpu_kind(devices), None
    import torch

    if device is None and not torch.cuda.is_available():
        return _cpu_kind(devices), None
    cuda = torch.device(device or "cuda")
    if cuda.type != "cuda":
        return _cpu_kind(devices), None
    index = cuda.index if cuda.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    name = torch.cuda.get_device_name(index)
    if devices > 1:
        seen = torch.cuda.device_count()
        if index != 0 or seen < devices:
            raise typer.BadParameter(
                f"a worker of {devices} devices owns cuda:0..{devices - 1} (it sees "
                f"{counted(seen, 'GPU')}, and was given {cuda}): give it its GPUs with "
                "CUDA_VISIBLE_DEVICES",
                param_hint="--devices",
            )
        names = {torch.cuda.get_device_name(i) for i in range(devices)}
        if len(names) > 1:
            raise typer.BadParameter(
                f"a worker's GPUs are of one kind; cuda:0..{devices - 1} are {sorted(names)}",
                param_hint="--devices",
            )
    return WorkerKind.gpu(name, f"{major}.{minor}", devices), f"cuda:{index}"


def _cpu_kind(devices: int) -> WorkerKind:
    """A CPU worker of `devices` processes (more than one only on a host without CUDA:
    transformers' TP loading places every rank on the host's accelerator)."""
    if devices > 1:
        import torch

        if torch.cuda.is_available():
            raise typer.BadParameter(
                "CPU tensor parallel runs only on a host without CUDA: give this worker GPUs "
                "(--device cuda) or --devices 1",
                param_hint="--devices",
            )
    return WorkerKind(CPU_KIND, devices=devices)


def _worker_class(gpu_kind: str, cuda_device: str | None) -> type[Any]:
    """RQ's SimpleWorker, each job counted and timed (`telemetry.metric.observe_job`), its log
    lines carrying its job id, and the GPU's memory read after it; it says why its work loop
    ended (`stop_asked`, `drained`)."""
    from rq import SimpleWorker

    from replay_audit.telemetry.log import bound
    from replay_audit.telemetry.metric import GPU_MEMORY, job_kind, observe_job

    class ObservedWorker(SimpleWorker):
        #: Why its work loop may end well: a stop asked for (SIGTERM, SIGINT, `rq shutdown`,
        #: which signals it) or, in burst mode, no job left. Otherwise an error ended it.
        stop_asked = False
        drained = False

        def request_stop(self, signum: Any, frame: Any) -> None:
            self.stop_asked = True
            super().request_stop(signum, frame)  # type: ignore[no-untyped-call]  # rq

        def dequeue_job_and_maintain_ttl(self, *args: Any, **kwargs: Any) -> Any:
            job = super().dequeue_job_and_maintain_ttl(*args, **kwargs)
            self.drained = job is None
            return job

        def perform_job(self, job: Any, queue: Any, execution: Any) -> bool:
            kind = job_kind(job.func_name)
            with bound(job_id=job.id), observe_job(kind, gpu_kind) as attempt:
                ok = bool(super().perform_job(job, queue, execution))
                attempt.failed = not ok
            if cuda_device is not None:
                import torch

                allocated = torch.cuda.memory_allocated(cuda_device)
                GPU_MEMORY.labels(gpu_kind, "allocated").set(allocated)
                GPU_MEMORY.labels(gpu_kind, "reserved").set(torch.cuda.memory_reserved(cuda_device))
            return ok

    return ObservedWorker


@app.command()
def reconcile(
    stale_after_s: Annotated[
        float,
        typer.Option(
            help="A running job silent this long is presumed stuck, unless it holds a lease "
            "(a job that runs renews its lease; a dead worker's job is taken 15 to 20 s after "
            "its death: docs/operations.md)."
        ),
    ] = 900.0,
) -> None:
    """Re-enqueue unfinished replay jobs, screenings and verifications that no runner holds.

    The database says they are unfinished, but no runner holds them (after a Redis flush, or a
    worker killed mid-job). With the embedded in-process runner the jobs run in this process,
    and the command waits for them (Ctrl-C stops them cleanly)."""
    from replay_audit.audits.tasks import reconcile_jobs
    from replay_audit.cli.database import ready_database
    from replay_audit.cli.shutdown import own
    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.queue import build_runner, stop_runner
    from replay_audit.queue.runner import InProcessRunner

    settings = get_settings()
    ready_database(settings)
    runner = build_runner(settings)
    own(lambda timeout_s: stop_runner(runner, timeout_s))
    with session_scope(settings.database_url) as session:
        again = reconcile_jobs(session, runner, settings, stale_after_s=stale_after_s)
    typer.echo(f"re-enqueued {counted(len(again), 'job')}" + (f": {again}" if again else ""))
    if again and isinstance(runner, InProcessRunner):
        runner.join()
        typer.echo("done")


@app.command()
def scheduler(
    interval_s: Annotated[
        float | None,
        typer.Option(help="Seconds between ticks (default REPLAY_AUDIT_AUDIT_TICK_INTERVAL_S)."),
    ] = None,
    stale_after_s: Annotated[float, typer.Option()] = 900.0,
) -> None:
    """The audit scheduler as a plain loop, for deployments without `rq cron`.

    Every tick it starts due audit runs, evaluates finished ones, delivers alerts and
    reconciles the queue with the database (production runs `rq cron
    replay_audit.audits.cron_config` instead; running both is harmless, the database's unique
    keys decide)."""
    from replay_audit.audits.tasks import build_alert_runner, run_tick
    from replay_audit.cli.database import ready_database, shown_url
    from replay_audit.cli.shutdown import own
    from replay_audit.queue import build_runner, stop_runner
    from replay_audit.telemetry.log import configure_logging

    settings = get_settings()
    ready_database(settings)
    configure_logging(settings.log_format)
    runner = build_runner(settings)
    alerts = build_alert_runner(settings)
    own(lambda timeout_s: stop_runner(runner, timeout_s))
    own(lambda timeout_s: stop_runner(alerts, timeout_s))
    interval = settings.audit_tick_interval_s if interval_s is None else interval_s
    log = logging.getLogger("replay_audit.scheduler")
    url = settings.database_url
    log.info("audit scheduler: a tick every %g s (database %s)", interval, shown_url(url))
    while True:
        try:
            report = run_tick(
                settings, runner=runner, alert_runner=alerts, stale_after_s=stale_after_s
            )
            log.info(report.summary())  # every tick, so an operator sees it is alive
        except Exception:  # keep the loop alive: the next pass retries
            log.exception("scheduler tick failed")
        time.sleep(interval)
