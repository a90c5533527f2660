"""`replay-audit generate --temperature`: seeded sampled traces as users make them
(generate(do_sample=True) after torch.manual_seed), each recording its seeded sampler, stored
and read back over HTTP on both databases with the sampler whole, and reproduced by a scan
(issue 34)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from replay_audit.cli import app
from replay_audit.engine import EnginePool
from replay_audit.replays.domain import LoggedTrace
from replay_audit.verifications.scan import deficit_arrays, scan_evidence

runner = CliRunner()
TINY = Path(__file__).parents[2] / "replay_audit" / "assets" / "tiny-llama"


def _generate(tmp: Path, *extra: str) -> tuple[int, str, list[dict[str, Any]]]:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"prompt {i}: "}) + "\n" for i in range(3)))
    out = tmp / "traces.jsonl"
    r = runner.invoke(
        app,
        ["generate", "--model", str(TINY), "--prompts", str(prompts), "--out", str(out),
         "--max-new-tokens", "12", "--device", "cpu", "--threads", "1", *extra],
    )  # fmt: skip
    traces = [json.loads(x) for x in out.read_text().splitlines()] if r.exit_code == 0 else []
    return r.exit_code, r.output, traces


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    code, output, traces = _generate(
        tmp_path_factory.mktemp("sampled"),
        "--temperature", "0.9", "--sample-top-k", "40", "--seed", "11", "--batch-size", "2",
    )  # fmt: skip
    assert code == 0, output
    return traces


def test_each_trace_records_its_seeded_sampler_and_its_batch(
    sampled: list[dict[str, Any]],
) -> None:
    decodings = [t["decoding"] for t in sampled]
    assert all(d["strategy"] == "sample" for d in decodings)
    samplings = [d["sampling"] for d in decodings]
    # One seed per generate() call: the base seed plus the call's first row.
    assert [s["seed"] for s in samplings] == [11, 11, 13]
    assert {(s["sampler"], s["temperature"], s["top_k"], s["top_p"]) for s in samplings} == {
        ("transformers", 0.9, 40, 1.0)
    }
    assert [d.get("batch", {}).get("row") for d in decodings] == [0, 1, None]


def test_the_scan_reproduces_the_logged_draws(sampled: list[dict[str, Any]]) -> None:
    traces = [
        LoggedTrace.from_parts(
            external_id=None,
            weights_sha256="",
            vocab_size=t["model"]["vocab_size"],
            config=t["config"],
            decoding=t["decoding"],
            prompt_token_ids=t["prompt_token_ids"],
            output_token_ids=t["output_token_ids"],
            top_k_logits=None,
        )
        for t in sampled
    ]
    ulps = np.concatenate(deficit_arrays(scan_evidence(traces, EnginePool(device="cpu"), TINY)))
    assert ulps.size == sum(len(t["output_token_ids"]) for t in sampled)
    assert (ulps <= 4).all() and (ulps == 0).mean() >= 0.9


def test_the_sampler_is_stored_and_read_back_whole(
    sampled: list[dict[str, Any]],
    client: TestClient,
    headers: Callable[..., dict[str, str]],
) -> None:
    h = headers()
    r = client.post("/v1/traces:batch", json={"traces": sampled}, headers=h)
    assert r.status_code in (200, 201, 207), r.text
    ids = [x["id"] for x in r.json()["results"]]
    for trace_id, logged in zip(ids, sampled, strict=True):
        got = client.get(f"/v1/traces/{trace_id}", headers=h).json()
        assert got["decoding"]["sampling"] == logged["decoding"]["sampling"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--top-p", "0.5"], "give --temperature too"),
        (["--temperature", "0"], "--temperature must be above 0"),
    ],
)
def test_a_sampler_flag_without_a_temperature_is_refused(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    code, output, _ = _generate(tmp_path, *flags)
    assert code == 2 and message in output
