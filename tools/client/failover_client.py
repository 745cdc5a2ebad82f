"""FailoverClient: one OpenAI API call, tried on several pagedserve replicas in turn until one answers.

For programs that talk to a fleet of replicas with no load balancer in front
(or one that passes a replica's failures through). Standard library only (with
failover_stream.py and sse_parser.py beside it): importing it loads neither
torch nor the server.

    client = FailoverClient(["http://10.0.0.1:8000", "http://10.0.0.2:8000"], api_key="KEY")
    reply = client.post("/v1/completions", {"model": "m", "prompt": "ROMEO:", "max_tokens": 16})
    print(reply["choices"][0]["text"])

    for event in client.stream("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}):
        print(event["choices"][0]["delta"].get("content", ""), end="", flush=True)

    for event in client.stream("/v1/responses", {"model": "m", "input": "Hi"}):
        print(event.get("delta", ""), end="", flush=True)  # the last event: response.completed (or .incomplete)

Owns: which replica each attempt goes to, what is retried, the back-off and
the errors a caller sees. Must not know: how a replica works inside.
How: each call starts at the next replica in a rotation and moves on to the
following one after a failed attempt: a connection error (refused, reset,
timed out), a 5xx or a 429. Before each retry it sleeps a jittered
exponential back-off, and never asks a replica again before the Retry-After
it sent has passed (capped at retry_after_max). Any other status is the
request's fault: RequestRejected at once, with the replica's OpenAI error.
A call whose every attempt failed raises AllAttemptsFailed, listing them.
A stream may have either shape a replica sends (chat and completions chunks
up to data: [DONE], or the Responses API's events up to response.completed,
.incomplete or .failed; failover_stream.py reads them). The events
before the first one carrying output (the chat role chunk, response.created
...) are held back, so a stream that breaks before any output is retried as
a whole; once output has been delivered it is never retried: a break raises
StreamInterrupted and an error event raises StreamFailed. An error event
before any output is retried unless it says the request is at fault.
"""

from __future__ import annotations

import email.utils
import http.client
import itertools
import json
import math
import random
import time
import urllib.parse
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import overload

from tools.client.failover_stream import ErrorEvent, StreamEvent, StreamReader

READ_SIZE = 65536
_CONNECTION_ERRORS = (OSError, http.client.HTTPException)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try of a call on one replica, for the attempt log."""

    url: str  # the replica's base URL
    outcome: str  # what happened, e.g. "connection refused" or "HTTP 503: no engine worker is ready"
    seconds: float  # how long the attempt took
    status: int | None = None  # None: no HTTP status arrived
    retry_after: float | None = None  # what the replica's Retry-After asked for, in seconds, before the cap

    def __str__(self) -> str:
        wait = "" if self.retry_after is None else f", Retry-After {self.retry_after:g} s"
        return f"{self.url}: {self.outcome} ({self.seconds:.2f} s{wait})"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: dict
    url: str  # the replica that answered
    attempts: list[Attempt] = field(default_factory=list)  # every try, the successful one last


class FailoverError(Exception):
    """What FailoverClient raises; each subclass carries `attempts`, the log of the call."""

    attempts: list[Attempt]


class RequestRejected(FailoverError):
    """A replica answered a status that says the request is at fault (4xx other than 429); not retried."""

    def __init__(self, url: str, status: int, error: dict, attempts: list[Attempt]):
        self.url, self.status, self.error, self.attempts = url, status, error, attempts
        param = f" (param {error['param']!r})" if error.get("param") else ""
        super().__init__(f"{url} rejected the request with HTTP {status} {error.get('type')}: {error['message']}{param}")


class AllAttemptsFailed(FailoverError):
    def __init__(self, what: str, attempts: list[Attempt]):
        self.attempts = attempts
        tries = "".join(f"\n  {number}. {attempt}" for number, attempt in enumerate(attempts, 1))
        super().__init__(f"{what} failed on all {len(attempts)} attempts:{tries}")


class StreamInterrupted(FailoverError):
    """A stream broke after output had reached the caller; it is not retried, so no output is repeated."""

    def __init__(self, url: str, num_events: int, num_output_events: int, cause: str, attempts: list[Attempt]):
        self.url, self.num_events, self.num_output_events, self.attempts = url, num_events, num_output_events, attempts
        super().__init__(f"the stream from {url} broke after {num_events} events ({num_output_events} carrying output) "
                         f"had been delivered: {cause}; not retried on another replica because output had already "
                         "been delivered")


class StreamFailed(FailoverError):
    """The replica sent an error event in the stream: `error` is its OpenAI error object (chat: the "error" of
    `data: {"error": ...}`; Responses: the `error` event), `kind` what failed (its type; a Responses event's code)."""

    def __init__(self, url: str, error: dict, kind: str | None, num_events: int, attempts: list[Attempt]):
        self.url, self.error, self.kind, self.num_events, self.attempts = url, error, kind, num_events, attempts
        super().__init__(f"{url} reported an error in the stream after {num_events} events had been delivered: "
                         f"{kind}: {error.get('message')}")


@dataclass(frozen=True, slots=True)
class _Replica:
    url: str
    host: str
    port: int | None
    prefix: str  # a path the replica is served under, e.g. behind a proxy: "" or "/llm"
    is_https: bool

    @classmethod
    def parse(cls, url: object) -> _Replica:
        malformed = ValueError(f"a replica URL looks like 'http://host:port' (optionally with a path prefix), got {url!r}")
        if not isinstance(url, str):
            raise malformed
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port  # ValueError if it is not a port number
        except ValueError:
            raise malformed from None
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise malformed
        return cls(url.rstrip("/"), parts.hostname, port, parts.path.rstrip("/"), parts.scheme == "https")

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.is_https else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=timeout)


