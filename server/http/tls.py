"""TLS for the HTTP server: the settings (vLLM's --ssl-* flags) and the server's SSLContext built from them.

Owns: which files make the server's certificate, whether clients must show
certificates of their own, and the SSLContext (TLS 1.2 at least, Python's
default ciphers). Must not know: HTTP; the HttpServer hands the context to
the loop for each accepted socket, and the handshake runs before the
connection's first byte is parsed.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

# --ssl-cert-reqs' values, as vLLM takes them: the ssl module's numbers.
CERT_REQS = {int(ssl.CERT_NONE): ssl.CERT_NONE, int(ssl.CERT_OPTIONAL): ssl.CERT_OPTIONAL,
             int(ssl.CERT_REQUIRED): ssl.CERT_REQUIRED}


@dataclass(slots=True, frozen=True)
class TlsConfig:
    """The server's certificate chain and key (PEM); with `ca_certs`, the CAs that client certificates must chain to.

    cert_reqs: whether clients show a certificate (ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED); None: required
    when `ca_certs` is given, else none is asked for.
    """

    certfile: Path
    keyfile: Path
    ca_certs: Path | None = None
    cert_reqs: ssl.VerifyMode | None = None

    def __post_init__(self) -> None:
        if self.cert_reqs not in (None, ssl.CERT_NONE) and self.ca_certs is None:
            raise ValueError(f"ssl_cert_reqs {self.cert_reqs.name} needs ssl_ca_certs: the CAs that client "
                             "certificates are checked against")

    @property
    def client_cert_reqs(self) -> ssl.VerifyMode:
        if self.cert_reqs is not None:
            return self.cert_reqs
        return ssl.CERT_REQUIRED if self.ca_certs is not None else ssl.CERT_NONE

    def server_context(self) -> ssl.SSLContext:
        """The context every accepted connection's handshake runs with; OSError (ssl.SSLError) for a bad file."""
        # Not create_default_context: it would trust the system's CAs for client certificates too.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except OSError as exc:  # a missing file's error would not name it
            raise OSError(f"expected a PEM certificate chain at {self.certfile} and its key at {self.keyfile}: "
                          f"{exc}") from exc
        if self.ca_certs is not None:
            try:
                context.load_verify_locations(cafile=self.ca_certs)
            except OSError as exc:
                raise OSError(f"expected PEM CA certificates at {self.ca_certs}: {exc}") from exc
        context.verify_mode = self.client_cert_reqs
        return context
