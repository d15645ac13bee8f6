"""The LLM test double of the verifiers tests: a local OpenAI-compatible chat-completions server of our own
(real HTTP on 127.0.0.1, the standard library's ``http.server``) that replays scripted tool calls.

Each script is one rollout's list of turns, a turn being the tool calls the model makes (``[(name, arguments)]``);
after its last turn the model answers ``FINAL_ANSWER`` in text. A new conversation (no assistant message yet) takes
the next script in order, counted per prompt (its user messages), so each group of rollouts of one prompt cycles
through the scripts whatever order the groups run in; later requests find their script from the ids of the tool
calls the conversation already holds (``call-<script>-<turn>-<k>``), so concurrent rollouts of one prompt each
follow their own script.
Streaming (``"stream": true``, as verifiers v1's chat program asks) and plain answers are both served.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Turn = Sequence[tuple[str, dict[str, Any]]]
Script = Sequence[Turn]

FINAL_ANSWER = "done"


class ScriptedModel:
    """``with ScriptedModel(scripts) as model:`` serves at ``model.base_url`` (``.../v1``)."""

    def __init__(self, scripts: Sequence[Script]) -> None:
        self.scripts = [list(script) for script in scripts]
        self._next: dict[str, itertools.count[int]] = {}
        self._lock = threading.Lock()
        self.requests = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    def __enter__(self) -> ScriptedModel:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def reply(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The assistant message that answers ``messages``."""
        with self._lock:
            self.requests += 1
        assistant = [m for m in messages if m.get("role") == "assistant"]
        if not assistant:
            prompt = json.dumps([m.get("content") for m in messages if m.get("role") == "user"])
            with self._lock:
                script = next(self._next.setdefault(prompt, itertools.count())) % len(self.scripts)
        else:
            first_call = (assistant[0].get("tool_calls") or [{}])[0].get("id", "")
            script = int(first_call.split("-")[1])
        turn = len(assistant)
        turns = self.scripts[script]
        if turn >= len(turns):
            return {"role": "assistant", "content": FINAL_ANSWER}
        calls = [
            {
                "id": f"call-{script}-{turn}-{k}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
            for k, (name, arguments) in enumerate(turns[turn])
        ]
        return {"role": "assistant", "content": None, "tool_calls": calls}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        model = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self.send_error(404)
                    return
                message = model.reply(body.get("messages", []))
                finish = "tool_calls" if message.get("tool_calls") else "stop"
                usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
                base = {"id": "chatcmpl-scripted", "created": 0, "model": body.get("model", "scripted")}
                if not body.get("stream"):
                    answer = {
                        **base,
                        "object": "chat.completion",
                        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                        "usage": usage,
                    }
                    self._send(200, "application/json", json.dumps(answer).encode())
                    return
                delta = dict(message)
                if "tool_calls" in delta:
                    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(delta["tool_calls"])]
                chunks = [
                    {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                    {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                    {"choices": [], "usage": usage},
                ]
                events = [f"data: {json.dumps({**base, 'object': 'chat.completion.chunk', **c})}\n\n" for c in chunks]
                self._send(200, "text/event-stream", ("".join(events) + "data: [DONE]\n\n").encode())

            def _send(self, status: int, content_type: str, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler
