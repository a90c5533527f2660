"""Auditor reports: a replay run's statistics with their intervals, any pair of its
comparisons, two runs against each other, task accuracy, browsing and exports.

    statistics   reports from the run's statistics (`replays.statistics`, the one builder)
    browsing     the runs list, pages of results, one trace in a run
    filters      what lists can be filtered by
    repository   SQL: runs list, flips pages, keyset pages, export batches
    schemas      what a report says (`RunReport`), the same for the API and the web UI
    export       CSV / JSONL streams, one row per trace x comparison
    endpoints    `GET /v1/replays/{id}/report`, `GET /v1/replays/{id}/export?format=csv|jsonl`
"""
