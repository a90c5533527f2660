"""`replay-audit import`: files of logged responses -> traces JSONL, or posted to a real server
(uvicorn on 127.0.0.1, SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import socket
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
from replay_audit.formats import logged_by_another_engine
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
    # Stored, but said at import (issue 33: "3 new" and no word, the reason surfacing later).
    assert "; 2 traces cannot be replayed (decoding.strategy: sample 2)" in r.output
    assert "stored, but only greedy traces replay: decoding.strategy 'sample'" in r.output
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
    # The served name is kept; a response that names no model gets the directory's name.
    served = response | {"model": "gpt-4o-mini-2024-07-18", "id": "chatcmpl-served"}
    unnamed = {k: v for k, v in response.items() if k != "model"}
    path = _write_jsonl(tmp_path / "r.jsonl", [served, unnamed])
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
    kept, named = _read(out)
    assert (kept.model.name, named.model.name) == ("gpt-4o-mini-2024-07-18", "tiny-llama")
    for trace in (kept, named):
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
            ["--config", "dtype=bf16", "--config", "model.default_name=" + "x" * 5000],
            "default_name",
        ),
        (["--config", "dtype=bf16", "--config", "model.default_name=a\x00b"], "default_name"),
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
    # No server at the URL (a closed port): said at once, naming it (it waited 300 s silently).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
        start = time.monotonic()
        nowhere = runner.invoke(app, [a if a != server else closed for a in args])
    assert nowhere.exit_code == 2 and f"cannot reach {closed}" in nowhere.output
    assert time.monotonic() - start < 10


class NotAllowed:
    """A class no allow-list names: a pickle holding it must not load (nor run anything)."""


def _saved_generate(chat_checkpoint: Path, path: Path) -> tuple[Any, Any]:
    """`torch.save` of a real `generate(..., return_dict_in_generate=True)` output of a
    left-padded batch of two prompts (its KV cache included), and the tokenizer's encoding."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_checkpoint), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(chat_checkpoint))
    enc = tokenizer(["def f(x):\n", "import os\n\n\nclass A"], return_tensors="pt", padding=True)
    out = model.generate(
        **enc,
        max_new_tokens=6,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.save(out, path)
    return out, enc


def test_a_saved_generate_output_loads_safely_and_a_bad_file_stops_nothing(
    chat_checkpoint: Path, tmp_path: Path
) -> None:
    import torch

    from replay_audit.imports.hf import traces_from_generate
    from replay_audit.imports.schemas import ImportContext

    good, evil = tmp_path / "gen.pt", tmp_path / "evil.pt"
    out, enc = _saved_generate(chat_checkpoint, good)
    assert type(out).__name__ == "GenerateDecoderOnlyOutput"
    torch.save({"sequences": out.sequences, "x": NotAllowed()}, evil)
    result = tmp_path / "t.jsonl"
    r = runner.invoke(
        app,
        [
            "import",
            "--format",
            "hf",
            str(evil),
            str(good),
            "--model",
            str(chat_checkpoint),
            "--config",
            "dtype=fp32",
            "--config",
            "decoding.strategy=greedy",
            "--out",
            str(result),
        ],
    )
    assert r.exit_code == 1, r.output
    assert f"{evil}: not a generate() output loadable safely" in r.output
    assert "NotAllowed" in r.output  # torch's weights_only refusal names the global
    traces = _read(result)
    assert len(traces) == 2 and "wrote 2 traces" in r.output
    context = ImportContext.model_validate(
        {"model": traces[0].model.model_dump(), "dtype": "fp32", "decoding": {"eos_token_ids": [1]}}
    )
    live = traces_from_generate(
        out, context=context, input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]
    )
    for saved, expected in zip(traces, live, strict=True):
        assert saved.prompt_token_ids == expected.prompt_token_ids  # left padding dropped
        assert saved.output_token_ids == expected.output_token_ids and saved.top_k == expected.top_k
        assert saved.config.batch_size == 2 and saved.config.extras["top_k_source"] == "logged ids"
    assert traces[0].prompt_token_ids[0] == 0 and 2 not in traces[0].prompt_token_ids


def test_format_vllm_is_openai_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(load_fixture("vllm_chat_token_ids.json")))
    out = tmp_path / "t.jsonl"
    args = ["import", "--format", "vllm", str(path), "--out", str(out), "--config", "dtype=bf16"]
    r = runner.invoke(app, [*args, *MODEL_FLAGS])
    assert r.exit_code == 0, r.output
    assert "read by --format openai" in r.output and len(_read(out)) == 1
    assert _read(out)[0].config.extras["import_format"] == "openai"


