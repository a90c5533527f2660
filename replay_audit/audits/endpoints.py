"""HTTP: `/v1/audits/schedules`. Thin: parse, call the service, return a schema.

Admins create, change (pause, resume), delete schedules and start runs by hand; auditors and
admins read. Another project's schedule is a 404, like any object of another project.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends, Query, Response, status

from replay_audit.api.deps import AppSettings, DBSession, Queue, Reader, require_role
from replay_audit.audits import service
from replay_audit.audits.models import AuditSchedule
from replay_audit.audits.schemas import (
    AlertList,
    AuditRunCreated,
    AuditRunList,
    CatchUpRequest,
    CatchUpResult,
    Missed,
    ScheduleCreate,
    ScheduleList,
    ScheduleRead,
    ScheduleUpdate,
    ScheduleWritten,
    Trend,
)
from replay_audit.audits.webhook import DestinationPolicy
from replay_audit.auth.models import Role
from replay_audit.auth.schemas import Principal
from replay_audit.config import Settings
from replay_audit.input import UtcDatetime
from replay_audit.json_value import JsonObject
from replay_audit.replays.service import RunDefaults

router = APIRouter(prefix="/v1/audits/schedules", tags=["audits"])

Admin = Annotated[Principal, Depends(require_role(Role.admin))]


def _read(session: DBSession, schedule: AuditSchedule, principal: Principal) -> ScheduleRead:
    return service.to_reads(session, [schedule], reveal_webhook=principal.role == Role.admin)[0]


def _written(
    session: DBSession, schedule: AuditSchedule, principal: Principal, secret: str | None
) -> ScheduleWritten:
    read = _read(session, schedule, principal)
    return ScheduleWritten(**read.model_dump(), webhook_secret=secret)


def _destinations(settings: Settings) -> DestinationPolicy:
    return DestinationPolicy.parse(settings.webhook_allowed_hosts)


_NAME_TAKEN: dict[int | str, JsonObject] = {
    409: {"description": "A schedule of this name exists in the project"}
}


@router.post(
    "", status_code=status.HTTP_201_CREATED, response_model=ScheduleWritten, responses=_NAME_TAKEN
)
def create_schedule(
    body: ScheduleCreate, session: DBSession, queue: Queue, principal: Admin, settings: AppSettings
) -> ScheduleWritten:
    """Create a schedule (cron in UTC; its first run is its first due time from now). With a
    webhook, `webhook_secret` (the key its deliveries are signed with) is in this answer only."""
    schedule = service.create_schedule(
        session,
        principal.project_id,
        body,
        capabilities=queue.capabilities,
        destinations=_destinations(settings),
    )
    return _written(session, schedule, principal, schedule.webhook_secret)


@router.get("", response_model=ScheduleList)
def list_schedules(session: DBSession, principal: Reader) -> ScheduleList:
    """This project's schedules, with their next due time, last run and missed runs."""
    schedules = service.list_schedules(session, principal.project_id)
    return ScheduleList(
        items=service.to_reads(session, schedules, reveal_webhook=principal.role == Role.admin)
    )


@router.get("/{schedule_id}", response_model=ScheduleRead)
def read_schedule(schedule_id: str, session: DBSession, principal: Reader) -> ScheduleRead:
    schedule = service.get_schedule(session, principal.project_id, schedule_id)
    return _read(session, schedule, principal)


@router.patch("/{schedule_id}", response_model=ScheduleWritten, responses=_NAME_TAKEN)
def update_schedule(
    schedule_id: str,
    body: ScheduleUpdate,
    session: DBSession,
    principal: Admin,
    settings: AppSettings,
) -> ScheduleWritten:
    """Pause (`{"status": "paused"}`), resume, rename, change the sample size, the drift
    threshold or the webhook; `{"rotate_webhook_secret": true}` makes a new signing secret,
    shown in this answer only (as is the secret of a webhook added here)."""
    schedule = service.get_schedule(session, principal.project_id, schedule_id)
    secret = service.update_schedule(session, schedule, body, destinations=_destinations(settings))
    return _written(session, schedule, principal, secret)


@router.delete("/{schedule_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_schedule(schedule_id: str, session: DBSession, principal: Admin) -> Response:
    """Delete the schedule with its audit runs and alerts; its replay runs stay."""
    schedule = service.get_schedule(session, principal.project_id, schedule_id)
    service.delete_schedule(session, schedule)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post(
    "/{schedule_id}/runs",
    status_code=status.HTTP_201_CREATED,
    response_model=AuditRunCreated,
    responses={200: {"description": "A run due the same second exists"}},
)
def run_now(
    schedule_id: str,
    session: DBSession,
    queue: Queue,
    principal: Admin,
    response: Response,
    settings: AppSettings,
) -> AuditRunCreated:
    """Run the schedule now (due now; paused schedules too)."""
    schedule = service.get_schedule(session, principal.project_id, schedule_id)
    run, created = service.run_now(
        session,
        schedule,
        queue=queue,
        defaults=RunDefaults.from_settings(settings),
    )
    if not created:
        response.status_code = status.HTTP_200_OK
    [read] = service.runs_to_read(session, [run], [schedule])
    return AuditRunCreated(run=read, created=created)


@router.get("/{schedule_id}/runs", response_model=AuditRunList)
def list_runs(
    schedule_id: str,
    session: DBSession,
    principal: Reader,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    before: UtcDatetime | None = None,
) -> AuditRunList:
    """The schedule's runs, newest due time first (`before`: older than this due time)."""
    schedule = service.get_schedule(session, principal.project_id, schedule_id)
    return AuditRunList(items=service.runs_page(session, schedule, limit=limit, before=before))


@router.get("/{schedule_id}/trend", response_model=Trend)
def read_trend(
    schedule_id: str,
    session: DBSession,
    principal: Reader,
    limit: Annotated[int, Query(ge=1, le=1000)] = 90,
) -> Trend:
    """One point per run, oldest first: EAR, C lift, trigger rate, category mix, flags."""
    schedule = service.get_schedule(session, principal.project_id, schedule_id)
    return service.trend(session, schedule, limit=limit)


@router.get("/{schedule_id}/missed", response_model=Missed)
def read_missed(schedule_id: str, session: DBSession, principal: Reader) -> Missed:
    """Due times that passed with no run (the scheduler was down)."""
    schedule = service.get_schedule(session, principal.project_id, schedule_id)
    return service.missed(session, schedule)


@router.post("/{schedule_id}/catch-up", response_model=CatchUpResult)
def catch_up(
    schedule_id: str,
    session: DBSession,
    queue: Queue,
    principal: Admin,
    settings: AppSettings,
    body: Annotated[CatchUpRequest | None, Body()] = None,
) -> CatchUpResult:
    """Start runs for missed due times, newest first (each samples its own window)."""
    schedule = service.get_schedule(session, principal.project_id, schedule_id)
    runs, remaining = service.catch_up(
        session,
        schedule,
        limit=(body or CatchUpRequest()).limit,
        queue=queue,
        defaults=RunDefaults.from_settings(settings),
    )
    return CatchUpResult(
        started=service.runs_to_read(session, runs, [schedule]), remaining=remaining
    )


@router.get("/{schedule_id}/alerts", response_model=AlertList)
def list_alerts(
    schedule_id: str,
    session: DBSession,
    principal: Reader,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> AlertList:
    """Webhook deliveries of the schedule's drift alerts, with every attempt."""
    schedule = service.get_schedule(session, principal.project_id, schedule_id)
    return AlertList(
        items=service.alerts(
            session, schedule, limit=limit, reveal_url=principal.role == Role.admin
        )
    )
