"""Every table of the service, imported in one place.

SQLAlchemy resolves a relationship's target by class name (`Trace.project` names `"Project"`)
when the first session configures the mappers, so every mapped class must be imported by then,
whichever command, job or request opens that session. `replay_audit.db.engine` imports this
module before it hands out a session factory, and the migrations' `env.py` imports it so that
`alembic check` sees every table. A new domain's `models.py` is added here.
"""

from replay_audit.audits.models import AuditAlert, AuditRun, AuditSchedule
from replay_audit.auth.models import ApiKey, Project
from replay_audit.replays.models import ReplayJob, ReplayResult, ReplayRun
from replay_audit.screenings.models import Screening, ScreeningOutput
from replay_audit.traces.models import NumericalConfigRow, Trace, TraceKey, TraceTag
from replay_audit.verifications.models import Verification, VerificationCalibration

__all__ = [
    "ApiKey",
    "AuditAlert",
    "AuditRun",
    "AuditSchedule",
    "NumericalConfigRow",
    "Project",
    "ReplayJob",
    "ReplayResult",
    "ReplayRun",
    "Screening",
    "ScreeningOutput",
    "Trace",
    "TraceKey",
    "TraceTag",
    "Verification",
    "VerificationCalibration",
]
