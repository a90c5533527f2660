"""The trace contract: what `POST /v1/traces` accepts and `GET /v1/traces/{id}` returns.

`replay-audit generate` writes exactly `TraceCreate` JSON, one per line. Validation here is the
whole of input checking: every error names its field (pydantic's `loc`), so the API answers 422
with the field and never 500.
"""

from __future__ import annotations

import math
from collections.abc import Sequence, Sized
from datetime import datetime
from functools import cached_property
from itertools import chain
from typing import Annotated, Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt
from pydantic import (
    AfterValidator,
    Field,
    PlainValidator,
    StringConstraints,
    WithJsonSchema,
    model_validator,
)

from replay_audit.config import MAX_BATCH_TRACES, MAX_TOP_K, MAX_TRACE_TOKENS
from replay_audit.diff.pieces import MAX_PIECE_LENGTH, from_json, to_json
from replay_audit.formats import (
    ATTN_KERNEL_PATTERN,
    BodyDType,
    HeadDType,
    LoggedDevice,
    NoiseDevice,
    Sampler,
    StopReason,
    Strategy,
    WeightDType,
)
from replay_audit.input import InputModel, refuse_unstorable
from replay_audit.json_value import JsonObject
from replay_audit.output import OutputModel

Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


Name = Annotated[str, StringConstraints(min_length=1, max_length=200)]
# The constraints of a numerical configuration's fields, shared by `NumericalConfig` and the
# import's partial one (`imports.schemas.ImportContext`).
Version = Annotated[str, StringConstraints(max_length=100)]
#: A logged attention kernel: any transformers-style name (`formats.ATTN_KERNELS` are the ones
#: this engine runs).
AttnKernelName = Annotated[str, StringConstraints(pattern=ATTN_KERNEL_PATTERN)]
BatchSize = Annotated[int, Field(ge=1, le=1_000_000)]
TpDegree = Annotated[int, Field(ge=1, le=1024)]
#: Compute capability, "major.minor" (e.g. "8.6", "9.0").
ComputeCapability = Annotated[str, StringConstraints(pattern=r"^\d{1,2}\.\d{1,2}$")]
ExtraKey = Annotated[str, StringConstraints(max_length=100)]
#: Most keys of `config.extras`.
MAX_EXTRAS: Final = 100

#: Numbers in `config.extras` fit a signed 64-bit integer, which JSON libraries and databases
#: hold exactly (orjson serialises nothing larger, and parses a larger integer as a float of
#: magnitude 2^63 or more, which this bound refuses too: no silently rounded value).
EXTRA_NUMBER_MAX: Final = 2**63 - 1
EXTRA_NUMBER_MIN: Final = -EXTRA_NUMBER_MAX


def _extra_value(value: Any) -> str | int | float | bool | None:
    # One validator instead of a union: exact JSON types (no "3" -> 3, no true -> 1), finite
    # numbers in range, and one error message naming the key instead of one per union member.
    kind = type(value)
    if value is None or kind is bool:
        return value  # type: ignore[no-any-return]
    if kind is str:
        return refuse_unstorable(value)
    if kind is int or kind is float:
        if kind is float and not math.isfinite(value):
            raise ValueError("numbers must be finite (no NaN or Infinity)")
        if not EXTRA_NUMBER_MIN <= value <= EXTRA_NUMBER_MAX:
            raise ValueError("numbers must lie in -(2^63 - 1) .. 2^63 - 1")
        return value  # type: ignore[no-any-return]
    raise ValueError("must be a string, a number, a boolean or null")


#: A value of `config.extras`: a string, a finite number in the 64-bit range, a boolean or null,
#: stored and read back exactly as sent.
ExtraValue = Annotated[
    str | int | float | bool | None,
    PlainValidator(_extra_value),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {"type": "number", "minimum": EXTRA_NUMBER_MIN, "maximum": EXTRA_NUMBER_MAX},
                {"type": "boolean"},
                {"type": "null"},
            ]
        }
    ),
]
Tag = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[\w.:/=-]+$")]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
#: One output token's piece: its text, or its bytes (integers 0..255, as OpenAI's `bytes`)
#: where they are not valid UTF-8 text alone (half of a character) or hold a NUL.
PieceByte = Annotated[int, Field(ge=0, le=255)]
TokenPiece = (
    Annotated[str, StringConstraints(max_length=MAX_PIECE_LENGTH)]
    | Annotated[list[PieceByte], Field(min_length=1, max_length=MAX_PIECE_LENGTH)]
)


