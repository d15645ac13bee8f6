"""TRL: an ``environment_factory`` environment for ``GRPOTrainer`` whose tools are calls through a tvcache session.

TRL (``trl`` >= 1.16, transformers >= 5.2) builds one environment instance per rollout from
``environment_factory``, pools them, and calls ``reset(**row)`` on each before its rollout, with every column of
the dataset row. It lists the instance's class and turns every public method other than ``reset`` and
``get_reward`` into a tool (name, type hints and Google-style docstring make the schema), then calls them in its
tool loop. ``CachingEnvironment`` is such a class: ``bash(command)`` runs the command in the task's sandbox
through the rollout's tvcache session, and a subclass adds tools as public methods built on ``self._shell`` (the
sandbox's shell tool) or ``self._call`` (any tool of the sandbox factory):

    from trl import GRPOTrainer
    from tvcache.integrations.trl import CachingEnvironment
    from tvcache.sandboxes import ShellSandbox

    class RepoEnvironment(CachingEnvironment):
        def read_file(self, path: str) -> str:
            '''Read a file of the repository.

            Args:
                path: The file's path, relative to the repository.
            '''
            return self._shell(f"cat -- {shlex.quote(path)}")

    environments = RepoEnvironment.factory(cache="/data/tvcache", sandbox=ShellSandbox.factory(checkout))
    GRPOTrainer(..., environment_factory=environments).train()
    environments.close()

Everything that is not a tool must stay out of TRL's way: helpers are ``_``-prefixed, and the rest are
properties, classmethods or class attributes (TRL lists the class's plain functions, staticmethods included).

**Task ids.** ``reset(**row)`` closes the previous rollout's session (stopping its sandbox) and opens one of the
row's task: the row's ``task_id`` column (``task_key=`` names another), or, without that column, a digest of the
whole row (every column, as JSON: stable across epochs, and rows that differ in anything never share a graph).
The ``num_generations`` rollouts of a row share the task's graph, so siblings hit each other's calls and a later
epoch hits the first's. Override ``_task_id(row)`` for another rule, and ``_sandbox_for(row)`` to give tasks
sandboxes of their own (one checkout per task); a task id must name one initial state.

**What is cached.** Each call through ``_shell``/``_call`` (``bash`` included), keyed by the rollout's history:
a hit is what executing it after the same calls returns. A miss gets a sandbox lazily: overlay shell sandboxes
(``ShellSandbox.factory(tree)``, one process per command, or ``persistent=True``: one long-lived shell per
rollout, whose snapshots carry its state) fork the snapshot nearest the divergence; other backends replay the
path. ``_check(command)`` runs an end-of-rollout check (a reward's tests) cached per reached state. Whether a
tool's results may be cached is the sandbox factory's declaration (its ``ToolSpec``; shell sandboxes declare
``sh`` deterministic, since they run it confined in a fixed environment, so a command that reads the clock or
``$RANDOM`` is served as first answered: ``audit_rate=`` re-executes a fraction of hits and reports differences).

**What is not.** Tools a subclass writes without ``_shell``/``_call`` run as written. An outcome the backend
reports non-deterministic (a command that timed out, hit a limit or left a process behind) is returned but not
cached, and the rollout runs live and uncached from there, since its state cannot be reproduced. Tool results are
text (no images). There are no uploads: a tool's arguments are the model's JSON; files a task needs belong in
its sandbox's base tree, or in calls made through ``_shell`` in ``reset``.

Tools are synchronous (TRL runs them one after another in its loop); tvcache's calls run on the adapter's
background event loop. Under ``accelerate launch`` each process has its own environments: give ``cache`` a
``tvcache serve`` URL so they share the graphs. This module imports nothing of TRL, whose environment protocol
is duck-typed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ..calls import ToolCall, canonical_json, stable_digest
from ..errors import InvalidInput, SessionClosed
from ..protocol import SandboxFactory
from ..results import ToolResult
from ..session import Session
from .background_loop import shared_loop
from .cache_location import CacheLike, CacheLocation, open_cache

__all__ = ["CachingEnvironment", "CachingEnvironmentFactory"]

KIND = "trl"


class CachingEnvironment:
    """A TRL environment whose tools go through a tvcache session of the row's task. See the module docstring."""

    shell_tool: ClassVar[str] = "sh"  # the sandbox factory's shell tool: {"cmd": str}

    def __init__(self, *, cache: CacheLike, sandbox: SandboxFactory, task_key: str = "task_id") -> None:
        self._cache = cache
        self._sandbox = sandbox
        self._task_key = task_key
        self._session: Session | None = None
        self._rollouts = 0

    @classmethod
    def factory(
        cls,
        *,
        cache: CacheLocation,
        sandbox: SandboxFactory,
        task_key: str = "task_id",
        token: str | None = None,
        audit_rate: float = 0.0,
        verify_undeclared: bool = True,
        **options: Any,
    ) -> CachingEnvironmentFactory:
        """The ``environment_factory`` to give ``GRPOTrainer``: it opens ``cache`` (None, a directory, a URL or a
        list of URLs; ``audit_rate`` and ``verify_undeclared`` are its checks, see ``tvcache.Cache``) once and makes
        instances of this class over it. ``options``: more keyword arguments of a subclass's ``__init__``."""
        opened = open_cache(cache, token=token, audit_rate=audit_rate, verify_undeclared=verify_undeclared)
        return CachingEnvironmentFactory(
            cls, cache=opened, sandbox=sandbox, task_key=task_key, options=options, owns_cache=opened is not cache
        )

    # ------------------------------------------------------------ TRL's protocol

    def reset(self, **row: Any) -> str | None:
        """Start the rollout of ``row``'s task, ending this instance's previous one. A subclass may return an
        observation (TRL appends it to the prompt's last message) after calling this."""
        self._end_rollout()
        self._session = self._cache.session(self._task_id(row), sandbox=self._sandbox_for(row))
        self._rollouts += 1
        return None

    def bash(self, command: str) -> str:
        """Run a bash command in the task's sandbox and return its output (stdout and stderr).

        Args:
            command: The bash command to run.
        """
        return self._shell(command)

    # ------------------------------------------------------------ state (properties: never tools)

    @property
    def session(self) -> Session | None:
        """The current rollout's session (None before the first ``reset``, and after the factory's ``close``)."""
        return self._session

    @property
    def rollouts(self) -> int:
        """How many rollouts this instance has started."""
        return self._rollouts

    # ------------------------------------------------------------ for subclasses

    def _call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Run one call of the sandbox factory's tool ``name`` through the rollout's session."""
        return shared_loop().run(self._current().call(name, arguments))

    def _shell(self, command: str) -> str:
        """The output of ``command`` run by the sandbox's shell tool, through the rollout's session."""
        return self._call(self.shell_tool, {"cmd": command}).output

    def _check(self, command: str) -> str:
        """The output of ``command`` run as the rollout's end-of-episode check (a reward's tests, say), cached per
        reached state and command. The check may change the sandbox, so the rollout's later calls, if any,
        rebuild their state rather than trust it."""
        tool = self.shell_tool

        async def run(sandbox: Any) -> str:
            output: str = (await sandbox.execute(ToolCall(tool, {"cmd": command}))).output
            return output

        result = shared_loop().run(self._current().test(run, key=f"{KIND}.check:{command}"))
        value: str = result.value
        return value

    def _task_id(self, row: Mapping[str, Any]) -> str:
        """The task of ``row``: its ``task_key`` column, or a digest of the whole row (see the module docstring)."""
        value = row.get(self._task_key)
        if value is not None:
            return str(value)
        try:
            body = canonical_json(dict(row))
        except InvalidInput as error:
            raise InvalidInput(
                f"the dataset row has no {self._task_key!r} column and is not JSON ({error}), so no task id can be "
                f"derived from it: add a {self._task_key!r} column (or pass task_key= naming the column to use)"
            ) from error
        return f"{KIND}:{stable_digest(body).hex()}"

    def _sandbox_for(self, row: Mapping[str, Any]) -> SandboxFactory:
        """The sandbox factory of ``row``'s task: the one given, for every task; override for one per task."""
        return self._sandbox

    def _current(self) -> Session:
        if self._session is None:
            raise SessionClosed(f"{type(self).__name__} has no rollout: TRL calls reset(**row) before the tools")
        return self._session

    def _end_rollout(self) -> None:
        """Close the current rollout's session (stopping its sandbox), if any. Idempotent."""
        session, self._session = self._session, None
        if session is not None:
            shared_loop().run(session.close())


