"""HTTP/1.1 request assembler, sans-I/O: bytes in, complete requests (or one terminal error) out.

Owns: the framing and limits of incoming requests — request line and header
size (431), number of header fields (431), body size by Content-Length before
reading and by counting for chunked bodies (413), charging arriving body bytes
to the BodyBudget all connections share (503), the smuggling rules
(Content-Length with Transfer-Encoding, duplicate or invalid Content-Length,
chunked not the final transfer coding: 400; another coding before chunked:
501, RFC 9112 §6.1 and §6.3), exactly one Host in HTTP/1.1 (400, §3.2),
CONNECT (501), HTTP versions (505), Expect: 100-continue, and keep-alive per
HTTP/1.0 and 1.1.
Must not know: sockets, timers, asyncio, routes, JSON.
How: httptools (llhttp) tokenizes with every leniency off (its default; never
call set_dangerous_leniencies). Its callbacks fill in one request at a time;
a finished one becomes an HttpRequest event. Any parser error or limit breach
becomes one terminal RequestError: after it the assembler takes no more
bytes, and the connection answers it and closes. The caller's head check runs
once a head is complete, before 100 Continue is asked for and before a byte
of the body is read; its refusal is terminal too, so a refused body is never
buffered.

The body budget (server.http.body_budget): a head reserves nothing; each body
byte is charged as it arrives, so a request that waits for 100 Continue holds
nothing until its body comes. A delivered request's charge (len(body)) goes
with it to the connection, which releases it; a request cut short releases
its own.

Upgrade: a request with Connection: upgrade is served as plain HTTP/1.1 and
the connection goes on (RFC 9110 §7.8 lets a server ignore Upgrade; no 101 is
ever sent, so no proxy in front starts tunnelling). httptools makes llhttp
skip the body of such a request and stop right after its head; parsing on
from there would read the body as the next request (smuggling). So a fresh
parser takes over, primed with a head of the same framing (Content-Length or
chunked), and reads the body as a body.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import httptools

from server.http.body_budget import BodyBudget, BodyCharge
from server.http.errors import RETRY_AFTER_S, clip

MAX_REQUEST_ID_CHARS = 128
# Bytes a header line costs beyond its name and value (": " and CRLF); the
# request line is charged its method, URL and this much for the version.
HEADER_LINE_OVERHEAD = 4
REQUEST_LINE_OVERHEAD = 12
SUPPORTED_VERSIONS = ("1.0", "1.1")


class Phase(enum.Enum):
    IDLE = "idle"  # between requests: no byte of the next one yet
    HEAD = "head"  # the request line and headers are arriving
    BODY = "body"  # the body is arriving
    CLOSED = "closed"  # terminal error or Connection: close: no more requests here


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str  # as sent, not percent-decoded
    query: str  # after "?", "" when none
    headers: dict[str, str]  # lower-case names; repeated fields joined with ", "
    body: bytes
    request_id: str  # the client's X-Request-Id when usable, else a fresh one
    http_version: str = "1.1"
    keep_alive: bool = True


@dataclass(slots=True)
class RequestError:
    """The request cannot be served: answer `status` with `message` (and `headers`), then close the connection."""

    status: int
    message: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class ExpectContinue:
    """The client waits for `100 Continue` before it sends the body of the request in progress."""


Event = HttpRequest | RequestError | ExpectContinue
# (method, path, headers) of a complete head -> the refusal to answer before its body is read, or None
HeadCheck = Callable[[str, str, dict[str, str]], RequestError | None]


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_id_from(header: str | None) -> str:
    """The client's X-Request-Id if it is 1..128 visible ASCII characters, else a fresh id."""
    if header and len(header) <= MAX_REQUEST_ID_CHARS and all("!" <= c <= "~" for c in header):
        return header
    return new_request_id()


class _Rejected(Exception):
    """Raised inside a parser callback to stop parsing; the RequestError is already recorded."""


