"""Auditor reports: a replay run's statistics with their intervals, any pair of its
comparisons, two runs against each other, task accuracy, browsing and exports. Every report
reads the run's statistics from their one builder (`stats.report`, through
`replays.statistics`); `RunReport` is the same for the API and the web UI.
"""
