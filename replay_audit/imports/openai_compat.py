"""OpenAI-compatible chat and completions responses (vLLM, SGLang, the OpenAI API), and vLLM's
offline `RequestOutput` dumped as JSON. Pure.

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
  strings to logprobs, so two tokens that decode alike collide; with `echo` the completions
  logprobs start with the prompt's.
- `vllm/config/model.py`: `LogprobsMode` (`imports.schemas.LogprobsMode`): not in the response.
- `vllm/outputs.py`: `RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs,
  outputs, finished, ...)`, `CompletionOutput(index, text, token_ids, cumulative_logprob,
  logprobs, finish_reason, stop_reason, ...)`; `vllm/logprobs.py`: `Logprob(logprob, rank,
  decoded_token)`, one `{token id: Logprob}` per step.
- sgl-project/sglang `python/sglang/srt/entrypoints/openai/protocol.py`:
  `ChatCompletionResponseChoice.prompt_token_ids`, `.token_ids`, `.matched_stop` per choice.
- openai/openai-python `src/openai/types/chat/chat_completion.py`, `..._token_logprob.py`: the
  OpenAI API's layout (no ids; `bytes` beside each token).

Ids a response does not carry (no `return_token_ids`; the OpenAI API) and top-k keyed by text
are left to `generation.resolve`: the output's pieces, the prompt's text or messages are kept.

An item is a response object, or `{"request": ..., "response": ...}` with the request that
produced it (its sampling parameters say whether decoding was greedy; a response never does).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from replay_audit.diff.pieces import Piece, piece_of, piece_of_text
from replay_audit.formats import SamplingJson, StopReason, Strategy
from replay_audit.imports import _json as j
from replay_audit.imports.generation import Generation
from replay_audit.imports.processors import RequestProcessors, read_processors
from replay_audit.traces.schemas import ExtraValue


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


#: Below this temperature (`_SAMPLING_EPS` in vLLM's `vllm/sampling_params.py` and SGLang's
#: `sampling/sampling_params.py`, read by each `SamplingParams`) both decode greedily.
SAMPLING_EPS: Final = 1e-5


#: A request's sampling fields (OpenAI's, vLLM's `SamplingParams`, SGLang's `sampling_params`),
#: kept in `config.extras` under their own names whether or not a replay uses them (issue 33:
#: they were dropped without a word); a list or mapping as its compact JSON.
RECIPE_FIELDS: Final = (
    "temperature", "top_p", "top_k", "min_p", "seed", "sampling_seed", "stop",
    "stop_token_ids", "ignore_eos", "min_tokens", "n", "best_of",
)  # fmt: skip


def request_recipe(request: Mapping[str, Any] | None) -> tuple[dict[str, ExtraValue], list[int]]:
    """The request's `RECIPE_FIELDS` as extras, and its `stop_token_ids` (the server stopped
    on them as on an eos: the replay does too)."""
    params = request.get("sampling_params", request) if request is not None else None
    if not isinstance(params, Mapping):
        return {}, []
    kept = {k: extra_value(params[k]) for k in RECIPE_FIELDS if params.get(k) is not None}
    ids = params.get("stop_token_ids")
    stops = [t for t in ids if type(t) is int and t >= 0] if isinstance(ids, list) else []
    return kept, stops


def extra_value(value: object) -> ExtraValue:
    """`value` as `config.extras` keeps it (a list or mapping as its compact JSON)."""
    if isinstance(value, str | bool) or (type(value) is int and abs(value) < 2**63):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    return json.dumps(value, separators=(",", ":"), default=str)


def decoding_recipe(
    request: Mapping[str, Any] | None, *, clamp_logit_bias: bool = True
) -> tuple[Strategy | None, RequestProcessors]:
    """(strategy, logits processors) of a request, as the engine reads it. Greedy is the
    engine's rule (`SAMPLING_EPS`, or top_k 1), but `other` with a processor a replay cannot
    apply (`imports.processors`); None when the request is not known or left the temperature
    to the server's default. `clamp_logit_bias`: the server clamps a logit bias to [-100, 100]
    (vLLM, OpenAI)."""
    if request is None:
        return None, RequestProcessors()
    params = request.get("sampling_params") if "sampling_params" in request else request
    if not isinstance(params, Mapping):
        return None, RequestProcessors()
    processors = read_processors(params, clamp_logit_bias=clamp_logit_bias)
    if request.get("use_beam_search") or params.get("use_beam_search"):
        return "beam", processors
    temperature, top_k = params.get("temperature"), params.get("top_k")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        temperature = None
    if top_k == 1 or (temperature is not None and temperature < SAMPLING_EPS):
        return ("other" if processors.not_replayed else "greedy"), processors
    return ("sample" if temperature is not None else None), processors


def vllm_sampling(request: Mapping[str, Any] | None, index: int) -> SamplingJson | None:
    """The seeded sampler of choice `index` of a vLLM request that sampled with its own `seed`
    (`decoding.sampling`, without the device: the import context says where it ran), or None
    where a verification could not reproduce it: no seed, or a `min_p` (applied between the
    temperature and top-k, not reproduced here). vLLM gives each of `n` choices the seed
    `seed + index` (`vllm/v1/engine/parallel_sampling.py`); a top_k of 0 or -1 and a top_p of
    1 are off; what the request leaves out is vLLM's default (off), as a server without a
    generation config's sampling defaults applies it."""
    params = request.get("sampling_params", request) if request is not None else None
    if not isinstance(params, Mapping):
        return None
    seed, temperature = params.get("seed"), params.get("temperature")
    if type(seed) is not int or not 0 <= seed < 2**63 - 1024:
        return None
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        return None
    min_p = params.get("min_p")
    if min_p not in (None, 0, 0.0):
        return None
    top_k, top_p = params.get("top_k"), params.get("top_p")
    top_k = top_k if type(top_k) is int and top_k > 0 else 0
    top_p = float(top_p) if isinstance(top_p, int | float) and not isinstance(top_p, bool) else 1.0
    if not (0.0 < top_p <= 1.0 and SAMPLING_EPS <= temperature <= 100.0):
        return None
    return SamplingJson(
        sampler="vllm", seed=seed + index, temperature=float(temperature), top_k=top_k, top_p=top_p
    )


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


