"""RequestAssembler, sans-I/O: every case on the whole input, then one byte at a time, then
followed by a second (pipelined) request, which a terminal error must swallow."""

import pytest

from server.http_parser import ExpectContinue, HttpRequest, Phase, RequestAssembler, RequestError, request_id_from

LIMITS = dict(max_header_bytes=1024, max_header_count=10, max_body_bytes=100)
SECOND = b"GET /second?x=1 HTTP/1.1\r\nHost: a\r\n\r\n"
MODES = ["whole", "bytewise", "trailing"]


def feed(data: bytes, mode: str, **limits) -> list:
    assembler = RequestAssembler(**(LIMITS | limits))
    if mode == "trailing":
        data += SECOND
    pieces = [data[i:i + 1] for i in range(len(data))] if mode == "bytewise" else [data]
    events = []
    for piece in pieces:
        events += assembler.feed(piece)
    return events


def requests_of(data: bytes, mode: str, **limits) -> list[HttpRequest]:
    """The requests in `data`; in trailing mode, checks the pipelined SECOND came out after them."""
    events = feed(data, mode, **limits)
    assert all(isinstance(e, (HttpRequest, ExpectContinue)) for e in events), events
    requests = [e for e in events if isinstance(e, HttpRequest)]
    if mode == "trailing":
        second = requests.pop()
        assert (second.method, second.path, second.query, second.body) == ("GET", "/second", "x=1", b"")
    return requests


def error_of(data: bytes, mode: str, **limits) -> RequestError:
    """The one terminal error `data` causes: nothing after it, not even the pipelined SECOND."""
    events = feed(data, mode, **limits)
    errors = [e for e in events if isinstance(e, RequestError)]
    assert len(errors) == 1 and events[-1] is errors[0], events
    return errors[0]


@pytest.mark.parametrize("mode", MODES)
def test_get(mode):
    [request] = requests_of(b"GET /v1/models?a=1&b=2 HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n", mode)
    assert (request.method, request.path, request.query) == ("GET", "/v1/models", "a=1&b=2")
    assert request.headers == {"host": "x", "accept": "*/*"}
    assert request.body == b"" and request.keep_alive and request.http_version == "1.1"


@pytest.mark.parametrize("mode", MODES)
def test_post_with_content_length(mode):
    body = b'{"prompt": "hi"}'
    [request] = requests_of(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body), mode)
    assert request.method == "POST" and request.body == body and request.query == ""


@pytest.mark.parametrize("mode", MODES)
def test_chunked_body_with_extension_and_trailer(mode):
    data = (b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n")
    [request] = requests_of(data, mode)
    assert request.body == b"hello world"
    assert "x-trailer" not in request.headers  # trailers are read and dropped


@pytest.mark.parametrize("mode", MODES)
def test_header_names_lower_case_values_trimmed_repeats_joined(mode):
    [request] = requests_of(b"GET / HTTP/1.1\r\nX-A:   one  \r\nx-a: two\r\nX-Obs: caf\xe9\r\n\r\n", mode)
    assert request.headers == {"x-a": "one, two", "x-obs": "caf\xe9"}


@pytest.mark.parametrize("mode", MODES)
def test_absolute_form_target(mode):
    [request] = requests_of(b"GET http://example.com/v1/models?q=1 HTTP/1.1\r\n\r\n", mode)
    assert (request.path, request.query) == ("/v1/models", "q=1")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head, keep_alive", [
    (b"GET / HTTP/1.1\r\n\r\n", True),
    (b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", True),
])
def test_keep_alive(mode, head, keep_alive):
    [request] = requests_of(head, mode)
    assert request.keep_alive is keep_alive


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head", [b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n", b"GET / HTTP/1.0\r\n\r\n"])
def test_no_keep_alive_ends_the_input(mode, head):
    events = feed(head, mode)  # in trailing mode the pipelined request is never read
    assert len(events) == 1 and not events[0].keep_alive


@pytest.mark.parametrize("mode", MODES)
def test_pipelined_requests_come_out_in_order(mode):
    data = (b"POST /a HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc" b"GET /b HTTP/1.1\r\n\r\n"
            b"POST /c HTTP/1.1\r\nContent-Length: 1\r\n\r\nz")
    requests = requests_of(data, mode)
    assert [(r.path, r.body) for r in requests] == [("/a", b"abc"), ("/b", b""), ("/c", b"z")]