def _canonical_pieces(pieces: list[str | list[int]]) -> list[str | list[int]]:
    return to_json(from_json(pieces))


class TraceInput(InputModel):
    """A request model of the trace contract (a token id `3.0` is JSON Schema's integer 3, as
    everywhere: it is stored and read back as 3)."""


class ModelRef(TraceInput):
    name: Name
    revision: str | None = Field(default=None, max_length=200)
    weights_sha256: Sha256
    vocab_size: int = Field(ge=2, le=2**31 - 1)


class GpuInfo(TraceInput):
    name: Name
    sm: ComputeCapability


class EngineInfo(TraceInput):
    name: Name
    version: Version | None = None


def _is_none(value: object) -> bool:
    """`exclude_if` of a field written out only where given: what is stored, hashed and read
    back is what was sent, and a trace without it is stored and hashed as before it existed."""
    return value is None


class NumericalConfig(TraceInput):
    """Everything that changes the numbers. Stored once per distinct content (its hash)."""

    dtype: BodyDType
    #: None means the same as `dtype`.
    lm_head_dtype: HeadDType | None = None
    #: Storage dtype of the weights (e.g. bf16 weights computed in fp32); None = `dtype`.
    weight_dtype: WeightDType | None = None
    device: LoggedDevice = "cpu"
    gpu: GpuInfo | None = None
    attn_kernel: AttnKernelName = "eager"
    #: None = not known (an import whose source does not say it): never a guessed 1.
    batch_size: BatchSize | None = 1
    tp_degree: TpDegree | None = 1
    engine: EngineInfo = EngineInfo(name="transformers")
    torch_version: Version | None = None
    cuda_version: Version | None = None
    cublas_version: Version | None = None
    #: cuDNN's version as torch loaded it (torch.backends.cudnn.version(), e.g. "91002").
    cudnn_version: Version | None = Field(default=None, exclude_if=_is_none)
    deterministic: bool | None = None
    tf32: bool | None = None
    extras: dict[ExtraKey, ExtraValue] = Field(default_factory=dict, max_length=MAX_EXTRAS)

    @property
    def head_dtype(self) -> str:
        return self.lm_head_dtype or self.dtype

    @model_validator(mode="after")
    def _gpu_needs_accelerator(self) -> NumericalConfig:
        if self.gpu is not None and self.device == "cpu":
            raise ValueError("config.gpu is set but config.device is 'cpu'")
        return self


#: A token id as a JSON object key (OpenAI's and vLLM's `logit_bias`: `{"50256": -100}`).
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]{0,9})$")]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
#: Most entries of a logits processor's list or map (OpenAI allows 300 logit biases).
MAX_PROCESSOR_ENTRIES: Final = 1000


class LogitsProcessorsSpec(TraceInput):
    """The logits processors a greedy generation ran with (absent: off). A replay applies them
    at every step with transformers' own classes (`engine.protocol.LogitsProcessors` says how
    each is read); a request that ran any other processor is stored with strategy `other` and
    is not replayed. Only the processors given are written out."""

    #: transformers' and vLLM's `repetition_penalty` (1: off), over prompt and output.
    repetition_penalty: float | None = Field(
        gt=0, allow_inf_nan=False, default=None, exclude_if=_is_none
    )
    #: transformers' `no_repeat_ngram_size` (0: off), over prompt and output.
    no_repeat_ngram_size: int | None = Field(
        ge=0, le=MAX_TRACE_TOKENS, default=None, exclude_if=_is_none
    )
    #: transformers' `min_new_tokens`, vLLM's `min_tokens`: the eos ids are held back until
    #: this many tokens are out.
    min_new_tokens: int | None = Field(ge=0, le=MAX_TRACE_TOKENS, default=None, exclude_if=_is_none)
    #: Additive bias by token id, as OpenAI and vLLM take it (`{"50256": -100.0}`).
    logit_bias: dict[TokenIdKey, FiniteFloat] | None = Field(
        max_length=MAX_PROCESSOR_ENTRIES, default=None, exclude_if=_is_none
    )
    #: transformers' `bad_words_ids`: token id sequences never completed (prompt and output).
    bad_words_ids: list[Annotated[list[TokenId], Field(min_length=1, max_length=64)]] | None = (
        Field(max_length=MAX_PROCESSOR_ENTRIES, default=None, exclude_if=_is_none)
    )
    #: vLLM's `bad_words`: texts, encoded with the checkpoint's tokenizer as vLLM does.
    bad_words: list[Annotated[str, StringConstraints(min_length=1, max_length=200)]] | None = Field(
        max_length=MAX_PROCESSOR_ENTRIES, default=None, exclude_if=_is_none
    )

    def stored(self) -> JsonObject:
        """The stored form: only the processors given."""
        return self.model_dump(mode="json")


