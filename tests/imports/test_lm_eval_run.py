"""A real `lm_eval --model hf` run on the bundled model (a local YAML task over a local JSON
file, no hub), `--log_samples`, imported with `replay-audit import --format lm-eval` and
replayed in the logged format: the re-tokenised generations replay exactly.

Needs lm-eval with its `hf` model (accelerate): `pip install -e '.[lm-eval]'` (torch first, as
the README says), then `pytest -m lm_eval`. Marked `lm_eval` and deselected by the default test
command, which does not install lm-eval's large dependency tree; never skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from replay_audit.cli import app
from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.engine import EnginePool, Target
from replay_audit.replays.domain import LoggedTrace
from replay_audit.replays.pipeline import replay_trace
from replay_audit.traces.schemas import TraceCreate

# lm_eval's start-up alone takes ~30 s on 2 shared cores.
pytestmark = [pytest.mark.slow, pytest.mark.lm_eval]

TASK = """\
task: ra_code
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{id}}}}"
generation_kwargs:
  until: ["\\n\\n\\n"]
  do_sample: false
  max_gen_toks: 12
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("lm-eval")
    # The bundled model was trained on Python source: its own prompt set makes it write.
    prompts = (BUNDLED_MODEL_DIR.parent / "prompts.jsonl").read_text().splitlines()[:8]
    data = d / "code.jsonl"
    data.write_text("".join(line + "\n" for line in prompts))
    (d / "tasks").mkdir()
    (d / "tasks" / "arith.yaml").write_text(TASK.format(data=data))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "HF_DATASETS_CACHE": str(d / "cache"),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={BUNDLED_MODEL_DIR},dtype=float32",
            "--tasks",
            "ra_code",
            "--include_path",
            str(d / "tasks"),
            "--device",
            "cpu",
            "--batch_size",
            "1",
            "--log_samples",
            "--output_path",
            str(d / "out"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [samples] = list((d / "out").glob("*/samples_ra_code_*.jsonl"))
    return samples


def test_a_real_lm_eval_run_imports_and_replays_exactly(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "traces.jsonl"
    r = CliRunner().invoke(
        app,
        [
            "import",
            "--format",
            "lm-eval",
            str(run),
            "--model",
            str(BUNDLED_MODEL_DIR),
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    samples = [json.loads(line) for line in run.read_text().splitlines()]
    traces = [TraceCreate.model_validate_json(x) for x in out.read_text().splitlines()]
    non_empty = [s for s in samples if s["resps"][0][0]]
    assert len(traces) == len(non_empty) >= 4
    if len(non_empty) < len(samples):
        assert f"{len(samples) - len(non_empty)} empty responses skipped" in r.output
    pool = EnginePool(device="cpu")
    torch.set_num_threads(1)
    for trace, sample in zip(traces, non_empty, strict=True):
        # What the run's results JSON stated, and the task's target as the reference answer.
        assert trace.config.dtype == "fp32" and trace.config.device == "cpu"
        assert trace.config.engine.name == "transformers"
        assert trace.reference_answer == sample["target"]
        assert trace.prompt_text == sample["arguments"]["gen_args_0"]["arg_0"]
        assert trace.config.extras["tokenization"].startswith("re-tokenised")
        assert trace.decoding.strategy == "greedy" and trace.decoding.max_new_tokens == 12
        # The re-tokenised response is what the model generated: it replays exactly.
        outcome = replay_trace(
            LoggedTrace.from_json(trace.model_dump()),
            Target("fp32"),
            pool,
            model_dir=BUNDLED_MODEL_DIR,
        )
        assert outcome.exact_match, (sample["resps"], outcome.first_divergence_step)
