"""Contract suite every sandbox backend passes, then backend-specific behaviour. Real SQLite, real bash."""

from __future__ import annotations

import asyncio
import os
import re
import select
import sqlite3
import time
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tvcache.calls import ToolCall
from tvcache.errors import InvalidToolCall, SandboxError
from tvcache.protocol import Outcome, SandboxFactory, Snapshot
from tvcache.sandboxes import FolderSandbox, FolderSandboxFactory, FolderTool, SQLiteSandbox, SQLiteSandboxFactory
from tvcache.sandboxes.shell.linux import overlay_supported
from tvcache.testing import CHECKS, SandboxCheckFailed, SandboxProbe, check_sandbox, run_check

T = TypeVar("T")


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


# ---------------------------------------------------------------- fixtures


def make_database(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(path)
    connection.executescript(
        """
        CREATE TABLE items (name TEXT PRIMARY KEY);
        INSERT INTO items VALUES ('apple'), ('pear');
        CREATE TABLE numbers (n INTEGER, x REAL, b BLOB, t TEXT);
        INSERT INTO numbers VALUES (1, 0.1, x'00ff', 'one'), (2, NULL, NULL, 'two');
        """
    )
    connection.commit()
    connection.close()
    return path


def make_template(path: Path) -> Path:
    (path / "items").mkdir(parents=True)
    (path / "items" / "apple").write_text("red\n")
    (path / "items" / "pear").write_text("green\n")
    (path / "notes.txt").write_text("line one\nline two\n")
    (path / "link").symlink_to("notes.txt")
    return path


@dataclass(frozen=True, kw_only=True)
class Backend(SandboxProbe):
    """One backend and the probe that maps the contract's abstract operations onto its tool calls (the contract
    itself is ``tvcache.testing``, shipped for third-party backends). Every fixture's base holds apple and pear."""

    factory: SandboxFactory
    initial: Collection[str] = frozenset({"apple", "pear"})
    # Contract clauses this backend is known to break today: (test name, the diagnosis). Each runs as a strict
    # xfail of SandboxCheckFailed, so the fix turns it into a failure: then delete the entry.
    known_bugs: tuple[tuple[str, str], ...] = ()


def sqlite_backend(tmp_path: Path) -> Backend:
    return Backend(
        factory=SQLiteSandbox.factory(make_database(tmp_path / "base.sqlite")),
        read=ToolCall("sql", {"query": "SELECT name FROM items ORDER BY name"}),
        write=lambda name: ToolCall("sql", {"query": f"INSERT INTO items VALUES ('{name}')"}),
        failing=ToolCall("sql", {"query": "SELECT * FROM no_such_table"}),
        bad_arguments=ToolCall("sql", {"query": 42}),
        items=lambda outcome: set(outcome.output.splitlines()[1:]) - {"(0 rows)"},
    )


def folder_backend(tmp_path: Path) -> Backend:
    return Backend(
        factory=FolderSandbox.factory(make_template(tmp_path / "template")),
        read=ToolCall("sh", {"cmd": "ls items"}),
        write=lambda name: ToolCall("sh", {"cmd": f"echo new > items/{name}"}),
        failing=ToolCall("sh", {"cmd": "echo failing; exit 3"}),
        bad_arguments=ToolCall("sh", {"command": "ls"}),
        items=lambda outcome: set(outcome.output.splitlines()),
    )


def shell_backend(tmp_path: Path) -> Backend:
    from tvcache.sandboxes import ShellSandbox

    if not overlay_supported():
        pytest.skip("overlay mounts need root on Linux >= 6.8; the shell backend falls back to FolderSandbox")
    return Backend(
        factory=ShellSandbox.factory(make_template(tmp_path / "base"), fallback=False),
        read=ToolCall("sh", {"cmd": "ls items"}),
        write=lambda name: ToolCall("sh", {"cmd": f"echo new > items/{name}"}),
        failing=ToolCall("sh", {"cmd": "echo failing; exit 3"}),
        bad_arguments=ToolCall("sh", {"command": "ls"}),
        items=lambda outcome: set(outcome.output.splitlines()),
    )


def persistent_shell_backend(tmp_path: Path) -> Backend:
    from tvcache.sandboxes import ShellSandbox

    if not overlay_supported():
        pytest.skip("persistent shell sandboxes need overlay mounts (root on Linux >= 6.8), with no fallback")
    return Backend(
        factory=ShellSandbox.factory(make_template(tmp_path / "base"), fallback=False, persistent=True),
        read=ToolCall("sh", {"cmd": "ls -1 items"}),  # one name a line: on a terminal, `ls` prints columns
        write=lambda name: ToolCall("sh", {"cmd": f"echo new > items/{name}"}),
        # Not `exit 3`: in a live shell that ends the shell itself, a different clause (the next call starts a
        # new shell and says so), covered by test_persistent_shell. Here a command fails and the shell lives on.
        failing=ToolCall("sh", {"cmd": "echo failing; (exit 3)"}),
        bad_arguments=ToolCall("sh", {"command": "ls"}),
        items=lambda outcome: set(outcome.output.splitlines()),
        reads_keep_state=False,
    )


@pytest.fixture(
    params=[sqlite_backend, folder_backend, shell_backend, persistent_shell_backend],
    ids=["sqlite", "folder", "shell", "persistent-shell"],
)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    make: Callable[[Path], Backend] = request.param
    made = make(tmp_path)
    for test, diagnosis in made.known_bugs:
        if request.node.originalname == test:
            request.applymarker(
                pytest.mark.xfail(raises=SandboxCheckFailed, strict=True, reason=f"known bug: {diagnosis}")
            )
    return made


def check(name: str, backend: Backend, tmp_path: Path) -> None:
    """Run one check of the shipped contract (``tvcache.testing.CHECKS``) on ``backend``."""
    run(run_check(name, backend.factory, backend, tmp_path))


# ---------------------------------------------------------------- contract (tvcache.testing)


def test_factory_and_sandbox_satisfy_the_protocol(backend: Backend, tmp_path: Path) -> None:
    check("protocol", backend, tmp_path)
    # tvcache's own backends declare every cost the cost model reads (the protocol lets others leave some out).
    assert set(backend.factory.cost_hints) == {"start", "fork", "snapshot"}  # type: ignore[attr-defined]


def test_reads_do_not_change_state_and_writes_do(backend: Backend, tmp_path: Path) -> None:
    check("reads-and-writes", backend, tmp_path)


def test_forks_are_independent_and_snapshots_frozen(backend: Backend, tmp_path: Path) -> None:
    check("fork-isolation", backend, tmp_path)


def test_state_digest_tracks_content(backend: Backend, tmp_path: Path) -> None:
    assert backend.has_state_digest  # every backend of tvcache's own offers one
    check("state-digest", backend, tmp_path)


def test_stop_is_idempotent_and_a_stopped_sandbox_refuses_work(backend: Backend, tmp_path: Path) -> None:
    check("stop", backend, tmp_path)


def test_discard_removes_the_snapshot_and_forking_it_then_fails(backend: Backend, tmp_path: Path) -> None:
    check("discard", backend, tmp_path)


def test_snapshot_refuses_an_existing_destination(backend: Backend, tmp_path: Path) -> None:
    check("snapshot-destination", backend, tmp_path)


def test_tool_failures_are_outcomes_and_bad_calls_raise(backend: Backend, tmp_path: Path) -> None:
    check("bad-input", backend, tmp_path)


def test_check_sandbox_passes_a_real_backend_and_names_what_a_broken_one_breaks(tmp_path: Path) -> None:
    backend = folder_backend(tmp_path)
    check_sandbox(backend.factory, backend, scratch=tmp_path / "checks")
    assert sorted(p.name for p in (tmp_path / "checks").iterdir()) == sorted(CHECKS)

    class ForksIgnoreTheSnapshot(FolderSandboxFactory):
        async def fork(self, snapshot: Snapshot) -> FolderSandbox:
            return await self.start()

    class KeepsWorkingAfterStop(FolderSandboxFactory):
        async def start(self) -> FolderSandbox:
            sandbox = await super().start()
            sandbox.stop = lambda: asyncio.sleep(0)  # type: ignore[method-assign]
            return sandbox

    template = make_template(tmp_path / "broken")
    for broken, name, seen in (
        (ForksIgnoreTheSnapshot(template), "fork-isolation", "a fork lists"),
        (KeepsWorkingAfterStop(template), "stop", "execute() after stop() did not raise SandboxError"),
    ):
        with pytest.raises(SandboxCheckFailed, match=re.escape(seen)) as failed:
            check_sandbox(broken, backend)
        assert failed.value.check == name
        assert failed.value.property == CHECKS[name].property
        assert CHECKS[name].property in str(failed.value)
        broken.close()
    with pytest.raises(ValueError, match="no sandbox check 'forks'"):
        check_sandbox(backend.factory, backend, checks=["forks"])


def test_the_readme_snippet_checks_a_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (Path(__file__).parent.parent / "README.md").read_text()
    match = re.search(r"<!-- snippet: check-sandbox -->\n```python\n(.*?)```", text, re.S)
    assert match is not None, "README has no check-sandbox snippet"
    make_template(tmp_path / "template")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(match.group(1), "README.md", "exec"), namespace)
    namespace["factory"].close()


