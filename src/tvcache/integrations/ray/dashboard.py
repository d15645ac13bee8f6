"""``tvcache ray dashboard``: the dashboard and ``/metrics`` of ``tvcache serve``, for the shard actors of a Ray
namespace.

A small Starlette app that serves the server's own dashboard page (``tvcache.server.dashboard``, the same
static files) and answers the read-only routes that page reads, with the server's route shapes, from the shard
actors (it is a Ray driver; the shards are found by name as ``RayCache`` finds them):

* **per-task routes** (``/v1/graph``, ``/v1/graph/outline``, ``/v1/node``, ``/v1/path``) go to the shard that owns
  the task, chosen by ``rendezvous(task_id, shard names)``, the hash ``RayCache`` routes sessions with; the
  shard's answer is passed on unchanged, with its name in the ``X-Tvcache-Shard`` header.
* **cluster-wide routes** are merged over the shards that answered. Tasks live on one shard each, so:
  ``/v1/stats`` sums every counter and size (hits, misses, seconds saved, nodes, snapshots, claims, leases...),
  except ``nondeterministic_tools``, the size of the union of the shards' tool sets (a tool marked on two shards
  is one tool); ``/v1/tasks`` and ``/v1/activity`` list the union of the shards' tasks (sorted by task id), each
  with the ``shard`` that holds it and that shard's Ray ``node_id`` and ``node_ip``; the activity ``total`` is the
  sum of the shards' tallies (hit rate recomputed from the sums) and ``since`` the earliest shard's start;
  ``/v1/tools/nondeterministic`` is the union of the tool sets.
* ``/metrics`` is every shard's Prometheus text with a ``shard`` label on each sample (the usual shape for one
  exporter covering several processes: ``sum without (shard) (...)`` gives the totals, and a shard's restart
  resets only its own counters, which ``rate()`` handles), plus ``tvcache_shard_up``, ``tvcache_shard_info``
  (its node) and ``tvcache_shard_start_time_seconds`` per shard.
* ``/healthz`` is this process's liveness: it never waits for a shard.

A shard that is dead, restarting, missing or slower than ``timeout`` is a value (``ShardDown``), not an error:
``/v1/stats`` lists it under ``shards`` with ``up: false`` and a message, the totals cover the shards that
answered, and ``tvcache_shard_up`` is 0; a per-task route whose owner is down answers 503 saying so.

Auth is that of ``tvcache serve``: loopback by default; any other address needs a bearer token, which every
route but ``/healthz`` and the page's static files requires.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray
import uvicorn
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from ... import __version__
from ...api import routes as api
from ...api.errors import METHOD_NOT_ALLOWED, NOT_FOUND, SHARD_DOWN, VALIDATION, ErrorCode, error_body
from ...api.params import parse_query
from ...client.sharding import rendezvous
from ...errors import InvalidInput
from ...server.activity import Tally
from ...server.app import Guard
from ...server.dashboard import dashboard_routes
from ...server.metrics import label_expositions, label_value
from ...server.runner import check_token
from .shards import DEFAULT_NAMESPACE, ensure_ray, shard_names

__all__ = ["DEFAULT_PORT", "ShardAnswer", "ShardDown", "ShardReader", "create_dashboard_app", "serve_dashboard"]

DEFAULT_PORT = 8100  # not 8000 (Ray Serve's default) nor 8265 (Ray's own dashboard)
# The totals the page draws: present (zero) even when no shard answers, so the page still renders.
PAGE_TOTALS = ("tasks", "nodes", "snapshots", "snapshot_bytes", "hits", "misses", "seconds_saved", "seconds_executed")

# The routes of the one table the page reads: answered by the task's shard, or merged over every shard.
PER_TASK = (api.EXPORT, api.OUTLINE, api.NODE, api.PATH)
_TASKS, _ACTIVITY, _TOOLS = api.TASKS.path, api.ACTIVITY.path, api.NONDETERMINISTIC.path


@dataclass(frozen=True, kw_only=True)
class ShardDown:
    """A shard that did not answer: dead, restarting, missing or too slow; ``message`` says which."""

    name: str
    message: str


@dataclass(frozen=True, kw_only=True)
class ShardAnswer:
    """One shard's ``info()`` (node, pid, start time, counters) and the payloads of the GET paths asked for."""

    name: str
    info: dict[str, Any]
    payloads: dict[str, Any] = field(default_factory=dict)
    metrics: str = ""
    node_ip: str | None = None

    @property
    def where(self) -> dict[str, Any]:
        return {"shard": self.name, "node_id": self.info.get("node_id"), "node_ip": self.node_ip}


Polled = ShardAnswer | ShardDown


