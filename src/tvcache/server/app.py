"""The HTTP face of ``CacheService``: a Starlette app (measured ~3x the throughput of FastAPI on this stack,
see docs/server.md), pydantic validation, bearer-token auth, request size limits, an OpenAPI document built from
the same models that validate requests, Prometheus metrics and the reference TVCache routes.

The native routes are the one table ``tvcache.api.routes.ROUTES`` (served through ``dispatch.Dispatcher``, which
Ray's shard actors use too). Errors are JSON ``{"error": {"type": ..., "message": ...}}`` with the statuses of the
one table ``tvcache.api.errors``: 422 for a body or query that does not fit the schema (with pydantic's list of
problems), 400 for a value the cache cannot accept, 404 for an unknown node, claim or lease, 401 for a missing or
wrong token, 409 for ids of another server instance, 413/414 for an oversized body or query string.

The two lookups clients make before every call are also answered from the HTTP parser, past these layers but
through their checks and handlers (``hot``; ``create_app`` hands them to the server as ``Guard.hot``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from ..api import models as m
from ..api.errors import (
    BODY_TOO_LARGE,
    INSTANCE_CHANGED,
    INVALID_INPUT,
    METHOD_NOT_ALLOWED,
    NOT_FOUND,
    QUERY_TOO_LARGE,
    UNAUTHORIZED,
    VALIDATION,
    ErrorCode,
)
from ..api.params import parse_query
from ..api.routes import Route as ApiRoute
from ..defaults import MAX_BODY_BYTES
from .dashboard import OPEN_PATHS, dashboard_routes
from .dispatch import Dispatcher, Refused, Reply, dumps, refusal, refused
from .hot import HotRoutes
from .metrics import Histogram, render
from .service import CacheService
from .wire import WIRE_ROUTES, WireCompat, WireRoute

__all__ = ["Guard", "ServerSettings", "create_app"]


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """Limits and policies of one server process."""

    token: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    max_query_bytes: int = 1024 * 1024
    sweep_interval: float = 1.0


def _json(value: Any, status: int = 200) -> Response:
    return Response(dumps(value), status_code=status, media_type="application/json")


def _reply(reply: Reply) -> Response:
    return Response(reply.body, status_code=reply.status, media_type=reply.media_type)


def _refused(code: ErrorCode, message: str) -> Response:
    return _reply(refused(code, message))


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Refused(BODY_TOO_LARGE, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Refused(BODY_TOO_LARGE, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class Server:
    """Routes bound to one service: the native table (``tvcache.api.routes``, served by a ``Dispatcher``), the
    reference routes (``wire.WIRE_ROUTES``), the OpenAPI document and the dashboard."""

    def __init__(self, service: CacheService, settings: ServerSettings) -> None:
        self.service = service
        self.settings = settings
        self.wire = WireCompat(service)
        self.latency = Histogram()
        self.statuses: dict[str, int] = {}
        own = {"stats": self.stats, "healthz": self.healthz, "metrics": self.metrics}
        self.dispatcher = Dispatcher(service, latency=self.latency, handlers=own)

    # -------------------------------------------------------------- the HTTP process's own handlers

    def stats(self) -> dict[str, Any]:
        return self.service.stats() | self.wire.stats()

    def healthz(self) -> dict[str, Any]:
        return {"status": "ok", "version": __version__}

    def metrics(self) -> str:
        return render(self.stats(), self.latency, self.statuses)

    # -------------------------------------------------------------- endpoints

    def native_endpoint(self, route: ApiRoute[Any]) -> Callable[[Request], Awaitable[Response]]:
        limit = self.settings.max_body_bytes
        answer = self.dispatcher.answer

        async def endpoint(request: Request) -> Response:
            try:
                body = None if route.body is None else await _read_body(request, limit)
            except Refused as error:
                return _refused(error.code, error.message)
            return _reply(await answer(route, body, request.query_params))

        return endpoint

    def wire_answer(self, route: WireRoute, given: Callable[[], Any], task_header: str | None) -> Reply:
        """Serve a reference route (``wire.WIRE_ROUTES``): ``given()`` parses the request (its validated body or
        its query), ``task_header`` is the ``X-Task-Name`` the released client sends for a sharding proxy. The
        app's endpoints and the hot path (``hot``) both answer through here."""
        try:
            parsed = given()
            started = time.perf_counter()
            result = route.call(self.wire, parsed, task_header)
            if route.timed:
                self.latency.observe(route.path, time.perf_counter() - started)
        except Exception as error:
            answer = refusal(error)
            if answer is None:
                raise
            return answer
        if isinstance(result, tuple):
            return Reply(result[0], dumps(result[1]))
        return Reply(200, dumps(result))

    def wire_endpoint(self, route: WireRoute) -> Callable[[Request], Awaitable[Response]]:
        """A reference route as a Starlette endpoint: the JSON body or the query string."""
        limit = self.settings.max_body_bytes
        model = route.body

        async def endpoint(request: Request) -> Response:
            if model is not None:
                try:
                    body = await _read_body(request, limit)
                except Refused as error:
                    return _refused(error.code, error.message)

                def given() -> Any:
                    return model.model_validate_json(body)
            else:

                def given() -> Any:
                    return parse_query(request.query_params, route.query)

            return _reply(self.wire_answer(route, given, request.headers.get("x-task-name")))

        return endpoint

    async def openapi(self, request: Request) -> Response:
        return _json(self.openapi_document())

    # -------------------------------------------------------------- assembly

    def routes(self) -> list[Route]:
        return [
            *(Route(r.path, self.native_endpoint(r), methods=[r.method]) for r in self.dispatcher.served()),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            *(Route(route.path, self.wire_endpoint(route), methods=[route.method]) for route in WIRE_ROUTES),
            *dashboard_routes(),
        ]

    def openapi_document(self) -> dict[str, Any]:
        native = self.dispatcher.served()
        models: list[type[BaseModel]] = [m.ErrorOut]
        for route in native:
            models += [model for model in (route.body, route.reply) if isinstance(model, type)]
        models += [route.body for route in WIRE_ROUTES if route.body is not None]
        unique = list(dict.fromkeys(models))
        _, schema = models_json_schema(
            [(model, "validation") for model in unique], ref_template="#/components/schemas/{model}"
        )
        components = schema.get("$defs", {})

        def ref(model: type[BaseModel]) -> dict[str, Any]:
            return {"$ref": f"#/components/schemas/{model.__name__}"}

        documented = (INVALID_INPUT, UNAUTHORIZED, NOT_FOUND, BODY_TOO_LARGE, VALIDATION)
        errors = {
            str(code.status): {
                "description": code.description,
                "content": {"application/json": {"schema": ref(m.ErrorOut)}},
            }
            for code in documented
        }

        def operation(summary: str, response: dict[str, Any], request: dict[str, Any] | None = None,
                      parameters: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
            op: dict[str, Any] = {
                "summary": summary,
                "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": response}}}}
                | errors,
            }
            if request is not None:
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": request}}}
            if parameters:
                op["parameters"] = parameters
            return op

        def query(name: str, *, required: bool = True, repeated: bool = False) -> dict[str, Any]:
            schema: dict[str, Any] = {"type": "string"}
            if repeated:
                schema = {"type": "array", "items": {"type": "string"}}
            return {"name": name, "in": "query", "required": required, "schema": schema, "explode": True}

        paths: dict[str, dict[str, Any]] = {}
        for route in native:
            reply = route.reply
            response = ref(reply) if isinstance(reply, type) else {"type": reply}
            # task_id first, as clients read it (the table lists parameters in the order they are checked)
            names = sorted((p for p in route.query), key=lambda p: p.name != "task_id")
            parameters = [query(p.name, required=p.required) for p in names]
            paths.setdefault(route.path, {})[route.method.lower()] = operation(
                route.summary,
                response,
                None if route.body is None else ref(route.body),
                parameters=parameters,
            )
        wire = "Reference TVCache wire format (docs/wire-compat.md): "
        task_header = {
            "name": "X-Task-Name",
            "in": "header",
            "required": False,
            "schema": {"type": "string"},
            "description": "the request's task, for a sharding proxy; must agree with task_name ('__admin__': none)",
        }
        for wire_route in WIRE_ROUTES:
            parameters = [query(q.name, required=q.required, repeated=q.repeated) for q in wire_route.query]
            paths.setdefault(wire_route.path, {})[wire_route.method.lower()] = operation(
                wire + wire_route.summary,
                {"type": "object"},
                None if wire_route.body is None else ref(wire_route.body),
                parameters=[*parameters, task_header],
            )
        document: dict[str, Any] = {
            "openapi": "3.1.0",
            "info": {"title": "tvcache", "version": __version__},
            "paths": paths,
            "components": {"schemas": components},
        }
        if self.settings.token is not None:
            document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            document["security"] = [{"bearer": []}]
        return document