# ---------------------------------------------------------------- SQLite


def sql(query: str) -> ToolCall:
    return ToolCall("sql", {"query": query})


def run_sql(tmp_path: Path, *queries: str, **options: Any) -> list[Outcome]:
    async def main() -> list[Outcome]:
        sandbox = await SQLiteSandbox.factory(make_database(tmp_path / "db.sqlite"), **options).start()
        outcomes = [await sandbox.execute(sql(query)) for query in queries]
        await sandbox.stop()
        return outcomes

    return run(main())


@pytest.mark.parametrize(
    ("query", "changed"),
    [
        ("SELECT * FROM items", False),
        ("WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r WHERE x < 3) SELECT * FROM r", False),
        ("EXPLAIN SELECT * FROM items", False),
        ("EXPLAIN QUERY PLAN SELECT * FROM items WHERE name = 'x'", False),
        ("SELECT count(*), max(n) FROM numbers", False),
        ("PRAGMA table_info(items)", False),
        ("PRAGMA user_version", False),
        ("SELECT * FROM no_such_table", False),
        ("INSERT INTO items VALUES ('fig')", True),
        ("UPDATE numbers SET n = n + 1", True),
        ("DELETE FROM items WHERE name = 'pear'", True),
        ("CREATE TABLE more (a)", True),
        ("DROP TABLE numbers", True),
        ("CREATE INDEX numbers_n ON numbers (n)", True),
        ("ALTER TABLE items ADD COLUMN colour TEXT", True),
        ("PRAGMA user_version = 7", True),
        ("INSERT INTO items VALUES ('apple')", True),  # fails (duplicate key), but it is a write
    ],
)
def test_sqlite_read_only_is_decided_by_the_authorizer(tmp_path: Path, query: str, changed: bool) -> None:
    (outcome,) = run_sql(tmp_path, query)
    assert outcome.changed_state is changed, outcome.output


