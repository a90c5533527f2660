"""One logged generation as read from a source, and the trace it becomes. Pure.

Source modules (`openai`, `sglang`, `hf`, `lm_eval`) turn their input into `Generation`s;
`build_trace` (after `resolve` read the ids a source logged only as text) is the one place
where an imported trace's configuration, logged margins and unknowns are decided:

- A configuration field that neither the context nor the source gives keeps a neutral value
  (`attn_kernel`/`engine.name` "unknown", device "other", null batch size and TP degree) and is
  named in `config.extras["unknown"]`. `dtype` and the model reference cannot be unknown: a
  trace without them could not be replayed, so the import refuses with the field named.
- Logged margins: the per-step values become the trace's top-k only when raw (logits, or raw
  logprobs whose top-1 minus top-2 is the logit margin) and every step has at least two;
  `config.extras["top_k_values"]` says which, `logprobs_mode_source` who said the mode (a vLLM
  source without one: vLLM's default, raw_logprobs). Processed logprobs or an unknown mode give
  no top-k, so a replay reconstructs the logged arm's margins rather than mixing sources;
  `config.extras["top_k_source"]` says where a kept top-k came from, or why a logged one was
  dropped (`dropped_top_k`: the CLI prints it, the API answers it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pydantic import ValidationError

from replay_audit.diff.pieces import Piece, shown, to_json
from replay_audit.exceptions import FieldError
from replay_audit.formats import (
    EXTRA_PROCESSORS,
    EXTRA_TOKEN_IDS_SOURCE,
    EXTRA_TOP_K_VALUES,
    ImportFormat,
    SamplingJson,
    StopReason,
    Strategy,
    TokenIdsSource,
    TopKValues,
)
from replay_audit.imports import _json as j
from replay_audit.imports.processors import RequestProcessors
from replay_audit.imports.schemas import (
    EXTRA_FORMAT,
    EXTRA_LOGPROBS_MODE,
    EXTRA_UNKNOWN,
    UNKNOWN,
    ImportContext,
    LogprobsMode,
)
from replay_audit.imports.tokenization import DROPPED, Vocabulary
from replay_audit.json_value import JsonObject
from replay_audit.traces.schemas import ExtraValue, TraceCreate, TraceFieldError

#: A logprob at or below this is a clamped -inf (vLLM writes max(logprob, -9999.0)): absent.
ABSENT_LOGPROB: Final = -9999.0
#: The most top-k entries kept per step (the trace schema's limit).
MAX_KEPT_TOP_K: Final = 20

#: `config.extras` keys of the import's provenance records.
EXTRA_TOP_K_SOURCE: Final = "top_k_source"
EXTRA_LOGPROBS_MODE_SOURCE: Final = "logprobs_mode_source"

#: The configuration fields that are named in `extras["unknown"]` when nobody gave them.
_OPTIONAL_FIELDS: Final = (
    "lm_head_dtype",
    "weight_dtype",
    "device",
    "gpu",
    "attn_kernel",
    "batch_size",
    "tp_degree",
    "engine.name",
    "engine.version",
    "torch_version",
    "cuda_version",
    "cublas_version",
    "deterministic",
    "tf32",
)


@dataclass(frozen=True)
class Generation:
    """One generation read from a source, before the context is applied.

    `steps[t]`: the (token id, value) pairs logged for output step t, in any order. `field`
    (e.g. `choices[1]`) and `steps_field` locate the generation and its values for errors.
    """

    field: str
    #: None where the source logged no ids: `generation.resolve` fills them from the text.
    prompt_token_ids: Sequence[int] | None
    output_token_ids: Sequence[int] | None
    steps: Sequence[Sequence[tuple[int, float]]] | None = None
    #: Per-step (piece, value) pairs of a top-k keyed by token text (mapped to ids by
    #: `generation.resolve` where each piece is exactly one token).
    text_steps: Sequence[Sequence[tuple[Piece, float]]] | None = None
    steps_field: str = "logprobs"
    stop_reason: StopReason | None = None
    #: The stop token id the server matched (added to the trace's eos ids).
    stop_token_id: int | None = None
    #: The request's stop token ids (added to the trace's eos ids: the server stopped on them).
    stop_token_ids: Sequence[int] = ()
    prompt_text: str | None = None
    output_text: str | None = None
    external_id: str | None = None
    #: The served model's name (default model.name).
    served_model: str | None = None
    #: What the source itself says about its values (e.g. transformers' logits are raw_logits).
    logprobs_mode: LogprobsMode | None = None
    #: The engine the source implies (SGLang's native API: "sglang").
    engine_name: str | None = None
    #: From the item's request, when it came with one.
    strategy: Strategy | None = None
    max_new_tokens: int | None = None
    reference_answer: str | None = None
    tags: Sequence[str] = ()
    #: Facts of the source recorded in `config.extras` (e.g. the tokenization of lm-eval).
    extras: Mapping[str, ExtraValue] = dataclasses.field(default_factory=dict)
    #: Each output token's piece (`diff.pieces`), where the source gives token strings.
    output_token_pieces: Sequence[Piece] | None = None
    #: The chat request's messages (the prompt is their rendering by the chat template).
    prompt_messages: Sequence[Mapping[str, Any]] | None = None
    #: Where the prompt's ids belong in the item (default `{field}.prompt_token_ids`).
    prompt_field: str | None = None
    #: Whether the server added special tokens (BOS) when it encoded `prompt_text`.
    add_special_tokens: bool = True
    #: Where the ids came from (the `tokenization` module docstring).
    token_ids_source: TokenIdsSource = "logged"
    #: Where a kept top-k's ids came from (what `resolve` did with text keys).
    top_k_source: str = "logged ids"
    processors: RequestProcessors = dataclasses.field(default_factory=RequestProcessors)
    #: The seeded sampler, where the source's request names one a verification reproduces
    #: (`decoding.sampling` without its device: the import context's, else cuda).
    sampling: SamplingJson | None = None
    #: The batch size that ran, where the source states it (a generate() call's rows).
    batch_size: int | None = None
    #: Where the row sat in the batch it was generated in (`decoding.batch`: every row's prompt
    #: length, this row), where the source shows it (a generate() call's left-padded rows).
    batch: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class LoggedTopK:
    """The per-step top-k kept for a trace: ids and values sorted by value descending (ties by
    smaller id), the same k at every step."""

    ids: list[list[int]]
    values: list[list[float]]

    @property
    def k(self) -> int:
        return len(self.ids[0]) if self.ids else 0

    def margins(self) -> list[float]:
        """Top-1 minus top-2 at each step (in float32, as stored)."""
        import numpy as np

        v = np.asarray(self.values, dtype=np.float32)
        return [float(x) for x in (v[:, 0] - v[:, 1])]


def logged_top_k(
    steps: Sequence[Sequence[tuple[int, float]]] | None,
    output_token_ids: Sequence[int],
    *,
    field: str,
    greedy: bool,
    max_k: int = MAX_KEPT_TOP_K,
) -> LoggedTopK | None:
    """The `LoggedTopK` of per-step (id, value) pairs, or None when they give no margin.

    Every step is cut to the smallest count of present values (at most `max_k`). With `greedy`,
    a logged token below its step's top-1 (a tie is allowed) means these are not the values the
    decode took its argmax of: the import refuses with the step named.
    """
    if steps is None:
        return None
    if len(steps) != len(output_token_ids):
        raise FieldError(
            f"{field}: {len(steps)} steps of logprobs for {len(output_token_ids)} output tokens",
            field=field,
        )
    rows: list[list[tuple[int, float]]] = []
    for t, step in enumerate(steps):
        present: dict[int, float] = {}
        for token_id, value in step:
            if not math.isfinite(value) and not (value == -math.inf):
                raise FieldError(f"{field}[{t}]: logprob {value!r} is not a number", field=field)
            if value <= ABSENT_LOGPROB:
                continue
            present[token_id] = max(value, present.get(token_id, -math.inf))
        rows.append(sorted(present.items(), key=lambda p: (-p[1], p[0])))
    k = min(min((len(r) for r in rows), default=0), max_k)
    if greedy:
        for t, (row, token) in enumerate(zip(rows, output_token_ids, strict=True)):
            if not row:
                continue
            logged = dict(row).get(token)
            if logged is None or logged < row[0][1]:
                where = "is not among" if logged is None else f"has value {logged!r} below"
                raise FieldError(
                    f"{field}[{t}]: the logged token {token} {where} the step's top-1 "
                    f"({row[0][0]}: {row[0][1]!r}): not a greedy decode of these values "
                    "(sampling, penalties or a logit bias?)",
                    field=f"{field}[{t}]",
                )
    if k < 2:
        return None
    return LoggedTopK(
        ids=[[i for i, _ in r[:k]] for r in rows],
        values=[[v for _, v in r[:k]] for r in rows],
    )


def _top_k_values(mode: LogprobsMode | None) -> TopKValues | None:
    if mode == "raw_logits":
        return "logits"
    if mode == "raw_logprobs":
        return "raw_logprobs"
    return None  # processed or unknown: no logged margin


def _resolve_mode(gen: Generation, context: ImportContext) -> tuple[LogprobsMode | None, str]:
    """The logprobs mode and who said it: the source, the context, or the engine's default
    (vLLM's `--logprobs-mode` is raw_logprobs unless the server was started otherwise)."""
    if gen.logprobs_mode is not None and context.logprobs_mode not in (None, gen.logprobs_mode):
        raise FieldError(
            f"logprobs_mode: the source's values are {gen.logprobs_mode}, but the context says "
            f"{context.logprobs_mode}",
            field="logprobs_mode",
        )
    if gen.logprobs_mode is not None:
        return gen.logprobs_mode, "source"
    if context.logprobs_mode is not None:
        return context.logprobs_mode, "context"
    if (context.engine.name or gen.engine_name) == "vllm":
        return "raw_logprobs", "engine_default"
    return None, "unknown"


def check_context(context: ImportContext) -> None:
    """Refuse, naming the field, a context without what every trace needs and no response
    carries: the dtype, the weights hash and the vocabulary size."""
    if context.dtype is None:
        raise FieldError(
            "config.dtype is unknown: a response does not say which dtype the model ran in; "
            "give it (CLI: --config dtype=bf16; HTTP: context.dtype)",
            field="dtype",
        )
    for name in ("weights_sha256", "vocab_size"):
        if getattr(context.model, name) is None:
            raise FieldError(
                f"model.{name} is unknown: no response carries it; give the checkpoint "
                "(CLI: --model DIR) or model.weights_sha256 and model.vocab_size in the context",
                field=f"model.{name}",
            )


def _config(
    gen: Generation,
    context: ImportContext,
    fmt: ImportFormat,
    mode: LogprobsMode | None,
    *,
    strategy_known: bool,
    values_kind: TopKValues | None,
    provenance: Mapping[str, ExtraValue],
) -> dict[str, object]:
    check_context(context)
    given = context.model_dump(exclude_unset=True, exclude_none=True)
    unknown = []
    for name in _OPTIONAL_FIELDS:
        head, _, tail = name.partition(".")
        value = given.get(head)
        present = value is not None and (not tail or value.get(tail) is not None)
        if (name == "engine.name" and gen.engine_name is not None) or (
            name == "batch_size" and gen.batch_size is not None
        ):
            present = True
        if name in ("gpu", "cuda_version", "cublas_version") and context.device in ("cpu", "mps"):
            present = True  # not applicable
        if not present:
            unknown.append(name)
    if not strategy_known:
        unknown.append("decoding.strategy")
    engine_name = context.engine.name or gen.engine_name or UNKNOWN
    extras: dict[str, ExtraValue] = {
        **dict(gen.extras),
        **context.extras,
        EXTRA_FORMAT: fmt,
        EXTRA_LOGPROBS_MODE: mode or UNKNOWN,
        **provenance,
    }
    if unknown:
        extras[EXTRA_UNKNOWN] = ",".join(unknown)
    # A property of the source's mode, not of one trace (so one server's traces share a
    # configuration): what a top-k of these traces holds, "none" when it gives no margin.
    extras[EXTRA_TOP_K_VALUES] = values_kind or "none"
    return {
        "dtype": context.dtype,
        "lm_head_dtype": context.lm_head_dtype,
        "weight_dtype": context.weight_dtype,
        "device": context.device or "other",
        "gpu": context.gpu.model_dump() if context.gpu is not None else None,
        "attn_kernel": context.attn_kernel or UNKNOWN,
        # Unknown stays null (and listed): a default here would read as a fact.
        "batch_size": context.batch_size or gen.batch_size,
        "tp_degree": context.tp_degree,
        "engine": {"name": engine_name, "version": context.engine.version},
        "torch_version": context.torch_version,
        "cuda_version": context.cuda_version,
        "cublas_version": context.cublas_version,
        "deterministic": context.deterministic,
        "tf32": context.tf32,
        "extras": extras,
    }


def _model(gen: Generation, context: ImportContext) -> dict[str, object]:
    m = context.model
    name = m.name or gen.served_model or m.default_name
    if not name:
        raise FieldError(
            "model.name is unknown: give it (CLI: --config model.name=...)", field="model.name"
        )
    return {
        "name": name,
        "revision": m.revision,
        "weights_sha256": m.weights_sha256,
        "vocab_size": m.vocab_size,
    }


def build_trace(
    gen: Generation,
    context: ImportContext,
    fmt: ImportFormat,
    vocabulary: Vocabulary | None = None,
) -> TraceCreate:
    """The trace for `gen` in `context` (the module docstring says what is decided here).
    `vocabulary` (the checkpoint's tokenizer) reads the ids the source did not log (`resolve`).
    Raises FieldError naming the field."""
    gen = resolve(gen, vocabulary, context.decoding.eos_token_ids or ())
    mode, mode_source = _resolve_mode(gen, context)
    strategy = gen.strategy or context.decoding.strategy
    values_kind = _top_k_values(mode)
    top_k = (
        logged_top_k(
            gen.steps,
            gen.output_token_ids or (),
            field=f"{gen.field}.{gen.steps_field}",
            greedy=strategy == "greedy" and mode in ("raw_logits", "raw_logprobs"),
        )
        if values_kind is not None
        else None
    )
    provenance: dict[str, ExtraValue] = {
        EXTRA_LOGPROBS_MODE_SOURCE: mode_source,
        EXTRA_TOKEN_IDS_SOURCE: gen.token_ids_source,
        EXTRA_TOP_K_SOURCE: _top_k_source(gen, top_k, mode),
    }
    if gen.processors.not_replayed:
        provenance[EXTRA_PROCESSORS] = gen.processors.named()
    config = _config(
        gen,
        context,
        fmt,
        mode,
        strategy_known=strategy is not None,
        values_kind=values_kind,
        provenance=provenance,
    )
    eos = list(context.decoding.eos_token_ids or [])
    for stop in (*gen.stop_token_ids, gen.stop_token_id):
        if stop is not None and stop not in eos:
            eos.append(stop)
    body: dict[str, object] = {
        "external_id": gen.external_id,
        "model": _model(gen, context),
        "config": config,
        "decoding": {
            # Unknown is "other": a trace is replayed only when it is known to be greedy.
            "strategy": strategy or "other",
            "max_new_tokens": gen.max_new_tokens or context.decoding.max_new_tokens,
            "eos_token_ids": eos,
            "stop_reason": gen.stop_reason,
            "logits_processors": _logits_processors(gen, context),
            **({"batch": dict(gen.batch)} if gen.batch is not None else {}),
            **(
                {"sampling": {**gen.sampling, "device": _noise_device(context)}}
                if gen.sampling is not None and strategy == "sample"
                else {}
            ),
        },
        "prompt_token_ids": list(gen.prompt_token_ids or ()),
        "output_token_ids": list(gen.output_token_ids or ()),
        "prompt_text": _printable(gen.prompt_text),
        "prompt_messages": _text_messages(gen.prompt_messages),
        "output_text": _printable(gen.output_text),
        "output_token_pieces": (
            to_json(gen.output_token_pieces) if gen.output_token_pieces is not None else None
        ),
        "top_k": None if top_k is None else {"ids": top_k.ids, "logits": top_k.values},
        "tags": list(dict.fromkeys([*context.tags, *gen.tags])),
        "reference_answer": gen.reference_answer,
    }
    try:
        return TraceCreate.model_validate(body)
    except ValidationError as exc:
        raise _trace_error(exc, gen.field) from None


def _noise_device(context: ImportContext) -> str:
    """Where a server's sampler drew its noise: the import context's device where it is one a
    generator runs on, else CUDA (where vLLM serves)."""
    return "cpu" if context.device == "cpu" else "cuda"


def _logits_processors(gen: Generation, context: ImportContext) -> JsonObject | None:
    """The import context's logits processors (a server's defaults, such as a repetition
    penalty vLLM takes from generation_config.json), then the request's own."""
    given = context.decoding.logits_processors
    merged: JsonObject = {**(given.stored() if given is not None else {})}
    merged.update(gen.processors.replayed or {})
    return merged or None


def _top_k_source(gen: Generation, top_k: LoggedTopK | None, mode: LogprobsMode | None) -> str:
    """Where the kept top-k came from, or why the logged one was not kept (`DROPPED`)."""
    if top_k is not None:
        return gen.top_k_source
    if gen.top_k_source.startswith(DROPPED):
        return gen.top_k_source
    if gen.steps is None:
        return "none logged"
    if _top_k_values(mode) is None:
        return (
            f"{DROPPED}the logprobs mode is {mode or 'unknown'}: no logit margin "
            "(give --config logprobs_mode=raw_logprobs if the server's values are raw)"
        )
    return f"{DROPPED}fewer than two logged values at some step"


def dropped_top_k(trace: TraceCreate) -> str | None:
    """Why a trace's logged top-k was not kept, or None (kept, or none was logged)."""
    source = trace.config.extras.get(EXTRA_TOP_K_SOURCE)
    if isinstance(source, str) and source.startswith(DROPPED):
        return source[len(DROPPED) :]
    return None


def _text_messages(messages: Sequence[Mapping[str, Any]] | None) -> list[object] | None:
    """A chat prompt's messages as the trace keeps them ({role, content}), where each is text
    (tool calls and content parts are only in the rendered prompt)."""
    if not messages or not all(
        isinstance(m, Mapping)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str)
        for m in messages
    ):
        return None
    return [{"role": m["role"], "content": _printable(m["content"])} for m in messages]


