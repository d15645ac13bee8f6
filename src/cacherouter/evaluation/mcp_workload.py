"""The real-registry workload: a long tail assembled from the tool lists of real third-party MCP servers.

Five servers, installed from the registries by the project's setup: ``mcp-server-git`` and ``mcp-server-time``
(PyPI, the ``dev`` extra) and ``@modelcontextprotocol/server-memory``, ``server-filesystem`` and
``server-everything`` (npm, ``scripts/install-mcp-servers.sh``). Their 50 tools (with the schemas they
declare) join the evaluation repository's 12 scripts. Servers join and leave during the run (:data:`SCHEDULE`),
as they do when a user starts and stops them, and every call really goes to the server.

The 24 queries were written from the servers' own tool descriptions, before any figures were seen. They run in a
private workspace (a git repository with fixed author and dates, two text files, a memory file), reached by
relative paths so that no temporary directory name enters a request. Calls whose answers depend on the day
(``convert_time``) make the figures vary by a few tokens from day to day, never between the architectures.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import ConfigError
from ..tools.upstreams import UpstreamConfig
from .suite import Action, Query, core, routed

SERVERS = ("everything", "filesystem", "git", "memory", "time")
INITIAL = ("git", "memory", "time")
#: Query index -> the events before it: servers joining ("join:NAME") and leaving ("leave:NAME").
SCHEDULE: dict[int, tuple[str, ...]] = {
    6: ("join:filesystem",),
    12: ("join:everything",),
    16: ("leave:time",),
    20: ("join:time", "leave:memory"),
}
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "Ada",
    "GIT_AUTHOR_EMAIL": "ada@example.org",
    "GIT_COMMITTER_NAME": "Ada",
    "GIT_COMMITTER_EMAIL": "ada@example.org",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
}


def npm_servers_dir() -> Path:
    """Where scripts/install-mcp-servers.sh put the npm servers: $MCP_SERVERS_DIR, else ./.cache/mcp-servers."""
    return Path(os.environ.get("MCP_SERVERS_DIR") or Path.cwd() / ".cache" / "mcp-servers")


def _pypi(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise ConfigError(f"{name} is not installed: pip install -e '.[dev]' (it is in the dev extra)")
    return found


def upstream_configs(workspace: Path, names: tuple[str, ...]) -> tuple[UpstreamConfig, ...]:
    """The configs of servers ``names``, working in ``workspace``. Raises ConfigError when one is not installed."""
    npm = npm_servers_dir() / "node_modules" / "@modelcontextprotocol"
    node = shutil.which("node")
    out: list[UpstreamConfig] = []
    for name in sorted(names):
        cwd = str(workspace)
        args: tuple[str, ...]
        if name in ("git", "time"):
            args = ("--repository", ".") if name == "git" else ("--local-timezone", "UTC")
            out.append(UpstreamConfig(name=name, command=_pypi(f"mcp-server-{name}"), args=args, cwd=cwd))
            continue
        entry = npm / f"server-{name}" / "dist" / "index.js"
        if node is None or not entry.exists():
            raise ConfigError(
                f"the npm MCP server {name} is not installed in {npm.parent.parent}: run scripts/install-mcp-servers.sh"
            )
        args = (str(entry), ".") if name == "filesystem" else (str(entry),)
        env = (("MEMORY_FILE_PATH", str(workspace / "memory.jsonl")),) if name == "memory" else ()
        out.append(UpstreamConfig(name=name, command=node, args=args, cwd=cwd, env=env))
    return tuple(out)


def unavailable() -> str | None:
    """Why the workload cannot run here (a server or git is not installed), or None when it can."""
    if shutil.which("git") is None:
        return "git is not installed"
    try:
        upstream_configs(Path.cwd(), SERVERS)
    except ConfigError as e:
        return str(e)
    return None


def prepare_workspace(path: Path) -> Path:
    """The workspace the servers work in: a git repository with two commits and the same hashes on every run."""
    path.mkdir(parents=True)
    (path / "README.md").write_text("# Campus notes\nNotes on the BUPT campus project.\n")
    (path / "todo.txt").write_text("1. collect the weather data\n2. write the report\n")
    env = {**os.environ, **_GIT_ENV}
    for args in (
        ("init", "-q"),
        ("add", "README.md"),
        ("commit", "-q", "-m", "Start the campus notes"),
        ("add", "todo.txt"),
        ("commit", "-q", "-m", "Add the to-do list"),
    ):
        subprocess.run(
            ["git", "-c", "init.defaultBranch=main", *args], cwd=path, env=env, check=True, capture_output=True
        )
    return path


def _r(task: str, tool: str, **arguments: object) -> Action:
    return routed(task, tool, **arguments)


def _queries() -> tuple[Query, ...]:
    git, fs, mem, tm, ev = "git__git_", "filesystem__", "memory__", "time__", "everything__"
    plans: list[tuple[str, tuple[tuple[Action, ...], ...]]] = [
        # 0-5: git, memory, time (the initial servers)
        (
            "What is the git status of my working tree?",
            ((_r("show the git working tree status", f"{git}status", repo_path="."),),),
        ),
        (
            "Show the last two commits of the repository.",
            ((_r("show the git commit log, last 2 commits", f"{git}log", repo_path=".", max_count=2),),),
        ),
        (
            "Beijing weather, and remember that Beijing is hot today.",
            (
                (
                    core("weather", city="Beijing"),
                    _r(
                        "create a knowledge graph entity for Beijing with an observation",
                        f"{mem}create_entities",
                        entities=[{"name": "Beijing", "entityType": "city", "observations": ["hot today"]}],
                    ),
                ),
            ),
        ),
        (
            "What is 12:00 UTC in Tokyo?",
            (
                (
                    _r(
                        "convert the time 12:00 from timezone UTC to Asia/Tokyo",
                        f"{tm}convert_time",
                        source_timezone="UTC",
                        time="12:00",
                        target_timezone="Asia/Tokyo",
                    ),
                ),
            ),
        ),
        ("Read back everything you remember.", ((_r("read the entire knowledge graph memory", f"{mem}read_graph"),),)),
        (
            "List the local git branches.",
            ((_r("list the local git branches", f"{git}branch", repo_path=".", branch_type="local"),),),
        ),
        # 6-11: filesystem has joined
        (
            "What files are in the workspace?",
            ((_r("list the files and directories in the directory .", f"{fs}list_directory", path="."),),),
        ),
        ("Read my to-do list.", ((_r("read the text file todo.txt", f"{fs}read_text_file", path="todo.txt"),),)),
        (
            "Search rag_project1 for the campus and compare with the README.",
            (
                (core("rag_search", query="campus"),),
                (_r("read the text file README.md", f"{fs}read_text_file", path="README.md"),),
            ),
        ),
        (
            "Show the first commit's changes.",
            ((_r("show the contents of the git commit HEAD~1", f"{git}show", repo_path=".", revision="HEAD~1"),),),
        ),
        (
            "Search my memory for Beijing.",
            ((_r("search the knowledge graph nodes for Beijing", f"{mem}search_nodes", query="Beijing"),),),
        ),
        (
            "Which directories may you read?",
            ((_r("list the allowed directories the filesystem server can access", f"{fs}list_allowed_directories"),),),
        ),
        # 12-15: everything has joined
        ("Add 17 and 25.", ((_r("add two numbers 17 and 25 and return the sum", f"{ev}get-sum", a=17, b=25),),)),
        ("Echo back the word cache.", ((_r("echo back the message cache", f"{ev}echo", message="cache"),),)),
        (
            "Shanghai weather, and the git status.",
            (
                (
                    core("weather", city="Shanghai"),
                    _r("show the git working tree status", f"{git}status", repo_path="."),
                ),
            ),
        ),
        ("Give me a tiny test image.", ((_r("return a tiny test image", f"{ev}get-tiny-image"),),)),
        # 16-19: time has left
        (
            "Show me the file info of todo.txt.",
            ((_r("get detailed file information metadata for todo.txt", f"{fs}get_file_info", path="todo.txt"),),),
        ),
        (
            "Show the last commit.",
            ((_r("show the git commit log, last 1 commit", f"{git}log", repo_path=".", max_count=1),),),
        ),
        (
            "Remember that Shanghai is humid.",
            (
                (
                    _r(
                        "add observations to the knowledge graph entity Beijing: Shanghai is humid",
                        f"{mem}add_observations",
                        observations=[{"entityName": "Beijing", "contents": ["Shanghai is humid"]}],
                    ),
                ),
            ),
        ),
        ("What is the weather like in Guangzhou?", ((core("weather", city="Guangzhou"),),)),
        # 20-23: time is back, memory has left
        (
            "What is 09:30 in New York when it is 09:30 in London?",
            (
                (
                    _r(
                        "convert the time 09:30 from timezone Europe/London to America/New_York",
                        f"{tm}convert_time",
                        source_timezone="Europe/London",
                        time="09:30",
                        target_timezone="America/New_York",
                    ),
                ),
            ),
        ),
        (
            "Show the directory tree of the workspace.",
            ((_r("show a recursive directory tree of the directory .", f"{fs}directory_tree", path="."),),),
        ),
        (
            "Echo hello, then add 2 and 3.",
            (
                (_r("echo back the message hello", f"{ev}echo", message="hello"),),
                (_r("add two numbers 2 and 3 and return the sum", f"{ev}get-sum", a=2, b=3),),
            ),
        ),
        (
            "Any unstaged git changes?",
            ((_r("show the unstaged git diff of the working tree", f"{git}diff_unstaged", repo_path="."),),),
        ),
    ]
    return tuple(
        Query(
            id=f"M{i:02d}",
            experiment="mcp",
            text=text,
            rounds=rounds,
            final="Done.",
            events=SCHEDULE.get(i, ()),
        )
        for i, (text, rounds) in enumerate(plans)
    )


MCP_QUERIES: tuple[Query, ...] = _queries()
