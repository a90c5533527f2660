"""What the service tells its operators: Prometheus metrics (`telemetry.metric`) and structured
logs with the request, project, run and job they belong to (`telemetry.log`).

Plumbing: it imports no domain package. The domain, the queue and the edges record into the
metrics defined here; the edges expose them (the API's `/metrics`, a worker's metrics port).
"""
