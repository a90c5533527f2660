"""Loading a checkpoint prints no "Loading weights" progress bar and no `past_key_values`
deprecation notice (issue 20), and other transformers warnings still pass."""

from __future__ import annotations

import subprocess
import sys

from replay_audit.config import BUNDLED_MODEL_DIR

SCRIPT = f"""
import logging, warnings
from pathlib import Path
from replay_audit.engine.loading import load_model
import torch
import transformers
assert logging.getLogger("transformers").filters == []  # nothing at import
load_model(Path({str(BUNDLED_MODEL_DIR)!r}), "fp32", None, torch.device("cpu"))
log = logging.getLogger("transformers.utils.generic")
log.warning("`past_key_values`/`cache_params` are deprecated. Use `cache` instead.")
log.warning("a real transformers warning")
warnings.warn("`past_key_values` is deprecated", FutureWarning)
warnings.warn("another future change", FutureWarning)
"""


def test_loading_prints_no_progress_bar_nor_the_deprecation_notice() -> None:
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    out = r.stdout + r.stderr
    assert "Loading weights" not in out and "it/s" not in out, out
    assert "past_key_values" not in out, out
    assert "a real transformers warning" in out and "another future change" in out, out
