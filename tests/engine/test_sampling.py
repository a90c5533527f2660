"""The seeded samplers' noise and the draw evidence (`engine.sampling`), against torch itself:
`torch.multinomial(p, 1)` after `torch.manual_seed(seed)` is the exponential race over the
noise `engine.sampling.noise` draws (what `generate(do_sample=True)` relies on), and the
evidence follows its definition at the edges (the drawn token, a token outside the top-k)."""

from __future__ import annotations

import pytest
import torch

from replay_audit.engine.generate import sampling_json
from replay_audit.engine.protocol import Sampling, SamplingRecipe
from replay_audit.engine.sampling import draw_evidence, noise, warped
from replay_audit.exceptions import EngineError


def test_multinomial_is_the_race_over_the_noise_drawn_here() -> None:
    """Several steps of a batch of 3 rows sampled with torch.multinomial after manual_seed:
    every row's token is argmax(p / q) with q the row of each step's (3, V) draw."""
    vocab, rows, steps, seed = 500, 3, 6, 1234
    gen = torch.Generator().manual_seed(0)
    probs = [
        torch.softmax(torch.randn(rows, vocab, generator=gen) * 3, dim=-1) for _ in range(steps)
    ]
    torch.manual_seed(seed)
    sampled = [torch.multinomial(p, num_samples=1)[:, 0] for p in probs]
    recipe = SamplingRecipe("transformers", 1.0)
    for row in range(rows):
        q = noise(Sampling(recipe, seed, "cpu", rows, row), steps, vocab, torch.device("cpu"))
        raced = [int((probs[t][row] / q[t]).argmax()) for t in range(steps)]
        assert raced == [int(s[row]) for s in sampled]


def test_vllm_noise_is_one_row_a_step_from_the_request_generator() -> None:
    vocab, seed = 300, 77
    g = torch.Generator().manual_seed(seed)
    expected = []
    for _ in range(4):
        q = torch.empty((2, vocab))
        q[1].exponential_(generator=g)  # vLLM draws a seeded request's row in place
        expected.append(q[1].clone())
    got = noise(Sampling(SamplingRecipe("vllm", 0.5), seed), 4, vocab, torch.device("cpu"))
    assert torch.equal(got, torch.stack(expected))


def test_the_evidence_at_its_edges() -> None:
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(4, 50, generator=gen) * 4
    q = torch.empty(4, 50).exponential_(generator=gen)
    recipe = SamplingRecipe("vllm", 0.7, top_k=5)
    s = warped(z, recipe)
    kept = ~torch.isneginf(s)
    assert (kept.sum(dim=-1) == 5).all()
    drawn = (torch.softmax(s, dim=-1) / q).argmax(dim=-1)
    e = draw_evidence(z, drawn, q, recipe)
    # The provider's own draw: deficit exactly 0, rank 0, and it is the reference's draw.
    assert torch.equal(e.drawn, drawn)
    assert (e.deficit == 0).all() and (e.rank == 0).all()
    # A token the top-k leaves out: at least the gap to the set's smallest logit, ranked last.
    outside = torch.stack([torch.nonzero(~k)[0, 0] for k in kept])
    e2 = draw_evidence(z, outside, q, recipe)
    gap = (
        z.masked_fill(~kept, float("inf")).min(dim=-1).values - z.gather(1, outside[:, None])[:, 0]
    )
    assert (e2.deficit >= gap.double() - 1e-9).all() and (e2.deficit > 0).all()
    assert (e2.rank == 5).all()
    # A kept token that lost the race: a positive deficit, T times the race gap.
    g = (s.double() - q.double().log()).masked_fill(~kept, float("-inf"))
    second = g.topk(2, dim=-1).indices[:, 1]
    e3 = draw_evidence(z, second, q, recipe)
    race = g.gather(1, drawn[:, None])[:, 0] - g.gather(1, second[:, None])[:, 0]
    assert torch.allclose(e3.deficit, 0.7 * race) and (e3.rank == 1).all()


def test_a_sampled_trace_logs_the_kind_of_its_generators_device() -> None:
    """`decoding.sampling` names the noise's device kind; a generator a verification cannot
    reproduce (not CPU, not CUDA) is refused rather than logged."""
    recipe = SamplingRecipe("transformers", 0.7)
    got = sampling_json(recipe, 3, torch.device("cpu"))
    assert got == {**recipe.to_json(), "seed": 3, "device": "cpu"}
    assert sampling_json(recipe, 3, torch.device("cuda", 1))["device"] == "cuda"
    with pytest.raises(EngineError, match="sampled on mps"):
        sampling_json(recipe, 3, torch.device("mps"))
