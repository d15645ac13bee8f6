"""A TEST DOUBLE of an LLM provider for the proxy's tests: a real HTTP server on 127.0.0.1 (stdlib
``ThreadingHTTPServer``) that speaks the OpenAI chat-completions and Anthropic Messages wire formats, records every
request (body byte for byte, headers) and answers from a script instead of a model.

Only the provider is a stand-in; the proxy, its HTTP server and the SDK clients in front of it are the real ones.
Usage figures are computed the way a prefix cache would: the prompt is ``len(body) // 4`` tokens, of which the
longest byte prefix shared with any earlier request, in whole 64-byte blocks, counts as cached.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Json = dict[str, Any]


@dataclass
class Recorded:
    path: str
    raw: bytes
    headers: dict[str, str]

    @property
    def body(self) -> Json:
        return json.loads(self.raw)


@dataclass
class Reply:
    """One scripted answer: text and/or tool calls (name, arguments object), and the ids to give the calls."""

    text: str = ""
    calls: list[tuple[str, Any]] = field(default_factory=list)
    raw_bodies: bytes | None = None  # answer these exact bytes instead (pass-through tests)
    status: int = 200


Script = Callable[[str, Json, int], Reply]  # (api, body, request number) -> reply


class ProviderDouble(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, script: Script) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script = script
        self.requests: list[Recorded] = []
        self.lock = threading.Lock()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    def __enter__(self) -> ProviderDouble:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()

    def usage_for(self, raw: bytes) -> tuple[int, int]:
        """(prompt tokens, cached tokens) of a request, against every earlier one."""
        best = 0
        for earlier in self.requests[:-1]:
            common = 0
            for a, b in zip(earlier.raw, raw, strict=False):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        return len(raw) // 4, (best // 64) * 64 // 4

    def chat_requests(self) -> list[Recorded]:
        return [r for r in self.requests if r.path.endswith(("/chat/completions", "/messages"))]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ProviderDouble

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.requests.append(Recorded(self.path, b"", {k.lower(): v for k, v in self.headers.items()}))
        self._send(200, b'{"object":"list","data":[{"id":"double-1","object":"model","owned_by":"tests"}]}')

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            self.server.requests.append(Recorded(self.path, raw, {k.lower(): v for k, v in self.headers.items()}))
            number = len(self.server.requests) - 1
            prompt, cached = self.server.usage_for(raw)
        body = json.loads(raw)
        api = "anthropic" if self.path.endswith("/messages") else "openai"
        reply = self.server.script(api, body, number)
        if reply.raw_bodies is not None:
            media = "text/event-stream" if body.get("stream") else "application/json"
            self._send(reply.status, reply.raw_bodies, media)
            return
        stream = body.get("stream") is True
        if api == "openai":
            out = _openai(reply, body, number, prompt, cached, stream)
        else:
            out = _anthropic(reply, body, number, prompt, cached, stream)
        self._send(200, out, "text/event-stream" if stream else "application/json")

    def _send(self, status: int, payload: bytes, media: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", media)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _openai(reply: Reply, body: Json, number: int, prompt: int, cached: int, stream: bool) -> bytes:
    calls = [
        {"id": f"call_{number}_{i}", "type": "function", "function": {"name": name, "arguments": _dump(args)}}
        for i, (name, args) in enumerate(reply.calls)
    ]
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": 7,
        "total_tokens": prompt + 7,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    finish = "tool_calls" if calls else "stop"
    base = {"id": f"chatcmpl-{number}", "created": 1700000000 + number, "model": body.get("model", "double")}
    if not stream:
        message: Json = {"role": "assistant", "content": reply.text or None, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        completion = {**base, "object": "chat.completion", "usage": usage}
        completion["choices"] = [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}]
        return _dump(completion).encode()
    chunks: list[Json] = [{"role": "assistant", "content": ""}]
    if reply.text:
        half = len(reply.text) // 2
        chunks += [{"content": reply.text[:half]}, {"content": reply.text[half:]}]
    for i, call in enumerate(calls):
        arguments = call["function"]["arguments"]
        half = len(arguments) // 2
        first = {"index": i, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"]}}
        first["function"]["arguments"] = arguments[:half]
        chunks += [{"tool_calls": [first]}, {"tool_calls": [{"index": i, "function": {"arguments": arguments[half:]}}]}]
    events = [{**base, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d}]} for d in chunks]
    events.append(
        {**base, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
    )
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
    return "".join(f"data: {_dump(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


def _anthropic(reply: Reply, body: Json, number: int, prompt: int, cached: int, stream: bool) -> bytes:
    content: list[Json] = [{"type": "text", "text": reply.text}] if reply.text else []
    content += [
        {"type": "tool_use", "id": f"toolu_{number}_{i}", "name": name, "input": args}
        for i, (name, args) in enumerate(reply.calls)
    ]
    usage = {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": 7,
    }
    stop = "tool_use" if reply.calls else "end_turn"
    message = {
        "id": f"msg_{number}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model", "double"),
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": usage,
    }
    if not stream:
        return _dump(message).encode()

    def event(kind: str, data: Json) -> str:
        return f"event: {kind}\ndata: {_dump({'type': kind, **data})}\n\n"

    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    out = [event("message_start", {"message": start})]
    for index, block in enumerate(content):
        if block["type"] == "text":
            out.append(event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}}))
            half = len(block["text"]) // 2
            for part in (block["text"][:half], block["text"][half:]):
                out.append(
                    event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": part}})
                )
        else:
            opening = {**block, "input": {}}
            out.append(event("content_block_start", {"index": index, "content_block": opening}))
            text = _dump(block["input"])
            half = len(text) // 2
            for part in (text[:half], text[half:]):
                delta = {"type": "input_json_delta", "partial_json": part}
                out.append(event("content_block_delta", {"index": index, "delta": delta}))
        out.append(event("content_block_stop", {"index": index}))
    out.append(
        event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 7}})
    )
    out.append(event("message_stop", {}))
    return "".join(out).encode()