def test_lm_eval_filters_give_one_trace_per_doc_and_do_sample_false_is_greedy(
    chat_checkpoint: Path, tmp_path: Path
) -> None:
    from tests.imports.conftest import FIXTURES

    samples = FIXTURES / "samples_gsm8k_2026-01-05T00-00-00.000000.jsonl"
    lines = [json.loads(x) for x in samples.read_text().splitlines()]
    assert len(lines) == 4 and {x["filter"] for x in lines} == {"strict-match", "flexible-extract"}
    for x in lines:  # HF decodes greedily with do_sample false, whatever the temperature
        x["arguments"]["gen_args_0"]["arg_1"]["temperature"] = 0.7
    copy = _write_jsonl(tmp_path / samples.name, lines)
    (tmp_path / "results_2026-01-05T00-00-00.000000.json").write_text(
        (FIXTURES / "results_2026-01-05T00-00-00.000000.json").read_text()
    )
    out = tmp_path / "t.jsonl"
    r = runner.invoke(
        app,
        [
            "import",
            "--format",
            "lm-eval",
            str(copy),
            "--model",
            str(chat_checkpoint),
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    traces = _read(out)
    assert [t.external_id for t in traces] == [
        "lm-eval:gsm8k:0:1767571200.0",
        "lm-eval:gsm8k:1:1767571200.0",
    ]
    for t in traces:
        assert t.config.extras["filters"] == "strict-match,flexible-extract"
        assert t.decoding.strategy == "greedy" and t.config.batch_size == 1  # results JSON
        assert t.config.extras["token_ids_source"] == "retokenized"


@pytest.mark.slow
def test_each_engines_default_layout_imports_and_its_replay_reproduces_it(
    chat_checkpoint: Path, tmp_path: Path
) -> None:
    """Done when (issue 21): each engine's default shape imports with ids (and top-k, or a
    reason per item), and a replay of each imported set runs, here in the logged fp32
    configuration (the chat checkpoint is the bundled model with a chat template)."""
    from tests.imports.conftest import FIXTURES

    _saved_generate(chat_checkpoint, tmp_path / "gen.pt")
    imports = [
        ("openai", FIXTURES / "vllm_chat_default.json", []),
        ("openai", FIXTURES / "vllm_chat_text_top_k.json", []),
        ("openai", FIXTURES / "openai_chat_logprobs.json", []),
        ("sglang", FIXTURES / "sglang_generate_default.json", []),
        ("vllm", FIXTURES / "vllm_offline_request_output.jsonl", ["decoding.strategy=greedy"]),
        ("lm-eval", FIXTURES / "samples_gsm8k_2026-01-05T00-00-00.000000.jsonl", []),
        ("hf", tmp_path / "gen.pt", ["decoding.strategy=greedy"]),
    ]
    every = tmp_path / "all.jsonl"
    with every.open("w") as sink:
        for n, (fmt, path, flags) in enumerate(imports):
            out = tmp_path / f"{n}.jsonl"
            config = [f for flag in ["dtype=fp32", *flags] for f in ("--config", flag)]
            r = runner.invoke(
                app,
                [
                    "import",
                    "--format",
                    fmt,
                    str(path),
                    "--model",
                    str(chat_checkpoint),
                    *config,
                    "--out",
                    str(out),
                ],
            )
            assert r.exit_code == 0, (path, r.output)
            traces = _read(out)
            assert traces and all(t.decoding.strategy == "greedy" for t in traces), path
            kept = [t.top_k is not None for t in traces]
            if path.name.startswith(("openai", "sglang")):  # the mode unknown: said per trace
                assert not any(kept) and "top-k not kept: the logprobs mode is" in r.output
            else:  # lm-eval logs no logprobs
                assert all(kept) != (fmt == "lm-eval"), path
            sink.write(out.read_text())
    results = tmp_path / "results.jsonl"
    r = runner.invoke(
        app,
        [
            "replay",
            str(every),
            "--model",
            str(chat_checkpoint),
            "--dtype",
            "fp32",
            "--out",
            str(results),
            "--device",
            "cpu",
            "--threads",
            "1",
        ],
    )
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    rows = [row for row in lines if row["comparison"] == 1]  # the reproduction check
    assert len(rows) == len(every.read_text().splitlines()) == 12
    assert all(row["status"] == "ok" for row in rows), rows
    exact = {row["trace_id"]: row["exact_match"] for row in rows}
    # lm-eval logs text: the model wrote "\n\n\n" as three tokens that the tokenizer merges, so
    # the re-tokenised trace diverges at step 0, as a non-canonical split does. Every log with
    # ids, or with pieces, reproduces exactly.
    assert [k for k, v in exact.items() if not v] == [
        "lm-eval:gsm8k:0:1767571200.0",
        "lm-eval:gsm8k:1:1767571200.0",
    ]
    assert all(row["first_divergence_step"] == 0 for row in rows if not row["exact_match"])
    # Every result says where its trace's ids came from (None: logged).
    sources = {row["trace_id"]: row["token_ids_source"] for row in rows}
    assert sources["chatcmpl-" + "b2" * 16] == "retokenized"  # the prompt; output: pieces
    assert sources["chatcmpl-" + "a1" * 16] is None and sources["0"] is None
    assert sources["lm-eval:gsm8k:0:1767571200.0"] == "retokenized"
    assert sources["0f3c2a9e4b1d4c8e9a0b1c2d3e4f5a6b"] == "retokenized"  # SGLang's prompt
    # Reproduce before compare: the target's comparison (0) of a trace that did not reproduce
    # is judged against that replay, one of an engine this service cannot run (vLLM, SGLang)
    # against its logged configuration replayed here, any other against its logged tokens;
    # every line says whether its trace reproduced.
    engines = {
        t.get("external_id") or f"line {n}": t["config"]["engine"]["name"]
        for n, t in enumerate(map(json.loads, every.read_text().splitlines()), start=1)
    }
    for row in lines:
        assert row["engine_reproduced"] is exact[row["trace_id"]], row
        if row["comparison"] == 0:
            expected = (
                "replayed"
                if logged_by_another_engine(engines[row["trace_id"]])
                else ("logged" if exact[row["trace_id"]] else "reproduced")
            )
            assert (row["baseline"], row["exact_match"]) == (expected, True), row
    assert {e for e in engines.values() if logged_by_another_engine(e)} == {
        "vllm",
        "sglang",
        "unknown",
    }


def test_a_penalised_greedy_request_replays_with_its_processors_and_an_unsupported_one_is_refused(
    chat_checkpoint: Path, tmp_path: Path
) -> None:
    """Issue 21: the processors a replay applies are imported with the trace and every result
    says they ran; a processor it does not apply makes the trace `other`, and its replay is
    refused naming the processor."""
    item = load_fixture("vllm_chat_text_top_k.json")
    item["request"].update(temperature=0, repetition_penalty=1.2, logit_bias={"201": -5})
    path = _write_jsonl(tmp_path / "r.jsonl", [item])
    out = tmp_path / "t.jsonl"
    model = ["--model", str(chat_checkpoint), "--config", "dtype=fp32"]
    r = runner.invoke(app, ["import", "--format", "openai", str(path), *model, "--out", str(out)])
    assert r.exit_code == 0, r.output
    [trace] = _read(out)
    assert trace.decoding.strategy == "greedy"
    assert trace.decoding.logits_processors is not None
    assert trace.decoding.logits_processors.stored() == {
        "repetition_penalty": 1.2,
        "logit_bias": {"201": -5.0},
    }
    results = tmp_path / "results.jsonl"
    replay = ["replay", str(out), *model[:2], "--dtype", "fp32", "--out", str(results)]
    r = runner.invoke(app, replay)
    assert r.exit_code == 0, r.output
    row, check = [json.loads(x) for x in results.read_text().splitlines()]
    # The reproduction check (its logged configuration replayed here) runs its processors
    # too; the fixture's tokens were logged without them, so it does not reproduce, and the
    # target's comparison of a vLLM trace is judged against that replay.
    assert check["comparison"] == 1 and check["engine_reproduced"] is check["exact_match"]
    assert (
        check["arms"]["b"]["resolved"]["logits_processors"]
        == row["arms"]["b"]["resolved"]["logits_processors"]
    )
    assert row["baseline"] == "replayed"
    ran = row["arms"]["b"]["resolved"]["logits_processors"]
    assert ran["repetition_penalty"] == 1.2 and ran["logit_bias"] == [[201, -5.0]]

    item["request"].update(frequency_penalty=0.3)
    path = _write_jsonl(tmp_path / "r2.jsonl", [item])
    r = runner.invoke(app, ["import", "--format", "openai", str(path), *model, "--out", str(out)])
    assert r.exit_code == 0, r.output
    [trace] = _read(out)
    assert trace.decoding.strategy == "other"
    assert "1 trace cannot be replayed (decoding.strategy: other 1)" in r.output
    assert "does not apply: frequency_penalty=0.3)" in r.output  # named at import already
    assert trace.config.extras["logits_processors"] == "frequency_penalty=0.3"
    r = runner.invoke(app, replay)
    assert r.exit_code == 2
    assert f"{out}:1: decoding.strategy: only greedy" in r.output
    assert "(logits processors a replay does not apply: frequency_penalty=0.3)" in r.output


def test_counts_of_one_read_in_the_singular(tmp_path: Path) -> None:
    """Issue 20: "wrote 1 traces", "1 items failed"."""
    path = tmp_path / "one.jsonl"
    chat = {"request": {"temperature": 0}, "response": load_fixture("vllm_chat_token_ids.json")}
    path.write_text(json.dumps(chat) + "\n{not json\n")
    out = tmp_path / "o.jsonl"
    r = runner.invoke(
        app,
        ["import", "--format", "openai", str(path), "--out", str(out), "--config", "dtype=bf16",
         *MODEL_FLAGS],
    )  # fmt: skip
    assert r.exit_code == 1, r.output
    assert "wrote 1 trace to" in r.output and "; 1 item failed" in r.output, r.output


def test_counted() -> None:
    from replay_audit.words import counted

    assert [counted(n, "trace") for n in (0, 1, 2)] == ["0 traces", "1 trace", "2 traces"]
    assert counted(1, "forward") == "1 forward" and counted(3, "axis", "axes") == "3 axes"


def test_a_file_of_another_format_says_which_reader_takes_it(
    chat_checkpoint: Path, tmp_path: Path
) -> None:
    """A torch.save file given to a text format, and a text file named .pt given to the hf
    reader: each error says what the file is and which format reads it, not a codec's or an
    unpickler's message."""
    import torch

    saved, text = tmp_path / "gen.pt", tmp_path / "log.pt"
    torch.save({"sequences": torch.tensor([[1, 2, 3]])}, saved)
    text.write_text('{"id": "chatcmpl-1"}\n')
    common = ["--model", str(chat_checkpoint), "--config", "dtype=fp32"]
    r = runner.invoke(
        app, ["import", "--format", "openai", str(saved), *common, "--out", str(tmp_path / "a")]
    )
    assert r.exit_code == 2
    assert f"{saved}: not UTF-8 text, what --format openai reads" in r.output
    assert "--format hf reads it" in r.output and "codec" not in r.output
    r = runner.invoke(
        app, ["import", "--format", "hf", str(text), *common, "--out", str(tmp_path / "b")]
    )
    assert r.exit_code == 1
    assert f"{text}: not a generate() output loadable safely (a text file" in r.output
    assert ".json or .jsonl" in r.output and "Unpickl" not in r.output


def test_a_wrong_format_names_the_format_the_file_looks_like(
    chat_checkpoint: Path, tmp_path: Path
) -> None:
    """An SGLang answer (`meta_info`) or an lm-eval sample (`doc_id`, `arguments`, `resps`)
    read with another `--format`: the error still names the field, and now the format too."""
    from tests.imports.conftest import FIXTURES

    answer = {"request": {"text": "a"}, "response": load_fixture("sglang_generate.json")}
    sglang = _write_jsonl(tmp_path / "answers.jsonl", [answer])
    samples = FIXTURES / "samples_gsm8k_2026-01-05T00-00-00.000000.jsonl"
    common = ["--model", str(chat_checkpoint), "--config", "dtype=fp32", "--out"]
    for fmt, path, field, found in [
        ("openai", sglang, "item.response.choices", "an SGLang /generate answer"),
        ("hf", sglang, "item.sequences", "an SGLang /generate answer"),
        ("openai", samples, "item.choices", "an lm-eval --log_samples sample"),
        ("sglang", samples, "item.meta_info", "an lm-eval --log_samples sample"),
    ]:
        right = "sglang" if path == sglang else "lm-eval"
        args = ["import", "--format", fmt, str(path), *common, str(tmp_path / "o")]
        r = runner.invoke(app, args)
        assert r.exit_code == 1, r.output
        assert f"{path}:1: {field}" in r.output, (fmt, r.output)
        assert f"(this looks like {found}: use --format {right})" in r.output, (fmt, r.output)
    # lm-eval's reader on an SGLang log: the file name or the sample says which format it is.
    lm = ["import", "--format", "lm-eval", str(sglang), *common, str(tmp_path / "o")]
    r = runner.invoke(app, lm)
    assert r.exit_code == 2 and "give --task (this looks like an SGLang" in r.output, r.output
    r = runner.invoke(app, [*lm, "--task", "t"])
    assert r.exit_code == 1 and "sample.arguments: missing" in r.output
    assert "use --format sglang)" in r.output
    # The right format with a bad item: no hint.
    bad = load_fixture("vllm_chat_token_ids.json")
    del bad["prompt_token_ids"]
    path = _write_jsonl(tmp_path / "bad.jsonl", [bad])
    r = runner.invoke(
        app, ["import", "--format", "openai", str(path), *common, str(tmp_path / "o")]
    )
    assert r.exit_code == 1 and "prompt_token_ids" in r.output and "looks like" not in r.output
