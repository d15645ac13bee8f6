"""The state capture of a persistent shell: a trap that prints bash's state in a format its content cannot steer,
the checks from outside that nothing of the user's runs inside it, and the parse.

The trap (``CAPTURE_TRAP``, set at boot by ``CAPTURE_PROTOCOL``; SIGRTMAX runs it between commands) defines
nothing that stays: it keeps ``$?`` and ``$_`` in three variables, draws a 128-bit token from ``$SRANDOM``, prints
every section under a header framed by that token, and ends by a function it defines, which unsets the variables
and itself and leaves ``$_`` as it was (a function call's last argument). bash restores ``$?`` and
``PIPESTATUS`` after a trap; no job table is read (``jobs`` would mark finished jobs as reported). Everything goes
to ``/dev/tty`` with stderr to /dev/null, so ``exec >log.txt``, ``exec 2>err.txt`` and ``set -x`` neither lose the
capture nor receive any of it.

Why content cannot steer it. The token is drawn when the capture runs, after every byte of the state was made, so
no function body, directory name, alias or value can hold a header of this capture; the parse reads only headers
with the token, rejects unknown and repeated sections and anything missing, and the sections whose text could
hold a newline in a way that changes their meaning are printed ``%q``-quoted, one item a line (arguments, ``$_``,
``$0``, the directory stack from ``DIRSTACK``, aliases from ``BASH_ALIASES``, the hash table from ``BASH_CMDS``);
functions, traps and completions are bash's own re-readable listings, restored as they are.

Why nothing of the user's runs inside it, checked from outside before the signal (``BashMemory`` reads bash's
globals through ``/proc/<pid>/mem``, as ``bash_observer`` does): the SIGRTMAX trap is exactly ours; no DEBUG or
RETURN trap (they would run before every command of it); ERR never fires (every command of it is in a ``||``
list); no function named ``builtin`` and every builtin it calls enabled and built in (not ``enable -f``); no alias
named ``function``, ``{`` or ``}`` (the trap's text is parsed with the user's aliases; its command words are
quoted); none of its names taken; ``SRANDOM``, ``DIRSTACK``, ``BASH_ALIASES`` and ``BASH_CMDS`` still bash's
dynamic variables; ``set -v`` off (bash would echo the trap's text to the user's stderr); under ``set -x``, a
``PS4`` without expansions and the trace going to stderr (not to a ``BASH_XTRACEFD`` of the user's); and, when
other processes live in the namespace (they could signal the shell mid-capture), no other signal trap. A check
that fails declines the capture; the shell is left as it was.

Read from outside and added to the state (``OUTSIDE``): the shell's resource limits and nice value (``/proc``),
its disabled builtins, whether ``getopts`` stopped inside a bundled option (``-abc``), the files its functions
were defined in, and the shape of bash's special variables (one the user unset has lost its meaning).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import struct
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .bash_observer import (
    DEBUG_TRAP,
    ERR_TRAP,
    RETURN_TRAP,
    SIG_IGN,
    FileIdentity,
    ShellGone,
    UnknownBash,
    elf_symbols,
    load_address,
    per_file,
)

if TYPE_CHECKING:
    from .bash_observer import BashObserver
    from .zygote import Spawned


class CapturedShell(Protocol):
    """What the capture uses of a live shell (``pty_shell.PtyShell``), named here so that this module does not
    depend on the driver that depends on it."""

    pid: int
    spawned: Spawned | None
    _buffer: bytearray

    @property
    def alive(self) -> bool: ...

    @property
    def observer(self) -> BashObserver: ...

    def wait_idle(self, timeout: float = ...) -> bool: ...

    def children(self) -> list[int]: ...

    def kill(self) -> None: ...

    def close(self) -> None: ...

    def _reset_terminal(self) -> None: ...

    def _read_some(self, timeout: float) -> bool: ...


__all__ = [
    "CAPTURE_PROTOCOL",
    "CAPTURE_TRAP",
    "OUTSIDE",
    "SECTIONS",
    "BashMemory",
    "CaptureRefused",
    "capture_refusal",
    "outside_sections",
    "parse_capture",
    "prepare_capture",
    "take_capture",
]

CAPTURE_SIGNAL_NUMBER = 64  # SIGRTMAX on Linux (glibc); bash's trap_list is indexed by signal number

# The sections the trap prints, in order; a capture is valid only with each exactly once.
SECTIONS = (
    "status",
    "pipestatus",
    "underscore",
    "args",
    "argv0",
    "cwd",
    "last-background",
    "vars",
    "functions",
    "function-attributes",
    "shopt",
    "set",
    "umask",
    "traps",
    "complete",
    "last-pid",
)
# The sections read from outside the shell (``outside_sections``).
OUTSIDE = (
    "physical-cwd",
    "aliases",
    "hash",
    "dirs",
    "comp-wordbreaks",
    "limits",
    "nice",
    "disabled-builtins",
    "getopts-bundle",
    "function-sources",
    "special-variables",
    "firing-traps",
)

_NAMES = ("__tvcache_s", "__tvcache_t")  # the capture's local variables (no global of these names may be readonly)
_CAPTURE = "__tvcache_capture"
# Every builtin the trap calls (through ``builtin``, itself included).
_USED_BUILTINS = ("builtin", "printf", "declare", "pwd", "shopt", "set", "umask", "trap", "complete", "read", "unset")
_RESERVED_ALIASES = ("{", "}")
# Special variables whose meaning the capture relies on; and every special variable whose shape is compared.
_RELIED_ON = ("DIRSTACK", "BASH_ALIASES", "BASH_CMDS")  # their tables are read from outside
_SPECIAL = (
    "BASH_ALIASES BASH_ARGC BASH_ARGV BASH_ARGV0 BASH_CMDS BASH_COMMAND BASH_LINENO BASH_SOURCE BASH_SUBSHELL "
    "BASHPID COMP_WORDBREAKS DIRSTACK EPOCHREALTIME EPOCHSECONDS FUNCNAME GROUPS HISTCMD LINENO RANDOM SECONDS "
    "SRANDOM"
).split()
_TRAPPED = " ".join(str(number) for number in range(CAPTURE_SIGNAL_NUMBER)) + " DEBUG ERR RETURN"


_T = '"$__tvcache_t"'


def _listing(name: str, command: str) -> str:
    """A section header, then a builtin's own listing."""
    return f"\\builtin printf '\\n@@%s:{name}@@\\n' {_T}; \\builtin {command}\n"


