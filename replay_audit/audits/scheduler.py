"""The embedded scheduler: a daemon thread of `replay-audit serve` that runs the tick every
`audit_tick_interval_s`, with no Redis. Production runs `rq cron` instead (cron_config.py);
both run the same `run_tick`, and running both by mistake is harmless (the database's unique
keys, not this process, decide what runs).

    scheduler = start_inprocess_scheduler(settings, runner=runner)  # None unless asked for
    ...
    scheduler.stop()

The scheduler belongs to whoever starts it (`replay-audit serve`, a test), who stops it; nothing
process-wide keeps it.
"""

from __future__ import annotations

import logging
import threading

from replay_audit.audits.tasks import TickReport, build_alert_runner, run_tick
from replay_audit.config import Settings
from replay_audit.queue import Runner, build_runner, stop_runner

log = logging.getLogger(__name__)


class InProcessScheduler:
    """Ticks in a daemon thread until `stop()`. Times are UTC throughout (see schedule.py).

    `runner` (replay jobs) and `alerts` (webhook deliveries) are the caller's when given; the
    ones it builds itself (from the settings) are its own, and `stop()` stops them too."""

    def __init__(
        self,
        settings: Settings,
        *,
        runner: Runner | None = None,
        alerts: Runner | None = None,
        interval_s: float | None = None,
    ) -> None:
        self.settings = settings
        self.runner = runner or build_runner(settings)
        self.alerts = alerts or build_alert_runner(settings)
        #: The runners it built itself, which `stop()` stops too.
        self._owned = [
            r for r, given in ((self.runner, runner), (self.alerts, alerts)) if given is None
        ]
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
        """Stop ticking and wait for a tick under way, then stop the runners it built; False if
        a thread is still running after `timeout_s` (each)."""
        self._stop.set()
        clean = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            clean = not self._thread.is_alive()
        return all([stop_runner(r, timeout_s) for r in self._owned]) and clean

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def wants_inprocess_scheduler(settings: Settings) -> bool:
    """`scheduler=auto` means in-process with the in-process runner, `rq cron` with RQ."""
    if settings.scheduler == "auto":
        return settings.runner == "inprocess"
    return settings.scheduler == "inprocess"


def start_inprocess_scheduler(
    settings: Settings, *, runner: Runner | None = None
) -> InProcessScheduler | None:
    """Start an embedded scheduler if the settings ask for one, its replay jobs on `runner`
    (by default one of its own); None when they do not (production: `rq cron
    replay_audit.audits.cron_config`). The caller owns it: stop it before the process exits,
    and before the runner it was given, since a tick enqueues jobs."""
    if not wants_inprocess_scheduler(settings):
        return None
    scheduler = InProcessScheduler(settings, runner=runner).start()
    log.info("embedded audit scheduler: a tick every %.0f s", scheduler.interval_s)
    return scheduler
