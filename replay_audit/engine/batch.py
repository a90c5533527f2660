"""How a batched scan lays its traces out: length buckets, batches packed up to a token budget,
and each batch's right-padded rows. Pure (numpy, no torch), so its properties are tested alone.

A trace's scan forwards its context, prompt ‖ output[:-1] (n tokens). The trace goes to the
bucket of the smallest power of two ≥ n (at least `MIN_BUCKET`), and every batch of a bucket is
padded to the bucket's length, so the padded length a trace runs at depends on its own length
only, never on which traces share its batch: on kernels that are invariant to the number of
rows (the CPU's, for these shapes), a trace's batched scan is the same whatever else is scanned
with it. A batch holds as many rows as fit in `token_budget` tokens (rows x padded length).

A trace whose bucket alone exceeds the budget runs alone, unpadded. It is not cut into chunks:
a chunked forward attends over a cache of the earlier chunks, which changes the attention's
reduction order, so it would not give the one-forward scan's numbers.

Rows are right-padded. Position p of a row is position p of its trace, so the position ids
0..L-1 are right for every row, and every padded position comes after all of its row's real
ones: under the causal mask a real position attends only to itself and earlier positions, so it
never reads padding. No padding mask is passed: it would change nothing a real position computes
(bit for bit, measured on CPU), and on CUDA an explicit mask takes sdpa off its flash kernel.
Only the hidden states of real output positions (`PackedBatch.output_positions`) go on to the
lm_head: a padded position's logits are never computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from replay_audit.engine.protocol import ExtraValue, ScanItem

#: The shortest bucket: shorter traces are padded up to it (a few padded tokens per row cost
#: less than many buckets of tiny batches).
MIN_BUCKET: Final = 16


def context_length(item: ScanItem) -> int:
    """Tokens a scan of `item` forwards: prompt ‖ output[:-1]."""
    return len(item.prompt_ids) + len(item.output_ids) - 1


def bucket_length(n: int, shortest: int = MIN_BUCKET) -> int:
    """The padded length of a trace whose context is `n` tokens: the smallest power of two
    ≥ n, at least `shortest`."""
    if n < 1:
        raise ValueError("a scanned context has at least one token")
    length = shortest
    while length < n:
        length *= 2
    return length


@dataclass(frozen=True)
class ScanBatch:
    """One forward of a batched scan: `indices` (ascending) name its rows, one trace each, by
    their position in the list that was planned; all rows are padded to `padded_length`."""

    indices: tuple[int, ...]
    padded_length: int

    @property
    def rows(self) -> int:
        return len(self.indices)

    @property
    def tokens(self) -> int:
        """Tokens the forward runs over, padding included."""
        return self.rows * self.padded_length

    @property
    def shape(self) -> str:
        """The shape, "rows x padded length", as `scan_extras` records it."""
        return f"{self.rows}x{self.padded_length}"


def plan_scan_batches(lengths: Sequence[int], token_budget: int) -> list[ScanBatch]:
    """The batches that scan traces of context `lengths`, each within `token_budget` tokens
    (padding included) but for a trace too long for its bucket alone (module docstring)."""
    if token_budget < 1:
        raise ValueError("the scan's token budget must be at least 1")
    buckets: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        buckets.setdefault(bucket_length(n), []).append(i)
    batches: list[ScanBatch] = []
    for length in sorted(buckets):
        members = buckets[length]
        if length > token_budget:
            batches.extend(ScanBatch((i,), lengths[i]) for i in members)
            continue
        rows = token_budget // length
        batches.extend(
            ScanBatch(tuple(members[j : j + rows]), length) for j in range(0, len(members), rows)
        )
    return batches


def plan_scan(items: Sequence[ScanItem], token_budget: int) -> list[ScanBatch]:
    """`plan_scan_batches` of the items that need a forward (an empty output needs none), with
    `indices` into `items`."""
    if any(it.output_ids and not it.prompt_ids for it in items):
        raise ValueError("a scan needs at least one prompt token before the output")
    todo = [i for i, it in enumerate(items) if it.output_ids]
    batches = plan_scan_batches([context_length(items[i]) for i in todo], token_budget)
    return [ScanBatch(tuple(todo[j] for j in b.indices), b.padded_length) for b in batches]


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """A batch's rows as arrays for one forward.

    input_ids         (rows, L) the contexts, right-padded with the pad id
    lengths           (rows,) each row's context length: positions >= it are padding
    output_positions  (steps,) flat positions row * L + p of the hidden states that predict the
                      rows' output tokens, row by row: output step t of a row with a prompt of
                      P tokens is at p = P - 1 + t (never a padded position)
    row_steps         (rows + 1,) row r's steps are output_positions[row_steps[r]:row_steps[r+1]]
    """

    input_ids: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    output_positions: npt.NDArray[np.int64]
    row_steps: npt.NDArray[np.int64]

    @property
    def padded(self) -> bool:
        """Whether any row has padding."""
        return bool((self.lengths < self.input_ids.shape[1]).any())


def pack_batch(items: Sequence[ScanItem], padded_length: int, pad_id: int) -> PackedBatch:
    """The rows of one batch: each item's context right-padded to `padded_length` with
    `pad_id`, and where its output steps' hidden states are."""
    rows = len(items)
    input_ids = np.full((rows, padded_length), pad_id, dtype=np.int64)
    lengths = np.zeros(rows, dtype=np.int64)
    positions: list[npt.NDArray[np.int64]] = []
    row_steps = np.zeros(rows + 1, dtype=np.int64)
    for r, item in enumerate(items):
        n_prompt, n_out = len(item.prompt_ids), len(item.output_ids)
        if n_prompt == 0 or n_out == 0:
            raise ValueError("a batched row needs at least one prompt and one output token")
        n = context_length(item)
        if n > padded_length:
            raise ValueError(f"a context of {n} tokens does not fit a row of {padded_length}")
        input_ids[r, :n_prompt] = item.prompt_ids
        input_ids[r, n_prompt:n] = item.output_ids[:-1]
        lengths[r] = n
        positions.append(r * padded_length + n_prompt - 1 + np.arange(n_out, dtype=np.int64))
        row_steps[r + 1] = row_steps[r] + n_out
    output_positions = np.concatenate(positions) if positions else np.zeros(0, np.int64)
    return PackedBatch(input_ids, lengths, output_positions, row_steps)


