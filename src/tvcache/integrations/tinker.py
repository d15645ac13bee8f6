"""Tinker cookbook: a ``SandboxFactory`` whose sandboxes answer ``run_command``, ``read_file`` and ``write_file``
from a tvcache graph, one graph per task, with the grader cached per state.

tinker-cookbook's recipes (``recipes/harbor_rl``) build one sandbox per rollout with a ``SandboxFactory``
(``async (env_dir, timeout) -> SandboxInterface``); its tools (``HarborBashTool``) and grader (``HarborReward``)
only talk to that interface. ``CachingSandboxFactory`` wraps the factory you use today (Modal, SandboxFusion,
your own): each sandbox it returns is a tvcache session of the task, and the real sandbox is created only on the
first miss (a rollout whose calls all hit never creates one). On a miss after hits a real sandbox is created and
the cached state-changing calls replayed into it. ``read_file`` is read-only; ``run_command`` and ``write_file``
change state. The task key is the Harbor task directory's name (``env_dir`` is ``<task>/environment``), or
``task_id=``.

    from tvcache.integrations.tinker import CachingSandboxFactory

    factory = CachingSandboxFactory.open(inner=default_sandbox_factory, cache="/data/tvcache")  # or URL(s)
    builder = HarborEnvGroupBuilder(..., sandbox_factory=factory)

Replay is the only flavour here: the sandboxes are ``inner``'s (Modal, SandboxFusion, yours), which tvcache
cannot snapshot, and tvcache ships no ``SandboxInterface`` of its own yet through which a persistent shell could
be asked for. A Harbor task that needs processes kept between commands runs on tvcache's shells through Harbor
itself: ``harbor.OverlayEnvironment(..., persistent=True)``.

The grader as the session's test: ``await sandbox.cached_reward(lambda real: HarborReward(tests_dir, real),
history)`` runs the grader in the real sandbox once per reached state and key; afterwards the sandbox is done.
"""

from __future__ import annotations

import base64
import itertools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..calls import ToolCall, ToolSpec
from ..errors import SessionClosed
from ..protocol import Outcome
from ..session import Session
from .cache_location import CacheLike, CacheLocation, open_cache
from .external_sandboxes import ExternalSandboxFactory, NoSnapshots
from .optional_imports import require

__all__ = ["TOOLS", "CachedSandbox", "CachingSandboxFactory"]

KIND = "tinker"
TOOLS = {
    "run_command": ToolSpec(name="run_command", description="SandboxInterface.run_command"),
    "read_file": ToolSpec(name="read_file", read_only=True, description="SandboxInterface.read_file"),
    "write_file": ToolSpec(name="write_file", description="SandboxInterface.write_file"),
}
InnerFactory = Callable[[Path, int], Awaitable[Any]]
RewardFn = Callable[[list[Any]], Awaitable[tuple[float, dict[str, float]]]]
_counter = itertools.count()


def _content_json(content: str | bytes) -> dict[str, str]:
    if isinstance(content, bytes):
        return {"base64": base64.b64encode(content).decode()}
    return {"text": content}


