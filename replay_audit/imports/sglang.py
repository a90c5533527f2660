"""SGLang's native `/generate` responses with `return_logprob`. Pure.

Field names, checked against the sources (sgl-project/sglang):
- `python/sglang/srt/managers/tokenizer_manager.py` (`_handle_batch_output`): the answer is
  `{"text", "output_ids", "meta_info"}`, plus `"prompt_token_ids"` when the request set
  `return_prompt_token_ids`; `meta_info` has `id`, `finish_reason`, `prompt_tokens`,
  `completion_tokens`, `cached_tokens` and, with `return_logprob`, `input_token_logprobs`,
  `output_token_logprobs` (one `(logprob, token_id, text)` per token; text None unless
  `return_text_in_logprobs`) and, with `top_logprobs_num` > 0, `input_top_logprobs` and
  `output_top_logprobs` (per position a list of such tuples, or None).
- `python/sglang/srt/managers/schedule_batch.py`: `finish_reason` is `{"type": "stop",
  "matched": <token id or string>}`, `{"type": "length", "length": n}` or `{"type": "abort",
  ...}`.
- `python/sglang/srt/managers/io_struct.py` (`GenerateReqInput`): the request's `text` or
  `input_ids`, `sampling_params` (`temperature`, `top_k`, `max_new_tokens`), `return_logprob`,
  `logprob_start_len` (-1 by default: input logprobs of the last prompt token only),
  `top_logprobs_num`.

Without `return_prompt_token_ids` (or all input logprobs) the prompt is the request's `text`,
re-tokenised by `generation.resolve`.

What the logprobs are depends on the server (the sampler's all-greedy path returns
log_softmax of the logits; otherwise they are taken after temperature scaling unless the server
runs with `SGLANG_RETURN_ORIGINAL_LOGPROB`): the import context's `logprobs_mode` says it.
A request with a batch of prompts answers a list: every element is a generation. The server
batches dynamically, so the list's length is not the batch that ran: it is kept as
`config.extras["request_batch"]` and the batch size stays unknown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from replay_audit.diff.pieces import Piece, piece_of_text
from replay_audit.formats import StopReason
from replay_audit.imports import _json as j
from replay_audit.imports.generation import Generation
from replay_audit.imports.openai_compat import decoding_recipe, request_recipe
from replay_audit.imports.schemas import EXTRA_REQUEST_BATCH


def _tuple(value: Any, path: str) -> tuple[float | None, int]:
    parts = j.seq(value, path)
    if len(parts) < 2:
        raise j.fail(path, "expected a (logprob, token_id, text) tuple")
    logprob = None if parts[0] is None else j.number(parts[0], f"{path}[0]")
    return logprob, j.token_id(parts[1], f"{path}[1]")


def _finish(meta: Mapping[str, Any], path: str) -> tuple[StopReason | None, int | None]:
    reason = meta.get("finish_reason")
    if reason is None:
        return None, None
    reason = j.obj(reason, f"{path}.finish_reason")
    kind = reason.get("type")
    if kind == "length":
        return "length", None
    if kind != "stop":
        return "other", None
    matched = reason.get("matched")
    if isinstance(matched, str):
        return "stop_string", None
    if isinstance(matched, int) and not isinstance(matched, bool):
        return "eos", j.token_id(matched, f"{path}.finish_reason.matched")
    return "eos", None


def _prompt_ids(
    body: Mapping[str, Any],
    meta: Mapping[str, Any],
    request: Mapping[str, Any] | None,
    path: str,
) -> list[int] | None:
    """Logged prompt ids, the request's `input_ids`, complete input logprobs, or None (the
    module docstring says what then)."""
    if body.get("prompt_token_ids") is not None:
        return j.token_ids(body["prompt_token_ids"], f"{path}.prompt_token_ids")
    input_ids = request.get("input_ids") if request is not None else None
    if isinstance(input_ids, list) and input_ids and all(isinstance(x, int) for x in input_ids):
        return j.token_ids(input_ids, "request.input_ids")
    n_prompt = meta.get("prompt_tokens")
    logged = meta.get("input_token_logprobs")
    if isinstance(logged, list) and logged and len(logged) == n_prompt:
        lpath = f"{path}.meta_info.input_token_logprobs"
        return [_tuple(x, f"{lpath}[{i}]")[1] for i, x in enumerate(logged)]
    return None


def _one(
    body: Mapping[str, Any], request: Mapping[str, Any] | None, path: str, batch: int | None
) -> Generation:
    meta = j.obj(body.get("meta_info"), f"{path}.meta_info")
    mpath = f"{path}.meta_info"
    logged = meta.get("output_token_logprobs")
    logged_ids = None
    pieces: list[Piece] | None = None
    if logged is not None:
        lpath = f"{mpath}.output_token_logprobs"
        entries = j.seq(logged, lpath)
        logged_ids = [_tuple(x, f"{lpath}[{t}]")[1] for t, x in enumerate(entries)]
        # The third member is the token's text with `return_text_in_logprobs` (else None).
        texts = [x[2] if len(x) > 2 else None for x in entries]
        if texts and all(isinstance(t, str) for t in texts):
            pieces = [piece_of_text(str(t)) for t in texts]
    if body.get("output_ids") is not None:
        output = j.token_ids(body["output_ids"], f"{path}.output_ids")
        if logged_ids is not None and logged_ids != output:
            raise j.fail(
                f"{path}.output_ids", "disagrees with the ids of meta_info.output_token_logprobs"
            )
    elif logged_ids is not None:
        output = logged_ids
    else:
        raise j.fail(
            f"{path}.output_ids",
            "no output token ids (neither output_ids nor meta_info.output_token_logprobs)",
        )
    if not output:
        raise j.fail(f"{path}.output_ids", "the generation has no tokens")
    steps: list[list[tuple[int, float]]] | None = None
    tops = meta.get("output_top_logprobs")
    if tops is not None:
        tpath = f"{mpath}.output_top_logprobs"
        steps = []
        for t, row in enumerate(j.seq(tops, tpath)):
            if row is None:
                steps = None
                break
            entries = j.seq(row, f"{tpath}[{t}]")
            pairs = (_tuple(e, f"{tpath}[{t}][{i}]") for i, e in enumerate(entries))
            steps.append([(tid, logprob) for logprob, tid in pairs if logprob is not None])
    stop_reason, stop_id = _finish(meta, mpath)
    # SGLang adds a logit bias as given (no clamp to OpenAI's range in its native API).
    strategy, processors = decoding_recipe(request, clamp_logit_bias=False)
    recipe, stop_ids = request_recipe(request)
    params = request.get("sampling_params") if request is not None else None
    max_new = params.get("max_new_tokens") if isinstance(params, Mapping) else None
    text = body.get("text")
    prompt_text = request.get("text") if request is not None else None
    return Generation(
        field=path,
        prompt_token_ids=_prompt_ids(body, meta, request, path),
        output_token_ids=output,
        steps=steps,
        steps_field="meta_info.output_top_logprobs",
        stop_reason=stop_reason,
        stop_token_id=stop_id,
        prompt_text=prompt_text if isinstance(prompt_text, str) else None,
        output_text=text if isinstance(text, str) else None,
        external_id=j.opt_str(meta.get("id"), f"{mpath}.id"),
        engine_name="sglang",
        output_token_pieces=pieces if pieces is not None and len(pieces) == len(output) else None,
        strategy=strategy,
        processors=processors,
        extras={**recipe, **({EXTRA_REQUEST_BATCH: batch} if batch is not None else {})},
        stop_token_ids=stop_ids,
        max_new_tokens=max_new if isinstance(max_new, int) and max_new >= 1 else None,
    )


def parse_sglang(item: Any, path: str = "item") -> list[Generation]:
    """The generations of one `/generate` answer (a list answer: one per element), bare or as
    `{"request": ..., "response": ...}`. Raises FieldError naming the field."""
    request: Mapping[str, Any] | None = None
    answer, rpath = item, path
    if isinstance(item, Mapping) and "response" in item and set(item) <= {"request", "response"}:
        if item.get("request") is not None:
            request = j.obj(item["request"], f"{path}.request")
        answer, rpath = item["response"], f"{path}.response"
    if not isinstance(answer, list):
        return [_one(j.obj(answer, rpath), request, rpath, None)]
    bodies: Sequence[Any] = answer
    # A list answer is one request's prompts, but the server batches dynamically (with other
    # requests, as they arrive and finish): its length is kept, not stored as the batch size.
    return [
        _one(j.obj(b, f"{rpath}[{i}]"), _nth_request(request, i), f"{rpath}[{i}]", len(bodies))
        for i, b in enumerate(bodies)
    ]


def _nth_request(request: Mapping[str, Any] | None, i: int) -> Mapping[str, Any] | None:
    """The request of the i-th prompt of a batch request (its list fields taken at i)."""
    if request is None:
        return None
    out = dict(request)
    for key in ("text", "input_ids", "sampling_params"):
        value = request.get(key)
        if isinstance(value, list) and value and (key != "input_ids" or isinstance(value[0], list)):
            out[key] = value[i] if i < len(value) else None
    return out