def _output_ids(explicit: Any, from_tokens: list[int] | None, path: str, tokens_path: str) -> Any:
    """Explicit `token_ids`, else the "token_id:" tokens' ids, else None (`generation.resolve`)."""
    if explicit is None:
        return from_tokens
    ids = j.token_ids(explicit, f"{path}.token_ids")
    if from_tokens is not None and from_tokens != ids:
        raise j.fail(
            f"{path}.token_ids", f'disagrees with the ids of {tokens_path} (the "token_id:" tokens)'
        )
    return ids


def _prompt_ids(value: Any, request: Mapping[str, Any] | None, field: str, path: str) -> Any:
    """Logged prompt ids, or the request's id prompt, or None (re-tokenised from the text)."""
    if value is not None:
        return j.token_ids(value, field)
    prompt = request.get("prompt") if request is not None else None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return j.token_ids(prompt, f"{path}.request.prompt")
    return None


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


Steps = list[list[tuple[int, float]]]
TextSteps = list[list[tuple[Piece, float]]]


def _row(
    entries: Sequence[tuple[Any, Any, Any]], where: str
) -> tuple[list[tuple[int, float]] | None, list[tuple[Piece, float]] | None]:
    """One step's (id, value) pairs when every token is a "token_id:" string, else its (piece,
    value) pairs (for `generation.resolve`); (None, None) when a token is neither."""
    ids, texts = [], []
    for n, (key, raw_bytes, value) in enumerate(entries):
        number = j.number(value, f"{where}[{n}]")
        tid, piece = j.parse_token_id_string(key), _piece(key, raw_bytes)
        if tid is not None:
            ids.append((tid, number))
        if piece is not None:
            texts.append((piece, number))
    if len(ids) == len(entries):
        return ids, None
    return None, (texts if len(texts) == len(entries) else None)


def _chat_steps(
    content: Sequence[Any], path: str
) -> tuple[list[int] | None, Steps | None, TextSteps | None, list[Piece] | None]:
    """(ids of the "token_id:" tokens, per-step pairs by id, by text, the tokens' pieces) of
    `logprobs.content`."""
    tokens: list[Any] = []
    pieces: list[Piece | None] = []
    steps: Steps | None = []
    texts: TextSteps | None = []
    for t, raw in enumerate(content):
        entry = j.obj(raw, f"{path}[{t}]")
        tokens.append(entry.get("token"))
        pieces.append(_piece(entry.get("token"), entry.get("bytes")))
        where = f"{path}[{t}].top_logprobs"
        tops = [
            j.obj(x, f"{where}[{i}]")
            for i, x in enumerate(j.seq(entry.get("top_logprobs") or [], where))
        ]
        ids, text = _row([(x.get("token"), x.get("bytes"), x.get("logprob")) for x in tops], where)
        steps = None if steps is None or ids is None else [*steps, ids]
        texts = None if texts is None or text is None else [*texts, text]
    return _ids_from_tokens(tokens), steps, (None if steps is not None else texts), _pieces(pieces)


