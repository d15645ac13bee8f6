"""kill -9 of a `tvcache serve` process under write load: every insert that got a 2xx is there after restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from server_support import free_port, wait_until


def start_server(data_dir: Path, port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tvcache.cli", "serve", "--port", str(port), "--data-dir", str(data_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    def healthy() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"server exited: {process.stderr.read().decode() if process.stderr else ''}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout=20, interval=0.02)
    return process


def test_kill_9_under_write_load_loses_no_acknowledged_insert(tmp_path: Path) -> None:
    data = tmp_path / "data"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(data, port)
    acked: dict[str, list[tuple[int, int, str]]] = {}
    lock = threading.Lock()
    total = [0]

    def writer(task: str) -> None:
        acks = acked.setdefault(task, [])
        parent = 0
        with httpx.Client(base_url=url, timeout=5) as client:
            for step in range(100_000):
                output = f"{task}:{step}:" + "x" * (step % 200)
                body = {"task_id": task, "parent": parent, "call": {"name": "sh", "arguments": {"step": step}},
                        "output": output, "seconds": 0.01}  # fmt: skip
                try:
                    response = client.post("/v1/insert", json=body)
                except httpx.HTTPError:
                    return  # the server is gone
                if response.status_code != 200:
                    return
                node = response.json()["node"]
                acks.append((parent, node["id"], output))
                parent = node["id"] if step % 3 else 0  # chains and branches
                with lock:
                    total[0] += 1

    writers = [threading.Thread(target=writer, args=(f"task-{index}",)) for index in range(4)]
    try:
        for thread in writers:
            thread.start()
        wait_until(lambda: total[0] >= 600, timeout=30)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        for thread in writers:
            thread.join(30)
        assert total[0] >= 600
        server = start_server(data, port)
        with httpx.Client(base_url=url, timeout=10) as client:
            for task, acks in acked.items():
                nodes = {n["id"]: n for n in client.get("/v1/graph", params={"task_id": task}).json()["nodes"]}
                for parent, node_id, output in acks:
                    assert nodes[node_id]["output"] == output
                    assert nodes[node_id]["parent"] == parent
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            server.wait(10)
