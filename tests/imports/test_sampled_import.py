"""A vLLM request that sampled with its own seed imports with its seeded sampler
(`decoding.sampling`), so a verification can reproduce its draws (issue 34); one it could not
reproduce imports without it, as sampled traffic set apart."""

from __future__ import annotations

import pytest

from replay_audit.imports.service import traces_from_item
from tests.imports.conftest import load_fixture, make_context

SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 42, "max_tokens": 16, "logprobs": True}


def _item(file: str, **request: object) -> dict[str, object]:
    return {"request": {**SAMPLED, **request}, "response": load_fixture(file)}


def test_a_seeded_vllm_chat_request_records_its_sampler() -> None:
    [trace] = traces_from_item("openai", _item("vllm_chat_token_ids.json"), make_context())
    assert trace.decoding.strategy == "sample"
    assert trace.decoding.sampling is not None
    assert trace.decoding.sampling.model_dump() == {
        "sampler": "vllm",
        "seed": 42,
        "temperature": 0.8,
        "top_k": 0,
        "top_p": 0.95,
        "device": "cuda",
    }


def test_each_of_n_choices_gets_vllms_seed_plus_its_index() -> None:
    item = _item(
        "vllm_completion_token_ids.json",
        n=2,
        top_k=-1,
        prompt=[1, 1724, 338, 29871, 29953, 29930],
        return_tokens_as_token_ids=True,
        logprobs=2,
    )
    traces = traces_from_item("openai", item, make_context(device="cpu"))
    assert len(traces) == 2
    seeds = [t.decoding.sampling.seed for t in traces if t.decoding.sampling is not None]
    assert seeds == [42, 43]
    assert {t.decoding.sampling.device for t in traces if t.decoding.sampling} == {"cpu"}
    assert all(t.decoding.sampling and t.decoding.sampling.top_k == 0 for t in traces)


@pytest.mark.parametrize(
    "request_edit",
    [{"seed": None}, {"min_p": 0.05}, {"seed": True}],
    ids=["no_seed", "min_p", "bool_seed"],
)
def test_a_sampler_no_verification_reproduces_is_not_recorded(
    request_edit: dict[str, object],
) -> None:
    item = _item("vllm_chat_token_ids.json", **request_edit)
    [trace] = traces_from_item("openai", item, make_context())
    assert trace.decoding.strategy == "sample"
    assert trace.decoding.sampling is None


def test_a_greedy_request_records_no_sampler() -> None:
    item = _item("vllm_chat_token_ids.json", temperature=0)
    [trace] = traces_from_item("openai", item, make_context())
    assert trace.decoding.strategy == "greedy" and trace.decoding.sampling is None


def test_a_full_recipe_beside_a_context_with_every_extra_it_may_give_imports() -> None:
    """Issue 33: the import's own `config.extras` (its provenance and the request's recipe
    fields) fit beside as many extras as the context may give: never a 4xx for a request
    that names its whole recipe."""
    from replay_audit.imports.openai_compat import RECIPE_FIELDS
    from replay_audit.imports.schemas import IMPORT_EXTRAS
    from replay_audit.traces.schemas import MAX_EXTRAS

    recipe = {
        "temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.0, "seed": 1,
        "sampling_seed": 2, "stop": ["\n\n"], "stop_token_ids": [2], "ignore_eos": False,
        "min_tokens": 1, "n": 1, "best_of": 1,
    }  # fmt: skip
    assert set(recipe) == set(RECIPE_FIELDS)
    context = make_context(extras={f"k{i}": i for i in range(MAX_EXTRAS - IMPORT_EXTRAS)})
    [trace] = traces_from_item("openai", _item("vllm_chat_token_ids.json", **recipe), context)
    assert len(trace.config.extras) <= MAX_EXTRAS
    assert trace.config.extras["top_k"] == 40 and trace.config.extras["k0"] == 0