def _items(name: str, *words: str) -> str:
    """A section header, then each word ``%q``-quoted on a line of its own."""
    return f"\\builtin printf '\\n@@%s:{name}@@\\n' {_T}; \\builtin printf '%q\\n' {' '.join(words)}\n"


# The fixed-size sections, printed by one command: (name, format, arguments).
_SCALARS = (
    ("status", "%s", '"$1"'),
    ("pipestatus", "%s", '"$2"'),
    ("underscore", "%q", '"$3"'),
    ("argv0", "%q", '"$0"'),
    ("cwd", "%q", '"${PWD-}"'),
    ("last-background", "%s", '"${!-}"'),
)

# The capture function, defined at boot and made read-only there: no later definition, ``unset -f`` or
# ``declare`` can change it for the shell's life, and its body is parsed once. Arguments: ``$?``, ``PIPESTATUS``
# (bash keeps both as the last command left them while a trap runs), ``$_``, ``$#``,
# the positional parameters, ``$_`` again (the call's last argument: bash sets ``$_`` to it after the call). Its
# command words are quoted (``\\builtin``: no alias applies); the steps that can fail (the reads) are in ``||``
# lists, so ``set -e`` and ERR traps stay quiet; its variables are local. It expands no dynamic variable of bash's
# (``SRANDOM``, ``DIRSTACK``, ``BASH_ALIASES``, ``BASH_CMDS``, ``COMP_WORDBREAKS``): each keeps the value it was
# last expanded to, which a later ``declare -p`` shows. The token comes from the kernel instead, and those tables
# are read from outside.
CAPTURE_FUNCTION = (
    f"{_CAPTURE}() {{\n"
    "\\builtin local __tvcache_t= __tvcache_s=\n"
    # ``IFS=``: a user's IFS would trim the token's last digit (``IFS=0``) and no header would match.
    "IFS= \\builtin read -r __tvcache_t </proc/sys/kernel/random/uuid || __tvcache_t=\n"
    "{ \\builtin printf '\\n@@tvcache-state %s@@\\n"
    + "".join(f"\\n@@%s:{name}@@\\n{form}\\n" for name, form, _ in _SCALARS)
    + "' "
    + _T
    + "".join(f" {_T} {words}" for _, _, words in _SCALARS)
    + "\n"
    + _items("args", '"$4"', '"${@:5:$4}"')
    + _listing("vars", "declare -p")
    + _listing("functions", "declare -f")
    + _listing("function-attributes", "declare -F")
    + _listing("shopt", "shopt -p")
    + _listing("set", "set +o")
    + _listing("umask", "umask")
    + _listing("traps", f"trap -p {_TRAPPED}")
    + _listing("complete", "complete -p")
    + "IFS= \\builtin read -r __tvcache_s </proc/sys/kernel/ns_last_pid || __tvcache_s=\n"
    + f"\\builtin printf '\\n@@%s:last-pid@@\\n%s\\n\\n@@%s:end@@\\n' {_T} \"$__tvcache_s\" {_T}\n"
    + "} >/dev/tty\n"
    + "}"
)
# The trap: the whole capture's stderr (an xtrace of it included) to /dev/null, its output to /dev/tty.
CAPTURE_TRAP = f'{{ \\{_CAPTURE} "$?" "${{PIPESTATUS[*]}}" "$_" "$#" "$@" "$_"; }} 2>/dev/null'


