"""Running the server: one process on uvicorn (uvloop + httptools when installed), N shard processes, or a
background thread for tests and embedding."""

from __future__ import annotations

import gc
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import uvicorn
from starlette.types import ASGIApp

from ..errors import InvalidInput
from ..policies import Budget
from .app import ServerSettings, create_app
from .service import CacheService

__all__ = ["AppThread", "ServerThread", "is_loopback", "serve", "serve_shards"]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_token(host: str, token: str | None) -> None:
    if token is None and not is_loopback(host):
        raise InvalidInput(
            f"binding {host} exposes the cache beyond this machine: pass --token (or set TVCACHE_TOKEN); "
            "clients then send 'Authorization: Bearer <token>'"
        )


def _config(app: Any, **kwargs: Any) -> uvicorn.Config:
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    try:
        import httptools  # noqa: F401

        http = "httptools"
    except ImportError:
        http = "h11"
    # Clients (rollout workers) keep connections open between bursts of calls: do not drop them after 5 s idle.
    return uvicorn.Config(
        app, loop=loop, http=http, access_log=False, log_level="warning", timeout_keep_alive=75, **kwargs
    )


def serve(
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    data_dir: str | Path | None = None,
    token: str | None = None,
    budget: Budget | None = None,
    fsync: bool = False,
    claim_ttl: float = 30.0,
    lease_ttl: float = 600.0,
    max_body_bytes: int = 16 * 1024 * 1024,
) -> None:
    """Serve until SIGINT/SIGTERM. Refuses a non-loopback ``host`` without a token."""
    check_token(host, token)
    service = CacheService(data_dir, budget=budget, fsync=fsync, claim_ttl=claim_ttl, lease_ttl=lease_ttl)
    tune_gc()
    try:
        app = create_app(service, ServerSettings(token=token, max_body_bytes=max_body_bytes))
        server = uvicorn.Server(_config(app, host=host, port=port))
        where = "memory (nothing survives a restart)" if data_dir is None else str(data_dir)
        print(f"tvcache serve: http://{host}:{port} data: {where}", file=sys.stderr, flush=True)
        server.run()
    finally:
        service.close()


def tune_gc() -> None:
    """Graph nodes live as long as the server and are never garbage: keep the collector off them.

    Objects loaded from the journal are frozen out of collection, and young collections run less often, so a
    full collection over a large graph (tens of ms) does not stall requests; measured by ``tvcache bench server``.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def serve_shards(shards: int, *, host: str, port: int, data_dir: str | Path | None, argv: Sequence[str]) -> int:
    """Start ``shards`` server processes on consecutive ports (data in ``data_dir/shard-<i>``); wait for them."""
    children: list[subprocess.Popen[bytes]] = []
    urls = []
    for index in range(shards):
        args = [sys.executable, "-m", "tvcache.cli", "serve", "--host", host, "--port", str(port + index), *argv]
        if data_dir is not None:
            args += ["--data-dir", str(Path(data_dir) / f"shard-{index}")]
        children.append(subprocess.Popen(args))
        urls.append(f"http://{host}:{port + index}")
    print("tvcache serve: shards " + " ".join(urls), file=sys.stderr, flush=True)

    def stop(signum: int, frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    for child in children:
        code = max(code, child.wait())
    return code


class AppThread:
    """Any ASGI ``app`` on 127.0.0.1 in a background thread, on a free port unless ``port`` is given (tests,
    notebooks, embedding). Its URL is ``url``; ``with`` starts and stops it."""

    def __init__(self, app: ASGIApp, *, port: int = 0) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", port))
        self.port: int = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(_config(app))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def start(self, timeout: float = 10.0) -> Self:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop(timeout=1.0)
                raise RuntimeError(f"the server thread on {self.url} did not start within {timeout:g} s (see its log)")
            time.sleep(0.005)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class ServerThread(AppThread):
    """A tvcache server for ``service`` on 127.0.0.1 in a background thread, on a free port (tests, notebooks,
    embedding). Closing the service stays with the caller."""

    def __init__(self, service: CacheService, settings: ServerSettings | None = None, *, port: int = 0) -> None:
        super().__init__(create_app(service, settings), port=port)
        self.service = service


def default_token() -> str | None:
    return os.environ.get("TVCACHE_TOKEN") or None
