"""Issue 34 on the bundled model: the null's benign traces are what users' plain transformers
`generate()` gives for those prompts in that batch (distinct prompts, left-padded), each
variation named with its batch; a null measured from them records how far it reaches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.engine import EnginePool, Intervention, Target
from replay_audit.screenings.sweep.plan import ScreenConfig
from replay_audit.screenings.sweep.worker import TorchFacts
from replay_audit.verifications.null import (
    BENIGN_VARIATIONS,
    NullVariation,
    benign_null,
    generate,
)

PROMPTS = Path(BUNDLED_MODEL_DIR).parent / "prompts.jsonl"


def _rows(n: int) -> list[dict[str, Any]]:
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()[:n]
    return [json.loads(line) for line in lines]


def _plain_generate(
    prompts: list[list[int]], dtype: torch.dtype, max_new: int, eos: int
) -> list[list[int]]:
    """What a user's batch gives: the checkpoint loaded by transformers itself, the prompts
    left-padded with its pad id and masked, greedy `generate()`, each row cut after its eos."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR, dtype=dtype)
    model.eval()
    pad = int(model.generation_config.pad_token_id)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    rows = []
    for r in out[:, width:].tolist():
        rows.append(r[: r.index(eos) + 1] if eos in r else r)
    return rows


@pytest.mark.parametrize("batch", [1, 4])
def test_the_null_traces_are_plain_generate_of_those_prompts_in_that_batch(
    verify_pool: EnginePool, batch: int
) -> None:
    facts = TorchFacts(BUNDLED_MODEL_DIR, "cpu")
    prompts = facts.prompts(_rows(6))  # type: ignore[arg-type]
    (eos,) = facts.eos_ids()
    variation = NullVariation("bf16", batch_size=batch)
    made = generate(variation, prompts, 24, verify_pool, BUNDLED_MODEL_DIR, [eos], device="cpu")
    assert [t.prompt for t in made] == [list(p.token_ids) for p in prompts]
    expected: list[list[int]] = []
    ids = [list(p.token_ids) for p in prompts]
    for start in range(0, len(ids), batch):  # 6 prompts at 4 a call: a batch of 4, one of 2
        expected += _plain_generate(ids[start : start + batch], torch.bfloat16, 24, eos)
    assert [t.output for t in made] == expected
    assert all(t.decoding == {} for t in made)  # greedy: nothing beyond it to log
    if batch > 1:
        assert len({len(p) for p in ids[:4]}) > 1  # the batch was padded


def test_variations_name_their_batch_and_kernel() -> None:
    names = [v.key for v in BENIGN_VARIATIONS]
    assert len(set(names)) == len(names)
    assert "bf16 b1" in names and "bf16 b8" in names and "bf16 b4" in names
    assert "bf16 eager b1" in names and "fp16 b1" in names
    assert NullVariation.of(ScreenConfig("fp16", attn_kernel="eager", batch_size=8)).key == (
        "fp16 eager b8"
    )
    assert NullVariation("bf16", tp_degree=2).key == "bf16 tp2 b1"


@pytest.mark.slow
def test_a_batched_null_records_its_reach_and_what_ran(verify_pool: EnginePool) -> None:
    prompts = TorchFacts(BUNDLED_MODEL_DIR, "cpu").prompts(_rows(8))  # type: ignore[arg-type]
    cal = benign_null(
        BUNDLED_MODEL_DIR,
        Target("bf16", None, "sdpa", 1, Intervention()),
        prompts,
        pool=verify_pool,
        device="cpu",
        max_new_tokens=16,
        variations=(NullVariation("bf16", batch_size=4), NullVariation("fp16", batch_size=8)),
        budgets=(16, 32, 64, 128, 256),
        draws=50,
    )
    assert [v.name for v in cal.variations] == ["bf16 b4", "fp16 b8"]
    least = min(v.tokens for v in cal.variations)
    assert cal.reach is not None and cal.reach <= least < 2 * cal.reach
    assert f"{cal.reach:,} tokens" in cal.notes[-1] and "batched" in cal.notes[-1]
    assert [r.tokens for r in cal.rule] == [16, 32, 64, 128, 256]


def test_a_sampled_claims_null_samples_with_its_recipe_one_seed_a_call(
    verify_pool: EnginePool,
) -> None:
    """The null of a sampled claim: each call sampled with the claim's recipe and seeded by its
    batch's index, each trace logging what the scan needs to reproduce its draws (the recipe,
    the seed, its row of the batch); the claimed model's own traces, scanned so, are honest."""
    from replay_audit.engine.protocol import SamplingRecipe
    from replay_audit.verifications.null import _scan

    facts = TorchFacts(BUNDLED_MODEL_DIR, "cpu")
    prompts = facts.prompts(_rows(6))  # type: ignore[arg-type]
    recipe = SamplingRecipe("transformers", 0.7)
    variation = NullVariation("bf16", batch_size=4)
    made = generate(
        variation,
        prompts,
        12,
        verify_pool,
        BUNDLED_MODEL_DIR,
        facts.eos_ids(),
        device="cpu",
        sampling=recipe,
    )
    assert [t.decoding["sampling"]["seed"] for t in made] == [0, 0, 0, 0, 1, 1]
    assert [t.decoding["batch"]["row"] for t in made] == [0, 1, 2, 3, 0, 1]
    assert all(t.decoding["sampling"]["temperature"] == 0.7 for t in made)
    greedy = generate(
        variation, prompts, 12, verify_pool, BUNDLED_MODEL_DIR, facts.eos_ids(), device="cpu"
    )
    assert [t.output for t in made] != [t.output for t in greedy]  # it sampled
    claim = Target("bf16", None, "sdpa", 1, Intervention())
    ulps = _scan(made, claim, verify_pool, BUNDLED_MODEL_DIR)
    assert len(ulps) == len(made) and all(len(u) for u in ulps)
    assert max(float(u.max()) for u in ulps) <= 4.0  # reproduced: within the tie band


@pytest.mark.slow
def test_a_sampled_claims_calibration_names_its_recipe(verify_pool: EnginePool) -> None:
    prompts = TorchFacts(BUNDLED_MODEL_DIR, "cpu").prompts(_rows(4))  # type: ignore[arg-type]
    recipe = {"sampler": "transformers", "temperature": 0.7, "top_k": 0, "top_p": 1.0}
    cal = benign_null(
        BUNDLED_MODEL_DIR,
        Target("bf16", None, "sdpa", 1, Intervention()),
        prompts,
        pool=verify_pool,
        device="cpu",
        max_new_tokens=8,
        variations=(NullVariation("bf16", batch_size=4), NullVariation("bf16", tp_degree=2)),
        budgets=(16,),
        draws=20,
        sampling=recipe,
    )
    assert cal.claim.get("sampling") == recipe
    assert "sampled with transformers T=0.7" in cal.notes[-1]
    assert any("bf16 tp2 b1 not run here" in n for n in cal.notes)