def _printable(text: str | None) -> str | None:
    # Texts are informational (the ids are the record) and no database stores a NUL in text.
    return None if text is None else text.replace("\x00", "\ufffd")


def _trace_error(exc: ValidationError, where: str) -> FieldError:
    first = exc.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, TraceFieldError):
        return FieldError(f"{where}: the trace would be invalid: {cause}", field=cause.field)
    loc = ".".join(str(p) for p in first.get("loc", ()))
    return FieldError(
        f"{where}: the trace would be invalid: {loc}: {first.get('msg', 'invalid')}",
        field=loc or where,
    )


# -- ids a log lacks, read with the checkpoint's tokenizer (`tokenization`) -------------

_NEEDS_TOKENIZER: Final = "needs the checkpoint's tokenizer: import with the CLI and --model DIR"
_ASK: Final = (
    'not logged (ask the server: vLLM "return_token_ids": true, SGLang '
    '"return_prompt_token_ids": true)'
)


def _mismatch(decoded: str, logged: str) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(decoded, logged, strict=False)) if a != b),
        min(len(decoded), len(logged)),
    )
    return (
        f"the ids decode to {decoded[at : at + 20]!r} where the log has "
        f"{logged[at : at + 20]!r} (character {at})"
    )


def _prompt(gen: Generation, vocab: Vocabulary | None) -> tuple[list[int], str | None]:
    field = gen.prompt_field or f"{gen.field}.prompt_token_ids"
    text, add = gen.prompt_text, gen.add_special_tokens
    if text is None and gen.prompt_messages is None:
        raise j.fail(field, f"{_ASK}, and no prompt text or chat messages (give the request)")
    if vocab is None:
        raise j.fail(field, f"{_ASK}; re-tokenising the prompt {_NEEDS_TOKENIZER}")
    if gen.prompt_messages is not None:
        text, add = vocab.render(gen.prompt_messages, f"{gen.field}.request.messages"), False
    assert text is not None
    body = vocab.encode(text, add_special_tokens=False)
    decoded = vocab.decode(body, skip_special_tokens=False)
    if decoded != text:
        raise j.fail(field, f"the prompt does not round-trip: {_mismatch(decoded, text)}")
    return (vocab.encode(text, add_special_tokens=True) if add else body), text