#: Most rows a logged batch layout lists (`BatchPlacement.prompt_lengths`).
MAX_BATCH_ROWS: Final = 4096


class BatchPlacement(TraceInput):
    """Where the trace's row sat in the batch its generation ran: every row's prompt length
    before padding (in the batch's order) and this trace's row, the rows left-padded to the
    longest under an attention mask (as transformers' `generate()` takes a batch). A replay at
    the logged batch size replays the row in that layout."""

    prompt_lengths: list[Annotated[int, Field(ge=1, le=MAX_TRACE_TOKENS)]] = Field(
        min_length=1, max_length=MAX_BATCH_ROWS
    )
    row: int = Field(ge=0, lt=MAX_BATCH_ROWS)


class SamplingSpec(TraceInput):
    """A sampled generation's seeded sampler (`strategy: sample`): what a verification needs to
    draw the same noise (`engine.sampling`). `sampler`: `transformers` (`generate(do_sample=
    True)` after `torch.manual_seed(seed)`; the noise is drawn per batch, so the trace's
    `batch` matters) or `vllm` (a request's `seed`: its own generator); `device`: the device
    kind whose generator drew it."""

    sampler: Sampler
    seed: int = Field(ge=0, lt=2**63)
    temperature: float = Field(gt=0.0, le=100.0)
    #: 0: off.
    top_k: int = Field(default=0, ge=0, le=2**31 - 1)
    #: 1: off.
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    device: NoiseDevice = "cpu"


class Decoding(TraceInput):
    #: Only greedy traces can be replayed; others are stored but refused by replays.
    strategy: Strategy = "greedy"
    max_new_tokens: int | None = Field(default=None, ge=1, le=MAX_TRACE_TOKENS)
    eos_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    stop_reason: StopReason | None = None
    #: The logits processors the generation ran with (absent: none); a replay applies them.
    logits_processors: LogitsProcessorsSpec | None = Field(default=None, exclude_if=_is_none)
    #: The row's place in the batch it was generated in (absent: not logged).
    batch: BatchPlacement | None = Field(default=None, exclude_if=_is_none)
    #: A sampled generation's seeded sampler (absent: greedy, or not logged).
    sampling: SamplingSpec | None = Field(default=None, exclude_if=_is_none)

    @model_validator(mode="after")
    def _sampled(self) -> Decoding:
        if self.sampling is not None and self.strategy != "sample":
            raise ValueError("decoding.sampling: given for a trace whose strategy is not sample")
        return self

    def stored(self) -> JsonObject:
        """The stored `decoding` JSON."""
        return self.model_dump(mode="json")


class PackedTopK(NamedTuple):
    """A `TopK` as stored: k, then (steps, k) row-major little-endian int32 ids and float32
    logits."""

    k: int
    ids: bytes
    logits: bytes

    def arrays(self) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]:
        """The (steps, k) id and logit arrays (read-only views of the bytes)."""
        if self.k == 0:
            return np.zeros((0, 0), dtype=np.int32), np.zeros((0, 0), dtype=np.float32)
        ids = np.frombuffer(self.ids, dtype="<i4").reshape(-1, self.k)
        logits = np.frombuffer(self.logits, dtype="<f4").reshape(-1, self.k)
        return ids.astype(np.int32, copy=False), logits.astype(np.float32, copy=False)


def _first_length_not(rows: Sequence[Sized], k: int) -> int | None:
    """Index of the first row whose length is not k (None if all are k)."""
    if not set(map(len, rows)) - {k}:  # the common case, in one C-level pass
        return None
    return next(t for t, row in enumerate(rows) if len(row) != k)


class TopK(TraceInput):
    """Per-step top-k of the logged arm: `ids[t]` and `logits[t]` for output step t, sorted by
    logit descending. Logits are the arm's native values, exactly converted to float32."""

    ids: list[list[TokenId]]
    logits: list[list[float]]

    @cached_property
    def packed(self) -> PackedTopK:
        """The arrays packed once, as the store keeps them (bytes, so model equality still
        works); TraceFieldError naming a step whose length differs from step 0's."""
        n_steps = len(self.ids)
        k = len(self.ids[0]) if n_steps else 0
        for rows in (self.ids, self.logits):
            t = _first_length_not(rows, k)
            if t is not None:
                raise TraceFieldError(
                    f"top_k[{t}]", f"every step must carry exactly k={k} ids and logits"
                )
        count = n_steps * k
        ids = np.fromiter(chain.from_iterable(self.ids), dtype="<i4", count=count)
        logits = np.fromiter(
            chain.from_iterable(self.logits), dtype=np.float64, count=len(self.logits) * k
        )
        with np.errstate(over="ignore", invalid="ignore"):
            # Out-of-range float64 values become inf here and are refused as non-finite.
            logits32 = logits.astype("<f4")
        return PackedTopK(k, ids.tobytes(), logits32.tobytes())


