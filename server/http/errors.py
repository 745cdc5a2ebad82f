"""The OpenAI error schema, in one place: `{"error": {"message", "type", "param", "code"}}`.

Owns: the error body every endpoint and the HTTP layer itself send, and
ApiError, which a handler raises and the HTTP layer renders.
Must not know: HTTP framing, routes, the engine.
"""

from __future__ import annotations

import orjson

# OpenAI's `type` for each status; the SDK keys its exception classes on the
# status, so the type is for humans and for clients that branch on it.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
    505: "invalid_request_error",
}


RETRY_AFTER_S = "1"  # the Retry-After of every 429 and 503: a client tries again a second later
MAX_ECHOED_CHARS = 100  # of a client's own text quoted back in an error message


def clip(text: str, limit: int = MAX_ECHOED_CHARS) -> str:
    """`text` cut to `limit` characters (with "..." when cut): client input quoted in a message stays small."""
    return text if len(text) <= limit else f"{text[:limit]}..."


def error_type_for(status: int) -> str:
    """The OpenAI error `type` for an HTTP status (4xx default: invalid_request_error, 5xx: server_error)."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def error_dict(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> bytes:
    """The JSON body of an error response."""
    return orjson.dumps(error_dict(message, type, param, code))


class ApiError(Exception):
    """An error a handler raises to answer with `status` and the OpenAI error body.

    `headers` go on the response as well (e.g. {"Retry-After": RETRY_AFTER_S} with a 429 or 503).
    """

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        if not 400 <= status <= 599:
            raise ValueError(f"ApiError status must be a 4xx or 5xx code, got {status!r}")
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type if type is not None else error_type_for(status)
        self.param = param
        self.code = code
        self.headers = dict(headers) if headers else {}

    def to_dict(self) -> dict:
        return error_dict(self.message, self.type, self.param, self.code)

    def body(self) -> bytes:
        return orjson.dumps(self.to_dict())

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, type={self.type!r}, param={self.param!r})"


def describe_value(value: object) -> str:
    """`value` as JSON, cut to 60 characters; a value nested too deep to write says only what it is."""
    try:
        text = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode() if not isinstance(value, bytes) else repr(value)
    except (TypeError, RecursionError):  # orjson writes at most 254 levels; it reads up to 1024
        return f"a {type(value).__name__} nested too deep to show"
    return f"{text[:60]}{'...' if len(text) > 60 else ''}"
