"""CORS: which browser origins may call the API, and the Access-Control-* headers that say so.

Owns: the --allowed-origins / --allowed-methods / --allowed-headers /
--allow-credentials flags (vLLM's, each a JSON list), the CorsPolicy they make,
and Cors, which wraps the App as the HTTP server's handler and head check.
Off unless --allowed-origins is given (vLLM's default is every origin): a
server on a machine's loopback is then no target for a page a browser opens.
Must not know: routes, the API key itself, HTTP framing.
How (as Starlette's CORSMiddleware, which vLLM uses): a request without an
Origin header passes untouched. A preflight (OPTIONS with Origin and
Access-Control-Request-Method) is answered here, before the App and its API
key check, which a browser's preflight never carries: 200 with the
Access-Control-Allow-* headers when origin, method and headers are allowed,
else 400 with none. Any other request with an allowed Origin is served as
ever, and its response (errors included, even a 401 refused before its body
is read) carries Access-Control-Allow-Origin; from another origin it gets none,
so the browser keeps the response from the page.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from server.http.errors import ApiError
from server.http.server import HttpRequest, Responder

ANY = "*"
ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
SAFELISTED_HEADERS = ("Accept", "Accept-Language", "Content-Language", "Content-Type")  # always allowed
PREFLIGHT_MAX_AGE_S = "600"  # how long a browser may keep a preflight's answer, as Starlette's default

Handler = Callable[[HttpRequest, Responder], Awaitable[None]]
CheckHead = Callable[[str, str, dict[str, str]], ApiError | None]


@dataclass(slots=True, frozen=True)
class CorsPolicy:
    allowed_origins: tuple[str, ...]  # exact origins ("https://app.example"), or "*" for every one
    allowed_methods: tuple[str, ...] = (ANY,)
    allowed_headers: tuple[str, ...] = (ANY,)
    allow_credentials: bool = False  # cookies and Authorization from the page: the origin is echoed, never "*"

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(item, str) and item for item in value):
                raise ValueError(f"{name} must be a list of non-empty strings, got {value!r:.200}")

    def allows_origin(self, origin: str) -> bool:
        return ANY in self.allowed_origins or origin in self.allowed_origins

    def origin_headers(self, origin: str) -> dict[str, str]:
        """What every response to an allowed origin carries."""
        if ANY in self.allowed_origins and not self.allow_credentials:
            return {"Access-Control-Allow-Origin": ANY}
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.allow_credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers

    def preflight_headers(self, origin: str, method: str, requested_headers: str) -> dict[str, str] | None:
        """The answer's headers when the origin may send `method` with `requested_headers` (the comma-separated
        Access-Control-Request-Headers), else None."""
        requested = [name.strip() for name in requested_headers.split(",") if name.strip()]
        allowed_methods = ALL_METHODS if ANY in self.allowed_methods else tuple(m.upper() for m in self.allowed_methods)
        if not self.allows_origin(origin) or method.upper() not in allowed_methods:
            return None
        if ANY in self.allowed_headers:
            allowed_headers = ", ".join(requested) if requested else ", ".join(SAFELISTED_HEADERS)
        else:
            names = {h.lower() for h in (*self.allowed_headers, *SAFELISTED_HEADERS)}
            if any(name.lower() not in names for name in requested):
                return None
            allowed_headers = ", ".join(sorted({*self.allowed_headers, *SAFELISTED_HEADERS}))
        return {**self.origin_headers(origin), "Access-Control-Allow-Methods": ", ".join(allowed_methods),
                "Access-Control-Allow-Headers": allowed_headers, "Access-Control-Max-Age": PREFLIGHT_MAX_AGE_S}


def is_preflight(method: str, headers: dict[str, str]) -> bool:
    return method == "OPTIONS" and "origin" in headers and "access-control-request-method" in headers


class Cors:
    """The App behind a CorsPolicy: `handler` and `check_head` for http.serve()."""

    def __init__(self, handler: Handler, check_head: CheckHead, policy: CorsPolicy):
        self._handler = handler
        self._check_head = check_head
        self.policy = policy

    async def handler(self, request: HttpRequest, responder: Responder) -> None:
        origin = request.headers.get("origin")
        if origin is None:
            await self._handler(request, responder)
        elif is_preflight(request.method, request.headers):
            await self._preflight(origin, request, responder)
        else:
            if self.policy.allows_origin(origin):
                responder.common_headers.update(self.policy.origin_headers(origin))
            await self._handler(request, responder)

    def check_head(self, method: str, path: str, headers: dict[str, str]) -> ApiError | None:
        """The App's head check, but none for a preflight; a refusal to an allowed origin says it may read it."""
        if is_preflight(method, headers):
            return None
        error = self._check_head(method, path, headers)
        origin = headers.get("origin")
        if error is not None and origin is not None and self.policy.allows_origin(origin):
            error.headers.update(self.policy.origin_headers(origin))
        return error

    async def _preflight(self, origin: str, request: HttpRequest, responder: Responder) -> None:
        headers = self.policy.preflight_headers(origin, request.headers["access-control-request-method"],
                                                request.headers.get("access-control-request-headers", ""))
        if headers is None:
            await responder.send(400, b"Disallowed CORS origin, method or headers", content_type="text/plain")
        else:
            await responder.send(200, b"OK", content_type="text/plain", headers=headers)


# ----------------------------------------------------------------------------------------------- flags


def _json_list(text: str) -> tuple[str, ...]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r:.100}: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r:.100}")
    return tuple(value)


def add_cors_arguments(parser: argparse.ArgumentParser) -> None:
    cors = parser.add_argument_group("CORS (off unless --allowed-origins is given)")
    cors.add_argument("--allowed-origins", type=_json_list, default=None, metavar="JSON",
                      help='origins a browser page may call the API from, a JSON list: \'["https://app.example"]\', '
                           '\'["*"]\' for any (default: CORS off, no Access-Control-* headers; vLLM\'s is ["*"])')
    cors.add_argument("--allowed-methods", type=_json_list, default=None, metavar="JSON",
                      help='methods those origins may use, a JSON list (default: ["*"], every one)')
    cors.add_argument("--allowed-headers", type=_json_list, default=None, metavar="JSON",
                      help='request headers those origins may send, a JSON list (default: ["*"], any)')
    cors.add_argument("--allow-credentials", action="store_true",
                      help="let those origins send credentials (cookies, Authorization): the answer names the origin "
                           "instead of *")


def cors_policy_from_args(args: argparse.Namespace) -> CorsPolicy | None:
    """The policy the flags ask for; None without --allowed-origins (CORS off). ValueError for the other flags
    without it: they would change nothing."""
    if args.allowed_origins is None:
        given = [flag for flag, value in (("--allowed-methods", args.allowed_methods),
                                          ("--allowed-headers", args.allowed_headers),
                                          ("--allow-credentials", args.allow_credentials or None)) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} needs --allowed-origins: CORS is off without it")
        return None
    return CorsPolicy(args.allowed_origins, args.allowed_methods or (ANY,), args.allowed_headers or (ANY,),
                      args.allow_credentials)
