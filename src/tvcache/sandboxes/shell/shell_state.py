"""Snapshot routes of a live persistent shell, and the *shell state* route: bash's state read with its own
builtins and rebuilt in a fresh shell.

A snapshot of a persistent shell is its files (the overlay freeze every shell sandbox does) plus its process
state, carried by the cheapest exact route. ``choose_route`` is the one place that picks it, per snapshot: each
strategy in order either refuses (saying why) or captures; when every one refuses, the snapshot is declined
(``SnapshotDeclined``) and later states replay, slower but never wrong. Strategies are small objects with a
``route`` name: this one, and the CRIU route for live processes (``criu_route``); ``ROUTES`` lists both, the
cheaper first.

The shell-state route applies when bash is the only process in its namespace and holds no descriptor besides
its terminal. It captures (``capture``: a trap, so no line is typed, in a format no content can steer, with checks
from outside that nothing of the user's runs inside it): ``$?``, ``$_``, ``$0``, the positional parameters, the
working directory (logical, and physical as read from outside), every variable with its attributes except bash's
dynamic ones, functions and their attributes, aliases, ``shopt`` and ``set`` options, umask, traps, completion
specs, ``COMP_WORDBREAKS``, the directory stack, the command hash table, the namespace's last PID; and from outside
the shell: its resource limits and nice value, disabled builtins, where ``getopts`` stands, the files its functions
came from, and the shape of bash's special variables. A fork starts a fresh shell whose boot script unsets what a
fresh shell defines, then declares all of it (limits and nice value are set from outside, by ``prlimit`` and
``setpriority``); typed empty lines bring ``$LINENO`` to the same count, and one line sets ``$?`` and ``$_``. The
fork then captures its own state and compares it with the snapshot's, section by section: any difference fails
the fork (the cache then rebuilds the state by replay), so a fork never runs in a different state. The live
sandbox takes the same path: its restore is tried beside the live shell before that one ends (``persistent``).

What this route cannot carry makes it refuse: other processes (background jobs, coprocs), extra descriptors
(``exec 3>file``), a ``$!`` (it names a PID of the old namespace; a finished job bash has not reported has one),
DEBUG/RETURN/ERR traps (they would fire on the restore itself), history turned on, functions that read
``$LINENO`` (bash renumbers a function's lines when it lists it), a function defined in a sourced file (its
``BASH_SOURCE``), ``getopts`` stopped inside a bundled option (``-abc``), a removed working directory, files in the
shell's private tmpfs directories (``/tmp``, ``/dev/shm``, ...: a fresh shell gets empty ones), and anything the
capture's own checks refuse (``capture``). Not carried, by design (``UNCOMPARED`` and what no capture reads):
``$RANDOM``'s generator (seeded anew), ``$SECONDS`` (counts from the restore), the hash table's hit counts, ``\\#``
in PS1, ``BASH_SOURCE`` inside a function defined before the snapshot (``/dev/stdin`` or ``/dev/fd/3``, the boot,
where a plain shell says ``main``), and the line a function was defined at (``declare -F`` under ``extdebug``).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import re
import resource
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ...errors import SandboxError, SnapshotDeclined
from .capture import OUTSIDE, SECTIONS, CaptureRefused, decode_state
from .pty_shell import DYNAMIC, FRESH_LINENO, GRACE_SECONDS, RESET_VARIABLES, PtyShell, ansi_c_quote
from .zygote import Confinement

__all__ = [
    "ShellLaunch",
    "ShellProbe",
    "ShellState",
    "ShellStateRoute",
    "SnapshotPlace",
    "SnapshotRoute",
    "SnapshotStrategy",
    "choose_route",
    "route_of",
]

# Set by the line that ends a fork's boot, so that the typed padding lines print no prompt and run nothing.
PROMPT_VARIABLES = ("PS0", "PS1", "PROMPT_COMMAND")
UNSETTABLE_OPTIONS = ("login_shell", "restricted_shell")
FIRING_TRAPS = ("DEBUG", "RETURN", "ERR")
MAX_BOOT_BYTES = 100_000  # the boot script travels in an environment variable (128 KiB at most)
# Not compared between a shell and its fork: a restored shell's functions were all defined by its boot (their
# BASH_SOURCE reads /dev/stdin, a plain shell's "main"); one defined in a sourced file declines the snapshot.
UNCOMPARED = frozenset({"function-sources"})
_PLAIN_SOURCES = frozenset({"main", "environment", "/dev/stdin", "/dev/fd/3"})  # a plain shell, a cold boot, a warm one
_SHOPT_LINE = re.compile(r"^shopt (-[su]) ([a-z0-9_]+)$")
_SET_LINE = re.compile(r"^set ([-+]o [a-z-]+)$")
_DECLARATION = re.compile(r"^declare -(\S+) ([A-Za-z_][A-Za-z0-9_]*)(=|$)")


class SnapshotRoute(enum.Enum):
    """How a snapshot of a persistent shell carried its process state (counted per factory)."""

    SHELL_STATE = "shell-state"
    CRIU = "criu"
    DECLINED = "declined"


@dataclass(frozen=True, kw_only=True, slots=True)
class ShellProbe:
    """What the route chooser knows about a live shell, read from outside it before anything is captured."""

    untrusted: str | None  # why nothing this shell does may be cached any more, or None
    children: tuple[int, ...]  # processes besides the shell in its namespace (their parent is PID 1)
    foreign_descriptors: tuple[str, ...]  # descriptors besides its terminal
    firing_traps: bool = False  # a DEBUG or RETURN trap (the last epilogue saw it)
    scratch_files: tuple[str, ...] = ()  # files made in its private tmpfs directories (/tmp, /dev, ...)


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotPlace:
    """Where a snapshot being taken may keep what does not fit its metadata."""

    images: Path  # a directory a route may create for a process image (it does not exist yet)
    tree: str | None  # where the sandbox's tree is attached inside the shell's namespace (None: a root filesystem)
    confinement: Confinement  # the shell's private directories and devices (its tmpfs mounts, not in the layers)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShellLaunch:
    """What a route restoring a snapshot gets from the sandbox: ``fresh(boot_script, last_pid)`` starts a new
    confined shell over the sandbox's tree, ``mount_fd`` is that tree (a detached overlay mount)."""

    fresh: Callable[[str, int | None], PtyShell]
    mount_fd: int
    cgroups: dict[str, object] | None = None  # the spec of a restored tree's cgroup (``cgroups``), or None
    keepers: Any = None  # where a CRIU restore's keeper process comes from (``criu.Keepers``), or None


