"""What every persistent shell sandbox does with a call (the overlay one, ``persistent``, and the container one,
``docker_shell``): the command checked, run on the live shell (on a new one when the last ended), and the outcome
rendered with the notes a harness's own terminal session would show.

The sandbox keeps ``_shell`` and ``_untrusted`` and says how a new shell starts (``_new_shell``), what code an
ended one left (``_ended_code``) and how that reads (``_ended_note``); the rest is here, once.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping

from ...calls import ToolCall, ToolSpec
from ...errors import InvalidToolCall
from ...protocol import Outcome
from ..commands import command_timeout, render_shell, validated
from ..threads import Steps, drive
from .pty_shell import PtyResult, PtyShell

__all__ = ["NEW_SHELL_NOTE", "PersistentShellCalls", "persistent_command"]

REPLACED_NOTE = (
    "[the shell replaced itself with another program (exec); the next call starts a new shell in the same files, "
    "and nothing this sandbox does is cached from now on]"
)
NEW_SHELL_NOTE = "[a new shell was started: the previous one ended; its variables, functions and jobs are gone]"


def persistent_command(call: ToolCall, tools: Mapping[str, ToolSpec], default_timeout: float) -> tuple[str, float]:
    """The ``sh`` call's command and timeout; InvalidToolCall for what bash could never be typed."""
    _, arguments = validated(call, tools)
    timeout = command_timeout(arguments, default_timeout)
    command = arguments["cmd"]
    if "\x00" in command:
        raise InvalidToolCall("tool 'sh': a command cannot contain NUL characters (bash never sees them)")
    return command, timeout


class PersistentShellCalls:
    """Mixin for a sandbox driving one long-lived shell (``PtyShell`` or a subclass)."""

    _shell: PtyShell | None
    _untrusted: str | None

    def _new_shell(self, what: str) -> PtyShell:
        """A new shell in the same files, after the last one ended (``what``: the call, for error messages)."""
        raise NotImplementedError

    def _ended_code(self, shell: PtyShell) -> int | None:
        """The exit code the ended ``shell`` left, if known."""
        raise NotImplementedError

    def _ended_note(self, code: int | None) -> str:
        raise NotImplementedError

    def _output_limit(self) -> int:
        """The factory's ``max_output_bytes`` (both flavours' factories have one)."""
        limit: int = self._factory.max_output_bytes  # type: ignore[attr-defined]
        return limit

    def _run_command(
        self, command: str, timeout: float, what: str, abandon: threading.Event
    ) -> tuple[PtyResult, bool, int | None]:
        """Run ``command`` (in a worker thread): its result, whether a new shell had to start for it, and the
        code of a shell it ended."""
        return drive(self._command_steps(command, timeout, what, abandon))

    def _command_steps(
        self, command: str, timeout: float, what: str, abandon: threading.Event
    ) -> Steps[tuple[PtyResult, bool, int | None]]:
        """``_run_command`` as ``Steps`` (``PtyShell.steps``); starting a new shell is never a quick step."""
        restarted = False
        if self._shell is None or not self._shell.alive:
            yield math.inf
            if self._shell is not None:
                self._shell.close()
            self._shell = None
            self._untrusted = self._untrusted or "its shell ended"
            self._shell = self._new_shell(what)
            restarted = True
        shell = self._shell
        result = yield from shell.steps(command, timeout=timeout, limit=self._output_limit(), abandon=abandon)
        code = None
        if result.died:
            self._untrusted = "its shell ended" if result.replaced is None else "its shell replaced itself (exec)"
            code = self._ended_code(shell)
        return result, restarted, code

    def _render(self, result: PtyResult, restarted: bool, code: int | None, timeout: float) -> Outcome:
        plain = result.as_shell_result()
        outcome = render_shell(plain, self._output_limit(), timeout)
        text = outcome.output
        if result.died:
            note = self._ended_note(code) if result.replaced is None else REPLACED_NOTE
            if result.replaced is not None and "line editing" in result.replaced:
                note = self._ended_note(None)
            text += ("" if not text or text.endswith("\n") else "\n") + note
        if restarted:
            text = NEW_SHELL_NOTE + "\n" + text
        return Outcome(
            output=text,
            is_error=outcome.is_error or result.died,
            changed_state=True,  # even `cat` moves $LINENO and $_ in a persistent shell
            deterministic=outcome.deterministic and self._untrusted is None and not result.background,
        )

    def _kill_shell(self) -> None:
        shell = self._shell
        if shell is not None:
            shell.kill()

    @property
    def trusted(self) -> bool:
        """False once the shell ended (or could not be restored): nothing this sandbox does is cached, and it is
        never snapshotted."""
        return self._untrusted is None