def _completion_steps(
    logprobs: Mapping[str, Any],
    path: str,
    prompt: Sequence[int],
    n_output: int,
    echo: bool | None,
) -> tuple[list[int] | None, Steps | None, TextSteps | None, bool]:
    """(ids of the tokens, per-step pairs by id, by text, echoed) of a completions `logprobs`,
    without an echoed prompt's entries. Without the request's `echo`, an echo is read from the
    entries: they start with the prompt's ids and the first has no logprobs."""
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
    steps: Steps | None = [] if tops else None
    texts: TextSteps | None = [] if tops else None
    offset = n_prompt if echo else 0
    for t, top in enumerate(tops):
        where = f"{path}.top_logprobs[{t + offset}]"
        # Keys are token strings: tokens that decode alike collide in one key, so text keys
        # are kept only where each is exactly one token (`generation.resolve`).
        ids, text = (
            (None, None)
            if top is None
            else _row([(k, None, v) for k, v in j.obj(top, where).items()], where)
        )
        steps = None if steps is None or ids is None else [*steps, ids]
        texts = None if texts is None or text is None else [*texts, text]
    return (
        _ids_from_tokens(tokens) if tokens else None,
        steps,
        None if steps is not None else texts,
        echo,
    )


def _engine(response: Mapping[str, Any], choices: Sequence[Any]) -> str | None:
    """The server a response shows: vLLM's fields (`prompt_logprobs`, a choice's
    `stop_reason`) or SGLang's (a choice's `matched_stop`); None for any other."""
    keys = {k for c in choices if isinstance(c, Mapping) for k in c}
    if "prompt_logprobs" in response or "stop_reason" in keys:
        return "vllm"
    if "sglext" in response or "matched_stop" in keys:
        return "sglang"
    return None


def parse_openai(item: Any, path: str = "item") -> list[Generation]:
    """The generations of one OpenAI-compatible chat or completions response (one per choice),
    or of one vLLM offline `RequestOutput`. Raises FieldError naming the field."""
    request, response, rpath = split_item(item, path)
    if "choices" not in response and "outputs" in response:
        return parse_request_output(request, response, rpath)
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
    strategy, processors = decoding_recipe(request)
    recipe, stop_ids = request_recipe(request)
    engine = _engine(response, choices)
    max_tokens = _max_tokens(request)
    messages = request.get("messages") if request is not None else None
    out = []
    for c, raw in enumerate(choices):
        cpath = f"{rpath}.choices[{c}]"
        choice = j.obj(raw, cpath)
        index = j.opt_int(choice.get("index"), f"{cpath}.index")
        stop_reason, stop_id = _stop(choice, cpath)
        logprobs = choice.get("logprobs")
        suffix = "" if len(choices) == 1 else f"#{index if index is not None else c}"
        external_id = f"{rid}{suffix}" if rid else None
        texts: TextSteps | None = None
        if chat:
            # vLLM logs the prompt's ids once per response, SGLang on each choice.
            logged, where = response.get("prompt_token_ids"), f"{rpath}.prompt_token_ids"
            if logged is None and choice.get("prompt_token_ids") is not None:
                logged, where = choice["prompt_token_ids"], f"{cpath}.prompt_token_ids"
            prompt = _prompt_ids(logged, request, where, path)
            content = None
            if logprobs is not None:
                content = j.obj(logprobs, f"{cpath}.logprobs").get("content")
            lpath = f"{cpath}.logprobs.content"
            ids_from_tokens, steps, texts, pieces = (
                _chat_steps(j.seq(content, lpath), lpath)
                if content is not None
                else (None, None, None, None)
            )
            message = choice.get("message")
            text = message.get("content") if isinstance(message, Mapping) else None
            output = _output_ids(choice.get("token_ids"), ids_from_tokens, cpath, lpath)
            steps_field = "logprobs.content"
            prompt_text = j.opt_str(response.get("prompt_text"), f"{rpath}.prompt_text")
        else:
            where = f"{cpath}.prompt_token_ids"
            prompt = _prompt_ids(choice.get("prompt_token_ids"), request, where, path)
            explicit = choice.get("token_ids")
            n_output = len(explicit) if isinstance(explicit, list) else 0
            ids_from_tokens, steps, echoed, pieces = None, None, False, None
            if logprobs is not None:
                echo = request.get("echo") if request is not None else None
                if prompt is None and echo:
                    raise j.fail(f"{cpath}.prompt_token_ids", "an echoed prompt without its ids")
                ids_from_tokens, steps, texts, echoed = _completion_steps(
                    j.obj(logprobs, f"{cpath}.logprobs"),
                    f"{cpath}.logprobs",
                    prompt or [],
                    n_output,
                    echo if isinstance(echo, bool) else None,
                )
                tokens = list(j.seq(logprobs.get("tokens") or [], f"{cpath}.logprobs.tokens"))
                tokens = tokens[len(tokens) - n_output :] if explicit is not None else tokens
                if explicit is None and echoed:
                    tokens = tokens[len(prompt or []) :]
                pieces = _pieces([_piece(t, None) for t in tokens])
            output = _output_ids(explicit, ids_from_tokens, cpath, f"{cpath}.logprobs.tokens")
            text = None if echoed else choice.get("text")
            steps_field = "logprobs.top_logprobs"
            raw_prompt = request.get("prompt") if request is not None else None
            prompt_text = raw_prompt if isinstance(raw_prompt, str) else None
        if output is not None and not output:
            raise j.fail(f"{cpath}.token_ids", "the choice generated no tokens")
        out.append(
            Generation(
                field=cpath,
                prompt_token_ids=prompt,
                output_token_ids=output,
                steps=steps,
                text_steps=texts,
                steps_field=steps_field,
                stop_reason=stop_reason,
                stop_token_id=stop_id,
                prompt_text=prompt_text,
                prompt_field=where,
                prompt_messages=messages if chat and isinstance(messages, list) else None,
                # A chat prompt is rendered with its special tokens in the text.
                add_special_tokens=not chat,
                output_text=text if isinstance(text, str) else None,
                external_id=external_id,
                served_model=model,
                engine_name=engine,
                strategy=strategy,
                processors=processors,
                extras=recipe,
                sampling=vllm_sampling(request, c) if engine == "vllm" else None,
                stop_token_ids=stop_ids,
                max_new_tokens=max_tokens,
                output_token_pieces=(
                    pieces
                    if pieces is not None and (output is None or len(pieces) == len(output))
                    else None
                ),
            )
        )
    return out


