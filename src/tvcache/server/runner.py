"""Running the server: one process on uvicorn (uvloop + httptools when installed), N shard processes, or a
background thread for tests and embedding, or no server at all: ``InProcessTransport`` hands an httpx client's
requests to the app in this process."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import httpx
import uvicorn
from starlette.types import ASGIApp

from ..api.errors import BAD_REQUEST, QUERY_TOO_LARGE, ErrorCode, error_body
from ..defaults import CLAIM_TTL, LEASE_TTL, MAX_BODY_BYTES, env_token
from ..errors import InvalidInput
from ..policies import Budget
from .app import Guard, ServerSettings, create_app
from .hot import HotRequest, HotRoutes
from .service import CacheService

__all__ = ["AppThread", "InProcessTransport", "ServerThread", "is_loopback", "serve", "serve_shards"]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_token(host: str, token: str | None) -> None:
    if token is None and not is_loopback(host):
        raise InvalidInput(
            f"binding {host} exposes the cache beyond this machine: pass --token (or set TVCACHE_TOKEN); "
            "clients then send 'Authorization: Bearer <token>'"
        )


# Room for the path and the rest of the request head around a query string of the maximum size.
_HEAD_ROOM = 64 * 1024


def _refusal(code: ErrorCode, reason: str, message: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete HTTP/1.1 response with the API's JSON error body, for requests refused before they reach the app."""
    body = error_body(code, message)
    head = [b"HTTP/1.1 %d %s\r\n" % (code.status, reason.encode())]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
    return b"".join(head) + body


