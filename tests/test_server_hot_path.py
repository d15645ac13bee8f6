"""The hot path (``tvcache.server.hot``): ``GET /get`` and ``POST /v1/lookup`` answered from the HTTP parser put
the same bytes on the wire as the app answering them, and whatever the hot path does not plainly own reaches the
app, which answers it as before.

Two real servers share one app: one with the hot path (as ``tvcache serve`` runs), one without. Every request goes
to both over a plain socket and the answers are compared byte for byte (the ``date`` header aside); a counting
layer in front of the app's own stack tells which requests reached it."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import pytest

from tvcache.server import CacheService, ServerSettings, create_app
from tvcache.server.app import Guard
from tvcache.server.hot import MAX_HOT_BODY
from tvcache.server.runner import AppThread
from tvcache.server.wire import WIRE_TOOL

TOKEN = "s3cret"
MAX_QUERY = 4096


class Counting:
    """An ASGI layer counting the HTTP requests that reach the app behind it."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.calls = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.calls += 1
        await self.app(scope, receive, send)


@dataclass
class Servers:
    hot: AppThread
    cold: AppThread
    reached: Counting
    instance: str


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    service = CacheService()
    app = create_app(service, ServerSettings(token=TOKEN, max_query_bytes=MAX_QUERY))
    assert isinstance(app, Guard)
    assert app.hot is not None
    reached = Counting(app.app)
    app.app = reached
    hot = AppThread(app, max_query_bytes=MAX_QUERY)
    cold = AppThread(app, max_query_bytes=MAX_QUERY, hot_path=False)
    with hot, cold:
        put = {"task_name": "t", "history": ["a", "b"], "values": ["x", {"é": [1, 2.5, None]}],
               "tool_exec_times": [1.0, 2.0], "env_id": "env-1"}  # fmt: skip
        body = json.dumps(put).encode()
        answers = exchange(hot.port, request("PUT", "/put", body=body))
        assert answers[0].startswith(b"HTTP/1.1 200"), answers
        put = {"task_name": "t", "history": ["ключ ✓"], "values": ["naïve"]}
        exchange(hot.port, request("PUT", "/put", body=json.dumps(put).encode()))
        yield Servers(hot=hot, cold=cold, reached=reached, instance=service.instance)
    service.close()


def request(method: str, target: str, *, body: bytes | None = None, headers: str = "", auth: bool = True,
            version: str = "1.1") -> bytes:  # fmt: skip
    head = f"{method} {target} HTTP/{version}\r\nHost: t\r\n"
    if auth:
        head += f"Authorization: Bearer {TOKEN}\r\n"
    head += headers
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + (body or b"")


def exchange(port: int, data: bytes, answers: int = 1) -> list[bytes]:
    """Send ``data`` (one request or several, pipelined) on a new connection; read ``answers`` whole responses
    (fewer if the server closes first; an answer to HEAD has no body, whatever its content-length says)."""
    head_only = data.startswith(b"HEAD ")
    out: list[bytes] = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        buffer = b""
        while len(out) < answers:
            end = buffer.find(b"\r\n\r\n")
            if end >= 0:
                match = re.search(rb"\r\ncontent-length: (\d+)", buffer[:end])
                size = end + 4 + (int(match.group(1)) if match and not head_only else 0)
                if len(buffer) >= size:
                    out.append(buffer[:size])
                    buffer = buffer[size:]
                    continue
            chunk = sock.recv(65536)
            if not chunk:
                break
            buffer += chunk
    return out


def masked(response: bytes) -> bytes:
    return re.sub(rb"\r\ndate: [^\r]*", b"\r\ndate: -", response)


def wire_get(task: str, *calls: str, **extra: str) -> str:
    pairs = [("task_name", task), *(("tool_calls", call) for call in calls), *extra.items()]
    return "/get?" + urlencode(pairs)