def _output(
    gen: Generation, vocab: Vocabulary | None, eos: Sequence[int]
) -> tuple[list[int], TokenIdsSource]:
    field = f"{gen.field}.token_ids"
    if vocab is None:
        raise j.fail(field, f"{_ASK}; reading them from the text {_NEEDS_TOKENIZER}")
    if gen.output_token_pieces is None:
        if gen.output_text is None:
            raise j.fail(field, "not logged, and neither are token pieces or the output text")
        return vocab.encode(gen.output_text, add_special_tokens=False), "retokenized"
    ids = []
    last = len(gen.output_token_pieces) - 1
    for t, piece in enumerate(gen.output_token_pieces):
        token = vocab.id_of(piece)
        if token is None and piece == "" and t == last and gen.stop_reason == "eos":
            # vLLM writes the eos token that ended the choice as an empty piece.
            token = gen.stop_token_id if gen.stop_token_id is not None else next(iter(eos), None)
        if token is None:
            raise j.fail(
                f"{gen.field}.{gen.steps_field}[{t}]",
                f"the logged piece {shown(piece)!r} is not exactly one token of the checkpoint's "
                "tokenizer: no ids for this output",
            )
        ids.append(token)
    return ids, "pieces"


def _text_top_k(
    gen: Generation, vocab: Vocabulary | None, output: Sequence[int]
) -> tuple[list[list[tuple[int, float]]] | None, str]:
    assert gen.text_steps is not None
    if vocab is None:
        return None, f"{DROPPED}the top-k is keyed by token text; mapping it {_NEEDS_TOKENIZER}"
    # The logged tokens' own pieces must map to their logged ids, or the server's texts are
    # not this tokenizer's pieces (an older vLLM strips SentencePiece's leading space).
    for t, (piece, logged) in enumerate(zip(gen.output_token_pieces or (), output, strict=False)):
        if vocab.id_of(piece) not in (None, logged):
            return None, (
                f"{DROPPED}the text keys are not this tokenizer's pieces: step {t}'s token "
                f"{shown(piece)!r} maps to {vocab.id_of(piece)}, logged as {logged}"
            )
    steps, cut = [], ""
    for t, step in enumerate(gen.text_steps):
        row: list[tuple[int, float]] = []
        for piece, value in sorted(step, key=lambda e: -e[1]):
            token = vocab.id_of(piece)
            if token is None or any(token == i for i, _ in row):
                cut = cut or f" (cut at step {t}: {shown(piece)!r} is not exactly one token)"
                break
            row.append((token, value))
        steps.append(row)
    if min((len(r) for r in steps), default=0) < 2:
        return None, f"{DROPPED}text keys that map to fewer than two tokens at some step{cut}"
    return steps, f"text keys mapped to ids with the checkpoint's tokenizer{cut}"