def http_protocol(max_query_bytes: int, parser: str = "auto", hot: HotRoutes | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol (``parser``: httptools, h11, or auto: httptools when installed) accepting
    query strings up to ``max_query_bytes`` and answering what it refuses in the API's JSON error format. With
    httptools, the ``hot`` routes' requests are answered in the parser's callbacks (see ``hot``).

    Left alone, httptools refuses any URL over 65,535 bytes (``httptools.parse_url`` keeps offsets in 16 bits) and
    h11 any request head over 16 KiB, with a plain-text ``400 Invalid HTTP request received.``: the wire format's
    ``GET /get`` of a long history would fail far below the documented limit. Here a URL up to the limit plus
    ``_HEAD_ROOM`` is parsed (the app's ``Guard`` answers 414 above ``max_query_bytes``); a longer one is refused
    with a JSON 414 as it arrives, before it is buffered whole."""
    max_url = max_query_bytes + _HEAD_ROOM
    try:
        if parser == "h11":
            raise ImportError("h11 was asked for")
        import httptools
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        if parser == "httptools":
            raise
        from uvicorn.protocols.http.h11_impl import H11Protocol

        class H11(H11Protocol):  # its head limit is set by ``h11_max_incomplete_event_size`` (see ``_config``)
            def send_400_response(self, msg: str) -> None:
                message = f"not a valid HTTP/1.1 request, or a request line and headers over {max_url} bytes"
                headers = self.server_state.default_headers
                self.transport.write(_refusal(BAD_REQUEST, "Bad Request", message, headers))
                self.transport.close()

        return H11

    class HttpTools(HttpToolsProtocol):
        url_too_long = False
        hot_request: HotRequest | None = None  # the request being answered on the hot path, and its body so far
        hot_body = b""

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            if len(self.url) > max_url:
                self.url_too_long = True
                raise ValueError("URL too long")  # stops the parser: answered by send_400_response

        def _may_answer_in_place(self) -> bool:
            """Whether answering now keeps uvicorn's order and flow: no earlier answer still to come, a client
            reading its answers, a plain keep-alive HTTP/1.1 request."""
            cycle = self.cycle
            parser = self.parser
            return (
                (cycle is None or cycle.response_complete)
                and not self.pipeline
                and not self.flow.write_paused
                and not self.transport.is_closing()
                and self.limit_concurrency is None
                and parser.get_http_version() == "1.1"
                and parser.should_keep_alive()
                and not parser.should_upgrade()
            )

        def _hot_request(self) -> HotRequest | None:
            """The hot request this one is (``hot``), or None: uvicorn's cycle takes it to the app."""
            if hot is None or len(self.url) > 65535 or not self._may_answer_in_place():
                return None  # (a longer URL is parsed below)
            try:
                parsed = httptools.parse_url(self.url)
            except httptools.HttpParserInvalidURLError:
                return None  # refused below, as uvicorn refuses it
            return hot.accept(self.parser.get_method(), parsed.path, parsed.query or b"", self.headers)

        def on_headers_complete(self) -> None:
            self.hot_request = self._hot_request()
            if self.hot_request is not None:
                self.hot_body = b""
                return  # answered when the message completes
            url = self.url
            if len(url) <= 65535:
                super().on_headers_complete()
                return
            # Too long for httptools.parse_url: let it parse the path alone, and take the query from here.
            path, _, query = url.partition(b"?")
            self.url = path
            try:
                super().on_headers_complete()
            finally:
                self.url = url  # a WebSocket upgrade replays the request line from it
            if "path" in self.scope:  # the request goes on (not an upgrade): its task has not run yet
                self.scope["query_string"] = query.partition(b"#")[0]

        def on_body(self, body: bytes) -> None:
            if self.hot_request is None:
                super().on_body(body)
                return
            self.hot_body += body  # at most hot.MAX_HOT_BODY bytes, as its content-length said

        def on_message_complete(self) -> None:
            request = self.hot_request
            if request is None or hot is None:
                super().on_message_complete()
                return
            body, self.hot_request, self.hot_body = self.hot_body, None, b""
            answer = hot.answer(request, body, self.server_state.default_headers)
            self.transport.write(answer.data)
            self.on_response_complete()  # as a finished cycle does: counted, reading resumed, keep-alive armed
            if answer.close:
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            headers = self.server_state.default_headers
            if self.url_too_long:
                message = f"query string exceeds {max_query_bytes} bytes"
                response = _refusal(QUERY_TOO_LARGE, "URI Too Long", message, headers)
            else:
                response = _refusal(BAD_REQUEST, "Bad Request", "not a valid HTTP/1.1 request", headers)
            self.transport.write(response)
            self.transport.close()

    return HttpTools


def _config(
    app: Any, *, max_query_bytes: int, parser: str = "auto", hot_path: bool = True, **kwargs: Any
) -> uvicorn.Config:
    """uvicorn's settings for ``app``; ``hot_path``: answer the app's hot routes (``Guard.hot``) in the parser."""
    hot = app.hot if hot_path and isinstance(app, Guard) else None
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    # Clients (rollout workers) keep connections open between bursts of calls: do not drop them after 5 s idle.
    return uvicorn.Config(
        app,
        loop=loop,
        http=http_protocol(max_query_bytes, parser, hot),
        h11_max_incomplete_event_size=max_query_bytes + _HEAD_ROOM,
        access_log=False,
        log_level="warning",
        timeout_keep_alive=75,
        **kwargs,
    )


def serve(
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    data_dir: str | Path | None = None,
    token: str | None = None,
    budget: Budget | None = None,
    fsync: bool = False,
    claim_ttl: float = CLAIM_TTL,
    lease_ttl: float = LEASE_TTL,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> None:
    """Serve until SIGINT/SIGTERM. Refuses a non-loopback ``host`` without a token."""
    check_token(host, token)
    service = CacheService(data_dir, budget=budget, fsync=fsync, claim_ttl=claim_ttl, lease_ttl=lease_ttl)
    tune_gc()
    try:
        settings = ServerSettings(token=token, max_body_bytes=max_body_bytes)
        app = create_app(service, settings)
        server = uvicorn.Server(_config(app, max_query_bytes=settings.max_query_bytes, host=host, port=port))
        where = "memory (nothing survives a restart)" if data_dir is None else str(data_dir)
        print(f"tvcache serve: http://{host}:{port} data: {where}", file=sys.stderr, flush=True)
        server.run()
    finally:
        service.close()


def tune_gc() -> None:
    """Graph nodes live as long as the server and are never garbage: keep the collector off them.

    Objects loaded from the journal are frozen out of collection, and young collections run less often, so a
    full collection over a large graph (tens of ms) does not stall requests; measured by ``tvcache bench server``.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def serve_shards(shards: int, *, host: str, port: int, data_dir: str | Path | None, argv: Sequence[str]) -> int:
    """Start ``shards`` server processes on consecutive ports (data in ``data_dir/shard-<i>``); wait for them."""
    children: list[subprocess.Popen[bytes]] = []
    urls = []
    for index in range(shards):
        args = [sys.executable, "-m", "tvcache.cli", "serve", "--host", host, "--port", str(port + index), *argv]
        if data_dir is not None:
            args += ["--data-dir", str(Path(data_dir) / f"shard-{index}")]
        children.append(subprocess.Popen(args))
        urls.append(f"http://{host}:{port + index}")
    print("tvcache serve: shards " + " ".join(urls), file=sys.stderr, flush=True)

    def stop(signum: int, frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    for child in children:
        code = max(code, child.wait())
    return code


class AppThread:
    """Any ASGI ``app`` on 127.0.0.1 in a background thread, on a free port unless ``port`` is given (tests,
    notebooks, embedding). Its URL is ``url``; ``with`` starts and stops it. ``max_query_bytes`` and ``parser``:
    see ``http_protocol`` (the app's own limit is checked by its ``Guard``); ``hot_path=False``: the app answers
    its hot routes too (the hot path's tests compare both)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        port: int = 0,
        max_query_bytes: int = ServerSettings.max_query_bytes,
        parser: str = "auto",
        hot_path: bool = True,
    ) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", port))
        self.port: int = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(_config(app, max_query_bytes=max_query_bytes, parser=parser, hot_path=hot_path))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def start(self, timeout: float = 10.0) -> Self:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop(timeout=1.0)
                raise RuntimeError(f"the server thread on {self.url} did not start within {timeout:g} s (see its log)")
            time.sleep(0.005)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class ServerThread(AppThread):
    """A tvcache server for ``service`` on 127.0.0.1 in a background thread, on a free port (tests, notebooks,
    embedding). Closing the service stays with the caller."""

    def __init__(self, service: CacheService, settings: ServerSettings | None = None, *, port: int = 0) -> None:
        settings = settings or ServerSettings()
        super().__init__(create_app(service, settings), port=port, max_query_bytes=settings.max_query_bytes)
        self.service = service


def default_token() -> str | None:
    return env_token()


class InProcessTransport(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """An httpx transport, blocking and async, that serves requests with ``app`` in this process (no socket):
    ``RemoteCache(url, transport=InProcessTransport(create_app(service)))`` runs the real app, middleware
    included. The app runs on one event loop of its own (a daemon thread), whichever thread or loop sends the
    request, so its claims and long-polls see one loop as under uvicorn; ``shutdown()`` stops it (clients closing
    do not: one transport may serve several clients, blocking and async). The app's lifespan (the sweeper of
    expired claims and leases) is not run: call ``service.sweep()``."""

    def __init__(self, app: ASGIApp, *, client: tuple[str, int] = ("127.0.0.1", 123)) -> None:
        self._asgi = httpx.ASGITransport(app=app, client=client)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tvcache-in-process", daemon=True)
        self._thread.start()

    async def _serve(self, request: httpx.Request) -> httpx.Response:
        response = await self._asgi.handle_async_request(request)
        content = await response.aread()
        return httpx.Response(response.status_code, headers=response.headers, content=content, request=request)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        return asyncio.run_coroutine_threadsafe(self._serve(request), self._loop).result()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        future = asyncio.run_coroutine_threadsafe(self._serve(request), self._loop)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    def shutdown(self) -> None:
        """Stop the app's loop (idempotent); requests sent after it fail."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