def _single_quoted(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


# What every shell runs at boot (before any user function or alias exists: plain ``readonly`` and ``trap``).
CAPTURE_PROTOCOL = f"{CAPTURE_FUNCTION}\nreadonly -f {_CAPTURE}\ntrap -- {_single_quoted(CAPTURE_TRAP)} SIGRTMAX\n"

_BEGIN = re.compile(rb"\n@@tvcache-state ([0-9a-f-]{36})@@\n")


class CaptureRefused(Exception):
    """The capture cannot be trusted or taken; the message says why (the shell is left as it was)."""


def begin_token(buffer: bytes | bytearray) -> tuple[int, int, bytes] | None:
    """Where the capture's first line is in ``buffer`` (start, end) and its token; None if not there yet."""
    match = _BEGIN.search(buffer)
    return None if match is None else (match.start(), match.end(), match.group(1))


def end_marker(token: bytes) -> bytes:
    return b"\n@@" + token + b":end@@\n"


def parse_capture(token: bytes, body: bytes) -> dict[str, str]:
    """The sections of a capture's body (after its first line, up to its end marker), by name. CaptureRefused
    for a header of an unknown section, a section twice, or one missing."""
    prefix = b"\n@@" + token + b":"
    pieces = body.split(prefix)
    if pieces[0]:
        raise CaptureRefused("the capture has bytes before its first section")
    sections: dict[str, str] = {}
    for piece in pieces[1:]:
        name, mark, text = piece.partition(b"@@\n")
        if not mark or name.decode(errors="replace") not in SECTIONS:
            raise CaptureRefused(f"the capture has an unknown section {name[:40]!r}")
        if name.decode() in sections:
            raise CaptureRefused(f"the capture has the section {name.decode()!r} twice")
        sections[name.decode()] = text.decode("utf-8", errors="surrogateescape")
    missing = [name for name in SECTIONS if name not in sections]
    if missing:
        raise CaptureRefused(f"the capture lacks the section(s) {', '.join(missing)}")
    return sections


def encode_state(sections: Mapping[str, str]) -> bytes:
    """A parsed state as the bytes ``PtyShell.capture`` returns and snapshots keep (JSON, lone surrogates kept)."""
    return json.dumps(dict(sections), sort_keys=True).encode()


def decode_state(data: bytes | str) -> dict[str, str]:
    loaded = json.loads(data)
    if not isinstance(loaded, dict):
        raise ValueError("a captured state is a JSON object")
    return {str(name): str(text) for name, text in loaded.items()}


# ---------------------------------------------------------------------------------------------------- memory


@dataclass(frozen=True, slots=True, eq=False)  # hashed by identity (one per binary, cached)
class _Image:
    """Offsets in one bash binary: its exported data objects and functions, and the getopts scanner's pointer."""

    symbols: Mapping[str, int]
    nextchar: int | None  # the static ``nextchar`` of bash's getopt.c (found in sh_getopt_restore_state's code)
    data: bytes  # the file, to read the static strings its pointers name (builtin names) without a syscall
    dirstack: tuple[int, int] | None  # pushd's directory_list_offset and pushd_directory_list statics

    def static_string(self, address: int) -> bytes | None:
        """The NUL-terminated string at virtual ``address`` of the file, or None if it is not in the file."""
        return _static_string(self, address)


@functools.lru_cache(maxsize=4096)
def _static_string(image: _Image, address: int) -> bytes | None:
    offset = _file_offset(image.data, address)
    if offset is None:
        return None
    end = image.data.find(b"\0", offset, offset + 4096)
    return image.data[offset:end] if end >= 0 else None


@per_file
def _image(identity: FileIdentity, path: str) -> _Image:
    try:
        data, symbols = elf_symbols(identity, path)
    except UnknownBash as unknown:
        raise CaptureRefused(str(unknown)) from None
    needed = (
        "trap_list shell_functions shell_function_defs global_variables aliases shell_builtins num_shell_builtins "
        "echo_command_at_execute echo_input_at_read xtrace_fd sh_optind sh_getopt_restore_state pending_traps "
        "hashed_filenames rl_completer_word_break_characters get_directory_stack"
    ).split()
    missing = [name for name in needed if name not in symbols]
    if missing:
        raise CaptureRefused(f"{path} does not export {', '.join(missing)} (not bash 5, or stripped)")
    # ``if (nextchar) nextchar = argv[sh_curopt] + sh_charindex;``: its one 8-byte store to a RIP-relative
    # address (REX.W 89 /r, mod 00, r/m 101) is the pointer. Found only near getopt.c's exported sh_optind.
    nextchar = None
    start = _file_offset(data, symbols["sh_getopt_restore_state"])
    code = data[start : start + 64] if start is not None else b""
    for index in range(len(code) - 6):
        if code[index] == 0x48 and code[index + 1] == 0x89 and code[index + 2] & 0xC7 == 0x05:
            (displacement,) = struct.unpack_from("<i", code, index + 3)
            target = symbols["sh_getopt_restore_state"] + index + 7 + displacement
            if abs(target - symbols["sh_optind"]) < 256:
                nextchar = target
            break
    return _Image(symbols=symbols, nextchar=nextchar, data=data, dirstack=_dirstack(data, symbols))


def _dirstack(data: bytes, symbols: Mapping[str, int]) -> tuple[int, int] | None:
    """``get_directory_stack`` reads ``directory_list_offset`` (its first RIP-relative 4-byte load, 8B /r) and
    ``pushd_directory_list`` (its first RIP-relative 8-byte load, REX.W 8B /r); both statics sit side by side."""
    start = _file_offset(data, symbols["get_directory_stack"])
    code = data[start : start + 256] if start is not None else b""
    count = pointer = None
    for index in range(len(code) - 7):
        if code[index] == 0x8B and code[index + 1] & 0xC7 == 0x05 and count is None and code[index - 1] != 0x48:
            count = symbols["get_directory_stack"] + index + 6 + struct.unpack_from("<i", code, index + 2)[0]
        if code[index] == 0x48 and code[index + 1] == 0x8B and code[index + 2] & 0xC7 == 0x05 and pointer is None:
            pointer = symbols["get_directory_stack"] + index + 7 + struct.unpack_from("<i", code, index + 3)[0]
    if count is None or pointer is None or abs(count - pointer) > 64:
        return None
    return count, pointer


def _ansi(text: bytes) -> str:
    """``$'...'`` quoting of any bytes without NUL (as ``pty_shell.ansi_c_quote``): one shell word, one line."""
    out = []
    for byte in text:
        out.append(chr(byte) if 0x20 <= byte < 0x7F and byte not in (0x27, 0x5C) else f"\\x{byte:02x}")
    return "$'" + "".join(out) + "'"


def _file_offset(data: bytes, address: int) -> int | None:
    """The file offset of virtual ``address`` (by the ELF program headers)."""
    (header_offset,) = struct.unpack_from("<Q", data, 0x20)
    entry_size, count = struct.unpack_from("<HH", data, 0x36)
    for index in range(count):
        kind, _, offset, virtual, _, size, _, _ = struct.unpack_from(
            "<IIQQQQQQ", data, header_offset + index * entry_size
        )
        if kind == 1 and virtual <= address < virtual + size:
            return int(offset + address - virtual)
    return None


@functools.lru_cache(maxsize=256)
def _hash(name: bytes) -> int:
    """bash's ``hash_string`` (FNV-1, 32 bits, over signed chars)."""
    value = 2166136261
    for byte in name:
        value = (value * 16777619) & 0xFFFFFFFF
        value ^= (byte - 256 if byte > 127 else byte) & 0xFFFFFFFF
    return value


class BashMemory:
    """bash's globals and tables read through ``/proc/<pid>/mem`` (root reads any process's memory; the sandbox
    cannot, its ``/proc/1/mem`` is hidden). Raises CaptureRefused when the binary or its memory cannot be read."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._mem = -1
        try:
            exe = f"/proc/{pid}/exe"
            info = os.stat(exe)
            self._image = _image((info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns), exe)
            self._base = load_address(pid)
            self._mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        except UnknownBash as unknown:
            self.close()
            raise CaptureRefused(str(unknown)) from None
        except OSError as error:
            self.close()
            raise CaptureRefused(f"the shell's memory cannot be read ({error.strerror})") from None

    def close(self) -> None:
        if self._mem >= 0:
            os.close(self._mem)
            self._mem = -1

    @property
    def closed(self) -> bool:
        return self._mem < 0

    def __enter__(self) -> BashMemory:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------ primitives

    def read(self, address: int, size: int) -> bytes:
        try:
            data = os.pread(self._mem, size, address)
        except OSError as error:
            raise CaptureRefused(f"the shell's memory cannot be read ({error.strerror})") from None
        if len(data) != size:
            raise CaptureRefused("the shell's memory cannot be read (it replaced its image)")
        return data

    def symbol(self, name: str) -> int:
        return self._base + self._image.symbols[name]

    def integer(self, address: int) -> int:
        return int.from_bytes(self.read(address, 4), "little", signed=True)

    def pointer(self, address: int) -> int:
        return int.from_bytes(self.read(address, 8), "little")

    def string(self, address: int, limit: int = 1 << 16) -> bytes:
        out = bytearray()
        while address and len(out) < limit:
            try:
                chunk = os.pread(self._mem, 256 - address % 256, address)  # never across a page
            except OSError:
                raise CaptureRefused("the shell's memory cannot be read") from None
            if not chunk:
                raise CaptureRefused("the shell's memory cannot be read (it replaced its image)")
            end = chunk.find(b"\0")
            if end >= 0:
                return bytes(out + chunk[:end])
            out += chunk
            address += len(chunk)
        return bytes(out)

    def read_many(self, places: list[tuple[int, int]]) -> list[bytes]:
        """Several (address, size) reads; a place that cannot be read reads empty. (One ``pread`` each: about 2 us,
        less than building a ``process_vm_readv`` call from Python.)"""
        out = []
        for address, size in places:
            try:
                out.append(os.pread(self._mem, size, address) if address else b"")
            except OSError:
                out.append(b"")
        return out

    def lookup(self, table: int, name: str) -> int:
        """The data of ``name`` in the bash hash table at ``table`` (a HASH_TABLE *), or 0."""
        return self.lookup_many(table, [name])[0]

    def lookup_many(self, table: int, names: list[str]) -> list[int]:
        """The data of each of ``names`` in the hash table at ``table`` (0: absent), by level-wise batched reads."""
        if not table or not names:
            return [0] * len(names)
        buckets, count = struct.unpack("<QI", self.read(table, 12))
        if not buckets or count <= 0 or count & (count - 1):
            return [0] * len(names)
        keys = [name.encode() for name in names]
        hashes = [_hash(key) for key in keys]
        heads = self.read_many([(buckets + 8 * (value & (count - 1)), 8) for value in hashes])
        entries = [int.from_bytes(head, "little") if len(head) == 8 else 0 for head in heads]
        found = [0] * len(names)
        pending = [index for index in range(len(names)) if entries[index]]
        for _ in range(64):  # chain links, all names at once
            if not pending:
                break
            rows = self.read_many([(entries[index], 28) for index in pending])
            candidates, following = [], []
            for index, row in zip(pending, rows, strict=False):
                if len(row) != 28:
                    continue
                next_entry, key_address, data, khash = struct.unpack("<QQQI", row)
                if khash == hashes[index]:
                    candidates.append((index, key_address, data))
                entries[index] = next_entry
                following.append(index)
            texts = self.read_many([(key_address, len(keys[index]) + 1) for index, key_address, _ in candidates])
            for (index, _, data), text in zip(candidates, texts, strict=False):
                if text == keys[index] + b"\0":
                    found[index] = data
            pending = [index for index in following if not found[index] and entries[index]]
        return found

    def entries(self, table: int) -> list[tuple[bytes, int]]:
        """Every (key, data) of the bash hash table at ``table``."""
        if not table:
            return []
        buckets, count = struct.unpack("<QI", self.read(table, 12))
        if not buckets or not 0 < count <= 1 << 16:
            return []
        heads = struct.unpack(f"<{count}Q", self.read(buckets, 8 * count))
        found: list[tuple[bytes, int]] = []
        for head in heads:
            entry = head
            while entry and len(found) < 100_000:
                following, key_address, data = struct.unpack("<QQQ", self.read(entry, 24))
                found.append((self.string(key_address), data))
                entry = following
        return found

    # ------------------------------------------------------------ bash's state

    def traps(self) -> tuple[int, ...]:
        """bash's trap_list: one string pointer per signal (0: default, 1: ignored), then DEBUG, ERR, RETURN."""
        return struct.unpack("<68Q", self.read(self.symbol("trap_list"), 8 * 68))

    @functools.cached_property
    def _globals(self) -> int:
        context = self.pointer(self.symbol("global_variables"))
        return self.pointer(context + 32) if context else 0

    def variable(self, name: str) -> tuple[int, int, int, int] | None:
        """A global variable's (value pointer, dynamic-value function, assign function, attributes), or None."""
        return self.variables([name])[0]

    def variables(self, names: list[str]) -> list[tuple[int, int, int, int] | None]:
        addresses = self.lookup_many(self._globals, names)
        rows = self.read_many([(address, 44) for address in addresses if address])
        out: list[tuple[int, int, int, int] | None] = []
        for address in addresses:
            if not address:
                out.append(None)
                continue
            _, value, _, dynamic, assign, attributes = struct.unpack("<QQQQQi", rows.pop(0))
            out.append((value, dynamic, assign, attributes))
        return out

    def builtins(self) -> dict[bytes, tuple[int, int]]:
        """Every builtin by name: (flags, loaded-from handle). Names of bash's own come from its file."""
        table = self.pointer(self.symbol("shell_builtins"))
        count = self.integer(self.symbol("num_shell_builtins"))
        if not table or not 0 < count < 4096:
            raise CaptureRefused("bash's builtin table cannot be read")
        data = self.read(table, 48 * count)
        found = {}
        for index in range(count):
            name, _, flags, _, _, handle = struct.unpack_from("<QQi4xQQQ", data, 48 * index)
            if name:
                text = self._image.static_string(name - self._base) if name >= self._base else None
                found[text if text is not None else self.string(name, 256)] = (flags, handle)
        return found

    def pointer_string(self, address: int) -> bytes:
        """The string a pointer at ``address`` points to."""
        return self.string(self.pointer(address))

    def directory_stack(self) -> list[bytes]:
        """The directory stack below the working directory, as ``DIRSTACK[1]``... (``pushd`` keeps it in two
        statics, found in ``get_directory_stack``'s code)."""
        if self._image.dirstack is None:
            raise CaptureRefused("bash's directory stack cannot be found in this binary")
        count_address, list_address = self._image.dirstack
        count = self.integer(self._base + count_address)
        entries = self.pointer(self._base + list_address)
        if not 0 <= count <= 4096 or (count and not entries):
            raise CaptureRefused("bash's directory stack cannot be read")
        pointers = struct.unpack(f"<{count}Q", self.read(entries, 8 * count)) if count else ()
        return [self.string(pointer) for pointer in reversed(pointers)]

    def getopts_in_bundle(self) -> bool | None:
        """Whether ``getopts`` stopped inside a bundled option (its scanner's pointer is set); None: unknown."""
        if self._image.nextchar is None:
            return None
        return self.pointer(self._base + self._image.nextchar) != 0


_BUILTIN_ENABLED = 0x1
_ATT_NAMEREF = 0x800
_ATT_READONLY = 0x2


def capture_refusal(
    memory: BashMemory, *, others_alive: bool, traps: tuple[int, ...], builtins: Mapping[bytes, tuple[int, int]]
) -> str | None:
    """Why a capture of this shell could run code of the user's or be read wrong (see the module docstring), or
    None. ``others_alive``: processes besides the shell live in its namespace; ``traps`` and ``builtins`` as
    ``BashMemory`` read them."""
    trap = traps[CAPTURE_SIGNAL_NUMBER]
    expected = CAPTURE_TRAP.encode() + b"\0"
    if trap <= SIG_IGN or memory.read(trap, len(expected)) != expected:
        return "the SIGRTMAX trap of the state capture was changed"
    for index, name in ((DEBUG_TRAP, "DEBUG"), (RETURN_TRAP, "RETURN")):
        if traps[index] > SIG_IGN:
            return f"a {name} trap is set: it would run inside the state capture"
    if others_alive and any(trap > SIG_IGN for trap in traps[1:CAPTURE_SIGNAL_NUMBER]):
        return "a signal trap is set while other processes live: one could run it inside the state capture"
    if memory.integer(memory.symbol("echo_input_at_read")):
        return "set -v is on: bash would echo the capture's text to the shell's stderr"
    if memory.integer(memory.symbol("echo_command_at_execute")):
        if memory.integer(memory.symbol("xtrace_fd")) not in (-1, 2):
            return "set -x traces to a BASH_XTRACEFD of the user's: the capture's trace would go there"
        ps4 = memory.variable("PS4")
        if ps4 is not None and any(mark in memory.string(ps4[0]) for mark in (b"$", b"`")):
            return "set -x is on with a PS4 that expands: it would run inside the state capture"
    functions = memory.pointer(memory.symbol("shell_functions"))
    shadow, capture = memory.lookup_many(functions, ["builtin", _CAPTURE])
    if shadow:
        return "a function named builtin would replace the builtins the capture calls"
    if not capture or not struct.unpack("<i", memory.read(capture + 40, 4))[0] & _ATT_READONLY:
        return "the capture function is gone or no longer read-only"
    aliases = memory.pointer(memory.symbol("aliases"))
    for name, found in zip(_RESERVED_ALIASES, memory.lookup_many(aliases, list(_RESERVED_ALIASES)), strict=True):
        if found:
            return f"an alias named {name!r} would change the capture's text"
    for name in _USED_BUILTINS:
        flags, handle = builtins.get(name.encode(), (0, 0))
        if not flags & _BUILTIN_ENABLED or handle:
            return f"the builtin {name} is disabled or replaced (enable)"
    for name, variable in zip(_NAMES, memory.variables(list(_NAMES)), strict=True):
        if variable is not None:
            return f"a variable named {name} is in the way of the capture's own"
    for name, variable in zip(_RELIED_ON, memory.variables(list(_RELIED_ON)), strict=True):
        if variable is None or not variable[1] or variable[3] & _ATT_NAMEREF:
            return f"{name} is no longer bash's own (unset or redefined)"
    return None


def outside_sections(
    memory: BashMemory, *, traps: tuple[int, ...], builtins: Mapping[bytes, tuple[int, int]]
) -> dict[str, str]:
    """What the shell cannot print about itself, read from outside (``OUTSIDE``)."""
    pid = memory.pid
    with open(f"/proc/{pid}/limits") as handle:
        limits = handle.read()
    with open(f"/proc/{pid}/stat") as handle:
        nice = handle.read().rsplit(")", 1)[1].split()[16]  # field 19, counted after the command name
    disabled = sorted(
        name.decode("utf-8", "surrogateescape")
        for name, (flags, handle) in builtins.items()
        if not flags & _BUILTIN_ENABLED or handle
    )
    bundle = memory.getopts_in_bundle()
    sources = []
    for key, definition in memory.entries(memory.pointer(memory.symbol("shell_function_defs"))):
        source = memory.pointer(definition + 24) if definition else 0
        sources.append(
            f"{key.decode('utf-8', 'surrogateescape')} {memory.string(source, 4096).decode(errors='replace')}"
        )
    special = []
    for name, variable in zip(_SPECIAL, memory.variables(_SPECIAL), strict=True):
        special.append(
            f"{name} -"
            if variable is None
            else f"{name} {int(bool(variable[1]))}{int(bool(variable[2]))} {variable[3]:#x}"
        )
    try:
        removed = os.stat(f"/proc/{pid}/cwd").st_nlink == 0
        physical = "" if removed else os.readlink(f"/proc/{pid}/cwd")  # as the shell's own namespace names it
    except OSError:
        physical = ""
    aliases = sorted(
        f"{_ansi(memory.string(name))}={_ansi(memory.string(value))}"
        for _, alias in memory.entries(memory.pointer(memory.symbol("aliases")))
        if alias
        for name, value in [struct.unpack("<QQ", memory.read(alias, 16))]
    )
    hashed = sorted(
        f"{_ansi(memory.pointer_string(data))} {_ansi(key)}"
        for key, data in memory.entries(memory.pointer(memory.symbol("hashed_filenames")))
        if data
    )
    breaks = memory.variable("COMP_WORDBREAKS")
    characters = memory.pointer(memory.symbol("rl_completer_word_break_characters"))
    return {
        "aliases": "\n".join(aliases),
        "hash": "\n".join(hashed),
        "dirs": "\n".join(_ansi(entry) for entry in memory.directory_stack()),
        "comp-wordbreaks": "unset" if breaks is None else _ansi(memory.string(characters)) if characters else "default",
        "physical-cwd": physical,
        "limits": limits,
        "nice": nice,
        "disabled-builtins": "\n".join(disabled),
        "getopts-bundle": "unknown" if bundle is None else str(int(bundle)),
        "function-sources": "\n".join(sorted(sources)),
        "special-variables": "\n".join(special),
        "firing-traps": "\n".join(
            name
            for index, name in ((DEBUG_TRAP, "DEBUG"), (ERR_TRAP, "ERR"), (RETURN_TRAP, "RETURN"))
            if traps[index] > SIG_IGN
        ),
    }


def kernel_pending(pid: int, signum: int) -> bool:
    """Whether ``signum`` is still pending for ``pid`` (not yet delivered to bash's handler)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) >> (signum - 1) & 1:
                return True
    return False


# A bound for a capture that never ends (a stuck shell), not a budget: a deadline hit ends the live shell, and on a
# loaded machine (the suite's four workers on two cores) a capture once took over 5 s. A state over
# MAX_STATE_BYTES is refused, and the shell goes on: the rest of it is read and dropped as it comes.
CAPTURE_SECONDS = 60.0
MAX_STATE_BYTES = 4 << 20


_MEMORIES: weakref.WeakKeyDictionary[CapturedShell, BashMemory] = weakref.WeakKeyDictionary()


def _memory(shell: CapturedShell) -> BashMemory:
    """The shell's memory reader, kept with the shell (its descriptor closes when the shell is collected)."""
    memory = _MEMORIES.get(shell)
    if memory is None or memory.pid != shell.pid or memory.closed:
        memory = BashMemory(shell.pid)
        weakref.finalize(shell, memory.close)
        _MEMORIES[shell] = memory
    return memory


def prepare_capture(shell: CapturedShell) -> None:
    """Make the shell's memory reader now (a warm shell, before the fork that will capture it): CaptureRefused
    if its binary or memory cannot be read."""
    _memory(shell)


def take_capture(shell: CapturedShell, *, checked: bool = True) -> bytes:
    """The state of ``shell`` (idle, between commands): checked from outside, signalled, read from its terminal
    and parsed, with the sections read from outside added; as ``encode_state`` bytes. CaptureRefused says why
    not; the shell then goes on as it was (a state too large included), unless it did not finish the trap by
    CAPTURE_SECONDS (it is killed: the rest of the capture could come later, inside a command's output;
    ``shell.alive`` turns False). ``checked=False`` skips the checks that no code of the user's can run inside
    the trap: for a shell that ran only our boot."""
    spawned = shell.spawned
    if spawned is None or not shell.alive:
        raise CaptureRefused("the shell is gone")
    if not shell.wait_idle():
        raise CaptureRefused("the shell did not return to its prompt")
    memory = _memory(shell)
    traps, builtins = memory.traps(), memory.builtins()
    if checked:
        reason = capture_refusal(memory, others_alive=bool(shell.children()), traps=traps, builtins=builtins)
        if reason is not None:
            raise CaptureRefused(reason)
    outside = outside_sections(memory, traps=traps, builtins=builtins)
    if outside["getopts-bundle"] == "unknown":
        raise CaptureRefused("bash's getopts state cannot be found in this binary")
    shell._reset_terminal()
    start = len(shell._buffer)  # bytes already there are a background process's, for the next command
    deadline = time.monotonic() + CAPTURE_SECONDS
    if not spawned.send_signal(CAPTURE_SIGNAL_NUMBER):
        raise CaptureRefused("the shell is gone")
    nudges: list[int] = []
    try:
        body = _read_capture(shell, memory, start, deadline, nudges)
    except ShellGone:
        shell.close()
        raise CaptureRefused("the shell ended during the state capture") from None
    if body is None:
        shell.kill()
        shell.close()
        raise CaptureRefused("the shell did not finish the state capture in time; it was ended")
    token, data = body
    _wait_trap_end(shell, deadline)
    if nudges:
        _drop_repeated_capture(shell, memory, start, deadline)
    if data is None:
        raise CaptureRefused(f"the shell's state is over {MAX_STATE_BYTES >> 20} MiB")
    return encode_state({**parse_capture(token, data), **outside})


def _read_capture(
    shell: CapturedShell, memory: BashMemory, start: int, deadline: float, nudges: list[int]
) -> tuple[bytes, bytes | None] | None:
    """The token and the body of the capture the trap prints, cut out of the shell's buffer (what came before it
    stays there; the body None when it was over MAX_STATE_BYTES); None at the deadline; CaptureRefused when the
    trap ran but printed no whole capture. A signal bash took but left for later (``_lost_wakeup``) is sent
    again, and counted in ``nudges``."""
    token = b""
    end = b""
    begin = body_start = searched = 0
    oversized = False  # the body passed MAX_STATE_BYTES: it is dropped as it comes, up to its end marker
    finished = False  # the trap has run: what it printed is all in the buffer
    while True:
        buffer = shell._buffer
        if not token:
            found = begin_token(buffer[start:])
            if found is not None:
                begin, body_start, token = found[0] + start, found[1] + start, found[2]
                end = end_marker(token)
                searched = body_start
        if token:
            index = buffer.find(end, searched)
            if index >= 0:
                body = bytes(buffer[body_start:index])
                del buffer[begin : index + len(end)]
                return token, None if oversized else body
            searched = max(body_start, len(buffer) - len(end) + 1)
            if len(buffer) - body_start > MAX_STATE_BYTES:
                oversized = True
            if oversized:
                del buffer[body_start:searched]  # a tail that may hold the marker's start stays
                searched = body_start
        if finished:
            # What the trap printed is ours, never the next command's, whatever it looks like.
            del buffer[begin if token else start :]
            raise CaptureRefused("the shell's state capture printed no complete state")
        if time.monotonic() >= deadline:
            return None
        size = len(buffer)
        shell._read_some(0.0002)
        if not token and len(buffer) == size and _lost_wakeup(shell, memory):
            nudges.append(1)
            shell.spawned.send_signal(CAPTURE_SIGNAL_NUMBER)  # type: ignore[union-attr]
        if len(buffer) == size and _trap_done(shell, memory):
            while True:  # the last bytes it wrote
                size = len(buffer)
                shell._read_some(0)
                if len(buffer) == size:
                    break
            finished = True


def _lost_wakeup(shell: CapturedShell, memory: BashMemory) -> bool:
    """bash took the signal (its handler marked the trap pending) but waits for a line without running the trap,
    twice in a row 2 ms apart: the signal came while a SIGCHLD handler ran, and that handler's SA_RESTART
    restarted the read, so bash looks at its pending traps only when the next input or an interrupting signal
    comes. Sending the signal again interrupts the read (the trap's handler has no SA_RESTART)."""
    for look in range(2):
        if look:
            time.sleep(0.002)
        try:
            if kernel_pending(shell.pid, CAPTURE_SIGNAL_NUMBER) or shell.observer.idle() is None:
                return False
            if not _trap_pending(memory):
                return False
        except Exception:
            return False
    return True


def _drop_repeated_capture(shell: CapturedShell, memory: BashMemory, start: int, deadline: float) -> None:
    """After a signal sent again: if bash woke on its own meanwhile, the trap runs a second time; that capture is
    ours too, never the next command's, and is dropped once bash waits with no trap pending."""
    buffer = shell._buffer
    while time.monotonic() < deadline:
        found = begin_token(buffer[start:])
        if found is not None:
            end = buffer.find(end_marker(found[2]), start + found[1])
            if end >= 0:
                del buffer[start + found[0] : end + len(end_marker(found[2]))]
                continue
        elif _trap_done(shell, memory):
            return
        shell._read_some(0.0002)


def _trap_pending(memory: BashMemory) -> bool:
    """bash's handler took the capture signal and its trap has not run yet (``pending_traps`` in its memory)."""
    return bool(memory.integer(memory.symbol("pending_traps") + 4 * CAPTURE_SIGNAL_NUMBER))


def _wait_trap_end(shell: CapturedShell, deadline: float) -> None:
    """Until bash waits at its prompt again: the trap's last line (its tail) runs after the end marker."""
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if shell.observer.idle() is not None:
                return
        shell._read_some(0.00005)


def _trap_done(shell: CapturedShell, memory: BashMemory) -> bool:
    """The signal reached bash, bash ran its trap, and waits at its prompt again."""
    if kernel_pending(shell.pid, CAPTURE_SIGNAL_NUMBER):
        return False
    if _trap_pending(memory):
        return False
    try:
        return shell.observer.idle() is not None
    except Exception:
        return False
