"""What every request accepts, checked once for every field: `InputModel`, the base of every
request schema, and the checks the API applies to query and path parameters.

Storable text. PostgreSQL text cannot hold U+0000, and no UTF-8 text (PostgreSQL's, SQLite's)
holds a lone surrogate (U+D800..U+DFFF, which JSON's `\\ud800` escapes can spell). A request
carrying one used to reach the database and fail there with a 500. `InputModel` wraps every
`str` validator of its subclasses' schemas (dict keys, list items, unions, constrained strings:
whatever the annotation) with `refuse_unstorable`, so a new field cannot forget the check; the
API applies the same function to query and path parameters (`api.deps`).

Strictness. Request models are strict (`strict=True`): a token id must be a JSON integer, not
`true`, `"3"` or `3.0`; a logit a JSON number, not `"99.0"`. What was stored reads back exactly
as sent. The few fields whose JSON form is a string of another type (times, enums given by
value, pairs written as arrays) relax it for themselves with `Lax`.

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
    GetCoreSchemaHandler,
    Strict,
)
from pydantic_core import core_schema

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


def _check_strings(schema: Any) -> Any:
    # Every `str` validator in the schema, wherever it sits, gets the check after it. Schemas
    # of nested models are their own classes' (already checked); serialization is output.
    if isinstance(schema, list):
        return [_check_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if schema.get("type") == "str":
        return core_schema.no_info_after_validator_function(refuse_unstorable, schema)
    return {
        key: value if key in ("serialization", "metadata") else _check_strings(value)
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
        schema: core_schema.CoreSchema = _check_strings(handler(source))
        return schema


#: Relaxes strictness for one field whose JSON form is a string (or array) of another type:
#: `Annotated[Role, Lax]`. Values of the wrong JSON type are still refused where it matters.
Lax: Final = Strict(False)


def _string_or_time(value: Any) -> Any:
    # A time is a JSON string (ISO 8601); a number would be read as seconds since 1970.
    if isinstance(value, str | datetime):
        return value
    raise ValueError("must be an ISO 8601 date-time string")


def _as_utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("is outside the representable range (years 1 to 9999) in UTC") from None


#: A time, converted to UTC (no zone means UTC); refused when UTC cannot represent it.
UtcDatetime = Annotated[
    datetime, Lax, BeforeValidator(_string_or_time), AfterValidator(_as_utc)
]
