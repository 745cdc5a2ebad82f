"""Typed reads of a JSON request body's fields, each failing with a 400 that names the field and what arrived.

Shared by the parameter checks of every endpoint (api/completions/params.py,
api/responses/params.py), so every endpoint words its errors the same way.
"""

from __future__ import annotations

import math
from typing import TypeVar, overload

from server.http.errors import ApiError, describe_value

T = TypeVar("T")
D = TypeVar("D")


def get_field(body: dict, name: str, kind: type[T], expected: str, default: D, *, where: str = "") -> T | D:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ApiError(400, f"{where}{name} must be {expected}, got {describe_value(value)}", param=f"{where}{name}")
    return value


@overload
def get_int(body: dict, name: str, *, minimum: int | None = None, maximum: int | None = None, default: int) -> int: ...


@overload
def get_int(body: dict, name: str, *, minimum: int | None = None, maximum: int | None = None,
            default: None = None) -> int | None: ...


def get_int(body: dict, name: str, *, minimum: int | None = None, maximum: int | None = None,
            default: int | None = None) -> int | None:
    value = get_field(body, name, int, "an integer", None)
    if value is None:
        return default
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "" if minimum is None else f" >= {minimum}"
        high = "" if maximum is None else f"{' and' if low else ''} <= {maximum}"
        raise ApiError(400, f"{name} must be an integer{low}{high}, got {value}", param=name)
    return value


def get_number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is not None and not is_number(value):
        raise ApiError(400, f"{name} must be a number, got {describe_value(value)}", param=name)
    return value


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
