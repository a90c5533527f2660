"""Loading a checkpoint prints no "Loading weights" progress bar, and the engine's probes (a
decode, a scan, single-step re-runs) call no API transformers has deprecated: with every
warning shown, none says so (issue 20 silenced the `past_key_values` notice; the engine now
names the cache as transformers does, `decoder.cache_keyword`)."""

from __future__ import annotations

import subprocess
import sys

from replay_audit.config import BUNDLED_MODEL_DIR

SCRIPT = f"""
import logging, warnings
from pathlib import Path
warnings.simplefilter("always")
from replay_audit.engine.protocol import Target
from replay_audit.engine.torch_engine import TorchEngine
assert logging.getLogger("transformers").filters == []  # nothing at import
model = Path({str(BUNDLED_MODEL_DIR)!r})
for kernel in ("sdpa", "eager"):
    engine = TorchEngine.load(model, Target("bf16", attn_kernel=kernel), device="cpu")
    run = engine.decode([5, 6, 7, 8], 6, [1])
    engine.scan([5, 6, 7, 8], run.output_token_ids, None)
    engine.step_batch([[5, 6, 7], [8, 9, 10]], engine.target.intervention)
logging.getLogger("transformers").warning("a real transformers warning")
"""


def test_the_engine_prints_no_progress_bar_and_calls_no_deprecated_api() -> None:
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    out = r.stdout + r.stderr
    assert "Loading weights" not in out and "it/s" not in out, out
    assert "deprecated" not in out.lower(), out
    assert "a real transformers warning" in out, out
