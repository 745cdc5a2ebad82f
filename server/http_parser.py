"""HTTP/1.1 request assembler, sans-I/O: bytes in, complete requests (or one terminal error) out.

Owns: the framing and limits of incoming requests — request line and header
size (431), number of header fields (431), body size by Content-Length before
reading and by counting for chunked bodies (413), the smuggling rules
(Content-Length with Transfer-Encoding, duplicate or invalid Content-Length,
a Transfer-Encoding other than chunked: 400), HTTP versions (505), and
keep-alive per HTTP/1.0 and 1.1.
Must not know: sockets, timers, asyncio, routes, JSON.
How: httptools (llhttp) tokenizes with every leniency off (its default; never
call set_dangerous_leniencies). Its callbacks fill in one request at a time;
a finished one becomes an HttpRequest event. Any parser error or limit breach
becomes one terminal RequestError: after it the assembler takes no more
bytes, and the connection answers it and closes.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass

import httptools

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
    CLOSED = "closed"  # terminal error, Connection: close or an upgrade: no more requests here


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
    """The request cannot be served: answer `status` with `message`, then close the connection."""

    status: int
    message: str


@dataclass(slots=True)
class ExpectContinue:
    """The client waits for `100 Continue` before it sends the body of the request in progress."""


Event = HttpRequest | RequestError | ExpectContinue


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

    def __init__(self, *, max_header_bytes: int, max_header_count: int, max_body_bytes: int):
        self._max_header_bytes = max_header_bytes
        self._max_header_count = max_header_count
        self._max_body_bytes = max_body_bytes
        self._parser = httptools.HttpRequestParser(self)
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
        """Take no more bytes (the caller answers with its own terminal error, e.g. a timeout)."""
        self.phase = Phase.CLOSED

    def _feed_piece(self, piece: memoryview) -> None:
        num_begun_before, was_idle = self.num_begun, self.phase is Phase.IDLE
        try:
            self._parser.feed_data(piece)
        except httptools.HttpParserUpgrade:
            self.phase = Phase.CLOSED  # the request before the upgrade is delivered; nothing after it is read
            return
        except httptools.HttpParserError as exc:
            if self._error is None:  # not a limit we raised in a callback: malformed input
                self._reject(400, f"expected a well-formed HTTP/1.1 request, got a parse error: {exc}")
            return
        num_new = self.num_begun - num_begun_before
        self._charge_raw_head(len(piece), whole=num_new == 0 or (num_new == 1 and was_idle))

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

    def _reject(self, status: int, message: str) -> None:
        if self.phase is Phase.CLOSED:
            return
        self._error = RequestError(status, message)
        self._events.append(self._error)
        self.phase = Phase.CLOSED

    def _stop(self, status: int, message: str) -> None:
        self._reject(status, message)
        raise _Rejected(message)

    def _start_message(self) -> None:
        self._url = bytearray()
        self._headers: dict[str, str] = {}
        self._num_headers = 0
        self._head_bytes = REQUEST_LINE_OVERHEAD
        self._body = bytearray()
        self._path = self._query = ""

    def _charge_head(self, num_bytes: int) -> None:
        self._head_bytes += num_bytes
        if self._head_bytes > self._max_header_bytes:
            self._stop(431, f"expected a request line and headers of at most {self._max_header_bytes} bytes, "
                            f"got at least {self._head_bytes}")

    # httptools callbacks, in the order it calls them.

    def on_message_begin(self) -> None:
        self.num_begun += 1
        self.phase = Phase.HEAD
        self._start_message()

    def on_url(self, url: bytes) -> None:
        self._charge_head(len(url))
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self._max_header_count:
            self._stop(431, f"expected at most {self._max_header_count} header fields, got more")
        self._charge_head(len(name) + len(value) + HEADER_LINE_OVERHEAD)
        if self.phase is Phase.BODY:
            return  # a trailer field of a chunked body: counted above, otherwise ignored
        key, text = name.decode("latin-1").lower(), value.decode("latin-1").strip(" \t")
        self._headers[key] = f"{self._headers[key]}, {text}" if key in self._headers else text

    def on_headers_complete(self) -> None:
        self.phase = Phase.BODY
        version = self._parser.get_http_version()
        if version not in SUPPORTED_VERSIONS:
            self._stop(505, f"expected HTTP/1.0 or HTTP/1.1, got HTTP/{version}")
        headers = self._headers
        if "content-length" in headers and "transfer-encoding" in headers:
            self._stop(400, "expected Content-Length or Transfer-Encoding, got both")
        try:
            self._path, self._query = _split_target(bytes(self._url))
            content_length = int(headers.get("content-length", "0"))  # llhttp already insists on digits
        except ValueError as exc:
            self._stop(400, str(exc))
        if content_length > self._max_body_bytes:
            self._stop(413, f"expected a body of at most {self._max_body_bytes} bytes, "
                            f"got Content-Length: {content_length}")
        if self._parser.should_upgrade() and (content_length or "transfer-encoding" in headers):
            self._stop(400, f"protocol upgrade is not supported, got Upgrade: {headers.get('upgrade', '')!r}")
        if headers.get("expect", "").lower() == "100-continue":
            self._events.append(ExpectContinue())

    def on_body(self, body: bytes) -> None:
        if len(self._body) + len(body) > self._max_body_bytes:
            self._stop(413, f"expected a body of at most {self._max_body_bytes} bytes, got more")
        self._body += body

    def on_message_complete(self) -> None:
        keep_alive = self._parser.should_keep_alive() and not self._parser.should_upgrade()
        self._events.append(HttpRequest(
            method=self._parser.get_method().decode("ascii"), path=self._path, query=self._query,
            headers=self._headers, body=bytes(self._body),
            request_id=request_id_from(self._headers.get("x-request-id")),
            http_version=self._parser.get_http_version(), keep_alive=keep_alive))
        self.phase = Phase.IDLE if keep_alive else Phase.CLOSED


def _split_target(url: bytes) -> tuple[str, str]:
    """Request target -> (path, query); origin form ("/a?b"), absolute form or "*"."""
    if url.startswith(b"/") or url == b"*":
        path, _, query = url.partition(b"?")
        return path.decode("latin-1"), query.decode("latin-1")
    try:
        parsed = httptools.parse_url(url)
    except httptools.HttpParserInvalidURLError:
        raise ValueError(f"expected a request target like /path?query, got {url[:64]!r}") from None
    return (parsed.path or b"/").decode("latin-1"), (parsed.query or b"").decode("latin-1")