def scan_extras(batches: Sequence[ScanBatch], token_budget: int) -> dict[str, ExtraValue]:
    """What a batched scan records in the engine's `environment()["extras"]`: the budget, the
    distinct batch shapes ("rows x padded length", by length then rows) and the padding rule.
    The shape is part of the numerical configuration: kernels may sum in another order at
    another shape."""
    shapes = sorted({(b.padded_length, b.rows): b.shape for b in batches}.items())
    return {
        "scan_token_budget": token_budget,
        "scan_batch_shapes": ",".join(shape for _, shape in shapes),
        "scan_padding": f"right, power-of-two buckets from {MIN_BUCKET}",
    }


def plan_steps(lengths: Sequence[int], token_budget: int) -> list[ScanBatch]:
    """The batches of single-step re-runs over contexts of `lengths` tokens: one length per
    forward, unpadded, as many as fit in `token_budget` tokens (at least one). Not the scan's
    buckets: a re-run is looked at where the margin is a near-tie, and right padding changes
    the CPU sdpa kernel's reduction order (tests/engine/test_engine_torch_scan_batch.py), so
    it could flip the very token asked for."""
    if token_budget < 1:
        raise ValueError("the token budget must be at least 1")
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError("a single step needs at least one context token")
        by_length.setdefault(n, []).append(i)
    batches: list[ScanBatch] = []
    for length in sorted(by_length):
        members = by_length[length]
        rows = max(1, token_budget // length)
        batches.extend(
            ScanBatch(tuple(members[j : j + rows]), length) for j in range(0, len(members), rows)
        )
    return batches


def step_extras(batches: Sequence[ScanBatch], token_budget: int) -> dict[str, ExtraValue]:
    """`scan_extras` of batched single-step re-runs: a result says its re-runs were batched."""
    shapes = sorted({(b.padded_length, b.rows): b.shape for b in batches}.items())
    return {
        "step_token_budget": token_budget,
        "step_batch_shapes": ",".join(shape for _, shape in shapes),
        "step_padding": "none: one context length per forward",
    }


#: A decode's logged batch (`decode_batch`): the layout's prompt lengths, the tokens past the
#: logged prompt (a forced prefix), and the row the trace sat at.
RowKey = tuple[tuple[int, ...], int, int]


@dataclass(frozen=True)
class RowPlan:
    """Which decodes of a `decode_batch` run together: each of `together` is one run of a logged
    batch with two or more of its rows decoded (distinct rows, the same batch and prefix
    length); `alone` decode one by one."""

    together: list[list[int]]
    alone: list[int]


def plan_rows(keys: Sequence[RowKey | None]) -> RowPlan:
    """The decodes of one logged batch together, at most one per row a run (a second request
    for a row goes to the next run); a run that would hold one row, and a key of None, decode
    alone. Runs keep the requests' order within each batch."""
    groups: dict[tuple[tuple[int, ...], int], list[tuple[int, int]]] = {}
    alone: list[int] = []
    for i, key in enumerate(keys):
        if key is None:
            alone.append(i)
        else:
            groups.setdefault((key[0], key[1]), []).append((i, key[2]))
    together: list[list[int]] = []
    for members in groups.values():
        while members:
            run: dict[int, int] = {}  # row -> request
            rest: list[tuple[int, int]] = []
            for i, row in members:
                if row in run:
                    rest.append((i, row))
                else:
                    run[row] = i
            if len(run) > 1:
                together.append(list(run.values()))
            else:
                alone.extend(run.values())
            members = rest
    return RowPlan(together, sorted(alone))
