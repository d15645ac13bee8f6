"""Differential tests: every call answered through the cache equals fresh, uncached execution of the same
history, over hundreds of random rollouts on both real backends, interleaving writes and reads."""

from __future__ import annotations

import asyncio
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tvcache import AlwaysSnapshot, Budget, Cache, CostAwareSnapshots, NeverSnapshot, ToolCall
from tvcache.sandboxes import FolderSandbox, SQLiteSandbox

SQL = [
    "CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, body TEXT)",
    "INSERT INTO items (name, qty) VALUES ('bolt', 3)",
    "INSERT INTO items (name, qty) VALUES ('nut', 5)",
    "UPDATE items SET qty = qty + 1 WHERE name = 'bolt'",
    "DELETE FROM items WHERE qty > 5",
    "SELECT COUNT(*) FROM items",
    "SELECT name, qty FROM items ORDER BY id",
    "SELECT SUM(qty) FROM items",
    "SELECT * FROM notes",
    "INSERT INTO notes (body) VALUES ('hello')",
    "SELEC broken",
]
SHELL = [
    "cat a.txt",
    "echo x >> a.txt",
    "ls",
    "wc -l a.txt",
    "rm -f b.txt",
    "echo y > b.txt",
    "cat b.txt",
    "sed -i 's/x/z/' a.txt",
    "mkdir -p d && echo q > d/f",
    "find . -type f | sort",
    "cat missing.txt",
]


def sqlite_factory(tmp_path: Path) -> SQLiteSandbox:
    path = tmp_path / "base.sqlite"
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT, qty INTEGER)")
    connection.execute("INSERT INTO items (name, qty) VALUES ('washer', 1)")
    connection.commit()
    connection.close()
    return SQLiteSandbox.factory(path)


def folder_factory(tmp_path: Path) -> FolderSandbox:
    template = tmp_path / "template"
    template.mkdir()
    (template / "a.txt").write_text("x\n")
    return FolderSandbox.factory(template)


BACKENDS: dict[str, tuple[Any, str, str, list[str]]] = {
    "sqlite": (sqlite_factory, "sql", "query", SQL),
    "folder": (folder_factory, "sh", "cmd", SHELL),
}


async def uncached(factory: Any, calls: list[ToolCall]) -> list[str]:
    """Fresh execution of the whole history in a new sandbox: the ground truth for every prefix."""
    sandbox = await factory.start()
    try:
        return [(await sandbox.execute(call)).output for call in calls]
    finally:
        await sandbox.stop()


async def cached(cache: Cache, factory: Any, task: str, calls: list[ToolCall]) -> list[tuple[str, bool]]:
    async with cache.session(task, sandbox=factory) as session:
        results = [await session.call(call.name, call.arguments) for call in calls]
    return [(result.output, result.hit) for result in results]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("policy", ["cost-aware", "always", "never"])
def test_cached_equals_uncached_over_random_rollouts(tmp_path: Path, backend: str, policy: str) -> None:
    make, tool, argument, alphabet = BACKENDS[backend]
    factory = make(tmp_path)
    snapshots = {"cost-aware": CostAwareSnapshots(), "always": AlwaysSnapshot(), "never": NeverSnapshot()}[policy]
    cache = Cache(tmp_path / "cache", snapshot_policy=snapshots, budget=Budget(max_snapshots_per_task=6))
    rng = random.Random(f"{backend}:{policy}")
    rollouts = 120 if backend == "sqlite" else 60
    group = 4
    mismatches: list[tuple[Any, ...]] = []
    hits = calls_made = 0

    async def main() -> None:
        nonlocal hits, calls_made
        for start in range(0, rollouts, group):
            # A group of rollouts of the same task, concurrently, sharing prefixes like an RL group does.
            task = f"task-{start // group % 3}"
            stem = [rng.choice(alphabet) for _ in range(rng.randrange(0, 4))]
            histories = []
            for _ in range(group):
                tail = [rng.choice(alphabet) for _ in range(rng.randrange(1, 6))]
                histories.append([ToolCall(tool, {argument: text}) for text in stem + tail])
            through_cache = await asyncio.gather(*(cached(cache, factory, task, h) for h in histories))
            for history, answers in zip(histories, through_cache, strict=True):
                truth = await uncached(factory, history)
                for step, ((output, hit), expected) in enumerate(zip(answers, truth, strict=True)):
                    calls_made += 1
                    hits += hit
                    if output != expected:
                        mismatches.append((task, step, history[: step + 1], output, expected))

    asyncio.run(main())
    cache.check_invariants()
    stats = cache.stats()
    cache.close()
    assert mismatches == [], mismatches[:3]
    assert hits > 0
    assert calls_made >= rollouts * 2
    assert stats.audit_disagreements == 0
    assert stats.replay_divergences == 0


