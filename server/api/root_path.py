"""--root-path: serve behind a proxy that routes a path prefix here, with or without the prefix removed.

vLLM passes --root-path to its ASGI app, where a path that begins with the
root path is routed without it and any other path as it is; this does the
same in front of the App: `/prefix/v1/models` and `/v1/models` both reach
GET /v1/models. The prefix matches whole segments (`/prefix` does not
match `/prefixed`).
"""

from __future__ import annotations

from server.http.errors import ApiError
from server.http.server import CheckHead, Handler, HttpRequest, Responder


def check_root_path(root_path: str) -> str:
    """The root path without its trailing '/'; a ValueError unless it starts with '/'."""
    if not root_path.startswith("/"):
        raise ValueError(f"root_path must start with '/', got {root_path!r}")
    return root_path.rstrip("/")


def strip_root_path(path: str, root_path: str) -> str:
    """`path` without the root path when it begins with it, else `path`."""
    if path == root_path or path.startswith(root_path + "/"):
        return path[len(root_path):] or "/"
    return path


class RootPathHandler:
    """The App's handler and head check, each seeing paths without the root path."""

    def __init__(self, handler: Handler, check_head: CheckHead | None, root_path: str):
        self._handler = handler
        self._check_head = check_head
        self.root_path = check_root_path(root_path)

    async def __call__(self, request: HttpRequest, responder: Responder) -> None:
        request.path = strip_root_path(request.path, self.root_path)
        await self._handler(request, responder)

    def check_head(self, method: str, path: str, headers: dict[str, str]) -> ApiError | None:
        if self._check_head is None:
            return None
        return self._check_head(method, strip_root_path(path, self.root_path), headers)
