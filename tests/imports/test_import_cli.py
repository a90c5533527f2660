"""`replay-audit import`: files of logged responses -> traces JSONL, or posted to a real server
(uvicorn on 127.0.0.1, SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from typer.testing import CliRunner

from replay_audit.cli import app
from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.engine.hashing import weights_sha256
from replay_audit.traces.schemas import TraceCreate
from tests.imports.conftest import WEIGHTS, load_fixture

runner = CliRunner()
MODEL_FLAGS = [
    "--config",
    "model.name=tiny-llama",
    "--config",
    f"model.weights_sha256={WEIGHTS}",
    "--config",
    "model.vocab_size=32000",
]


def _write_jsonl(path: Path, items: list[Any]) -> Path:
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return path


@pytest.fixture
def responses(tmp_path: Path) -> Path:
    return _write_jsonl(
        tmp_path / "responses.jsonl",
        [
            {"request": {"temperature": 0}, "response": load_fixture("vllm_chat_token_ids.json")},
            {
                "request": {"prompt": [1, 2, 3], "temperature": 0.8},
                "response": load_fixture("vllm_completion_token_ids.json"),
            },
        ],
    )


def _read(path: Path) -> list[TraceCreate]:
    return [TraceCreate.model_validate_json(line) for line in path.read_text().splitlines()]


def test_openai_responses_to_jsonl_with_flags_and_a_config_file(
    responses: Path, tmp_path: Path
) -> None:
    config = tmp_path / "server.yaml"
    config.write_text(
        "dtype: bf16\nlogprobs_mode: raw_logprobs\ndevice: cuda\n"
        "gpu: {name: NVIDIA H100 80GB HBM3, sm: '9.0'}\n"
        "engine: {name: vllm, version: 0.11.0}\nattn_kernel: flash_attention_2\n"
        "extras: {quantization: none}\n"
    )
    out = tmp_path / "traces.jsonl"
    r = runner.invoke(
        app,
        [
            "import",
            "--format",
            "openai",
            str(responses),
            "--out",
            str(out),
            "--config-file",
            str(config),
            "--config",
            "batch_size=16",
            "--config",
            "engine.version=0.11.1",
            "--config",
            "tags=prod,eu",
            *MODEL_FLAGS,
        ],
    )
    assert r.exit_code == 0, r.output
    assert "wrote 3 traces" in r.output
    chat, *completions = _read(out)
    assert chat.config.gpu is not None and chat.config.gpu.sm == "9.0"
    assert chat.config.batch_size == 16 and chat.config.engine.version == "0.11.1"  # flags win
    assert chat.config.extras["quantization"] == "none" and chat.tags == ["prod", "eu"]
    assert chat.decoding.strategy == "greedy" and chat.top_k is not None
    assert [t.decoding.strategy for t in completions] == ["sample", "sample"]


def test_the_model_directory_gives_the_model_reference(tmp_path: Path) -> None:
    response = load_fixture("vllm_chat_token_ids.json")
    response["prompt_token_ids"] = [1, 45, 300]
    response["choices"][0]["token_ids"] = [278, 635, 3290, 1]
    for step, tid in zip(
        response["choices"][0]["logprobs"]["content"], [278, 635, 3290, 1], strict=True
    ):
        step["token"] = step["top_logprobs"][0]["token"] = f"token_id:{tid}"
        step["top_logprobs"] = step["top_logprobs"][:2]
        step["top_logprobs"][1]["token"] = "token_id:7"
        step["top_logprobs"][1]["logprob"] = -20.0
    path = _write_jsonl(tmp_path / "r.jsonl", [response])
    out = tmp_path / "t.jsonl"
    r = runner.invoke(
        app,
        [
            "import",
            "--format",
            "openai",
            str(path),
            "--out",
            str(out),
            "--model",
            str(BUNDLED_MODEL_DIR),
            "--config",
            "dtype=fp32",
            "--config",
            "logprobs_mode=raw_logprobs",
        ],
    )
    assert r.exit_code == 0, r.output
    [trace] = _read(out)
    assert trace.model.name == "tiny-llama"
    assert trace.model.weights_sha256 == weights_sha256(BUNDLED_MODEL_DIR)
    assert trace.model.vocab_size == 4096 and trace.decoding.eos_token_ids == [1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "logprobs_mode=raw_logprobs"], "config.dtype is unknown"),
        (["--config", "dtype=fp64"], "configuration key dtype"),
        (["--config", "dtype"], "expected key=value"),
        (["--config", "dtype=bf16", "--config", "batch_size=many"], "batch_size"),
        (
            ["--config", "dtype=bf16", "--config", "gpu.sm=9.0", "--config", "gpu.name="],
            "configuration key gpu",
        ),
    ],
)
def test_a_bad_context_stops_with_exit_2_naming_the_key(
    responses: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    r = runner.invoke(
        app,
        [
            "import",
            "--format",
            "openai",
            str(responses),
            "--out",
            str(tmp_path / "o.jsonl"),
            *MODEL_FLAGS,
            *args,
        ],
    )
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


def test_bad_lines_are_reported_with_file_and_line_and_skipped(
    responses: Path, tmp_path: Path
) -> None:
    bad = load_fixture("vllm_chat_token_ids.json")
    del bad["prompt_token_ids"]
    path = tmp_path / "mixed.jsonl"
    path.write_text(responses.read_text() + json.dumps(bad) + "\n{not json\n")
    out = tmp_path / "o.jsonl"
    r = runner.invoke(
        app,
        [
            "import",
            "--format",
            "openai",
            str(path),
            "--out",
            str(out),
            "--config",
            "dtype=bf16",
            *MODEL_FLAGS,
        ],
    )
    assert r.exit_code == 1
    assert f"{path}:3: item.prompt_token_ids: not logged" in r.output
    assert f"{path}:4: not JSON" in r.output
    assert "2 items failed" in r.output and len(_read(out)) == 3


def test_usage_errors(responses: Path, tmp_path: Path) -> None:
    base = ["import", str(responses), "--config", "dtype=bf16", *MODEL_FLAGS]
    for args, message in [
        (["--format", "xml", "--out", "o"], "--format must be one of"),
        (["--format", "openai"], "give one of --out FILE or --post URL"),
        (["--format", "openai", "--post", "http://x"], "--post needs --key"),
        (["--format", "lm-eval", "--out", "o"], "needs --model DIR"),
    ]:
        r = runner.invoke(app, [*base, *args], env={"REPLAY_AUDIT_API_KEY": ""})
        assert r.exit_code == 2 and message in r.output, (args, r.output)
    r = runner.invoke(
        app, ["import", "--format", "openai", str(tmp_path / "none.jsonl"), "--out", "o"]
    )
    assert r.exit_code == 2 and "no such file" in r.output


@pytest.fixture
def server(app: FastAPI) -> Iterator[str]:
    """The app (on the test database) served by uvicorn on a free port of 127.0.0.1."""
    srv = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


def test_post_sends_batches_idempotently(
    responses: Path, server: str, api_key: Callable[..., str]
) -> None:
    key = api_key("submitter")
    args = [
        "import",
        "--format",
        "openai",
        str(responses),
        "--post",
        server,
        "--key",
        key,
        "--batch-size",
        "2",
        "--config",
        "dtype=bf16",
        *MODEL_FLAGS,
    ]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "posted 3 traces" in first.output and "3 new, 0 already stored" in first.output
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and "0 new, 3 already stored" in again.output
    wrong_key = [a if a != key else "wrong" for a in args]
    refused = runner.invoke(app, wrong_key)
    assert refused.exit_code == 2 and "401" in refused.output
