"""A seeded sampler's draws, reproduced: the evidence of a sampled trace (after Token-DiFR,
Karvonen et al. 2025).

Both samplers a trace can name draw a token as one exponential race over the processed
probabilities: `argmax(p / q)` with q ~ Exp(1) from a seeded generator.
`torch.multinomial(p, 1)`, which transformers' `generate(do_sample=True)` calls, computes
exactly that (`aten/src/ATen/native/Distributions.cpp`, the one-sample path: `q =
empty_like(p).exponential_(1, gen)`, `argmax(p / q)`), and so does vLLM's `random_sample`
(`vllm/v1/sample/ops/topk_topp_sampler.py`: `q[i].exponential_(generator=generator)` per
seeded request, `probs.div_(q).argmax(dim=-1)`). Given the seed, the reference draws the same
noise, so the provider's token and the reference's own draw differ only where their
probabilities do. The noise:

    transformers  `torch.manual_seed(seed)`, then one (rows, V) float32 draw a step from the
                  default generator of the device `generate()` ran on; this trace is row `row`
    vllm          `torch.Generator(device).manual_seed(seed)`, one (V,) float32 draw a step

The evidence of a logged token y at a step (`draw_evidence`), in logit units: how far the
reference's logits would have to move for y to win the race. With warped scores s = z / T
(-inf outside the top-k / top-p set) and g = s - log q, the reference draws j* = argmax g; the
deficit is T (g_j* - g_y), and where the reference's top-k / top-p set leaves y out, at least
the gap from the set's smallest logit to y's. It is 0 where y is the reference's own draw, a
few ulps where a benign difference in the logits moved a near-tie of the race, and large where
another computation (other weights, another temperature) drew the token. With T -> 0 it is
the greedy deficit (`diff.deficit`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from replay_audit.engine.protocol import Sampling, SamplingRecipe
from replay_audit.exceptions import UnsupportedFormat


def noise(sampling: Sampling, steps: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The (steps, vocab) float32 noise q of a trace's first `steps` draws, on `device`: drawn
    where the sampler drew it (its generator's device kind), as it drew it."""
    if sampling.device == "cuda" and not torch.cuda.is_available():
        raise UnsupportedFormat(
            "the sampler's noise came from a CUDA generator: it is reproduced on a CUDA device "
            "only, and this worker has none"
        )
    where = torch.device(sampling.device)
    generator = torch.Generator(device=where)
    generator.manual_seed(sampling.seed)
    per_step = (sampling.rows, vocab) if sampling.recipe.sampler == "transformers" else (1, vocab)
    row = sampling.row if sampling.recipe.sampler == "transformers" else 0
    out = torch.empty((steps, vocab), dtype=torch.float32, device=where)
    for t in range(steps):
        q = torch.empty(per_step, dtype=torch.float32, device=where)
        if sampling.recipe.sampler == "vllm":
            q[0].exponential_(generator=generator)
        else:
            q.exponential_(generator=generator)
        out[t] = q[row]
    return out.to(device)


def warped(z: torch.Tensor, recipe: SamplingRecipe) -> torch.Tensor:
    """The sampler's scores (M, V) of float32 processed logits z (M, V): divided by the
    temperature, -inf outside the top-k / top-p set, as the sampler computes them."""
    if recipe.sampler == "transformers":
        return _transformers_warped(z, recipe)
    return _vllm_warped(z, recipe)


def _transformers_warped(z: torch.Tensor, recipe: SamplingRecipe) -> torch.Tensor:
    # generate()'s warpers, in its order (`GenerationMixin._get_logits_processor`); they read
    # the scores only.
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers: list[Any] = []
    if recipe.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(recipe.temperature))
    if recipe.top_k:
        warpers.append(TopKLogitsWarper(recipe.top_k))
    if recipe.top_p < 1.0:
        warpers.append(TopPLogitsWarper(recipe.top_p))
    s = z.clone()
    for w in warpers:
        s = w(None, s)
    return s


def _vllm_warped(z: torch.Tensor, recipe: SamplingRecipe) -> torch.Tensor:
    # vLLM's temperature (`logits.div_(temp)`) then `apply_top_k_top_p_pytorch`: sort ascending,
    # mask below the k-th largest, then the tokens whose ascending cumulative probability is
    # <= 1 - p (the largest always kept), scattered back.
    s = z / recipe.temperature
    if not recipe.top_k and recipe.top_p >= 1.0:
        return s
    s_sort, idx = s.sort(dim=-1, descending=False)
    if recipe.top_k:
        k = min(recipe.top_k, s.shape[-1])
        kth = s_sort[:, s.shape[-1] - k : s.shape[-1] - k + 1]
        s_sort = s_sort.masked_fill(s_sort < kth, -float("inf"))
    if recipe.top_p < 1.0:
        cum = s_sort.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - recipe.top_p
        drop[:, -1] = False
        s_sort = s_sort.masked_fill(drop, -float("inf"))
    return torch.empty_like(s).scatter_(-1, idx, s_sort)


class DrawEvidence(NamedTuple):
    """Per step (M,): the logged token's deficit against the reference's draw, in logit units
    (float64), the reference's draw, its logit (float32: the ulps' scale) and the logged
    token's rank in the race among the tokens the reference's set keeps (0: its own draw)."""

    deficit: torch.Tensor
    drawn: torch.Tensor
    drawn_logit: torch.Tensor
    rank: torch.Tensor


def draw_evidence(
    z: torch.Tensor, logged: torch.Tensor, q: torch.Tensor, recipe: SamplingRecipe
) -> DrawEvidence:
    """The module docstring's evidence of logged tokens (M,) from float32 processed logits
    z (M, V) and the noise q (M, V) of those steps, all on one device."""
    s = warped(z, recipe)
    kept = ~torch.isneginf(s)
    g = s.double() - q.double().log()
    g = g.masked_fill(~kept, -float("inf"))
    drawn = g.argmax(dim=-1)
    ids = logged.reshape(-1, 1)
    best = g.gather(-1, drawn.reshape(-1, 1))[:, 0]
    # y's race score: the race's own where the set keeps y (0 exactly for the drawn token),
    # else from y's logit as the warper would have scaled it: how far it is from winning.
    z64 = z.double()
    zy = z64.gather(-1, ids)[:, 0]
    outside = ~kept.gather(-1, ids)[:, 0]
    unscaled = zy / recipe.temperature - q.double().gather(-1, ids)[:, 0].log()
    gy = torch.where(outside, unscaled, g.gather(-1, ids)[:, 0])
    deficit = recipe.temperature * (best - gy)
    # Left out by the reference's top-k / top-p set: at least the gap to the set's smallest.
    smallest = z64.masked_fill(~kept, float("inf")).min(dim=-1).values
    deficit = torch.where(outside, torch.maximum(deficit, smallest - zy), deficit)
    deficit = deficit.clamp(min=0.0)
    vocab = torch.arange(z.shape[-1], device=z.device)
    g_y = g.gather(-1, ids)
    before = (g > g_y) | ((g == g_y) & (vocab < ids))
    rank = torch.where(outside, kept.sum(dim=-1), (before & kept).sum(dim=-1))
    drawn_logit = z.gather(-1, drawn.reshape(-1, 1))[:, 0]
    return DrawEvidence(deficit, drawn, drawn_logit, rank)
