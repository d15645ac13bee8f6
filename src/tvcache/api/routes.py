"""The one table of the native API's routes, GET and POST alike.

Each ``Route`` names its method and path, the body it takes and the body it answers (``tvcache.api.models``),
the query parameters of a GET, the operation that serves it and a one-line description. The table feeds:

- the server's Starlette app and its OpenAPI document (``tvcache.server.app``), through the dispatcher that
  binds it to a ``CacheService`` (``tvcache.server.routes``);
- the Ray shard actors, which dispatch with that same dispatcher (``tvcache.integrations.ray.shards``);
- the HTTP store, which sends the bodies it names (``tvcache.store.http``).

``handler`` is the name of a ``CacheService`` method (``on="service"``), called with the validated body, or with
the query parameters as keywords for a GET; ``on="server"`` routes are the HTTP process's own (health, metrics),
which a Ray shard does not serve. The reference TVCache routes are a table of their own
(``tvcache.server.wire.WIRE_ROUTES``): their bodies and errors follow the released server, not this API.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from ..errors import InvalidInput
from . import models as m

__all__ = ["GET_ROUTES", "POST_ROUTES", "ROUTES", "Param", "Route", "route"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Param:
    """A query parameter: text, or a non-negative integer (``low``..``high`` when bounded). ``default``: the
    value when absent (None: it is required)."""

    name: str
    integer: bool = False
    default: Any = None
    low: int = 0
    high: int | None = None

    def parse(self, params: Mapping[str, str]) -> Any:
        """The value in ``params``, or InvalidInput naming what is wrong (the server answers 422)."""
        text = params.get(self.name)
        if text is None and self.default is not None:
            return self.default
        if not text and self.default is None:
            raise InvalidInput(f"query parameter {self.name!r} is required")
        assert text is not None
        if not self.integer:
            return text
        if not text.isdigit() or (self.high is not None and not self.low <= int(text) <= self.high):
            if self.high is None:
                raise InvalidInput(f"{self.name} must be a non-negative integer")
            raise InvalidInput(f"{self.name} must be an integer from {self.low} to {self.high}")
        return int(text)


@dataclass(frozen=True, kw_only=True, slots=True)
class Route:
    """One route of the native API. ``reply``: the answer's model, or a JSON schema type for a free-form one
    (``"object"``: the counters; ``"string"``: Prometheus text). ``timed``: observed in the latency histogram."""

    method: Literal["GET", "POST"]
    path: str
    handler: str
    summary: str
    body: type[BaseModel] | None = None
    reply: type[BaseModel] | Literal["object", "string"] = "object"
    query: tuple[Param, ...] = ()
    on: Literal["service", "server"] = "service"
    timed: bool = False


def _post(path: str, body: type[BaseModel], reply: type[BaseModel], handler: str, summary: str, **kw: Any) -> Route:
    return Route(method="POST", path=path, body=body, reply=reply, handler=handler, summary=summary, **kw)


_TASK = Param(name="task_id")
_NODE = Param(name="node_id", integer=True)
_LIMIT = Param(name="limit", integer=True, default=2000, low=1, high=100_000)

POST_ROUTES: tuple[Route, ...] = (
    _post("/v1/lookup", m.LookupIn, m.LookupOut, "lookup", "Match a history, or step from a state", timed=True),
    _post("/v1/touch", m.TouchIn, m.OkOut, "touch", "Count hits served from a client's replica"),
    _post("/v1/claim", m.ClaimIn, m.ClaimOut, "claim", "Claim a missed call, or learn who executes it"),
    _post("/v1/claim/heartbeat", m.HeartbeatIn, m.ClaimOut, "heartbeat", "Renew a claim's TTL"),
    _post("/v1/claim/resolve", m.ResolveIn, m.OkOut, "resolve", "Give up a claim (failed or uncacheable)"),
    _post("/v1/claim/wait", m.WaitIn, m.WaitOut, "wait", "Long-poll for a claimed call's result"),
    _post("/v1/insert", m.InsertIn, m.InsertOut, "insert", "Record an executed call (durable on 2xx)"),
    _post("/v1/snapshots/attach", m.AttachIn, m.AttachOut, "attach", "Attach a client-owned snapshot"),
    _post("/v1/snapshots/lease", m.LeaseIn, m.LeaseOut, "lease", "Lease the nearest snapshot of a kind"),
    _post("/v1/snapshots/release", m.ReleaseIn, m.OkOut, "release", "Release a snapshot lease"),
    _post("/v1/snapshots/drop", m.DropIn, m.DropOut, "drop", "Forget a snapshot no client can fork"),
    _post("/v1/tests/get", m.TestGetIn, m.TestOut, "test_get", "A cached test result of a state"),
    _post("/v1/tests/put", m.TestPutIn, m.OkOut, "test_put", "Store a test result of a state"),
    _post(
        "/v1/tools/nondeterministic",
        m.NondeterministicIn,
        m.NondeterministicOut,
        "mark_nondeterministic",
        "Never serve a tool from cache again",
    ),
    _post(
        "/v1/tools/nondeterministic/clear",
        m.ClearNondeterministicIn,
        m.ClearedOut,
        "clear_nondeterministic",
        "Lift non-determinism marks (by tool and task; null: any)",
    ),
)

GET_ROUTES: tuple[Route, ...] = (
    Route(method="GET", path="/v1/stats", handler="stats", summary="Counters and sizes"),
    Route(method="GET", path="/v1/tasks", handler="tasks", reply=m.TasksOut, summary="Tasks with their sizes"),
    Route(
        method="GET", path="/v1/graph", handler="export", reply=m.GraphOut, query=(_TASK,),
        summary="Export a task's graph",
    ),
    Route(
        method="GET", path="/v1/path", handler="path", reply=m.PathOut, query=(_NODE, _TASK),
        summary="The nodes from the root to a node",
    ),
    Route(
        method="GET", path="/v1/activity", handler="activity_report", reply=m.ActivityOut,
        summary="Hits, misses and time saved by task and epoch",
    ),
    Route(
        method="GET", path="/v1/graph/outline", handler="outline", reply=m.OutlineOut, query=(_LIMIT, _TASK),
        summary="A task's graph without results, for drawing",
    ),
    Route(
        method="GET", path="/v1/node", handler="node_detail", reply=m.NodeOut, query=(_NODE, _TASK),
        summary="One node with its call and result",
    ),
    Route(
        method="GET", path="/v1/tools/nondeterministic", handler="nondeterministic", reply=m.NondeterministicOut,
        summary="Tools never served from cache",
    ),
    Route(method="GET", path="/healthz", handler="healthz", summary="Liveness (no auth)", on="server"),
    Route(method="GET", path="/metrics", handler="metrics", reply="string", summary="Prometheus metrics", on="server"),
)  # fmt: skip

ROUTES: tuple[Route, ...] = POST_ROUTES + GET_ROUTES

_BY_KEY: dict[tuple[str, str], Route] = {(r.method, r.path): r for r in ROUTES}


def route(method: str, path: str) -> Route | None:
    """The route serving ``method path`` (None: there is none)."""
    return _BY_KEY.get((method, path))