class CachingEnvironmentFactory:
    """What ``CachingEnvironment.factory`` returns: TRL calls it for each instance it pools; ``close()`` ends
    the rollouts still open (TRL has no hook for the last batch's) and closes the cache if it opened it."""

    def __init__(
        self,
        environment: type[CachingEnvironment],
        *,
        cache: CacheLike,
        sandbox: SandboxFactory,
        task_key: str,
        options: Mapping[str, Any],
        owns_cache: bool,
    ) -> None:
        self.environment = environment
        self.cache = cache
        self.sandbox = sandbox
        self.task_key = task_key
        self.options = dict(options)
        self.environments: list[CachingEnvironment] = []  # every instance made, as TRL pools them
        self._owns_cache = owns_cache

    def __call__(self) -> CachingEnvironment:
        instance = self.environment(cache=self.cache, sandbox=self.sandbox, task_key=self.task_key, **self.options)
        self.environments.append(instance)
        return instance

    def close(self) -> None:
        """End every instance's open rollout, then close the cache if this factory opened it. Idempotent."""
        for instance in self.environments:
            instance._end_rollout()
        if self._owns_cache:
            self.cache.close()

    def __repr__(self) -> str:
        return f"CachingEnvironmentFactory({self.environment.__name__}, instances={len(self.environments)})"