class Guard:
    """Bearer-token auth and a query-string limit in front of every route of ``app``, and a count of responses
    by status.

    ``token``: every request needs ``Authorization: Bearer <token>`` (None: no auth), except ``open_paths`` --
    by default ``/healthz`` and the dashboard's static page and assets (they hold no data; the page sends the
    token with each of its ``/v1`` requests, see ``dashboard``). ``statuses``: a dict counting responses by
    status code (None: not counted).

    WebSocket connections are held to the same rules (no route serves one today; a future one must not be open
    by accident): refused ones are closed before the handshake completes with code 1008, policy violation, which
    the HTTP server turns into a 403 response."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str | None,
        open_paths: frozenset[str] = OPEN_PATHS,
        max_query_bytes: int = ServerSettings.max_query_bytes,
        statuses: dict[str, int] | None = None,
    ) -> None:
        self.app = app
        self.expected = None if token is None else f"Bearer {token}".encode()
        self.open_paths = open_paths
        self.max_query_bytes = max_query_bytes
        self.statuses = statuses
        # Routes the HTTP server may answer from its parser, past this app (see ``hot``); None: none.
        self.hot: HotRoutes | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        counted = send if self.statuses is None else _counting(send, self.statuses)
        if not self._authorized(scope["path"], scope["headers"]):
            response = _refused(UNAUTHORIZED, "missing or wrong bearer token (Authorization: Bearer ...)")
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, counted)
            return
        if len(scope.get("query_string", b"")) > self.max_query_bytes:
            limit = self.max_query_bytes
            await _refused(QUERY_TOO_LARGE, f"query string exceeds {limit} bytes")(scope, receive, counted)
            return
        await self.app(scope, receive, counted)

    def admits(self, path: str, headers: list[tuple[bytes, bytes]], query_string: bytes) -> bool:
        """Whether a request passes both checks (the hot path answers only such requests itself)."""
        return self._authorized(path, headers) and len(query_string) <= self.max_query_bytes

    def _authorized(self, path: str, headers: list[tuple[bytes, bytes]]) -> bool:
        if self.expected is None or path in self.open_paths:
            return True
        given = dict(headers).get(b"authorization", b"")
        return hmac.compare_digest(given, self.expected)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._authorized(scope["path"], scope["headers"]):
            reason = "missing or wrong bearer token (Authorization: Bearer ...)"
        elif len(scope.get("query_string", b"")) > self.max_query_bytes:
            reason = f"query string exceeds {self.max_query_bytes} bytes"
        else:
            await self.app(scope, receive, send)
            return
        message = await receive()  # the ASGI server's "websocket.connect"; closing now refuses the handshake
        if message["type"] == "websocket.connect":
            await send({"type": "websocket.close", "code": 1008, "reason": reason})


def _counting(send: Send, statuses: dict[str, int]) -> Send:
    async def counted(message: Any) -> None:
        if message["type"] == "http.response.start":
            status = str(message["status"])
            statuses[status] = statuses.get(status, 0) + 1
        await send(message)

    return counted


INSTANCE_HEADER = "X-TVCache-Instance"
_INSTANCE_NAME = INSTANCE_HEADER.lower().encode()


class InstanceCheck:
    """Node ids mean something only within one server instance (``CacheService.instance``): every response names
    the instance that answered, and a request naming the instance its ids came from is refused with 409 when
    that is not this one, before it reads or writes a state the client never saw (a restarted server hands out
    the same ids for other states). Requests without the header are served as before."""

    def __init__(self, app: ASGIApp, service: CacheService) -> None:
        self.app = app
        self.service = service

    def header(self) -> tuple[bytes, bytes]:
        """The header every response carries: this instance's id."""
        return _INSTANCE_NAME, self.service.instance.encode()

    def admits(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a request names this instance, or none."""
        expected = dict(headers).get(_INSTANCE_NAME)
        return expected is None or expected == self.service.instance.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        instance = self.service.instance
        header = self.header()

        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        if not self.admits(scope["headers"]):
            expected = dict(scope["headers"])[header[0]]
            message = (
                f"this server is instance {instance}, not {expected.decode(errors='replace')[:64]}: it restarted, "
                "and the node ids the request names may be other states now; drop them and look the history up again"
            )
            await _refused(INSTANCE_CHANGED, message)(scope, receive, tagged)
            return
        await self.app(scope, receive, tagged)


def create_app(service: CacheService, settings: ServerSettings | None = None) -> ASGIApp:
    """The ASGI app serving ``service``. Closing the service stays with the caller."""
    settings = settings or ServerSettings()
    server = Server(service, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async def sweep() -> None:
            while True:
                await asyncio.sleep(settings.sweep_interval)
                service.sweep()

        task = asyncio.create_task(sweep())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def not_found(request: Request, exc: Exception) -> Response:
        return _refused(NOT_FOUND, f"no route {request.method} {request.url.path}")

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return _refused(METHOD_NOT_ALLOWED, f"{request.method} is not allowed on {request.url.path}")

    app = Starlette(routes=server.routes(), lifespan=lifespan, exception_handlers={404: not_found, 405: not_allowed})
    app.state.server = server
    checked = InstanceCheck(app, service)
    guard = Guard(checked, token=settings.token, max_query_bytes=settings.max_query_bytes, statuses=server.statuses)

    def admits(path: str, headers: list[tuple[bytes, bytes]], query_string: bytes) -> bool:
        return guard.admits(path, headers, query_string) and checked.admits(headers)

    guard.hot = HotRoutes(
        wire_answer=server.wire_answer,
        dispatcher=server.dispatcher,
        admits=admits,
        instance_header=checked.header,
        statuses=server.statuses,
        max_body_bytes=settings.max_body_bytes,
    )
    return guard
