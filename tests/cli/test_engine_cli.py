"""`replay-audit hash-model`, `generate` and `replay` on the tiny random checkpoint."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from replay_audit.cli import app
from replay_audit.traces.schemas import TraceCreate

runner = CliRunner()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from replay_audit.engine.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def traces(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    prompts = d / "prompts.jsonl"
    texts = ["The quick brown fox", "def main():", "Once upon a time", "import os", "x = 1"]
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts))
    )
    out = d / "traces.jsonl"
    r = runner.invoke(
        app,
        [
            "generate",
            "--model",
            str(ckpt),
            "--dtype",
            "bf16",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "16",
            "--out",
            str(out),
            "--tag",
            "cli",
            "--tag",
            "run=1",
            "--limit",
            "4",
            "--attn-kernel",
            "eager",
            "--device",
            "cpu",
            "--threads",
            "1",
        ],
    )
    assert r.exit_code == 0, r.output
    return out


def test_hash_model_follows_the_documented_rule(ckpt: Path) -> None:
    files = sorted(p for p in ckpt.iterdir() if p.name.endswith(".safetensors"))
    text = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in files)
    r = runner.invoke(app, ["hash-model", str(ckpt)])
    assert r.exit_code == 0
    assert r.output.strip() == hashlib.sha256(text.encode()).hexdigest()


def test_hash_model_without_weights_exits_2(tmp_path: Path) -> None:
    r = runner.invoke(app, ["hash-model", str(tmp_path)])
    assert r.exit_code == 2 and "safetensors" in r.output


def test_generate_writes_valid_traces(traces: Path) -> None:
    rows = [json.loads(x) for x in traces.read_text().splitlines()]
    assert len(rows) == 4  # --limit
    for i, row in enumerate(rows):
        tr = TraceCreate.model_validate(row)
        assert tr.external_id == f"p{i}" and tr.tags == ["cli", "run=1"]
        assert tr.config.attn_kernel == "eager" and tr.config.dtype == "bf16"
        assert tr.decoding.max_new_tokens == 16 and tr.top_k is not None


def test_replay_self_is_exact_and_summarised(ckpt: Path, traces: Path, tmp_path: Path) -> None:
    out, summary = tmp_path / "results.jsonl", tmp_path / "summary.json"
    r = runner.invoke(
        app,
        [
            "replay",
            str(traces),
            "--model",
            str(ckpt),
            "--dtype",
            "bf16",
            "--out",
            str(out),
            "--summary-json",
            str(summary),
            "--device",
            "cpu",
            "--threads",
            "1",
        ],
    )
    assert r.exit_code == 0, r.output
    results = [json.loads(x) for x in out.read_text().splitlines()]
    # Two comparisons a trace: the target's (0) and the reproduction check in the logged
    # configuration (1), here the same configuration: both exact.
    assert sorted((x["trace_id"], x["comparison"]) for x in results) == [
        (f"p{i}", c) for i in range(4) for c in (0, 1)
    ]
    assert all(x["exact_match"] and x["baseline"] == "logged" for x in results)
    assert "reproduced in their own logged configuration: 4 of 4 traces" in r.output
    s = json.loads(summary.read_text())
    assert s["ear"]["estimate"] == 1.0 and s["categories"]["agreed"]["successes"] == 4
    assert s["n"] == 4 and s["label"] == "logged vs T0: bf16"
    assert "EAR" in r.output and "100.0%" in r.output


def test_replay_in_fp16_with_c_and_scan_mode(ckpt: Path, traces: Path, tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    r = runner.invoke(
        app,
        [
            "replay",
            str(traces),
            "--model",
            str(ckpt),
            "--dtype",
            "fp16",
            "--out",
            str(out),
            "--intervention",
            "C",
            "--tau-ulps",
            "2",
            "--mode",
            "scan_then_decode",
            "--control-fraction",
            "1",
            "--decode-window",
            "0",
            "--summary-json",
            str(tmp_path / "summary.json"),
            "--kv-cache",
            "compiled",
            "--device",
            "cpu",
            "--threads",
            "1",
        ],
    )
    assert r.exit_code == 0, r.output
    # Every unflagged trace is in a control sample of fraction 1: all decoded, none only scanned.
    summary = json.loads((tmp_path / "summary.json").read_text())
    screening = summary["screening"]
    assert screening["scanned"] == 4 and screening["scanned_only"] == 0
    decoded = screening["flagged"] + screening["near_tie"] + screening["control"]
    assert screening["decoded"] == decoded == 4
    assert screening["decoded_by_reason"]["near_tie"] == screening["near_tie"]
    assert "estimated miss rate" in r.output and "decode window" in r.output
    # A mode named and no --flagged-fraction: every flagged trace decoded (the flagged sample).
    assert screening["flagged_fraction"] == 1.0 and screening["flagged_scanned"] == 0
    assert screening["flagged_decoded"] == screening["flagged"] and "flagged sample" in r.output
    # ... and every near-tie trace (the same flagged sample), its rate's sample size said.
    assert screening["near_tie_decoded"] == screening["near_tie"]
    assert screening["near_tie_scanned"] == 0
    nd = screening["near_tie_divergence"]
    assert (nd["n"], nd["successes"]) == (screening["near_tie"], screening["near_tie_diverged"])
    assert ("near-tie sample" in r.output) == (screening["near_tie"] > 0)
    cut = 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # The reproduction check (comparison 1) ran in the logged configuration: BF16, no C.
    checks = [x["arms"]["b"]["resolved"] for x in rows if x["comparison"] == 1]
    assert len(checks) == 4
    assert all(c["dtype"] == "bf16" and c["intervention"]["kind"] == "none" for c in checks)
    for x in (x for x in rows if x["comparison"] == 0):
        # --decode-window 0: a decode that diverged stops at the token at t* (unless it ended
        # there anyway): the logged prefix and that token, nothing after.
        if x["window_cut"]:
            cut += 1
            assert len(x["arms"]["b"]["output_token_ids"]) == x["first_divergence_step"] + 1
            assert x["cascade_length"] is None and x["length_difference"] is None
        assert x["screen"] in ("flagged", "near_tie", "control") and x["exact_match"] is not None
        b = x["arms"]["b"]
        assert x["mode"] == "scan_then_decode" and b["resolved"]["intervention"]["kind"] == "C"
        assert b["resolved"]["intervention"]["tau_ulps"] == 2.0 and b["resolved"]["dtype"] == "fp16"
        assert b["resolved"]["engine_path"] == "compiled"
        assert b["environment"]["dtype"] == "fp16"
        assert b["environment"]["extras"]["kv_cache"] == "static"
        assert b["environment"]["extras"]["decoder"] == "compiled"
    assert (summary["decode_window"], summary["window_cut"]) == (0, cut)


def test_replay_refuses_other_weights(ckpt: Path, traces: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    with (other / "model.safetensors").open("ab") as f:
        f.write(b"\0")  # one more byte: other weights
    r = runner.invoke(
        app,
        [
            "replay",
            str(traces),
            "--model",
            str(other),
            "--dtype",
            "fp16",
            "--out",
            str(tmp_path / "r.jsonl"),
        ],
    )
    assert r.exit_code == 2
    assert "weights_sha256" in r.output and "refusing" in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)  # no traceback


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dtype", "fp64"], "Invalid value for '--dtype'"),
        (["--dtype", "fp16", "--tau", "0.1", "--tau-ulps", "2"], "not both"),
        (["--dtype", "fp16", "--intervention", "D"], "Invalid value for '--intervention'"),
        (["--dtype", "fp16", "--mode", "fast"], "Invalid value for '--mode'"),
        # the dynamic and static decode paths are gone: piecewise is the faithful one
        (["--dtype", "fp16", "--kv-cache", "static"], "Invalid value for '--kv-cache'"),
        (["--dtype", "fp16", "--kv-cache", "dynamic"], "Invalid value for '--kv-cache'"),
        (["--dtype", "fp16", "--decode-window", "-1"], "Invalid value for '--decode-window'"),
        (
            ["--dtype", "fp16", "--decode-window", str(10**20)],
            "Invalid value for '--decode-window'",
        ),
        (["--dtype", "fp16", "--tp-degree", str(10**20)], "Invalid value for '--tp-degree'"),
        (["--dtype", "fp16", "--tp-degree", "two"], "Invalid value for '--tp-degree'"),
        (["--dtype", "fp16", "--mode", "scan", "--decode-window", "2"], "decodes nothing"),
        (["--dtype", "fp16", "--flagged-fraction", "0"], "--flagged-fraction must be more than 0"),
        (
            ["--dtype", "fp16", "--flagged-fraction", "1.5"],
            "Invalid value for '--flagged-fraction'",
        ),
    ],
)
def test_replay_rejects_bad_options(
    ckpt: Path, traces: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    r = runner.invoke(
        app,
        ["replay", str(traces), "--model", str(ckpt), "--out", str(tmp_path / "r.jsonl"), *args],
    )
    assert r.exit_code == 2 and message in r.output


def test_replay_rejects_a_bad_trace_line(ckpt: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"model": {}}\n')
    r = runner.invoke(
        app,
        [
            "replay",
            str(bad),
            "--model",
            str(ckpt),
            "--dtype",
            "fp16",
            "--out",
            str(tmp_path / "r"),
        ],
    )
    assert r.exit_code == 2 and "bad.jsonl:1: not a valid trace" in r.output


def test_generate_with_a_mistyped_model_says_not_a_directory(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    typo = tmp_path / "tiny-lama"
    r = runner.invoke(
        app,
        ["generate", "--model", str(typo), "--prompts", str(prompts), "--out", str(tmp_path / "o")],
    )
    assert r.exit_code == 2, r.output
    assert f"{typo} is not a directory" in r.output
    assert "repo" not in r.output.lower()  # not the hub's words about repo ids


def test_generate_names_the_prompt_line_without_a_prompt(ckpt: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n\n{"id": "b", "text": "hi"}\n')
    r = runner.invoke(
        app,
        ["generate", "--model", str(ckpt), "--prompts", str(prompts), "--out", str(tmp_path / "o")],
    )
    assert r.exit_code == 2 and f"{prompts}:3: prompt:" in r.output, r.output


def test_load_model_refuses_a_path_that_is_no_directory(tmp_path: Path) -> None:
    from replay_audit.engine.loading import load_model
    from replay_audit.exceptions import EngineError

    with pytest.raises(EngineError, match="is not a directory"):
        load_model(tmp_path / "typo", "bf16", None, torch.device("cpu"))


def test_replay_names_a_non_greedy_line_before_loading_the_model(
    traces: Path, tmp_path: Path
) -> None:
    rows = [json.loads(x) for x in traces.read_text().splitlines()]
    rows[2]["decoding"]["strategy"] = "sample"
    bad = tmp_path / "mixed.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The checkpoint is not even a directory: had any model load or hash been tried first, the
    # error would be about it, not about line 3.
    r = runner.invoke(
        app,
        ["replay", str(bad), "--model", str(tmp_path / "none"), "--dtype", "fp16",
         "--out", str(tmp_path / "r.jsonl")],
    )  # fmt: skip
    assert r.exit_code == 2, r.output
    assert f"{bad}:3: decoding.strategy: only greedy traces can be replayed" in r.output
    assert not (tmp_path / "r.jsonl").exists()


def test_replay_names_the_line_logged_with_other_weights(
    ckpt: Path, traces: Path, tmp_path: Path
) -> None:
    rows = [json.loads(x) for x in traces.read_text().splitlines()]
    rows[1]["model"]["weights_sha256"] = "0" * 64
    bad = tmp_path / "other.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = runner.invoke(
        app,
        ["replay", str(bad), "--model", str(ckpt), "--dtype", "fp16",
         "--out", str(tmp_path / "r.jsonl")],
    )  # fmt: skip
    assert r.exit_code == 2 and f"{bad}:2: model.weights_sha256:" in r.output, r.output


def test_generate_renders_chat_messages_with_the_checkpoints_chat_template(
    tmp_path: Path,
) -> None:
    """A `{"messages": [...]}` line is rendered by the checkpoint's chat template (with the
    generation prompt, no special tokens added on top); the trace keeps both."""
    from transformers import AutoTokenizer

    from tests.imports.conftest import make_chat_checkpoint

    chat = make_chat_checkpoint(tmp_path / "tiny-llama-chat")
    messages = [
        {"role": "system", "content": "Write Python."},
        {"role": "user", "content": "def f("},
    ]
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(
        json.dumps({"id": "c", "messages": messages})
        + "\n"
        + json.dumps({"id": "t", "prompt": "def f("})
        + "\n"
    )
    out = tmp_path / "traces.jsonl"
    args = ["generate", "--model", str(chat), "--prompts", str(prompts), "--out", str(out)]
    flags = ["--dtype", "fp32", "--max-new-tokens", "4", "--device", "cpu", "--threads", "1"]
    r = runner.invoke(app, [*args, *flags])
    assert r.exit_code == 0, r.output
    chat_trace, text_trace = [
        TraceCreate.model_validate_json(x) for x in out.read_text().splitlines()
    ]
    rendered = "<s><|system|>\nWrite Python.</s>\n<|user|>\ndef f(</s>\n<|assistant|>\n"
    assert chat_trace.prompt_text == rendered
    assert [m.model_dump() for m in chat_trace.prompt_messages or []] == messages
    tokenizer = AutoTokenizer.from_pretrained(str(chat))
    assert chat_trace.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert chat_trace.prompt_token_ids.count(0) == 1  # one BOS: the template's
    assert text_trace.prompt_text == "def f(" and text_trace.prompt_messages is None

    plain = tmp_path / "plain"  # the bundled tokenizer has no chat template
    shutil.copytree(chat, plain)
    (plain / "chat_template.jinja").unlink()
    r = runner.invoke(
        app,
        ["generate", "--model", str(plain), "--prompts", str(prompts), "--out", str(out), *flags],
    )
    assert r.exit_code == 2 and "no chat template" in r.output, r.output


def test_generate_with_logits_processors_replays_exactly_with_them(
    ckpt: Path, tmp_path: Path
) -> None:
    """`generate --repetition-penalty --no-repeat-ngram-size --logit-bias --bad-words-ids`
    records the processors it ran in each trace; `replay` applies them (each result's resolved
    arm says so, and the summary counts them), so the traces replay exactly. A bad flag exits 2
    naming it."""
    prompts = tmp_path / "prompts.jsonl"
    texts = ["The quick brown fox", "def main():", "Once upon a time"]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    out = tmp_path / "traces.jsonl"
    base = ["generate", "--model", str(ckpt), "--prompts", str(prompts), "--out", str(out)]
    flags = ["--dtype", "fp32", "--max-new-tokens", "16", "--device", "cpu", "--threads", "1"]
    processors = [
        "--repetition-penalty",
        "1.3",
        "--no-repeat-ngram-size",
        "2",
        "--logit-bias",
        "65=2.5",
        "--bad-words-ids",
        "32,116",
    ]
    r = runner.invoke(app, [*base, *flags, *processors])
    assert r.exit_code == 0, r.output
    traces = [TraceCreate.model_validate_json(x) for x in out.read_text().splitlines()]
    for tr in traces:
        assert tr.decoding.logits_processors is not None
        assert tr.decoding.logits_processors.stored() == {
            "repetition_penalty": 1.3,
            "no_repeat_ngram_size": 2,
            "logit_bias": {"65": 2.5},
            "bad_words_ids": [[32, 116]],
        }
    results = tmp_path / "results.jsonl"
    replay = ["replay", str(out), "--model", str(ckpt), "--dtype", "fp32", "--out", str(results)]
    r = runner.invoke(app, [*replay, "--device", "cpu", "--threads", "1"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert len(rows) == 6 and all(x["exact_match"] for x in rows)  # the target and the check
    assert all(x["arms"]["b"]["resolved"]["logits_processors"]["logit_bias"] for x in rows)
    assert "3 traces replayed with their logits processors (repetition_penalty=1.3" in r.output

    r = runner.invoke(app, [*base, *flags, "--logit-bias", "65"])
    assert r.exit_code == 2 and "--logit-bias '65': expected ID=BIAS" in r.output


@pytest.mark.parametrize("fraction", [None, "0.5"])
def test_replay_naming_no_mode_on_a_large_run_takes_the_large_run_defaults(
    ckpt: Path, traces: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fraction: str | None
) -> None:
    """Offline as in the service: a run of at least REPLAY_AUDIT_LARGE_RUN_TRACES traces that
    names no mode is scanned then decoded, to t* + the large-run window, decoding the flagged
    sample of the large-run fraction (the deployment's setting where it is set)."""
    monkeypatch.setenv("REPLAY_AUDIT_LARGE_RUN_TRACES", "3")  # the fixture's 4 traces: large
    if fraction is not None:
        monkeypatch.setenv("REPLAY_AUDIT_LARGE_RUN_FLAGGED_FRACTION", fraction)
    summary_path = tmp_path / "summary.json"
    args = ["replay", str(traces), "--model", str(ckpt), "--dtype", "fp16"]
    args += ["--out", str(tmp_path / "r.jsonl"), "--summary-json", str(summary_path)]
    r = runner.invoke(app, [*args, "--device", "cpu", "--threads", "1"])
    assert r.exit_code == 0, r.output
    summary = json.loads(summary_path.read_text())
    assert summary["decode_window"] == 32
    screening = summary["screening"]
    assert screening["flagged_fraction"] == (0.05 if fraction is None else 0.5)
    assert screening["scanned"] == 4
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert {x["mode"] for x in rows if x["comparison"] == 0} == {"scan_then_decode"}
