"""A live bash read from outside: whether it waits for a command, and its ``$?`` and ``$LINENO``, from the kernel
and from the shell's own memory, never from anything the shell prints.

Why. A command runs inside the shell's process: anything the shell could print about itself (a sentinel, a
status line), the command can print first, or stop the shell from printing, by a DEBUG trap, a function named
like a builtin, ``enable -n``, ``exec >file``... So the driver does not ask the shell. It reads:

* ``/proc/<pid>/syscall``: the shell is blocked in ``read`` on descriptor 0, its terminal (checked by device);
* bash's globals, through ``/proc/<pid>/mem`` at the addresses of its exported symbols (bash exports them for
  loadable builtins; found in the ELF dynamic symbol table of ``/proc/<pid>/exe``, relocated by the load address
  in ``/proc/<pid>/maps``): no builtin, function, trap, ``eval``, ``source`` or loop is running
  (``executing``, ``executing_builtin``, ``running_trap``, ``variable_context``, ``loop_level``,
  ``parse_and_execute_level``, ``sourcelevel``), and whether the parser is in the middle of a command
  (``current_command_line_count``). Then ``last_command_exit_value`` is the ``$?`` the next command would see,
  and ``line_number`` its ``$LINENO``.

Both reads together mean "bash's top-level reader waits for the next line": a ``read`` builtin, a trap, a
function or a loop waiting on the terminal all show in the globals. What stays open: a process that rewrites
bash's memory (``/proc/1/mem`` is hidden from the sandbox, see ``zygote_process``) or replaces bash (``exec``: the
memory descriptor of the old image then reads nothing, which ``ShellReplaced`` reports).
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "BashObserver",
    "FileIdentity",
    "Idle",
    "ShellGone",
    "ShellReplaced",
    "UnknownBash",
    "elf_symbols",
    "load_address",
    "per_file",
]

# The globals read at each check, in the order of ``_STATE``; all are C ints.
_BUSY = (
    "executing",
    "executing_builtin",
    "running_trap",
    "variable_context",
    "loop_level",
    "parse_and_execute_level",
    "sourcelevel",
)
_STATE = (
    *_BUSY,
    "current_command_line_count",
    "last_command_exit_value",
    "line_number",
    "echo_input_at_read",
    "no_line_editing",
)
_READ, _PSELECT6 = b"0", b"270"  # readline waits in pselect6 before it reads
_POINTERS = ("js", "last_asynchronous_pid", "trap_list", "ps1_prompt", "ps2_prompt", "ps0_prompt", "shell_name")
# bash's trap_list: one pointer per signal (NSIG of glibc: 65), then DEBUG, ERR and RETURN.
DEBUG_TRAP, ERR_TRAP, RETURN_TRAP = 65, 66, 67
SIG_IGN = 1  # trap_list's value for an ignored signal; 0 is the default action
_JOBS_OFFSET, _DEAD_OFFSET = 40, 44  # j_njobs and j_ndead in struct jobstats (a long, then eleven ints)
_SHT_DYNSYM = 11
_STT_OBJECT, _STT_FUNC = 1, 2


class UnknownBash(Exception):
    """The shell's binary is not a bash whose globals we can find (not ELF64, stripped of its dynamic symbols)."""


class ShellGone(Exception):
    """The shell's end of the pty closed: bash (PID 1, and with it its namespace) is gone."""


class ShellReplaced(Exception):
    """The process no longer runs the bash image it was started with (``exec``), or its memory cannot be read."""


@dataclass(frozen=True, slots=True)
class Idle:
    """A shell waiting for its next line: ``status`` and ``lineno`` are what its next command sees as ``$?`` and
    ``$LINENO``; ``continuation`` says it is inside an unfinished command (a quote, a group, a here-document)."""

    status: int
    lineno: int
    continuation: bool
    verbose: bool  # ``set -v``: bash echoes each line it reads
    editing: bool = False  # ``set -o emacs``/``vi``: readline reads the terminal, and echoes what is typed


FileIdentity = tuple[int, int, int, int]  # a file's device, inode, size and mtime
T = TypeVar("T")


def per_file(function: Callable[[FileIdentity, str], T]) -> Callable[[FileIdentity, str], T]:
    """``function(identity, path)`` computed once per file ``identity`` (the last 8 kept): the path, a shell's
    ``/proc/<pid>/exe``, says where to read the file, not which file it is."""
    results: dict[FileIdentity, T] = {}

    @functools.wraps(function)
    def cached(identity: FileIdentity, path: str) -> T:
        if identity not in results:
            result = function(identity, path)
            if len(results) >= 8:
                results.pop(next(iter(results)), None)
            results[identity] = result
        return results[identity]

    return cached