def test_the_papers_motivating_case_on_real_files(tmp_path: Path) -> None:
    template = tmp_path / "repo"
    template.mkdir()
    (template / "foo.py").write_text("print('old')\n")
    factory = FolderSandbox.factory(template)
    cache = Cache()
    rollout = [
        ("sh", {"cmd": "cat foo.py"}),
        ("sh", {"cmd": "sed -i s/old/new/ foo.py"}),
        ("sh", {"cmd": "cat foo.py"}),
    ]

    async def run() -> list:
        async with cache.session("fix-foo", sandbox=factory) as session:
            return [await session.call(name, args) for name, args in rollout]

    first = asyncio.run(run())
    assert [r.output for r in first] == ["print('old')\n", "", "print('new')\n"]
    assert [r.hit for r in first] == [False, False, False]  # the second cat is not served the first's result
    second = asyncio.run(run())
    assert [r.output for r in second] == [r.output for r in first]
    assert [r.hit for r in second] == [True, True, True]
    cache.close()


# Persistent shells: rollouts whose calls depend on the shell's own state, as with a terminal per rollout.
PERSISTENT_SHELL = [
    "cd sub1",
    "cd ../sub2 2>&1",
    "cd {base}",
    "pwd; echo $LINENO",
    "export CFLAGS=-O0",
    "unset CFLAGS",
    'X=$((X+1)); echo "${{CFLAGS-none}} $X"',
    "greet() {{ echo hi $1 from $PWD; }}",
    "greet you 2>&1",
    "alias ll='ls -1'",
    "ll 2>&1",
    "python3 -m venv --without-pip venv >/dev/null && source venv/bin/activate && echo ${{VIRTUAL_ENV#{base}}}",
    "deactivate 2>&1; python3 -c 'import sys; print(sys.prefix != sys.base_prefix)'",
    "echo x >> a.txt; cat a.txt",
    "cat <<EOF\nunterminated",
    "false",
    'echo "$? $_"',
    "shopt -s nullglob; set -- *.none; echo $#",
]


def persistent_shell_factory(tmp_path: Path) -> Any:
    from tvcache.sandboxes import ShellSandbox

    base = tmp_path / "proj"
    for sub in ("sub1", "sub2"):
        (base / sub).mkdir(parents=True)
        (base / sub / "main.c").write_text(f"/* {sub} */\n")
    (base / "a.txt").write_text("a\n")
    return ShellSandbox.factory(base, fallback=False, store_root=tmp_path / "layers", persistent=True)


def _overlay_supported() -> bool:
    from tvcache.sandboxes.shell.linux import overlay_supported

    return overlay_supported()


@pytest.mark.skipif(not _overlay_supported(), reason="persistent shell sandboxes need overlay mounts (root)")
@pytest.mark.parametrize("policy", ["cost-aware", "always", "never"])
def test_cached_equals_an_uncached_persistent_shell_over_random_rollouts(tmp_path: Path, policy: str) -> None:
    factory = persistent_shell_factory(tmp_path)
    alphabet = [text.format(base=factory.base) for text in PERSISTENT_SHELL]
    snapshots = {"cost-aware": CostAwareSnapshots(), "always": AlwaysSnapshot(), "never": NeverSnapshot()}[policy]
    cache = Cache(tmp_path / "cache", snapshot_policy=snapshots, budget=Budget(max_snapshots_per_task=6))
    rng = random.Random(f"persistent:{policy}")
    mismatches: list[tuple[Any, ...]] = []
    hits = calls_made = 0

    async def main() -> None:
        nonlocal hits, calls_made
        for start in range(0, 40, 4):
            task = f"task-{start // 4 % 2}"
            stem = [rng.choice(alphabet) for _ in range(rng.randrange(2, 7))]
            histories = []
            for _ in range(4):
                tail = [rng.choice(alphabet) for _ in range(rng.randrange(1, 5))]
                histories.append([ToolCall("sh", {"cmd": text}) for text in stem + tail])
            through_cache = await asyncio.gather(*(cached(cache, factory, task, h) for h in histories))
            for history, answers in zip(histories, through_cache, strict=True):
                truth = await uncached(factory, history)
                for step, ((output, hit), expected) in enumerate(zip(answers, truth, strict=True)):
                    calls_made += 1
                    hits += hit
                    if output != expected:
                        mismatches.append((task, step, history[: step + 1], output, expected))

    asyncio.run(main())
    cache.check_invariants()
    stats = cache.stats()
    findings = cache.findings
    routes = factory.route_counts()
    cache.close()
    factory.close()
    assert mismatches == [], mismatches[:3]
    assert hits > 0
    assert stats.replay_divergences == 0, [(f.call, f.cached_output, f.fresh_output) for f in findings]
    if policy == "always":
        assert routes.get("shell-state", 0) > 0
    if policy == "never":
        assert routes == {}