class _AttemptFailed(Exception):
    """One attempt failed in a way worth trying another replica for; the message says how."""


class FailoverClient:
    """Calls the OpenAI API of the replicas at `urls`; safe to share between threads."""

    def __init__(self, urls: list[str], *, api_key: str | None = None, timeout: float = 60.0,
                 max_attempts: int | None = None, backoff_base: float = 0.1, backoff_max: float = 5.0,
                 retry_after_max: float = 10.0, first_replica: int | None = None):
        """timeout: seconds for a connect or any one read (a replica pings an idle stream every 15 s).
        max_attempts: tries per call, over all replicas (None: two per replica).
        backoff_base, backoff_max: the n-th retry waits a random 50-100 % of min(backoff_max, backoff_base * 2**(n-1)).
        retry_after_max: the longest a replica's Retry-After is honoured for, in seconds.
        first_replica: the index of the replica the first call starts at (None: a random one); each call starts at
        the next."""
        if isinstance(urls, str) or not isinstance(urls, (list, tuple)) or not urls:
            raise ValueError(f"urls must be a non-empty list of replica URLs such as ['http://10.0.0.1:8000'], got {urls!r}")
        self.replicas = [_Replica.parse(url) for url in urls]
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key must be a non-empty string or None")
        if not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        max_attempts = 2 * len(urls) if max_attempts is None else max_attempts
        if type(max_attempts) is not int or max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        if not (isinstance(backoff_base, (int, float)) and 0 <= backoff_base <= backoff_max < math.inf):
            raise ValueError(f"need 0 <= backoff_base <= backoff_max (seconds), got backoff_base={backoff_base!r}, "
                             f"backoff_max={backoff_max!r}")
        if not (isinstance(retry_after_max, (int, float)) and 0 <= retry_after_max < math.inf):
            raise ValueError(f"retry_after_max must be a number of seconds >= 0, got {retry_after_max!r}")
        if first_replica is not None and first_replica not in range(len(urls)):
            raise ValueError(f"first_replica must be an index into urls, 0 to {len(urls) - 1}, got {first_replica!r}")
        self.timeout, self.max_attempts = timeout, max_attempts
        self.backoff_base, self.backoff_max, self.retry_after_max = backoff_base, backoff_max, retry_after_max
        self._api_key = api_key
        self._rotation = itertools.count(random.randrange(len(urls)) if first_replica is None else first_replica)

    def post(self, path: str, body: dict) -> dict:
        """POST a JSON body; the replica's JSON answer."""
        return self.request("POST", path, body).body

    def request(self, method: str, path: str, body: dict | None = None) -> Reply:
        """One non-streaming call, tried on replica after replica; a 2xx Reply, else RequestRejected or AllAttemptsFailed."""
        attempts: list[Attempt] = []
        payload = self._payload(path, body)
        for replica in self._replicas_to_try(attempts):
            started = time.monotonic()
            conn = replica.connect(self.timeout)
            try:
                conn.request(method, replica.prefix + path, payload, self._headers(payload, "application/json"))
                response = conn.getresponse()
                status, data = response.status, response.read()
            except _CONNECTION_ERRORS as exc:
                attempts.append(Attempt(replica.url, _describe(exc, self.timeout), time.monotonic() - started))
                continue
            finally:
                conn.close()
            if 200 <= status < 300:
                try:
                    answer = json.loads(data)
                except ValueError:
                    attempts.append(Attempt(replica.url, f"HTTP {status} with a body that is not JSON: {data[:80]!r}",
                                            time.monotonic() - started, status))
                    continue
                attempts.append(Attempt(replica.url, f"HTTP {status}", time.monotonic() - started, status))
                return Reply(status, answer, replica.url, attempts)
            self._note_failure(replica, response, data, started, attempts)
        raise AllAttemptsFailed(f"{method} {path}", attempts)

    def stream(self, path: str, body: dict) -> EventStream:
        """POST with "stream": true; iterate the result for the events, as dicts: chat and completions chunks (up to
        data: [DONE], not delivered), or Responses events up to and with response.completed (or .incomplete)."""
        return EventStream(self, path, self._payload(path, {**body, "stream": True}))

    # ------------------------------------------------------------------------------------------ shared by both

    @overload
    def _payload(self, path: str, body: dict) -> bytes: ...
    @overload
    def _payload(self, path: str, body: dict | None) -> bytes | None: ...
    def _payload(self, path: str, body: dict | None) -> bytes | None:
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"path must start with '/', e.g. '/v1/completions', got {path!r}")
        if body is not None and not isinstance(body, dict):
            raise ValueError(f"body must be a dict (sent as JSON) or None, got {type(body).__name__}")
        return None if body is None else json.dumps(body).encode()

    def _headers(self, payload: bytes | None, accept: str) -> dict[str, str]:
        headers = {"Accept": accept, "User-Agent": "pagedserve-failover-client"}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def _replicas_to_try(self, attempts: list[Attempt]) -> Iterator[_Replica]:
        """The replica of each attempt in turn, sleeping before each retry; reads the attempt log the caller keeps."""
        start, num_replicas = next(self._rotation), len(self.replicas)
        not_before: dict[str, float] = {}  # replica url -> when its Retry-After has passed
        for number in range(self.max_attempts):
            replica = self.replicas[(start + number) % num_replicas]
            if number:
                last = attempts[-1]
                if last.retry_after is not None:
                    not_before[last.url] = time.monotonic() + min(last.retry_after, self.retry_after_max)
                backoff = min(self.backoff_max, self.backoff_base * 2 ** (number - 1)) * random.uniform(0.5, 1.0)
                time.sleep(max(backoff, not_before.get(replica.url, 0.0) - time.monotonic()))
            yield replica

    def _note_failure(self, replica: _Replica, response: http.client.HTTPResponse, data: bytes, started: float,
                      attempts: list[Attempt]) -> None:
        """Log a non-2xx answer as a failed attempt if another replica may do better; else raise RequestRejected."""
        error = _error_object(data, response.status)
        if response.status != 429 and not 500 <= response.status < 600:
            raise RequestRejected(replica.url, response.status, error,
                                  [*attempts, Attempt(replica.url, f"HTTP {response.status}", time.monotonic() - started,
                                                      response.status)])
        attempts.append(Attempt(replica.url, f"HTTP {response.status}: {error['message']}", time.monotonic() - started,
                                response.status, _retry_after(response.getheader("Retry-After"))))


