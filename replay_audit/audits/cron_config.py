"""RQ cron configuration: production's one scheduler process.

    rq cron replay_audit.audits.cron_config --url redis://redis:6379/0

registers `replay_audit.audits.tasks.tick` on the `audit` queue every `audit_tick_interval_s`
(default 60 s), and a worker serving that queue (`replay-audit worker --queue audit`) runs it.
The queue's and the cron job's names carry REPLAY_AUDIT_QUEUE_PREFIX, as the workers' do.
Registered by interval, not with `cron=` (schedule.py says why). A tick not started within
`ttl` seconds is dropped rather than run late: the next one does the same work.
"""

from __future__ import annotations

from rq import cron

from replay_audit.audits.service import AUDIT_QUEUE
from replay_audit.audits.tasks import tick
from replay_audit.config import Settings, get_settings
from replay_audit.queue import rq_name


def register(settings: Settings) -> None:
    """Register the tick with `rq cron` for the deployment of `settings`."""
    interval_s = max(1, round(settings.audit_tick_interval_s))
    cron.register(
        tick,
        rq_name(settings, AUDIT_QUEUE),
        interval=interval_s,
        job_timeout=600,
        ttl=max(60, 2 * interval_s),
        result_ttl=3600,
        failure_ttl=7 * 24 * 3600,
        name=rq_name(settings, "replay-audit-tick"),
    )


# `rq cron` loads this module and reads what it registered: the one thing done at import. The
# settings are read for it and not kept.
register(get_settings())