class ShardReader:
    """Read-only calls to the shard actors ``names`` of ``namespace``, each bounded by ``timeout`` seconds.

    Actor handles are looked up by name when first needed and again after the actor died for good, so a shard
    stopped and started again (``tvcache ray down`` / ``up``) is found under its name."""

    def __init__(self, names: Sequence[str], *, namespace: str, timeout: float = 3.0) -> None:
        self.names = list(names)
        self.namespace = namespace
        self.timeout = timeout
        self._actors: dict[str, Any] = {}  # Any: Ray's stubs type actor methods without ``.remote``
        self._node_ips: dict[str, str] = {}

    def owner(self, task_id: str) -> str:
        """The shard that holds ``task_id``: the same rendezvous hash as ``RayCache``."""
        return rendezvous(task_id, self.names)

    async def call(self, name: str, method: str, *args: Any) -> Any | ShardDown:
        actor = self._actors.get(name)
        if actor is None:
            try:
                actor = await asyncio.to_thread(ray.get_actor, name, namespace=self.namespace)
            except ValueError:
                return ShardDown(
                    name=name,
                    message=f"{name} is down: no actor of that name in Ray namespace {self.namespace!r} (stopped, or "
                    "killed for good; `tvcache ray up` starts it again)",
                )
            except RayError as error:
                return ShardDown(name=name, message=f"{name} is down: Ray did not find it ({_summary(error)})")
            self._actors[name] = actor
        try:
            return await asyncio.wait_for(getattr(actor, method).remote(*args), self.timeout)
        except TimeoutError:
            why = "restarting after a crash or the loss of its node, or overloaded"
            return ShardDown(name=name, message=f"{name} is down: no answer within {self.timeout:g} s ({why})")
        except ActorDiedError as error:
            self._actors.pop(name, None)  # a shard started again under this name is a new actor
            return ShardDown(name=name, message=f"{name} is down: its actor died ({_summary(error)})")
        except ActorUnavailableError as error:
            return ShardDown(name=name, message=f"{name} is down: unavailable, restarting ({_summary(error)})")
        except RayError as error:
            return ShardDown(name=name, message=f"{name} is down: {type(error).__name__} ({_summary(error)})")

    async def get(self, name: str, path: str, params: dict[str, str] | None = None) -> tuple[int, Any] | ShardDown:
        """``GET path`` on one shard: its ``(status, payload)``, as the server would answer."""
        reply = await self.call(name, "request", "GET", path, None, params)
        if isinstance(reply, ShardDown):
            return reply
        status, body = reply  # the JSON body the server would send
        return int(status), json.loads(body)

    async def poll(self, *paths: str, metrics: bool = False) -> list[Polled]:
        """Every shard's ``info()`` and ``GET paths`` (and Prometheus text), concurrently, in shard order."""
        polled = list(await asyncio.gather(*(self._poll(name, paths, metrics) for name in self.names)))
        await self._resolve_nodes(polled)
        return [
            replace(shard, node_ip=self._node_ips.get(str(shard.info.get("node_id"))))
            if isinstance(shard, ShardAnswer)
            else shard
            for shard in polled
        ]

    async def _poll(self, name: str, paths: Sequence[str], metrics: bool) -> Polled:
        info, replies, text = await asyncio.gather(
            self.call(name, "info"),
            asyncio.gather(*(self.get(name, path) for path in paths)),
            self.call(name, "metrics") if metrics else _nothing(),
        )
        if isinstance(info, ShardDown):
            return info
        if isinstance(text, ShardDown):
            return text
        payloads: dict[str, Any] = {}
        for path, reply in zip(paths, replies, strict=True):
            if isinstance(reply, ShardDown):
                return reply
            status, payload = reply
            if status != 200:
                return ShardDown(name=name, message=f"{name} answered GET {path} with {status}: {_message(payload)}")
            payloads[path] = payload
        return ShardAnswer(name=name, info=dict(info), payloads=payloads, metrics=str(text))

    async def _resolve_nodes(self, polled: Sequence[Polled]) -> None:
        """Ray node ids to addresses, asking Ray again only when a shard runs on a node not seen before."""
        wanted = {str(a.info.get("node_id")) for a in polled if isinstance(a, ShardAnswer)}
        if wanted <= self._node_ips.keys():
            return
        try:
            nodes = await asyncio.to_thread(ray.nodes)
        except RayError:  # the addresses are a convenience: the shards' own answers stand without them
            return
        self._node_ips.update({str(node["NodeID"]): str(node["NodeManagerAddress"]) for node in nodes})


# ---------------------------------------------------------------------------------------------- merges


