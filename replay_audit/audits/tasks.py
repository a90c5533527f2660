"""What the scheduler runs: the tick (`tick` under `rq cron`, `run_tick` in-process), and the
webhook delivery job (`deliver_alert`, which raises to be retried).

A tick, every step idempotent and safe to run from two schedulers at once:
  1. start the newest due time of each active schedule that has no run yet (the unique
     (schedule, due time) key decides who starts it);
  2. evaluate audit runs whose replay run has finished: trend point, drift flags, alert;
  3. re-enqueue alerts still pending that no runner holds (after a Redis flush or a restart);
  4. reconcile replay jobs, screenings and verifications with the queue (`reconcile_jobs`);
  5. storage: create the trace tables' partitions ahead (PostgreSQL, `db.partition`) and, when
     `retention_days` is set, prune what is older (`db.retention`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from sqlalchemy.orm import Session

import replay_audit
from replay_audit.audits import repository, service, webhook
from replay_audit.audits.models import AuditAlert, AuditSchedule
from replay_audit.config import Settings, get_settings
from replay_audit.db.base import utcnow
from replay_audit.db.partition import ensure_partitions
from replay_audit.db.retention import prune
from replay_audit.db.unit_of_work import session_scope
from replay_audit.json_value import JsonObject
from replay_audit.queue import JobSpec, Runner, build_job_queue, build_runner
from replay_audit.queue.runner import InProcessRunner
from replay_audit.replays.reconcile import reconcile
from replay_audit.replays.service import RunDefaults
from replay_audit.screenings.reconcile import reconcile_screenings
from replay_audit.telemetry.metric import WEBHOOK_DELIVERIES
from replay_audit.verifications.reconcile import reconcile_verifications
from replay_audit.words import counted

log = logging.getLogger(__name__)

#: A replay job running this long without a heartbeat is presumed dead (as `replay-audit
#: reconcile` assumes by default).
RECONCILE_STALE_AFTER_S: Final = 900.0


@dataclass
class TickReport:
    """What one tick did (an RQ job's result; logged by the schedulers, `summary()`)."""

    #: Schedules with a due time to start now (those started before are not counted again).
    due: int = 0
    started: int = 0
    evaluated: int = 0
    flagged: int = 0
    alerts_enqueued: int = 0
    jobs_reconciled: int = 0
    partitions_created: int = 0
    traces_pruned: int = 0
    screenings_pruned: int = 0
    errors: int = 0

    def summary(self) -> str:
        """One line for the log: what was due, started, evaluated, flagged, alerted, mended."""
        return (
            f"audit tick: {counted(self.due, 'schedule')} due, "
            f"{counted(self.started, 'run')} started, "
            f"{self.evaluated} evaluated ({self.flagged} flagged for drift), "
            f"{counted(self.alerts_enqueued, 'alert delivery', 'alert deliveries')} enqueued, "
            f"{counted(self.jobs_reconciled, 'job')} reconciled, "
            f"{counted(self.partitions_created, 'partition')} created, "
            f"{counted(self.traces_pruned, 'trace')} pruned, "
            f"{counted(self.screenings_pruned, 'screening')} pruned, "
            f"{counted(self.errors, 'error')}"
        )


def build_alert_runner(settings: Settings) -> Runner:
    """Where webhook deliveries go: RQ's `audit` queue, or in the embedded mode a runner thread
    of their own, so that a webhook's backoff never holds up a replay job. The caller owns it
    (an in-process one is stopped by whoever built it: the scheduler, a command)."""
    if settings.runner == "rq":
        return build_runner(settings)
    return InProcessRunner()


class DeferredRunner:
    """A runner that runs nothing: the work stays pending in the database for the scheduler's
    next tick (a short-lived CLI process must not start what its exit would cut short)."""

    def enqueue(self, spec: JobSpec) -> None:
        log.info("%s left to the scheduler", spec.job_id)

    def is_queued(self, job_id: str) -> bool:
        return False

    def ping(self) -> None:
        """Work is always accepted: it waits in the database."""


def run_tick(
    settings: Settings,
    *,
    runner: Runner,
    alert_runner: Runner,
    database_url: str | None = None,
    now: datetime | None = None,
    stale_after_s: float = RECONCILE_STALE_AFTER_S,
) -> TickReport:
    """One scheduler pass (see the module docstring). Each schedule, run and alert is handled
    in its own transaction: one that fails is logged and counted, the others go on."""
    url = database_url or settings.database_url
    now = now or utcnow()
    report = TickReport()
    queue = build_job_queue(settings, runner=runner)
    defaults = RunDefaults.from_settings(settings)

    with session_scope(url) as s:
        schedules = repository.active_schedules(s)
        claimed = repository.latest_scheduled_due(s, [x.id for x in schedules])
        due = [(x.id, service.due_now(x, claimed.get(x.id), now)) for x in schedules]
    report.due = sum(due_at is not None for _, due_at in due)
    for schedule_id, due_at in due:
        if due_at is None:
            continue
        try:
            with session_scope(url) as s:
                schedule = s.get(AuditSchedule, schedule_id)
                if schedule is None or schedule.status != "active":
                    continue  # paused or deleted since
                _, created = service.start_audit_run(
                    s, schedule, due_at, "scheduled", queue=queue, defaults=defaults
                )
            report.started += created
        except Exception:
            log.exception("could not start schedule %d at %s", schedule_id, due_at)
            report.errors += 1

    with session_scope(url) as s:
        to_evaluate = repository.runs_to_evaluate(s) + repository.orphaned_runs(s)
    for run_id in to_evaluate:
        try:
            with session_scope(url) as s:
                run = service.evaluate_audit_run(
                    s,
                    run_id,
                    alert_runner=alert_runner,
                    webhook_timeout_s=settings.webhook_timeout_s,
                    webhook_retry_intervals_s=settings.webhook_retry_intervals_s,
                    drift_alpha=settings.drift_alpha,
                    drift_min_n=settings.drift_min_n,
                )
            if run is not None:
                report.evaluated += 1
                report.flagged += bool(run.flags)
        except Exception:
            log.exception("could not evaluate audit run %d", run_id)
            report.errors += 1

    try:
        with session_scope(url) as s:
            pending = repository.pending_alerts(s)
        for alert_id in pending:
            spec = service.alert_job_spec(
                alert_id,
                timeout_s=settings.webhook_timeout_s,
                retry_intervals_s=settings.webhook_retry_intervals_s,
            )
            if not alert_runner.is_queued(spec.job_id):
                alert_runner.enqueue(spec)
                report.alerts_enqueued += 1
    except Exception:
        log.exception("could not re-enqueue pending alerts")
        report.errors += 1

    try:
        with session_scope(url) as s:
            again = reconcile_jobs(s, runner, settings, stale_after_s=stale_after_s)
        report.jobs_reconciled = len(again)
    except Exception:
        log.exception("reconcile pass failed")
        report.errors += 1

    try:
        maintain_storage(settings, url, now, report)
    except Exception:
        log.exception("storage maintenance failed")
        report.errors += 1
    return report


def reconcile_jobs(
    session: Session, runner: Runner, settings: Settings, *, stale_after_s: float
) -> list[int]:
    """Enqueue again every job the database says is unfinished and no runner holds: replay
    jobs and screenings (also when their heartbeat is older than `stale_after_s`) and
    verifications. What a tick and `replay-audit reconcile` run; the ids re-enqueued."""
    again = reconcile(
        session, runner, stale_after_s=stale_after_s, job_timeout_s=settings.job_timeout_s
    )
    again += reconcile_screenings(
        session,
        runner,
        stale_after_s=stale_after_s,
        job_timeout_s=settings.job_timeout_s,
        default_queue=settings.default_queue,
    )
    again += reconcile_verifications(
        session, runner, job_timeout_s=settings.job_timeout_s, default_queue=settings.default_queue
    )
    return again


def maintain_storage(settings: Settings, url: str, now: datetime, report: TickReport) -> None:
    """Partitions ahead, then retention if configured (both idempotent; a no-op mostly)."""
    with session_scope(url) as s:
        created = ensure_partitions(s, now)
    report.partitions_created += len(created)
    if created:
        log.info("created partitions %s", ", ".join(created))
    if settings.retention_days is not None:
        pruned = prune(url, timedelta(days=settings.retention_days), now=now)
        report.traces_pruned += pruned.traces_removed
        report.screenings_pruned += pruned.screenings_deleted
        if pruned.traces_removed or pruned.screenings_deleted:
            log.info("retention: %s", "; ".join(pruned.lines()))


def tick() -> dict[str, int]:
    """The job `rq cron` enqueues on the `audit` queue every minute (see cron_config.py)."""
    settings = get_settings()
    report = run_tick(
        settings, runner=build_runner(settings), alert_runner=build_alert_runner(settings)
    )
    if report.started or report.evaluated or report.errors or report.traces_pruned:
        log.info(report.summary())
    return asdict(report)


class DeliveryFailed(Exception):
    """A webhook attempt failed and another will follow (the runner retries the job)."""


def _post(
    url: str,
    payload: JsonObject,
    alert_id: str,
    secret: str | None,
    settings: Settings,
) -> webhook.Attempt:
    """One signed POST under the destination policy (see `webhook`)."""
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    headers = {
        "Content-Type": "application/json",
        "User-Agent": f"replay-audit/{replay_audit.__version__}",
        # Receivers may deduplicate on this: a retry after a lost answer sends it again.
        "X-Replay-Audit-Alert": alert_id,
    }
    if secret is not None:
        headers[webhook.SIGNATURE_HEADER] = webhook.signature(secret, body)
    return webhook.post(
        url,
        body,
        headers,
        timeout_s=settings.webhook_timeout_s,
        policy=webhook.DestinationPolicy.parse(settings.webhook_allowed_hosts),
    )


def deliver_alert(alert_id: int, database_url: str | None = None) -> str:
    """POST alert `alert_id` to its webhook once and record the attempt: its status code and
    error class only (`webhook.ERROR_CLASSES`), never what the receiver answered.

    The POST happens outside any transaction. On failure the attempt is recorded and
    DeliveryFailed raised, so the runner retries after the next backoff interval; after
    len(webhook_retry_intervals_s) + 1 attempts the alert is failed for good (recorded, not
    raised). A destination the policy refuses is a failed attempt like any other (its DNS
    answer may change back). Returns the alert's status."""
    settings = get_settings()
    url = database_url or settings.database_url
    with session_scope(url) as s:
        alert = s.get(AuditAlert, alert_id)
        if alert is None or alert.status != "pending":
            return "gone" if alert is None else alert.status
        target, payload, public_id = alert.url, dict(alert.payload), alert.public_id
        secret = repository.alert_webhook_secret(s, alert_id)
    started = datetime.now(UTC)
    attempt = _post(target, payload, public_id, secret, settings)
    WEBHOOK_DELIVERIES.labels(attempt.error or "delivered").inc()
    max_attempts = len(settings.webhook_retry_intervals_s) + 1
    with session_scope(url) as s:
        alert = repository.lock_alert(s, alert_id)
        if alert is None or alert.status != "pending":
            return "gone" if alert is None else alert.status
        alert.attempts += 1
        alert.attempt_log = [
            *(alert.attempt_log or []),
            {
                "at": started.isoformat(),
                "ok": attempt.ok,
                "status_code": attempt.status_code,
                "error": attempt.error,
            },
        ]
        if attempt.ok:
            alert.status, alert.delivered_at = "delivered", utcnow()
        else:
            alert.last_error = attempt.error
            if alert.attempts >= max_attempts:
                alert.status = "failed"
        status, attempts = alert.status, alert.attempts
    if status == "pending":
        raise DeliveryFailed(f"alert {public_id} attempt {attempts}: {attempt.error}")
    if status == "failed":
        log.warning(
            "alert %s failed for good after %d attempts: %s", public_id, attempts, attempt.error
        )
    return status
