"""The CRIU route of persistent shell snapshots: for a shell with live processes beside it (a background server,
a REPL, a tmux server), where bash's own builtins cannot carry the state.

Capture: the shell's state is read first (``__tvcache_capture``, as the shell-state route reads it), then CRIU
dumps the sandbox's whole process tree (its PID namespace) into an image directory next to the snapshot, and
ends the tree, frozen at the dump: its files are then exactly what the overlay freeze that follows turns into
a layer. The sandbox goes on in a copy restored from the image over its new upper layer, exactly as every fork
of the snapshot does.

Restore (a fork, or the sandbox itself after its snapshot): a fresh pty pair, ``criu restore`` into new
namespaces over the fork's tree with the pty's slave as the session's terminal, the namespace's last PID set
back to the dumped one (so the copy's next job gets the PID the original's would), and the restored shell is
then driven over the master as any other. Every restore is checked: the copy must answer a state capture, and
its state must equal the one captured before the dump; otherwise the fork fails (the cache then forks the next
snapshot up, or replays) and nothing is left running.

Refused, so that the snapshot is declined when no other route fits: no working CRIU (``criu.find_criu``), a
DEBUG or RETURN trap (it would fire on the capture that checks every restore), a root-filesystem sandbox (not
supported yet). Declined when the dump fails: descriptors CRIU cannot carry (a socket to a process outside the
sandbox, ...), no space left for the image, CRIU dying. A dump that fails late can take the tree with it: the
sandbox then meets a shell that ended (``persistent``: it is no longer trusted).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from ...errors import CriuError, SandboxError, SnapshotDeclined, SnapshotUnusable
from .capture import CaptureRefused
from .criu import Criu, criu_unavailable_reason, discard_images, find_criu
from .pty_shell import PtyShell, Terminal
from .shell_state import ShellLaunch, ShellProbe, ShellState, SnapshotPlace, SnapshotRoute, verify

__all__ = ["CriuRoute"]


class CriuRoute:
    """Carry a shell and its processes by a CRIU dump (see the module docstring). ``find`` returns the CRIU
    to use, or None (default: ``find_criu``, which says once why there is none)."""

    route = SnapshotRoute.CRIU

    def __init__(self, find: Callable[[], Criu | None] = find_criu) -> None:
        self._find = find

    def refusal(self, probe: ShellProbe) -> str | None:
        if probe.firing_traps:
            return "a DEBUG or RETURN trap is set: it would fire on the state capture that checks the restore"
        if self._find() is None:
            return f"no working CRIU ({criu_unavailable_reason() or 'disabled'})"
        return None

    def capture(self, shell: PtyShell, place: SnapshotPlace) -> dict[str, Any]:
        criu = self._find()
        if criu is None:
            raise SnapshotDeclined(f"no working CRIU ({criu_unavailable_reason() or 'disabled'})")
        if place.tree is None:
            raise SnapshotDeclined("the CRIU route does not snapshot root-filesystem sandboxes yet")
        try:
            data = shell.capture_state()
        except CaptureRefused as refused:
            raise SnapshotDeclined(f"the shell's state cannot be captured: {refused}") from None
        state = ShellState.parse(data)
        last_pid = state.lines("last-pid")
        if not state.lines("status") or not last_pid or not last_pid[0].isdigit():
            raise SnapshotDeclined("cannot carry this shell's state: the captured state is incomplete")
        try:
            root = asdict(place.confinement)  # its own root, which a restore rebuilds (``criu``)
            dump = criu.dump(shell.pid, place.images, tree_mountpoint=place.tree, leave_running=False, root=root)
        except CriuError as error:
            raise SnapshotDeclined(f"CRIU could not dump the shell's processes: {error}") from error
        return {
            "images": str(dump.images),
            "image_bytes": dump.image_bytes,
            "state": data.decode("utf-8", errors="surrogateescape"),
            "lineno": shell.lineno,
            "status": shell.status,
            "last_command": shell.last_command,
            "escapes": shell.escapes,
            "last_pid": int(last_pid[0]),
        }

    def restore(self, launch: ShellLaunch, image: Mapping[str, Any]) -> PtyShell:
        criu = self._find()
        if criu is None:
            raise SandboxError(
                f"cannot fork a CRIU snapshot: no working CRIU ({criu_unavailable_reason() or 'disabled'}); "
                "rebuilding the state by replay instead"
            )
        if not os.path.isdir(image["images"]):
            raise SnapshotUnusable(f"the snapshot's CRIU image {image['images']} is gone (discarded?)")
        terminal = Terminal.open()
        try:
            restored = criu.restore(
                image["images"],
                tty_fd=terminal.slave,
                tree_mount_fd=launch.mount_fd,
                last_pid=int(image["last_pid"]),
                cgroups=launch.cgroups,
                keepers=launch.keepers,
            )
        except BaseException:
            os.close(terminal.master)
            raise
        finally:
            os.close(terminal.slave)
        shell = PtyShell.adopt(
            terminal,
            restored.tree,
            restored.pid,
            lineno=int(image["lineno"]),
            status=int(image["status"]),
            last_command=image.get("last_command"),
            escapes=image.get("escapes"),
        )
        try:
            verify(shell, image, moved_on, fresh=False)
        except BaseException:
            shell.close()
            raise
        return shell

    def discard(self, image: Mapping[str, Any]) -> None:
        discard_images(image["images"])


def moved_on(expected: ShellState, actual: ShellState) -> bool:
    """Whether a restored shell's state differs from the one captured before the dump only as the processes
    that live beside it may have moved it on by themselves meanwhile: PIDs handed out (the namespace's last PID
    only grew). Anything else fails the restore."""
    if set(expected.sections) != set(actual.sections):
        return False
    for name in expected.sections:
        if name == "last-pid":
            before, after = expected.lines(name), actual.lines(name)
            if not (before and after and before[0].isdigit() and after[0].isdigit()):
                return False
            if int(after[0]) < int(before[0]):
                return False
        elif name == "vars":
            if expected.variables() != actual.variables():
                return False
        elif expected.sections[name] != actual.sections[name]:
            return False
    return True