@pytest.mark.parametrize(
    ("query", "deterministic"),
    [
        ("SELECT random()", False),
        ("SELECT hex(randomblob(4))", False),
        ("SELECT CURRENT_TIMESTAMP", False),
        ("SELECT datetime('now')", False),
        ("SELECT last_insert_rowid()", False),
        ("SELECT abs(-1), upper('a'), count(*) FROM items", True),
    ],
)
def test_sqlite_volatile_functions_make_a_call_non_deterministic(
    tmp_path: Path, query: str, deterministic: bool
) -> None:
    (outcome,) = run_sql(tmp_path, query)
    assert not outcome.is_error
    assert outcome.deterministic is deterministic


def test_sqlite_volatile_defaults_and_triggers_are_seen(tmp_path: Path) -> None:
    create_log, create_audit, insert_log, insert_audit, trigger, fire = run_sql(
        tmp_path,
        "CREATE TABLE log (message TEXT, at TEXT DEFAULT CURRENT_TIMESTAMP)",
        "CREATE TABLE audit (name TEXT, seen TEXT)",
        "INSERT INTO log (message) VALUES ('hello')",
        "INSERT INTO audit VALUES ('x', 'fixed')",
        "CREATE TRIGGER stamp AFTER INSERT ON items BEGIN INSERT INTO audit VALUES (new.name, datetime('now')); END",
        "INSERT INTO items VALUES ('fig')",
    )
    assert all(o.deterministic for o in (create_log, create_audit, insert_audit, trigger))
    assert not insert_log.deterministic  # the default evaluated CURRENT_TIMESTAMP
    assert not fire.deterministic  # the trigger called datetime('now')


