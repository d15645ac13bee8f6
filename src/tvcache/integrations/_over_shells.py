"""The sandbox factory a harness adapter puts over persistent shell sandboxes (SWE-ReX's shell flavour, OpenHands
workspaces): its sandboxes wrap the shell backend's, and its snapshots are the shell backend's under a kind of
its own, so that only this adapter forks them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

from ..calls import ToolSpec
from ..errors import InvalidToolCall, SandboxError
from ..protocol import Sandbox, Snapshot, cost_hints
from ..sandboxes.shell.sandbox import ShellSandboxFactory

__all__ = ["OverPersistentShells"]

Wrapped = TypeVar("Wrapped")


class OverPersistentShells(Generic[Wrapped]):
    """Sandboxes of ``shell`` (a persistent shell factory, else InvalidToolCall saying that ``needs`` one), each
    wrapped by ``wrap``; ``kind`` names the snapshots, ``sandbox`` the wrapped sandboxes in errors."""

    kind: str
    needs: str  # "SWE-ReX sessions need": who needs a persistent shell factory
    sandbox: str  # "a SWE-ReX shell sandbox": what cannot fork another kind's snapshot

    def __init__(self, shell: ShellSandboxFactory, tools: Mapping[str, ToolSpec]) -> None:
        if not isinstance(shell, ShellSandboxFactory) or not shell.persistent:
            raise InvalidToolCall(
                f"{self.needs} a persistent shell factory, ShellSandbox.factory(tree, persistent=True); got {shell!r}"
            )
        self.shell = shell
        self._tools = tools
        self.cost_hints: Mapping[str, float] = cost_hints(shell)

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        return self._tools

    def wrap(self, inner: Sandbox) -> Wrapped:
        raise NotImplementedError

    async def start(self) -> Wrapped:
        return self.wrap(await self.shell.start())

    async def fork(self, snapshot: Snapshot) -> Wrapped:
        return self.wrap(await self.shell.fork(self._inner(snapshot)))

    def discard(self, snapshot: Snapshot) -> None:
        self.shell.discard(self._inner(snapshot))

    def route_counts(self) -> dict[str, int]:
        return self.shell.route_counts()

    def _inner(self, snapshot: Snapshot) -> Snapshot:
        if snapshot.kind != self.kind:
            raise SandboxError(f"cannot fork {self.sandbox} from a {snapshot.kind!r} snapshot")
        return Snapshot(kind=self.shell.kind, path=snapshot.path, bytes=snapshot.bytes, meta=snapshot.meta)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.shell!r})"