class _RealSandbox(NoSnapshots):
    """A real tinker sandbox as a tvcache sandbox."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def execute(self, call: ToolCall) -> Outcome:
        a = call.arguments
        if call.name == "run_command":
            result = await self.inner.run_command(
                a["command"], workdir=a["workdir"], timeout=a["timeout"], max_output_bytes=a["max_output_bytes"]
            )
        elif call.name == "read_file":
            result = await self.inner.read_file(a["path"], max_bytes=a["max_bytes"], timeout=a["timeout"])
        else:
            body = a["content"]
            content = base64.b64decode(body["base64"]) if "base64" in body else body["text"]
            result = await self.inner.write_file(a["path"], content, executable=a["executable"], timeout=a["timeout"])
        output = {"stdout": result.stdout, "stderr": result.stderr, "exit_code": result.exit_code}
        return Outcome(output=json.dumps(output, sort_keys=True), is_error=result.exit_code != 0)

    async def stop(self) -> None:
        await self.inner.cleanup()


class CachedSandbox:
    """A tinker ``SandboxInterface`` over one tvcache session (one rollout of one task)."""

    def __init__(self, session: Session, *, sandbox_id: str) -> None:
        self.session = session
        self._sandbox_id = sandbox_id
        self._result_type = require("tinker_cookbook.sandbox", "tinker").SandboxResult
        self.graded = False

    @property
    def sandbox_id(self) -> str:
        return self._sandbox_id

    async def send_heartbeat(self, timeout: int = 30) -> None:
        """Nothing to keep alive until a miss creates the real sandbox; it is used right away then."""

    async def _call(self, name: str, arguments: dict[str, Any]) -> Any:
        if self.graded:
            raise SessionClosed(f"sandbox {self._sandbox_id} was graded; its state is final (make a new one)")
        result = await self.session.call(name, arguments)
        data = json.loads(result.output)
        return self._result_type(stdout=data["stdout"], stderr=data["stderr"], exit_code=data["exit_code"])

    async def run_command(
        self, command: str, workdir: str | None = None, timeout: int = 60, max_output_bytes: int | None = None
    ) -> Any:
        arguments = {"command": command, "workdir": workdir, "timeout": timeout, "max_output_bytes": max_output_bytes}
        return await self._call("run_command", arguments)

    async def read_file(self, path: str, max_bytes: int | None = None, timeout: int = 60) -> Any:
        return await self._call("read_file", {"path": path, "max_bytes": max_bytes, "timeout": timeout})

    async def write_file(self, path: str, content: str | bytes, executable: bool = False, timeout: int = 60) -> Any:
        arguments = {"path": path, "content": _content_json(content), "executable": executable, "timeout": timeout}
        return await self._call("write_file", arguments)

    async def cached_reward(
        self, make_reward: Callable[[Any], RewardFn], history: list[Any], *, key: str = "grader"
    ) -> tuple[float, dict[str, float]]:
        """Grade the reached state with ``make_reward(real_sandbox)(history)``, cached per state and ``key``.

        The grader must depend only on the sandbox's state (``HarborReward`` ignores ``history``). It may
        write into the sandbox, so the sandbox takes no more calls afterwards.
        """

        async def grade(real: _RealSandbox) -> list[Any]:
            reward, metrics = await make_reward(real.inner)(history)
            return [reward, metrics]

        result = await self.session.test(grade, key=key)  # type: ignore[arg-type]
        self.graded = True
        reward, metrics = result.value
        return float(reward), {name: float(value) for name, value in metrics.items()}

    async def cleanup(self) -> None:
        """Stop the real sandbox if one was created. Idempotent."""
        await self.session.close()


@dataclass(frozen=True, kw_only=True)
class CachingSandboxFactory:
    """A tinker-cookbook ``SandboxFactory`` of caching sandboxes over ``inner`` (your current factory)."""

    inner: InnerFactory
    cache: CacheLike
    task_id: str | None = None

    @classmethod
    def open(
        cls,
        *,
        inner: InnerFactory,
        cache: CacheLocation,
        task_id: str | None = None,
        token: str | None = None,
        audit_rate: float = 0.0,
        verify_undeclared: bool = True,
    ) -> CachingSandboxFactory:
        """Open ``cache`` (None, a directory, a URL or a list of URLs) and wrap ``inner``. ``audit_rate`` and
        ``verify_undeclared``: the cache's checks (see ``tvcache.Cache``)."""
        opened = open_cache(cache, token=token, audit_rate=audit_rate, verify_undeclared=verify_undeclared)
        return cls(inner=inner, cache=opened, task_id=task_id)

    async def __call__(self, env_dir: Path, timeout: int) -> CachedSandbox:
        task = self.task_id or f"tinker:{Path(env_dir).resolve().parent.name}"

        async def start() -> _RealSandbox:
            return _RealSandbox(await self.inner(env_dir, timeout))

        factory = ExternalSandboxFactory(kind=KIND, tools=TOOLS, start=start)
        session = self.cache.session(task, sandbox=factory)
        return CachedSandbox(session, sandbox_id=f"tvcache-{task}-{next(_counter)}")