def lookup_body(task: str, *calls: str) -> bytes:
    history = [{"name": WIRE_TOOL, "arguments": {"call": call}} for call in calls]
    return json.dumps({"task_id": task, "history": history}).encode()


HOT_CASES = {
    "a hit": request("GET", wire_get("t", "a", "b")),
    "a hit on a prefix": request("GET", wire_get("t", "a")),
    "a miss": request("GET", wire_get("t", "a", "c")),
    "an unknown task": request("GET", wire_get("nobody", "a")),
    "utf-8 keys and values": request("GET", wire_get("t", "ключ ✓")),
    "no tool_calls (400)": request("GET", "/get?task_name=t"),
    "task_name twice (400)": request("GET", "/get?task_name=t&task_name=u&tool_calls=a"),
    "no task_name (400)": request("GET", "/get?tool_calls=a"),
    "an agreeing X-Task-Name": request("GET", wire_get("t", "a"), headers="X-Task-Name: t\r\n"),
    "a disagreeing X-Task-Name (400)": request("GET", wire_get("t", "a"), headers="X-Task-Name: u\r\n"),
    "the admin X-Task-Name": request("GET", wire_get("t", "a"), headers="X-Task-Name: __admin__\r\n"),
    "two X-Task-Names (the first counts)": request(
        "GET", wire_get("t", "a"), headers="X-Task-Name: u\r\nX-Task-Name: t\r\n"
    ),
    "requests' Connection: keep-alive": request("GET", wire_get("t", "a"), headers="Connection: keep-alive\r\n"),
    "an escaped path-free query": request("GET", "/get?task_name=t&tool_calls=" + quote("a", safe="")),
    "a query at the limit": request("GET", "/get?task_name=t&tool_calls=" + "x" * (MAX_QUERY - 30)),
    "a native hit": request("POST", "/v1/lookup", body=lookup_body("t", "a", "b")),
    "a native miss": request("POST", "/v1/lookup", body=lookup_body("t", "b")),
    "a native body that is not JSON (422)": request("POST", "/v1/lookup", body=b"{nope"),
    "a native body of the wrong shape (422)": request("POST", "/v1/lookup", body=b'{"task_id": 3}'),
    "a native empty body (422)": request("POST", "/v1/lookup", body=b""),
}

