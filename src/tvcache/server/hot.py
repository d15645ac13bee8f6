"""The hot routes, answered from the HTTP parser: the lookups clients make before every tool call.

Profiled under load (py-spy, ``tvcache bench server``), a ``GET /get`` hit spent about a fifth of its time looking
the history up and the rest in the layers around it: an ASGI task per request, uvicorn's ``send``, the ``Guard``
and ``InstanceCheck`` wrappers, Starlette's error middleware, routing and ``Response``. A hot request skips those
layers and none of their checks: the parser's callbacks (``runner.http_protocol``) hand it here, it is answered
in place by the functions the layers call -- the ``Guard``'s token and query-size checks, the instance check, the
route's parse, call, timing and refusal (``Server.wire_answer``, ``Dispatcher.serve``) -- and it is framed as
uvicorn frames the app's answer, its status counted. Byte for byte the same response (tests/test_server_hot_path.py).

Whatever is not plainly a hot request goes the ordinary way, to the app, which answers it as before: a request
the checks would refuse (their refusals are the app's to write), ``Expect``, an upgrade, a chunked body or one
over ``MAX_HOT_BODY``, HTTP/1.0 or ``Connection: close``, a URL too long for httptools' own parser, a request
pipelined behind one the app is still answering (answers leave in order), or one arriving while the client is not
reading its answers.
"""

from __future__ import annotations

import http
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from ..api.params import parse_query
from .dispatch import Reply
from .wire import WIRE_ROUTES, WireRoute

if TYPE_CHECKING:
    from ..api.routes import Route
    from .dispatch import Dispatcher

__all__ = ["HOT", "MAX_HOT_BODY", "Framed", "HotRequest", "HotRoutes", "RawQuery"]

# The hot routes: the reference client's lookup (``WIRE_ROUTES``) and the native one (``api.routes.ROUTES``).
HOT = frozenset({("GET", "/get"), ("POST", "/v1/lookup")})
MAX_HOT_BODY = 64 * 1024  # a lookup's body is a history of calls; larger ones are read by the app, in chunks

Headers = list[tuple[bytes, bytes]]
# ``Server.wire_answer``: a wire route's answer to a request (``given()`` parses it) and its X-Task-Name.
WireAnswer = Callable[[WireRoute, Callable[[], Any], str | None], Reply]
# Whether the app's middleware lets a request (path, headers, query string) through to its routes.
Admits = Callable[[str, Headers, bytes], bool]

_NOT_HOT = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
_TASK_HEADER = b"x-task-name"
_LENGTH = b"content-length"


def _status_line(status: int) -> bytes:
    """The status line as uvicorn's httptools protocol writes it (its ``STATUS_LINE``)."""
    try:
        phrase = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}

# Starlette's answer to an exception no refusal maps (ServerErrorMiddleware), after which uvicorn closes.
_CRASH_BODY = b"Internal Server Error"
_CRASH_TYPE = "text/plain; charset=utf-8"


class RawQuery:
    """A query string's parameters read as Starlette's ``QueryParams`` reads them (latin-1 text, then
    ``parse_qsl`` keeping blank values), grouped by name once, without its two copies of everything."""

    def __init__(self, query_string: bytes) -> None:
        grouped: dict[str, list[str]] = {}
        for name, value in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True):
            grouped.setdefault(name, []).append(value)
        self._grouped = grouped

    def getlist(self, key: str) -> list[str]:
        return self._grouped.get(key, [])


@dataclass(frozen=True, slots=True)
class HotRequest:
    """A request the hot path answers once its body (``size`` bytes) has arrived."""

    route: _Hot
    query: bytes
    task_header: str | None
    size: int


@dataclass(frozen=True, slots=True)
class Framed:
    """A whole HTTP/1.1 response; ``close``: close the connection after it (as uvicorn does after a crash)."""

    data: bytes
    close: bool = False


@dataclass(frozen=True, slots=True)
class _Hot:
    """One hot route: its path (for the ``Guard``), whether it takes a body, and how it is answered."""

    path: str
    has_body: bool
    answer: Callable[[HotRequest, bytes], Reply]


