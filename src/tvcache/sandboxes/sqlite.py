"""SQLite sandboxes: each sandbox is a private in-memory copy of one database file.

The one tool, ``sql``, runs a single statement. Whether that statement read or wrote is decided by SQLite itself:
an authorizer records every action the statement's compilation asks for, and only ``SELECT``, ``READ``,
``FUNCTION`` and ``RECURSIVE`` (plus a few introspection pragmas) count as reads. No regex ever looks at the SQL.

The authorizer also refuses what a snapshot could not carry to a fork, so every state a sandbox reaches lives in
its ``main`` database and nowhere else:

- ``ATTACH`` and ``VACUUM INTO`` (they reach files outside the sandbox),
- temporary tables, views, triggers and indexes (the ``temp`` schema is not part of a snapshot),
- pragmas that change connection settings (``PRAGMA foreign_keys = ON``); the file-stored ``user_version`` and
  ``application_id`` may be set,
- a transaction left open across calls (``BEGIN`` alone) is rolled back: each call is its own transaction.

A call is flagged non-deterministic when SQLite reports a clock, random or connection-state function
(``random()``, ``datetime('now')``, ``CURRENT_TIMESTAMP``, ``last_insert_rowid()``...), whether in the
statement, in a trigger it fires, or in a column default an ``INSERT`` evaluates.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sqlite3
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType

from ..calls import ToolCall, ToolSpec
from ..errors import SandboxError, UnknownTool
from ..protocol import Outcome, Snapshot, discard_snapshot_files, require_new_destination
from .threads import finish_in_thread

__all__ = ["SQL_TOOL", "SQLiteSandbox", "SQLiteSandboxFactory"]

KIND = "sqlite"
DIGEST_BYTES = 16
# Pages a snapshot's backup copies per step (4 MiB at the default page size): a cancelled snapshot stops within
# one step instead of copying the whole database first.
_BACKUP_PAGES = 1024

SQL_TOOL = ToolSpec(
    name="sql",
    arguments={"query": str},
    read_only=False,
    deterministic=True,
    description=(
        "Run one SQLite statement against the database and return its result as a text table "
        "(or 'OK (N rows changed)' for statements without a result). One statement per call."
    ),
)

_READ_ACTIONS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)
# Names as the authorizer reports them (SQLite >= 3.38 reports CURRENT_TIMESTAMP & co. as functions too).
_VOLATILE_FUNCTIONS = frozenset(
    {
        "random",
        "randomblob",
        "changes",
        "last_insert_rowid",
        "total_changes",
        "date",
        "time",
        "datetime",
        "julianday",
        "strftime",
        "unixepoch",
        "timediff",
        "current_date",
        "current_time",
        "current_timestamp",
    }
)
_TEMP_CREATES = frozenset(
    {
        sqlite3.SQLITE_CREATE_TEMP_TABLE,
        sqlite3.SQLITE_CREATE_TEMP_INDEX,
        sqlite3.SQLITE_CREATE_TEMP_TRIGGER,
        sqlite3.SQLITE_CREATE_TEMP_VIEW,
    }
)
# Pragmas whose argument, if any, names a table or index: they only report, never change anything.
_INTROSPECTION_PRAGMAS = frozenset(
    {
        "table_info",
        "table_xinfo",
        "table_list",
        "index_info",
        "index_xinfo",
        "index_list",
        "foreign_key_list",
        "foreign_key_check",
        "integrity_check",
        "quick_check",
        "database_list",
        "collation_list",
        "function_list",
        "module_list",
        "pragma_list",
        "compile_options",
    }
)
# Settings that may be queried (no value) as a read.
_QUERYABLE_PRAGMAS = frozenset(
    {"user_version", "application_id", "schema_version", "page_count", "page_size", "freelist_count", "encoding"}
)
# Settings stored in the database file itself, so a snapshot carries them.
_FILE_PRAGMAS = frozenset({"user_version", "application_id"})

_TRANSACTION_LEFT_OPEN = (
    "Error: a transaction cannot stay open across calls (each call runs in its own transaction); "
    "it was rolled back. Send the statements one per call without BEGIN/COMMIT."
)
_ONE_STATEMENT = (
    "Error: only one SQL statement per call is accepted; send each statement in its own call. Nothing was run."
)


class _StatementAudit:
    """The authorizer for one statement: records what SQLite reports and refuses what snapshots cannot carry."""

    def __init__(self) -> None:
        self.writes = False
        self.volatile = False
        self.inserted: set[tuple[str, str]] = set()
        self.refusal: str | None = None

    def __call__(self, action: int, arg1: str | None, arg2: str | None, db_name: str | None, _: object) -> int:
        refusal = self._refusal(action, arg1, arg2)
        if refusal is not None:
            self.refusal = self.refusal or refusal
            return sqlite3.SQLITE_DENY
        if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _VOLATILE_FUNCTIONS:
            self.volatile = True
        if action == sqlite3.SQLITE_INSERT and arg1 and db_name and not arg1.lower().startswith("sqlite_"):
            self.inserted.add((db_name, arg1))
        if action not in _READ_ACTIONS and not _is_read_pragma(action, arg1, arg2):
            self.writes = True
        return sqlite3.SQLITE_OK

    @staticmethod
    def _refusal(action: int, arg1: str | None, arg2: str | None) -> str | None:
        # VACUUM attaches an empty name internally; any real file name reaches outside the sandbox.
        if action == sqlite3.SQLITE_ATTACH and arg1:
            return "ATTACH and VACUUM INTO are not allowed: they reach files outside the sandbox."
        if action in _TEMP_CREATES:
            return (
                "temporary tables, views, triggers and indexes are not allowed: the temp schema is not part of "
                "snapshots. Create a regular one instead."
            )
        if action == sqlite3.SQLITE_PRAGMA and arg2 is not None:
            name = (arg1 or "").lower()
            if name not in _INTROSPECTION_PRAGMAS and name not in _FILE_PRAGMAS:
                return f"PRAGMA {name} = ... is not allowed: it changes a connection setting that forks would lose."
        return None


def _is_read_pragma(action: int, name: str | None, value: str | None) -> bool:
    if action != sqlite3.SQLITE_PRAGMA:
        return False
    name = (name or "").lower()
    return name in _INTROSPECTION_PRAGMAS or (value is None and name in _QUERYABLE_PRAGMAS)


_ESCAPES = {code: repr(chr(code))[1:-1] for code in [*range(32), 127]}


def _render_value(value: object) -> str:
    """Stable text for one cell: NULL, repr for floats, x'..' for blobs, control characters escaped."""
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, bytes):
        return f"x'{value.hex()}'"
    if isinstance(value, str):
        return value.translate(_ESCAPES)
    return str(value)


def _execute_and_render(connection: sqlite3.Connection, query: str, max_rows: int) -> str:
    cursor = connection.execute(query)
    try:
        if cursor.description is None:
            changed = max(cursor.rowcount, 0)
            return f"OK ({changed} {'row' if changed == 1 else 'rows'} changed)"
        lines = [" | ".join(column[0] for column in cursor.description)]
        total = 0
        for row in cursor:  # read to the end: the count is part of the output, and the statement must finish
            total += 1
            if total <= max_rows:
                lines.append(" | ".join(_render_value(value) for value in row))
        if total > max_rows:
            lines.append(f"... ({total} rows total)")
        elif total == 0:
            lines.append("(0 rows)")
        return "\n".join(lines)
    finally:
        cursor.close()


def _defaults_are_volatile(connection: sqlite3.Connection, tables: Iterable[tuple[str, str]]) -> bool:
    """Whether an INSERT into these tables may have evaluated a volatile column default.

    The authorizer does not report functions in column defaults, so each default is compiled on its own
    (``SELECT (default)``; defaults are constant expressions, so this has no effect) under a fresh audit.
    """
    for schema, table in sorted(tables):
        try:
            defaults = connection.execute(
                "SELECT dflt_value FROM pragma_table_xinfo(?, ?) WHERE dflt_value IS NOT NULL", (table, schema)
            ).fetchall()
        except sqlite3.Error:
            return True
        for (expression,) in defaults:
            probe = _StatementAudit()
            connection.set_authorizer(probe)
            try:
                connection.execute(f"SELECT ({expression})").fetchall()
            except sqlite3.Error:
                return True  # cannot tell: say volatile
            finally:
                connection.set_authorizer(None)
            if probe.volatile:
                return True
    return False


def _run_statement(connection: sqlite3.Connection, query: str, max_rows: int) -> Outcome:
    audit = _StatementAudit()
    connection.set_authorizer(audit)
    error: Exception | None = None
    output = ""
    try:
        output = _execute_and_render(connection, query, max_rows)
    except (sqlite3.Error, sqlite3.Warning) as caught:
        error = caught
    finally:
        connection.set_authorizer(None)
    if connection.in_transaction:
        # Only BEGIN / SAVEPOINT leave one open, and they change nothing: rolling back restores the prior state.
        connection.rollback()
        return Outcome(output=_TRANSACTION_LEFT_OPEN, is_error=True, changed_state=False)
    deterministic = not audit.volatile and not _defaults_are_volatile(connection, audit.inserted)
    if error is None:
        return Outcome(output=output, changed_state=audit.writes, deterministic=deterministic)
    # Python refuses a second statement after compiling the first, before running anything.
    several = isinstance(error, sqlite3.Warning) or "one statement at a time" in str(error)
    if several:
        return Outcome(output=_ONE_STATEMENT, is_error=True, changed_state=False, deterministic=deterministic)
    if audit.refusal is not None:  # refused while compiling: nothing ran
        return Outcome(output=f"Error: {audit.refusal}", is_error=True, changed_state=False)
    # A failed write may still have changed rows (INSERT OR FAIL stops half way): stay conservative.
    return Outcome(output=f"Error: {error}", is_error=True, changed_state=audit.writes, deterministic=deterministic)


def _open_copy(path: Path, what: str) -> sqlite3.Connection:
    """A private in-memory copy of the database at ``path``, which is opened read-only and left untouched.

    In memory rather than a temp file: a copy is a page-for-page memcpy with no filesystem round trip, reads and
    writes never touch disk, and stopping frees it at once. The cost is RAM, one database size per live sandbox.
    """
    try:
        source = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as error:
        raise SandboxError(f"cannot open the {what} {path}: {error}; check that it exists and is readable") from error
    try:
        # check_same_thread=False: every call runs in a worker thread, serialised by the sandbox's lock.
        target = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        source.backup(target)
    except sqlite3.Error as error:
        raise SandboxError(f"cannot copy the {what} {path}: {error}; is it a SQLite database?") from error
    finally:
        source.close()
    return target


class _Abandoned(Exception):
    """Raised from a backup's progress callback to stop it: its snapshot was cancelled."""


