"""HTTPS as vLLM serves it: --ssl-certfile/--ssl-keyfile, and --ssl-ca-certs for client certificates, against
`python -m server` with a CA made here; spoken to by the openai SDK and by plain TLS sockets."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import openai
import pytest

from helpers.running_server import start_server, stop_server
from helpers.tiny_tokenizer import make_served_checkpoint
from helpers.tls_certificates import CertificateAuthority

HEADER_TIMEOUT_S = 1.0
SERVER_FLAGS = ("--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256",
                "--max-num-seqs", "4", "--standby-workers", "0", "--timeout-header", str(HEADER_TIMEOUT_S))
TIMEOUT_S = 30


@pytest.fixture
def ca(tmp_path: Path) -> CertificateAuthority:
    return CertificateAuthority.create(tmp_path / "ca")


def server_cert_flags(ca: CertificateAuthority, tmp_path: Path) -> tuple[str, ...]:
    cert = ca.issue(tmp_path / "server-cert", "127.0.0.1", is_server=True)
    return "--ssl-certfile", str(cert.certfile), "--ssl-keyfile", str(cert.keyfile)


def handshake(port: int, context: ssl.SSLContext) -> None:
    """A TLS handshake and one request with 127.0.0.1:port; ssl.SSLError or a closed connection when refused."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = tls.recv(64)
            if not reply:
                raise ConnectionResetError("the server closed the connection without an answer")
            assert reply.startswith(b"HTTP/1.1 200"), reply


def test_the_sdk_over_https_with_the_ca_and_a_client_without_it_refused(ca: CertificateAuthority,
                                                                        tmp_path: Path) -> None:
    server = start_server(tmp_path, make_served_checkpoint(tmp_path), *server_cert_flags(ca, tmp_path),
                          *SERVER_FLAGS, ssl_context=ca.client_context())
    try:
        assert server.base_url.startswith("https://")
        completion = server.client().completions.create(model="tiny", prompt="to be", max_tokens=3)
        assert completion.usage.completion_tokens == 3
        stream = server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=3, stream=True)
        assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content is not None) >= 1
        without_ca = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                                   timeout=TIMEOUT_S)
        with pytest.raises(openai.APIConnectionError):  # the system's CAs do not know this one
            without_ca.models.list()
        with pytest.raises(ssl.SSLCertVerificationError):
            handshake(server.port, ssl.create_default_context())
        plain = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                              timeout=TIMEOUT_S)
        with pytest.raises(openai.BadRequestError, match="this port serves HTTPS: .* use an https:// URL"):
            plain.models.list()  # plain HTTP to the HTTPS port: told so, in plain HTTP
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S) as silent:
            assert silent.recv(1) == b""  # no handshake within the header timeout: closed
        assert server.get("/health")[0] == 200  # the refusals left the server serving
    finally:
        stop_server(server)


def test_ssl_ca_certs_requires_a_client_certificate_from_that_ca(ca: CertificateAuthority, tmp_path: Path) -> None:
    client_cert = ca.issue(tmp_path / "client-cert", "a client", is_server=False)
    other_ca = CertificateAuthority.create(tmp_path / "other-ca")
    stranger_cert = other_ca.issue(tmp_path / "stranger-cert", "a stranger", is_server=False)
    server = start_server(tmp_path, make_served_checkpoint(tmp_path), *server_cert_flags(ca, tmp_path),
                          "--ssl-ca-certs", str(ca.certfile), *SERVER_FLAGS,
                          ssl_context=ca.client_context(client_cert))
    try:
        assert [m.id for m in server.client().models.list().data] == ["tiny"]
        handshake(server.port, ca.client_context(client_cert))
        for refused in (ca.client_context(), ca.client_context(stranger_cert)):
            with pytest.raises((ssl.SSLError, ConnectionError)):  # TLS 1.3: the alert comes with the first read
                handshake(server.port, refused)
    finally:
        stop_server(server)
