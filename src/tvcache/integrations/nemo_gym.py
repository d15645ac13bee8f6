"""NeMo-Gym: tool routes of a resources server served through tvcache sessions, one per rollout.

A NeMo-Gym resources server (``SimpleResourcesServer``) is a FastAPI app: the agent seeds a rollout
(``/seed_session``), calls a POST route per tool with the rollout's session cookie, and asks for the reward
(``/verify``). ``RolloutSessions`` keeps one tvcache session per rollout, keyed by the rollout's session id
(``request.session[SESSION_ID_KEY]``, the id NeMo-Gym's session middleware gives each rollout): ``open`` in
``seed_session``, ``call`` in each tool route, ``test`` for a reward read from the sandbox, ``close`` in
``verify`` (and in ``close_resources_session``, for an Environment Server's sessions). Rollouts of one task share
its tool call graph, so the ``num_repeats`` rollouts of a task and every later epoch hit where they repeat
each other, and a rollout whose calls all hit starts no sandbox::

    from tvcache.integrations.nemo_gym import RolloutSessions

    class ShellServer(SimpleResourcesServer):
        def model_post_init(self, context):
            super().model_post_init(context)
            self._rollouts = RolloutSessions(ShellSandbox.factory(tree, persistent=True), cache="/data/tvcache")

        async def seed_session(self, request: Request, body: BaseSeedSessionRequest) -> BaseSeedSessionResponse:
            await self._rollouts.open(request)
            return BaseSeedSessionResponse()

        async def run_command(self, request: Request, body: RunCommand) -> RunCommandResponse:
            result = await self._rollouts.call(request, "sh", {"cmd": body.command})
            return RunCommandResponse(output=result.output)

        async def verify(self, request: Request, body: BaseVerifyRequest) -> BaseVerifyResponse:
            passed = await self._rollouts.test(request, run_tests, key="tests")
            await self._rollouts.close(request)
            return BaseVerifyResponse(**body.model_dump(), reward=float(passed.value))

**Task ids** follow NeMo-Gym's own: an Environment Server's seed names the task (``task_id``: its taskset and
id, as ``taskset:id``); a rollout seeded by an agent's ``/run`` is named by its row's ``task_id``,
``problem_id``, ``instance_id`` or ``_ng_task_index`` field, the fields ``SimpleAgent`` names a trajectory's task
by, in that order; a row with none of them by a digest of the row itself (its ``_ng_*`` fields, which differ per
rollout, left out). Pass ``task_id=`` a function of the seed's JSON body to choose otherwise.

**What is cached**: the calls made with ``call`` (what ``sandbox``'s tools declare: a shell command is not
known to be deterministic, so its first hit per task is executed once more and compared unless its spec says
``deterministic=True``), and the values of ``test`` (keyed by the state they read; the function must depend on
that state only). **Not cached**: what a route does outside ``call`` (a judge model, a clock), calls the sandbox
marks non-deterministic (a timeout; the rollout then runs uncached), and the seed and verify requests themselves.

An Environment Server's session contract holds (``nemo_gym.testing.session_conformance``): seeding an id again
returns the same session, closing is idempotent, and a seed of an id already closed, or closed before it was
ever seeded, is refused (HTTP 409).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from ..calls import canonical_json
from ..protocol import SandboxFactory
from ..results import ToolResult
from ..session import Session, SessionStats, TestFunction, TestResult
from ._harness import shared_cache
from .cache_location import CacheLocation
from .optional_imports import require

_server_utils = require("nemo_gym.server_utils", "nemo-gym")
_fastapi = require("fastapi", "nemo-gym")
SESSION_ID_KEY: str = _server_utils.SESSION_ID_KEY

__all__ = ["SESSION_ID_KEY", "RolloutSessions", "task_id_of"]

# The row fields SimpleAgent names a trajectory's task by (responses_api_agents/simple_agent), in its order.
TASK_FIELDS = ("task_id", "problem_id", "instance_id", "_ng_task_index")


def task_id_of(body: Mapping[str, Any]) -> str:
    """The tvcache task id of a seed request's JSON body (see the module docstring)."""
    task = body.get("task_id")
    if "resources_session_id" in body and isinstance(task, Mapping):  # an Environment Server's typed seed
        return f"{task['taskset']}:{task['task_id']}"
    for field in TASK_FIELDS:
        value = body.get(field)
        if value is not None and not isinstance(value, Mapping | list):
            return f"nemo-gym:{value}"
    row = {key: value for key, value in body.items() if not key.startswith("_ng_")}
    return "nemo-gym:" + hashlib.blake2b(canonical_json(row), digest_size=16).hexdigest()


