"""RequestAssembler, sans-I/O: every case on the whole input, then one byte at a time, then
followed by a second (pipelined) request, which a terminal error must swallow."""

import tracemalloc

import pytest

from server.http.body_budget import BodyBudget
from server.http.parser import ExpectContinue, HttpRequest, Phase, RequestAssembler, RequestError, request_id_from

LIMITS = dict(max_header_bytes=1024, max_header_count=10, max_body_bytes=100)
SECOND = b"GET /second?x=1 HTTP/1.1\r\nHost: a\r\n\r\n"
MODES = ["whole", "bytewise", "trailing"]


def assembler(budget: BodyBudget | None = None, check_head=lambda method, path, headers: None,
              **limits) -> RequestAssembler:
    return RequestAssembler(**(LIMITS | limits), body_budget=budget or BodyBudget(1000), check_head=check_head)


def feed(data: bytes, mode: str, **options) -> list:
    parser = assembler(**options)
    if mode == "trailing":
        data += SECOND
    pieces = [data[i:i + 1] for i in range(len(data))] if mode == "bytewise" else [data]
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events


def requests_of(data: bytes, mode: str, **options) -> list[HttpRequest]:
    """The requests in `data`; in trailing mode, checks the pipelined SECOND came out after them."""
    events = feed(data, mode, **options)
    assert all(isinstance(e, (HttpRequest, ExpectContinue)) for e in events), events
    requests = [e for e in events if isinstance(e, HttpRequest)]
    if mode == "trailing":
        second = requests.pop()
        assert (second.method, second.path, second.query, second.body) == ("GET", "/second", "x=1", b"")
    return requests


def error_of(data: bytes, mode: str, **options) -> RequestError:
    """The one terminal error `data` causes: nothing after it, not even the pipelined SECOND."""
    events = feed(data, mode, **options)
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
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body)
    [request] = requests_of(head + body, mode)
    assert request.method == "POST" and request.body == body and request.query == ""


@pytest.mark.parametrize("mode", MODES)
def test_chunked_body_with_extension_and_trailer(mode):
    data = (b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n")
    [request] = requests_of(data, mode)
    assert request.body == b"hello world"
    assert "x-trailer" not in request.headers  # trailers are read and dropped


@pytest.mark.parametrize("mode", MODES)
def test_header_names_lower_case_values_trimmed_repeats_joined(mode):
    [request] = requests_of(b"GET / HTTP/1.1\r\nHost: t\r\nX-A:   one  \r\nx-a: two\r\nX-Obs: caf\xe9\r\n\r\n", mode)
    assert request.headers == {"host": "t", "x-a": "one, two", "x-obs": "caf\xe9"}


@pytest.mark.parametrize("mode", MODES)
def test_absolute_form_target(mode):
    [request] = requests_of(b"GET http://example.com/v1/models?q=1 HTTP/1.1\r\nHost: t\r\n\r\n", mode)
    assert (request.path, request.query) == ("/v1/models", "q=1")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head, keep_alive", [
    (b"GET / HTTP/1.1\r\nHost: t\r\n\r\n", True),
    (b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", True),
])
def test_keep_alive(mode, head, keep_alive):
    [request] = requests_of(head, mode)
    assert request.keep_alive is keep_alive


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head", [b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", b"GET / HTTP/1.0\r\n\r\n"])
def test_no_keep_alive_ends_the_input(mode, head):
    events = feed(head, mode)  # in trailing mode the pipelined request is never read
    assert len(events) == 1 and not events[0].keep_alive


@pytest.mark.parametrize("mode", MODES)
def test_pipelined_requests_come_out_in_order(mode):
    data = (b"POST /a HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc" b"GET /b HTTP/1.1\r\nHost: t\r\n\r\n"
            b"POST /c HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\nz")
    requests = requests_of(data, mode)
    assert [(r.path, r.body) for r in requests] == [("/a", b"abc"), ("/b", b""), ("/c", b"z")]


