"""transformers `generate(..., return_dict_in_generate=True, output_logits=True)` output.

For users who log from their own transformers code: `traces_from_generate` (with an example).
`parse_hf` reads the same output saved with `torch.save(out)` (the CLI's `--format hf`, loaded
safely by `hf_context.load_generate_output`); without `input_ids` the prompt is what precedes one
`logits` row per new token, its left padding the leading `pad_token_id`s.

Names as in transformers' `GenerateDecoderOnlyOutput` (src/transformers/generation/utils.py):
`sequences` (batch, prompt + new tokens: the prompt is included for decoder-only models),
`logits` (one (batch, vocab) tensor per generated step: the model's raw logits, before any
logits processor) and `scores` (the same after the processors: temperature, penalties, top-k
masks). `logits` give the logged arm's margins; `scores` alone are processed values and give
none. Rows that finished early are padded after their eos: a row ends at its first eos id.

This module imports no torch: tensors are read through `.detach().cpu()` (floating ones through
`.float()`, exact for bf16 and fp16), and plain nested lists work the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from replay_audit.formats import StopReason
from replay_audit.imports import _json as j
from replay_audit.imports.generation import Generation, build_trace
from replay_audit.imports.schemas import ImportContext
from replay_audit.traces.schemas import TraceCreate

#: Values kept per step from a full-vocabulary row before the top-k is cut (the rest cannot be
#: among the top k; the tie rule of `generation.logged_top_k` orders them).
_CANDIDATES = 20


def _array(x: Any, path: str, *, floating: bool) -> npt.NDArray[Any]:
    if hasattr(x, "detach"):  # a torch tensor, read without importing torch
        t = x.detach().cpu()
        if floating and t.is_floating_point():
            t = t.float()
        x = t.numpy()
    try:
        arr = np.asarray(x, dtype=np.float64 if floating else None)
    except (TypeError, ValueError) as exc:
        raise j.fail(path, f"not a numeric array ({exc})") from None
    if not np.issubdtype(arr.dtype, np.number) or np.issubdtype(arr.dtype, np.complexfloating):
        raise j.fail(path, "expected a numeric array")
    if not floating and arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.equal(np.mod(arr, 1), 0)):
            raise j.fail(path, "expected token ids (integers)")
        arr = arr.astype(np.int64)
    if not floating and arr.size and (arr.min() < 0 or arr.max() >= 2**31):
        raise j.fail(path, "token ids must be in [0, 2**31)")
    return arr


def _field(output: Any, name: str) -> Any:
    return output.get(name) if isinstance(output, Mapping) else getattr(output, name, None)


def _top_pairs(row: npt.NDArray[np.float64], k: int) -> list[tuple[int, float]]:
    kk = min(k, row.shape[0])
    return [(int(i), float(row[i])) for i in np.argpartition(-row, kk - 1)[:kk]]


def generations_from_generate(
    output: Any,
    *,
    input_ids: Any = None,
    attention_mask: Any = None,
    eos_token_ids: Sequence[int] = (),
    prompt_texts: Sequence[str | None] | None = None,
    max_new_tokens: int | None = None,
    path: str = "output",
) -> list[Generation]:
    """One `Generation` per row of one `generate()` output. The prompts lose the left padding
    `attention_mask` shows; without `input_ids`, `output` carries `prompt_length` (a saved
    file does). Raises FieldError naming the field."""
    sequences = _array(_field(output, "sequences"), f"{path}.sequences", floating=False)
    if sequences.ndim != 2 or sequences.shape[0] == 0:
        raise j.fail(f"{path}.sequences", "expected a (batch, length) array of token ids")
    batch = sequences.shape[0]
    input_ids = _field(output, "input_ids") if input_ids is None else input_ids
    attention_mask = _field(output, "attention_mask") if attention_mask is None else attention_mask
    # The raw logits where they were kept, else the processed scores (no logged margin).
    values_field = "logits" if _field(output, "logits") is not None else "scores"
    logits = _field(output, values_field)
    if input_ids is not None:
        prompts = _array(input_ids, f"{path}.input_ids", floating=False)
        if prompts.ndim == 1:
            prompts = prompts[None, :]
        if prompts.shape[0] != batch:
            raise j.fail(f"{path}.input_ids", f"{prompts.shape[0]} rows for {batch} sequences")
        n_prompt = prompts.shape[1]
    else:
        n_prompt_value = _field(output, "prompt_length")
        if n_prompt_value is None and logits is not None:
            # One logits (or scores) row per new token: the rest of `sequences` is the prompt.
            n_prompt_value = sequences.shape[1] - len(logits)
        if not isinstance(n_prompt_value, int) or n_prompt_value < 1:
            raise j.fail(f"{path}.input_ids", "give the prompt ids (input_ids) or prompt_length")
        n_prompt = n_prompt_value
        prompts = sequences[:, :n_prompt]
        pad = _field(output, "pad_token_id")
        if attention_mask is None and isinstance(pad, int):
            # Left padding, where the call's mask was not saved: the leading pad ids.
            attention_mask = (np.cumsum(prompts != pad, axis=1) > 0).astype(np.int64)
    if sequences.shape[1] <= n_prompt:
        raise j.fail(f"{path}.sequences", f"no generated tokens after the {n_prompt} prompt ids")
    if np.any(sequences[:, :n_prompt] != prompts):
        raise j.fail(f"{path}.sequences", "do not start with the prompt ids (input_ids)")
    mask = None
    if attention_mask is not None:
        mask = _array(attention_mask, f"{path}.attention_mask", floating=False)
        if mask.ndim == 1:
            mask = mask[None, :]
        if mask.shape != prompts.shape:
            raise j.fail(f"{path}.attention_mask", "must have input_ids' shape")

    n_steps = sequences.shape[1] - n_prompt
    step_rows: list[npt.NDArray[np.float64]] | None = None
    if logits is not None:
        steps_seq = j.seq(list(logits), f"{path}.{values_field}")
        if len(steps_seq) != n_steps:
            raise j.fail(
                f"{path}.{values_field}", f"{len(steps_seq)} steps for {n_steps} new tokens"
            )
        step_rows = []
        for t, s in enumerate(steps_seq):
            arr = _array(s, f"{path}.{values_field}[{t}]", floating=True)
            if arr.ndim == 1:
                arr = arr[None, :]
            if arr.ndim != 2 or arr.shape[0] != batch:
                raise j.fail(f"{path}.{values_field}[{t}]", "expected a (batch, vocab) array")
            step_rows.append(arr)

    eos = set(int(e) for e in eos_token_ids)
    # The rows' prompt lengths before padding: where each row sat in the call's batch (left
    # padding only: a right-padded batch is not laid out as `decoding.batch` says).
    lengths = [int(n) for n in (mask != 0).sum(axis=1)] if mask is not None else [n_prompt] * batch
    left_padded = mask is None or bool(np.all(np.diff((mask != 0).astype(np.int8), axis=1) >= 0))
    out = []
    for b in range(batch):
        new = [int(x) for x in sequences[b, n_prompt:]]
        stop: StopReason | None = "length" if max_new_tokens == len(new) else None
        for t, token in enumerate(new):
            if token in eos:
                new, stop = new[: t + 1], "eos"
                break
        if not new:
            raise j.fail(f"{path}.sequences[{b}]", "no generated tokens")
        prompt = prompts[b] if mask is None else prompts[b][mask[b] != 0]
        steps = None
        if step_rows is not None:
            steps = [_top_pairs(step_rows[t][b], _CANDIDATES) for t in range(len(new))]
        out.append(
            Generation(
                field=f"{path}[{b}]",
                prompt_token_ids=[int(x) for x in prompt],
                output_token_ids=new,
                steps=steps,
                steps_field=values_field,
                stop_reason=stop,
                prompt_text=prompt_texts[b] if prompt_texts else None,
                logprobs_mode="raw_logits" if values_field == "logits" else "processed_logits",
                engine_name="transformers",
                max_new_tokens=max_new_tokens,
                batch_size=batch,  # the rows of one generate() call ran as one batch
                batch=(
                    {"prompt_lengths": lengths, "row": b} if batch > 1 and left_padded else None
                ),
            )
        )
    return out


def traces_from_generate(
    output: Any,
    *,
    context: ImportContext,
    input_ids: Any = None,
    attention_mask: Any = None,
    tokenizer: Any = None,
    prompt_texts: Sequence[str | None] | None = None,
    max_new_tokens: int | None = None,
) -> list[TraceCreate]:
    """The traces of one `generate()` call, one per row, with the raw logits' top-k.

        out = model.generate(**enc, max_new_tokens=64, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
        ctx = context_from_model(model, model_dir)  # imports.hf_context
        traces = traces_from_generate(out, context=ctx, input_ids=enc["input_ids"],
                                      attention_mask=enc["attention_mask"])

    `context.decoding.eos_token_ids` end the rows (context_from_model reads the model's).
    With `tokenizer`, the output texts are decoded for display. Raises FieldError."""
    eos = list(context.decoding.eos_token_ids or [])
    gens = generations_from_generate(
        output,
        input_ids=input_ids,
        attention_mask=attention_mask,
        eos_token_ids=eos,
        prompt_texts=prompt_texts,
        max_new_tokens=max_new_tokens or context.decoding.max_new_tokens,
    )
    if tokenizer is not None:
        gens = [
            replace(g, output_text=tokenizer.decode(g.output_token_ids, skip_special_tokens=True))
            for g in gens
        ]
    return [build_trace(g, context, "hf") for g in gens]


def parse_hf(item: Any, path: str = "item") -> list[Generation]:
    """A saved `generate()` output: `{"sequences", "logits" | "scores", "input_ids" |
    "prompt_length", "attention_mask"?, "eos_token_ids"?, "max_new_tokens"?, "prompt_texts"?}`
    (lists or tensors)."""
    body = j.obj(item, path)
    eos = body.get("eos_token_ids") or ()
    max_new = j.opt_int(body.get("max_new_tokens"), f"{path}.max_new_tokens")
    texts = body.get("prompt_texts")
    return generations_from_generate(
        body,
        eos_token_ids=j.token_ids(list(eos), f"{path}.eos_token_ids"),
        prompt_texts=list(texts) if isinstance(texts, list) else None,
        max_new_tokens=max_new,
        path=path,
    )