class SnapshotStrategy(Protocol):
    """One way to carry a live shell's process state into a snapshot and back into forks."""

    route: SnapshotRoute

    def refusal(self, probe: ShellProbe) -> str | None:
        """Why this route cannot carry this shell (None: it can try)."""
        ...

    def capture(self, shell: PtyShell, place: SnapshotPlace) -> dict[str, Any]:
        """The snapshot's process part (JSON-representable), or SnapshotDeclined. The shell may be gone after a
        capture that succeeded (its state is in the capture: the sandbox goes on in a restored copy)."""
        ...

    def restore(self, launch: ShellLaunch, image: Mapping[str, Any]) -> PtyShell:
        """A live shell in the captured state; SandboxError (nothing left running) if not."""
        ...

    def discard(self, image: Mapping[str, Any]) -> None:
        """Delete what the capture kept outside the snapshot's metadata (idempotent)."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ShellState:
    """A shell's state as ``PtyShell.capture`` returned it (``capture``): the trap's sections and those read from
    outside the shell, by name."""

    sections: Mapping[str, str]

    @classmethod
    def parse(cls, data: bytes | str) -> ShellState:
        try:
            return cls(sections=decode_state(data))
        except ValueError as error:
            raise SandboxError(f"a captured shell state cannot be read ({error})") from error

    def lines(self, name: str) -> list[str]:
        return self.sections.get(name, "").splitlines()

    def variables(self) -> dict[str, str]:
        """Declarations by name (``declare -p`` prints one a line: values with newlines are ``$'...'``-quoted),
        without bash's dynamic variables and the capture's own."""
        found = {}
        for line in self.lines("vars"):
            match = _DECLARATION.match(line)
            if match and match.group(2) not in DYNAMIC and not match.group(2).startswith("__tvcache"):
                found[match.group(2)] = line
        return found

    def physical_cwd(self) -> str | None:
        """The working directory's physical path (read from outside: ``pwd -P`` would reset bash's idea of a
        removed one), or None when it was removed."""
        return self.sections.get("physical-cwd") or None

    def canonical(self) -> str:
        """Everything a later command could observe, in a fixed order: equal for indistinguishable shells. Hash
        tables (aliases, hash) are listed sorted (their own order depends on insertion order); the files the
        functions were defined in are not compared (``UNCOMPARED``)."""
        return "\n".join(f"[{name}]\n{body}" for name, body in sorted(self.canonical_sections().items()))

    def canonical_sections(self) -> dict[str, str]:
        out = {}
        for name in sorted(self.sections):
            if name in UNCOMPARED:
                continue
            if name == "vars":
                body = "\n".join(self.variables().values())
            elif name == "comp-wordbreaks" and self.sections[name] == "default":
                # Not set yet: bash's default, with "@" when hostname completion is on (as its shopt sets it).
                at = "@" if "shopt -s hostcomplete" in self.lines("shopt") else ""
                body = ansi_c_quote(f" \t\n\"'{at}><=;|&(:")
            else:
                body = self.sections[name]
            out[name] = body
        return out

    def refusal(self) -> str | None:
        """What in this state the shell-state route cannot carry, or None."""
        if self.lines("last-background") and self.lines("last-background")[0]:
            return "$! names a background process of this shell's PID namespace"
        if self.physical_cwd() is None:
            return "the working directory was removed"
        firing = self.lines("firing-traps")
        if firing:
            return f"a {firing[0]} trap would fire on the restore itself"
        if "set -o history" in self.lines("set"):
            return "command history is on (it holds the protocol's lines)"
        if "LINENO" in self.sections.get("functions", ""):
            return "a function reads $LINENO, which bash renumbers when it lists the function"
        if self.sections.get("getopts-bundle") != "0":
            return "getopts stopped inside a bundled option (-abc): its position cannot be carried"
        functions = {line.split(" ", 2)[-1] for line in self.lines("function-attributes")}
        for line in self.lines("function-sources"):
            name, _, source = line.partition(" ")
            if name in functions and source not in _PLAIN_SOURCES:
                return f"the function {name} was defined in {source} (BASH_SOURCE would differ in a restored shell)"
        missing = [name for name in (*SECTIONS, *OUTSIDE) if name not in self.sections]
        if missing or not self.lines("status") or not self.lines("last-pid"):
            return "the captured state is incomplete"
        return None

    def boot_script(self) -> str:
        """The script a fresh shell sources at boot to take this state (before the prompt variables). What bash
        lists re-readably (completions, traps, functions) is restored as listed, before any user function or
        alias exists to shadow the builtins; after the aliases every command is ``\\builtin``."""
        cwd = self.lines("cwd")[0] if self.lines("cwd") else "''"
        physical = ansi_c_quote(self.physical_cwd() or "/")
        out = [
            RESET_VARIABLES.rstrip("\n"),
            # The logical directory, as the shell had it (a symlinked path stays one); the physical one if that no
            # longer leads there. The check compares both.
            f"builtin cd -L -- {cwd} 2>/dev/null || builtin cd -P -- {physical} || :",
            "builtin complete -r",
            self.sections.get("complete", "").rstrip("\n"),
            self.sections.get("traps", "").rstrip("\n"),
        ]
        # Plain `declare`: behind `builtin`, bash would not parse array assignments. No user function or alias
        # exists yet to shadow it (they are restored below).
        out += [line for name, line in self.variables().items() if name not in PROMPT_VARIABLES]
        out.append(self.sections.get("functions", "").rstrip("\n"))
        out += [f"builtin {line}" for line in self.lines("function-attributes") if not line.startswith("declare -f ")]
        out.append(f"builtin umask {self.lines('umask')[0]}" if self.lines("umask") else "")
        out.append("builtin hash -r")
        out += [f"builtin hash -p {line}" for line in self.lines("hash")]
        out.append("builtin dirs -c")
        out += [f"builtin pushd -n -- {entry} >/dev/null" for entry in reversed(self.lines("dirs"))]
        args = self.lines("args")
        out.append("builtin set -- " + " ".join(args[1:]) if args[1:] else "builtin set --")
        if self.lines("argv0"):
            out.append(f"BASH_ARGV0={self.lines('argv0')[0]}")
        out += [f"builtin alias -- {line}" for line in self.lines("aliases")]
        # From here on an alias could shadow the first word: every command is quoted.
        disabled = self.lines("disabled-builtins")
        if disabled:
            out.append("\\builtin enable -n " + " ".join(disabled))
        # The compatNN options follow BASH_COMPAT (restored with the variables); setting them would unset it.
        out += _merged_options(
            [
                line
                for line in self.lines("shopt")
                if line.split()[-1] not in UNSETTABLE_OPTIONS and not line.split()[-1].startswith("compat")
            ]
        )
        out += _merged_options(self.lines("set"))
        # Last: `shopt -s/-u hostcomplete` rewrites the word breaks (it adds or removes "@").
        breaks = self.sections.get("comp-wordbreaks", "default")
        if breaks == "unset":
            out.append("\\builtin unset -v COMP_WORDBREAKS")
        elif breaks != "default":
            out.append(f"COMP_WORDBREAKS={breaks}")
        return "\n".join(line for line in out if line) + "\n"

    def prompt_script(self) -> str:
        variables = self.variables()
        return "\n".join(f"builtin {variables[name]}" for name in PROMPT_VARIABLES if name in variables)

    def apply_process_state(self, pid: int) -> None:
        """Give process ``pid`` (a fresh shell) this state's resource limits and nice value, from outside (bash's
        ``ulimit`` counts in blocks that depend on its POSIX mode; ``prlimit`` takes the kernel's own values)."""
        wanted = _limits(self.sections.get("limits", ""))
        with open(f"/proc/{pid}/limits") as handle:
            current = _limits(handle.read())
        for name, values in wanted.items():
            if current.get(name) != values and name in _RESOURCES:
                resource.prlimit(pid, _RESOURCES[name], values)
        nice = self.sections.get("nice", "0").strip()
        if nice.lstrip("-").isdigit() and os.getpriority(os.PRIO_PROCESS, pid) != int(nice):
            os.setpriority(os.PRIO_PROCESS, pid, int(nice))