def test_sqlite_output_format(tmp_path: Path) -> None:
    select, insert, empty, update = run_sql(
        tmp_path,
        "SELECT n, x, b, t FROM numbers ORDER BY n",
        "INSERT INTO items VALUES ('a\nb')",
        "SELECT name FROM items WHERE name = 'zzz'",
        "UPDATE numbers SET t = 'x'",
    )
    assert select.output == "n | x | b | t\n1 | 0.1 | x'00ff' | one\n2 | NULL | NULL | two"
    assert insert.output == "OK (1 row changed)"
    assert empty.output == "name\n(0 rows)"
    assert update.output == "OK (2 rows changed)"
    (escaped,) = run_sql(tmp_path / "again", "SELECT 'a' || char(10) || 'b' AS s")
    assert escaped.output == "s\na\\nb"


def test_sqlite_truncates_long_results(tmp_path: Path) -> None:
    (outcome,) = run_sql(
        tmp_path,
        "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r WHERE x < 25) SELECT x FROM r",
        max_rows=10,
    )
    lines = outcome.output.splitlines()
    assert lines[0] == "x"
    assert lines[1:11] == [str(i) for i in range(1, 11)]
    assert lines[11:] == ["... (25 rows total)"]


def test_sqlite_refuses_several_statements_and_runs_none(tmp_path: Path) -> None:
    several, after = run_sql(tmp_path, "INSERT INTO items VALUES ('fig'); SELECT 2", "SELECT count(*) FROM items")
    assert several.is_error
    assert "one SQL statement per call" in several.output
    assert several.changed_state is False
    assert after.output == "count(*)\n2"


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("ATTACH DATABASE ':memory:' AS other", "ATTACH"),
        ("VACUUM INTO 'copy.sqlite'", "ATTACH"),
        ("CREATE TEMP TABLE scratch (a)", "temp"),
        ("PRAGMA foreign_keys = ON", "connection setting"),
        ("BEGIN", "transaction"),
        ("SAVEPOINT here", "transaction"),
    ],
)
def test_sqlite_refuses_state_that_snapshots_cannot_carry(tmp_path: Path, query: str, message: str) -> None:
    refused, after = run_sql(tmp_path, query, "INSERT INTO items VALUES ('fig')")
    assert refused.is_error
    assert message in refused.output
    assert refused.changed_state is False
    assert after.output == "OK (1 row changed)"  # the next call runs in autocommit as usual
    assert not (tmp_path / "copy.sqlite").exists()


def test_sqlite_vacuum_is_allowed(tmp_path: Path) -> None:
    (outcome,) = run_sql(tmp_path, "VACUUM")
    assert not outcome.is_error, outcome.output


def test_sqlite_base_file_is_never_modified(tmp_path: Path) -> None:
    base = make_database(tmp_path / "base.sqlite")
    before = (base.read_bytes(), base.stat().st_mtime_ns)

    async def main() -> None:
        factory = SQLiteSandbox.factory(base)
        sandbox = await factory.start()
        for query in ("DELETE FROM items", "DROP TABLE numbers", "CREATE TABLE t (a)", "VACUUM"):
            assert not (await sandbox.execute(sql(query))).is_error
        await sandbox.snapshot(tmp_path / "snap")
        await sandbox.stop()

    run(main())
    assert (base.read_bytes(), base.stat().st_mtime_ns) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.sqlite", "snap"]


def test_sqlite_snapshot_size_is_the_file_size(tmp_path: Path) -> None:
    async def main() -> Snapshot:
        sandbox = await SQLiteSandbox.factory(make_database(tmp_path / "base.sqlite")).start()
        snapshot = await sandbox.snapshot(tmp_path / "nested" / "snap.sqlite")
        await sandbox.stop()
        return snapshot

    snapshot = run(main())
    assert snapshot.bytes == Path(snapshot.path).stat().st_size
    assert Snapshot.from_json(snapshot.to_json()) == snapshot