class EventStream:
    """The events of one streamed call, in order; iterating it makes the call. `attempts` and `url` tell where it went."""

    def __init__(self, client: FailoverClient, path: str, payload: bytes):
        self.attempts: list[Attempt] = []
        self.url: str | None = None  # the replica whose events are being delivered
        self.num_events = 0  # delivered to the caller
        self.num_output_events = 0
        self._events = self._run(client, path, payload)

    def __iter__(self) -> EventStream:
        return self

    def __next__(self) -> dict:
        return next(self._events)

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop early; closes the connection (`with client.stream(...) as events:` does it on leaving)."""
        self._events.close()

    def _run(self, client: FailoverClient, path: str, payload: bytes) -> Generator[dict, None, None]:
        for replica in client._replicas_to_try(self.attempts):
            started = time.monotonic()
            conn = replica.connect(client.timeout)
            try:
                conn.request("POST", replica.prefix + path, payload, client._headers(payload, "text/event-stream"))
                response = conn.getresponse()
                if response.status != 200:
                    client._note_failure(replica, response, response.read(), started, self.attempts)
                    continue
                yield from self._relay(replica, response, started, client.timeout)
                return
            except _CONNECTION_ERRORS as exc:
                self.attempts.append(Attempt(replica.url, _describe(exc, client.timeout), time.monotonic() - started))
            except _AttemptFailed as exc:
                self.attempts.append(Attempt(replica.url, str(exc), time.monotonic() - started, 200))
            finally:
                conn.close()
        raise AllAttemptsFailed(f"POST {path} (stream)", self.attempts)

    def _relay(self, replica: _Replica, response: http.client.HTTPResponse, started: float,
               timeout: float) -> Iterator[dict]:
        """Deliver one started stream; _AttemptFailed if it fails before any output, StreamInterrupted after."""
        reader = StreamReader()
        try:
            while not reader.is_complete:
                chunk = response.read1(READ_SIZE)
                if not chunk:
                    raise EOFError("the stream ended before its last event (data: [DONE], or response.completed, "
                                   ".incomplete or .failed)")
                for event in reader.feed(chunk):
                    yield from self._deliver(replica, event, started)
        except ErrorEvent as exc:
            self._fail(replica, exc, started)
        except (*_CONNECTION_ERRORS, EOFError, ValueError) as exc:
            cause = _describe(exc, timeout)
            if self.num_events == 0:
                raise _AttemptFailed(f"HTTP 200, then the stream broke before any output: {cause}") from exc
            self.attempts.append(Attempt(replica.url, f"HTTP 200, then the stream broke: {cause}",
                                         time.monotonic() - started, 200))
            raise StreamInterrupted(replica.url, self.num_events, self.num_output_events, cause, self.attempts) from exc

    def _deliver(self, replica: _Replica, event: StreamEvent, started: float) -> Iterator[dict]:
        if event.is_last:  # logged before the last event is delivered: the caller may stop at it
            self.attempts.append(Attempt(replica.url, "HTTP 200, stream complete", time.monotonic() - started, 200))
        if event.payload is not None:
            self.url = replica.url
            self.num_events += 1
            self.num_output_events += event.is_output
            yield event.payload

    def _fail(self, replica: _Replica, error: ErrorEvent, started: float) -> None:
        """An error event: retried on another replica only if nothing was delivered and the request is not at fault."""
        message = f"HTTP 200, then an error event: {error}"
        if self.num_events == 0 and not error.is_callers_fault:
            raise _AttemptFailed(message) from error
        self.attempts.append(Attempt(replica.url, message, time.monotonic() - started, 200))
        raise StreamFailed(replica.url, error.error, error.kind, self.num_events, self.attempts) from error


def _error_object(data: bytes, status: int) -> dict:
    """The OpenAI error object of an error answer; one made from the body's text if it has none."""
    try:
        error = json.loads(data)["error"]
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error
    except (ValueError, KeyError, TypeError):
        pass
    text = data.decode(errors="replace").strip()[:200]
    return {"message": text or f"HTTP {status} with an empty body", "type": None, "param": None, "code": None}


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (it may be a number of seconds or an HTTP date); None if absent or unreadable."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _describe(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError):
        return "connection reset by the replica"
    if isinstance(exc, TimeoutError):
        return f"timed out (nothing within {timeout:g} s)"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "the replica closed the connection without answering"
    if isinstance(exc, http.client.IncompleteRead):
        return "the connection closed in the middle of the response"
    if isinstance(exc, json.JSONDecodeError):
        return f"a data: line that is not JSON ({exc})"
    if isinstance(exc, EOFError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
