"""The `tvcache serve` and `tvcache bench server` commands, as a user runs them."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from test_server_durability import free_port
from tvcache import ShardedCache
from tvcache.cli import main

from kvstore import KVFactory
from server_support import wait_until


def test_serve_help_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for option in ("--host", "--port", "--data-dir", "--token", "--shards"):
        assert option in text
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert "--token" in capsys.readouterr().err


def test_serve_shards_starts_n_processes_and_stops_them(tmp_path: Path) -> None:
    while True:  # two consecutive free ports
        port = free_port()
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
            break
        except OSError:
            continue
    env = {**os.environ, "TVCACHE_TOKEN": "tok"}
    TASKS = 40
    command = [sys.executable, "-m", "tvcache.cli", "serve", "--shards", "2", "--port", str(port)]
    process = subprocess.Popen([*command, "--data-dir", str(tmp_path)], env=env, stderr=subprocess.PIPE)
    urls = [f"http://127.0.0.1:{port + index}" for index in range(2)]

    def up() -> bool:
        try:
            return all(httpx.get(f"{url}/healthz", timeout=1).status_code == 200 for url in urls)
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, timeout=30, interval=0.05)
        with ShardedCache(urls, token="tok") as cache:
            factory = KVFactory()
            for index in range(TASKS):

                async def rollout(task: str = f"task-{index}") -> None:
                    async with cache.session(task, sandbox=factory) as session:
                        await session.call("set", {"key": "a", "value": 1})

                asyncio.run(rollout())
            sizes = [stats["tasks"] for stats in cache.server_stats().values()]
        assert sum(sizes) == TASKS
        assert min(sizes) > 0  # each shard got some (all on one: 2 in 2**TASKS, for a random port's hash)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0 or process.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-0", "shard-1"]
    assert not up()


def test_bench_server_runs_and_prints_percentiles(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    report = tmp_path / "bench.json"
    assert main(["bench", "server", "--rates", "100", "--duration", "0.3", "--keys", "64", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"GET /get\s+100 req/s\s+achieved\s+\d+\s+p50\s+[\d.]+ ms\s+p95", out)
    assert "POST /v1/lookup" in out
    assert "ratios" in out
    assert report.exists()


@pytest.mark.parametrize(
    ("blocked", "statement"),
    [("starlette", "import tvcache.server"), ("httpx", "tvcache.RemoteCache")],
)
def test_without_the_server_extra_the_core_imports_and_the_error_names_the_extra(blocked: str, statement: str) -> None:
    code = (
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "import tvcache\n"
        "assert not [m for m in ('httpx', 'starlette', 'uvicorn', 'pydantic') if sys.modules.get(m)]\n"
        "try:\n"
        f"    {statement}\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "pip install 'tvcache[server]'" in result.stdout
