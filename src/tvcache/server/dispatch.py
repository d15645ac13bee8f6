"""The native API's route table (``tvcache.api.routes``) bound to a ``CacheService``: one code path from a request's
bytes to the answer's, and from an exception to its refusal (``tvcache.api.errors``).

The Starlette app (``tvcache.server.app``) wraps it in endpoints; a Ray shard actor calls ``dispatch`` with what
the HTTP client would have sent (``tvcache.integrations.ray.shards``). Neither maps an error or a route itself.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from ..api.errors import METHOD_NOT_ALLOWED, NOT_FOUND, VALIDATION, ErrorCode, code_of, error_body
from ..api.params import parse_query, query_values
from ..api.routes import ROUTES, Route
from ..api.routes import route as find_route
from ..errors import InvalidInput
from .metrics import Histogram

__all__ = ["Dispatcher", "Refused", "Reply", "refusal"]

JSON = "application/json"
PROMETHEUS = "text/plain; version=0.0.4"


@dataclass(frozen=True, slots=True)
class Reply:
    """An answer: its status, its body and the body's media type."""

    status: int
    body: bytes
    media_type: str = JSON


class Refused(Exception):
    """A request the HTTP layer refuses before any operation runs (too large, a bad query parameter)."""

    def __init__(self, code: ErrorCode, message: str, detail: Any = None) -> None:
        super().__init__(message)
        self.code, self.message, self.detail = code, message, detail


# Built once: ``json.dumps`` with options builds an encoder per call, a tenth of a /get hit (py-spy).
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def dumps(value: Any) -> bytes:
    return _ENCODER.encode(value).encode()


def refused(code: ErrorCode, message: str, detail: Any = None, *, error: BaseException | None = None) -> Reply:
    return Reply(code.status, error_body(code, message, detail, error=error))


def refusal(error: BaseException) -> Reply | None:
    """The answer to ``error`` raised while serving a request (None: not a refusal, let it propagate)."""
    if isinstance(error, Refused):
        return refused(error.code, error.message, error.detail)
    if isinstance(error, ValidationError):
        details = [
            {"loc": list(item["loc"]), "msg": item["msg"], "type": item["type"]}
            for item in error.errors(include_url=False, include_context=False, include_input=False)
        ]
        first = details[0] if details else {"loc": [], "msg": "invalid"}
        where = ".".join(str(part) for part in first["loc"]) or "body"
        return refused(VALIDATION, f"{where}: {first['msg']}", details)
    code = code_of(error)
    if code is None:
        return None
    return refused(code, str(error), error=error)


def _refusal_of(error: Exception) -> Reply:
    """The refusal answering ``error``; an error no refusal maps is raised again (the HTTP server's 500)."""
    answer = refusal(error)
    if answer is None:
        raise error
    return answer


def encode(route: Route[Any], result: Any) -> Reply:
    if isinstance(result, BaseModel):
        return Reply(200, result.model_dump_json().encode())
    if isinstance(result, str):
        return Reply(200, result.encode(), PROMETHEUS)
    return Reply(200, dumps(result))


class Dispatcher:
    """The routes of ``ROUTES`` served by ``service`` (``on="service"``) and by ``handlers`` (by handler name:
    the ``on="server"`` routes, and any service handler the HTTP process serves its own way). Routes with neither
    are not served here (a Ray shard has no ``/healthz``)."""

    def __init__(
        self, service: object, *, latency: Histogram, handlers: Mapping[str, Callable[..., Any]] | None = None
    ) -> None:
        self.latency = latency
        own = dict(handlers or {})
        self.handlers: dict[tuple[str, str], Callable[..., Any]] = {}
        for route in ROUTES:
            handler = own.get(route.handler)
            if handler is None and route.on == "service":
                handler = getattr(service, route.handler)
            if handler is not None:
                self.handlers[(route.method, route.path)] = handler

    def served(self) -> list[Route[Any]]:
        return [route for route in ROUTES if (route.method, route.path) in self.handlers]

    def serve(
        self, route: Route[Any], body: bytes | None, params: Mapping[str, str]
    ) -> Reply | Coroutine[Any, Any, Reply]:
        """Serve ``route``: the body validated by its model (a POST) or its query parameters (a GET). The answer,
        or for an async handler (``/v1/claim/wait``) a coroutine of it: the hot path (``hot``) serves sync
        handlers' routes in place."""
        try:
            handler = self.handlers[(route.method, route.path)]
            if route.body is not None:
                args: tuple[Any, ...] = (route.body.model_validate_json(body or b""),)
                kwargs: dict[str, Any] = {}
            else:
                args, kwargs = (), self._query(route, params)
            started = time.perf_counter()
            result = handler(*args, **kwargs)
            if asyncio.iscoroutine(result):
                return self._finish(route, result, started)
            return self._encoded(route, result, started)
        except Exception as error:
            return _refusal_of(error)

    async def answer(self, route: Route[Any], body: bytes | None, params: Mapping[str, str]) -> Reply:
        reply = self.serve(route, body, params)
        return reply if isinstance(reply, Reply) else await reply

    async def _finish(self, route: Route[Any], pending: Coroutine[Any, Any, Any], started: float) -> Reply:
        try:
            return self._encoded(route, await pending, started)
        except Exception as error:
            return _refusal_of(error)

    def _encoded(self, route: Route[Any], result: Any, started: float) -> Reply:
        if route.timed:
            self.latency.observe(route.path, time.perf_counter() - started)
        return encode(route, result)

    def is_async(self, route: Route[Any]) -> bool:
        """Whether ``route``'s handler is a coroutine function (its answer waits on the event loop)."""
        return inspect.iscoroutinefunction(self.handlers[(route.method, route.path)])

    async def dispatch(self, method: str, path: str, body: bytes | None, params: Mapping[str, str]) -> Reply:
        """Serve ``method path`` as the HTTP app would, routing included."""
        route = find_route(method, path)
        if route is not None and (method, path) in self.handlers:
            return await self.answer(route, body, params)
        if any(key[1] == path for key in self.handlers):
            return refused(METHOD_NOT_ALLOWED, f"{method} is not allowed on {path}")
        return refused(NOT_FOUND, f"no route {method} {path}")

    @staticmethod
    def _query(route: Route[Any], params: Mapping[str, str]) -> dict[str, Any]:
        try:
            return parse_query(query_values(params), route.query)
        except InvalidInput as error:
            raise Refused(VALIDATION, str(error)) from error
