"""An OpenHands tool that runs commands through the conversation's workspace (``workspace.execute_command``).

The SDK's own tools (``TerminalTool``, ``FileEditorTool``, ...) work on ``workspace.working_dir`` directly, in
this process, when the conversation is local; only a remote conversation's agent server runs them elsewhere.
So an agent loop reaches a workspace's sandbox through a tool that calls the workspace: this one. It works with
any ``BaseWorkspace`` (the SDK's ``LocalWorkspace`` as well as ``CachingWorkspace``), which is what makes an
uncached run of the same agent a faithful reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

from pydantic import Field

from .optional_imports import require

_tool = require("openhands.sdk.tool", "openhands")
Action: Any = _tool.Action
Observation: Any = _tool.Observation
ToolExecutor: Any = _tool.ToolExecutor
ToolDefinition: Any = _tool.ToolDefinition

__all__ = ["WorkspaceCommandAction", "WorkspaceCommandObservation", "WorkspaceCommandTool"]

DESCRIPTION = (
    "Run a shell command (with /bin/sh) in the workspace's working directory and get its exit code, standard "
    "output and standard error. Each command runs in a new shell: cd and variables do not carry over, files do."
)


class WorkspaceCommandAction(Action):  # type: ignore[misc]
    """One command for ``workspace.execute_command``."""

    command: str = Field(description="The shell command to run.")
    timeout: float = Field(default=30.0, ge=0, description="Seconds the command may run before it is killed.")


class WorkspaceCommandObservation(Observation):  # type: ignore[misc]
    """What the command returned, as the workspace's ``CommandResult`` has it."""

    exit_code: int = Field(description="The command's exit code (-1 after a timeout).")
    timeout_occurred: bool = Field(default=False, description="Whether the command was killed at its timeout.")


def render(result: Any) -> str:
    """The observation's text: the exit code, then stdout and stderr as the command printed them."""
    head = "timed out" if result.timeout_occurred else f"exit code {result.exit_code}"
    return f"[{head}]\n[stdout]\n{result.stdout}[stderr]\n{result.stderr}"


class WorkspaceCommandExecutor(ToolExecutor):  # type: ignore[misc]
    """Runs an action through ``workspace.execute_command`` (any ``BaseWorkspace``)."""

    def __init__(self, workspace: Any) -> None:
        self.workspace = workspace

    def __call__(self, action: WorkspaceCommandAction, conversation: Any = None) -> WorkspaceCommandObservation:
        result = self.workspace.execute_command(action.command, timeout=action.timeout)
        observation: WorkspaceCommandObservation = WorkspaceCommandObservation.from_text(
            render(result),
            is_error=result.exit_code != 0,
            exit_code=result.exit_code,
            timeout_occurred=result.timeout_occurred,
        )
        return observation


class WorkspaceCommandTool(ToolDefinition):  # type: ignore[misc]
    """The tool ``workspace_command``: a command through ``conv_state.workspace.execute_command``. Give an
    agent ``Tool(name="WorkspaceCommandTool")``."""

    @classmethod
    def create(cls, conv_state: Any, **params: Any) -> Sequence[Self]:
        if params:
            raise ValueError(f"WorkspaceCommandTool takes no parameters, got {sorted(params)}")
        annotations = _tool.ToolAnnotations(
            title="workspace_command", readOnlyHint=False, destructiveHint=True, idempotentHint=False
        )
        return [
            cls(
                description=DESCRIPTION,
                action_type=WorkspaceCommandAction,
                observation_type=WorkspaceCommandObservation,
                annotations=annotations,
                executor=WorkspaceCommandExecutor(conv_state.workspace),
            )
        ]


_tool.register_tool("WorkspaceCommandTool", WorkspaceCommandTool)
