"""Logits processors (issue 21): a greedy generation that ran repetition penalty, no-repeat
n-grams, a logit bias, bad words or min new tokens replays exactly only when every probe of the
arm applies them as transformers' `generate()` did. On the bundled model, on the CPU, against
transformers' own `generate()` (not the project's trace generator)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from replay_audit.engine import EnginePool, FakeEngine, Intervention, ScanItem, Target
from replay_audit.engine.processors import build, vllm_bad_words_ids
from replay_audit.engine.protocol import Engine, LogitsProcessors
from replay_audit.exceptions import UnsupportedFormat

MAX_NEW = 32
N_PROMPTS = 12


@pytest.fixture(scope="module")
def hf(real_dir: Path) -> Iterator[tuple[Any, Any]]:
    """transformers' model and tokenizer of the bundled checkpoint, in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_dir)
    model = AutoModelForCausalLM.from_pretrained(
        real_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    yield model, tokenizer


@pytest.fixture(scope="module")
def prompts(hf: tuple[Any, Any], real_prompts: list[tuple[str, str]]) -> list[list[int]]:
    _, tokenizer = hf
    return [list(tokenizer(text)["input_ids"]) for _, text in real_prompts[:N_PROMPTS]]


@pytest.fixture(scope="module")
def engine(pool: EnginePool, real_dir: Path) -> Engine:
    return pool.get(real_dir, Target("fp32", attn_kernel="sdpa"))


@pytest.fixture(scope="module")
def eager(pool: EnginePool, real_dir: Path) -> Engine:
    return pool.get(real_dir, Target("fp32", attn_kernel="eager"))


def _eos(hf: tuple[Any, Any]) -> int:
    return int(hf[0].generation_config.eos_token_id)


def _generate(
    hf: tuple[Any, Any], ids: list[int], max_new: int = MAX_NEW, **settings: Any
) -> list[int]:
    """transformers' greedy generate() with `settings` (its own processors)."""
    model, _ = hf
    x = torch.tensor([ids])
    eos = _eos(hf)
    with torch.inference_mode():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=eos,
            **settings,
        )
    return [int(t) for t in out[0, len(ids) :]]


def _ngrams(seq: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)]


def _repeats_an_ngram(prompt: list[int], out: list[int], n: int) -> bool:
    """Whether some output token completes an n-gram seen before it (in prompt or output):
    what `no_repeat_ngram_size=n` rules out."""
    for t in range(len(out)):
        seq = [*prompt, *out[: t + 1]]
        if len(seq) >= n and tuple(seq[-n:]) in _ngrams(seq[:-1], n):
            return True
    return False


