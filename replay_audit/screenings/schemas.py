"""Request and response bodies of `/v1/screenings`."""

from __future__ import annotations

import re
from typing import Annotated, Final, cast

from pydantic import ConfigDict, Field, field_validator, model_validator

from replay_audit.diff.margin import DEFAULT_TAU
from replay_audit.formats import COVER, DEFAULT_PAIR, MAX_NEW_TOKENS, BodyDType, Device
from replay_audit.input import InputModel, Lax, option_field
from replay_audit.output import JobRead, OutputModel
from replay_audit.queue.route import MAX_TP_DEGREE
from replay_audit.screenings.sweep.outputs import PromptRow
from replay_audit.screenings.sweep.plan import DEFAULT_TP_DEGREE, KnobName
from replay_audit.screenings.sweep.report import ScreeningReport

#: At most this many prompts per screening (every one is decoded in every run).
MAX_SCREENING_PROMPTS: Final = 256
_SHA256: Final = re.compile(r"^[0-9a-f]{64}$")


class ScreeningPrompt(InputModel):
    """A prompt: its text (encoded by the checkpoint's tokenizer on the worker) or its token
    ids; exactly one of the two (the document says so with oneOf)."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {
                    "required": ["prompt_token_ids"],
                    "properties": {"prompt_token_ids": {"type": "array"}},
                },
            ]
        }
    )

    id: str | None = Field(default=None, min_length=1, max_length=200)
    prompt: str | None = Field(default=None, min_length=1, max_length=100_000)
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, min_length=1, max_length=8192
    )

    @model_validator(mode="after")
    def _one(self) -> ScreeningPrompt:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt or prompt_token_ids")
        return self

    def row(self) -> PromptRow:
        """The prompt as the screening's backend reads it."""
        return cast(PromptRow, self.model_dump(exclude_none=True))


class ScreeningCreate(InputModel):
    """A screening of the checkpoint whose weights hash is `model_sha256` (found by a worker in
    its `REPLAY_AUDIT_MODEL_DIRS`), on `device`, over `prompts` (docs/screening.md)."""

    #: The checkpoint's weights hash; the API must find it in `REPLAY_AUDIT_MODEL_DIRS` (422).
    model_sha256: str = Field(json_schema_extra={"pattern": _SHA256.pattern})
    prompts: list[ScreeningPrompt] = Field(min_length=1, max_length=MAX_SCREENING_PROMPTS)
    knobs: list[KnobName] | None = Field(default=None, min_length=1)
    #: The one TP degree the `tp` knob screens (it runs where the worker owns that many GPUs).
    tp_degree: int = Field(default=DEFAULT_TP_DEGREE, ge=2, le=MAX_TP_DEGREE)
    max_new_tokens: int = option_field(MAX_NEW_TOKENS)
    device: Device | None = None
    reference_dtype: BodyDType | None = None
    pair: Annotated[tuple[BodyDType, BodyDType], Lax] = DEFAULT_PAIR
    tau: float = Field(default=DEFAULT_TAU, ge=0, allow_inf_nan=False)
    tau_ulps: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    cover: float = option_field(COVER)
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)

    @field_validator("model_sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        if not _SHA256.match(v):
            raise ValueError("must be 64 lower-case hex digits (`replay-audit hash-model DIR`)")
        return v

    @field_validator("pair")
    @classmethod
    def _pair(cls, v: tuple[BodyDType, BodyDType]) -> tuple[BodyDType, BodyDType]:
        if v[0] == v[1]:
            raise ValueError("name two different body dtypes")
        return v


class ScreeningCreated(OutputModel):
    id: str
    created: bool


class ScreeningRead(JobRead):
    report: ScreeningReport | None
