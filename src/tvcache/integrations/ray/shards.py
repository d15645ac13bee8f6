"""Graph shards as named Ray actors, and ``RayCache``, the client that routes sessions to them.

A shard actor wraps the very ``CacheService`` that ``tvcache serve`` wraps, and answers the same native ``/v1``
operations through the same route table, dispatcher and error table as the HTTP server (``tvcache.api.routes``,
``tvcache.server.dispatch.Dispatcher``, ``tvcache.api.errors``), so claims, leases, inserts, their validation and
their refusals behave exactly as over HTTP. It is an async actor: a long-poll
(``/v1/claim/wait``) awaits on the actor's event loop without blocking other requests, just as on uvicorn.

A shard journals every insert to ``data_dir/shard-<i>`` before it answers. Shards are created with
``max_restarts=-1`` and ``max_task_retries=-1``: an actor that dies (killed, or its node removed) is restarted
by Ray, reloads its journal and the calls in flight are retried on it. Every retried operation is idempotent or
harmless (an insert of an existing call returns the existing node; a claim or lease lost with the old process is
claimed again), so nothing acknowledged is lost. ``data_dir`` must therefore be readable from wherever Ray may
restart the actor: a shared filesystem in a real cluster, any local path when every node is on one machine.

``RayCache`` is to the shard actors what ``ShardedCache`` is to HTTP servers: one ``RemoteCache`` per shard, the
same rendezvous hash over the shard names, the same session API. Each per-shard client is a plain ``RemoteCache``
over a ``RayTransport``, an httpx transport (blocking and async) that hands each request to the actor instead of a
socket; everything else (the replica graph, claims with heartbeats, long-polls on a background loop, batched hit
counts) is the HTTP client's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx
import ray
from pydantic import ValidationError
from ray.exceptions import RayError

from ...api import models as m
from ...api import routes
from ...calls import ToolSpec
from ...client.remote import RemoteCache
from ...client.sharding import ShardRouter
from ...defaults import CLAIM_TTL, LEASE_TTL
from ...errors import InvalidInput, JournalError
from ...policies import Budget
from ...server.dispatch import Dispatcher
from ...server.dispatch import Reply as Answer
from ...server.metrics import Histogram, render
from ...server.service import CacheService

__all__ = [
    "DEFAULT_NAMESPACE",
    "SHARD_PREFIX",
    "RayCache",
    "RayTransport",
    "ShardActor",
    "find_shards",
    "shard_names",
    "start_shards",
    "stop_shards",
]

DEFAULT_NAMESPACE = "tvcache"
SHARD_PREFIX = "tvcache-shard-"

Reply = tuple[int, bytes]  # (HTTP status, JSON body), what a shard actor answers

ATTACH = routes.ATTACH.path


# Handles of non-detached shards started by this process, keeping them alive until ``stop_shards``.
_HELD: dict[str, list[Any]] = {}


def shard_name(index: int) -> str:
    return f"{SHARD_PREFIX}{index}"


class ShardActor:
    """One graph shard: a ``CacheService`` answering the native API's operations (run as an async Ray actor).

    ``request`` takes the operation as the HTTP client would send it (method, path, JSON body, query) and returns
    ``(status, payload)`` with the HTTP status the server would have answered and its JSON payload, so the client
    code that decodes HTTP responses decodes these too.
    """

    def __init__(
        self,
        name: str,
        data_dir: str | None,
        *,
        fsync: bool = False,
        claim_ttl: float = CLAIM_TTL,
        lease_ttl: float = LEASE_TTL,
        budget: dict[str, Any] | None = None,
        sweep_interval: float = 1.0,
        lock_wait: float = 60.0,
    ) -> None:
        self.name = name
        self.started = time.time()
        self.service = _open_service(
            data_dir,
            budget=None if budget is None else Budget(**budget),
            fsync=fsync,
            claim_ttl=claim_ttl,
            lease_ttl=lease_ttl,
            lock_wait=lock_wait,
        )
        self._sweep_interval = sweep_interval
        self._last_sweep = time.monotonic()
        self.latency = Histogram()
        self.statuses: dict[str, int] = {}
        self.dispatcher = Dispatcher(self.service, latency=self.latency)

    async def request(self, method: str, path: str, body: bytes | None, params: dict[str, str] | None) -> Reply:
        """Answer a request as the HTTP server would: ``(status, JSON body)``."""
        self._maybe_sweep()
        if method == "POST" and path == ATTACH and body is not None and self._already_attached(body):
            reply = Answer(200, m.AttachOut(attached=True, evicted=[]).model_dump_json().encode())
        else:
            reply = await self.dispatcher.dispatch(method, path, body, params or {})
        key = str(reply.status)
        self.statuses[key] = self.statuses.get(key, 0) + 1
        return reply.status, reply.body

    def _maybe_sweep(self) -> None:
        """Expire abandoned claims and leases, at most once per ``sweep_interval`` (the HTTP server's sweeper
        runs on a timer; here requests drive it, and a wait notices an expired claim by itself)."""
        now = time.monotonic()
        if now - self._last_sweep >= self._sweep_interval:
            self._last_sweep = now
            self.service.sweep()

    def _already_attached(self, data: bytes) -> bool:
        """A retried attach (the reply to the first was lost when the actor died after journaling it) must not
        be answered "evict your own snapshot": the node holds exactly that snapshot already."""
        try:
            body = m.AttachIn.model_validate_json(data)
        except ValidationError:
            return False  # the dispatcher refuses it
        graph = self.service.existing_graph(body.task_id)
        node = None if graph is None else graph.get(body.node_id)
        if node is None or node.snapshot is None:
            return False
        given = body.snapshot
        held = node.snapshot
        return (held.kind, held.path, held.bytes, dict(held.meta)) == (given.kind, given.path, given.bytes, given.meta)

    # ------------------------------------------------------------------ operations

    def info(self) -> dict[str, Any]:
        """Where this shard runs and what it holds (``tvcache ray status``)."""
        context = ray.get_runtime_context()
        return {
            "name": self.name,
            "node_id": context.get_node_id(),
            "pid": os.getpid(),
            "started": self.started,
            "restarted": context.was_current_actor_reconstructed,
            "stats": self.service.stats(),
        }

    def metrics(self) -> str:
        """The Prometheus text ``GET /metrics`` serves, for this shard."""
        return render(self.service.stats(), self.latency, self.statuses)

    def pid(self) -> int:
        return os.getpid()


def _open_service(
    data_dir: str | None,
    *,
    budget: Budget | None,
    fsync: bool,
    claim_ttl: float,
    lease_ttl: float,
    lock_wait: float,
) -> CacheService:
    """Open the shard's service; wait (bounded) for the journal lock a previous incarnation may still hold while
    it exits (a restarted actor can start before the old process is fully gone)."""
    deadline = time.monotonic() + lock_wait
    while True:
        try:
            return CacheService(data_dir, budget=budget, fsync=fsync, claim_ttl=claim_ttl, lease_ttl=lease_ttl)
        except JournalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# ---------------------------------------------------------------------------------------------- deployment


def ensure_ray(address: str | None = None, *, namespace: str = DEFAULT_NAMESPACE) -> None:
    """Connect this process to Ray unless it already is (inside a Ray task or actor it always is)."""
    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace=namespace, log_to_driver=False, logging_level=logging.WARNING)


def start_shards(
    shards: int,
    *,
    data_dir: str | os.PathLike[str] | None,
    namespace: str = DEFAULT_NAMESPACE,
    address: str | None = None,
    detached: bool = True,
    fsync: bool = False,
    claim_ttl: float = CLAIM_TTL,
    lease_ttl: float = LEASE_TTL,
    budget: Budget | None = None,
    timeout: float = 60.0,
    scheduling_strategy: Any = "SPREAD",
) -> list[str]:
    """Start ``shards`` named shard actors (spread over the cluster's nodes), or find the ones already running
    under the same names; return their names once every one answers. ``scheduling_strategy`` overrides SPREAD
    (e.g. a soft ``NodeAffinitySchedulingStrategy``: a restart after that node dies may go elsewhere).

    ``data_dir``: each shard journals to ``data_dir/shard-<i>``; it must be reachable from every node the actor
    may be restarted on (a shared filesystem), and None keeps everything in memory (lost on a restart).
    ``detached``: the actors outlive this process (``tvcache ray up``); otherwise they die with the driver.
    """
    if shards < 1:
        raise InvalidInput(f"start_shards needs at least one shard, got {shards}")
    ensure_ray(address, namespace=namespace)
    if data_dir is not None:
        data_dir = Path(data_dir).resolve()
        data_dir.mkdir(parents=True, exist_ok=True)
    budget_options = None if budget is None else {k: getattr(budget, k) for k in budget.__dataclass_fields__}
    remote_class = ray.remote(ShardActor)
    handles: list[Any] = []  # Ray's stubs type actor methods without ``.remote``
    names = []
    for index in range(shards):
        name = shard_name(index)
        options: dict[str, Any] = {
            "name": name,
            "namespace": namespace,
            "get_if_exists": True,
            "max_restarts": -1,
            "max_task_retries": -1,
            "max_concurrency": 1000,
            "num_cpus": 0,
            "scheduling_strategy": scheduling_strategy,
        }
        if detached:
            options["lifetime"] = "detached"
        handles.append(
            remote_class.options(**options).remote(
                name,
                None if data_dir is None else str(data_dir / f"shard-{index}"),
                fsync=fsync,
                claim_ttl=claim_ttl,
                lease_ttl=lease_ttl,
                budget=budget_options,
            )
        )
        names.append(name)
    ray.get([handle.pid.remote() for handle in handles], timeout=timeout)
    if not detached:  # Ray destroys a non-detached actor, named or not, once no handle to it is left
        _HELD[namespace] = handles
    return names


def find_shards(namespace: str = DEFAULT_NAMESPACE) -> list[str]:
    """The names of the shard actors running in ``namespace``, in index order (``tvcache-shard-0`` onwards, up to
    the first index missing). Probed by name: Ray's listing leaves out actors that are not detached."""
    names: list[str] = []
    while True:
        name = shard_name(len(names))
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return names
        names.append(name)


def shard_names(namespace: str, shards: Sequence[str] | None = None) -> list[str]:
    """``shards``, or the shard actors running in ``namespace`` (``find_shards``); InvalidInput for none."""
    names = list(shards) if shards is not None else find_shards(namespace)
    if not names:
        raise InvalidInput(
            f"no tvcache shard actors in Ray namespace {namespace!r}; start them with `tvcache ray up --shards N` "
            "or tvcache.integrations.ray.start_shards(N, data_dir=...)"
        )
    return names


def stop_shards(namespace: str = DEFAULT_NAMESPACE) -> list[str]:
    """Kill every shard actor in ``namespace`` for good (their journals stay on disk). Returns their names."""
    names = find_shards(namespace)
    _HELD.pop(namespace, None)
    for name in names:
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    return names


# ---------------------------------------------------------------------------------------------- clients


class RayTransport(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """An httpx transport (blocking and async) that hands each request to one shard actor instead of a socket:
    a shard is a ``RemoteCache`` over this transport, exactly as over HTTP. The actor answers with the status and
    body the HTTP server would have (``ShardActor.request``); replies name no server instance, so a restarted
    actor is caught by the replica's node identity check instead. A Ray failure or timeout is an
    ``httpx.TransportError`` (the client's "cannot reach" ``ServerError``)."""

    def __init__(self, actor: Any, name: str) -> None:
        self.actor = actor
        self.name = name

    @staticmethod
    def _args(request: httpx.Request) -> tuple[str, str, bytes | None, dict[str, str]]:
        body = request.read() or None
        return request.method, request.url.path, body, dict(request.url.params)

    @staticmethod
    def _timeout(request: httpx.Request) -> float | None:
        timeout: dict[str, float | None] = request.extensions.get("timeout", {})
        return timeout.get("read")

    def _response(self, reply: Reply, request: httpx.Request) -> httpx.Response:
        status, body = reply
        media = "text/plain" if request.url.path == routes.METRICS.path else "application/json"
        return httpx.Response(status, content=body, headers={"content-type": media}, request=request)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            reply = ray.get(self.actor.request.remote(*self._args(request)), timeout=self._timeout(request))
        except (RayError, TimeoutError) as error:
            raise httpx.TransportError(f"shard actor {self.name} did not answer: {error!r}") from error
        return self._response(reply, request)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            reply = await asyncio.wait_for(self.actor.request.remote(*self._args(request)), self._timeout(request))
        except (RayError, TimeoutError) as error:
            raise httpx.TransportError(f"shard actor {self.name} did not answer: {error!r}") from error
        return self._response(reply, request)

    def info(self, timeout: float | None = None) -> dict[str, Any]:
        """Where the shard runs and what it holds (``ShardActor.info``)."""
        info: dict[str, Any] = ray.get(self.actor.info.remote(), timeout=timeout)
        return info


class RayCache(ShardRouter[RemoteCache]):
    """Sessions routed to the shard actors of ``namespace`` by the task id, with the same rendezvous hash as
    ``ShardedCache``. The same session API as ``Cache``::

        cache = RayCache()                                  # inside a Ray cluster that ran start_shards(...)
        async with cache.session("task-1", sandbox=factory) as s:
            await s.call("sql", {"query": "SELECT 1"})

    ``shards``: the shard names (default: every shard actor found in ``namespace``). Other options are those of
    ``RemoteCache`` (``tools``, ``snapshot_policy``, ``snapshot_dir``, ``claim_ttl``, ``epoch``, ...).
    """

    def __init__(
        self,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        shards: Sequence[str] | None = None,
        address: str | None = None,
        tools: Iterable[ToolSpec] = (),
        **options: Any,
    ) -> None:
        ensure_ray(address, namespace=namespace)
        names = shard_names(namespace, shards)
        if len(set(names)) != len(names):
            raise InvalidInput("RayCache got the same shard name twice")
        specs = list(tools)
        for given in ("transport", "async_transport"):
            options.pop(given, None)
        self.namespace = namespace
        self.shards: dict[str, RemoteCache] = {}
        self.transports: dict[str, RayTransport] = {}
        for name in names:
            try:
                actor = ray.get_actor(name, namespace=namespace)
            except ValueError as error:
                raise InvalidInput(f"no shard actor {name!r} in Ray namespace {namespace!r}: {error}") from error
            transport = self.transports[name] = RayTransport(actor, name)
            self.shards[name] = RemoteCache(f"ray://{name}", transport=transport, tools=specs, **options)

    def shard_info(self) -> dict[str, dict[str, Any]]:
        """Where each shard runs and what it holds (``tvcache ray status``), by shard name."""
        return {name: transport.info() for name, transport in self.transports.items()}

    def metrics(self) -> dict[str, str]:
        """Each shard's Prometheus text, as ``GET /metrics`` of a server."""
        refs = {name: transport.actor.metrics.remote() for name, transport in self.transports.items()}
        return {name: str(ray.get(ref)) for name, ref in refs.items()}

    def __repr__(self) -> str:
        return f"<RayCache {self.namespace} shards={len(self.shards)}>"
