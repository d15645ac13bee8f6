"""The HTTP face of ``CacheService``: a Starlette app (measured ~3x the throughput of FastAPI on this stack,
see docs/server.md), pydantic validation, bearer-token auth, request size limits, an OpenAPI document built from
the same models that validate requests, Prometheus metrics and the reference TVCache routes.

Errors are JSON ``{"error": {"type": ..., "message": ...}}``: 422 for a body or query that does not fit the
schema (with pydantic's list of problems), 400 for a value the cache cannot accept, 404 for an unknown node,
claim or lease, 401 for a missing or wrong token, 413/414 for an oversized body or query string.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from ..errors import InvalidInput, TVCacheError
from . import models as m
from .dashboard import OPEN_PATHS, dashboard_routes
from .metrics import Histogram, render
from .service import CacheService, NotFound
from .wire import WIRE_ROUTES, WireCompat, WireRoute, parse_query

__all__ = ["Guard", "ServerSettings", "create_app"]


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """Limits and policies of one server process."""

    token: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_query_bytes: int = 1024 * 1024
    sweep_interval: float = 1.0


class HTTPError(Exception):
    def __init__(self, status: int, kind: str, message: str, detail: Any = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.detail = status, kind, message, detail


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _json(value: Any, status: int = 200) -> Response:
    return Response(_dumps(value), status_code=status, media_type="application/json")


def _model(value: BaseModel) -> Response:
    return Response(value.model_dump_json(), media_type="application/json")


def _error(status: int, kind: str, message: str, detail: Any = None) -> Response:
    body: dict[str, Any] = {"type": kind, "message": message}
    if detail is not None:
        body["detail"] = detail
    return _json({"error": body}, status)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, "too_large", f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, "too_large", f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _validation_detail(error: ValidationError) -> list[dict[str, Any]]:
    return [
        {"loc": list(item["loc"]), "msg": item["msg"], "type": item["type"]}
        for item in error.errors(include_url=False, include_context=False, include_input=False)
    ]


def _handle(call: Callable[[], Awaitable[Response]]) -> Callable[[], Awaitable[Response]]:
    async def run() -> Response:
        try:
            return await call()
        except HTTPError as error:
            return _error(error.status, error.kind, error.message, error.detail)
        except ValidationError as error:
            details = _validation_detail(error)
            first = details[0] if details else {"loc": [], "msg": "invalid"}
            where = ".".join(str(part) for part in first["loc"]) or "body"
            return _error(422, "validation", f"{where}: {first['msg']}", details)
        except NotFound as error:
            return _error(404, "not_found", str(error))
        except InvalidInput as error:
            return _error(400, "invalid_input", str(error))
        except TVCacheError as error:
            return _error(503, type(error).__name__, str(error))

    return run


@dataclass(frozen=True)
class JsonRoute:
    method: str
    path: str
    request: type[BaseModel] | None
    response: type[BaseModel] | None
    summary: str


class Server:
    """Routes bound to one service."""

    def __init__(self, service: CacheService, settings: ServerSettings) -> None:
        self.service = service
        self.settings = settings
        self.wire = WireCompat(service)
        self.latency = Histogram()
        self.statuses: dict[str, int] = {}

    # -------------------------------------------------------------- native API

    def native_routes(self) -> list[tuple[JsonRoute, Callable[[Any], Any]]]:
        s = self.service
        table: list[tuple[str, type[BaseModel], type[BaseModel], str, Callable[[Any], Any]]] = [
            ("/v1/lookup", m.LookupIn, m.LookupOut, "Match a history, or step from a state", s.lookup),
            ("/v1/touch", m.TouchIn, m.OkOut, "Count hits served from a client's replica", s.touch),
            ("/v1/claim", m.ClaimIn, m.ClaimOut, "Claim a missed call, or learn who executes it", s.claim),
            ("/v1/claim/heartbeat", m.HeartbeatIn, m.ClaimOut, "Renew a claim's TTL", s.heartbeat),
            ("/v1/claim/resolve", m.ResolveIn, m.OkOut, "Give up a claim (failed or uncacheable)", s.resolve),
            ("/v1/claim/wait", m.WaitIn, m.WaitOut, "Long-poll for a claimed call's result", s.wait),
            ("/v1/insert", m.InsertIn, m.InsertOut, "Record an executed call (durable on 2xx)", s.insert),
            ("/v1/snapshots/attach", m.AttachIn, m.AttachOut, "Attach a client-owned snapshot", s.attach),
            ("/v1/snapshots/lease", m.LeaseIn, m.LeaseOut, "Lease the nearest snapshot of a kind", s.lease),
            ("/v1/snapshots/release", m.ReleaseIn, m.OkOut, "Release a snapshot lease", s.release),
            ("/v1/snapshots/drop", m.DropIn, m.DropOut, "Forget a snapshot no client can fork", s.drop),
            ("/v1/tests/get", m.TestGetIn, m.TestOut, "A cached test result of a state", s.test_get),
            ("/v1/tests/put", m.TestPutIn, m.OkOut, "Store a test result of a state", s.test_put),
            (
                "/v1/tools/nondeterministic",
                m.NondeterministicIn,
                m.NondeterministicOut,
                "Never serve a tool from cache again",
                s.mark_nondeterministic,
            ),
            (
                "/v1/tools/nondeterministic/clear",
                m.ClearNondeterministicIn,
                m.ClearedOut,
                "Lift non-determinism marks (by tool and task; null: any)",
                s.clear_nondeterministic,
            ),
        ]
        return [
            (JsonRoute("POST", path, request, response, summary), method)
            for path, request, response, summary, method in table
        ]

    def json_endpoint(self, route: JsonRoute, method: Callable[[Any], Any]) -> Callable[[Request], Awaitable[Response]]:
        model = route.request
        assert model is not None
        limit = self.settings.max_body_bytes
        timed = route.path == "/v1/lookup"

        async def endpoint(request: Request) -> Response:
            async def run() -> Response:
                body = model.model_validate_json(await _read_body(request, limit))
                started = time.perf_counter()
                result = method(body)
                if asyncio.iscoroutine(result):
                    result = await result
                if timed:
                    self.latency.observe(route.path, time.perf_counter() - started)
                return _model(result)

            return await _handle(run)()

        return endpoint

    async def get_stats(self, request: Request) -> Response:
        return _json(self.service.stats() | self.wire.stats())

    async def get_tasks(self, request: Request) -> Response:
        return _model(self.service.tasks())

    async def get_graph(self, request: Request) -> Response:
        async def run() -> Response:
            return _model(self.service.export(_query(request, "task_id")))

        return await _handle(run)()

    async def get_path(self, request: Request) -> Response:
        async def run() -> Response:
            node_id = _query(request, "node_id")
            if not node_id.isdigit():
                raise HTTPError(422, "validation", "node_id must be a non-negative integer")
            return _model(self.service.path(_query(request, "task_id"), int(node_id)))

        return await _handle(run)()

    async def get_activity(self, request: Request) -> Response:
        return _model(self.service.activity_report())

    async def get_outline(self, request: Request) -> Response:
        async def run() -> Response:
            limit = request.query_params.get("limit", "2000")
            if not limit.isdigit() or not 1 <= int(limit) <= 100_000:
                raise HTTPError(422, "validation", "limit must be an integer from 1 to 100000")
            return _model(self.service.outline(_query(request, "task_id"), int(limit)))

        return await _handle(run)()

    async def get_node(self, request: Request) -> Response:
        async def run() -> Response:
            node_id = _query(request, "node_id")
            if not node_id.isdigit():
                raise HTTPError(422, "validation", "node_id must be a non-negative integer")
            return _model(self.service.node_detail(_query(request, "task_id"), int(node_id)))

        return await _handle(run)()

    async def get_nondeterministic(self, request: Request) -> Response:
        return _model(self.service.nondeterministic())

    async def healthz(self, request: Request) -> Response:
        return _json({"status": "ok", "version": __version__})

    async def metrics(self, request: Request) -> Response:
        text = render(self.service.stats() | self.wire.stats(), self.latency, self.statuses)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def openapi(self, request: Request) -> Response:
        return _json(self.openapi_document())

    # -------------------------------------------------------------- wire format

    def wire_endpoint(self, route: WireRoute) -> Callable[[Request], Awaitable[Response]]:
        """A reference route (``wire.WIRE_ROUTES``): the JSON body or the query string, and the ``X-Task-Name``
        header the released client sends for a sharding proxy."""
        limit = self.settings.max_body_bytes

        async def endpoint(request: Request) -> Response:
            async def run() -> Response:
                if route.body is not None:
                    given: Any = route.body.model_validate_json(await _read_body(request, limit))
                else:
                    given = parse_query(request.query_params, route.query)
                started = time.perf_counter()
                result = route.call(self.wire, given, request.headers.get("x-task-name"))
                if route.timed:
                    self.latency.observe(route.path, time.perf_counter() - started)
                if isinstance(result, tuple):
                    return _json(result[1], result[0])
                return _json(result)

            return await _handle(run)()

        return endpoint

    # -------------------------------------------------------------- assembly

    def routes(self) -> list[Route]:
        routes = [
            Route(route.path, self.json_endpoint(route, method), methods=[route.method])
            for route, method in self.native_routes()
        ]
        routes += [
            Route("/v1/stats", self.get_stats, methods=["GET"]),
            Route("/v1/tasks", self.get_tasks, methods=["GET"]),
            Route("/v1/graph", self.get_graph, methods=["GET"]),
            Route("/v1/path", self.get_path, methods=["GET"]),
            Route("/v1/activity", self.get_activity, methods=["GET"]),
            Route("/v1/graph/outline", self.get_outline, methods=["GET"]),
            Route("/v1/node", self.get_node, methods=["GET"]),
            Route("/v1/tools/nondeterministic", self.get_nondeterministic, methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            *(Route(route.path, self.wire_endpoint(route), methods=[route.method]) for route in WIRE_ROUTES),
            *dashboard_routes(),
        ]
        return routes

    def openapi_document(self) -> dict[str, Any]:
        native = self.native_routes()
        models: list[type[BaseModel]] = [
            *(m.ErrorOut, m.TasksOut, m.GraphOut, m.PathOut, m.NondeterministicOut),
            *(m.ActivityOut, m.OutlineOut, m.NodeOut),
        ]
        for route, _ in native:
            assert route.request is not None and route.response is not None
            models += [route.request, route.response]
        models += [route.body for route in WIRE_ROUTES if route.body is not None]
        unique = list(dict.fromkeys(models))
        _, schema = models_json_schema(
            [(model, "validation") for model in unique], ref_template="#/components/schemas/{model}"
        )
        components = schema.get("$defs", {})

        def ref(model: type[BaseModel]) -> dict[str, Any]:
            return {"$ref": f"#/components/schemas/{model.__name__}"}

        errors = {
            str(code): {"description": text, "content": {"application/json": {"schema": ref(m.ErrorOut)}}}
            for code, text in (
                (400, "a value the cache cannot accept"),
                (401, "missing or wrong bearer token"),
                (404, "unknown task, node, claim or lease"),
                (413, "body too large"),
                (422, "body does not fit the schema"),
            )
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
        for route, _ in native:
            assert route.request is not None and route.response is not None
            paths.setdefault(route.path, {})[route.method.lower()] = operation(
                route.summary, ref(route.response), ref(route.request)
            )
        obj = {"type": "object"}
        paths["/v1/stats"] = {"get": operation("Counters and sizes", obj)}
        paths["/v1/tasks"] = {"get": operation("Tasks with their sizes", ref(m.TasksOut))}
        paths["/v1/graph"] = {"get": operation("Export a task's graph", ref(m.GraphOut), parameters=[query("task_id")])}
        paths["/v1/path"] = {
            "get": operation("The nodes from the root to a node", ref(m.PathOut),
                             parameters=[query("task_id"), query("node_id")])
        }  # fmt: skip
        paths["/v1/activity"] = {"get": operation("Hits, misses and time saved by task and epoch", ref(m.ActivityOut))}
        paths["/v1/graph/outline"] = {
            "get": operation("A task's graph without results, for drawing", ref(m.OutlineOut),
                             parameters=[query("task_id"), query("limit", required=False)])
        }  # fmt: skip
        paths["/v1/node"] = {
            "get": operation("One node with its call and result", ref(m.NodeOut),
                             parameters=[query("task_id"), query("node_id")])
        }  # fmt: skip
        paths["/v1/tools/nondeterministic"]["get"] = operation(
            "Tools never served from cache", ref(m.NondeterministicOut)
        )
        paths["/healthz"] = {"get": operation("Liveness (no auth)", obj)}
        paths["/metrics"] = {"get": operation("Prometheus metrics", {"type": "string"})}
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
                obj,
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


def _query(request: Request, name: str) -> str:
    value = request.query_params.get(name)
    if not value:
        raise HTTPError(422, "validation", f"query parameter {name!r} is required")
    return value


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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        counted = send if self.statuses is None else _counting(send, self.statuses)
        if not self._authorized(scope):
            response = _error(401, "unauthorized", "missing or wrong bearer token (Authorization: Bearer ...)")
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, counted)
            return
        if len(scope.get("query_string", b"")) > self.max_query_bytes:
            limit = self.max_query_bytes
            await _error(414, "too_large", f"query string exceeds {limit} bytes")(scope, receive, counted)
            return
        await self.app(scope, receive, counted)

    def _authorized(self, scope: Scope) -> bool:
        if self.expected is None or scope["path"] in self.open_paths:
            return True
        given = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(given, self.expected)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._authorized(scope):
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


class InstanceCheck:
    """Node ids mean something only within one server instance (``CacheService.instance``): every response names
    the instance that answered, and a request naming the instance its ids came from is refused with 409 when
    that is not this one, before it reads or writes a state the client never saw (a restarted server hands out
    the same ids for other states). Requests without the header are served as before."""

    def __init__(self, app: ASGIApp, service: CacheService) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        instance = self.service.instance
        header = (INSTANCE_HEADER.lower().encode(), instance.encode())

        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        expected = dict(scope["headers"]).get(header[0])
        if expected is not None and expected != header[1]:
            message = (
                f"this server is instance {instance}, not {expected.decode(errors='replace')[:64]}: it restarted, "
                "and the node ids the request names may be other states now; drop them and look the history up again"
            )
            await _error(409, "instance_changed", message)(scope, receive, tagged)
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
        return _error(404, "not_found", f"no route {request.method} {request.url.path}")

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return _error(405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}")

    app = Starlette(routes=server.routes(), lifespan=lifespan, exception_handlers={404: not_found, 405: not_allowed})
    app.state.server = server
    checked = InstanceCheck(app, service)
    return Guard(checked, token=settings.token, max_query_bytes=settings.max_query_bytes, statuses=server.statuses)