def test_sqlite_delay_is_honoured(tmp_path: Path) -> None:
    async def main() -> float:
        sandbox = await SQLiteSandbox.factory(make_database(tmp_path / "db"), delay_seconds=0.05).start()
        started = time.perf_counter()
        await sandbox.execute(sql("SELECT 1"))
        elapsed = time.perf_counter() - started
        await sandbox.stop()
        return elapsed

    assert run(main()) >= 0.05


def test_sqlite_factory_fails_early_on_a_bad_base(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="does not exist"):
        SQLiteSandbox.factory(tmp_path / "missing.sqlite")
    (tmp_path / "text.txt").write_text("not a database at all")
    with pytest.raises(SandboxError, match="not a SQLite database"):
        SQLiteSandbox.factory(tmp_path / "text.txt")
    with pytest.raises(ValueError, match="delay_seconds"):
        SQLiteSandbox.factory(make_database(tmp_path / "db"), delay_seconds=-1)


def test_sqlite_factory_type(tmp_path: Path) -> None:
    factory = SQLiteSandbox.factory(make_database(tmp_path / "db"))
    assert isinstance(factory, SQLiteSandboxFactory)
    assert factory.kind == "sqlite"
    assert list(factory.tools) == ["sql"]


# ---------------------------------------------------------------- folder


def sh(cmd: str, **extra: Any) -> ToolCall:
    return ToolCall("sh", {"cmd": cmd, **extra})


def process_gone(pid: int, within: float = 2.0) -> bool:
    """Whether ``pid`` has exited (a zombie counts as exited), waiting at most ``within`` seconds."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([pidfd], [], [], within)
        return bool(ready)
    finally:
        os.close(pidfd)


def run_folder(tmp_path: Path, *calls: ToolCall, **options: Any) -> tuple[list[Outcome], Path]:
    """Run calls in a fresh folder sandbox; returns the outcomes and the sandbox's folder."""

    async def main() -> tuple[list[Outcome], Path]:
        factory = FolderSandbox.factory(make_template(tmp_path / "template"), **options)
        sandbox = await factory.start()
        assert isinstance(sandbox, FolderSandbox)
        folder = sandbox.folder
        outcomes = [await sandbox.execute(call) for call in calls]
        await sandbox.stop()
        return outcomes, folder

    return run(main())


def test_folder_background_processes_are_killed(tmp_path: Path) -> None:
    started = time.perf_counter()
    (holding, detached), _ = run_folder(tmp_path, sh("sleep 30 & echo $!"), sh("sleep 30 >/dev/null 2>&1 & echo $!"))
    assert time.perf_counter() - started < 10
    for outcome in (holding, detached):
        assert not outcome.is_error, outcome.output
        assert process_gone(int(outcome.output))


def test_folder_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    started = time.perf_counter()
    (outcome,), _ = run_folder(tmp_path, sh("sleep 60 & echo $!; sleep 5", timeout=0.5))
    assert time.perf_counter() - started < 4.5
    assert outcome.is_error
    assert not outcome.deterministic
    lines = outcome.output.splitlines()
    assert lines[-1] == "[timed out after 0.5s]"
    assert process_gone(int(lines[0]))


def test_folder_timeout_is_capped_by_the_factory(tmp_path: Path) -> None:
    (outcome,), _ = run_folder(tmp_path, sh("sleep 5", timeout=100), timeout=0.3)
    assert outcome.output == "[timed out after 0.3s]"
    with pytest.raises(InvalidToolCall, match="timeout"):
        run_folder(tmp_path / "again", sh("true", timeout=0))


def test_folder_environment_is_fixed_and_no_shell_state_carries_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TVCACHE_SECRET", "leaked")
    (env, set_state, read_state), folder = run_folder(
        tmp_path,
        sh('echo "$HOME|$PWD|${TVCACHE_SECRET-unset}|$TZ|$LANG|$PATH"'),
        sh("export CARRIED=1; cd items"),
        sh('echo "${CARRIED-unset} $(basename "$PWD")"'),
    )
    assert env.output == f"{folder}|{folder}|unset|UTC|C.UTF-8|/usr/local/bin:/usr/bin:/bin\n"
    assert set_state.changed_state is False
    assert read_state.output == f"unset {folder.name}\n"


