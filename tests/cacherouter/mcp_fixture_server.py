"""A small MCP server over stdio (2025-11-25 handshake era), written on the wire with the standard library only.

Not a mock of the SDK: a real server process that speaks JSON-RPC on stdin/stdout, so the tests can make it do
what real servers do when they misbehave, which an SDK-built server would refuse to: list a tool twice or with a
broken schema, never answer ``initialize``, send ``list_changed`` in a storm, exit in the middle of a call.

    python mcp_fixture_server.py --tools TOOLS.json [--never-initialize] [--pidfile PATH] [--once MARKER]
        [--slow-exit SECONDS] [--slow-initialize SECONDS [--slow-marker PATH]]

TOOLS.json holds the ``tools`` array, read again at every ``tools/list`` (a test edits it, then calls
``notify``). Calls, whatever is listed: ``echo`` (text + image content, structured content, an extra field),
``fail`` (``isError``), ``crash`` (exits without answering), ``sleep`` (``seconds``; a hung call when long),
``notify`` (one ``list_changed``), ``storm`` (``count`` of them, then the answer), ``stderr`` (writes ``lines``
to stderr). ``--slow-exit`` makes it a server that is slow to go: it ignores SIGTERM and, once its stdin has
closed, lingers that many seconds before it exits. ``--slow-initialize`` answers ``initialize`` that late (with
``--slow-marker``, only in the first start, the one that creates PATH: a server slow to start the first time).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

PIXEL = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


def send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def list_changed() -> None:
    send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})


def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    if name == "echo":
        return {
            "content": [
                {"type": "text", "text": f"echo: {arguments.get('text', '')}"},
                {"type": "image", "data": PIXEL, "mimeType": "image/png"},
            ],
            "structuredContent": {"echoed": arguments},
            "isError": False,
            "_meta": {"fixture/served-by": "mcp_fixture_server"},
        }
    if name == "fail":
        return {"content": [{"type": "text", "text": "the fixture failed on purpose"}], "isError": True}
    if name == "crash":
        os._exit(3)
    if name == "sleep":
        time.sleep(float(arguments.get("seconds", 60)))
        return {"content": [{"type": "text", "text": "slept"}]}
    if name == "stderr":
        for line in arguments.get("lines", []):
            sys.stderr.write(f"{line}\n")
        sys.stderr.flush()
        return {"content": [{"type": "text", "text": "written"}]}
    if name == "notify":
        list_changed()
        return {"content": [{"type": "text", "text": "notified"}]}
    if name == "storm":
        for _ in range(int(arguments.get("count", 1000))):
            list_changed()
        return {"content": [{"type": "text", "text": "stormed"}]}
    return {"content": [{"type": "text", "text": f"unknown tool {name}"}], "isError": True}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tools", required=True)
    parser.add_argument("--never-initialize", action="store_true")
    parser.add_argument("--pidfile")
    parser.add_argument("--once", metavar="MARKER", help="serve once: exit at start if MARKER exists, else create it")
    parser.add_argument("--slow-exit", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--slow-initialize", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--slow-marker", metavar="PATH")
    args = parser.parse_args()
    if args.slow_marker:
        if Path(args.slow_marker).exists():
            args.slow_initialize = 0.0
        Path(args.slow_marker).touch()
    if args.slow_exit:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.once:
        if Path(args.once).exists():
            sys.exit("this fixture server serves only once")
        Path(args.once).touch()
    if args.pidfile:
        with Path(args.pidfile).open("a") as pids:  # one line per start: a restart adds its own
            pids.write(f"{os.getpid()}\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        method, ident = message.get("method"), message.get("id")
        if ident is None:  # a notification (initialized, cancelled): nothing to answer
            continue
        if args.never_initialize:
            continue  # reads everything, answers nothing
        if method == "initialize":
            time.sleep(args.slow_initialize)
            result: dict[str, Any] = {
                "protocolVersion": "2025-11-25",
                "capabilities": {"tools": {"listChanged": True}},
                "serverInfo": {"name": "fixture", "version": "1.0"},
                "instructions": "A fixture server for cacherouter's tests.",
            }
        elif method == "tools/list":
            result = {"tools": json.loads(Path(args.tools).read_text())}
        elif method == "tools/call":
            params = message.get("params") or {}
            result = call(params.get("name", ""), params.get("arguments") or {})
        elif method == "ping":
            result = {}
        else:
            send({"jsonrpc": "2.0", "id": ident, "error": {"code": -32601, "message": f"no method {method}"}})
            continue
        send({"jsonrpc": "2.0", "id": ident, "result": result})
    time.sleep(args.slow_exit)  # stdin closed: a slow server takes its time (SIGTERM does not hurry it)


if __name__ == "__main__":
    main()