def merge_stats(polled: Sequence[Polled]) -> dict[str, Any]:
    """``/v1/stats`` of the deployment: see the module docstring for the rules."""
    totals: dict[str, Any] = {}
    tools: set[str] = set()
    for answer in _answers(polled):
        for key, value in answer.info["stats"].items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                totals[key] = totals.get(key, 0) + value
        tools.update(answer.payloads[_TOOLS]["tools"])
    for key in PAGE_TOTALS:
        totals.setdefault(key, 0)
    totals["nondeterministic_tools"] = len(tools)
    down = [shard for shard in polled if isinstance(shard, ShardDown)]
    totals["shards_up"] = len(polled) - len(down)
    totals["shards_down"] = len(down)
    totals["message"] = (
        None
        if not down
        else f"{len(down)} of {len(polled)} shards down; the totals cover the others. "
        + " ".join(shard.message for shard in down)
    )
    totals["shards"] = [_shard_entry(shard) for shard in polled]
    return totals


def merge_tasks(polled: Sequence[Polled]) -> dict[str, Any]:
    """``/v1/tasks`` of the deployment: every shard's tasks, each with where it lives."""
    tasks = [{**task, **answer.where} for answer in _answers(polled) for task in answer.payloads[_TASKS]["tasks"]]
    return {"tasks": sorted(tasks, key=lambda task: str(task["task_id"])), "shards_down": _down_names(polled)}


def merge_activity(polled: Sequence[Polled], *, started: float) -> dict[str, Any]:
    """``/v1/activity`` of the deployment: every shard's tasks (each on one shard, so its epochs are that shard's),
    the summed total and the earliest start (``started`` when no shard answered)."""
    total = Tally()
    since: list[float] = []
    tasks: list[dict[str, Any]] = []
    for answer in _answers(polled):
        report = answer.payloads[_ACTIVITY]
        shard_total = report["total"]
        total.add(
            Tally(
                hits=shard_total["hits"],
                misses=shard_total["misses"],
                seconds_saved=shard_total["seconds_saved"],
                seconds_executed=shard_total["seconds_executed"],
            )
        )
        since.append(float(report["since"]))
        tasks += [{**task, **answer.where} for task in report["tasks"]]
    return {
        "since": min(since, default=started),
        "total": {
            "epoch": None,
            "hits": total.hits,
            "misses": total.misses,
            "hit_rate": total.hit_rate,
            "seconds_saved": total.seconds_saved,
            "seconds_executed": total.seconds_executed,
        },
        "tasks": sorted(tasks, key=lambda task: str(task["task_id"])),
        "shards_down": _down_names(polled),
    }


def merge_tools(polled: Sequence[Polled]) -> dict[str, Any]:
    tools: dict[str, str] = {}
    for answer in _answers(polled):
        tools.update(answer.payloads[_TOOLS]["tools"])
    return {"tools": dict(sorted(tools.items())), "shards_down": _down_names(polled)}


def merge_metrics(polled: Sequence[Polled]) -> str:
    """The shards' Prometheus texts, one ``shard`` label per sample, and each shard's liveness and node."""
    answers = _answers(polled)
    lines = label_expositions({answer.name: answer.metrics for answer in answers}, label="shard")
    lines += [
        "# HELP tvcache_shard_up 1 if the shard actor answered this scrape within the timeout, else 0.",
        "# TYPE tvcache_shard_up gauge",
    ]
    lines += [
        f"tvcache_shard_up{{{_labels(shard=shard.name)}}} {int(isinstance(shard, ShardAnswer))}" for shard in polled
    ]
    lines += ["# HELP tvcache_shard_info The Ray node each shard actor runs on.", "# TYPE tvcache_shard_info gauge"]
    lines += [
        f"tvcache_shard_info{{{_labels(shard=a.name, node_id=str(a.info.get('node_id')), node_ip=a.node_ip or '')}}} 1"
        for a in answers
    ]
    lines += [
        "# HELP tvcache_shard_start_time_seconds Unix time the shard actor (this incarnation) started.",
        "# TYPE tvcache_shard_start_time_seconds gauge",
    ]
    lines += [
        f"tvcache_shard_start_time_seconds{{{_labels(shard=a.name)}}} {float(a.info['started'])!r}" for a in answers
    ]
    return "\n".join(lines) + "\n"


def _labels(**labels: str) -> str:
    return ",".join(f'{name}="{label_value(value)}"' for name, value in labels.items())


def _answers(polled: Sequence[Polled]) -> list[ShardAnswer]:
    return [answer for answer in polled if isinstance(answer, ShardAnswer)]


def _down_names(polled: Sequence[Polled]) -> list[str]:
    return [shard.name for shard in polled if isinstance(shard, ShardDown)]


def _shard_entry(shard: Polled) -> dict[str, Any]:
    if isinstance(shard, ShardDown):
        return {"name": shard.name, "up": False, "message": shard.message}
    info = shard.info
    return {
        "name": shard.name,
        "up": True,
        "node_id": info.get("node_id"),
        "node_ip": shard.node_ip,
        "pid": info.get("pid"),
        "started": info.get("started"),
        "restarted": info.get("restarted"),
        "stats": info.get("stats"),
    }


