"""Shared helpers of the MCP-upstream tests: the fixture server, the real third-party servers, bounded waits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cacherouter.tools.upstreams import UpstreamConfig

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).with_name("mcp_fixture_server.py")
BIN = Path(sys.executable).parent

ECHO = {
    "name": "echo",
    "description": "Echo a text back, with a picture.",
    "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
}


def tool(name: str, description: str = "", **schema: Any) -> dict[str, Any]:
    return {
        "name": name,
        "description": description or f"The {name} tool.",
        "inputSchema": {"type": "object", **schema},
    }


def fixture(tmp_path: Path, name: str, tools: list[Any], *extra: str, **options: Any) -> tuple[UpstreamConfig, Path]:
    """An upstream config for the fixture server and the tools file it lists (edit it, then call ``notify``)."""
    tools_file = tmp_path / f"{name}-tools.json"
    tools_file.write_text(json.dumps(tools))
    args = (str(FIXTURE), "--tools", str(tools_file), "--pidfile", str(tmp_path / f"{name}.pids"), *extra)
    options.setdefault("timeout", 5.0)
    return UpstreamConfig(name=name, command=sys.executable, args=args, **options), tools_file


def pids(tmp_path: Path, name: str) -> list[int]:
    path = tmp_path / f"{name}.pids"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too: it only waits to be reaped
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_until(condition: Callable[[], Any], *, timeout: float = 10.0, what: str = "the condition") -> Any:
    """Poll ``condition`` until it is true, for at most ``timeout`` seconds (a bounded wait, not a sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def install_npm_servers() -> Path:
    """The npm MCP servers scripts/install-mcp-servers.sh pins, installed once (the tests skip without node/npm)."""
    missing = [t for t in ("node", "npm") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: the npm MCP servers cannot run")
    script = ROOT / "scripts" / "install-mcp-servers.sh"
    done = subprocess.run([str(script)], capture_output=True, text=True, timeout=600, check=False)
    if done.returncode == 3:
        pytest.skip(done.stderr.strip())
    if done.returncode != 0:
        pytest.fail(f"{script} failed (exit {done.returncode}):\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1])


def npm_entry(servers: Path, name: str) -> str:
    return str(servers / "node_modules" / "@modelcontextprotocol" / f"server-{name}" / "dist" / "index.js")


def pypi_server(name: str) -> str:
    """A PyPI MCP server the project's dev extra installs (pyproject.toml) into this venv."""
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is not installed in {BIN}: run `make setup` (it is in the dev extra)")
    return str(path)


def git_repository(path: Path) -> Path:
    """A git repository with two commits whose hashes are the same on every run (fixed author and dates)."""
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "Ada",
        "GIT_AUTHOR_EMAIL": "ada@example.org",
        "GIT_COMMITTER_NAME": "Ada",
        "GIT_COMMITTER_EMAIL": "ada@example.org",
        "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
        "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
    }
    path.mkdir(parents=True)

    def git(*args: str) -> None:
        subprocess.run(
            ["git", "-c", "init.defaultBranch=main", *args], cwd=path, env=env, check=True, capture_output=True
        )

    git("init", "-q")
    (path / "README.md").write_text("# demo\n")
    git("add", "README.md")
    git("commit", "-q", "-m", "first commit")
    (path / "notes.txt").write_text("second\n")
    git("add", "notes.txt")
    git("commit", "-q", "-m", "add notes")
    return path
