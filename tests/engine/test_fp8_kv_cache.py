"""The simulated FP8 KV-cache provider (`engine.testing.fp8_kv_cache`) on the bundled checkpoint:
its attention reads e4m3 keys and values, and that changes some greedy generations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.integrations import sdpa_attention

from replay_audit.engine import testing
from replay_audit.engine.generate import TraceGenerator
from replay_audit.engine.testing import FP8_KV_ATTENTION, e4m3_rounded, fp8_kv_cache

ASSETS = Path(__file__).resolve().parents[2] / "replay_audit" / "assets"
TINY = ASSETS / "tiny-llama"


def _prompts(n: int) -> list[list[int]]:
    gen_rows = [json.loads(x) for x in (ASSETS / "prompts.jsonl").read_text().splitlines()]
    return [list(r["prompt"].encode())[:48] for r in gen_rows[:n]]


@pytest.fixture(scope="module")
def generator() -> TraceGenerator:
    return TraceGenerator(TINY, dtype="bf16", attn_kernel="sdpa", device="cpu")


def test_attention_sees_e4m3_keys_and_values(
    generator: TraceGenerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    given: list[torch.Tensor] = []
    plain_sdpa = sdpa_attention.sdpa_attention_forward

    def spy(module: Any, query: Any, key: Any, value: Any, mask: Any, **kw: Any) -> Any:
        seen.append((key.detach().clone(), value.detach().clone()))
        return plain_sdpa(module, query, key, value, mask, **kw)

    def rounded(t: torch.Tensor) -> torch.Tensor:
        given.append(t.detach().clone())
        out: torch.Tensor = e4m3_rounded(t)
        return out

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", spy)
    monkeypatch.setattr(testing, "e4m3_rounded", rounded)
    ids = generator.tokenizer("def f(x):\n    return")["input_ids"]
    plain: Any = generator.model
    with fp8_kv_cache(plain) as model:
        assert model.config._attn_implementation == FP8_KV_ATTENTION
        generator.generate_ids(ids, 8)
    assert plain.config._attn_implementation == "sdpa"  # restored
    layers = plain.config.num_hidden_layers
    assert len(seen) == 8 * layers  # every layer at every step went through the FP8 cache
    for k, v in seen:
        assert k.dtype == torch.bfloat16
        for t in (k, v):
            assert torch.equal(t, t.to(torch.float8_e4m3fn).to(t.dtype))  # e4m3 values only
            assert t.abs().max() <= 448.0
    # not vacuous: the model's own keys and values are not all e4m3 values (bf16 has 4 more
    # mantissa bits)
    assert len(given) == 2 * len(seen)
    assert any(not torch.equal(t, e4m3_rounded(t)) for t in given)


def test_rounding_saturates_and_is_idempotent() -> None:
    x = torch.tensor([1000.0, -1000.0, 1.0 + 2.0**-5, 3.3, 2.0**-12], dtype=torch.bfloat16)
    r = e4m3_rounded(x)
    assert r.tolist() == [448.0, -448.0, 1.0, 3.25, 0.0]
    assert torch.equal(e4m3_rounded(r), r)


def test_fp8_kv_cache_changes_some_generations(generator: TraceGenerator) -> None:
    prompts = _prompts(24)
    plain = generator.generate_batch(prompts, 48)
    with fp8_kv_cache(generator.model):
        fp8 = generator.generate_batch(prompts, 48)
    differ = [a[0] != b[0] for a, b in zip(plain.rows, fp8.rows, strict=True)]
    assert any(differ), "an FP8 KV cache changed no greedy generation"
    assert not all(differ), "every generation changed: more than a rounding-level change"
    # the plain model is back: its generations are the same as before
    again = generator.generate_batch(prompts, 48)
    assert [r[0] for r in again.rows] == [r[0] for r in plain.rows]