class ChatMessage(TraceInput):
    """One message of a chat prompt (the prompt's ids are its rendering by the chat template)."""

    role: Name
    content: str = Field(max_length=1_000_000)


class TraceCreate(TraceInput):
    external_id: str | None = Field(default=None, min_length=1, max_length=200)
    model: ModelRef
    config: NumericalConfig
    decoding: Decoding = Decoding()
    prompt_token_ids: list[TokenId] = Field(min_length=1)
    output_token_ids: list[TokenId] = Field(min_length=1)
    prompt_text: str | None = Field(default=None, max_length=1_000_000)
    #: A chat prompt's messages; `prompt_text` is then their rendering by the chat template.
    prompt_messages: list[ChatMessage] | None = Field(default=None, max_length=1000)
    output_text: str | None = Field(default=None, max_length=1_000_000)
    #: One piece per output token (its text, or its bytes), from a producer that had the
    #: tokenizer; byte lists that are valid text are stored as that text.
    output_token_pieces: Annotated[list[TokenPiece], AfterValidator(_canonical_pieces)] | None = (
        Field(default=None, max_length=MAX_TRACE_TOKENS)
    )
    top_k: TopK | None = None
    tags: list[Tag] = Field(default_factory=list, max_length=64)
    reference_answer: str | None = Field(default=None, max_length=100_000)

    @model_validator(mode="after")
    def _check(self) -> TraceCreate:
        vocab = self.model.vocab_size
        n_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)
        if n_tokens > MAX_TRACE_TOKENS:
            prompt_too_long = len(self.prompt_token_ids) > MAX_TRACE_TOKENS
            field = "prompt_token_ids" if prompt_too_long else "output_token_ids"
            raise TraceTooLarge(field, f"trace has {n_tokens} tokens; at most {MAX_TRACE_TOKENS}")
        for field in ("prompt_token_ids", "output_token_ids"):
            ids = getattr(self, field)
            # max() runs in C; find the offender only when there is one.
            if ids and max(ids) >= vocab:
                bad = next(t for t in ids if t >= vocab)
                raise TraceFieldError(field, f"token id {bad} is outside the vocabulary ({vocab})")
        if self.decoding.eos_token_ids and max(self.decoding.eos_token_ids) >= vocab:
            raise TraceFieldError("decoding.eos_token_ids", "eos id outside the vocabulary")
        if self.decoding.logits_processors is not None:
            _check_processors(self.decoding.logits_processors, vocab)
        if self.decoding.batch is not None:
            _check_batch(self.decoding.batch, len(self.prompt_token_ids), self.config.batch_size)
        if self.top_k is not None:
            _check_top_k(self.top_k, len(self.output_token_ids), vocab)
        pieces = self.output_token_pieces
        if pieces is not None and len(pieces) != len(self.output_token_ids):
            raise TraceFieldError(
                "output_token_pieces",
                f"has {len(pieces)} pieces; output has {len(self.output_token_ids)} tokens "
                "(one piece per output token)",
            )
        return self


def _check_batch(batch: BatchPlacement, prompt_length: int, batch_size: int | None) -> None:
    field = "decoding.batch"
    rows = len(batch.prompt_lengths)
    if batch.row >= rows:
        raise TraceFieldError(f"{field}.row", f"row {batch.row} of a batch of {rows} rows")
    if batch.prompt_lengths[batch.row] != prompt_length:
        raise TraceFieldError(
            f"{field}.prompt_lengths",
            f"row {batch.row}'s prompt length is {batch.prompt_lengths[batch.row]}, "
            f"this trace's prompt has {prompt_length} tokens",
        )
    if batch_size is not None and batch_size != rows:
        raise TraceFieldError(
            f"{field}.prompt_lengths", f"{rows} rows, but config.batch_size is {batch_size}"
        )