@pytest.mark.skipif(not _overlay_supported(), reason="persistent shell sandboxes need overlay mounts (root)")
def test_a_background_job_declines_the_snapshot_and_replay_stays_exact(tmp_path: Path) -> None:
    from tvcache.sandboxes.shell.shell_state import ShellStateRoute

    factory = persistent_shell_factory(tmp_path)
    factory.snapshot_routes = (ShellStateRoute(),)  # as without CRIU (its route: the live-process test below)
    cache = Cache(tmp_path / "cache", snapshot_policy=AlwaysSnapshot())
    stem = ["cd sub1", "export MODE=fast", "sleep 30 & echo started", "jobs", "echo $! $MODE"]
    histories = [
        [ToolCall("sh", {"cmd": text}) for text in stem + tail]
        for tail in (["pwd"], ["kill %1; wait %1; echo $?"], ["echo $$ $BASHPID; jobs -p | wc -l"], ["pwd"])
    ]

    async def main() -> list[tuple[list[tuple[str, bool]], list[str]]]:
        found = []
        for history in histories:
            found.append((await cached(cache, factory, "bg", history), await uncached(factory, history)))
        return found

    results = asyncio.run(main())
    routes = factory.route_counts()
    cache.close()
    factory.close()
    for answers, truth in results:
        assert [output for output, _ in answers] == truth
    assert results[-1][0][-1][1]  # the repeated rollout is served from the cache
    assert routes["shell-state"] >= 2
    assert routes["declined"] >= 3


# Persistent shells with live processes (the CRIU route): a background HTTP server whose answers count its hits,
# a Python REPL kept alive as a coprocess, started in one call and used in later ones; a DEBUG trap declines
# every route. Scripts live in the tree, so the commands stay short.
COUNTER_SERVER = """import http.server, os, sys
hits = 0
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global hits
        hits += 1
        body = f"{self.path} hit {hits} in {os.getcwd()}\\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
if os.fork():
    os._exit(0)  # listening already: the call that starts it returns once it can be queried
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)  # the call's pipe must see its end
server.serve_forever()
"""
GET = """import sys, urllib.request
print(urllib.request.urlopen("http://127.0.0.1:8000" + sys.argv[1], timeout=10).read().decode(), end="")
"""
REPL = """import sys
scope = {}
for line in sys.stdin:
    try:
        try:
            answer = repr(eval(line, scope))
        except SyntaxError:
            exec(line, scope)
            answer = "ok"
    except Exception as error:
        answer = type(error).__name__
    print(answer, flush=True)
"""
ASK_REPL = 'echo "LINE" >&"${{REPL[1]}}" && read -r -t 10 answer <&"${{REPL[0]}}"; echo "$answer"'
LIVE_PROCESSES = [
    "cd sub1",
    "cd {base}",
    "export MODE=fast; X=$((X+1)); echo $MODE $X",
    "python3 {base}/counter.py 8000 2>&1 | tail -1; echo started ${{PIPESTATUS[0]}}",
    "python3 {base}/get.py /a 2>&1 | tail -1",
    "python3 {base}/get.py /b 2>&1 | tail -1",
    # Until the server has ended, the shell's state moves by itself (the call would not be deterministic).
    "pkill -f counter.py; s=$?; while pkill -0 -f counter.py; do :; done; echo stopped $s",
    # `exec`: the coprocess's subshell becomes the REPL instead of forking it after the call returned. Such a late
    # fork races with the next call's own forks for the next PID, in an uncached shell as much as in a fork
    # (``jobs -l`` then shows the REPL one PID apart from one run to the next), so no PID would be exact.
    "coproc REPL {{ exec python3 -u {base}/repl.py; }} 2>&1",
    ASK_REPL.replace("LINE", "x = 40"),
    ASK_REPL.replace("LINE", "x += 1"),
    ASK_REPL.replace("LINE", "x"),
    "trap : DEBUG",
    "trap - DEBUG",
    "jobs",
]


