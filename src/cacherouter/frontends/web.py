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

Turns on the one session run one at a time, each in a worker thread; the page, its assets and ``GET /api/state``
never wait for a running turn (the state shows it as pending). Any failure inside a turn becomes an error turn on
the page, with its traceback in the server log only.

The conversation state (:class:`WebChat`) is standard-library only; the Starlette app imports its framework lazily
and names the extra to install when it is missing. To serve it from a background thread (tests, embedding), use
tvcache's helper: ``with AppThread(create_app(web)) as thread: ... thread.url`` (``tvcache.server.runner``).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

from ..channels.conversation import ChatSession
from ..errors import CacheRouterError, ConfigError
from ..models.accounting import Ledger, RequestRecord
from ..models.base import Message
from ..prompts import ROUTER_TOOL
from .chat import MAX_MESSAGE_CHARS, SCRIPTED_LABEL, ChatSetup, known_cost, message_too_long

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = ["LIVE_LABEL", "MAX_MESSAGE_CHARS", "WebChat", "create_app"]

LIVE_LABEL = "Live models (OpenAI-compatible endpoints from CACHEROUTER_*); cache figures are provider-reported"
# The largest /api/chat body read: a message at the limit with every character JSON-escaped (at most 12 bytes).
MAX_BODY_BYTES = 12 * MAX_MESSAGE_CHARS + 1024
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
_log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class _Running:
    """The turn a worker thread is running now, as far as the page may know it."""

    index: int
    query: str
    seen_requests: int  # the ledger's length when the turn began: later records are this turn's requests


class WebChat:
    """One conversation shown in the browser: turns run one at a time, each recorded as JSON for the page.

    Two locks: ``_turn_lock`` is held for a whole turn (turns on one session never interleave); ``_state_lock``
    only while the turn list changes or is copied, so reading the state never waits for a model or a tool.
    """

    def __init__(self, setup: ChatSetup, session: ChatSession) -> None:
        self.setup = setup
        self.session = session
        self._turn_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._turns: list[dict[str, Any]] = []
        self._running: _Running | None = None

    @property
    def label(self) -> str:
        return "SCRIPTED" if self.setup.scripted else "provider-reported"

    def ask(self, query: str) -> dict[str, Any]:
        """Run one turn through the agent and return it as the page shows it; any failure is a turn too."""
        with self._turn_lock:
            seen_messages = len(self.session.full)
            seen_requests = len(self.setup.ledger.records)
            with self._state_lock:
                index = len(self._turns)
                self._running = _Running(index=index, query=query, seen_requests=seen_requests)
            turn: dict[str, Any] = {"index": index, "query": query, "pending": False}
            try:
                turn.update(self._run(query, seen_messages))
            finally:  # even a BaseException must not leave the turn pending forever
                turn["requests"] = _requests_json(index, self.setup.ledger.records, seen_requests)
                with self._state_lock:
                    if "path" in turn:
                        self._turns.append(turn)
                    self._running = None
            return turn

    def _run(self, query: str, seen_messages: int) -> dict[str, Any]:
        """The outcome of one turn: the answer and the calls the agent made, or the error it ended with."""
        try:
            answer = self.setup.agent.ask(self.session, query)
        except Exception as e:
            if isinstance(e, CacheRouterError):
                error = str(e)
            else:  # a bug or an answer nobody foresaw: the page gets the message, the log gets the traceback
                _log.exception("web turn failed: %s", query[:200])
                error = f"internal error: {type(e).__name__}: {str(e)[:500]} (the traceback is in the server log)"
            # Tool calls the agent stored before the failure (an aborted turn) ran: show them, status unknown.
            calls = _calls(self.session.full[seen_messages:])
            for call in calls:
                call["ok"] = None
            return {"answer": None, "error": error, "path": "error", "deep_thinking": [], "calls": calls}
        calls = _calls(self.session.full[seen_messages:])
        for call, record in zip(calls, answer.calls, strict=False):
            call.update(routed_to=record.routed_to, ok=record.ok)
        return {
            "answer": answer.text,
            "error": None,
            "path": answer.path,
            "deep_thinking": list(answer.deep_thinking),
            "calls": calls,
        }

    def state(self) -> dict[str, Any]:
        """Everything the page shows; never waits for a running turn, which appears as ``pending``."""
        with self._state_lock:
            turns = json.loads(json.dumps(self._turns))  # a deep copy: later turns never change this one
            running = self._running
        records = list(self.setup.ledger.records)  # one snapshot for the pending turn and the totals
        if running is not None:
            turns.append(
                {
                    "index": running.index,
                    "query": running.query,
                    "pending": True,
                    "answer": None,
                    "error": None,
                    "path": "pending",
                    "deep_thinking": [],
                    "calls": [],
                    "requests": _requests_json(running.index, records, running.seen_requests),
                }
            )
        summary = Ledger(records=records).summary()
        cost, unknown_cost = known_cost(records)
        return {
            "mode": "scripted" if self.setup.scripted else "live",
            "label": self.label,
            "banner": SCRIPTED_LABEL if self.setup.scripted else LIVE_LABEL,
            "session": self.session.id,
            "main_view": [*self.session.view.core_tools, ROUTER_TOOL],
            "max_message_chars": MAX_MESSAGE_CHARS,
            "turns": turns,
            "totals": {
                "requests": summary.requests,
                "prompt_tokens": summary.prompt_tokens,
                "cached_tokens": summary.cached_tokens,
                "unknown_requests": summary.unknown_requests,
                "hit_rate": summary.hit_rate,
                "cost": cost,  # the requests of known cost; None if there is none
                "unknown_cost_requests": unknown_cost,
            },
        }