@pytest.mark.parametrize("mode", MODES)
def test_expect_continue_comes_before_the_body(mode):
    events = feed(b"POST / HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nok", mode)
    assert isinstance(events[0], ExpectContinue) and events[1].body == b"ok"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("data, status, says", [
    (b"HELLO WORLD\r\n\r\n", 400, "parse error"),
    (b"GET / HTTP/1.1\nHost: a\n\n", 400, "parse error"),  # bare LF
    (b"GET / HTTP/1.1\r\nHost: t\r\nX: a\rb\r\n\r\n", 400, "parse error"),  # bare CR
    (b"GET / HTTP/1.1\r\nHost: t\r\nX: a\x00b\r\n\r\n", 400, "parse error"),
    (b"GET / HTTP/1.1\r\nHost: t\r\nX: a\r\n folded\r\n\r\n", 400, "parse error"),  # obs-fold
    (b"GET / HTTP/1.1\r\nHost: t\r\nX : a\r\n\r\n", 400, "parse error"),  # whitespace before the colon
    (b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "Content-Length"),
    (b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n", 400, "Content-Length"),
    (b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc", 400, "Duplicate Content-Length"),
    (b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 3x\r\n\r\nabc", 400, "Content-Length"),
    (b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: -1\r\n\r\n", 400, "Content-Length"),
    (b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\nabc", 400, "chunked as the last"),
    (b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked, gzip\r\n\r\nabc", 400, "Transfer-Encoding"),
    (b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", 501,
     "chunked alone, got 'gzip, chunked'"),  # a coding we cannot undo (RFC 9112 section 6.1)
    (b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 501,
     "chunked alone"),
    (b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "parse error"),  # bad chunk size
    (b"GET / HTTP/2.0\r\n\r\n", 505, "HTTP/2.0"),
    (b"GET / HTTP/1.1\r\n\r\n", 400, "Host header in an HTTP/1.1 request, got none"),  # RFC 9112 section 3.2
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "one Host header, got Host: 'a, b'"),
    (b"GET / HTTP/1.1\r\nHost: a,b\r\n\r\n", 400, "one Host header"),
    (b"GET / HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n", 400, "one Host header"),
    (b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", 501, "not a proxy"),
])
def test_malformed_requests_are_rejected(mode, data, status, says):
    error = error_of(data, mode)
    assert error.status == status and says in error.message


@pytest.mark.parametrize("mode", MODES)
def test_body_over_the_limit_by_content_length_is_rejected_before_reading_it(mode):
    error = error_of(b"POST / HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 101\r\n\r\n", mode)
    assert error.status == 413 and "at most 100 bytes" in error.message and "101" in error.message


@pytest.mark.parametrize("mode", MODES)
def test_chunked_body_over_the_limit_is_rejected_when_counted(mode):
    data = b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + b"32\r\n" + b"x" * 50 + b"\r\n"
    assert feed(data, "whole") == []  # 50 bytes: fine so far
    error = error_of(data + b"33\r\n" + b"x" * 51 + b"\r\n0\r\n\r\n", mode)
    assert error.status == 413 and "at most 100 bytes" in error.message


@pytest.mark.parametrize("mode", MODES)
def test_body_at_the_limit_is_accepted(mode):
    [request] = requests_of(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n" + b"y" * 100, mode)
    assert len(request.body) == 100


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("data", [
    b"GET /" + b"u" * 1100 + b" HTTP/1.1\r\nHost: t\r\n\r\n",  # request line
    b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"v" * 1100 + b"\r\n\r\n",  # one header
    b"GET / HTTP/1.1\r\nHost: t\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 200) for i in range(6)) + b"\r\n",  # several
    b"GET / HTTP/1.1\r\nHost: t\r\nX-Pad:" + b" " * 3000 + b"v\r\n\r\n",  # whitespace, which no callback reports
])
def test_head_over_the_limit_is_431(mode, data):
    error = error_of(data, mode)
    assert error.status == 431 and "at most 1024 bytes" in error.message


@pytest.mark.parametrize("mode", MODES)
def test_too_many_header_fields_is_431(mode):
    error = error_of(b"GET / HTTP/1.1\r\nHost: t\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(11)) + b"\r\n", mode)
    assert error.status == 431 and "at most 10 header fields" in error.message


def test_header_that_never_ends_is_cut_at_the_limit():
    parser = assembler()
    parser.feed(b"GET / HTTP/1.1\r\nHost: t\r\nX-Endless: ")
    fed = 0
    while not (events := parser.feed(b"v" * 100)):
        fed += 100
        assert fed < 3 * LIMITS["max_header_bytes"]
    assert events[0].status == 431 and parser.phase is Phase.CLOSED


def test_nothing_is_read_after_a_terminal_error():
    parser = assembler()
    assert parser.feed(b"BAD\r\n\r\n")[0].status == 400
    assert parser.feed(SECOND) == [] and parser.phase is Phase.CLOSED


@pytest.mark.parametrize("mode", MODES)
def test_http10_needs_no_host(mode):
    [request] = requests_of(b"GET /old HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", mode)
    assert request.path == "/old" and "host" not in request.headers


def test_long_client_text_in_a_message_is_clipped():
    error = error_of(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: " + b"x" * 900 + b", chunked\r\n\r\n", "whole")
    assert error.status == 501 and "x" * 100 + "..." in error.message and len(error.message) < 250


UPGRADE = b"POST /up HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
SMUGGLED = b"GET /admin HTTP/1.1\r\nHost: t\r\n\r\n"  # a body that reads like a request


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("framing, body", [
    (b"Content-Length: %d\r\n\r\n" % len(SMUGGLED), SMUGGLED),
    (b"Transfer-Encoding: chunked\r\n\r\n", b"%x\r\n%s\r\n0\r\n\r\n" % (len(SMUGGLED), SMUGGLED)),
])
def test_upgrade_is_ignored_and_its_body_read_as_a_body(mode, framing, body):
    [request] = requests_of(UPGRADE + framing + body, mode)  # trailing: the pipelined SECOND still comes out
    assert (request.path, request.body, request.keep_alive) == ("/up", SMUGGLED, True)


@pytest.mark.parametrize("mode", MODES)
def test_upgrade_without_a_body_is_served_and_the_connection_goes_on(mode):
    first, after = requests_of(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n" + SMUGGLED, mode)
    assert (first.path, first.keep_alive, after.path) == ("/", True, "/admin")


@pytest.mark.parametrize("mode", MODES)
def test_upgrade_waits_for_its_body_after_100_continue(mode):
    events = feed(UPGRADE + b"Expect: 100-continue\r\nContent-Length: 2\r\n\r\nok", mode)
    assert isinstance(events[0], ExpectContinue) and events[1].body == b"ok"


def refuse_v1(method, path, headers):
    if path.startswith("/v1/") and "authorization" not in headers:
        return RequestError(401, f"no key for {method} {path}", {"WWW-Authenticate": "Bearer"})
    return None


@pytest.mark.parametrize("mode", MODES)
def test_head_check_refuses_before_100_continue_and_the_body(mode):
    budget = BodyBudget(1000)
    data = b"POST /v1/x HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 50\r\n\r\n" + b"b" * 50
    events = feed(data, mode, budget=budget, check_head=refuse_v1)
    assert events == [RequestError(401, "no key for POST /v1/x", {"WWW-Authenticate": "Bearer"})]
    assert budget.num_bytes == 0


@pytest.mark.parametrize("mode", MODES)
def test_head_check_sees_method_path_and_headers_and_may_pass(mode):
    seen = []
    data = b"POST /v1/x?q=1 HTTP/1.1\r\nHost: t\r\nAuthorization: k\r\nContent-Length: 2\r\n\r\nok"
    [request] = requests_of(data, mode, check_head=lambda *head: seen.append(head) or refuse_v1(*head))
    assert request.body == b"ok" and seen[0] == ("POST", "/v1/x", {"host": "t", "authorization": "k",
                                                                   "content-length": "2"})


@pytest.mark.parametrize("mode", MODES)
def test_expect_continue_in_http10_is_ignored(mode):
    events = feed(b"POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nok", mode)
    assert [type(e) for e in events] == [HttpRequest]  # and HTTP/1.0 closes: the trailing request is not read


def test_a_content_length_body_is_charged_as_it_arrives_not_when_its_head_does():
    budget = BodyBudget(1000)
    parser = assembler(budget)
    assert parser.feed(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 80\r\n\r\n") == []
    assert budget.num_bytes == 0  # an announced body holds nothing
    assert parser.feed(b"z" * 30) == [] and budget.num_bytes == 30
    [request] = parser.feed(b"z" * 50)
    assert budget.num_bytes == 80  # until the connection is done with the request
    budget.release(len(request.body))
    assert budget.num_bytes == 0


@pytest.mark.parametrize("mode", MODES)
def test_heads_announcing_more_than_the_budget_holds_are_read_until_their_bytes_do_not_fit(mode):
    budget = BodyBudget(100)
    assert budget.reserve(50)  # another connection's
    head = b"POST / HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 60\r\n\r\n"
    assert feed(head, "whole", budget=budget) == [ExpectContinue()] and budget.num_bytes == 50
    error = error_of(head + b"x" * 60, mode, budget=budget)
    assert error.status == 503 and error.headers == {"Retry-After": "1"} and "more do not fit" in error.message
    assert budget.num_bytes == 50


@pytest.mark.parametrize("mode", MODES)
def test_a_chunked_body_is_charged_as_it_arrives_and_released_when_cut(mode):
    budget = BodyBudget(100)
    assert budget.reserve(40)
    data = b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + b"32\r\n" + b"x" * 50 + b"\r\n"
    error = error_of(data + b"14\r\n" + b"x" * 20 + b"\r\n0\r\n\r\n", mode, budget=budget)
    assert error.status == 503 and budget.num_bytes == 40


def test_closing_releases_the_body_in_progress():
    budget = BodyBudget(1000)
    parser = assembler(budget)
    parser.feed(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 90\r\n\r\nhalf")
    parser.close()
    assert budget.num_bytes == 0


def test_the_body_buffer_is_freed_once_its_request_is_out():
    parser = assembler(BodyBudget(4 << 20), max_body_bytes=2 << 20)
    body = b"y" * (1 << 20)
    tracemalloc.start()
    try:
        [request] = parser.feed(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert request.body == body
        del request
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 64 * 1024  # the idle connection keeps no copy of the last body


def test_phases_and_request_numbers():
    parser = assembler()
    seen = []
    for byte in b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\nzGET / HTTP/1.1\r\nHost: t\r\n\r\n":
        parser.feed(bytes([byte]))
        if not seen or seen[-1] != (parser.phase, parser.num_begun):
            seen.append((parser.phase, parser.num_begun))
    # a GET without a body is complete on the byte that ends its head
    assert seen == [(Phase.HEAD, 1), (Phase.BODY, 1), (Phase.IDLE, 1), (Phase.HEAD, 2), (Phase.IDLE, 2)]


@pytest.mark.parametrize("mode", MODES)
def test_request_id_from_the_client_is_kept(mode):
    [request] = requests_of(b"GET / HTTP/1.1\r\nHost: t\r\nX-Request-Id: trace-42/a.b\r\n\r\n", mode)
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
