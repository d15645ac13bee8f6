"""The gateway: serves the current registry, reloads it when the repository changes, and runs tools.

Reloading is polling, not inotify, so it works on any file system and in tests without timing games: a poll
takes a content fingerprint of the repository, and only when it differs builds a complete new
:class:`~cacherouter.tools.registry.Registry` and swaps it in with one reference assignment. Readers that already
hold the old registry keep a consistent view; a build that fails as a whole leaves the previous registry serving.

MCP servers are registry sources too (``GatewayConfig.upstreams`` or ``upstreams_file``, see
:mod:`cacherouter.tools.upstreams` and :mod:`cacherouter.tools.upstream_hub`): their tools join the registry under
namespaced names, and a change there (list_changed, a reconnect, a server joining or leaving, an edit of the
upstreams file, read at each poll) ends in the same atomic swap of a whole new registry as a script edit does. On a
name clash the tool that held the name keeps it; with no holder, the script wins.

A broken script is a :class:`~cacherouter.tools.registry.Problem`, logged (``logging.warning``) the first poll it
appears in; an unexpected error in a background poll is logged and kept in :attr:`Gateway.last_error`, and the
polling carries on. Tools run with the environment of this process minus the model endpoints' API keys
(:func:`~cacherouter.tools.executor.tool_environment`), plus ``CACHEROUTER_REPO``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..errors import ArgumentError, CacheRouterError, ConfigError
from .executor import Cancellation, ScriptResult, build_argv, run_script, tool_environment
from .registry import (
    Limits,
    Problem,
    RegisteredTool,
    Registry,
    build_registry,
    repository_snapshot,
    write_package_indices,
)
from .upstreams import UpstreamConfig, load_upstreams

if TYPE_CHECKING:
    from .upstream_hub import UpstreamHub, UpstreamResult, UpstreamStatus


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    root: Path | None  # the script repository; None for a gateway over MCP upstreams only
    limits: Limits = field(default_factory=Limits)
    allow_reflection: bool = False
    reflection_timeout: float = 10.0
    tool_timeout: float = 60.0
    poll_interval: float = 1.0
    index_dir: Path | None = None  # where package indices are written; None keeps them in memory only
    upstreams: tuple[UpstreamConfig, ...] = ()  # MCP servers whose tools join the registry
    upstreams_file: Path | None = None  # or a config file listing them, re-read when it changes
    upstream_debounce: float = 0.2  # list_changed notifications within this many seconds cost one listing

    def __post_init__(self) -> None:
        # Tools run in their own directory and find the repository through CACHEROUTER_REPO: both need it absolute.
        if self.root is not None:
            object.__setattr__(self, "root", Path(self.root).absolute())
        if self.upstreams and self.upstreams_file is not None:
            raise ConfigError("give the MCP upstreams as a list or as a file, not both")


@dataclass(frozen=True, kw_only=True)
class ReloadOutcome:
    """What one poll did."""

    changed: bool
    registry: Registry
    error: str | None = None  # set when the rebuild failed and the previous registry kept serving


Listener = Callable[[Registry], None]

logger = logging.getLogger(__name__)


class Gateway:
    """Holds the live registry of a tool repository and of the MCP upstreams."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self._lock = threading.Lock()  # serialises rebuilds; reads of self._registry need no lock
        self._snapshot: tuple[tuple[str, str], ...] | None = None
        self._scripts = Registry()  # the script repository's part of the registry
        self._registry = Registry()
        self._listeners: list[Listener] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hub: UpstreamHub | None = None
        self._upstreams_digest: str | None = None
        self.last_error: str | None = None
        if config.upstreams or config.upstreams_file is not None:
            from .upstream_hub import UpstreamHub  # needs the 'mcp' extra; the import says so when it is missing

            upstreams = config.upstreams
            if config.upstreams_file is not None:
                upstreams = load_upstreams(config.upstreams_file)  # a bad file at start-up is the caller's error
                self._upstreams_digest = _file_digest(config.upstreams_file)
            self._hub = UpstreamHub(
                upstreams, limits=config.limits, on_change=self._upstreams_changed, debounce=config.upstream_debounce
            )
        self.poll()
        if self._hub is not None:
            self._hub.start()  # waits for each server's first attempt, so the first registry has their tools

    @property
    def registry(self) -> Registry:
        return self._registry

    @property
    def upstreams(self) -> tuple[UpstreamStatus, ...]:
        """The state of each MCP upstream (empty without upstreams)."""
        return self._hub.status() if self._hub is not None else ()

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(new_registry)`` after every swap (e.g. to send MCP tools/list_changed)."""
        self._listeners.append(listener)

    def poll(self) -> ReloadOutcome:
        """Check the repository (and the upstreams file) once; rebuild and swap if anything changed."""
        self._poll_upstreams_file()
        if self.config.root is None:
            return ReloadOutcome(changed=False, registry=self._registry)
        with self._lock:
            try:
                snapshot = repository_snapshot(self.config.root)
            except CacheRouterError as e:
                self.last_error = str(e)
                return ReloadOutcome(changed=False, registry=self._registry, error=str(e))
            if snapshot == self._snapshot:
                return ReloadOutcome(changed=False, registry=self._registry)
            previous = self._scripts if self._snapshot is not None else None
            try:
                scripts = build_registry(
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
                for problem in sorted(set(scripts.problems) - set(previous.problems), key=lambda p: p.path):
                    logger.warning("tool script %s: %s", problem.path, problem.message)
            self._snapshot = snapshot
            self._scripts = scripts
            self.last_error = None
            registry = self._swap()
        self._notify(registry)
        return ReloadOutcome(changed=True, registry=registry)

    def _poll_upstreams_file(self) -> None:
        path = self.config.upstreams_file
        if path is None or self._hub is None:
            return
        digest = _file_digest(path)
        if digest == self._upstreams_digest:
            return
        self._upstreams_digest = digest
        try:
            upstreams = load_upstreams(path)
        except CacheRouterError as e:  # a bad edit keeps the servers that were configured before
            self.last_error = f"{e}; the MCP upstreams configured before keep serving"
            logger.warning("%s", self.last_error)
            return
        self._hub.set_upstreams(upstreams)

    def _upstreams_changed(self) -> None:
        """Hub listener (runs on the hub's thread): merge the new upstream tools and swap."""
        with self._lock:
            registry = self._swap()
        self._notify(registry)

    def _swap(self) -> Registry:
        """Merge the script registry and the upstream tools into a new registry and swap it in (holding the lock)."""
        scripts = self._scripts
        tools: dict[str, RegisteredTool] = dict(scripts.tools)
        problems: list[Problem] = list(scripts.problems)
        if self._hub is not None:
            holders = self._registry.tools
            for name, spec in sorted(self._hub.tools.items()):
                held = holders.get(name)
                if name in tools and not (held is not None and held.upstream == spec.upstream and held.upstream):
                    problems.append(
                        Problem(path=spec.package, message=f"tool name {name!r} is taken by a script; left out")
                    )
                    continue
                if name in tools:  # the upstream tool held the name before the script appeared: it keeps it
                    script = tools[name]
                    problems.append(
                        Problem(
                            path=str(script.script or script.name),
                            message=f"tool name {name!r} is held by MCP server {spec.upstream!r}; rename the script",
                        )
                    )
                tools[name] = spec
            problems.extend(self._hub.problems)
        registry = Registry(
            tools=MappingProxyType(tools), problems=tuple(problems), generation=self._registry.generation + 1
        )
        self._registry = registry  # the atomic swap
        if self.config.index_dir is not None:
            write_package_indices(registry, self.config.index_dir)
        return registry

    def _notify(self, registry: Registry) -> None:
        for listener in list(self._listeners):
            try:
                listener(registry)
            except Exception:  # one broken subscriber must not starve the others or stop the polling
                logger.exception("registry listener %r failed", listener)

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
        """Stop polling and disconnect the MCP upstreams (their processes are stopped). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, self.config.poll_interval * 2))
            self._thread = None
        if self._hub is not None:
            self._hub.close()

    def set_upstreams(self, upstreams: tuple[UpstreamConfig, ...]) -> None:
        """Replace the MCP upstreams: new ones connect, gone ones disconnect, unchanged ones are left alone."""
        if self._hub is None:
            raise ConfigError("this gateway was started without MCP upstreams")
        self._hub.set_upstreams(upstreams)

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
    ) -> ScriptResult | UpstreamResult:
        """Run tool ``name`` with ``arguments`` (a JSON object). Unknown tools and bad arguments raise.

        A script runs as a subprocess (:class:`~cacherouter.tools.executor.ScriptResult`); an upstream tool is called on
        its MCP server, with the arguments as given -- the server checks them against the schema it declared
        (:class:`~cacherouter.tools.upstream_hub.UpstreamResult`). ``cancel.cancel()``, from any thread, stops the run
        (see :class:`~cacherouter.tools.executor.Cancellation`).
        """
        spec = self._registry.get(name)
        if spec is None:
            raise ArgumentError(f"no tool named {name!r} is registered")
        if spec.upstream:
            if self._hub is None:  # pragma: no cover - upstream tools only come from the hub
                raise ArgumentError(f"{name!r} is an MCP tool, and this gateway has no upstreams")
            return self._hub.call(spec, arguments, timeout=timeout, cancel=cancel)
        if spec.script is None or self.config.root is None:  # pragma: no cover - scripts come from the repository
            raise ArgumentError(f"tool {name!r} has no script to run")
        argv = build_argv(spec.schema, arguments)
        # Tools that manage the repository (the skill builder) find it through this variable.
        env = tool_environment(CACHEROUTER_REPO=str(self.config.root))
        return run_script(
            spec.script, argv, tool=name, timeout=timeout or self.config.tool_timeout, env=env, cancel=cancel
        )


def _file_digest(path: Path) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as e:
        return f"unreadable: {e}"