def test_folder_exit_codes_and_output(tmp_path: Path) -> None:
    (ok, failed, stderr), _ = run_folder(tmp_path, sh("cat notes.txt"), sh("echo -n partial; exit 3"), sh("ls nope"))
    assert ok == Outcome(output="line one\nline two\n", changed_state=False)
    assert failed.output == "partial\n[exit code 3]"
    assert failed.is_error
    assert "No such file or directory" in stderr.output
    assert stderr.output.endswith("[exit code 2]")


def test_folder_output_is_capped(tmp_path: Path) -> None:
    (outcome,), _ = run_folder(tmp_path, sh("head -c 5000 /dev/zero | tr '\\0' a"), max_output_bytes=100)
    assert outcome.output == "a" * 100 + "\n[output truncated: first 100 of 5000 bytes shown]"
    assert not outcome.is_error


def test_folder_digest_sees_touch_and_ignores_reads(tmp_path: Path) -> None:
    (read, touch, chmod, link), _ = run_folder(
        tmp_path, sh("cat items/apple"), sh("touch notes.txt"), sh("chmod +x notes.txt"), sh("ln -sf items other")
    )
    assert read.changed_state is False
    assert touch.changed_state is True
    assert chmod.changed_state is True
    assert link.changed_state is True


def test_folder_symlinks_and_mtimes_survive_start_and_fork(tmp_path: Path) -> None:
    template = make_template(tmp_path / "template")
    os.utime(template / "notes.txt", ns=(1, 1_000_000_123))

    async def main() -> None:
        factory = FolderSandbox.factory(template)
        sandbox = await factory.start()
        assert isinstance(sandbox, FolderSandbox)
        assert (sandbox.folder / "link").readlink() == Path("notes.txt")
        assert (sandbox.folder / "notes.txt").stat().st_mtime_ns == 1_000_000_123
        fork = await factory.fork(await sandbox.snapshot(tmp_path / "snap"))
        assert isinstance(fork, FolderSandbox)
        assert (fork.folder / "link").is_symlink()
        assert (fork.folder / "notes.txt").stat().st_mtime_ns == 1_000_000_123
        await sandbox.stop()
        await fork.stop()

    run(main())


def count_lines(folder: Path, path: str) -> str:
    """Count the lines of a file."""
    return str(len((folder / path).read_text().splitlines()))


def append_line(folder: Path, path: str, line: str) -> str:
    with (folder / path).open("a") as file:
        file.write(line + "\n")
    return "appended"


def test_folder_python_tools(tmp_path: Path) -> None:
    tools = {
        "count_lines": FolderTool.wrap(count_lines, read_only=True, arguments={"path": str}),
        "append": FolderTool.wrap(append_line, name="append", arguments={"path": str, "line": str}),
    }
    assert tools["count_lines"].spec.description == "Count the lines of a file."
    (count, missing, append, recount), _ = run_folder(
        tmp_path,
        ToolCall("count_lines", {"path": "notes.txt"}),
        ToolCall("count_lines", {"path": "nope.txt"}),
        ToolCall("append", {"path": "notes.txt", "line": "three"}),
        ToolCall("count_lines", {"path": "notes.txt"}),
        tools=tools,
    )
    assert count == Outcome(output="2", changed_state=False)
    assert missing.is_error
    assert missing.output.startswith("Error: FileNotFoundError: ")
    assert append == Outcome(output="appended", changed_state=True)
    assert recount.output == "3"
    with pytest.raises(InvalidToolCall, match="missing required"):
        run_folder(tmp_path / "again", ToolCall("append", {"path": "x"}), tools=tools)


def test_folder_without_proof_cannot_tell(tmp_path: Path) -> None:
    (outcome,), _ = run_folder(tmp_path, sh("cat notes.txt"), prove_read_only=False)
    assert outcome.changed_state is None


