"""The web dashboard: one static page (plain JavaScript drawing SVG, no framework, nothing fetched from a CDN)
served at ``/dashboard``, reading the read-only JSON routes ``/v1/activity``, ``/v1/tasks``, ``/v1/stats``,
``/v1/tools/nondeterministic``, ``/v1/graph/outline`` and ``/v1/node``.

Auth: the page and its assets hold no data, so they are served without a token; every data request the page
makes carries ``Authorization: Bearer <token>`` like any other client. When the server has a token, the page
asks for it once and keeps it in the tab's ``sessionStorage`` (gone when the tab closes; never in a URL, so it
stays out of access logs, browser history and Referer headers). A strict Content-Security-Policy (scripts only
from this server, no inline script) and rendering all data as text keep cached tool outputs -- arbitrary bytes
from sandboxes -- from running as code in the page that holds the token.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

__all__ = ["OPEN_PATHS", "dashboard_routes"]

_ASSETS = {
    "/dashboard": ("index.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
OPEN_PATHS = frozenset({"/healthz", *_ASSETS})

_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _asset(body: bytes, media_type: str) -> Callable[[Request], Awaitable[Response]]:
    async def serve(request: Request) -> Response:
        return Response(body, media_type=media_type, headers=_HEADERS)

    return serve


def dashboard_routes() -> list[Route]:
    """One route per asset, each read from the package once."""
    static = resources.files("tvcache.server").joinpath("static")
    return [
        Route(path, _asset(static.joinpath(name).read_bytes(), media_type), methods=["GET"])
        for path, (name, media_type) in _ASSETS.items()
    ]
