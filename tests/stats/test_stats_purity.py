"""The statistics package imports nothing but the stdlib and numpy (DESIGN: pure)."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = {"scipy", "torch", "sqlalchemy", "fastapi", "redis", "rq", "transformers", "pandas"}


def test_importing_stats_pulls_in_no_heavy_or_io_package() -> None:
    code = (
        "import json, sys; import replay_audit.stats; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    loaded = set(json.loads(out))
    assert "numpy" in loaded
    assert loaded.isdisjoint(FORBIDDEN), loaded & FORBIDDEN