class RolloutSessions:
    """The tvcache sessions of a resources server's rollouts, by rollout session id. ``sandbox``: the factory of
    the task's sandboxes (one per process: its snapshots live there); ``cache``: where the graphs live (None:
    in memory; a directory; a ``tvcache serve`` URL); ``task_id``: a function of the seed's JSON body."""

    def __init__(
        self,
        sandbox: SandboxFactory,
        *,
        cache: CacheLocation = None,
        task_id: Callable[[Mapping[str, Any]], str] = task_id_of,
    ) -> None:
        self.sandbox = sandbox
        self.cache = shared_cache(cache)
        self._task_id = task_id
        self._open: dict[str, Session] = {}
        # Environment Server ids closed, so that a late seed cannot bring one back; kept for the server's life, as
        # NeMo-Gym's own servers keep their session records.
        self._closed: set[str] = set()
        self.finished: deque[SessionStats] = deque(maxlen=10_000)  # the stats of the latest closed rollouts

    async def open(self, request: Any) -> Session:
        """Start the rollout's session (in ``seed_session``); idempotent for a rollout already open."""
        body = await request.json()
        if not isinstance(body, Mapping):
            raise _fastapi.HTTPException(status_code=422, detail="a seed_session body is a JSON object")
        typed = body.get("resources_session_id")
        if typed is not None:  # an Environment Server's seed: its id is the rollout's, for the routes after it
            if typed in self._closed:
                raise _fastapi.HTTPException(
                    status_code=409, detail=f"resources session {typed!r} was closed; seed a new id"
                )
            request.session[SESSION_ID_KEY] = str(typed)
        rollout = self._rollout_id(request)
        session = self._open.get(rollout)
        if session is None:
            session = self.cache.session(self._task_id(body), sandbox=self.sandbox)
            self._open[rollout] = session
        return session

    def session(self, request: Any) -> Session:
        """The open session of the rollout ``request`` belongs to."""
        rollout = self._rollout_id(request)
        session = self._open.get(rollout)
        if session is None:
            raise _fastapi.HTTPException(
                status_code=409,
                detail=f"rollout {rollout!r} has no tvcache session: call /seed_session first (or it was verified)",
            )
        return session

    async def call(self, request: Any, tool: str, arguments: dict[str, Any] | None = None) -> ToolResult:
        """One tool call of the rollout, through the cache (exactly what executing it would return)."""
        return await self.session(request).call(tool, arguments)

    async def test(self, request: Any, fn: TestFunction, *, key: str, mutates: bool = True) -> TestResult:
        """An end-of-rollout check run in the sandbox at the rollout's state (a reward), cached by that state."""
        return await self.session(request).test(fn, key=key, mutates=mutates)

    async def close(self, request: Any) -> SessionStats | None:
        """End the rollout (in ``verify``): stop its sandbox. Idempotent; returns its stats, None if none."""
        return await self.close_id(self._rollout_id(request))

    async def close_id(self, rollout: str, *, tombstone: bool = False) -> SessionStats | None:
        """End the rollout ``rollout`` (``close_resources_session`` passes its ``resources_session_id`` with
        ``tombstone=True``, so that a seed arriving after the close cannot open it again)."""
        if tombstone:
            self._closed.add(rollout)
        session = self._open.pop(rollout, None)
        if session is None:
            return None
        await session.close()
        self.finished.append(session.stats)
        return session.stats

    async def close_all(self) -> None:
        """Stop every open rollout's sandbox (at the server's shutdown)."""
        for rollout in list(self._open):
            await self.close_id(rollout)

    @staticmethod
    def _rollout_id(request: Any) -> str:
        rollout: str = request.session[SESSION_ID_KEY]
        return rollout

    def __repr__(self) -> str:
        return f"RolloutSessions({self.sandbox!r}, open={len(self._open)})"