def resolve(gen: Generation, vocab: Vocabulary | None, eos: Sequence[int] = ()) -> Generation:
    """`gen` with ids for what its source logged only as text. Raises FieldError naming the
    field when an id cannot be read or the ids do not decode back to the logged text."""
    changes: dict[str, Any] = {}
    sources: list[TokenIdsSource] = [gen.token_ids_source]
    if gen.prompt_token_ids is None:
        changes["prompt_token_ids"], changes["prompt_text"] = _prompt(gen, vocab)
        sources.append("retokenized")
    output = gen.output_token_ids
    if output is None:
        output, source = _output(gen, vocab, eos)
        changes["output_token_ids"] = output
        sources.append(source)
        if gen.output_text is not None:
            assert vocab is not None
            decoded = vocab.decode(output, skip_special_tokens=True)
            if decoded != gen.output_text:
                raise j.fail(
                    f"{gen.field}.token_ids",
                    f"the output does not round-trip: {_mismatch(decoded, gen.output_text)}",
                )
        if gen.output_token_pieces is None and vocab is not None:
            changes["output_token_pieces"] = vocab.pieces(output)
    if gen.text_steps is not None and gen.steps is None:
        changes["steps"], changes["top_k_source"] = _text_top_k(gen, vocab, output)
    order: tuple[TokenIdsSource, ...] = ("logged", "pieces", "retokenized")
    changes["token_ids_source"] = max(sources, key=order.index)
    return dataclasses.replace(gen, **changes)