def parse_request_output(
    request: Mapping[str, Any] | None, response: Mapping[str, Any], path: str
) -> list[Generation]:
    """The generations of a vLLM offline `RequestOutput` dumped as JSON (layout: the module
    docstring; the ids as JSON keys). The request, when given, is the `SamplingParams`."""
    outputs = j.seq(response.get("outputs"), f"{path}.outputs")
    if not outputs:
        raise j.fail(f"{path}.outputs", "no outputs")
    prompt = _prompt_ids(response.get("prompt_token_ids"), None, f"{path}.prompt_token_ids", path)
    rid = j.opt_str(response.get("request_id"), f"{path}.request_id")
    strategy, processors = decoding_recipe(request)
    recipe, stop_ids = request_recipe(request)
    out = []
    for c, raw in enumerate(outputs):
        opath = f"{path}.outputs[{c}]"
        completion = j.obj(raw, opath)
        stop_reason, stop_id = _stop(completion, opath)
        output = j.token_ids(completion.get("token_ids"), f"{opath}.token_ids")
        if not output:
            raise j.fail(f"{opath}.token_ids", "the output generated no tokens")
        steps: Steps | None = None
        pieces: list[Piece | None] = []
        if completion.get("logprobs") is not None:
            steps = []
            for t, step in enumerate(j.seq(completion["logprobs"], f"{opath}.logprobs")):
                where = f"{opath}.logprobs[{t}]"
                row = []
                for key, entry in j.obj(step, where).items():
                    tid = j.token_id(int(key) if str(key).isdigit() else key, f"{where}.{key}")
                    logprob = j.obj(entry, f"{where}.{key}")
                    row.append((tid, j.number(logprob.get("logprob"), f"{where}.{key}.logprob")))
                    if t < len(output) and tid == output[t]:
                        decoded = logprob.get("decoded_token")
                        pieces.append(_piece(decoded, None) if isinstance(decoded, str) else None)
                steps.append(row)
        index = j.opt_int(completion.get("index"), f"{opath}.index")
        text = completion.get("text")
        out.append(
            Generation(
                field=opath,
                prompt_token_ids=prompt,
                output_token_ids=output,
                steps=steps,
                steps_field="logprobs",
                stop_reason=stop_reason,
                stop_token_id=stop_id,
                prompt_text=j.opt_str(response.get("prompt"), f"{path}.prompt"),
                output_text=text if isinstance(text, str) else None,
                external_id=rid if len(outputs) == 1 or rid is None else f"{rid}#{index or c}",
                engine_name="vllm",
                strategy=strategy,
                processors=processors,
                extras=recipe,
                sampling=vllm_sampling(request, index if index is not None else c),
                stop_token_ids=stop_ids,
                max_new_tokens=_max_tokens(request),
                output_token_pieces=_pieces(pieces) if len(pieces) == len(output) else None,
            )
        )
    return out