APP_CASES = {
    "no token (401)": request("GET", wire_get("t", "a"), auth=False),
    "a wrong token (401)": request("GET", wire_get("t", "a"), auth=False, headers="Authorization: Bearer no\r\n"),
    "a query over the limit (414)": request("GET", "/get?task_name=t&tool_calls=" + "x" * MAX_QUERY),
    "another instance's ids (409)": request("GET", wire_get("t", "a"), headers="X-TVCache-Instance: 0123\r\n"),
    "Connection: close": request("GET", wire_get("t", "a"), headers="Connection: close\r\n"),
    "HTTP/1.0": request("GET", wire_get("t", "a"), version="1.0"),
    "a GET with a body": request("GET", wire_get("t", "a"), body=b"{}"),
    "HEAD": request("HEAD", wire_get("t", "a")),
    "a trailing slash": request("GET", "/get/?task_name=t&tool_calls=a"),
    "a native body over the hot size": request("POST", "/v1/lookup", body=lookup_body("t", "a", "y" * MAX_HOT_BODY)),
    "a chunked native body": (
        f"POST /v1/lookup HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    + b"%x\r\n%s\r\n0\r\n\r\n" % (len(lookup_body("t", "a")), lookup_body("t", "a")),
    "Expect: 100-continue": request(
        "POST", "/v1/lookup", body=lookup_body("t", "a"), headers="Expect: 100-continue\r\n"
    ),
    "another route": request("GET", "/v1/stats"),
}


def answered_both_ways(servers: Servers, data: bytes) -> tuple[bytes, bytes, int, int]:
    """The hot server's answer, the app-only server's, and how many requests reached the app each time."""
    before = servers.reached.calls
    (hot,) = exchange(servers.hot.port, data)
    hot_reached = servers.reached.calls - before
    (cold,) = exchange(servers.cold.port, data)
    return hot, cold, hot_reached, servers.reached.calls - before - hot_reached


@pytest.mark.parametrize("case", sorted(HOT_CASES))
def test_a_hot_request_is_answered_without_the_app_in_the_same_bytes(servers: Servers, case: str) -> None:
    hot, cold, hot_reached, cold_reached = answered_both_ways(servers, HOT_CASES[case])
    assert (hot_reached, cold_reached) == (0, 1)
    assert masked(hot) == masked(cold)
    assert f"\r\nx-tvcache-instance: {servers.instance}\r\n".encode() in hot


@pytest.mark.parametrize("case", sorted(APP_CASES))
def test_what_the_hot_path_does_not_own_is_answered_as_before(servers: Servers, case: str) -> None:
    """As before: by the app, or by the ``Guard`` in front of it (a missing token, an oversized query)."""
    hot, cold, hot_reached, cold_reached = answered_both_ways(servers, APP_CASES[case])
    assert hot_reached == cold_reached
    if case == "another route":  # its counters move with every request: compared by shape
        assert hot.startswith(b"HTTP/1.1 200")
        assert cold.startswith(b"HTTP/1.1 200")
        return
    assert masked(hot) == masked(cold)


def test_the_values_served_are_the_values_put(servers: Servers) -> None:
    (hit,) = exchange(servers.hot.port, HOT_CASES["a hit"])
    body = json.loads(hit.partition(b"\r\n\r\n")[2])
    assert body == {"found": True, "env_id": "env-1", "value": {"é": [1, 2.5, None]}, "tool_exec_time": 2.0}
    (native,) = exchange(servers.hot.port, HOT_CASES["a native hit"])
    node = json.loads(native.partition(b"\r\n\r\n")[2])["node"]
    assert json.loads(node["output"]) == {"é": [1, 2.5, None]}


def test_pipelined_requests_are_answered_in_order_whichever_path_takes_them(servers: Servers) -> None:
    stats = request("GET", "/v1/stats")
    hit, miss = HOT_CASES["a hit"], HOT_CASES["a miss"]
    before = servers.reached.calls
    answers = exchange(servers.hot.port, hit + stats + miss + hit, answers=4)
    # The first is answered at once; /v1/stats goes to the app, and what was pipelined behind it waits its turn
    # there, so the answers leave in order.
    assert servers.reached.calls - before == 3
    bodies = [json.loads(answer.partition(b"\r\n\r\n")[2]) for answer in answers]
    assert [body.get("found") for body in bodies] == [True, None, False, True]
    assert "lookups" in bodies[1]


def test_the_status_counts_and_latency_histogram_count_hot_answers(servers: Servers) -> None:
    def metrics() -> str:
        (answer,) = exchange(servers.hot.port, request("GET", "/metrics"))
        return answer.partition(b"\r\n\r\n")[2].decode()

    def count(text: str, pattern: str, *, absent: int | None = None) -> int:
        match = re.search(pattern, text)
        if match is None and absent is not None:  # a status no request got yet has no counter
            return absent
        assert match is not None, pattern
        return int(match.group(1))

    before = metrics()
    for _ in range(3):
        exchange(servers.hot.port, HOT_CASES["a hit"])
    exchange(servers.hot.port, HOT_CASES["no tool_calls (400)"])
    after = metrics()
    ok = r'tvcache_http_requests_total\{status="200"\} (\d+)'
    bad = r'tvcache_http_requests_total\{status="400"\} (\d+)'
    timed = r'tvcache_lookup_seconds_count\{route="/get"\} (\d+)'
    assert count(after, ok) - count(before, ok, absent=0) == 3 + 1  # three hits and the /metrics read in between
    assert count(after, bad) - count(before, bad, absent=0) == 1
    assert count(after, timed) - count(before, timed, absent=0) == 3
