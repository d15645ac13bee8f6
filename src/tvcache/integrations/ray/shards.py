"""Graph shards as named Ray actors, and ``RayCache``, the client that routes sessions to them.

A shard actor wraps the very ``CacheService`` that ``tvcache serve`` wraps, and answers the same native ``/v1``
operations through the same route table and pydantic models (``tvcache.server.app.Server.native_routes``), so
claims, leases, inserts and their validation behave exactly as over HTTP. It is an async actor: a long-poll
(``/v1/claim/wait``) awaits on the actor's event loop without blocking other requests, just as on uvicorn.

A shard journals every insert to ``data_dir/shard-<i>`` before it answers. Shards are created with
``max_restarts=-1`` and ``max_task_retries=-1``: an actor that dies (killed, or its node removed) is restarted
by Ray, reloads its journal and the calls in flight are retried on it. Every retried operation is idempotent or
harmless (an insert of an existing call returns the existing node; a claim or lease lost with the old process is
claimed again), so nothing acknowledged is lost. ``data_dir`` must therefore be readable from wherever Ray may
restart the actor: a shared filesystem in a real cluster, any local path when every node is on one machine.

``RayCache`` is to the shard actors what ``ShardedCache`` is to HTTP servers: one ``RemoteCache`` per shard, the
same rendezvous hash over the shard names, the same session API. Each per-shard client is a ``RemoteCache``
whose two transport methods send the request to the actor instead of over HTTP; everything else (the replica
graph, claims with heartbeats, long-polls on a background loop, batched hit counts) is inherited unchanged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import ray
from pydantic import BaseModel, ValidationError
from ray.exceptions import RayError

from ...calls import ToolSpec
from ...client.remote import RemoteCache, ServerError
from ...client.sharding import ShardRouter
from ...errors import InvalidInput, JournalError, TVCacheError
from ...policies import Budget
from ...server import models as m
from ...server.app import Server, ServerSettings
from ...server.metrics import Histogram, render
from ...server.service import CacheService, NotFound

__all__ = [
    "DEFAULT_NAMESPACE",
    "SHARD_PREFIX",
    "RayCache",
    "RayShardClient",
    "ShardActor",
    "find_shards",
    "start_shards",
    "stop_shards",
]

DEFAULT_NAMESPACE = "tvcache"
SHARD_PREFIX = "tvcache-shard-"

Reply = tuple[int, Any]


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
        claim_ttl: float = 30.0,
        lease_ttl: float = 600.0,
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
        server = Server(self.service, ServerSettings())
        self._routes: dict[str, tuple[type[BaseModel], Callable[[Any], Any]]] = {}
        for route, method in server.native_routes():
            assert route.request is not None
            self._routes[route.path] = (route.request, method)
        self._sweep_interval = sweep_interval
        self._last_sweep = time.monotonic()
        self.latency = Histogram()
        self.statuses: dict[str, int] = {}

    async def request(self, method: str, path: str, body: bytes | None, params: dict[str, str] | None) -> Reply:
        self._maybe_sweep()
        status, payload = await self._dispatch(method, path, body, params or {})
        key = str(status)
        self.statuses[key] = self.statuses.get(key, 0) + 1
        return status, payload

    def _maybe_sweep(self) -> None:
        """Expire abandoned claims and leases, at most once per ``sweep_interval`` (the HTTP server's sweeper
        runs on a timer; here requests drive it, and a wait notices an expired claim by itself)."""
        now = time.monotonic()
        if now - self._last_sweep >= self._sweep_interval:
            self._last_sweep = now
            self.service.sweep()

    async def _dispatch(self, method: str, path: str, body: bytes | None, params: dict[str, str]) -> Reply:
        try:
            if method == "POST":
                route = self._routes.get(path)
                if route is None:
                    return _error(404, "not_found", f"no route POST {path}")
                model, operation = route
                request = model.model_validate_json(body or b"{}")
                if isinstance(request, m.AttachIn) and self._already_attached(request):
                    return 200, {"attached": True, "evicted": []}
                started = time.perf_counter()
                result = operation(request)
                if hasattr(result, "__await__"):
                    result = await result
                if path == "/v1/lookup":
                    self.latency.observe(path, time.perf_counter() - started)
                return 200, result.model_dump(mode="json")
            if method == "GET":
                return 200, self._get(path, params)
            return _error(405, "method_not_allowed", f"{method} is not allowed on {path}")
        except ValidationError as error:
            problems = error.errors(include_url=False, include_context=False, include_input=False)
            where = ".".join(str(part) for part in problems[0]["loc"]) if problems else "body"
            message = problems[0]["msg"] if problems else "invalid"
            return _error(422, "validation", f"{where}: {message}")
        except NotFound as error:
            return _error(404, "not_found", str(error))
        except InvalidInput as error:
            return _error(400, "invalid_input", str(error))
        except TVCacheError as error:
            return _error(503, type(error).__name__, str(error))

    def _already_attached(self, body: m.AttachIn) -> bool:
        """A retried attach (the reply to the first was lost when the actor died after journaling it) must not
        be answered "evict your own snapshot": the node holds exactly that snapshot already."""
        graph = self.service.existing_graph(body.task_id)
        node = None if graph is None else graph.get(body.node_id)
        if node is None or node.snapshot is None:
            return False
        given = body.snapshot
        held = node.snapshot
        return (held.kind, held.path, held.bytes, dict(held.meta)) == (given.kind, given.path, given.bytes, given.meta)

    def _get(self, path: str, params: dict[str, str]) -> Any:
        s = self.service
        if path == "/v1/stats":
            return s.stats()
        if path == "/v1/path":
            return s.path(_param(params, "task_id"), _int_param(params, "node_id")).model_dump(mode="json")
        if path == "/v1/tools/nondeterministic":
            return s.nondeterministic().model_dump(mode="json")
        if path == "/v1/tasks":
            return s.tasks().model_dump(mode="json")
        if path == "/v1/graph":
            return s.export(_param(params, "task_id")).model_dump(mode="json")
        if path == "/v1/activity":
            return s.activity_report().model_dump(mode="json")
        if path == "/v1/graph/outline":  # the dashboard's reads (tvcache ray dashboard)
            return s.outline(_param(params, "task_id"), _int_param(params, "limit")).model_dump(mode="json")
        if path == "/v1/node":
            return s.node_detail(_param(params, "task_id"), _int_param(params, "node_id")).model_dump(mode="json")
        raise NotFound(f"no route GET {path}")

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


def _error(status: int, kind: str, message: str) -> Reply:
    return status, {"error": {"type": kind, "message": message}}


def _param(params: dict[str, str], name: str) -> str:
    value = params.get(name)
    if not value:
        raise InvalidInput(f"query parameter {name!r} is required")
    return value


def _int_param(params: dict[str, str], name: str) -> int:
    value = _param(params, name)
    if not value.isdigit():
        raise InvalidInput(f"{name} must be a non-negative integer")
    return int(value)


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
    claim_ttl: float = 30.0,
    lease_ttl: float = 600.0,
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


def stop_shards(namespace: str = DEFAULT_NAMESPACE) -> list[str]:
    """Kill every shard actor in ``namespace`` for good (their journals stay on disk). Returns their names."""
    names = find_shards(namespace)
    _HELD.pop(namespace, None)
    for name in names:
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    return names


# ---------------------------------------------------------------------------------------------- clients


class RayShardClient(RemoteCache):
    """A ``RemoteCache`` whose requests go to one shard actor instead of an HTTP server."""

    def __init__(self, actor: Any, name: str, *, namespace: str, **options: Any) -> None:
        options.pop("transport", None)
        super().__init__(f"ray://{namespace}/{name}", **options)
        self.actor = actor
        self.name = name

    def _request(
        self, method: str, path: str, body: Any = None, params: Any = None, *, instance: str | None = None
    ) -> Any:
        # ``instance`` is not sent: actor replies name no server instance, so ``_instance`` stays None here and
        # a reconstructed actor is caught only by the replica's node identity check (``RemoteCache._adopt``).
        payload = None if body is None else json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
        query = None if params is None else {key: str(value) for key, value in params.items()}
        try:
            reply = ray.get(self.actor.request.remote(method, path, payload, query), timeout=self._timeout)
        except (RayError, TimeoutError) as error:
            raise ServerError(0, f"shard actor {self.name} did not answer {path}: {error!r}") from error
        return self._reply(reply, path)

    async def _arequest(self, path: str, body: Any, *, instance: str | None = None) -> Any:
        payload = json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
        try:
            reply = await self.actor.request.remote("POST", path, payload, None)
        except RayError as error:
            raise ServerError(0, f"shard actor {self.name} did not answer {path}: {error!r}") from error
        return self._reply(reply, path)

    def _reply(self, reply: Reply, path: str) -> Any:
        status, payload = reply
        if status >= 400:
            error = payload.get("error", {}) if isinstance(payload, dict) else {}
            message = f"{self.url}{path}: {status}: {error.get('message', payload)}"
            if status in (400, 422):
                raise InvalidInput(message)
            raise ServerError(status, message)
        return payload

    def shard_info(self) -> dict[str, Any]:
        info: dict[str, Any] = ray.get(self.actor.info.remote(), timeout=self._timeout)
        return info

    def __repr__(self) -> str:
        return f"<RayShardClient {self.name} tasks={len(self._graphs)}>"


class RayCache(ShardRouter[RayShardClient]):
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
        names = list(shards) if shards is not None else find_shards(namespace)
        if not names:
            raise InvalidInput(
                f"no tvcache shard actors in Ray namespace {namespace!r}; start them with `tvcache ray up --shards N` "
                "or tvcache.integrations.ray.start_shards(N, data_dir=...)"
            )
        if len(set(names)) != len(names):
            raise InvalidInput("RayCache got the same shard name twice")
        specs = list(tools)
        self.namespace = namespace
        self.shards: dict[str, RayShardClient] = {}
        for name in names:
            try:
                actor = ray.get_actor(name, namespace=namespace)
            except ValueError as error:
                raise InvalidInput(f"no shard actor {name!r} in Ray namespace {namespace!r}: {error}") from error
            self.shards[name] = RayShardClient(actor, name, namespace=namespace, tools=specs, **options)

    def metrics(self) -> dict[str, str]:
        """Each shard's Prometheus text, as ``GET /metrics`` of a server."""
        refs = {name: cache.actor.metrics.remote() for name, cache in self.shards.items()}
        return {name: str(ray.get(ref)) for name, ref in refs.items()}

    def __repr__(self) -> str:
        return f"<RayCache {self.namespace} shards={len(self.shards)}>"