@pytest.mark.parametrize("mode", MODES)
def test_expect_continue_comes_before_the_body(mode):
    events = feed(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nok", mode)
    assert isinstance(events[0], ExpectContinue) and events[1].body == b"ok"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("data, status, says", [
    (b"HELLO WORLD\r\n\r\n", 400, "parse error"),
    (b"GET / HTTP/1.1\nHost: a\n\n", 400, "parse error"),  # bare LF
    (b"GET / HTTP/1.1\r\nX: a\rb\r\n\r\n", 400, "parse error"),  # bare CR
    (b"GET / HTTP/1.1\r\nX: a\x00b\r\n\r\n", 400, "parse error"),
    (b"GET / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n", 400, "parse error"),  # obs-fold
    (b"GET / HTTP/1.1\r\nX : a\r\n\r\n", 400, "parse error"),  # whitespace before the colon
    (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "Content-Length"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n", 400, "Content-Length"),
    (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc", 400, "Duplicate Content-Length"),
    (b"POST / HTTP/1.1\r\nContent-Length: 3x\r\n\r\nabc", 400, "Content-Length"),
    (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400, "Content-Length"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\nabc", 400, "Transfer-Encoding"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\nabc", 400, "Transfer-Encoding"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "parse error"),  # bad chunk size
    (b"GET / HTTP/2.0\r\n\r\n", 505, "HTTP/2.0"),
    (b"POST / HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: h2c\r\nContent-Length: 2\r\n\r\nhi", 400, "upgrade"),
])
def test_malformed_requests_are_rejected(mode, data, status, says):
    error = error_of(data, mode)
    assert error.status == status and says in error.message


@pytest.mark.parametrize("mode", MODES)
def test_body_over_the_limit_by_content_length_is_rejected_before_reading_it(mode):
    error = error_of(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 101\r\n\r\n", mode)
    assert error.status == 413 and "at most 100 bytes" in error.message and "101" in error.message


@pytest.mark.parametrize("mode", MODES)
def test_chunked_body_over_the_limit_is_rejected_when_counted(mode):
    data = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + b"32\r\n" + b"x" * 50 + b"\r\n"
    assert feed(data, "whole") == []  # 50 bytes: fine so far
    error = error_of(data + b"33\r\n" + b"x" * 51 + b"\r\n0\r\n\r\n", mode)
    assert error.status == 413 and "at most 100 bytes" in error.message


@pytest.mark.parametrize("mode", MODES)
def test_body_at_the_limit_is_accepted(mode):
    [request] = requests_of(b"POST / HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + b"y" * 100, mode)
    assert len(request.body) == 100


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("data", [
    b"GET /" + b"u" * 1100 + b" HTTP/1.1\r\n\r\n",  # request line
    b"GET / HTTP/1.1\r\nX-Big: " + b"v" * 1100 + b"\r\n\r\n",  # one header
    b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 200) for i in range(6)) + b"\r\n",  # several
    b"GET / HTTP/1.1\r\nX-Pad:" + b" " * 3000 + b"v\r\n\r\n",  # whitespace, which no callback reports
])
def test_head_over_the_limit_is_431(mode, data):
    error = error_of(data, mode)
    assert error.status == 431 and "at most 1024 bytes" in error.message


@pytest.mark.parametrize("mode", MODES)
def test_too_many_header_fields_is_431(mode):
    error = error_of(b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(11)) + b"\r\n", mode)
    assert error.status == 431 and "at most 10 header fields" in error.message


def test_header_that_never_ends_is_cut_at_the_limit():
    assembler = RequestAssembler(**LIMITS)
    assembler.feed(b"GET / HTTP/1.1\r\nX-Endless: ")
    fed = 0
    while not (events := assembler.feed(b"v" * 100)):
        fed += 100
        assert fed < 3 * LIMITS["max_header_bytes"]
    assert events[0].status == 431 and assembler.phase is Phase.CLOSED


def test_nothing_is_read_after_a_terminal_error():
    assembler = RequestAssembler(**LIMITS)
    assert assembler.feed(b"BAD\r\n\r\n")[0].status == 400
    assert assembler.feed(SECOND) == [] and assembler.phase is Phase.CLOSED


def test_upgrade_without_body_is_served_then_input_ends():
    assembler = RequestAssembler(**LIMITS)
    [request] = assembler.feed(b"GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n" + SECOND)
    assert request.path == "/" and not request.keep_alive and assembler.phase is Phase.CLOSED


def test_phases_and_request_numbers():
    assembler = RequestAssembler(**LIMITS)
    seen = []
    for byte in b"POST / HTTP/1.1\r\nContent-Length: 1\r\n\r\nzGET / HTTP/1.1\r\n\r\n":
        assembler.feed(bytes([byte]))
        if not seen or seen[-1] != (assembler.phase, assembler.num_begun):
            seen.append((assembler.phase, assembler.num_begun))
    # a GET without a body is complete on the byte that ends its head
    assert seen == [(Phase.HEAD, 1), (Phase.BODY, 1), (Phase.IDLE, 1), (Phase.HEAD, 2), (Phase.IDLE, 2)]


@pytest.mark.parametrize("mode", MODES)
def test_request_id_from_the_client_is_kept(mode):
    [request] = requests_of(b"GET / HTTP/1.1\r\nX-Request-Id: trace-42/a.b\r\n\r\n", mode)
    assert request.request_id == "trace-42/a.b"


@pytest.mark.parametrize("header, is_kept", [
    ("a" * 128, True), ("a" * 129, False), ("", False), (None, False), ("has space", False),
    ("caf\xe9", False), ("tab\there", False),
])
def test_request_id_is_capped_and_printable(header, is_kept):
    request_id = request_id_from(header)
    if is_kept:
        assert request_id == header
    else:
        assert len(request_id) == 32 and int(request_id, 16) >= 0


def test_fresh_request_ids_differ():
    assert request_id_from(None) != request_id_from(None)
