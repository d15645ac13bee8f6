"""``cacherouter web``: a small browser UI over the same agent as ``cacherouter chat``.

One static page (plain JavaScript, no framework, nothing from a CDN) served at ``/`` with a chat box. Each turn
goes through :meth:`Agent.ask` exactly as in the terminal chat; the page shows the messages, every tool call and
``INTERNAL_ROUTER`` call with its result, and one row per model request with its prompt and cached tokens and its
relative input cost -- labelled SCRIPTED (offline DeepSeek cache model) or provider-reported (the provider's usage
fields).

Safety: the UI has no login and runs tools, so it binds to 127.0.0.1 by default and, when bound to loopback,
answers only requests whose Host is a loopback name (no DNS rebinding). Chat turns need a JSON body (a cross-site
form cannot send one without a CORS preflight, which is never granted) and a same-origin ``Origin`` when the browser
sends one. A strict Content-Security-Policy and rendering everything as text keep tool output -- arbitrary bytes --
from running as code in the page.

The conversation state (:class:`WebChat`) is standard-library only; the Starlette app imports its framework lazily
and names the extra to install when it is missing. To serve it from a background thread (tests, embedding), use
tvcache's helper: ``with AppThread(create_app(web)) as thread: ... thread.url`` (``tvcache.server.runner``).
"""

from __future__ import annotations

import json
import threading
from importlib import resources
from typing import TYPE_CHECKING, Any

from .accounting import RequestRecord
from .chat import SCRIPTED_LABEL, ChatSetup
from .errors import CacheRouterError, ConfigError
from .models import Message
from .prompts import ROUTER_TOOL
from .session import Session

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = ["LIVE_LABEL", "MAX_MESSAGE_CHARS", "WebChat", "create_app"]

LIVE_LABEL = "Live models (OpenAI-compatible endpoints from CACHEROUTER_*); cache figures are provider-reported"
MAX_MESSAGE_CHARS = 8000
LOOPBACK_NAMES = ("127.0.0.1", "localhost")
_EXTRA = "the web UI needs starlette and uvicorn: pip install 'tvcache[server]'"
_ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/web.js": ("web.js", "text/javascript; charset=utf-8"),
    "/static/web.css": ("web.css", "text/css; charset=utf-8"),
}
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class WebChat:
    """One conversation shown in the browser: turns run one at a time, each recorded as JSON for the page."""

    def __init__(self, setup: ChatSetup, session: Session) -> None:
        self.setup = setup
        self.session = session
        self._lock = threading.Lock()
        self._turns: list[dict[str, Any]] = []

    @property
    def label(self) -> str:
        return "SCRIPTED" if self.setup.scripted else "provider-reported"

    def ask(self, query: str) -> dict[str, Any]:
        """Run one turn through the agent and return it as the page shows it; a model failure is a turn too."""
        with self._lock:
            seen_messages = len(self.session.full)
            seen_requests = len(self.setup.ledger.records)
            turn: dict[str, Any] = {"index": len(self._turns), "query": query}
            try:
                answer = self.setup.agent.ask(self.session, query)
            except CacheRouterError as e:
                turn.update(answer=None, error=str(e), path="error", deep_thinking=[], calls=[])
            else:
                routed = [record.routed_to for record in answer.calls]
                oks = [record.ok for record in answer.calls]
                calls = _calls(self.session.full[seen_messages:])
                for call, routed_to, ok in zip(calls, routed, oks, strict=False):
                    call.update(routed_to=routed_to, ok=ok)
                turn.update(answer=answer.text, error=None, path=answer.path, deep_thinking=list(answer.deep_thinking))
                turn["calls"] = calls
            turn["requests"] = [
                _request_json(index, turn["index"], record)
                for index, record in enumerate(self.setup.ledger.records[seen_requests:], start=seen_requests)
            ]
            self._turns.append(turn)
            return turn

    def state(self) -> dict[str, Any]:
        with self._lock:
            summary = self.setup.ledger.summary()
            return {
                "mode": "scripted" if self.setup.scripted else "live",
                "label": self.label,
                "banner": SCRIPTED_LABEL if self.setup.scripted else LIVE_LABEL,
                "session": self.session.id,
                "main_view": [*self.session.view.core_tools, ROUTER_TOOL],
                "turns": json.loads(json.dumps(self._turns)),  # a deep copy: later turns never change this one
                "totals": {
                    "requests": summary.requests,
                    "prompt_tokens": summary.prompt_tokens,
                    "cached_tokens": summary.cached_tokens,
                    "unknown_requests": summary.unknown_requests,
                    "hit_rate": summary.hit_rate,
                    "cost": summary.cost,
                },
            }