def _limits(text: str) -> dict[str, tuple[int, int]]:
    """``/proc/<pid>/limits`` rows by name: (soft, hard), RLIM_INFINITY for "unlimited"."""
    found = {}
    for line in text.splitlines()[1:]:
        name, soft, hard = line[:26].strip(), line[26:47].strip(), line[47:68].strip()
        values = [resource.RLIM_INFINITY if value == "unlimited" else int(value) for value in (soft, hard)]
        found[name] = (values[0], values[1])
    return found


# The rows of /proc/<pid>/limits, in the order of Linux's RLIMIT_* numbers (Python's resource module lacks some).
_RESOURCES = {
    name: number
    for number, name in enumerate(
        (
            "Max cpu time",
            "Max file size",
            "Max data size",
            "Max stack size",
            "Max core file size",
            "Max resident set",
            "Max processes",
            "Max open files",
            "Max locked memory",
            "Max address space",
            "Max file locks",
            "Max pending signals",
            "Max msgqueue size",
            "Max nice priority",
            "Max realtime priority",
            "Max realtime timeout",
        )
    )
}


def _merged_options(lines: list[str]) -> list[str]:
    """``shopt -s a``/``set +o b`` lines as ``\\builtin`` commands (quoted: they follow the aliases), consecutive
    ones merged into one command (``shopt -s a c``, ``set +o b -o d``): each builtin sets its options in the order
    given, as the lines would, and a boot of fewer commands is quicker for bash to run. A line of another shape
    stays a command of its own."""
    out: list[str] = []
    merged = ""  # the command being extended: "shopt -s", "shopt -u" or "set", with its names
    for line in lines:
        shopt, toggle = _SHOPT_LINE.match(line), _SET_LINE.match(line)
        verb = f"shopt {shopt.group(1)}" if shopt else "set" if toggle else None
        if merged and (verb is None or not merged.startswith(verb + " ")):
            out.append(f"\\builtin {merged}")
            merged = ""
        if shopt:
            merged = (merged or verb or "") + f" {shopt.group(2)}"
        elif toggle:
            merged = (merged or "set") + f" {toggle.group(1)}"
        else:
            out.append(f"\\builtin {line}")
    if merged:
        out.append(f"\\builtin {merged}")
    return out


