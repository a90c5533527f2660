"""What every request accepts, checked once for every field: `InputModel`, the base of every
request schema, and the checks the API applies to query and path parameters.

Storable text. PostgreSQL text cannot hold U+0000, and no UTF-8 text holds a lone surrogate
(U+D800..U+DFFF, which JSON's `\\ud800` escapes can spell): the database would answer a 500.
`InputModel` wraps every `str` validator of its subclasses' schemas, wherever it sits, with
`refuse_unstorable`, so a new field cannot forget the check; the API applies the same function
to query and path parameters (`api.deps`).

Strictness. Request models are strict (`strict=True`): a number is a JSON number, not `"3"`
or `true`; a logit a JSON number, not `"99.0"`. An integer field takes what JSON Schema calls
an integer (27, and 27.0, the same value: what JSON Schema calls an integer). The few
fields whose JSON form is a string of another type (times, enums given by value, pairs written
as arrays) relax strictness for themselves with `Lax`.

Times. `UtcDatetime` is a time converted to UTC at the edge (a time without a zone is UTC):
one whose UTC value is outside the years 1..9999 is a 422, not an overflow in the database.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Final

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    Strict,
)
from pydantic_core import core_schema

from replay_audit.formats import RunOption

#: Characters no database of ours can store in text: NUL and the UTF-16 surrogate halves.
_UNSTORABLE: Final = re.compile("[\x00\ud800-\udfff]")


class UnstorableText(ValueError):
    """A string holds a character the database cannot store."""


def find_unstorable(value: str) -> str | None:
    """The first character of `value` that cannot be stored, or None."""
    match = _UNSTORABLE.search(value)
    return match.group() if match else None


def refuse_unstorable(value: str) -> str:
    """`value` unchanged, or UnstorableText naming the character it cannot store."""
    bad = find_unstorable(value)
    if bad is not None:
        raise UnstorableText(
            f"must not contain U+{ord(bad):04X} (a database cannot store it in text)"
        )
    return value


def integral_float(value: Any) -> Any:
    """27.0 -> 27 (JSON Schema's integer is a value, not a spelling); anything else as is."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def _wrap(schema: Any) -> Any:
    # Schemas of nested models are their own classes' (already wrapped); serialization is
    # output, metadata is not a schema.
    if isinstance(schema, list):
        return [_wrap(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if schema.get("type") == "str":
        return core_schema.no_info_after_validator_function(refuse_unstorable, schema)
    if schema.get("type") == "int":
        return core_schema.no_info_before_validator_function(integral_float, schema)
    return {
        key: value if key in ("serialization", "metadata") else _wrap(value)
        for key, value in schema.items()
    }


class InputModel(BaseModel):
    """The base of every request schema: unknown fields refused, immutable, strict types, and
    every string checked with `refuse_unstorable` (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        schema: core_schema.CoreSchema = _wrap(handler(source))
        return schema


#: Relaxes strictness for one field whose JSON form is a string (or array) of another type:
#: `Annotated[Role, Lax]`. Values of the wrong JSON type are still refused where it matters.
Lax: Final = Strict(False)


_DATE_TIME: Final = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}")


def _string_or_time(value: Any) -> Any:
    # A time is an ISO 8601 date-time string; pydantic alone would also read a number (or a
    # numeric string, as every query value is) as seconds since 1970.
    if isinstance(value, datetime):
        return value
    if isinstance(value, str) and _DATE_TIME.match(value):
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            pass
    raise ValueError("must be an ISO 8601 date-time, e.g. 2024-05-01T00:00:00Z")


def _as_utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("is outside the representable range (years 1 to 9999) in UTC") from None


#: A time, converted to UTC (no zone means UTC); refused when UTC cannot represent it.
UtcDatetime = Annotated[datetime, Lax, BeforeValidator(_string_or_time), AfterValidator(_as_utc)]


def option_field(option: RunOption[Any], *, default: Any = ..., **kwargs: Any) -> Any:
    """The pydantic `Field` of a run option: its default (or `default`), bounds and help; a
    float option takes finite numbers only."""
    if isinstance(option.default, float):
        kwargs.setdefault("allow_inf_nan", False)
    default = option.default if default is ... else default
    return Field(
        default=default, ge=option.ge, le=option.le, gt=option.gt, description=option.help, **kwargs
    )
