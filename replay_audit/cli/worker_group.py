"""`replay-audit worker --processes K`: K worker processes on one device, and the process that
supervises them.

Each of the K is a plain `replay-audit worker` (`--processes 1`), started with the group's
options: the same queues, the same device (the one a lone worker would choose, from `--device`
and `CUDA_VISIBLE_DEVICES`), its own RQ name (`NAME-i` where `--name NAME`) and its log lines
tagged `[process i/K]`. The supervisor runs no job and initialises no CUDA. It

- passes each SIGTERM and SIGINT it gets to every process (RQ's warm shutdown; a second one is
  a cold shutdown, as for a lone worker; RQ ignores the copy of a signal that reached a process
  twice within a second, as when a terminal's Ctrl-C or systemd's stop reaches every process of
  the group and the supervisor passes it on);
- restarts nothing: when a process exits non-zero without a stop asked for, it stops the others
  (warm) and exits 1, so that a supervisor of its own (systemd's `Restart=on-failure`) starts
  the whole group again. A process that exits 0 (`rq shutdown` of that worker, `--burst` with
  no job left) leaves the others running; the group exits 0 when all have exited 0;
- serves the group's metrics, every process's values added up, on the one metrics port
  (prometheus-client's multiprocess mode: each process counts into files of a directory of
  the group's own, removed when it exits);
- makes every process get SIGTERM if the supervisor dies (Linux's PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Final

log = logging.getLogger(__name__)

#: The measured defaults of `--processes` (REPLAY_AUDIT_WORKER_PROCESSES unset). A GPU worker
#: of one device: two processes, one building and writing its results (CPU and database work)
#: while the other's forwards run: 1.25x a lone worker's scan-only audit on an H200 without
#: MPS (BENCHMARKS.md, "Two workers on one GPU"). Four reach 519,856 traces/h time-sliced and
#: 582,666 under CUDA MPS ("The scan-only audit past 500,000 traces/h") but hold four copies of
#: the models, which a large model on a smaller GPU cannot; decodes gain more from more
#: processes under MPS (3.2x at 8 on an H100: "Faithful decode overlapped"). --processes sets K.
GPU_WORKER_PROCESSES: Final = 2
#: A CPU worker (and a tensor-parallel one, whose ranks already hold a process per device):
#: one. A CPU replay keeps every core busy itself (torch's threads), so a second process has
#: no idle device to fill and halves each one's cores (this project's CPU machines have 2).
CPU_WORKER_PROCESSES: Final = 1

#: Seconds between the supervisor's looks at its processes.
_POLL_S: Final = 0.2
#: prctl(2)'s option: the signal a process gets when its parent dies.
_PR_SET_PDEATHSIG: Final = 1
#: The signals passed on to every process: a stop (RQ: warm, then cold).
_STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)


def default_processes(gpu: bool, devices: int) -> int:
    """`--processes` when neither the option nor REPLAY_AUDIT_WORKER_PROCESSES gives it."""
    return GPU_WORKER_PROCESSES if gpu and devices == 1 else CPU_WORKER_PROCESSES


def member_argv(common: Sequence[str], index: int, count: int, name: str | None) -> list[str]:
    """The `replay-audit worker` options of process `index` (1-based) of `count`: the group's
    own (`common`), one process each, its name, no metrics port of its own (the supervisor
    serves the group's), and its place in the group for its log lines."""
    argv = [*common, "--processes", "1", "--metrics-port", "0", "--member", f"{index}/{count}"]
    if name is not None:
        argv += ["--name", f"{name}-{index}"]
    return argv


def member_env(
    base: dict[str, str], count: int, gpu: bool, torch_threads: int | None
) -> dict[str, str]:
    """A process's environment: the group's, and on a CPU worker whose torch threads are not
    set, the cores shared out (`cores // count`, at least 1) instead of every process taking
    all of them."""
    env = dict(base)
    if not gpu and torch_threads is None:
        cores = os.cpu_count() or 1
        env["REPLAY_AUDIT_TORCH_THREADS"] = str(max(1, cores // count))
    return env


@dataclass
class _Member:
    index: int
    count: int
    process: subprocess.Popen[bytes]
    exited: bool = False

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count} (pid {self.process.pid})"


@dataclass
class _Group:
    """The processes, and the stop signals sent to them (passed on, or the supervisor's own)."""

    members: list[_Member]
    metrics_dir: Path | None
    #: The stop signals this process got from outside.
    asked: list[int]
    sent: set[int]

    def stop(self, sig: int) -> None:
        self.sent.add(sig)
        for m in self.members:
            if not m.exited:
                m.process.send_signal(sig)  # a no-op on one already reaped

    def wait(self) -> bool:
        """Wait until every process has exited; whether all exited well: 0, or killed by a
        stop signal sent to them (one that came before RQ's handlers were in place). One that
        exits otherwise with no stop asked for stops the others (warm)."""
        ok = True
        while True:
            alive = 0
            for m in self.members:
                if m.exited:
                    continue
                code = m.process.poll()
                if code is None:
                    alive += 1
                    continue
                m.exited = True
                if self.metrics_dir is not None:  # its live gauges go; its counts stay
                    from prometheus_client import multiprocess

                    multiprocess.mark_process_dead(m.process.pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]
                if code == 0 or -code in self.sent:
                    log.info("worker group: process %s exited %d", m.label, code)
                    continue
                if not self.asked and not self.sent:
                    others = [o for o in self.members if not o.exited]
                    log.error(
                        "worker group: process %s exited %d, not asked to stop; stopping the "
                        "other %d (after their current jobs) and exiting 1 for a supervisor "
                        "to start the group again",
                        m.label,
                        code,
                        len(others),
                    )
                    self.stop(signal.SIGTERM)
                else:
                    log.error("worker group: process %s exited %d", m.label, code)
                ok = False
            if alive == 0:
                return ok
            time.sleep(_POLL_S)


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec function giving the child SIGTERM when this process dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def in_child() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the supervisor died before the prctl took hold
            os._exit(1)

    return in_child


def run_group(
    common: Sequence[str],
    count: int,
    *,
    name: str | None,
    gpu: bool,
    torch_threads: int | None,
    metrics: tuple[str, int] | None,
) -> bool:
    """Start `count` worker processes with the options `common` and supervise them until all
    have exited; whether all exited well (0, or stopped by a stop signal sent to them).
    `metrics`: the host and port to serve the group's metrics on, or None."""
    from replay_audit.cli.database import fail
    from replay_audit.telemetry.multiprocess import MULTIPROC_ENV

    # The group's own directory, new, whatever PROMETHEUS_MULTIPROC_DIR says: one inherited
    # may be an API's (`serve --workers N`), whose scrapes the processes' files would join.
    env = {k: v for k, v in os.environ.items() if k != MULTIPROC_ENV}
    metrics_dir: Path | None = None
    if metrics is not None:
        metrics_dir = Path(tempfile.mkdtemp(prefix="replay-audit-worker-metrics-"))
        env[MULTIPROC_ENV] = str(metrics_dir)
        os.environ[MULTIPROC_ENV] = str(metrics_dir)  # read by this process's scrapes
    group = _Group([], metrics_dir, [], set())

    def pass_on(signum: int, frame: FrameType | None) -> None:
        group.asked.append(signum)
        log.info("worker group: %s, passed on to its processes", signal.Signals(signum).name)
        group.stop(signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in _STOP_SIGNALS}
    try:
        env = member_env(env, count, gpu, torch_threads)
        # Started before any thread of this process (the metrics server's): a preexec function
        # runs Python between fork and exec.
        for index in range(1, count + 1):
            if group.asked:
                break
            cmd = [sys.executable, "-m", "replay_audit", "worker"]
            cmd += member_argv(common, index, count, name)
            proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent())
            group.members.append(_Member(index, count, proc))
            log.info("worker group: process %s started", group.members[-1].label)
        if metrics is not None:
            from replay_audit.telemetry.metric import start_metrics_server

            host, port = metrics
            try:
                start_metrics_server(host, port)  # a daemon thread, ends with us
            except OSError as e:
                group.stop(signal.SIGTERM)
                group.wait()
                fail(
                    f"cannot serve metrics on {host}:{port} ({e.strerror}): each worker of a "
                    "host needs its own --metrics-port (0: none)"
                )
            log.info(
                "worker group: metrics of its %d processes on http://%s:%d/metrics",
                count,
                host,
                port,
            )
        return group.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