def test_a_penalised_generation_replays_exactly_in_every_probe_and_not_as_plain_greedy(
    hf: tuple[Any, Any], prompts: list[list[int]], engine: Engine, eager: Engine
) -> None:
    """generate(repetition_penalty=1.3, no_repeat_ngram_size=3): the decode, the scan, the
    batched scan and the single-step re-runs with the processors give generate()'s tokens;
    plain greedy does not on this prompt set."""
    spec = LogitsProcessors(repetition_penalty=1.3, no_repeat_ngram_size=3)
    eos = [_eos(hf)]
    logged = [_generate(hf, p, repetition_penalty=1.3, no_repeat_ngram_size=3) for p in prompts]
    plain_diverged = 0
    for p, out in zip(prompts, logged, strict=True):
        run = engine.decode(p, MAX_NEW, eos, None, 5, processors=spec)
        assert run.output_token_ids == out
        # What the processors promise holds: no output token repeats a 3-gram.
        assert not _repeats_an_ngram(p, out, 3)
        scan = engine.scan(p, out, None, 5, processors=spec)
        assert bool(scan.agrees.all())
        assert np.array_equal(scan.steps.token_ids, run.steps.token_ids)
        plain = engine.decode(p, MAX_NEW, eos, None, 5)
        plain_diverged += plain.output_token_ids != out
    # The processors matter here: plain greedy gives other tokens on most prompts.
    assert plain_diverged >= N_PROMPTS // 2, plain_diverged

    # A batched scan of traces with and without processors: each row as its own scan, bit for
    # bit (with eager attention, whose batched scan on this CPU is bs=1's exactly: see
    # test_engine_torch_scan_batch), the evidence of the logged tokens included.
    items = [
        ScanItem(p, out, spec if i % 2 == 0 else None)
        for i, (p, out) in enumerate(zip(prompts, logged, strict=True))
    ]
    batched = eager.scan_batch(items, None, 5)
    for item, got in zip(items, batched, strict=True):
        alone = eager.scan(item.prompt_ids, item.output_ids, None, 5, processors=item.processors)
        for f in ("token_ids", "top_k_ids", "top_k_logits", "margins", "gate_fired"):
            np.testing.assert_array_equal(getattr(got.steps, f), getattr(alone.steps, f), f)
        assert got.evidence is not None and alone.evidence is not None
        np.testing.assert_array_equal(got.evidence.logits, alone.evidence.logits)
        np.testing.assert_array_equal(got.evidence.ranks, alone.evidence.ranks)

    # Single-step re-runs: from scratch at each step, alone and batched, the logged token.
    p, out = prompts[0], logged[0]
    steps = [0, 5, len(out) // 2, len(out) - 1]
    none = Intervention()
    for t in steps:
        assert engine.step(p, out[:t], none, 5, processors=spec).token == out[t]
    contexts = [[*p, *out[:t]] for t in steps]
    infos = engine.step_batch(contexts, none, 5, processors=spec, prompt_lengths=[len(p)] * 4)
    assert [i.token for i in infos] == [out[t] for t in steps]
    with pytest.raises(ValueError, match="prompt length"):
        engine.step_batch(contexts, none, 5, processors=spec)


def test_logit_bias_bad_words_and_min_new_tokens_replay_exactly_and_matter(
    hf: tuple[Any, Any], prompts: list[list[int]], engine: Engine
) -> None:
    """Each of them, as generate() runs it (a logit bias as a one-token sequence_bias), replays
    generate()'s tokens exactly; each changes the tokens of some prompt."""
    eos = _eos(hf)
    n = MAX_NEW + 8
    plain = [engine.decode(p, n, [eos], None, 5).output_token_ids for p in prompts]
    # Chosen from plain greedy's own tokens, so that each processor has something to change.
    common = np.bincount(np.concatenate([np.asarray(o) for o in plain])).argsort()[::-1]
    favoured, banned = int(common[0]), int(common[1])
    pair = next(o[1:3] for o in plain if len(o) > 3)
    # This model never stops on eos within n tokens of plain greedy; with a repetition penalty
    # it does on some prompts, which min_new_tokens then holds back.
    penalty = LogitsProcessors(repetition_penalty=1.3)
    penalised = [engine.decode(p, n, [eos], None, 5, processors=penalty) for p in prompts]
    stops = [len(r.output_token_ids) for r in penalised if r.stop_reason == "eos"]
    assert stops, "no prompt stops on eos: min_new_tokens would change nothing"
    at_least = max(stops) + 2
    cases: list[tuple[dict[str, Any], LogitsProcessors, list[list[int]]]] = [
        (
            {"sequence_bias": [[[favoured], -4.0], [[7], 2.5]]},
            LogitsProcessors(logit_bias=((7, 2.5), (favoured, -4.0))),
            plain,
        ),
        (
            {"bad_words_ids": [[banned], list(pair)]},
            LogitsProcessors(bad_words_ids=((banned,), tuple(pair)), eos_token_ids=(eos,)),
            plain,
        ),
        (
            {"repetition_penalty": 1.3, "min_new_tokens": at_least},
            LogitsProcessors(repetition_penalty=1.3, min_new_tokens=at_least, eos_token_ids=(eos,)),
            [r.output_token_ids for r in penalised],
        ),
    ]
    for settings, spec, without in cases:
        changed = 0
        outs = []
        for p, base in zip(prompts, without, strict=True):
            out = _generate(hf, p, n, **settings)
            run = engine.decode(p, n, [eos], None, 5, processors=spec)
            assert run.output_token_ids == out, settings
            assert bool(engine.scan(p, out, None, 5, processors=spec).agrees.all())
            changed += out != base
            outs.append(out)
        assert changed >= 1, settings
        if spec.bad_words_ids:  # never a banned token, never the banned pair
            assert all(banned not in o for o in outs)
            assert all(tuple(pair) not in _ngrams(o, 2) for o in outs)
        if spec.min_new_tokens:  # no eos before min_new_tokens
            assert all(eos not in o[: spec.min_new_tokens] for o in outs)


def test_interventions_choose_among_the_processed_logits(
    prompts: list[list[int]], engine: Engine
) -> None:
    """A, B and C, ungated (τ = 0: every step), never choose a token the processors rule out:
    C recomputes the FP32 head and B its top-K rows, then both apply the same processors."""
    spec = LogitsProcessors(no_repeat_ngram_size=2, repetition_penalty=1.5)
    for kind in ("A", "B", "C"):
        iv = Intervention(kind, tau=0.0)  # type: ignore[arg-type]
        for p in prompts[:4]:
            run = engine.decode(p, MAX_NEW, (), iv, 5, processors=spec)
            assert bool(run.steps.gate_fired.all())
            assert not _repeats_an_ngram(p, run.output_token_ids, 2), kind
            # The single-step re-run of the arm's whole computation chooses what the decode did.
            t = len(run.output_token_ids) // 2
            out = run.output_token_ids
            assert engine.step(p, out[:t], iv, 5, processors=spec).token == out[t]


def test_vllm_bad_words_are_encoded_as_vllm_does_and_match_the_output_only(
    hf: tuple[Any, Any], engine: Engine
) -> None:
    """vLLM's `bad_words` texts: each encoded as it is and with a leading space (kept where it
    is another word of as many tokens), and matched against the output alone; transformers'
    `bad_words_ids` are matched against prompt ‖ output."""
    _, tokenizer = hf
    word = "return"
    plain_ids = tokenizer.encode(word, add_special_tokens=False)
    spaced_ids = tokenizer.encode(" " + word, add_special_tokens=False)
    got = vllm_bad_words_ids([word, "   "], tokenizer)
    assert got[0] == plain_ids
    keep_spaced = spaced_ids[0] != plain_ids[0] and len(spaced_ids) == len(plain_ids)
    assert (spaced_ids in got) is keep_spaced

    vocab = engine.vocab_size
    a, b = 11, 12  # a two-token bad word whose first token ends the prompt
    prompt = [5, 6, a]
    scores = torch.zeros((1, vocab))
    context = torch.tensor([prompt])
    hf_rule = build(LogitsProcessors(bad_words_ids=((a, b),)), len(prompt), tokenizer, vocab)
    assert hf_rule(context, scores)[0, b] == -torch.inf  # the prompt completes its prefix
    text = tokenizer.decode([a, b])
    vllm_rule = build(LogitsProcessors(bad_words=(text,)), len(prompt), tokenizer, vocab)
    # vLLM looks at the output only: at step 0 nothing of the word was generated yet.
    ids = vllm_bad_words_ids([text], tokenizer)
    assert all(len(w) > 1 for w in ids)
    assert bool(torch.isfinite(vllm_rule(context, scores)).all())

    # And a decode with a bad word never writes it.
    spec = LogitsProcessors(bad_words=(word,))
    out = engine.decode(tokenizer.encode("def f(x):\n    "), MAX_NEW, (), None, 5, processors=spec)
    for w in vllm_bad_words_ids([word], tokenizer):
        assert tuple(w) not in _ngrams(out.output_token_ids, len(w))


def test_processors_outside_the_vocabulary_and_the_fake_engine_refuse(engine: Engine) -> None:
    with pytest.raises(UnsupportedFormat, match="outside the vocabulary"):
        engine.decode([1, 2, 3], 4, (), processors=LogitsProcessors(logit_bias=((10**6, 1.0),)))
    fake = FakeEngine(Target("bf16"))
    spec = LogitsProcessors(repetition_penalty=1.2)
    with pytest.raises(UnsupportedFormat, match=r"repetition_penalty=1\.2"):
        fake.decode([1, 2], 4, processors=spec)
    with pytest.raises(UnsupportedFormat):
        fake.scan_batch([ScanItem([1, 2], [3], spec)])
    # Processors that change nothing (a penalty of 1) are no processors at all.
    assert not LogitsProcessors(repetition_penalty=1.0, no_repeat_ngram_size=0).active
    assert fake.decode([1, 2], 4, processors=LogitsProcessors(repetition_penalty=1.0))
