"""Auditor reports: a replay run's statistics with their intervals, any pair of its
comparisons, two runs against each other, task accuracy, and exports.

    repository   SQL: aggregates computed by the database, keyset pages, export batches
    service      reports from those aggregates and the pure `replay_audit.stats` functions
    schemas      what a report says (`RunReport`), the same for the API and the web UI
    export       CSV / JSONL streams, one row per trace x comparison
    endpoints    `GET /v1/replays/{id}/report`, `GET /v1/replays/{id}/export?format=csv|jsonl`
"""
