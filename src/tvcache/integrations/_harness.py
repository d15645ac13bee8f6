"""What the harness adapters (Harbor, mini-swe-agent, SWE-ReX) share: one open cache per location, calls passed
through uncached, and a sandbox over a harness's own environment object. Beside it: ``_recorded_errors``
(answers that were exceptions) and ``_file_trees`` (upload digests, kept copies, tar archives).

A harness environment answers some calls by raising (mini-swe-agent's ``Submitted``, SWE-ReX's
``NonZeroExitCodeError``). Such an answer is cached like a return value when the exception can be rebuilt
exactly from its class and arguments (``_recorded_errors.recorded_exception``), and raised again on a hit;
anything else runs uncached (``_recorded_errors.UnrecordedErrors``). A call the adapter does not understand is
never keyed by a guess: it runs through the tool ``PASS_THROUGH`` (declared non-deterministic, so never served
from cache and, since it may change state, the rollout continues uncached from there), counted and logged once
per kind.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from ..calls import ToolCall, ToolSpec
from ..errors import SandboxError
from ..protocol import Outcome
from ..session import Session
from .cache_location import CacheLike, CacheLocation, open_cache
from .external_sandboxes import NoSnapshots

__all__ = [
    "PASS_THROUGH",
    "PASS_THROUGH_READ",
    "PASS_THROUGH_TOOLS",
    "HarnessSandbox",
    "PassThroughs",
    "shared_cache",
]

log = logging.getLogger("tvcache.integrations")

PASS_THROUGH = ToolSpec(
    name="tvcache.pass_through",
    deterministic=False,
    description="a harness call the adapter does not understand: run as it is, uncached",
)
PASS_THROUGH_READ = ToolSpec(
    name="tvcache.pass_through_read",
    read_only=True,
    deterministic=False,
    description="a call that only reads the environment (never changes it), run as it is, uncached",
)
PASS_THROUGH_TOOLS = {spec.name: spec for spec in (PASS_THROUGH, PASS_THROUGH_READ)}

Operation = Callable[[Any], Awaitable[Any]]


_OPENED: dict[str, CacheLike] = {}


def shared_cache(where: CacheLocation) -> CacheLike:
    """One open cache per location (a directory, URL or URLs) in this process: harnesses build a new environment
    per rollout, often from config that holds only JSON, and the rollouts of a run must share one cache."""
    if isinstance(where, str | os.PathLike) or (isinstance(where, list) and all(isinstance(u, str) for u in where)):
        key = json.dumps(os.fspath(where) if not isinstance(where, list) else where)
        if key not in _OPENED:
            _OPENED[key] = open_cache(where)
        return _OPENED[key]
    return open_cache(where)


class PassThroughs:
    """Counts the calls an adapter passed through uncached, logging the first of each kind."""

    def __init__(self, adapter: str) -> None:
        self.adapter = adapter
        self.counts: Counter[str] = Counter()
        self._ids = itertools.count()
        self.pending: dict[int, Operation] = {}
        self.results: dict[int, Any] = {}

    def note(self, kind: str, why: str) -> None:
        if not self.counts[kind]:
            log.warning("tvcache %s: %s passes through uncached (%s)", self.adapter, kind, why)
        self.counts[kind] += 1

    async def run(self, session: Session, kind: str, why: str, operation: Operation, *, read_only: bool = False) -> Any:
        """Run ``operation(real_environment)`` through ``session`` uncached, at the rollout's current state, and
        return (or raise) exactly what it did. ``read_only``: it never changes the environment, so the rollout
        stays on the cached paths."""
        self.note(kind, why)
        key = next(self._ids)
        self.pending[key] = operation
        tool = PASS_THROUGH_READ if read_only else PASS_THROUGH
        try:
            await session.call(tool.name, {"kind": kind, "id": key})
        finally:
            self.pending.pop(key, None)
        outcome = self.results.pop(key)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


class HarnessSandbox(NoSnapshots):
    """A tvcache sandbox over one real harness environment: ``run(real, call)`` executes a cached call;
    pass-through calls run the operation ``PassThroughs`` holds for them."""

    def __init__(
        self,
        real: Any,
        run: Callable[[Any, ToolCall], Awaitable[Outcome]],
        stop: Callable[[Any], Awaitable[None]],
        passes: PassThroughs,
    ) -> None:
        self.real = real
        self._run = run
        self._stop = stop
        self._passes = passes
        self._stopped = False

    async def execute(self, call: ToolCall) -> Outcome:
        if call.name not in PASS_THROUGH_TOOLS:
            return await self._run(self.real, call)
        key = call.arguments["id"]
        operation = self._passes.pending.get(key)
        if operation is None:  # a pass-through is never cached, so never replayed: this is a bug, say so
            raise SandboxError(f"pass-through call {key} has no operation to run")
        try:
            self._passes.results[key] = await operation(self.real)
        except Exception as error:
            self._passes.results[key] = error
        return Outcome(output="", deterministic=False)

    async def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            await self._stop(self.real)
