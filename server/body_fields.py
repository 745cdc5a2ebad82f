"""Typed reads of a JSON request body's fields, each failing with a 400 that names the field and what arrived.

Shared by the parameter checks of every endpoint (openai_params.py,
responses_params.py), so every endpoint words its errors the same way.
"""

from __future__ import annotations

import math

import orjson

from server.errors import ApiError


def get_field(body: dict, name: str, kind: type, expected: str, default: object, *, where: str = "") -> object:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ApiError(400, f"{where}{name} must be {expected}, got {describe_value(value)}", param=f"{where}{name}")
    return value


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


def describe_value(value: object) -> str:
    """`value` as JSON, cut to 60 characters; a value nested too deep to write says only what it is."""
    try:
        text = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode() if not isinstance(value, bytes) else repr(value)
    except (TypeError, RecursionError):  # orjson writes at most 254 levels; it reads up to 1024
        return f"a {type(value).__name__} nested too deep to show"
    return f"{text[:60]}{'...' if len(text) > 60 else ''}"