class HotRoutes:
    """The hot routes of one app (``create_app``), answered by the app's own functions: ``wire_answer`` and
    ``dispatcher`` serve the routes, ``admits`` makes the middleware's checks, ``instance_header`` is the header
    every answer carries, ``statuses`` counts answers by status (None: not counted), ``max_body_bytes`` is the
    app's body limit."""

    def __init__(
        self,
        *,
        wire_answer: WireAnswer,
        dispatcher: Dispatcher,
        admits: Admits,
        instance_header: Callable[[], tuple[bytes, bytes]],
        statuses: dict[str, int] | None,
        max_body_bytes: int,
    ) -> None:
        self.wire_answer = wire_answer
        self.dispatcher = dispatcher
        self.admits = admits
        self.instance_header = instance_header
        self.statuses = statuses
        self.max_body = min(MAX_HOT_BODY, max_body_bytes)
        self.logger = logging.getLogger("uvicorn.error")
        self.routes: dict[tuple[bytes, bytes], _Hot] = {}
        for wire in WIRE_ROUTES:
            if (wire.method, wire.path) in HOT:
                self._add(wire.method, _Hot(wire.path, False, self._wire_answer(wire)))
        for native in dispatcher.served():
            if (native.method, native.path) in HOT:
                self._add(native.method, _Hot(native.path, True, self._native_answer(native)))

    def _add(self, method: str, route: _Hot) -> None:
        self.routes[(method.encode(), route.path.encode())] = route

    def _wire_answer(self, route: WireRoute) -> Callable[[HotRequest, bytes], Reply]:
        if route.body is not None:
            raise ValueError(f"{route.path}: a hot wire route reads its query string, not a body")

        def answer(request: HotRequest, body: bytes) -> Reply:
            def given() -> Any:
                return parse_query(RawQuery(request.query), route.query)

            return self.wire_answer(route, given, request.task_header)

        return answer

    def _native_answer(self, route: Route[Any]) -> Callable[[HotRequest, bytes], Reply]:
        dispatcher = self.dispatcher
        if route.body is None or route.query or dispatcher.is_async(route):
            raise ValueError(f"{route.path}: a hot native route takes a body, no query, and answers at once")

        def answer(request: HotRequest, body: bytes) -> Reply:
            reply = dispatcher.serve(route, body, {})
            assert isinstance(reply, Reply)  # a sync handler's answer (checked above)
            return reply

        return answer

    def accept(self, method: bytes, path: bytes, query: bytes, headers: Headers) -> HotRequest | None:
        """The hot request ``method path?query headers`` is (the path as sent, not unquoted), or None: the app
        answers it."""
        route = self.routes.get((method, path))
        if route is None:
            return None
        task_header: str | None = None
        length: bytes | None = None
        for name, value in headers:
            if name in _NOT_HOT:
                return None
            if name == _LENGTH:
                if length is not None:
                    return None
                length = value
            elif name == _TASK_HEADER and task_header is None:  # Starlette's ``headers.get``: the first one
                task_header = value.decode("latin-1")
        if route.has_body:
            if length is None or not length.isdigit() or int(length) > self.max_body:
                return None
            size = int(length)
        elif length is not None:
            return None
        else:
            size = 0
        if not self.admits(route.path, headers, query):
            return None
        return HotRequest(route=route, query=query, task_header=task_header, size=size)

    def answer(self, request: HotRequest, body: bytes, default_headers: Headers) -> Framed:
        """Serve ``request``; ``default_headers``: the HTTP server's own (``date``, ``server``)."""
        try:
            reply = request.route.answer(request, body)
        except Exception as error:  # the app would log it and answer 500, then uvicorn would close
            self.logger.error("Exception in ASGI application\n", exc_info=error)
            return Framed(self._frame(Reply(500, _CRASH_BODY, _CRASH_TYPE), default_headers), close=True)
        return Framed(self._frame(reply, default_headers))

    def _frame(self, reply: Reply, default_headers: Headers) -> bytes:
        """The response as uvicorn writes the app's: status line, its default headers, then Starlette's
        ``content-length`` and ``content-type`` (hot routes answer JSON; the crash answer's text type carries
        its charset already), then the instance header; the status counted as ``Guard`` counts it."""
        statuses = self.statuses
        if statuses is not None:
            status = str(reply.status)
            statuses[status] = statuses.get(status, 0) + 1
        name, instance = self.instance_header()
        head = [_STATUS_LINES[reply.status]]
        for header, value in default_headers:
            head += [header, b": ", value, b"\r\n"]
        head.append(b"content-length: %d\r\ncontent-type: %s\r\n%s: %s\r\n\r\n" % (
            len(reply.body), reply.media_type.encode(), name, instance))  # fmt: skip
        head.append(reply.body)
        return b"".join(head)