def test_folder_factory_validation(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="not a directory"):
        FolderSandbox.factory(tmp_path / "missing")
    template = make_template(tmp_path / "template")
    with pytest.raises(ValueError, match="built-in"):
        FolderSandbox.factory(template, tools={"sh": FolderTool.wrap(count_lines, name="sh")})
    with pytest.raises(ValueError, match="spec is named"):
        FolderSandbox.factory(template, tools={"other": FolderTool.wrap(count_lines)})


def test_folder_leaves_nothing_behind(tmp_path: Path) -> None:
    template = make_template(tmp_path / "template")

    async def main() -> None:
        factory = FolderSandbox.factory(template)
        assert isinstance(factory, FolderSandboxFactory)
        root = factory.root
        one, two = await factory.start(), await factory.start()
        await one.execute(sh("mkdir -p deep/er && touch deep/er/file && chmod a-w deep/er"))
        assert len(list(root.iterdir())) == 2
        await one.stop()
        await two.stop()
        assert list(root.iterdir()) == []
        factory.close()
        assert not root.exists()
        with pytest.raises(SandboxError, match="closed"):
            await factory.start()

    run(main())


def test_cancelled_calls_stop_their_work_and_leave_the_sandbox_usable(tmp_path: Path) -> None:
    async def main() -> None:
        database = await SQLiteSandbox.factory(make_database(tmp_path / "db")).start()
        endless = "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT count(*) FROM r"
        started = time.perf_counter()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(database.execute(sql(endless)), 0.2)
        assert time.perf_counter() - started < 5  # interrupted, not run to the end
        assert (await database.execute(sql("SELECT count(*) FROM items"))).output == "count(*)\n2"
        await database.stop()

        folder = await FolderSandbox.factory(make_template(tmp_path / "template")).start()
        assert isinstance(folder, FolderSandbox)
        started = time.perf_counter()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(folder.execute(sh("echo $$ > pid; exec sleep 30")), 0.3)
        assert time.perf_counter() - started < 5
        assert process_gone(int((folder.folder / "pid").read_text()))
        assert (await folder.execute(sh("echo still here"))).output == "still here\n"
        await folder.stop()

    run(main())


def test_folder_copies_keep_hard_links_so_forks_behave_like_the_original(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    factory = FolderSandbox.factory(base)

    async def main() -> tuple[str, str]:
        live = await factory.start()
        await live.execute(ToolCall("sh", {"cmd": "echo a > f && ln f g"}))
        snapshot = await live.snapshot(tmp_path / "snap")
        fork = await factory.fork(snapshot)
        after = ToolCall("sh", {"cmd": "echo b >> f && cat g && stat -c %h g"})
        outputs = (await live.execute(after)).output, (await fork.execute(after)).output
        await live.stop()
        await fork.stop()
        return outputs

    assert asyncio.run(main()) == ("a\nb\n2\n", "a\nb\n2\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give files to other users")
def test_folder_copies_keep_owners_as_root_so_forks_show_what_their_sandbox_showed(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    factory = FolderSandbox.factory(base)
    make = (
        "mkdir d && echo x > d/f && ln d/f d/g && ln -s f d/link && cp /bin/true tool"
        " && chown 4242:4243 d/f && chown 4244:4245 d && chown -h 4246:4247 d/link"
        " && chown 4248:4249 tool && chmod 6755 tool"
        " && python3 -c \"import os; os.setxattr('d/f', 'user.k', b'v')\""
    )
    look = ToolCall("sh", {"cmd": "stat -c '%n %u:%g %a %h' . d d/f d/g d/link tool"})

    async def main() -> tuple[str, str, bool]:
        live = await factory.start()
        assert not (await live.execute(ToolCall("sh", {"cmd": make}))).is_error
        fork = await factory.fork(await live.snapshot(tmp_path / "snap"))
        assert isinstance(fork, FolderSandbox)
        outputs = (await live.execute(look)).output, (await fork.execute(look)).output
        kept = os.getxattr(fork.folder / "d" / "f", "user.k") == b"v"
        await live.stop()
        await fork.stop()
        return outputs[0], outputs[1], kept

    live, fork, kept = asyncio.run(main())
    assert "d/f 4242:4243 644 2" in live
    assert "tool 4248:4249 6755 1" in live
    assert fork == live  # owners, setuid and setgid bits (chown clears them) and hard links
    assert kept  # and extended attributes
