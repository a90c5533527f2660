"""prometheus-client's multiprocess mode, seen from outside the client.

With `PROMETHEUS_MULTIPROC_DIR` set when a process imports prometheus-client, its values live in
files of that directory, one set per process, and a scrape adds them up. The directory must
exist before `telemetry.metric` is imported (label-less metrics write their file at once) and
be emptied before the processes of a run start, or an earlier run's counts add to this one's.
This module imports no prometheus-client, so `serve` can prepare the directory first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

#: The environment variable of prometheus-client's multiprocess mode (a directory).
MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> Path | None:
    """The multiprocess directory this process writes its values to, if any."""
    value = os.environ.get(MULTIPROC_ENV)
    return Path(value) if value else None


def clear_multiprocess_dir(path: Path) -> None:
    """Empty (creating it if need be) a multiprocess directory before its processes start."""
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
