"""Scheduled re-audits of production samples: schedules (cron in UTC), reproducible sampling,
one ordinary replay run per schedule and due time (and, for a schedule that verifies, one
ordinary verification of the same sample), trends, drift and turned-inconsistent flags, webhook
alerts.

    schedule.py     due times (UTC)              sampling.py   which traces (pure)
    drift.py        trend point, flags (pure)    models.py     tables
    schemas.py      the HTTP contract            repository.py all SQL
    service.py      create, start, evaluate      endpoints.py  /v1/audits/schedules
    tasks.py        tick, webhook delivery       scheduler.py  embedded scheduler thread
    cron_config.py  `rq cron` configuration (production)
"""