def probe(shell: PtyShell, untrusted: str | None, confinement: Confinement) -> ShellProbe:
    return ShellProbe(
        untrusted=untrusted,
        children=tuple(shell.children()),
        foreign_descriptors=tuple(shell.foreign_descriptors()),
        firing_traps=shell.firing_traps,
        scratch_files=tuple(scratch_files(shell.pid, confinement)),
    )


def scratch_files(pid: int, confinement: Confinement, limit: int = 3) -> list[str]:
    """Up to ``limit`` files the shell made in its private tmpfs directories (``/tmp``, ``/var/tmp``, ``/run``,
    ``/dev/shm`` and ``/dev`` itself), seen from outside through ``/proc/<pid>/root``. They live in the shell's
    mount namespace, not in the sandbox's layers: a fresh shell has empty ones (but for the directories leading
    to the tree, when it sits below one of them, and the minimal /dev's own entries)."""
    root = f"/proc/{pid}/root"
    leading = {str(parent) for parent in Path(confinement.base).parents} if not confinement.rootfs else set()
    found: list[str] = []
    with contextlib.suppress(OSError):
        expected = {*confinement.devices, "shm", "fd", "stdin", "stdout", "stderr"}
        found += [f"/dev/{name}" for name in sorted(os.listdir(f"{root}/dev")) if name not in expected]
    for top in (*confinement.private_dirs, "/dev/shm"):
        pending = [top]
        while pending and len(found) < limit:
            directory = pending.pop()
            try:
                entries = sorted(os.scandir(root + directory), key=lambda entry: entry.name)
            except OSError:
                continue
            for entry in entries:
                path = f"{directory.rstrip('/')}/{entry.name}"
                if path in leading and entry.is_dir(follow_symlinks=False):
                    pending.append(path)
                elif path != confinement.base:
                    found.append(path)
    return found[:limit]


