"""`decode_batch`: the rows of one logged batch decoded in one `generate()` of that batch, each at
its logged row, give bit for bit what each row's decode alone gives (its batch's other rows
filler), on the committed small model: the row's tokens, every step's top-k logits and margins,
where and why it stopped. Requests that cannot share a run (another batch, another prefix
length, the same row twice, no logged batch) decode alone, and the result says nothing else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from replay_audit.engine import DecodeRequest, DecodeRun, DecodeWindow, Intervention, Target
from replay_audit.engine.protocol import BatchLayout
from replay_audit.engine.torch_engine import TorchEngine

N = 12  # tokens per decode
EOS = 1  # the committed model's eos id
TEXTS = ["def main():\n    ", "import os\n", "class Foo:", "for i in range(10):\n"]

EngineOf = Callable[..., TorchEngine]


@pytest.fixture(scope="module")
def engine_of(real_dir: Path) -> EngineOf:
    made: dict[tuple[object, ...], TorchEngine] = {}

    def get(dtype: str, b: int, **kw: object) -> TorchEngine:
        key = (dtype, b, *sorted(kw.items()))
        if key not in made:
            made[key] = TorchEngine.load(
                real_dir,
                Target(dtype, batch_size=b, **kw),  # type: ignore[arg-type]
                device="cpu",
            )
        return made[key]

    return get


def _ids(engine: TorchEngine, text: str) -> list[int]:
    return [int(i) for i in engine.tokenizer(text)["input_ids"]]


def _alone(engine: TorchEngine, r: DecodeRequest, iv: Intervention | None = None) -> DecodeRun:
    return engine.decode(
        r.prompt_ids,
        r.max_new_tokens,
        r.eos_ids,
        iv,
        forced_prefix=r.forced_prefix,
        window=r.window,
        layout=r.layout,
    )


def _same(a: DecodeRun, b: DecodeRun) -> None:
    assert a.output_token_ids == b.output_token_ids
    assert (a.start_step, a.stop_reason) == (b.start_step, b.stop_reason)
    assert np.array_equal(a.steps.top_k_ids, b.steps.top_k_ids)
    assert np.array_equal(a.steps.top_k_logits, b.steps.top_k_logits)
    assert np.array_equal(a.steps.margins, b.steps.margins)
    assert np.array_equal(a.steps.gate_fired, b.steps.gate_fired)
    assert np.array_equal(a.steps.token_ids, b.steps.token_ids)


@pytest.mark.parametrize("iv", [Intervention(), Intervention("C", tau=0.05)])
def test_a_logged_batch_decoded_together_is_each_row_alone(
    engine_of: EngineOf, iv: Intervention
) -> None:
    engine = engine_of("bf16", 4)
    prompts = [_ids(engine, t) for t in TEXTS]
    lengths = tuple(len(p) for p in prompts)
    assert len(set(lengths)) > 1  # a padded batch: generate()'s path, with a mask
    rows = [
        DecodeRequest(p, N, [EOS], layout=BatchLayout(lengths, j)) for j, p in enumerate(prompts)
    ]
    alone = [_alone(engine, r, iv) for r in rows]
    # Windows that stop rows at different steps: the reference differs from row j's own
    # decode at step j, so row j stops at step j + 1 + 2; rows 2 and 3 also get forced
    # prefixes of one length (a second run of the batch).
    windowed = [
        DecodeRequest(
            p,
            N,
            [EOS],
            window=DecodeWindow(
                tuple(t if i != j else -1 for i, t in enumerate(a.output_token_ids)), 2
            ),
            layout=BatchLayout(lengths, j),
        )
        for j, (p, a) in enumerate(zip(prompts, alone, strict=True))
    ]
    forced = [
        DecodeRequest(
            prompts[j], N, [EOS], forced_prefix=alone[j].output_token_ids[:3], layout=rows[j].layout
        )
        for j in (2, 3)
    ]
    lone = DecodeRequest(prompts[0], N, [EOS])  # no logged batch: copies of the row
    twice = rows[1]  # row 1 again: a second run of the batch would hold it alone
    requests = [*rows, *windowed, *forced, lone, twice]
    runs = engine.decode_batch(requests, iv)
    for r, run in zip(requests, runs, strict=True):
        _same(run, _alone(engine, r, iv))
    assert [run.stop_reason for run in runs[4:8]] == ["window"] * 4
    assert [len(run.output_token_ids) for run in runs[4:8]] == [3, 4, 5, 6]
    # Three runs together (the four rows, the four windowed ones, the two forced), and each
    # run says how many rows it shared; the others ran alone.
    assert [run.rows for run in runs] == [4] * 8 + [2, 2, 1, 1]


def test_an_unpadded_logged_batch_together_is_the_piecewise_decode(engine_of: EngineOf) -> None:
    """Rows of one prompt length decode alone through the piecewise decoder (checked against
    generate() on the engine's first decode); together, through generate(): the same bits."""
    engine = engine_of("bf16", 3)
    prompts = [_ids(engine, t)[:4] for t in TEXTS[:3]]
    lengths = tuple(len(p) for p in prompts)
    assert len(set(lengths)) == 1
    requests = [
        DecodeRequest(p, N, [EOS], layout=BatchLayout(lengths, j)) for j, p in enumerate(prompts)
    ]
    alone = [_alone(engine, r) for r in requests]
    assert "piecewise" in str(engine.environment()["extras"]["decoder"])
    for a, b in zip(engine.decode_batch(requests), alone, strict=True):
        _same(a, b)
        assert (a.rows, b.rows) == (3, 1)


def test_requests_without_a_shared_batch_decode_alone(engine_of: EngineOf) -> None:
    engine = engine_of("bf16", 2)
    a, b = _ids(engine, "import os\n"), _ids(engine, "class Foo:")
    requests = [
        DecodeRequest(a, N, [EOS], layout=BatchLayout((len(a), len(b)), 0)),
        DecodeRequest(b, N, [EOS], layout=BatchLayout((len(b), len(a)), 0)),  # another batch
        DecodeRequest(b, 0, [EOS], layout=BatchLayout((len(a), len(b)), 1)),  # nothing to decode
    ]
    runs = engine.decode_batch(requests)
    for r, run in zip(requests, runs, strict=True):
        _same(run, _alone(engine, r))
    assert runs[2].output_token_ids == [] and runs[2].stop_reason == "length"
    assert [run.rows for run in runs] == [1, 1, 1]