async def _nothing() -> str:
    return ""


def _summary(error: BaseException, limit: int = 300) -> str:
    """The first line of a Ray error (they run to pages of context)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _message(payload: Any) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    return str(error.get("message", payload)) if isinstance(error, dict) else str(payload)


# ---------------------------------------------------------------------------------------------- the app


def _json(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _error(code: ErrorCode, message: str) -> Response:
    return Response(error_body(code, message), status_code=code.status, media_type="application/json")


class _Routes:
    """The dashboard's routes over one ``ShardReader``."""

    def __init__(self, reader: ShardReader) -> None:
        self.reader = reader
        self.started = time.time()

    async def stats(self, request: Request) -> Response:
        return _json(merge_stats(await self.reader.poll(_TOOLS)))

    async def tasks(self, request: Request) -> Response:
        return _json(merge_tasks(await self.reader.poll(_TASKS)))

    async def activity(self, request: Request) -> Response:
        return _json(merge_activity(await self.reader.poll(_ACTIVITY), started=self.started))

    async def tools(self, request: Request) -> Response:
        return _json(merge_tools(await self.reader.poll(_TOOLS)))

    async def metrics(self, request: Request) -> Response:
        text = merge_metrics(await self.reader.poll(metrics=True))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def healthz(self, request: Request) -> Response:
        # Open to anyone (like the server's): liveness and version only; shard names and the namespace are data.
        return _json({"status": "ok", "version": __version__})

    def per_task(self, route: api.Route[Any]) -> Route:
        """A route answered by the shard that owns the task, its query validated as the server validates it (the
        parameters of the one route table)."""
        path = route.path

        async def endpoint(request: Request) -> Response:
            try:
                params = {name: str(value) for name, value in parse_query(request.query_params, route.query).items()}
            except InvalidInput as error:
                return _error(VALIDATION, str(error))
            task_id = params["task_id"]
            owner = self.reader.owner(task_id)
            reply = await self.reader.get(owner, path, params)
            if isinstance(reply, ShardDown):
                return _error(SHARD_DOWN, f"task {task_id!r} lives on {owner}, which is down: {reply.message}")
            status, payload = reply
            return _json(payload, status, headers={"X-Tvcache-Shard": owner})

        return Route(path, endpoint, methods=["GET"])

    def routes(self) -> list[Route]:
        return [
            Route(api.STATS.path, self.stats, methods=["GET"]),
            Route(api.TASKS.path, self.tasks, methods=["GET"]),
            Route(api.ACTIVITY.path, self.activity, methods=["GET"]),
            Route(api.NONDETERMINISTIC.path, self.tools, methods=["GET"]),
            *(self.per_task(route) for route in PER_TASK),
            Route(api.HEALTHZ.path, self.healthz, methods=["GET"]),
            Route(api.METRICS.path, self.metrics, methods=["GET"]),
            *dashboard_routes(),
        ]


def create_dashboard_app(
    *,
    namespace: str = DEFAULT_NAMESPACE,
    shards: Sequence[str] | None = None,
    token: str | None = None,
    address: str | None = None,
    timeout: float = 3.0,
) -> ASGIApp:
    """The dashboard app over the shard actors of ``namespace`` (connecting this process to Ray if needed).

    ``shards``: their names (default: those running now, found as ``RayCache`` finds them; restart the dashboard
    after starting more). ``token``: the bearer token every data route requires (None: no auth; bind loopback
    only). ``timeout``: seconds a shard has to answer before it is reported down."""
    ensure_ray(address, namespace=namespace)
    names = shard_names(namespace, shards)
    routes = _Routes(ShardReader(names, namespace=namespace, timeout=timeout))

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(NOT_FOUND, f"no route {request.method} {request.url.path}")

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return _error(METHOD_NOT_ALLOWED, f"{request.method} is not allowed on {request.url.path}")

    app = Starlette(routes=routes.routes(), exception_handlers={404: not_found, 405: not_allowed})
    return Guard(app, token=token)


def serve_dashboard(
    *,
    namespace: str = DEFAULT_NAMESPACE,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    address: str | None = None,
    shards: Sequence[str] | None = None,
    timeout: float = 3.0,
) -> None:
    """Serve the dashboard until SIGINT/SIGTERM. Refuses a non-loopback ``host`` without a token."""
    check_token(host, token)
    app = create_dashboard_app(namespace=namespace, shards=shards, token=token, address=address, timeout=timeout)
    print(f"tvcache ray dashboard: http://{host}:{port}/dashboard (namespace {namespace!r})", file=sys.stderr)
    config = uvicorn.Config(app, host=host, port=port, access_log=False, log_level="warning", loop="asyncio")
    uvicorn.Server(config).run()