class ShellStateRoute:
    """Carry the shell's state by bash's own builtins (see the module docstring)."""

    route = SnapshotRoute.SHELL_STATE

    def refusal(self, probe: ShellProbe) -> str | None:
        if probe.firing_traps:
            return "a DEBUG or RETURN trap is set: it would fire on the capture and on the restore"
        if probe.children:
            return f"{len(probe.children)} process(es) besides the shell are alive (background jobs, coprocs)"
        if probe.foreign_descriptors:
            return f"the shell holds descriptors besides its terminal ({', '.join(probe.foreign_descriptors[:3])})"
        if probe.scratch_files:
            return f"files in the shell's private tmpfs directories ({', '.join(probe.scratch_files)})"
        return None

    def capture(self, shell: PtyShell, place: SnapshotPlace) -> dict[str, Any]:
        try:
            data = shell.capture_state()
        except CaptureRefused as refused:
            raise SnapshotDeclined(f"the shell's state cannot be captured: {refused}") from None
        state = ShellState.parse(data)
        reason = state.refusal()
        if reason is not None:
            raise SnapshotDeclined(f"cannot carry this shell's state: {reason}")
        boot = state.boot_script()
        if len(boot.encode("utf-8", errors="surrogateescape")) > MAX_BOOT_BYTES:
            raise SnapshotDeclined(f"the shell's state is too large to carry ({len(boot)} characters of script)")
        last_pid = int(state.lines("last-pid")[0]) if state.lines("last-pid")[0].isdigit() else None
        return {
            "state": data.decode("utf-8", errors="surrogateescape"),
            "boot": boot,
            "prompt": state.prompt_script(),
            "lineno": shell.lineno,
            "status": int(state.lines("status")[0]),
            # Joined by the first character of IFS, whatever it is: the numbers are what counts.
            "pipestatus": [int(value) for value in re.findall(r"\d+", (state.lines("pipestatus") or [""])[0])],
            "underscore": state.lines("underscore")[0] if state.lines("underscore") else "''",
            "last_pid": last_pid,
        }

    def restore(self, launch: ShellLaunch, image: Mapping[str, Any]) -> PtyShell:
        boot = str(image["boot"])
        if int(image["lineno"]) <= FRESH_LINENO:
            # No line was typed yet, so none may be typed now: the prompt variables come with the boot instead.
            boot += str(image.get("prompt", "")) + "\n"
        last_pid = image.get("last_pid")
        several = len(image.get("pipestatus", [])) if len(image.get("pipestatus", [])) > 1 else 0
        if isinstance(last_pid, int) and several:
            last_pid -= several  # ``_synchronise`` restores PIPESTATUS by a pipeline of that many subshells
        shell = launch.fresh(boot, last_pid)
        try:
            try:
                _state(image).apply_process_state(shell.pid)
            except OSError as error:
                raise SandboxError(f"cannot give the restored shell its limits and nice value: {error}") from error
            _synchronise(shell, image)
            verify(shell, image)
        except BaseException:
            shell.close()
            raise
        return shell

    def discard(self, image: Mapping[str, Any]) -> None:
        """Nothing to delete: the whole state is in the snapshot's metadata."""


