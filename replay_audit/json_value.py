"""`JsonValue`: a value as JSON holds it, for the few places that carry arbitrary JSON (a
stored request, an environment's free-form extras, a logged response before it is parsed);
anything with a known shape gets a TypedDict, a dataclass or a pydantic model instead."""

from __future__ import annotations

from typing_extensions import TypeAliasType

#: A JSON value: what `json.loads` returns and `json.dumps` takes (pydantic validates it too).
JsonValue = TypeAliasType(
    "JsonValue",
    "str | int | float | bool | list[JsonValue] | dict[str, JsonValue] | None",
)
#: A JSON object.
JsonObject = dict[str, JsonValue]


# Narrowing at a read site: the value as the type the reader needs, or TypeError naming it.


def as_object(value: JsonValue) -> JsonObject:
    if not isinstance(value, dict):
        raise TypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def as_list(value: JsonValue) -> list[JsonValue]:
    if not isinstance(value, list):
        raise TypeError(f"expected a JSON array, got {type(value).__name__}")
    return value


def as_str(value: JsonValue) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a JSON string, got {type(value).__name__}")
    return value


def as_int(value: JsonValue) -> int:
    """An integer (a float with an integral value too, as JSON does not tell them apart)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise TypeError(f"expected a JSON integer, got {value!r}")


def as_float(value: JsonValue) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"expected a JSON number, got {value!r}")


def as_optional_float(value: JsonValue) -> float | None:
    return None if value is None else as_float(value)
