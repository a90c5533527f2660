"""Reading untyped JSON (a server's response as it came) with errors that name the field.

Each reader takes the value and its path (`choices[0].logprobs.content[3]`) and returns it
typed, or raises FieldError naming the path: bad input is a 422 or a CLI error, never a
KeyError or TypeError from deep inside a parser.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeVar

from replay_audit.exceptions import FieldError

T = TypeVar("T")

#: Token strings of vLLM's `return_tokens_as_token_ids`: "token_id:{id}".
TOKEN_ID_PREFIX: Final = "token_id:"
_INT32: Final = 2**31


def fail(path: str, message: str) -> FieldError:
    return FieldError(f"{path}: {message}", field=path)


def obj(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise fail(path, f"expected an object, got {_kind(value)}")
    return value


def seq(value: Any, path: str) -> Sequence[Any]:
    if not isinstance(value, list | tuple):
        raise fail(path, f"expected a list, got {_kind(value)}")
    return value


def token_id(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _INT32:
        raise fail(path, f"expected a token id (an integer in [0, 2**31)), got {value!r}")
    return value


def token_ids(value: Any, path: str) -> list[int]:
    return [token_id(v, f"{path}[{i}]") for i, v in enumerate(seq(value, path))]


def number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise fail(path, f"expected a number, got {_kind(value)}")
    x = float(value)
    if math.isnan(x) or x == math.inf:
        raise fail(path, f"expected a finite logprob, got {value!r}")
    return x


def opt_str(value: Any, path: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise fail(path, f"expected a string, got {_kind(value)}")
    return value


def opt_int(value: Any, path: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(path, f"expected an integer, got {_kind(value)}")
    return value


def parse_token_id_string(token: Any) -> int | None:
    """The id in vLLM's "token_id:{id}" token string; None for any other token string."""
    if not isinstance(token, str) or not token.startswith(TOKEN_ID_PREFIX):
        return None
    digits = token[len(TOKEN_ID_PREFIX) :]
    if not digits.isdigit() or not digits.isascii() or int(digits) >= _INT32:
        return None
    return int(digits)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int | float):
        return "a number"
    return type(value).__name__