def _backup_to_file(connection: sqlite3.Connection, dest: Path, abandon: threading.Event | None = None) -> int:
    """Write the database to ``dest``, in steps of ``_BACKUP_PAGES``; stops (leaving no file) once ``abandon``
    is set."""
    require_new_destination(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    partial.unlink(missing_ok=True)

    def progress(status: int, remaining: int, total: int) -> None:
        if abandon is not None and abandon.is_set():
            raise _Abandoned  # the backup is aborted by an exception from its callback

    try:
        target = sqlite3.connect(partial)
        try:
            connection.backup(target, pages=_BACKUP_PAGES, progress=progress)
        finally:
            target.close()
        if abandon is not None and abandon.is_set():
            raise _Abandoned
        os.replace(partial, dest)  # a crash never leaves a half-written file under the final name
    except _Abandoned:
        partial.unlink(missing_ok=True)
        raise SandboxError(f"the snapshot {dest} was cancelled before it was written") from None
    except (sqlite3.Error, OSError) as error:
        partial.unlink(missing_ok=True)
        raise SandboxError(f"cannot write the snapshot {dest}: {error}; check free space and permissions") from error
    return dest.stat().st_size


def _digest_database(connection: sqlite3.Connection) -> str:
    image = bytearray(connection.serialize())
    # Header fields that a copy rewrites without changing content: the change counter (24..28) and the
    # version-valid-for number and writer library version (92..100).
    if len(image) >= 100:
        image[24:28] = bytes(4)
        image[92:100] = bytes(8)
    return hashlib.blake2b(image, digest_size=DIGEST_BYTES).hexdigest()


class SQLiteSandboxFactory:
    """Starts SQLite sandboxes from a base database file (never modified) and forks them from snapshots."""

    kind: str = KIND

    def __init__(self, base_path: str | os.PathLike[str], *, delay_seconds: float = 0.0, max_rows: int = 200) -> None:
        path = Path(base_path)
        if not path.is_file():
            raise SandboxError(
                f"SQLite base database {path} does not exist or is not a file; pass an existing .db file"
            )
        with path.open("rb") as file:
            header = file.read(16)
        if header and header != b"SQLite format 3\x00":
            raise SandboxError(f"{path} is not a SQLite database (bad header); pass a SQLite 3 database file")
        if delay_seconds < 0:
            raise ValueError(f"delay_seconds must be >= 0, got {delay_seconds}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.base_path = path
        self.delay_seconds = float(delay_seconds)
        self.max_rows = max_rows
        # Rough priors in seconds (measured 1.5 / 1.5 / 3.4 ms on the 1 MB Chinook database); the cache
        # replaces them with its own measurements.
        self.cost_hints: dict[str, float] = {"start": 0.002, "fork": 0.002, "snapshot": 0.005}
        self._tools: Mapping[str, ToolSpec] = MappingProxyType({SQL_TOOL.name: SQL_TOOL})

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        return self._tools

    async def start(self) -> SQLiteSandbox:
        connection = await _open_in_thread(self.base_path, "base database")
        return SQLiteSandbox(self, connection)

    async def fork(self, snapshot: Snapshot) -> SQLiteSandbox:
        if snapshot.kind != KIND:
            raise SandboxError(f"cannot fork a SQLite sandbox from a {snapshot.kind!r} snapshot; use its own backend")
        path = Path(snapshot.path)
        if not path.is_file():
            raise SandboxError(
                f"snapshot file {path} is missing (discarded or deleted); rebuild the state by replaying its calls"
            )
        connection = await _open_in_thread(path, "snapshot")
        return SQLiteSandbox(self, connection)

    def discard(self, snapshot: Snapshot) -> None:
        discard_snapshot_files(snapshot)

    def __repr__(self) -> str:
        return f"SQLiteSandboxFactory({str(self.base_path)!r}, delay_seconds={self.delay_seconds})"


async def _open_in_thread(path: Path, what: str) -> sqlite3.Connection:
    """``_open_copy`` in a worker thread; a cancelled caller waits until the file is no longer read (a fork's
    caller may release the snapshot as soon as it returns) and closes the copy."""
    return await finish_in_thread(lambda: _open_copy(path, what), undo=sqlite3.Connection.close)


class SQLiteSandbox:
    """One private database. Calls are serialised by a lock; blocking SQLite work runs in a worker thread, and a
    cancelled caller keeps the lock until that thread is done (``finish_in_thread``), so no two threads ever use
    the connection at once."""

    def __init__(self, factory: SQLiteSandboxFactory, connection: sqlite3.Connection) -> None:
        self._factory = factory
        self._connection: sqlite3.Connection | None = connection
        self._lock = asyncio.Lock()

    @classmethod
    def factory(
        cls, path: str | os.PathLike[str], *, delay_seconds: float = 0.0, max_rows: int = 200
    ) -> SQLiteSandboxFactory:
        """A factory of sandboxes copied from the database at ``path``.

        ``delay_seconds`` is slept before each call to emulate a remote database; ``max_rows`` caps result rows.
        """
        return SQLiteSandboxFactory(path, delay_seconds=delay_seconds, max_rows=max_rows)

    def _require_open(self) -> sqlite3.Connection:
        if self._connection is None:
            raise SandboxError("this SQLite sandbox was stopped; start or fork a new one from the factory")
        return self._connection

    async def execute(self, call: ToolCall) -> Outcome:
        spec = self._factory.tools.get(call.name)
        if spec is None:
            raise UnknownTool(call.name, list(self._factory.tools))
        spec.validate(call)
        query: str = call.arguments["query"]
        self._require_open()
        if self._factory.delay_seconds:
            await asyncio.sleep(self._factory.delay_seconds)
        async with self._lock:
            connection = self._require_open()
            max_rows = self._factory.max_rows
            # Cancelled: abort the statement (its thread cannot be cancelled) and keep the lock until it ends.
            return await finish_in_thread(
                lambda: _run_statement(connection, query, max_rows), on_cancel=connection.interrupt
            )

    async def snapshot(self, dest: Path) -> Snapshot:
        dest = Path(dest)
        async with self._lock:
            connection = self._require_open()
            abandon = threading.Event()
            # Cancelled: stop the backup at its next step and keep the lock until it has; a backup that finished
            # anyway is removed (no one will record it).
            size = await finish_in_thread(
                lambda: _backup_to_file(connection, dest, abandon),
                on_cancel=abandon.set,
                undo=lambda _: dest.unlink(missing_ok=True),
            )
        return Snapshot(kind=KIND, path=str(dest), bytes=size)

    async def state_digest(self) -> str:
        """blake2b of the database image; equal for identical pages (a fork equals its origin)."""
        async with self._lock:
            connection = self._require_open()
            return await finish_in_thread(lambda: _digest_database(connection))

    async def stop(self) -> None:
        async with self._lock:
            connection, self._connection = self._connection, None
            if connection is not None:
                await finish_in_thread(connection.close)
