"""Screenings as a service: `POST /v1/screenings` stores a request and queues a job; a worker
with the checkpoint runs the screening (`replay_audit.screenings.sweep`) and stores its report.

    models      the `screenings` row and the `screening_outputs` it resumes from
    schemas     request and response bodies
    repository  all SQL
    service     create, read, list
    endpoints   `/v1/screenings` (thin)
    tasks       the job (workers only: it reaches the torch engine)
"""