def _calls(messages: list[Message]) -> list[dict[str, Any]]:
    """Each tool call the main model made this turn, paired with the tool message that answered it."""
    results = {m.get("tool_call_id"): str(m.get("content", "")) for m in messages if m.get("role") == "tool"}
    calls = []
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or ():
            raw = call["function"]["arguments"]
            try:
                arguments: Any = json.loads(raw)
            except json.JSONDecodeError:
                arguments = raw  # shown as the model sent it
            calls.append(
                {
                    "id": call["id"],
                    "name": call["function"]["name"],
                    "router": call["function"]["name"] == ROUTER_TOOL,
                    "arguments": arguments,
                    "result": results.get(call["id"], ""),
                    "routed_to": None,
                    "ok": False,  # until the agent's record says otherwise: a call it never ran stays failed
                }
            )
    return calls


def _request_json(index: int, turn: int, record: RequestRecord) -> dict[str, Any]:
    usage = record.usage
    return {
        "index": index,
        "turn": turn,
        "channel": record.channel,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.cached_tokens,  # None: the provider did not say (unknown, not zero)
        "cost": record.cost,  # relative input cost (uncached-token units); None: unknown provider or prices
    }


def create_app(web: WebChat, *, host: str = "127.0.0.1") -> Starlette:
    """The Starlette app: the page and its assets, ``GET /api/state`` and ``POST /api/chat``."""
    try:
        from starlette.applications import Starlette
        from starlette.concurrency import run_in_threadpool
        from starlette.middleware import Middleware
        from starlette.middleware.trustedhost import TrustedHostMiddleware
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route
    except ImportError as e:
        raise ConfigError(_EXTRA) from e

    static = resources.files("cacherouter").joinpath("web_static")

    def asset(body: bytes, media_type: str) -> Any:
        async def serve(request: Request) -> Response:
            return Response(body, media_type=media_type, headers=_HEADERS)

        return serve

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=_HEADERS)

    async def state(request: Request) -> JSONResponse:
        return JSONResponse(web.state(), headers=_HEADERS)

    async def chat(request: Request) -> JSONResponse:
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return error(415, 'send the message as JSON: {"message": "..."}')
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
            return error(403, f"cross-origin request from {origin} refused")
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the body is not valid JSON")
        message = body.get("message") if isinstance(body, dict) else None
        if not isinstance(message, str) or not message.strip():
            return error(400, "'message' must be a non-empty string")
        if len(message) > MAX_MESSAGE_CHARS:
            return error(400, f"'message' is longer than {MAX_MESSAGE_CHARS} characters")
        turn = await run_in_threadpool(web.ask, message.strip())
        return JSONResponse({"turn": turn, "state": web.state()}, headers=_HEADERS)

    routes = [
        Route(path, asset(static.joinpath(name).read_bytes(), media_type), methods=["GET"])
        for path, (name, media_type) in _ASSETS.items()
    ]
    routes += [Route("/api/state", state, methods=["GET"]), Route("/api/chat", chat, methods=["POST"])]
    # Bound to loopback: answer loopback names only, so a rebinding DNS name cannot reach the agent's tools.
    allowed = [*LOOPBACK_NAMES, host] if host in LOOPBACK_NAMES else ["*"]
    return Starlette(routes=routes, middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=allowed)])
