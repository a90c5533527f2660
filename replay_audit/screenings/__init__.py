"""Screenings as a service: `POST /v1/screenings` stores a request and queues a job; a worker
with the checkpoint runs the screening (`replay_audit.screenings.sweep`) and stores its report.
"""