def verify(
    shell: PtyShell,
    image: Mapping[str, Any],
    moved_on: Callable[[ShellState, ShellState], bool] | None = None,
    *,
    fresh: bool = True,
) -> ShellState:
    """The restored shell answers a state capture, and the state equals the snapshot's (or, with ``moved_on``,
    differs only as that allows); the state it captured, or SandboxError naming what differs. ``fresh``: the shell
    ran only its boot (a shell-state restore), so the capture's checks against a user's code are skipped; a CRIU
    restore brings back processes of the user's, and passes False."""
    try:
        data = shell.capture_state(checked=not fresh)
    except CaptureRefused as refused:
        raise SandboxError(
            f"the restored shell's state cannot be captured ({refused}); rebuilding the state by replay instead"
        ) from None
    actual = ShellState.parse(data)
    expected = _state(image)
    if actual.canonical() != _canonical(str(image["state"])) and (moved_on is None or not moved_on(expected, actual)):
        theirs, ours = expected.canonical_sections(), actual.canonical_sections()
        differ = sorted(name for name in {*theirs, *ours} if theirs.get(name) != ours.get(name))
        raise SandboxError(
            f"the restored shell's state differs from the snapshot's ({', '.join(differ)}); "
            "rebuilding the state by replay instead"
        )
    return actual


def _state(image: Mapping[str, Any]) -> ShellState:
    return _parsed(str(image["state"]))


@functools.lru_cache(maxsize=8)
def _parsed(state: str) -> ShellState:
    return ShellState.parse(state)


@functools.lru_cache(maxsize=8)
def _canonical(state: str) -> str:
    """The canonical form of a snapshot's captured state, kept for the next fork of the same snapshot."""
    return _parsed(state).canonical()


def _synchronise(shell: PtyShell, image: Mapping[str, Any]) -> None:
    """Type empty lines until the next line gets the snapshot's line number, then one line that restores the
    prompt variables and leaves ``$?``, ``$_`` and ``PIPESTATUS`` as they were (a ``source`` that returns the
    status, with ``$_`` as its last argument; a pipeline of subshells when PIPESTATUS had several members).
    Every line is read by bash before the next is typed, and the state it then waits in is checked."""
    lineno = int(image["lineno"])
    if lineno <= shell.lineno:
        return  # no line was typed after the boot (``restore`` gave the prompt variables to the boot)
    status = int(image["status"])
    prompt = str(image.get("prompt", ""))
    pipestatus = [int(value) for value in image.get("pipestatus", [])]
    if len(pipestatus) > 1:
        tail = f". /dev/stdin <<< {ansi_c_quote(prompt)}; : {image['underscore']}; " + " | ".join(
            f"(exit {value})" for value in pipestatus
        )
    else:
        tail = f". /dev/stdin {image['underscore']} <<< {ansi_c_quote(prompt + chr(10) + f'return {status}')}"
    padding = lineno - shell.lineno - 1
    deadline = time.monotonic() + GRACE_SECONDS + lineno * 1e-4
    state = shell.synchronise("\n" * padding + tail + "\n", deadline)
    if state is None or (state.lineno, state.status) != (lineno, status):
        reached = None if state is None else (state.lineno, state.status)
        raise SandboxError(f"the restored shell reached (line, status) {reached} instead of {(lineno, status)}")


def choose_route(
    shell: PtyShell, untrusted: str | None, routes: tuple[SnapshotStrategy, ...], place: SnapshotPlace
) -> tuple[SnapshotStrategy, dict[str, Any]]:
    """The one place that decides how a live shell is snapshotted: the first of ``routes`` that accepts and
    captures it, or SnapshotDeclined naming why each refused."""
    if untrusted is not None:
        raise SnapshotDeclined(f"not snapshotting this shell: {untrusted}")
    if not shell.wait_idle():
        raise SnapshotDeclined("the shell did not return to its prompt")
    found = probe(shell, untrusted, place.confinement)
    reasons = []
    for strategy in routes:
        reason = strategy.refusal(found)
        if reason is None:
            try:
                return strategy, strategy.capture(shell, place)
            except SnapshotDeclined as declined:
                reason = str(declined)
        reasons.append(f"{strategy.route.value}: {reason}")
    raise SnapshotDeclined("no snapshot route can carry this shell exactly (" + "; ".join(reasons) + ")")


def route_of(image: Mapping[str, Any], routes: tuple[SnapshotStrategy, ...]) -> SnapshotStrategy:
    """The route that captured ``image`` (its ``route`` entry), to restore or discard it."""
    name = image.get("route")
    for strategy in routes:
        if strategy.route.value == name:
            return strategy
    raise SandboxError(f"a persistent shell snapshot names an unknown route {name!r}")
