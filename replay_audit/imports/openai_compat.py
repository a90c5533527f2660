"""OpenAI-compatible chat and completions responses, as vLLM returns them. Pure.

Field names, checked against the sources (vllm-project/vllm):
- `vllm/entrypoints/openai/chat_completion/protocol.py`: `ChatCompletionResponse.prompt_token_ids`
  (top level), `ChatCompletionResponseChoice.token_ids`, `.logprobs.content[] = {token, logprob,
  bytes, top_logprobs: [{token, logprob, bytes}]}`, `.finish_reason`, `.stop_reason`
  (int: a stop token id; str: a stop string; null: eos), `prompt_text`.
- `vllm/entrypoints/openai/completion/protocol.py`: `CompletionResponseChoice.token_ids`,
  `.prompt_token_ids` (per choice), `.logprobs = {text_offset, token_logprobs, tokens,
  top_logprobs: [{token: logprob} | null]}`.
- `vllm/entrypoints/openai/chat_completion/serving.py` and `completion/serving.py`: logprobs are
  written as `max(logprob, -9999.0)`; with `return_tokens_as_token_ids` every token string is
  `format_token_id_placeholder(id)` = "token_id:{id}"; completions' `top_logprobs` maps token
  strings to logprobs, so two tokens that decode alike collide: ids are read from "token_id:"
  keys only; with `echo` the completions logprobs start with the prompt's.
- `vllm/config/model.py`: `LogprobsMode` = raw_logits | raw_logprobs | processed_logits |
  processed_logprobs (`--logprobs-mode`, default raw_logprobs): not in the response; the import
  context says it.

An item is a response object, or `{"request": ..., "response": ...}` with the request that
produced it (its sampling parameters say whether decoding was greedy; a response never does).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from replay_audit.diff.pieces import Piece, piece_of, piece_of_text
from replay_audit.formats import StopReason, Strategy
from replay_audit.imports import _json as j
from replay_audit.imports.generation import Generation


def split_item(item: Any, path: str) -> tuple[Mapping[str, Any] | None, Mapping[str, Any], str]:
    """(request or None, response, the response's path) of an item: a bare response or
    `{"request": ..., "response": ...}`."""
    body = j.obj(item, path)
    if "response" in body and set(body) <= {"request", "response"}:
        request = body.get("request")
        return (
            None if request is None else j.obj(request, f"{path}.request"),
            j.obj(body["response"], f"{path}.response"),
            f"{path}.response",
        )
    return None, body, path


def request_strategy(request: Mapping[str, Any] | None) -> Strategy | None:
    """Greedy when the request set temperature 0 or top_k 1 (vLLM's greedy sampling), beam for
    beam search, sample for any other temperature; None when the request is not known or left
    the temperature to the server's default."""
    if request is None:
        return None
    params = request.get("sampling_params") if "sampling_params" in request else request
    if not isinstance(params, Mapping):
        return None
    if request.get("use_beam_search") or params.get("use_beam_search"):
        return "beam"
    temperature, top_k = params.get("temperature"), params.get("top_k")
    if temperature == 0 or top_k == 1:
        return "greedy"
    if isinstance(temperature, int | float) and not isinstance(temperature, bool):
        return "sample"
    return None


def _max_tokens(request: Mapping[str, Any] | None) -> int | None:
    if request is None:
        return None
    for key in ("max_completion_tokens", "max_tokens"):
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def _stop(choice: Mapping[str, Any], path: str) -> tuple[StopReason | None, int | None]:
    finish = choice.get("finish_reason")
    if finish is None:
        return None, None
    if finish == "length":
        return "length", None
    if finish != "stop":
        return "other", None  # abort, tool_calls, content_filter, ...
    # vLLM's stop_reason (SGLang's OpenAI server calls it matched_stop): the stop token id or
    # string that ended the choice, null for eos. Neither key: stopped, but on what is unknown.
    for key in ("stop_reason", "matched_stop"):
        if key in choice:
            matched = choice[key]
            if matched is None:
                return "eos", None
            if isinstance(matched, str):
                return "stop_string", None
            return "eos", j.token_id(matched, f"{path}.{key}")
    return "other", None


def _ids_from_tokens(tokens: Sequence[Any]) -> list[int] | None:
    ids = [j.parse_token_id_string(t) for t in tokens]
    return None if any(i is None for i in ids) else [i for i in ids if i is not None]


def _output_ids(
    explicit: Any, from_tokens: list[int] | None, path: str, tokens_path: str
) -> list[int]:
    if explicit is not None:
        ids = j.token_ids(explicit, f"{path}.token_ids")
        if from_tokens is not None and from_tokens != ids:
            raise j.fail(
                f"{path}.token_ids",
                f'disagrees with the ids of {tokens_path} (the "token_id:" tokens)',
            )
        return ids
    if from_tokens is None:
        raise j.fail(
            f"{path}.token_ids",
            'no output token ids: ask the server for them (vLLM: "return_token_ids": true, '
            'or "return_tokens_as_token_ids": true with logprobs)',
        )
    return from_tokens


def _prompt_ids(value: Any, request: Mapping[str, Any] | None, field: str, path: str) -> list[int]:
    if value is not None:
        return j.token_ids(value, field)
    prompt = request.get("prompt") if request is not None else None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return j.token_ids(prompt, f"{path}.request.prompt")
    raise j.fail(
        field,
        'no prompt token ids: ask the server for them (vLLM: "return_token_ids": true) or '
        "send the request with the prompt as token ids",
    )


_BYTES_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")


def _piece(token: Any, raw_bytes: Any) -> Piece | None:
    """A token's piece from its entry: its `bytes` when they are byte values, else its token
    string (OpenAI's legacy "bytes:\\xe2\\x80" spelling read as those bytes); None for a
    "token_id:" string without bytes (no text) or anything else."""
    # An empty list is a piece too: a special token that decodes to nothing (eos).
    if isinstance(raw_bytes, list) and all(type(b) is int and 0 <= b <= 255 for b in raw_bytes):
        raw = bytes(raw_bytes)
        # With "token_id:" tokens vLLM's `bytes` are the token's own; bytes spelling the
        # placeholder itself say nothing.
        if isinstance(token, str) and raw == token.encode() and j.parse_token_id_string(token):
            return None
        return piece_of(raw)
    if not isinstance(token, str) or j.parse_token_id_string(token) is not None:
        return None
    escaped = token.removeprefix("bytes:")
    if escaped != token and escaped and not _BYTES_ESCAPE.sub("", escaped):
        return piece_of(bytes(int(h, 16) for h in _BYTES_ESCAPE.findall(escaped)))
    return piece_of_text(token)


def _pieces(pieces: Sequence[Piece | None]) -> list[Piece] | None:
    """The pieces, when every token has one (else none: a partial record is not stored)."""
    if not pieces or any(p is None for p in pieces):
        return None
    return [p for p in pieces if p is not None]


def _chat_steps(
    content: Sequence[Any], path: str
) -> tuple[list[int] | None, list[list[tuple[int, float]]] | None, list[Piece] | None]:
    """(ids of the logged tokens, per-step (id, logprob) pairs, the tokens' pieces) of
    `logprobs.content`; ids and pairs are None where the tokens are not "token_id:" strings,
    pieces where they are (or a token has neither a string nor bytes)."""
    tokens: list[Any] = []
    pieces: list[Piece | None] = []
    steps: list[list[tuple[int, float]]] | None = []
    for t, raw in enumerate(content):
        entry = j.obj(raw, f"{path}[{t}]")
        tokens.append(entry.get("token"))
        pieces.append(_piece(entry.get("token"), entry.get("bytes")))
        tops = entry.get("top_logprobs") or []
        row: list[tuple[int, float]] = []
        for i, top in enumerate(j.seq(tops, f"{path}[{t}].top_logprobs")):
            top = j.obj(top, f"{path}[{t}].top_logprobs[{i}]")
            tid = j.parse_token_id_string(top.get("token"))
            if tid is None:
                steps = None  # the alternatives' ids are unknown: no logged top-k
                break
            row.append((tid, j.number(top.get("logprob"), f"{path}[{t}].top_logprobs[{i}]")))
        if steps is not None:
            steps.append(row)
    return _ids_from_tokens(tokens), steps, _pieces(pieces)


def _completion_steps(
    logprobs: Mapping[str, Any],
    path: str,
    prompt: Sequence[int],
    n_output: int,
    echo: bool | None,
) -> tuple[list[int] | None, list[list[tuple[int, float]]] | None, bool]:
    """(ids of the tokens, per-step pairs, echoed) of a completions `logprobs`; the prompt's
    entries are dropped when the request echoed it (the request says so; without it, the
    entries start with the prompt's ids and the first has no logprobs, as only an echoed
    prompt's first token has none)."""
    tokens = list(j.seq(logprobs.get("tokens") or [], f"{path}.tokens"))
    tops = list(j.seq(logprobs.get("top_logprobs") or [], f"{path}.top_logprobs"))
    n_prompt = len(prompt)
    if echo is None:
        starts = _ids_from_tokens(tokens[:n_prompt]) == list(prompt) and len(tokens) > n_prompt
        echo = (n_output > 0 and len(tokens) == n_prompt + n_output) or (
            starts and bool(tops) and tops[0] is None
        )
    if echo:
        tokens, tops = tokens[n_prompt:], tops[n_prompt:]
    steps: list[list[tuple[int, float]]] | None = [] if tops else None
    offset = n_prompt if echo else 0
    for t, top in enumerate(tops):
        where = f"{path}.top_logprobs[{t + offset}]"
        if top is None or steps is None:
            steps = None
            break
        row = []
        for key, value in j.obj(top, where).items():
            tid = j.parse_token_id_string(key)
            if tid is None:
                # Keys are decoded strings: tokens that decode alike collide. Ids only.
                steps = None
                break
            row.append((tid, j.number(value, f"{where}.{key}")))
        if steps is not None:
            steps.append(row)
    return _ids_from_tokens(tokens) if tokens else None, steps, echo


def parse_openai(item: Any, path: str = "item") -> list[Generation]:
    """The generations of one OpenAI-compatible chat or completions response (one per choice).

    Raises FieldError naming the field when the response lacks what a trace needs (token ids)
    or is malformed."""
    request, response, rpath = split_item(item, path)
    choices = j.seq(response.get("choices"), f"{rpath}.choices")
    if not choices:
        raise j.fail(f"{rpath}.choices", "no choices")
    kind = response.get("object")
    chat = kind == "chat.completion" or (
        kind != "text_completion"
        and isinstance(j.obj(choices[0], f"{rpath}.choices[0]").get("message"), Mapping)
    )
    rid = j.opt_str(response.get("id"), f"{rpath}.id")
    model = j.opt_str(response.get("model"), f"{rpath}.model")
    strategy = request_strategy(request)
    max_tokens = _max_tokens(request)
    out = []
    for c, raw in enumerate(choices):
        cpath = f"{rpath}.choices[{c}]"
        choice = j.obj(raw, cpath)
        index = j.opt_int(choice.get("index"), f"{cpath}.index")
        stop_reason, stop_id = _stop(choice, cpath)
        logprobs = choice.get("logprobs")
        external_id = None
        if rid:
            external_id = rid if len(choices) == 1 else f"{rid}#{index if index is not None else c}"
        if chat:
            prompt = _prompt_ids(
                response.get("prompt_token_ids"), request, f"{rpath}.prompt_token_ids", path
            )
            content = None
            if logprobs is not None:
                content = j.obj(logprobs, f"{cpath}.logprobs").get("content")
            lpath = f"{cpath}.logprobs.content"
            ids_from_tokens, steps, pieces = (
                _chat_steps(j.seq(content, lpath), lpath)
                if content is not None
                else (None, None, None)
            )
            message = choice.get("message")
            text = message.get("content") if isinstance(message, Mapping) else None
            output = _output_ids(choice.get("token_ids"), ids_from_tokens, cpath, lpath)
            steps_field = "logprobs.content"
            prompt_text = j.opt_str(response.get("prompt_text"), f"{rpath}.prompt_text")
        else:
            prompt = _prompt_ids(
                choice.get("prompt_token_ids"), request, f"{cpath}.prompt_token_ids", path
            )
            explicit = choice.get("token_ids")
            n_output = len(explicit) if isinstance(explicit, list) else 0
            ids_from_tokens, steps, echoed = (None, None, False)
            pieces = None
            if logprobs is not None:
                echo = request.get("echo") if request is not None else None
                ids_from_tokens, steps, echoed = _completion_steps(
                    j.obj(logprobs, f"{cpath}.logprobs"),
                    f"{cpath}.logprobs",
                    prompt,
                    n_output,
                    echo if isinstance(echo, bool) else None,
                )
                tokens = list(j.seq(logprobs.get("tokens") or [], f"{cpath}.logprobs.tokens"))
                pieces = _pieces(
                    [_piece(t, None) for t in tokens[len(tokens) - n_output :]]
                    if explicit is not None and len(tokens) >= n_output
                    else []
                )
            output = _output_ids(explicit, ids_from_tokens, cpath, f"{cpath}.logprobs.tokens")
            text = None if echoed else choice.get("text")
            steps_field = "logprobs.top_logprobs"
            raw_prompt = request.get("prompt") if request is not None else None
            prompt_text = raw_prompt if isinstance(raw_prompt, str) else None
        if not output:
            raise j.fail(f"{cpath}.token_ids", "the choice generated no tokens")
        out.append(
            Generation(
                field=cpath,
                prompt_token_ids=prompt,
                output_token_ids=output,
                steps=steps,
                steps_field=steps_field,
                stop_reason=stop_reason,
                stop_token_id=stop_id,
                prompt_text=prompt_text,
                output_text=text if isinstance(text, str) else None,
                external_id=external_id,
                served_model=model,
                strategy=strategy,
                max_new_tokens=max_tokens,
                output_token_pieces=(
                    pieces if pieces is not None and len(pieces) == len(output) else None
                ),
            )
        )
    return out