@per_file
def elf_symbols(identity: FileIdentity, path: str) -> tuple[bytes, dict[str, int]]:
    """A bash binary's bytes and the offsets of its exported data objects and functions, from its ELF dynamic
    symbol table (``identity``: the file's device, inode, size and mtime, so that a changed binary is read again).
    UnknownBash if it is not a little-endian 64-bit ELF file."""
    with open(path, "rb") as handle:
        data = handle.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise UnknownBash(f"{path} is not a little-endian 64-bit ELF file")
    (section_offset,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size) for i in range(count)]
    found: dict[str, int] = {}
    for _, kind, _, _, offset, size, link, _, _, _ in sections:
        if kind != _SHT_DYNSYM:
            continue
        strings = sections[link][4]
        for index in range(size // 24):
            name, info, _, _, value, _ = struct.unpack_from("<IBBHQQ", data, offset + index * 24)
            if value and info & 0xF in (_STT_OBJECT, _STT_FUNC):
                start = strings + name
                found[data[start : data.index(b"\0", start)].decode("ascii", "replace")] = value
    return data, found


def _symbols(identity: FileIdentity, path: str) -> dict[str, int]:
    """The offsets the observer reads, or UnknownBash naming what the binary does not export."""
    _, found = elf_symbols(identity, path)
    missing = [name for name in (*_STATE, *_POINTERS) if name not in found]
    if missing:
        raise UnknownBash(f"{path} does not export {', '.join(missing)} (not bash 5, or stripped)")
    return found


class _Spans:
    """Little-endian integers at fixed addresses of the shell's memory, read with one ``pread`` per run of
    nearby ones (bash's globals sit in a few pages: a few reads instead of one per global)."""

    def __init__(self, fields: list[tuple[int, int]], gap: int = 2048) -> None:
        self._fields = fields
        order = sorted(range(len(fields)), key=lambda index: fields[index][0])
        runs: list[list[int]] = []
        for index in order:
            address, size = fields[index]
            if runs and address - (fields[runs[-1][-1]][0] + fields[runs[-1][-1]][1]) <= gap:
                runs[-1].append(index)
            else:
                runs.append([index])
        self._runs = []
        for run in runs:
            start = fields[run[0]][0]
            end = max(fields[index][0] + fields[index][1] for index in run)
            self._runs.append((start, end - start, [(index, fields[index][0] - start) for index in run]))

    def read(self, read: Callable[[int, int], bytes], *, signed: bool = False) -> list[int]:
        """The values, in the order of ``fields``; ``read(address, size)`` reads the memory."""
        values = [0] * len(self._fields)
        for start, size, members in self._runs:
            data = read(start, size)
            for index, offset in members:
                values[index] = int.from_bytes(data[offset : offset + self._fields[index][1]], "little", signed=signed)
        return values


class BashObserver:
    """Reads one bash process from outside (see the module docstring). Cheap: one ``pread`` of the syscall file
    and a few of its memory; descriptors kept open. ``terminal`` is the device number the shell's descriptor 0 must
    have."""

    def __init__(self, pid: int, terminal: int) -> None:
        self.pid = pid
        self._terminal = terminal
        self._syscall = -1
        self._io = -1
        self._mem = -1
        self._mem_writer = -1
        self._children = -1
        try:
            exe = f"/proc/{pid}/exe"
            info = os.stat(exe)
            symbols = _symbols((info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns), exe)
            base = load_address(pid)
            self._state = _Spans([(base + symbols[name], 4) for name in _STATE])
            self._prompt_pointers = _Spans(
                [(base + symbols[name], 8) for name in ("ps0_prompt", "ps1_prompt", "ps2_prompt", "shell_name")]
            )
            jobs = base + symbols["js"]
            self._jobs = _Spans(
                [(base + symbols["last_asynchronous_pid"], 4), (jobs + _JOBS_OFFSET, 4), (jobs + _DEAD_OFFSET, 4)]
            )
            self._trap_list = base + symbols["trap_list"]
            self._line_number = base + symbols["line_number"]
            self._syscall = os.open(f"/proc/{pid}/syscall", os.O_RDONLY | os.O_CLOEXEC)
            # The task's own counters: the process's (/proc/<pid>/io) also count what its reaped children read.
            self._io = os.open(f"/proc/{pid}/task/{pid}/io", os.O_RDONLY | os.O_CLOEXEC)
            self._mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
            self._children = os.open(f"/proc/{pid}/task/{pid}/children", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            self.close()
            raise

    def idle(self) -> Idle | None:
        """The shell's state when its top-level reader waits on the terminal, else None (it is busy)."""
        if not self._blocked_reading_terminal(editing=True, device=False):  # the device: at the second look
            return None
        values = self._state.read(self._read, signed=True)
        if any(values[: len(_BUSY)]):
            return None
        continuation, status, lineno, verbose, no_editing = values[len(_BUSY) :]
        if not self._blocked_reading_terminal(editing=not no_editing):  # it woke while we read: look again
            return None
        return Idle(
            status=status,
            lineno=lineno,
            continuation=continuation > 0,
            verbose=bool(verbose),
            editing=not no_editing,
        )

    def bytes_read(self) -> int:
        """How many bytes the shell's own ``read`` calls returned so far (``rchar``): a typed line was taken
        once this grew by its length (bash reads nothing else while it waits)."""
        try:
            data = os.pread(self._io, 256, 0)
        except OSError as error:
            raise ShellReplaced(f"the shell's I/O counters cannot be read ({error.strerror})") from None
        return int(data.split(b"\n", 1)[0].split()[1])

    def _blocked_reading_terminal(self, editing: bool = False, device: bool = True) -> bool:
        try:
            fields = os.pread(self._syscall, 128, 0).split(maxsplit=2)
        except OSError:
            return False
        if fields[:2] != [_READ, b"0x0"] and not (editing and fields[:1] == [_PSELECT6]):
            return False
        if not device:
            return True
        try:
            return os.stat(f"/proc/{self.pid}/fd/0").st_rdev == self._terminal
        except OSError:
            return False

    def set_lineno(self, value: int) -> None:
        """Set bash's line counter (``$LINENO`` of the next command) while it waits for a line: the driver types
        one line more per command than a user would (the group's closing line), and takes it back here, so
        that ``$LINENO`` counts as at a terminal. The only write the driver makes into the shell."""
        try:
            if self._mem_writer < 0:
                # Kept open: a descriptor of /proc/<pid>/mem stays with the image it was opened on, so after an
                # exec it writes nothing, where one opened anew would write into the new program.
                self._mem_writer = os.open(f"/proc/{self.pid}/mem", os.O_WRONLY | os.O_CLOEXEC)
            written = os.pwrite(self._mem_writer, int(value).to_bytes(4, "little", signed=True), self._line_number)
        except OSError as error:
            raise ShellReplaced(f"the shell's line counter cannot be set ({error.strerror})") from None
        if written != 4:
            raise ShellReplaced("the shell's line counter cannot be set")

    def firing_traps(self) -> bool:
        """Whether a DEBUG or RETURN trap is set (they would fire inside a capture or a restore)."""
        return any(self._pointer(self._trap_list + 8 * index) > SIG_IGN for index in (DEBUG_TRAP, RETURN_TRAP))

    def prompts(self) -> tuple[bytes, bytes, bytes, bytes]:
        """PS0, PS1 and PS2 as bash last read them for a prompt (raw, before their escapes are decoded), and
        ``$0`` as bash uses it for ``\\s`` in them (assigning BASH_ARGV0 changes it)."""
        ps0, ps1, ps2, name = self._prompt_pointers.read(self._read)
        return self._string(ps0), self._string(ps1), self._string(ps2), self._string(name)

    def jobs(self) -> tuple[int, int, int]:
        """``$!`` (the PID, in the shell's namespace, of the last job it started in the background), then how many
        jobs bash's table holds and how many of them ended (``js.j_njobs``, ``js.j_ndead`` of bash 5's ``struct
        jobstats``): a background job that ends changes them, and bash notes it on the terminal."""
        last, jobs, dead = self._jobs.read(self._read, signed=True)
        return last, jobs, dead

    def children(self) -> list[int]:
        """The PIDs (of this machine) whose parent is the shell. bash runs one thread, the only one they can
        have as a parent."""
        try:
            return [int(pid) for pid in os.pread(self._children, 1 << 16, 0).split()]
        except OSError:
            return []

    def _pointer(self, address: int) -> int:
        return int.from_bytes(self._read(address, 8), "little")

    def _string(self, address: int, limit: int = 4096) -> bytes:
        """The C string at ``address`` (a prompt, ``$0``): a short read first, most are short."""
        if address == 0:
            return b""
        data = self._read(address, 256, exact=False)
        end = data.find(b"\0")
        if end < 0 and len(data) == 256:
            data = self._read(address, limit, exact=False)
            end = data.find(b"\0")
        return data if end < 0 else data[:end]

    def _read(self, address: int, size: int, *, exact: bool = True) -> bytes:
        try:
            data = os.pread(self._mem, size, address)
        except OSError as error:
            raise ShellReplaced(f"the shell's memory cannot be read ({error.strerror})") from None
        if not data or (exact and len(data) != size):
            raise ShellReplaced("the shell replaced its bash image (exec)")
        return data

    def close(self) -> None:
        for name in ("_syscall", "_io", "_mem", "_mem_writer", "_children"):
            descriptor = getattr(self, name)
            if descriptor >= 0:
                os.close(descriptor)
                setattr(self, name, -1)


def load_address(pid: int) -> int:
    """Where the first page of the bash binary is mapped in ``pid`` (the base its symbol offsets add to): the
    mapping at file offset 0 of the executable's path (overlay files show their own path, not their inode).
    Read in small pieces: the kernel writes the map as it is read, and the executable comes first."""
    path = os.readlink(f"/proc/{pid}/exe").encode("utf-8", "surrogateescape")
    descriptor = os.open(f"/proc/{pid}/maps", os.O_RDONLY | os.O_CLOEXEC)
    try:
        pending = b""
        while chunk := os.read(descriptor, 1024):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and int(fields[2], 16) == 0 and fields[5] == path:
                    return int(fields[0].split(b"-")[0], 16)
    finally:
        os.close(descriptor)
    raise UnknownBash(f"the bash image of process {pid} is not in its memory map")
