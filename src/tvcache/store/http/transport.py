"""The round trips of an ``HttpStore`` to one server: blocking ones on the caller's thread, long-polls,
heartbeats and batched hit counts on a background loop.

Each route is taken from the one table (``tvcache.api.routes``) by name: ``send(routes.LOOKUP, body)`` posts the
body to its path and reads the answer as its reply model. Refusals become exceptions through the one error
table (``tvcache.api.errors``). Every answer names the server instance it came from (``X-TVCache-Instance``),
handed to ``on_instance``; a request naming node ids names the instance they belong to.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from ...api.errors import client_error
from ...api.routes import Route
from ...errors import ServerError

__all__ = ["INSTANCE_HEADER", "ServerConnection"]

T = TypeVar("T")
R = TypeVar("R", bound=BaseModel)

INSTANCE_HEADER = "X-TVCache-Instance"  # tvcache.server.app.INSTANCE_HEADER (the store does not import the server)


def _body(model: BaseModel) -> bytes:
    """The request body: the fields set, as strict JSON (a NaN is refused here, not sent as null)."""
    return json.dumps(model.model_dump(exclude_unset=True), ensure_ascii=False, allow_nan=False).encode()


def _error_of(response: httpx.Response) -> tuple[str | None, str]:
    """The error type and message of a refusal."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None, response.text[:500]
    if isinstance(error, dict):
        kind = error.get("type")
        return (None if kind is None else str(kind)), str(error.get("message", error))
    return None, str(error)


def _headers(body: object, instance: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if instance is not None:
        headers[INSTANCE_HEADER] = instance
    return headers


def _model(route: Route[R]) -> type[R]:
    reply = route.reply
    if isinstance(reply, str):
        raise TypeError(f"{route.method} {route.path} answers free-form {reply}, not a model: use fetch()")
    return reply


async def _finish_background() -> None:
    """Cancel what still runs on the background loop (heartbeats of claims just resolved, waits given up) and
    let it finish, so the loop stops with no task pending."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class ServerConnection:
    """HTTP to ``url`` through ``transport`` (blocking requests) and ``async_transport`` (the background loop's);
    a transport implementing both serves both (the Ray shards')."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        timeout: float,
        transport: httpx.BaseTransport | None,
        async_transport: httpx.AsyncBaseTransport | None,
        on_instance: Callable[[str], None],
    ) -> None:
        self.url = url
        self.timeout = timeout
        self.on_instance = on_instance
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url, headers=self._headers, timeout=timeout, transport=transport)
        given: object = transport
        if async_transport is None and isinstance(given, httpx.AsyncBaseTransport):
            async_transport = given
        self._async_transport = async_transport
        self._aclient: httpx.AsyncClient | None = None
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ by route

    def send(
        self, route: Route[R], body: BaseModel | None, *, instance: str | None = None,
        params: dict[str, Any] | None = None,
    ) -> R:  # fmt: skip
        """One blocking round trip of ``route``: ``body`` (or ``params``) sent, the answer read as its model."""
        return self.request(route.method, route.path, body, _model(route), instance=instance, params=params)

    async def asend(self, route: Route[R], body: BaseModel, *, instance: str | None = None) -> R:
        """``send`` on the background loop (POST routes only)."""
        return await self.arequest(route.path, body, _model(route), instance=instance)

    def fetch(self, route: Route[Any]) -> Any:
        """A free-form JSON answer (a GET without parameters)."""
        return json.loads(self.raw(route.method, route.path, None))

    # ------------------------------------------------------------------ by path

    def request(
        self, method: str, path: str, body: BaseModel | None, reply: type[R], *, instance: str | None = None,
        params: dict[str, Any] | None = None,
    ) -> R:  # fmt: skip
        """One blocking round trip: ``body`` to ``method path``, the answer read as ``reply``. ``instance``: the
        server instance the node ids in the request belong to (the server refuses another: ``ReplicaDropped``)."""
        return reply.model_validate_json(self.raw(method, path, body, instance=instance, params=params))

    def raw(
        self, method: str, path: str, body: BaseModel | None, *, instance: str | None = None,
        params: dict[str, Any] | None = None,
    ) -> bytes:  # fmt: skip
        content = None if body is None else _body(body)
        try:
            response = self._http.request(
                method, path, content=content, params=params, headers=_headers(body, instance)
            )
        except httpx.HTTPError as error:
            raise self._unreachable(error) from error
        return self._decode(response, path)

    async def arequest(self, path: str, body: BaseModel, reply: type[R], *, instance: str | None = None) -> R:
        """``request`` for the background loop (POST only)."""
        if self._aclient is None:
            self._aclient = httpx.AsyncClient(
                base_url=self.url, headers=self._headers, timeout=self.timeout + 60, transport=self._async_transport
            )
        try:
            response = await self._aclient.post(path, content=_body(body), headers=_headers(body, instance))
        except httpx.HTTPError as error:
            raise self._unreachable(error) from error
        return reply.model_validate_json(self._decode(response, path))

    def _unreachable(self, error: httpx.HTTPError) -> ServerError:
        return ServerError(0, f"cannot reach tvcache server {self.url}: {error!r}")

    def _decode(self, response: httpx.Response, path: str) -> bytes:
        answered = response.headers.get(INSTANCE_HEADER)
        if answered is not None:
            self.on_instance(answered)
        status = response.status_code
        if status >= 400:
            kind, message = _error_of(response)
            raise client_error(status, kind, f"{self.url}{path}: HTTP {status}: {message}")
        return response.content

    # ------------------------------------------------------------------ the background loop

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        """Run ``coroutine`` on a loop on a daemon thread, started on first use."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="tvcache-remote", daemon=True)
                thread.start()
                self._loop, self._loop_thread = loop, thread
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coroutine, loop)

    @property
    def started(self) -> bool:
        """Whether the background loop runs."""
        return self._loop is not None

    def close(self) -> None:
        """Stop the background loop (cancelling what still runs on it) and close both clients."""
        loop, thread = self._loop, self._loop_thread
        if loop is not None and thread is not None:
            self.submit(_finish_background()).result(timeout=self.timeout)
            if self._aclient is not None:
                self.submit(self._aclient.aclose()).result(timeout=self.timeout)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(self.timeout)
            loop.close()
        self._http.close()
