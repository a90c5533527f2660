"""The embedded scheduler: a daemon thread of `replay-audit serve` that runs the tick every
`audit_tick_interval_s`, with no Redis. Production runs `rq cron` instead (cron_config.py);
both run the same `run_tick`, and running both by mistake is harmless (the database's unique
keys, not this process, decide what runs).

    scheduler = start_inprocess_scheduler(settings)   # None unless the settings ask for one
    ...
    scheduler.stop()
"""

from __future__ import annotations

import logging
import threading

from replay_audit.audits.tasks import TickReport, alert_runner, run_tick
from replay_audit.config import Settings
from replay_audit.queue import Runner, get_runner

log = logging.getLogger(__name__)


class InProcessScheduler:
    """Ticks in a daemon thread until `stop()`. Times are UTC throughout (see schedule.py)."""

    def __init__(
        self,
        settings: Settings,
        *,
        runner: Runner | None = None,
        alerts: Runner | None = None,
        interval_s: float | None = None,
    ) -> None:
        self.settings = settings
        self.runner = runner or get_runner(settings)
        self.alerts = alerts or alert_runner(settings)
        self.interval_s = settings.audit_tick_interval_s if interval_s is None else interval_s
        self.ticks = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> TickReport:
        """One pass now, in the caller's thread."""
        report = run_tick(self.settings, runner=self.runner, alert_runner=self.alerts)
        self.ticks += 1
        if (
            report.started
            or report.evaluated
            or report.errors
            or report.traces_pruned
            or report.screenings_pruned
        ):
            log.info(report.summary())
        return report

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # the database may be briefly away: the next tick retries
                log.exception("audit tick failed")
            self._stop.wait(self.interval_s)

    def start(self) -> InProcessScheduler:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._loop, name="replay-audit-scheduler", daemon=True
            )
            self._thread.start()
        return self

    def stop(self, timeout_s: float | None = 10.0) -> bool:
        """Stop ticking and wait for a tick under way; False if it is still running."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


_scheduler: InProcessScheduler | None = None
_lock = threading.Lock()


def wants_inprocess_scheduler(settings: Settings) -> bool:
    """`scheduler=auto` means in-process with the in-process runner, `rq cron` with RQ."""
    if settings.scheduler == "auto":
        return settings.runner == "inprocess"
    return settings.scheduler == "inprocess"


def start_inprocess_scheduler(settings: Settings) -> InProcessScheduler | None:
    """Start this process's embedded scheduler if the settings ask for one (once per
    process); None when they do not (production: `rq cron replay_audit.audits.cron_config`)."""
    global _scheduler
    if not wants_inprocess_scheduler(settings):
        return None
    with _lock:
        if _scheduler is None or not _scheduler.running:
            _scheduler = InProcessScheduler(settings).start()
            log.info("embedded audit scheduler: a tick every %.0f s", _scheduler.interval_s)
        return _scheduler


def stop_inprocess_scheduler(timeout_s: float | None = 10.0) -> bool:
    """Stop this process's embedded scheduler, if one runs (before the process exits, and
    before its runners are stopped, since a tick enqueues jobs)."""
    with _lock:
        scheduler = _scheduler
    return scheduler.stop(timeout_s) if scheduler is not None else True