class RequestAssembler:
    """Feed it the bytes of one connection; it returns the events those bytes complete, in order."""

    def __init__(self, *, max_header_bytes: int, max_header_count: int, max_body_bytes: int,
                 body_budget: BodyBudget, check_head: HeadCheck):
        self._max_header_bytes = max_header_bytes
        self._max_header_count = max_header_count
        self._max_body_bytes = max_body_bytes
        self._charge = BodyCharge(body_budget)
        self._check_head = check_head
        self._parser = httptools.HttpRequestParser(self)
        self._is_priming = False  # feeding a fresh parser the stand-in head of a body after an Upgrade
        self._events: list[Event] = []
        self._error: RequestError | None = None
        self.phase = Phase.IDLE
        self.num_begun = 0  # requests begun so far; a new value means a new request (and a new deadline)
        self._head_raw_bytes = 0
        self._start_message()

    def feed(self, data: bytes) -> list[Event]:
        """Parse `data`; return the requests (and at most one terminal RequestError) it completes."""
        view = memoryview(data)
        # Pieces no longer than the header limit bound what llhttp and httptools
        # buffer for a header that never ends (see _charge_raw_head).
        for start in range(0, len(view), self._max_header_bytes):
            if self.phase is Phase.CLOSED:
                break
            self._feed_piece(view[start:start + self._max_header_bytes])
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        """Take no more bytes (the caller answers with its own terminal error, or the client left)."""
        self.phase = Phase.CLOSED
        self._drop_body()

    def _feed_piece(self, piece: memoryview) -> None:
        num_begun_before, was_idle = self.num_begun, self.phase is Phase.IDLE
        try:
            self._parse(piece)
        except httptools.HttpParserError as exc:
            if self._error is None:  # not a limit we raised in a callback: malformed input
                self._reject(400, f"expected a well-formed HTTP/1.1 request, got a parse error: {exc}")
            return
        num_new = self.num_begun - num_begun_before
        self._charge_raw_head(len(piece), whole=num_new == 0 or (num_new == 1 and was_idle))

    def _parse(self, data: memoryview) -> None:
        while self.phase is not Phase.CLOSED:
            try:
                self._parser.feed_data(data)
                return
            except httptools.HttpParserUpgrade as upgrade:
                data = data[upgrade.args[0]:]  # what follows the head or the request that asked for it
                self._resume_after_upgrade()

    def _resume_after_upgrade(self) -> None:
        """Go on as HTTP/1.1 with a fresh parser; primed to read the body llhttp skipped, if one is due."""
        self._parser = httptools.HttpRequestParser(self)
        if self._upgrade_head is not None:
            self._is_priming = True
            try:
                self._parser.feed_data(self._upgrade_head)
            finally:
                self._is_priming = False
            self._upgrade_head = None

    def _charge_raw_head(self, num_bytes: int, whole: bool) -> None:
        # Callbacks count the bytes that matter (URL, names, values), but httptools
        # joins a header value across pieces before reporting it, and whitespace is
        # never reported. So the raw bytes fed while a head is open are bounded too.
        # A piece that ended an earlier request and began this one is not charged
        # (where this head starts in it is unknown): at most one piece is missed, so
        # an open head never holds more than twice the limit in memory.
        if self.phase is not Phase.HEAD:
            self._head_raw_bytes = 0
            return
        self._head_raw_bytes = self._head_raw_bytes + num_bytes if whole else 0
        if self._head_raw_bytes > self._max_header_bytes:
            self._reject(431, f"expected a request line and headers of at most {self._max_header_bytes} bytes, "
                              f"got at least {self._head_raw_bytes}")

    def _reject(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        if self.phase is Phase.CLOSED:
            return
        self._error = RequestError(status, message, headers or {})
        self._events.append(self._error)
        self.close()

    def _stop(self, status: int, message: str, headers: dict[str, str] | None = None) -> NoReturn:
        self._reject(status, message, headers)
        raise _Rejected(message)

    def _drop_body(self) -> None:
        """Free the body in progress and its charge."""
        self._charge.drop()
        self._body = bytearray()

    def _start_message(self) -> None:
        self._url = bytearray()
        self._headers: dict[str, str] = {}
        self._num_headers = 0
        self._head_bytes = REQUEST_LINE_OVERHEAD
        self._body = bytearray()
        self._path = self._query = ""
        self._method, self._http_version, self._keep_alive = "", "", True
        self._upgrade_head: bytes | None = None  # the stand-in head for a body llhttp skips after an Upgrade

    def _charge_head(self, num_bytes: int) -> None:
        self._head_bytes += num_bytes
        if self._head_bytes > self._max_header_bytes:
            self._stop(431, f"expected a request line and headers of at most {self._max_header_bytes} bytes, "
                            f"got at least {self._head_bytes}")

    def _check_framing(self) -> int:
        """The Content-Length (0 if none) once version, framing, Host and target are sound; else stop."""
        headers, version = self._headers, self._http_version
        if version not in SUPPORTED_VERSIONS:
            self._stop(505, f"expected HTTP/1.0 or HTTP/1.1, got HTTP/{version}")
        if "content-length" in headers and "transfer-encoding" in headers:
            self._stop(400, "expected Content-Length or Transfer-Encoding, got both")
        if "transfer-encoding" in headers:
            self._check_transfer_coding(headers["transfer-encoding"])
        host = headers.get("host")
        if host is None and version == "1.1":
            self._stop(400, "expected a Host header in an HTTP/1.1 request, got none")
        if host is not None and "," in host:
            self._stop(400, f"expected one Host header, got Host: {clip(host)!r}")
        if self._method == "CONNECT":
            self._stop(501, "expected a request for this server, got CONNECT: it is not a proxy")
        try:
            self._path, self._query = _split_target(bytes(self._url))
            return int(headers.get("content-length", "0"))  # llhttp already insists on digits
        except ValueError as exc:
            self._stop(400, str(exc))

    def _check_transfer_coding(self, value: str) -> None:
        codings = [coding.strip().lower() for coding in value.split(",")]
        if codings[-1] != "chunked":  # the body's length cannot be known
            self._stop(400, f"expected chunked as the last Transfer-Encoding, got {clip(value)!r}")
        if len(codings) > 1:
            self._stop(501, f"expected Transfer-Encoding: chunked alone, got {clip(value)!r}; no other "
                            "transfer coding is implemented")

    def _check_body(self, content_length: int) -> None:
        """The caller's head check, then the announced body's size: all before a byte of it is read.

        Nothing is charged to the budget here: the body's bytes are, as they arrive (on_body).
        """
        refusal = self._check_head(self._method, self._path, self._headers)
        if refusal is not None:
            self._stop(refusal.status, refusal.message, refusal.headers)
        if content_length > self._max_body_bytes:
            self._stop(413, f"expected a body of at most {self._max_body_bytes} bytes, "
                            f"got Content-Length: {content_length}")

    # httptools callbacks, in the order it calls them. While priming, the head
    # callbacks see the stand-in head and ignore it.

    def on_message_begin(self) -> None:
        if self._is_priming:
            return
        self.num_begun += 1
        self.phase = Phase.HEAD
        self._start_message()

    def on_url(self, url: bytes) -> None:
        if self._is_priming:
            return
        self._charge_head(len(url))
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._is_priming:
            return
        self._num_headers += 1
        if self._num_headers > self._max_header_count:
            self._stop(431, f"expected at most {self._max_header_count} header fields, got more")
        self._charge_head(len(name) + len(value) + HEADER_LINE_OVERHEAD)
        if self.phase is Phase.BODY:
            return  # a trailer field of a chunked body: counted above, otherwise ignored
        key, text = name.decode("latin-1").lower(), value.decode("latin-1").strip(" \t")
        self._headers[key] = f"{self._headers[key]}, {text}" if key in self._headers else text

    def on_headers_complete(self) -> None:
        if self._is_priming:
            return
        self.phase = Phase.BODY
        parser = self._parser
        self._method, self._http_version = parser.get_method().decode("ascii"), parser.get_http_version()
        self._keep_alive = parser.should_keep_alive()
        content_length = self._check_framing()
        self._check_body(content_length)
        is_chunked = "transfer-encoding" in self._headers
        if parser.should_upgrade() and (content_length or is_chunked):
            framing = b"Transfer-Encoding: chunked" if is_chunked else b"Content-Length: %d" % content_length
            self._upgrade_head = b"POST / HTTP/1.1\r\n" + framing + b"\r\n\r\n"
        if self._headers.get("expect", "").lower() == "100-continue" and self._http_version == "1.1":
            self._events.append(ExpectContinue())  # HTTP/1.0 knows no 100 (RFC 9110 §10.1.1)

    def on_body(self, body: bytes) -> None:
        num_bytes = len(self._body) + len(body)
        if num_bytes > self._max_body_bytes:
            self._stop(413, f"expected a body of at most {self._max_body_bytes} bytes, got more")
        if not self._charge.add(len(body)):
            budget = self._charge.budget
            self._stop(503, f"the server holds {budget.num_bytes} bytes of request bodies, at most "
                            f"{budget.max_bytes}; {len(body)} more do not fit now, retry shortly",
                       {"Retry-After": RETRY_AFTER_S})
        self._body += body

    def on_message_complete(self) -> None:
        if self._upgrade_head is not None:
            return  # llhttp skipped the body of an Upgrade request: the primed parser reads it
        body = bytes(self._body)
        self._body = bytearray()  # freed now, not when the next request begins
        self._charge.hand_over()  # the connection releases len(body) once it is done with the request
        self._events.append(HttpRequest(
            method=self._method, path=self._path, query=self._query, headers=self._headers, body=body,
            request_id=request_id_from(self._headers.get("x-request-id")), http_version=self._http_version,
            keep_alive=self._keep_alive))
        self.phase = Phase.IDLE if self._keep_alive else Phase.CLOSED


def _split_target(url: bytes) -> tuple[str, str]:
    """Request target -> (path, query); origin form ("/a?b"), absolute form or "*"."""
    if url.startswith(b"/") or url == b"*":
        path, _, query = url.partition(b"?")
        return path.decode("latin-1"), query.decode("latin-1")
    try:
        parsed = httptools.parse_url(url)
    except httptools.HttpParserInvalidURLError:
        raise ValueError(f"expected a request target like /path?query, got {clip(repr(url))}") from None
    return (parsed.path or b"/").decode("latin-1"), (parsed.query or b"").decode("latin-1")
