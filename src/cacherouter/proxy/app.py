"""``cacherouter proxy``: an OpenAI- or Anthropic-compatible HTTP endpoint that keeps the provider's prompt cache.

An agent points its base URL at the proxy and sends its full ``tools=[...]`` with every request, as it always
does. Per request the proxy:

1. reads the client's tools (its registry for this request: a tool that appears, changes or vanishes is seen at
   once) and finds the session's **view** -- the ``--core`` tools, or all of the session's first request's tools,
   as the client defined them then, plus ``INTERNAL_ROUTER``, rendered once to canonical JSON;
2. sends the provider the client's body with ``tools`` replaced by that view (every other member as the client
   sent it, in its order: parsed order-preserving, re-serialised with one fixed set of separators), a
   ``tool_choice`` naming a tool outside the view pointed at ``INTERNAL_ROUTER``, and the history rewritten back to
   what the provider itself produced (see :mod:`cacherouter.proxy.routing`);
3. turns each ``INTERNAL_ROUTER`` call of the reply into a call of the client's own tool (router model: a
   sub-call to the same upstream picks and fills the tool; otherwise ``{"tool", "arguments"}`` names it), under an
   id that carries the original call. Calls the proxy answers itself (a retrieval search, arguments that do not
   fit, a view tool the client no longer offers) are answered in hidden rounds to the provider, at most
   ``max_hidden_rounds`` in a row, and remembered in the bounded :class:`~cacherouter.proxy.routing.TurnStore`.

A request without ``tools`` goes to the provider byte for byte, and its answer comes back byte for byte (streamed
as it arrives). Answers to requests with tools are read whole before the client gets them (the rewrite needs the
whole reply): a stream is replayed event for event when nothing in it was rewritten, and re-issued as an
equivalent stream when something was. The proxy never retries (the client's SDK does); provider errors come back
with their status and body.

Stateless or not: the routed calls (the common case) are rewritten from the request alone, so a restarted proxy or
any number of proxy processes give the same provider-facing bytes. State lives in two bounded in-memory LRUs: the
views of sessions without ``--core`` (after a restart, a session's view is rebuilt from the next request's tools:
one cache miss) and the hidden rounds (after a restart, the provider sees the conversation without them).

Auth headers (``Authorization``, ``x-api-key``, ``anthropic-version``, ``anthropic-beta`` and the OpenAI
organisation/project headers) are passed to the provider and nowhere else: never logged, never stored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..channels.relevance import make_ranker
from ..channels.router import RouterConfig, compress_task, filter_candidates, router_arguments
from ..errors import ConfigError
from ..prompts import ROUTER_TOOL
from .dialect import Dialect, DialectError
from .routing import (
    Answered,
    ClientTool,
    ProviderCall,
    Routed,
    StoredTurn,
    ToolView,
    TurnStore,
    dumps,
    encode_routed_id,
    parse_router_arguments,
    resolve_deterministic,
)
from .stats import ProxyStats

if TYPE_CHECKING:
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import Response

__all__ = ["APIS", "Proxy", "ProxyConfig", "create_app"]

APIS = ("openai", "anthropic")
SESSION_HEADER = "x-cacherouter-session"
_SESSION_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_EXTRA = "the proxy needs starlette, uvicorn and httpx: pip install 'tvcache[proxy]'"
_log = logging.getLogger(__name__)

Json = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    """Settings of one proxy (see ``cacherouter proxy --help``)."""

    upstream: str  # the provider's API base, /v1 included: https://api.openai.com/v1, https://api.anthropic.com/v1
    api: str = "openai"
    core: tuple[str, ...] = ()  # empty: each session's first request's tools are its core
    router_model: str | None = None  # None: deterministic retrieval
    router: RouterConfig = field(default_factory=RouterConfig)
    provider: str | None = None  # usage dialect and prices for /stats; None: detect from the usage fields
    timeout: float = 600.0
    max_sessions: int = 1024
    max_stored_turns: int = 4096
    max_hidden_rounds: int = 4

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ConfigError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        if not re.match(r"^https?://[^/\s]+", self.upstream):
            raise ConfigError(f"upstream must be an http:// or https:// URL, got {self.upstream!r}")
        if self.max_hidden_rounds < 0 or self.max_sessions < 1 or self.max_stored_turns < 1:
            raise ConfigError("max_hidden_rounds must be 0 or more, max_sessions and max_stored_turns at least 1")


class _Reply(Exception):
    """An answer for the client that ends the request now (a provider error, an unreachable provider)."""

    def __init__(self, status: int, body: bytes, media_type: str = "application/json") -> None:
        super().__init__(status)
        self.status, self.body, self.media_type = status, body, media_type


@dataclass(frozen=True, kw_only=True)
class _Answer:
    """One provider answer: the completion it adds up to, and what to replay if nothing is rewritten."""

    completion: Json
    raw: bytes  # the body (not streamed) or the whole event stream
    events: tuple[tuple[bytes, Json | None], ...] = ()  # (raw event, its data) of a stream


class Proxy:
    """The rewrite and the provider connection; :func:`create_app` puts it behind HTTP routes."""

    def __init__(self, config: ProxyConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        from .anthropic_api import AnthropicDialect
        from .openai_api import OpenAIDialect

        self.config = config
        self.dialect: Dialect = OpenAIDialect() if config.api == "openai" else AnthropicDialect()
        self.upstream = config.upstream.rstrip("/")
        self.store = TurnStore(capacity=config.max_stored_turns)
        self.stats = ProxyStats(provider=config.provider, max_sessions=config.max_sessions)
        self.ranker = make_ranker(config.router.ranker)
        self._views: OrderedDict[str, ToolView] = OrderedDict()
        self._lock = threading.Lock()
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._marker = f"\x00cacherouter-tools-{uuid.uuid4().hex}\x00"

    # -- plumbing -----------------------------------------------------------------------------------------

    def client(self) -> httpx.AsyncClient:
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.config.timeout, transport=self._transport)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _headers(self, headers: Mapping[str, str]) -> dict[str, str]:
        forwarded = {"content-type": "application/json"}
        for name in (*self.dialect.auth_headers, "anthropic-version", "anthropic-beta", "x-api-key"):
            value = headers.get(name)
            if value is not None:
                forwarded[name] = value
        return forwarded

    def _error(self, status: int, message: str) -> _Reply:
        return _Reply(status, dumps(self.dialect.error_body(message)).encode("utf-8"))

    def session_of(self, headers: Mapping[str, str], body: Json) -> str:
        """The session a request belongs to: the client's ``x-cacherouter-session`` header, or a digest of the
        conversation's head (model and the messages up to the first user message), which every turn repeats."""
        named = headers.get(SESSION_HEADER)
        if named and _SESSION_NAME.match(named):
            return named
        head = json.dumps(self.dialect.session_head(body), sort_keys=True, ensure_ascii=False, default=str)
        return "s-" + hashlib.sha256(head.encode("utf-8")).hexdigest()[:16]

    def view_of(self, session: str, tools: Sequence[ClientTool]) -> ToolView:
        with self._lock:
            view = self._views.get(session)
            if view is not None:
                self._views.move_to_end(session)
                return view
            core = [t for t in tools if t.name in self.config.core] if self.config.core else list(tools)
            definition = self.dialect.router_definition(router_model=self.config.router_model is not None)
            view = ToolView.build(core, definition, name_of=self.dialect.name_of)
            self._views[session] = view
            while len(self._views) > self.config.max_sessions:
                self._views.popitem(last=False)
            return view

    def serialize(self, body: Json, view: ToolView) -> bytes:
        """The provider-facing body: the client's members in its order, ``tools`` the view's canonical bytes."""
        marked = {key: (self._marker if key == "tools" else value) for key, value in body.items()}
        try:
            text = dumps(marked)
        except ValueError as e:  # NaN or infinity: not JSON, and a provider would refuse it anyway
            raise self._error(400, f"the body is not valid JSON: {e}") from e
        return text.replace(dumps(self._marker), view.tools_json, 1).encode("utf-8")

    # -- one request --------------------------------------------------------------------------------------

    async def forward_raw(
        self, raw: bytes, headers: Mapping[str, str], body: Any
    ) -> tuple[int, bytes, str] | AsyncIterator[bytes]:
        """A request without tools: the body to the provider and its answer back, byte for byte. ``body`` is
        ``raw`` parsed (None if it is not JSON), for the session and the accounting only."""
        import httpx

        session = self.session_of(headers, body) if isinstance(body, dict) else "unparsed"
        stream = isinstance(body, dict) and body.get("stream") is True
        client = self.client()
        request = client.build_request(
            "POST", self.upstream + self.dialect.path, content=raw, headers=self._headers(headers)
        )
        try:
            response = await client.send(request, stream=stream)
        except httpx.HTTPError as e:
            raise self._unreachable(e) from e
        if not stream:
            if response.status_code < 400:
                self._record(session, response.content, channel="passthrough", digest="")
            return response.status_code, response.content, response.headers.get("content-type", "application/json")

        async def relay() -> AsyncIterator[bytes]:
            seen = bytearray()
            try:
                async for chunk in response.aiter_bytes():  # decoded: the client never asked for gzip
                    seen.extend(chunk)
                    yield chunk
            finally:
                await response.aclose()
                if response.status_code < 400:
                    events = _parse_events(bytes(seen))
                    usage = self.dialect.assemble([data for _, data in events if data is not None]).get("usage")
                    self.stats.record(session, usage, channel="passthrough", tools_digest="")

        if response.status_code >= 400:
            body_bytes = await response.aread()
            await response.aclose()
            return response.status_code, body_bytes, response.headers.get("content-type", "application/json")
        return relay()

    def _record(self, session: str, raw: bytes, *, channel: str, digest: str) -> None:
        try:
            answer = json.loads(raw)
        except ValueError:
            return
        if isinstance(answer, dict):
            self.stats.record(session, self.dialect.usage(answer), channel=channel, tools_digest=digest)

    def _unreachable(self, error: Exception) -> _Reply:
        return self._error(502, f"the proxy cannot reach the provider at {self.upstream}: {type(error).__name__}")

    async def _send(self, payload: bytes, headers: Mapping[str, str], *, stream: bool) -> _Answer:
        import httpx

        client = self.client()
        url = self.upstream + self.dialect.path
        try:
            if not stream:
                response = await client.post(url, content=payload, headers=self._headers(headers))
                if response.status_code >= 400:
                    raise _Reply(response.status_code, response.content, response.headers.get("content-type", ""))
                try:
                    completion = response.json()
                except ValueError as e:
                    raise self._error(502, "the provider's answer is not JSON") from e
                if not isinstance(completion, dict):
                    raise self._error(502, "the provider's answer is not a JSON object")
                return _Answer(completion=completion, raw=response.content)
            async with client.stream("POST", url, content=payload, headers=self._headers(headers)) as response:
                raw = await response.aread()
                if response.status_code >= 400:
                    raise _Reply(response.status_code, raw, response.headers.get("content-type", ""))
        except httpx.HTTPError as e:
            raise self._unreachable(e) from e
        events = _parse_events(raw)
        completion = self.dialect.assemble([data for _, data in events if data is not None])
        return _Answer(completion=completion, raw=raw, events=tuple(events))

    async def handle(self, body: Json, headers: Mapping[str, str]) -> tuple[int, bytes | list[bytes], str]:
        """One chat request with tools (``body`` as parsed, modified here): (status, body or stream events,
        media type) for the client."""
        if not isinstance(body.get("messages"), list):
            raise self._error(400, "the body must be a JSON object with a 'messages' array")
        d = self.dialect
        try:
            tools = d.client_tools(body)
        except DialectError as e:
            raise self._error(400, str(e)) from None
        session = self.session_of(headers, body)
        view = self.view_of(session, tools)
        current = {tool.name: tool for tool in tools}
        core = frozenset(view.core)
        d.set_tool_choice(body, core)
        body["messages"] = d.rewrite_history(body["messages"], session=session, store=self.store)
        stream = body.get("stream") is True
        client_wants_usage = d.prepare_stream(body) if stream else True
        hidden: list[Any] = []
        rounds = 0
        while True:
            answer = await self._send(self.serialize(body, view), headers, stream=stream)
            self.stats.record(session, d.usage(answer.completion), channel="main", tools_digest=view.digest)
            calls = d.calls(answer.completion)
            decisions = [await self._decide(call, body, headers, session, current, core) for call, _ in calls]
            for_client = [decision for decision in decisions if not isinstance(decision, Answered)]
            if not calls or for_client or rounds >= self.config.max_hidden_rounds:
                break
            reply = d.history_reply(answer.completion)
            results = [
                d.tool_result(call.id, decision.text, is_error=decision.is_error)
                for (call, _), decision in zip(calls, decisions, strict=True)
                if isinstance(decision, Answered)
            ]
            d.append_round(body, reply, results)
            hidden += d.hidden_messages(reply, results)
            rounds += 1
            self.stats.count(session, answered=len(results), hidden_rounds=1)
        replacements: list[Json | None] = []
        inserted: list[tuple[int, Json]] = []
        answered: list[Json] = []
        routed = 0
        for (call, raw_call), decision in zip(calls, decisions, strict=True):
            if decision is None:
                replacements.append(raw_call)
            elif isinstance(decision, Routed):
                routed += 1
                routed_id = encode_routed_id(call.id, call.arguments)
                replacements.append(
                    d.routed_call(raw_call, call_id=routed_id, tool=decision.tool, arguments=decision.arguments)
                )
            else:
                replacements.append(None)
                inserted.append((d.position(answer.completion, call.id), raw_call))
                answered.append(d.tool_result(call.id, decision.text, is_error=decision.is_error))
        self.stats.count(session, routed=routed, answered=len(answered))
        media = "text/event-stream" if stream else "application/json"
        if not hidden and not inserted and routed == 0:  # nothing rewritten: the provider's own bytes
            if not stream:
                return 200, answer.raw, media
            return (
                200,
                [event + b"\n\n" for event, data in answer.events if client_wants_usage or not _usage_only(d, data)],
                media,
            )
        completion = d.with_calls(answer.completion, replacements)
        if hidden or inserted:
            key = d.reply_key(completion, session=session)
            self.store.put(key, StoredTurn(before=tuple(hidden), inserted=tuple(inserted), results=tuple(answered)))
        if not stream:
            return 200, dumps(completion).encode("utf-8"), media
        return 200, d.stream_events(completion, include_usage=client_wants_usage), media

    async def _decide(
        self,
        call: ProviderCall,
        body: Json,
        headers: Mapping[str, str],
        session: str,
        current: dict[str, ClientTool],
        core: frozenset[str],
    ) -> Routed | Answered | None:
        """What becomes of one call of the reply: None = the client's own call, as the provider made it."""
        if call.name == ROUTER_TOOL:
            if self.config.router_model is None:
                return resolve_deterministic(
                    call.arguments, current, core=core, config=self.config.router, ranker=self.ranker
                )
            return await self._route_with_model(call, body, headers, session, current, core)
        if call.name in core and call.name not in current:
            return Answered(
                text=f"{call.name} is no longer available: the client stopped offering it. Use another tool, or "
                f"{ROUTER_TOOL} to find one.",
                is_error=True,
            )
        return None

    async def _route_with_model(
        self,
        call: ProviderCall,
        body: Json,
        headers: Mapping[str, str],
        session: str,
        current: dict[str, ClientTool],
        core: frozenset[str],
    ) -> Routed | Answered:
        parsed = parse_router_arguments(call.arguments)
        if isinstance(parsed, str):
            return Answered(text=parsed, is_error=True)
        if not isinstance(parsed.get("task"), str) or not parsed["task"].strip() or set(parsed) - {"task", "hint"}:
            return Answered(text=f"{ROUTER_TOOL}: give a 'task' (and an optional 'hint') only", is_error=True)
        task, hint = router_arguments(parsed)
        config = self.config.router
        registered = [current[name].registered() for name in sorted(current)]
        candidates = filter_candidates(
            f"{task} {hint}".strip(), registered, config=config, core_tools=core, ranker=self.ranker
        )
        if not candidates:
            return Answered(
                text=dumps({"status": "retry", "reason": "no available tool matches this task; rephrase it"}),
                is_error=True,
            )
        names = tuple(t.name for t in candidates)
        assert self.config.router_model is not None
        request = self.dialect.router_body(
            model=self.config.router_model,
            summary=compress_task(task, self.dialect.context_lines(body)),
            candidates=[current[name] for name in names],
            max_tokens=config.max_tokens,
        )
        answer = await self._send(dumps(request).encode("utf-8"), headers, stream=False)
        self.stats.record(session, self.dialect.usage(answer.completion), channel="router", tools_digest="")
        for chosen, _ in self.dialect.calls(answer.completion):
            if chosen.name in names:
                try:
                    arguments = json.loads(chosen.arguments) if chosen.arguments.strip() else {}
                except ValueError:
                    arguments = None
                if not isinstance(arguments, dict):
                    reason = f"the router model's arguments for {chosen.name} are not a JSON object"
                    return Answered(text=dumps({"status": "retry", "reason": reason}), is_error=True)
                return Routed(tool=chosen.name, arguments=dumps(arguments), candidates=names)
        reason = self.dialect.router_reply_text(answer.completion).strip() or "the router model called no tool"
        return Answered(text=dumps({"status": "retry", "reason": reason[:500]}), is_error=True)

    async def models(self, headers: Mapping[str, str]) -> tuple[int, bytes, str]:
        import httpx

        try:
            response = await self.client().get(self.upstream + "/models", headers=self._headers(headers))
        except httpx.HTTPError as e:
            raise self._unreachable(e) from e
        return response.status_code, response.content, response.headers.get("content-type", "application/json")


