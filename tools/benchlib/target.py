"""Target: a server as the load generators address it; served_model: the name it serves.

One Target for every client in tools/: the asyncio load generator
(http_load.py), the soak's mixed load and the hostile client build their
raw HTTP/1.1 requests from it. Only the standard library.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

MODELS_TIMEOUT_S = 10.0


def auth_header(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model of GET /v1/models."""
    request = urllib.request.Request(f"{base_url}/v1/models", headers=auth_header(api_key))
    with urllib.request.urlopen(request, timeout=MODELS_TIMEOUT_S) as response:
        return json.load(response)["data"][0]["id"]


@dataclass(frozen=True, slots=True)
class Target:
    """Where the server is (host, port, TLS or not), the API key to send and the model name to ask for."""
    host: str
    port: int
    model: str
    api_key: str | None = None
    is_tls: bool = False

    @classmethod
    def from_url(cls, base_url: str, model: str, api_key: str | None = None) -> Target:
        url = urlsplit(base_url)
        port = url.port or (443 if url.scheme == "https" else 80)
        return cls(url.hostname or "127.0.0.1", port, model, api_key, url.scheme == "https")

    def head(self, path: str, fields: Iterable[str] = (), *, host: bool = True, auth: bool = True) -> bytes:
        """A JSON POST's request line and headers (Connection: close), `fields` last; host=False leaves out
        Host, auth=False the API key (for the probes that send what a client must not)."""
        lines = [f"POST {path} HTTP/1.1", *([f"Host: {self.host}:{self.port}"] if host else []),
                 "Content-Type: application/json", "Connection: close",
                 *([f"Authorization: Bearer {self.api_key}"] if auth and self.api_key else []), *fields]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    def post(self, path: str, payload: bytes, fields: Iterable[str] = ()) -> bytes:
        """A whole POST of the JSON `payload`: head (with Content-Length) and body."""
        return self.head(path, [*fields, f"Content-Length: {len(payload)}"]) + payload