def _calls(messages: list[Message]) -> list[dict[str, Any]]:
    """Each tool call the main model made this turn, paired with the tool message that answered it.

    A call's answer is looked for only among the tool messages right after its own assistant message: ids repeat
    across rounds with providers that omit them (and may repeat within one reply), so a turn-wide id map would
    pair calls with other rounds' results.
    """
    calls = []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        answers = []
        for following in messages[index + 1 :]:
            if following.get("role") != "tool":
                break
            answers.append(following)
        for call in message.get("tool_calls") or ():
            answer = next((a for a in answers if a.get("tool_call_id") == call["id"]), None)
            if answer is not None:
                answers.remove(answer)  # answers one call only, even if the id repeats
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
                    "result": "" if answer is None else str(answer.get("content", "")),
                    "routed_to": None,
                    "ok": False,  # until the agent's record says otherwise: a call it never ran stays failed
                }
            )
    return calls


def _requests_json(turn: int, records: list[RequestRecord], start: int) -> list[dict[str, Any]]:
    return [_request_json(index, turn, record) for index, record in enumerate(records[start:], start=start)]


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

    static = resources.files("cacherouter.frontends").joinpath("web_static")

    def asset(body: bytes, media_type: str) -> Any:
        async def serve(request: Request) -> Response:
            return Response(body, media_type=media_type, headers=_HEADERS)

        return serve

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=_HEADERS)

    async def state(request: Request) -> JSONResponse:
        return JSONResponse(web.state(), headers=_HEADERS)

    async def read_body(request: Request) -> bytes | None:
        """The request body, or None if it exceeds MAX_BODY_BYTES. The excess is read and dropped, never kept:
        a client still sending would see the connection reset instead of the error message."""
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size <= MAX_BODY_BYTES:
                chunks.append(chunk)
        return b"".join(chunks) if size <= MAX_BODY_BYTES else None

    async def chat(request: Request) -> JSONResponse:
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return error(415, 'send the message as JSON: {"message": "..."}')
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
            return error(403, f"cross-origin request from {origin} refused")
        raw = await read_body(request)
        if raw is None:
            return error(
                413,
                f"the body is larger than {MAX_BODY_BYTES:,} bytes; a message may have at most "
                f"{MAX_MESSAGE_CHARS:,} characters",
            )
        try:
            body = json.loads(raw)
        except ValueError:
            return error(400, "the body is not valid JSON")
        message = body.get("message") if isinstance(body, dict) else None
        if not isinstance(message, str) or not message.strip():
            return error(400, "'message' must be a non-empty string")
        refused = message_too_long(message.strip())
        if refused is not None:
            return error(400, refused)
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