def live_processes_factory(tmp_path: Path) -> Any:
    factory = persistent_shell_factory(tmp_path)
    for name, text in (("counter.py", COUNTER_SERVER), ("get.py", GET), ("repl.py", REPL)):
        (factory.base / name).write_text(text)
    return factory


def _criu_missing() -> str | None:
    if not _overlay_supported():
        return "persistent shell sandboxes need overlay mounts (root)"
    from tvcache.sandboxes.shell.criu import criu_unavailable_reason, find_criu

    return None if find_criu(warn=False) is not None else f"no working CRIU: {criu_unavailable_reason()} (make criu)"


@pytest.mark.skipif(_criu_missing() is not None, reason=str(_criu_missing()))
@pytest.mark.parametrize("policy", ["cost-aware", "always", "never"])
def test_cached_equals_an_uncached_persistent_shell_with_live_processes(tmp_path: Path, policy: str) -> None:
    factory = live_processes_factory(tmp_path)
    alphabet = [text.format(base=factory.base) for text in LIVE_PROCESSES]
    starters = alphabet[3], alphabet[7]  # the server, the REPL
    snapshots = {"cost-aware": CostAwareSnapshots(), "always": AlwaysSnapshot(), "never": NeverSnapshot()}[policy]
    cache = Cache(tmp_path / "cache", snapshot_policy=snapshots, budget=Budget(max_snapshots_per_task=8))
    rng = random.Random(f"live:{policy}")
    mismatches: list[tuple[Any, ...]] = []
    hits = 0

    async def main() -> None:
        nonlocal hits
        for group in range(4):
            # Most rollouts start a server or a REPL early, so that later calls depend on a live process.
            stem = [rng.choice(starters), *(rng.choice(alphabet) for _ in range(rng.randrange(1, 4)))]
            histories = []
            for _ in range(3):
                tail = [rng.choice(alphabet) for _ in range(rng.randrange(1, 4))]
                histories.append([ToolCall("sh", {"cmd": text}) for text in stem + tail])
            through_cache = await asyncio.gather(*(cached(cache, factory, f"live-{group % 2}", h) for h in histories))
            for history, answers in zip(histories, through_cache, strict=True):
                truth = await uncached(factory, history)
                for step, ((output, hit), expected) in enumerate(zip(answers, truth, strict=True)):
                    hits += hit
                    if output != expected:
                        mismatches.append((step, history[: step + 1], output, expected))

    asyncio.run(main())
    cache.check_invariants()
    stats = cache.stats()
    findings = cache.findings
    routes = factory.route_counts()
    cache.close()
    factory.close()
    assert mismatches == [], mismatches[:3]
    assert hits > 0
    assert stats.replay_divergences == 0, [(f.call, f.cached_output, f.fresh_output) for f in findings]
    assert stats.forks_failed == 0
    if policy == "always":
        assert routes.get("criu", 0) > 0, routes
        assert routes.get("shell-state", 0) > 0, routes
        assert routes.get("declined", 0) > 0, routes
    if policy == "never":
        assert routes == {}


def _tmux_missing() -> str | None:
    import shutil

    if shutil.which("tmux") is None:
        return "tmux is not installed"
    return _criu_missing()


@pytest.mark.skipif(_tmux_missing() is not None, reason=str(_tmux_missing()))
def test_a_tmux_session_through_the_cache_equals_an_uncached_one(tmp_path: Path) -> None:
    factory = persistent_shell_factory(tmp_path)
    start = "tmux new-session -d -s main -x 80 -y 24 2>&1; echo $?"
    history = [
        ToolCall("sh", {"cmd": command})
        for command in (start, "tmux send-keys -t main 'X=7; echo got $X' Enter", "tmux capture-pane -p -t main")
    ]

    async def main() -> tuple[list[str], list[tuple[str, bool]], list[tuple[str, bool]]]:
        truth = await uncached(factory, history)
        if truth[0] != "0\n":
            said = truth[0].splitlines()[0]
            pytest.skip(f"tmux cannot start in the sandbox: {said!r} (its minimal /dev has no pty devices)")
        cache = Cache(tmp_path / "cache", snapshot_policy=AlwaysSnapshot())
        try:
            first = await cached(cache, factory, "tmux", history)
            second = await cached(cache, factory, "tmux", [*history, ToolCall("sh", {"cmd": "tmux ls | wc -l"})])
        finally:
            cache.close()
        return truth, first, second

    truth, first, second = asyncio.run(main())
    routes = factory.route_counts()
    factory.close()
    assert [output for output, _ in first] == truth
    assert [output for output, _ in second[:3]] == truth
    assert second[3][0] == "1\n"
    assert routes.get("criu", 0) > 0, routes
