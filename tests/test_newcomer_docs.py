"""Issue 20, "a newcomer's first hour": what the docs tell a reader is true of this checkout."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "replay_audit" / "assets" / "tiny-llama"


def test_docs_point_to_nothing_outside_the_repository() -> None:
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        assert "../shared/" not in text and "/work/" not in text, doc
    engine = (ROOT / "docs" / "engine.md").read_text()
    assert "Greedy Decoding Is Not Precision-Invariant" in engine


def test_readme_sample_trace_uses_the_models_eos_and_bos() -> None:
    config = json.loads((MODEL / "config.json").read_text())
    readme = (ROOT / "README.md").read_text()
    eos = json.loads(re.search(r'"eos_token_ids": (\[[^]]*\])', readme)[1])  # type: ignore[index]
    assert eos == [config["eos_token_id"]]
    assert config["pad_token_id"] not in eos
    prompt = json.loads(re.search(r'"prompt_token_ids": (\[[^]]*\])', readme)[1])  # type: ignore[index]
    assert prompt[0] == config["bos_token_id"]


def test_what_the_readme_writes_is_ignored_by_git() -> None:
    """Following the README leaves no untracked file: every `--out` it names is ignored."""
    import subprocess

    outs = sorted(set(re.findall(r"--out ([^\s`]+)", (ROOT / "README.md").read_text())))
    assert {"traces.jsonl", "results.jsonl", "screen/"} <= set(outs), outs
    for out in outs:
        probe = out + "report.json" if out.endswith("/") else out
        r = subprocess.run(
            ["git", "check-ignore", "-q", "--no-index", probe], cwd=ROOT, check=False
        )
        assert r.returncode == 0, f"{out} is not ignored by .gitignore"