def _check_processors(spec: LogitsProcessorsSpec, vocab: int) -> None:
    field = "decoding.logits_processors"
    for key in spec.logit_bias or {}:
        if int(key) >= vocab:
            raise TraceFieldError(
                f"{field}.logit_bias", f"token id {key} is outside the vocabulary ({vocab})"
            )
    for i, seq in enumerate(spec.bad_words_ids or []):
        if max(seq) >= vocab:
            raise TraceFieldError(
                f"{field}.bad_words_ids[{i}]",
                f"token id {max(seq)} is outside the vocabulary ({vocab})",
            )


class TraceFieldError(ValueError):
    """A cross-field check that names the field it is about."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class TraceTooLarge(TraceFieldError):
    """The trace has more than MAX_TRACE_TOKENS tokens (the API answers 413)."""


def _check_top_k(top_k: TopK, n_steps: int, vocab: int) -> None:
    # Vectorised (numpy over the packed arrays): a Python loop per step cost more than the rest
    # of ingest together. Errors still name the field and the first offending step.
    for field, rows in (("ids", top_k.ids), ("logits", top_k.logits)):
        if len(rows) != n_steps:
            raise TraceFieldError(f"top_k.{field}", f"has {len(rows)} steps; output has {n_steps}")
    k = len(top_k.ids[0])
    if not 1 <= k <= MAX_TOP_K:
        raise TraceFieldError("top_k.ids", f"k must be between 1 and {MAX_TOP_K}, got {k}")
    ids, logits = top_k.packed.arrays()
    # One whole-array test each for the common (valid) case; rows are located only on failure.
    with np.errstate(invalid="ignore"):
        if (
            int(ids.max()) < vocab
            and bool(np.isfinite(logits).all())
            and not bool((logits[:, :-1] < logits[:, 1:]).any())
        ):
            return
    bad_id = np.flatnonzero((ids >= vocab).any(axis=1))
    if bad_id.size:
        raise TraceFieldError(f"top_k.ids[{int(bad_id[0])}]", "token id outside the vocabulary")
    bad_value = np.flatnonzero(~np.isfinite(logits).all(axis=1))
    if bad_value.size:
        raise TraceFieldError(
            f"top_k.logits[{int(bad_value[0])}]",
            "logits must be finite (no NaN or inf), also once converted to float32",
        )
    unsorted = np.flatnonzero((logits[:, :-1] < logits[:, 1:]).any(axis=1))
    if unsorted.size:
        raise TraceFieldError(
            f"top_k.logits[{int(unsorted[0])}]", "top-k logits must be sorted descending"
        )


class TraceRead(TraceCreate):
    id: str
    project: str
    config_id: str
    content_sha256: Sha256
    created_at: datetime

    def posted_json(self) -> str:
        """The trace as POST /v1/traces takes it (and `import` writes it): the read less
        `READ_ONLY_FIELDS`."""
        return self.model_dump_json(exclude=set(READ_ONLY_FIELDS))


#: What the API adds to a trace as posted, when it reads it back.
READ_ONLY_FIELDS: Final = frozenset(TraceRead.model_fields) - frozenset(TraceCreate.model_fields)


class TraceSummary(OutputModel):
    """One row of `GET /v1/traces`: no token arrays."""

    id: str
    external_id: str | None
    model: ModelRef
    config_id: str
    config: NumericalConfig
    n_prompt_tokens: int
    n_output_tokens: int
    tags: list[str]
    created_at: datetime


class IngestResult(OutputModel):
    """One item of a batch answer (and the body of a single POST)."""

    index: int | None = None
    status: int
    id: str | None = None
    created: bool | None = None
    #: The error body of a refused item (`api.errors.ErrorBody`).
    error: JsonObject | None = None


def _any_item(schema: JsonObject) -> None:
    schema["items"] = {
        "anyOf": [schema["items"], {}],
        "description": "a TraceCreate; an item that is not gets its own 4xx result",
    }


class TraceBatchCreate(TraceInput):
    """Body of `POST /v1/traces:batch`. Items are validated one by one: a bad item gets its own
    4xx result and the good ones are stored."""

    traces: list[TraceCreate] = Field(max_length=MAX_BATCH_TRACES, json_schema_extra=_any_item)


class TraceBatchResult(OutputModel):
    """Answer of `POST /v1/traces:batch` (HTTP 207): one result per item, in request order."""

    results: list[IngestResult]


class TracePage(OutputModel):
    """One page of `GET /v1/traces`, newest first; pass `next_cursor` back as `cursor`."""

    items: list[TraceSummary]
    next_cursor: str | None
