"""The import round trip on the bundled model: generate greedily with transformers, write the
same generation as vLLM would answer it (an OpenAI chat response with `return_token_ids`,
`return_tokens_as_token_ids` and top-5 raw logprobs: log_softmax of the float32 logits, as
vLLM's default `--logprobs-mode raw_logprobs`), import it, and replay it in its logged
configuration: exact, and the imported margins are the engine's logit margins to float32
rounding."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.engine import EnginePool, Target
from replay_audit.engine.generate import TraceGenerator
from replay_audit.imports.schemas import ImportContext
from replay_audit.imports.service import traces_from_item
from replay_audit.replays.domain import LoggedTrace
from replay_audit.replays.pipeline import replay_trace

pytestmark = pytest.mark.slow  # real transformers generate() on 2 shared cores

TOP_K = 5
MAX_NEW = 24


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompts() -> list[str]:
    path = BUNDLED_MODEL_DIR.parent / "prompts.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [str(r["prompt"]) for r in rows[:8]]


def vllm_response(gen: TraceGenerator, prompt: str, n: int) -> tuple[dict[str, Any], Any]:
    """(the chat response vLLM would give for this greedy generation, the float32 logits)."""
    prompt_ids = gen.encode(prompt)
    output_ids, logits = gen.generate_ids(prompt_ids, MAX_NEW)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # vLLM: float32 log_softmax
    values, ids = torch.topk(logprobs, TOP_K, dim=-1)
    content = []
    for t, token in enumerate(output_ids):
        content.append(
            {
                "token": f"token_id:{token}",
                "logprob": max(float(logprobs[t, token]), -9999.0),
                "bytes": None,
                "top_logprobs": [
                    {
                        "token": f"token_id:{int(i)}",
                        "logprob": max(float(v), -9999.0),
                        "bytes": None,
                    }
                    for v, i in zip(values[t], ids[t], strict=True)
                ],
            }
        )
    stopped = output_ids[-1] in gen.eos_ids
    response = {
        "id": f"chatcmpl-roundtrip-{n}",
        "object": "chat.completion",
        "created": 1733000000,
        "model": "tiny-llama",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": gen.tokenizer.decode(output_ids)},
                "logprobs": {"content": content},
                "finish_reason": "stop" if stopped else "length",
                "stop_reason": None,
                "token_ids": output_ids,
            }
        ],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(output_ids),
            "total_tokens": len(prompt_ids) + len(output_ids),
        },
        "prompt_token_ids": prompt_ids,
    }
    return response, logits.float().numpy()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_imported_vllm_responses_replay_exactly_with_the_engines_margins(dtype: str) -> None:
    gen = TraceGenerator(BUNDLED_MODEL_DIR, dtype=dtype, attn_kernel="eager", device="cpu")
    context = ImportContext.model_validate(
        {
            "model": {
                "name": "tiny-llama",
                "weights_sha256": gen.weights_sha256,
                "vocab_size": 4096,
            },
            "dtype": dtype,
            "device": "cpu",
            "attn_kernel": "eager",
            "batch_size": 1,
            "engine": {"name": "transformers"},
            "logprobs_mode": "raw_logprobs",
            "decoding": {"eos_token_ids": gen.eos_ids},
        }
    )
    pool = EnginePool(device="cpu")
    request = {
        "temperature": 0,
        "max_tokens": MAX_NEW,
        "logprobs": True,
        "top_logprobs": TOP_K,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    n_steps = 0
    for n, prompt in enumerate(_prompts()):
        response, logits = vllm_response(gen, prompt, n)
        [trace] = traces_from_item("openai", {"request": request, "response": response}, context)
        assert trace.decoding.strategy == "greedy"
        assert trace.top_k is not None and trace.config.extras["top_k_values"] == "raw_logprobs"

        # The imported margins are the engine's logit margins, to float32 rounding.
        stored = np.asarray(trace.top_k.logits, dtype=np.float32)
        imported = stored[:, 0].astype(np.float64) - stored[:, 1]
        top2 = -np.sort(-logits, axis=1)[:, :2].astype(np.float64)
        engine = top2[:, 0] - top2[:, 1]
        tolerance = 4 * np.finfo(np.float32).eps * np.maximum(1.0, np.abs(stored[:, :2]).max(1))
        assert np.all(np.abs(imported - engine) <= tolerance), (imported - engine, tolerance)
        # The engine's own log has the same top-k: the same ids above the k-th logit, in the
        # same order; at the k-th place vLLM's `torch.topk` may keep any of the ids tied there
        # (the engine keeps the smallest), so there only the logit must be the k-th one's.
        reference = gen.trace(prompt, max_new_tokens=MAX_NEW, top_k=TOP_K)
        assert trace.output_token_ids == reference["output_token_ids"]
        ref_ids = reference["top_k"]["ids"]
        for t, (mine, ref) in enumerate(zip(trace.top_k.ids, ref_ids, strict=True)):
            kth = logits[t, ref[-1]]
            above = [i for i in mine if logits[t, i] > kth]
            assert above == ref[: len(above)], (t, mine, ref)
            assert all(logits[t, i] == kth for i in mine[len(above) :]), (t, mine, ref)

        logged = LoggedTrace.from_json(trace.model_dump())
        outcome = replay_trace(
            logged, Target.from_config(trace.config.model_dump()), pool, model_dir=BUNDLED_MODEL_DIR
        )
        assert outcome.exact_match and outcome.first_divergence_step is None, prompt
        n_steps += len(trace.output_token_ids)
    assert n_steps >= 8 * 4
