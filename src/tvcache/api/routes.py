"""The one table of the native API's routes, GET and POST alike.

Each ``Route`` names its method and path, the body it takes and the body it answers (``tvcache.api.models``),
the query parameters of a GET, the operation that serves it and a one-line description. The table feeds:

- the server's Starlette app and its OpenAPI document (``tvcache.server.app``), through the dispatcher that
  binds it to a ``CacheService`` (``tvcache.server.dispatch``);
- the Ray shard actors, which dispatch with that same dispatcher (``tvcache.integrations.ray.shards``);
- the clients, which take each route by name (``LOOKUP``, ``CLAIM``...: its method, path and reply model), never
  by its path: the HTTP store (``tvcache.store.http``), the Ray dashboard and bench.

A route no ``HttpStore`` operation sends is marked ``server_only`` (``tests/test_architecture.py`` holds the
others to a client call).

``handler`` is the name of a ``CacheService`` method (``on="service"``), called with the validated body, or with
the query parameters as keywords for a GET; ``on="server"`` routes are the HTTP process's own (health, metrics),
which a Ray shard does not serve. The reference TVCache routes are a table of their own
(``tvcache.server.wire.WIRE_ROUTES``): their bodies and errors follow the released server, not this API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel

from . import models as m
from .params import Param

__all__ = ["GET_ROUTES", "POST_ROUTES", "ROUTES", "Param", "Route", "named", "route"]


T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class Route(Generic[T]):
    """One route of the native API. ``reply``: the answer's model, or a JSON schema type for a free-form one
    (``"object"``: the counters; ``"string"``: Prometheus text). ``timed``: observed in the latency histogram.
    ``server_only``: no ``HttpStore`` operation sends it (the dashboard, operators and monitoring read it);
    ``tests/test_architecture.py`` holds every other route to a client call."""

    method: Literal["GET", "POST"]
    path: str
    handler: str
    summary: str
    body: type[BaseModel] | None = None
    reply: type[T] | Literal["object", "string"] = "object"
    query: tuple[Param, ...] = ()
    on: Literal["service", "server"] = "service"
    timed: bool = False
    server_only: bool = False


M = TypeVar("M", bound=BaseModel)


def _post(path: str, body: type[BaseModel], reply: type[M], handler: str, summary: str, **kw: Any) -> Route[M]:
    return Route(method="POST", path=path, body=body, reply=reply, handler=handler, summary=summary, **kw)


def _get(path: str, reply: type[M], handler: str, summary: str, **kw: Any) -> Route[M]:
    return Route(method="GET", path=path, reply=reply, handler=handler, summary=summary, **kw)


_TASK = Param(name="task_id")
_NODE = Param(name="node_id", integer=True)
_LIMIT = Param(name="limit", required=False, integer=True, default=2000, low=1, high=100_000)

# Each route by name, typed by its answer: clients send ``LOOKUP`` (its method, path and reply model), never a
# path typed again.
LOOKUP = _post("/v1/lookup", m.LookupIn, m.LookupOut, "lookup", "Match a history, or step from a state", timed=True)
TOUCH = _post("/v1/touch", m.TouchIn, m.OkOut, "touch", "Count hits served from a client's replica")
CLAIM = _post("/v1/claim", m.ClaimIn, m.ClaimOut, "claim", "Claim a missed call, or learn who executes it")
HEARTBEAT = _post("/v1/claim/heartbeat", m.HeartbeatIn, m.ClaimOut, "heartbeat", "Renew a claim's TTL")
RESOLVE = _post("/v1/claim/resolve", m.ResolveIn, m.OkOut, "resolve", "Give up a claim (failed or uncacheable)")
WAIT = _post("/v1/claim/wait", m.WaitIn, m.WaitOut, "wait", "Long-poll for a claimed call's result")
INSERT = _post("/v1/insert", m.InsertIn, m.InsertOut, "insert", "Record an executed call (durable on 2xx)")
ATTACH = _post("/v1/snapshots/attach", m.AttachIn, m.AttachOut, "attach", "Attach a client-owned snapshot")
LEASE = _post("/v1/snapshots/lease", m.LeaseIn, m.LeaseOut, "lease", "Lease the nearest snapshot of a kind")
RELEASE = _post("/v1/snapshots/release", m.ReleaseIn, m.OkOut, "release", "Release a snapshot lease")
DROP = _post("/v1/snapshots/drop", m.DropIn, m.DropOut, "drop", "Forget a snapshot no client can fork")
TEST_GET = _post("/v1/tests/get", m.TestGetIn, m.TestOut, "test_get", "A cached test result of a state")
TEST_PUT = _post("/v1/tests/put", m.TestPutIn, m.OkOut, "test_put", "Store a test result of a state")
MARK_NONDETERMINISTIC = _post(
    "/v1/tools/nondeterministic",
    m.NondeterministicIn,
    m.NondeterministicOut,
    "mark_nondeterministic",
    "Never serve a tool from cache again",
)
CLEAR_NONDETERMINISTIC = _post(
    "/v1/tools/nondeterministic/clear",
    m.ClearNondeterministicIn,
    m.ClearedOut,
    "clear_nondeterministic",
    "Lift non-determinism marks (by tool and task; null: any)",
)

# fmt: off
STATS: Route[dict[str, Any]] = Route(method="GET", path="/v1/stats", handler="stats", summary="Counters and sizes")
TASKS = _get("/v1/tasks", m.TasksOut, "tasks", "Tasks with their sizes", server_only=True)
EXPORT = _get("/v1/graph", m.GraphOut, "export", "Export a task's graph", query=(_TASK,), server_only=True)
PATH = _get("/v1/path", m.PathOut, "path", "The nodes from the root to a node", query=(_NODE, _TASK))
ACTIVITY = _get("/v1/activity", m.ActivityOut, "activity_report", "Hits, misses and time saved by task and epoch",
                server_only=True)
OUTLINE = _get("/v1/graph/outline", m.OutlineOut, "outline", "A task's graph without results, for drawing",
               query=(_LIMIT, _TASK), server_only=True)
NODE = _get("/v1/node", m.NodeOut, "node_detail", "One node with its call and result", query=(_NODE, _TASK),
            server_only=True)
NONDETERMINISTIC = _get("/v1/tools/nondeterministic", m.NondeterministicOut, "nondeterministic",
                        "Tools never served from cache")
HEALTHZ: Route[dict[str, Any]] = Route(method="GET", path="/healthz", handler="healthz", summary="Liveness (no auth)",
                                       on="server", server_only=True)
METRICS: Route[str] = Route(method="GET", path="/metrics", handler="metrics", reply="string",
                            summary="Prometheus metrics", on="server", server_only=True)
# fmt: on

POST_ROUTES: tuple[Route[Any], ...] = (
    LOOKUP, TOUCH, CLAIM, HEARTBEAT, RESOLVE, WAIT, INSERT, ATTACH, LEASE, RELEASE, DROP, TEST_GET, TEST_PUT,
    MARK_NONDETERMINISTIC, CLEAR_NONDETERMINISTIC,
)  # fmt: skip
GET_ROUTES: tuple[Route[Any], ...] = (
    STATS, TASKS, EXPORT, PATH, ACTIVITY, OUTLINE, NODE, NONDETERMINISTIC, HEALTHZ, METRICS,
)  # fmt: skip

ROUTES: tuple[Route[Any], ...] = POST_ROUTES + GET_ROUTES

_BY_KEY: dict[tuple[str, str], Route[Any]] = {(r.method, r.path): r for r in ROUTES}
_BY_HANDLER: dict[str, Route[Any]] = {r.handler: r for r in ROUTES}
if len(_BY_HANDLER) != len(ROUTES):  # a handler names its route: two routes may not share one
    raise RuntimeError("tvcache.api.routes: two routes name the same handler")


def route(method: str, path: str) -> Route[Any] | None:
    """The route serving ``method path`` (None: there is none)."""
    return _BY_KEY.get((method, path))


def named(handler: str) -> Route[Any]:
    """The route served by ``handler`` (KeyError: there is none)."""
    return _BY_HANDLER[handler]
