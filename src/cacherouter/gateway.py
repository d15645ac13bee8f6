"""The gateway: serves the current registry, reloads it when the repository changes, and runs tools.

Reloading is polling, not inotify, so it works on any file system and in tests without timing games: a poll
takes a content fingerprint of the repository, and only when it differs builds a complete new
:class:`~cacherouter.registry.Registry` and swaps it in with one reference assignment. Readers that already hold
the old registry keep a consistent view; a build that fails as a whole leaves the previous registry serving.

A broken script is a :class:`~cacherouter.registry.Problem`, logged (``logging.warning``) the first poll it
appears in; an unexpected error in a background poll is logged and kept in :attr:`Gateway.last_error`, and the
polling carries on. Tools run with the environment of this process minus the model endpoints' API keys
(:func:`~cacherouter.executor.tool_environment`), plus ``CACHEROUTER_REPO``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ArgumentError, CacheRouterError
from .executor import Cancellation, ToolResult, build_argv, run_script, tool_environment
from .registry import Limits, Registry, build_registry, repository_snapshot, write_package_indices


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    root: Path
    limits: Limits = field(default_factory=Limits)
    allow_reflection: bool = False
    reflection_timeout: float = 10.0
    tool_timeout: float = 60.0
    poll_interval: float = 1.0
    index_dir: Path | None = None  # where package indices are written; None keeps them in memory only

    def __post_init__(self) -> None:
        # Tools run in their own directory and find the repository through CACHEROUTER_REPO: both need it absolute.
        object.__setattr__(self, "root", Path(self.root).absolute())


@dataclass(frozen=True, kw_only=True)
class ReloadOutcome:
    """What one poll did."""

    changed: bool
    registry: Registry
    error: str | None = None  # set when the rebuild failed and the previous registry kept serving


Listener = Callable[[Registry], None]

logger = logging.getLogger(__name__)


class Gateway:
    """Holds the live registry of a tool repository."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self._lock = threading.Lock()  # serialises rebuilds; reads of self._registry need no lock
        self._snapshot: tuple[tuple[str, str], ...] | None = None
        self._registry = Registry()
        self._listeners: list[Listener] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None
        self.poll()

    @property
    def registry(self) -> Registry:
        return self._registry

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(new_registry)`` after every swap (e.g. to send MCP tools/list_changed)."""
        self._listeners.append(listener)

    def poll(self) -> ReloadOutcome:
        """Check the repository once; rebuild and swap if anything changed."""
        with self._lock:
            try:
                snapshot = repository_snapshot(self.config.root)
            except CacheRouterError as e:
                self.last_error = str(e)
                return ReloadOutcome(changed=False, registry=self._registry, error=str(e))
            if snapshot == self._snapshot:
                return ReloadOutcome(changed=False, registry=self._registry)
            previous = self._registry if self._snapshot is not None else None
            try:
                registry = build_registry(
                    self.config.root,
                    limits=self.config.limits,
                    allow_reflection=self.config.allow_reflection,
                    reflection_timeout=self.config.reflection_timeout,
                    previous=previous,
                )
            except (CacheRouterError, OSError) as e:
                self.last_error = str(e)
                return ReloadOutcome(changed=False, registry=self._registry, error=str(e))
            if previous is not None:  # problems found at start-up are the caller's to report
                for problem in sorted(set(registry.problems) - set(previous.problems), key=lambda p: p.path):
                    logger.warning("tool script %s: %s", problem.path, problem.message)
            self._snapshot = snapshot
            self._registry = registry  # the atomic swap
            self.last_error = None
            if self.config.index_dir is not None:
                write_package_indices(registry, self.config.index_dir)
        for listener in list(self._listeners):
            try:
                listener(registry)
            except Exception:  # one broken subscriber must not starve the others or stop the polling
                logger.exception("registry listener %r failed", listener)
        return ReloadOutcome(changed=True, registry=registry)

    def start(self) -> None:
        """Poll in a background thread every ``poll_interval`` seconds until :meth:`close`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="cacherouter-gateway-poll", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.config.poll_interval):
            try:
                self.poll()
            except Exception as e:  # an unexpected error must not end hot reload for the life of the process
                self.last_error = f"poll failed: {type(e).__name__}: {e}"
                logger.exception("cacherouter gateway: poll of %s failed; polling carries on", self.config.root)

    def close(self) -> None:
        """Stop polling. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, self.config.poll_interval * 2))
            self._thread = None

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(
        self,
        name: str,
        arguments: Mapping[str, Any],
        *,
        timeout: float | None = None,
        cancel: Cancellation | None = None,
    ) -> ToolResult:
        """Run tool ``name`` with ``arguments`` (a JSON object). Unknown tools and bad arguments raise.

        ``cancel.cancel()``, from any thread, stops the run (see :class:`~cacherouter.executor.Cancellation`).
        """
        spec = self._registry.get(name)
        if spec is None:
            raise ArgumentError(f"no tool named {name!r} is registered")
        argv = build_argv(spec.schema, arguments)
        # Tools that manage the repository (the skill builder) find it through this variable.
        env = tool_environment(CACHEROUTER_REPO=str(self.config.root))
        return run_script(
            spec.script, argv, tool=name, timeout=timeout or self.config.tool_timeout, env=env, cancel=cancel
        )
