"""What an import takes besides the logged responses, and what it answers.

A response from vLLM, SGLang or transformers carries the token ids and (when asked for) the
per-step top-k logprobs, but not the numerical configuration it ran in, and not the model's
weights hash. `ImportContext` is that missing part, given once for a whole import: by the CLI's
`--config key=value` flags and `--config-file`, by the `context` of `POST /v1/traces:import`, or
by the Python client. What is not given is recorded as unknown in the trace
(`config.extras["unknown"]`), never filled with a guess.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import ConfigDict, Field

from replay_audit.config import MAX_BATCH_TRACES
from replay_audit.formats import BodyDType, HeadDType, LoggedDevice, Strategy, WeightDType
from replay_audit.input import InputModel
from replay_audit.traces.schemas import (
    MAX_EXTRAS,
    AttnKernelName,
    BatchSize,
    ComputeCapability,
    ExtraKey,
    ExtraValue,
    IngestResult,
    LogitsProcessorsSpec,
    Name,
    Sha256,
    Tag,
    TokenId,
    TpDegree,
    Version,
)

#: What the numbers a server returns as "logprobs" are (vLLM's `--logprobs-mode` names):
#: `raw_logprobs` log_softmax of the model's logits (vLLM's default), `raw_logits` the logits
#: themselves, `processed_*` the same after the sampler's processing (temperature, penalties,
#: bias, top-k/top-p masks). Only the raw ones give the logged arm's margins.
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]

#: The `config.extras` keys an import writes (a user's own extras keep any other key).
EXTRA_FORMAT: Final = "import_format"
EXTRA_LOGPROBS_MODE: Final = "logprobs_mode"
EXTRA_UNKNOWN: Final = "unknown"
EXTRA_TOKENIZATION: Final = "tokenization"
#: The prompts one request handed a server that batches dynamically (an SGLang list request,
#: lm-eval's `batch_size` on vLLM): not the batch that ran, which stays unknown.
EXTRA_REQUEST_BATCH: Final = "request_batch"
#: Keys of `config.extras` kept for the import's own: its provenance (`EXTRA_*`,
#: `formats.EXTRA_TOP_K_VALUES` & co., 8), a source's facts (lm-eval's tokenization, chat
#: template, filters, 4 seeds, request batch: 8) and a request's recipe (lm-eval's `until` and
#: `do_sample`, then `openai_compat.RECIPE_FIELDS`: 14); tests/imports check a full one fits.
IMPORT_EXTRAS: Final = 30
#: The value of a configuration field nobody gave (strings), and of `logprobs_mode`.
UNKNOWN: Final = "unknown"


class _Input(InputModel):
    """Request schemas of the import: every string checked as every request's (`InputModel`)."""

    # Import contexts are written by hand (YAML/JSON files, CLI flags): lax types, as
    # `InputModel` subclasses that are not traces allow.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class ModelInput(_Input):
    """The model reference, as far as it is known (the CLI's `--model DIR` fills it)."""

    name: Name | None = None
    revision: str | None = Field(default=None, max_length=200)
    weights_sha256: Sha256 | None = None
    vocab_size: int | None = Field(default=None, ge=2, le=2**31 - 1)
    #: The name where neither `name` nor the logged response gives one (the CLI: the
    #: checkpoint directory's): a served model name (`gpt-4o-mini-2024-07-18`) is kept.
    default_name: Name | None = None


class GpuInput(_Input):
    name: Name
    sm: ComputeCapability


class EngineInput(_Input):
    name: Name | None = None
    version: Version | None = None


class ProcessorsInput(LogitsProcessorsSpec):
    """`decoding.logits_processors` of an import context: the trace's fields, lax types (a
    `--config` flag's value is text)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class DecodingInput(_Input):
    """How the generations were decoded, where the responses do not say it (a response never
    carries its request's sampling parameters; an item's `request`, when given, does)."""

    strategy: Strategy | None = None
    max_new_tokens: int | None = Field(default=None, ge=1)
    eos_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    #: A server's defaults every request ran with (vLLM's `repetition_penalty` from the model's
    #: generation_config.json); a request's own values win.
    logits_processors: ProcessorsInput | None = None


class ImportContext(_Input):
    """Everything an import needs that the logged responses do not carry. None = not known."""

    model: ModelInput = ModelInput()
    dtype: BodyDType | None = None
    lm_head_dtype: HeadDType | None = None
    weight_dtype: WeightDType | None = None
    device: LoggedDevice | None = None
    gpu: GpuInput | None = None
    attn_kernel: AttnKernelName | None = None
    batch_size: BatchSize | None = None
    tp_degree: TpDegree | None = None
    engine: EngineInput = EngineInput()
    torch_version: Version | None = None
    cuda_version: Version | None = None
    cublas_version: Version | None = None
    deterministic: bool | None = None
    tf32: bool | None = None
    #: Fewer than a trace's: the import adds its own (`EXTRA_*`).
    extras: dict[ExtraKey, ExtraValue] = Field(
        default_factory=dict, max_length=MAX_EXTRAS - IMPORT_EXTRAS
    )
    #: The server's `--logprobs-mode` (vLLM) or its equivalent; None = unknown, and then the
    #: logged logprobs give no margin.
    logprobs_mode: LogprobsMode | None = None
    decoding: DecodingInput = DecodingInput()
    tags: list[Tag] = Field(default_factory=list, max_length=32)


class KnownModel(ModelInput):
    """The model reference of an HTTP import: no response carries the weights hash or the
    vocabulary size, so the request gives them."""

    weights_sha256: Sha256
    vocab_size: int = Field(ge=2, le=2**31 - 1)


class KnownContext(ImportContext):
    """The context of an HTTP import: what every trace needs and no response carries (the
    dtype, the weights hash, the vocabulary size) is required, so the OpenAPI document says
    so (the CLI's context may fill them from `--model DIR` and `--config`)."""

    model: KnownModel
    dtype: BodyDType


class ImportRequest(_Input):
    """Body of `POST /v1/traces:import?format=...`: the context, then the raw logged items
    (each a response as the server returned it, or `{"request": ..., "response": ...}`)."""

    context: KnownContext
    items: list[Any] = Field(max_length=MAX_BATCH_TRACES)


class ImportResult(IngestResult):
    """One trace of an import (or one item that gave none): `index` is the item's position,
    `choice` the trace's within the item (a response with n > 1 choices gives several)."""

    choice: int | None = None
    #: What the import could not keep of the item's logged evidence (its top-k), and why.
    warning: str | None = None


class ImportBatchResult(_Input):
    """Answer of `POST /v1/traces:import` (HTTP 207): the items' results in request order."""

    results: list[ImportResult]