def _usage_only(dialect: Dialect, data: Json | None) -> bool:
    return data is not None and bool(dialect.is_usage_only(data))


def _parse_events(raw: bytes) -> list[tuple[bytes, Json | None]]:
    """Server-sent events: (the event's raw bytes, its ``data`` parsed as a JSON object or None)."""
    events = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        if not block.strip():
            continue
        data_lines = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
        data: Json | None = None
        if data_lines:
            try:
                parsed = json.loads(b"\n".join(data_lines))
            except ValueError:
                parsed = None
            data = parsed if isinstance(parsed, dict) else None
        events.append((block, data))
    return events


def create_app(proxy: Proxy) -> Starlette:
    """The Starlette app: the API route of ``proxy.config.api``, ``GET /v1/models``, ``/stats``, ``/metrics``, ``/``."""
    try:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
        from starlette.routing import Route
    except ImportError as e:
        raise ConfigError(_EXTRA) from e

    async def chat(request: Request) -> Response:
        raw = await request.body()
        try:
            body = _parse(raw)
            if not (isinstance(body, dict) and isinstance(body.get("tools"), list) and body["tools"]):
                outcome = await proxy.forward_raw(raw, request.headers, body)
                if isinstance(outcome, tuple):
                    status, body, media = outcome
                    return Response(body, status_code=status, media_type=media)
                return StreamingResponse(outcome, media_type="text/event-stream")
            status, answer, media = await proxy.handle(body, request.headers)
        except _Reply as reply:
            _log.info("%s %s -> %d", request.method, request.url.path, reply.status)
            return Response(reply.body, status_code=reply.status, media_type=reply.media_type or "application/json")
        if isinstance(answer, list):

            async def events() -> AsyncIterator[bytes]:
                for event in answer:
                    yield event

            return StreamingResponse(events(), media_type=media)
        return Response(answer, status_code=status, media_type=media)

    async def models(request: Request) -> Response:
        try:
            status, body, media = await proxy.models(request.headers)
        except _Reply as reply:
            return Response(reply.body, status_code=reply.status, media_type="application/json")
        return Response(body, status_code=status, media_type=media)

    async def stats(request: Request) -> Response:
        return JSONResponse(proxy.stats.to_json())

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(proxy.stats.prometheus(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def page(request: Request) -> Response:
        return HTMLResponse(_stats_page(proxy.stats.to_json(), proxy.config), headers=_PAGE_HEADERS)

    async def other_api(request: Request) -> Response:
        message = (
            f"this proxy speaks the {proxy.config.api} API (--api {proxy.config.api}); {request.url.path} is not served"
        )
        return JSONResponse(proxy.dialect.error_body(message, kind="not_found_error"), status_code=404)

    path = "/v1" + proxy.dialect.path
    other = "/v1/messages" if proxy.config.api == "openai" else "/v1/chat/completions"
    routes = [
        Route(path, chat, methods=["POST"]),
        Route(other, other_api, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/", page, methods=["GET"]),
    ]

    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await proxy.aclose()

    return Starlette(routes=routes, lifespan=lifespan)


def _parse(raw: bytes) -> Any:
    """The body as JSON (member order kept), or None: a body that is not JSON is the provider's to refuse."""
    try:
        return json.loads(raw)
    except ValueError:
        return None


_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _stats_page(data: Json, config: ProxyConfig) -> str:
    import html

    columns = (
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "cache_write_tokens",
        "hit_rate",
        "input_cost",
        "routed_calls",
    )

    def cell(value: Any) -> str:
        if value is None:
            return "n/a"
        if isinstance(value, float):
            return f"{value:.4f}"
        return html.escape(str(value))

    rows = [("total", data["total"]), *data["sessions"].items()]
    body = "".join(
        "<tr><th>" + html.escape(name) + "</th>" + "".join(f"<td>{cell(figures[c])}</td>" for c in columns) + "</tr>"
        for name, figures in rows
    )
    head = "".join(f"<th>{c.replace('_', ' ')}</th>" for c in columns)
    return (
        '<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="5">'
        "<title>cacherouter proxy</title><style>body{font:14px sans-serif}td,th{padding:2px 8px;text-align:right}"
        "</style></head><body>"
        f"<h1>cacherouter proxy</h1><p>{html.escape(config.api)} API in front of {html.escape(config.upstream)}; "
        "input cost in uncached-token units at the provider's prices (n/a: unknown prices). "
        'Raw figures: <a href="/stats">/stats</a>, <a href="/metrics">/metrics</a>.</p>'
        f"<table><tr><th>session</th>{head}</tr>{body}</table></body></html>"
    )
