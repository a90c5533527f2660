"""Issue 21: a greedy generation that ran logits processors replays with them, through the
service, on SQLite and PostgreSQL, with the torch engine on the bundled model.

Traces are logged with transformers' own `generate()` (`replay-audit generate`'s producer) with
a repetition penalty and no-repeat 3-grams, and with a logit bias, bad words and min new tokens.
Stored with their processors, they self-replay exactly in their logged configuration, in every
mode; the same traces stored without them (what the replay would do if it ignored them)
diverge. Every surface says the processors ran: the result's resolved arm, the run page's "what
ran", the trace page, the export. A processor a replay does not apply (a frequency penalty) is
refused, naming it. Every result also says where its trace's token ids came from (`token_ids_
source`): the results API, the trace page and both exports."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replay_audit.config import BUNDLED_MODEL_DIR, Settings
from replay_audit.engine import EnginePool
from replay_audit.engine.protocol import LogitsProcessors
from replay_audit.worker import context
from tests.replays.conftest import HoldingRunner, all_results, ingest, run_to_done
from tests.ui.conftest import sign_in

N_PROMPTS = 6
MAX_NEW = 24
PENALTY = LogitsProcessors(repetition_penalty=1.3, no_repeat_ngram_size=3)
#: Ids of the bundled tokenizer that plain greedy writes on this prompt set (a bias and a ban
#: that change its tokens), and a length its penalised decodes stop before.
BIASED = LogitsProcessors(
    repetition_penalty=1.3,
    min_new_tokens=20,
    logit_bias=((7, 2.5), (292, -4.0)),
    bad_words_ids=((276,), (10, 343)),
)


@pytest.fixture
def torch_worker(
    monkeypatch: pytest.MonkeyPatch, db_url: str, pool: EnginePool
) -> Iterator[EnginePool]:
    """Worker settings on the test database and the torch engines on the bundled model."""
    monkeypatch.setenv("REPLAY_AUDIT_DATABASE_URL", db_url)
    monkeypatch.setenv("REPLAY_AUDIT_MODEL_DIRS", str(BUNDLED_MODEL_DIR))
    settings = Settings(_env_file=None)  # type: ignore[call-arg]  # from the env set above
    context.install_worker_context(context.WorkerContext(settings, pool))
    yield pool
    context.install_worker_context(None)


@cache
def _traces(which: str) -> tuple[str, ...]:
    """Traces (JSON) of the first prompts, logged by generate() with the processors."""
    from replay_audit.engine.generate import TraceGenerator

    rows = (BUNDLED_MODEL_DIR.parent / "prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(r)["prompt"] for r in rows if r.strip()][:N_PROMPTS]
    gen = TraceGenerator(BUNDLED_MODEL_DIR, dtype="fp32", attn_kernel="sdpa", device="cpu")
    spec = PENALTY if which == "penalty" else BIASED
    return tuple(
        json.dumps(
            gen.trace(p, max_new_tokens=MAX_NEW, external_id=f"{which}-{i}", processors=spec)
        )
        for i, p in enumerate(prompts)
    )


def _logged(which: str) -> list[dict[str, Any]]:
    return [json.loads(t) for t in _traces(which)]


def _without_processors(trace: dict[str, Any], ids_source: str) -> dict[str, Any]:
    """The same logged tokens stored as plain greedy (as a replay that ignored the processors
    would run them), marked as an import whose ids were re-tokenised or read from pieces."""
    out = json.loads(json.dumps(trace))
    del out["decoding"]["logits_processors"]
    out["external_id"] = "plain-" + trace["external_id"]
    out["config"]["extras"]["token_ids_source"] = ids_source
    return out


@pytest.mark.usefixtures("torch_worker")
def test_processed_traces_self_replay_exactly_and_plain_greedy_would_not(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    api_key: Callable[..., str],
) -> None:
    h = headers("admin")
    logged = _logged("penalty") + _logged("biased")
    assert all(t["decoding"]["logits_processors"] for t in logged)
    ids = ingest(client, h, logged)
    # Stored and read back with its processors, exactly as sent.
    stored = client.get(f"/v1/traces/{ids[0]}", headers=h).json()
    assert stored["decoding"]["logits_processors"] == logged[0]["decoding"]["logits_processors"]

    processed_runs = {}
    for mode in ("decode", "scan"):
        run = run_to_done(
            client, h, runner, {"trace_ids": ids, "compare_with": "self", "mode": mode}
        )
        processed_runs[mode] = run["id"]
        results = all_results(client, run["id"], h)
        assert len(results) == len(ids)
        assert all(x["status"] == "ok" and x["exact_match"] for x in results), [
            (x["trace_id"], x["error"], x["first_divergence_step"]) for x in results
        ]
        for x in results:
            ran = x["arms"]["b"]["resolved"]["logits_processors"]
            assert ran["repetition_penalty"] == 1.3
            if x["trace_id"] in ids[:N_PROMPTS]:
                assert ran["no_repeat_ngram_size"] == 3 and not ran["logit_bias"]
            else:
                assert ran["logit_bias"] == [[7, 2.5], [292, -4.0]]
                assert ran["bad_words_ids"] == [[276], [10, 343]]
                assert ran["min_new_tokens"] == 20 and ran["eos_token_ids"]
            assert x["token_ids_source"] is None  # logged by generate()
        labels = " ".join(r["label_b"] for r in run["ran"])
        assert "repetition_penalty=1.3, no_repeat_ngram_size=3" in labels
        assert "min_new_tokens=20, logit_bias=2 entries, bad_words_ids=2 entries" in labels

    # The same tokens as plain greedy: the replay decodes other tokens on most of them.
    sources = ["retokenized", "pieces"]
    plain = [_without_processors(t, sources[i % 2]) for i, t in enumerate(logged)]
    plain_ids = ingest(client, h, plain)
    run = run_to_done(client, h, runner, {"trace_ids": plain_ids, "compare_with": "self"})
    results = all_results(client, run["id"], h)
    diverged = [x for x in results if not x["exact_match"]]
    assert len(diverged) >= len(plain_ids) // 2, len(diverged)
    assert all(x["arms"]["b"]["resolved"]["logits_processors"] is None for x in results)
    # Every result says where its trace's ids came from.
    want = {tid: sources[i % 2] for i, tid in enumerate(plain_ids)}
    assert {x["trace_id"]: x["token_ids_source"] for x in results} == want

    # The exports say it too (JSONL and CSV), as the results do.
    jsonl = client.get(f"/v1/replays/{run['id']}/export?format=jsonl", headers=h).text
    records = [json.loads(line) for line in jsonl.splitlines()]
    assert {r["trace_id"]: r["token_ids_source"] for r in records} == want
    text = client.get(f"/v1/replays/{run['id']}/export?format=csv", headers=h).text
    rows = list(csv.DictReader(io.StringIO(text)))
    assert {r["trace_id"]: r["token_ids_source"] for r in rows} == want
    processed_run = processed_runs["decode"]
    lines = client.get(f"/v1/replays/{processed_run}/export?format=jsonl", headers=h).text
    assert all(json.loads(line)["token_ids_source"] is None for line in lines.splitlines())

    # The UI: the trace page names the source of the ids and the processors that ran.
    client.cookies.clear()
    assert sign_in(client, api_key("auditor")).status_code == 303
    page = client.get(f"/ui/runs/{run['id']}/traces/{plain_ids[0]}?comparison=0").text
    assert 'id="token-ids-source"' in page and "retokenized" in page
    assert 'id="logits-processors"' not in page
    page = client.get(f"/ui/runs/{run['id']}/traces/{plain_ids[1]}?comparison=0").text
    assert "pieces" in page
    page = client.get(f"/ui/runs/{processed_run}/traces/{ids[0]}?comparison=0").text
    assert 'id="logits-processors"' in page
    assert "repetition_penalty=1.3, no_repeat_ngram_size=3" in page
    assert "logged" in page.split('id="token-ids-source"')[1][:200]
    run_page = client.get(f"/ui/runs/{processed_run}").text
    assert "repetition_penalty=1.3" in run_page.split('id="ran"')[1]


def test_an_unsupported_processor_is_refused_naming_it(
    client: TestClient, runner: HoldingRunner, headers: Callable[..., dict[str, str]]
) -> None:
    """A greedy request that ran a frequency penalty is stored as `other` by the import, and a
    replay of it is refused with the processor named (never replayed as plain greedy)."""
    from replay_audit.imports.openai_compat import decoding_recipe

    strategy, processors = decoding_recipe(
        {"temperature": 0, "repetition_penalty": 1.3, "frequency_penalty": 0.4}
    )
    assert strategy == "other" and processors.named() == "frequency_penalty=0.4"
    h = headers("admin")
    trace = _logged("penalty")[0]
    trace["decoding"]["strategy"] = strategy
    trace["config"]["extras"]["logits_processors"] = processors.named()
    (tid,) = ingest(client, h, [trace])
    r = client.post("/v1/replays", json={"trace_ids": [tid], "compare_with": "self"}, headers=h)
    assert r.status_code == 422, r.text
    assert "frequency_penalty=0.4" in r.json()["detail"] and tid in r.json()["detail"]
    assert not runner.specs
