"""The live client against a real local HTTP server playing an OpenAI-compatible provider, glitches included."""

import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from cacherouter.errors import ConfigError, ModelError
from cacherouter.models.accounting import Ledger, RecordingModel
from cacherouter.models.base import ChatRequest, ChatResponse
from cacherouter.models.endpoint import EndpointConfig, OpenAICompatibleModel
from cacherouter.models.usage import parse_usage

Action = Callable[["_Handler"], None]
USER = {"role": "user", "content": "compute 6*7"}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.actions: list[Action] = []
        self.bodies: list[dict[str, Any]] = []
        self.raw_bodies: list[bytes] = []
        self.stopping = threading.Event()  # ends the waits of slow answers when a test is over


class _Handler(BaseHTTPRequestHandler):
    """Answers each POST with the next scripted action. Like vLLM, SGLang and llama-server, it refuses a history
    whose tool-call arguments are not a JSON object."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        body = json.loads(raw)
        self.server.raw_bodies.append(raw)
        self.server.bodies.append(body)
        action = self.server.actions.pop(0) if self.server.actions else send(418, b"no scripted answer left")
        if _invalid_history(body):
            action = send(400, b'{"error":{"message":"invalid tool call arguments in history"}}')
        action(self)

    def log_message(self, *args: Any) -> None:
        pass


def _invalid_history(body: dict[str, Any]) -> bool:
    for message in body["messages"]:
        for call in message.get("tool_calls") or ():
            try:
                arguments = json.loads(call["function"]["arguments"], parse_constant=_reject)
            except ValueError:
                return True
            if not isinstance(arguments, dict):
                return True
    return False


def _reject(name: str) -> Any:
    raise ValueError(name)


# Scripted actions


def send(status: int, body: bytes, headers: dict[str, str] | None = None) -> Action:
    def act(handler: _Handler) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(body)

    return act


def whole(data: Any) -> Action:
    """The JSON answer ``data``, whatever its shape (NaN written as the bare word, as Python's json does)."""
    return send(200, json.dumps(data).encode())


def answer(content: Any = "ok", *, tool_calls: Any = None, usage: Any = None, **fields: Any) -> Action:
    message = {"role": "assistant", "content": content, **fields}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    data: dict[str, Any] = {"model": "m", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
    if usage is not None:
        data["usage"] = usage
    return whole(data)


def call(name: str, arguments: Any, id: str | None = "c1") -> dict[str, Any]:
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if id is not None:
        out["id"] = id
    return out


def raw(data: bytes) -> Action:
    """Bytes written straight to the socket, then the connection closes: malformed HTTP."""

    def act(handler: _Handler) -> None:
        handler.close_connection = True
        handler.wfile.write(data)

    return act


def hang_up() -> Action:
    """Close the connection without answering, as a server restarting or a reset would."""

    def act(handler: _Handler) -> None:
        handler.close_connection = True

    return act


def slow(seconds: float, then: Action) -> Action:
    def act(handler: _Handler) -> None:
        if not handler.server.stopping.wait(seconds):
            then(handler)

    return act


def drip(data: bytes, *, start: int = 0, slow_bytes: int = 40, every: float = 0.05) -> Action:
    """Write ``data[:start]``, then ``slow_bytes`` one at a time (each well within a read timeout), then the rest."""

    def act(handler: _Handler) -> None:
        try:
            handler.wfile.write(data[:start])
            for byte in data[start : start + slow_bytes]:
                handler.wfile.write(bytes([byte]))
                if handler.server.stopping.wait(every):
                    return
            handler.wfile.write(data[start + slow_bytes :])
        except OSError:
            handler.close_connection = True  # the client gave up

    return act


def http_answer(body: bytes) -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


OK_BODY = json.dumps({"choices": [{"message": {"role": "assistant", "content": "ok"}}]}).encode()


class Provider:
    def __init__(self, server: _Server) -> None:
        self.server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}/v1"

    def script(self, *actions: Action) -> None:
        self.server.actions.extend(actions)

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return self.server.bodies

    def model(self, *, timeout: float = 2.0, sleep: Callable[[float], None] | None = None, **settings: Any) -> Any:
        config = EndpointConfig(base_url=self.url, model="m", timeout=timeout, **settings)
        return OpenAICompatibleModel(config) if sleep is None else OpenAICompatibleModel(config, sleep=sleep)


@pytest.fixture
def provider() -> Iterator[Provider]:
    server = _Server()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield Provider(server)
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def ask(model: Any, *messages: dict[str, Any]) -> ChatResponse:
    response: ChatResponse = model.complete(ChatRequest(messages=messages or (USER,)))
    return response


def round_trip(provider: Provider, first: Action) -> tuple[ChatResponse, dict[str, Any]]:
    """Ask once (answered by ``first``), answer its tool calls, ask again: the reply and the second request."""
    provider.script(first, answer("done"))
    model = provider.model()
    reply = ask(model)
    results = [{"role": "tool", "tool_call_id": c.id, "content": "{}"} for c in reply.tool_calls]
    assert ask(model, USER, reply.assistant_message(), *results).content == "done"
    return reply, provider.bodies[-1]


# 1. Glitches end in ModelError with a short message, never a traceback


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        (raw(b'HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{"choices":'), "cut its answer short"),
        (raw(b"SSH-2.0-OpenSSH_9.6\r\n"), "did not answer HTTP"),
        (send(200, b"\xff\xfe\x00A"), "not UTF-8"),
        (send(200, b"<html>gateway</html>"), "did not answer JSON"),
    ],
    ids=["truncated-body", "not-http", "not-utf8", "not-json"],
)
def test_broken_http_is_a_model_error(provider: Provider, action: Action, expected: str) -> None:
    provider.script(action)
    with pytest.raises(ModelError, match=expected):
        ask(provider.model())


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ([1, 2], "not a JSON object"),
        ({}, "no choices"),
        ({"error": {"message": "overloaded"}}, "provider answered an error: .*overloaded"),
        ({"choices": [{"message": None}]}, r"choices\[0\].message is not an object"),
        ({"choices": ["text"]}, r"choices\[0\].message is not an object"),
        ({"choices": [{"message": {"content": None, "tool_calls": ["oops"]}}]}, r"tool_calls\[0\] is not a function"),
        ({"choices": [{"message": {"tool_calls": {"id": "x"}}}]}, "tool_calls is not a list"),
        ({"choices": [{"message": {"content": 5}}]}, "neither text nor a list of parts"),
        ({"choices": [{"message": {"content": "ok"}}], "usage": [1]}, "usage is not an object"),
    ],
)
def test_answers_of_the_wrong_shape_are_model_errors(provider: Provider, data: Any, expected: str) -> None:
    provider.script(whole(data))
    with pytest.raises(ModelError, match=expected):
        ask(provider.model())


@pytest.mark.parametrize(
    "arguments",
    ['{"expression": NaN}', '{"x": -Infinity}', '{"x": 1e999}', "[1, 2]", [1, 2], {"x": math.nan}, '{"a": "1+'],
    ids=["nan", "infinity", "1e999", "array-text", "array", "object-with-nan", "truncated"],
)
def test_arguments_that_are_not_a_json_object_are_kept_for_the_error_and_replayed_as_empty(
    provider: Provider, arguments: Any
) -> None:
    reply, second = round_trip(provider, answer(None, tool_calls=[call("calculator", arguments)]))
    (tool_call,) = reply.tool_calls
    assert tool_call.arguments == {}
    assert tool_call.raw_arguments  # the agent quotes it in the error result it gives the model
    assert second["messages"][1]["tool_calls"][0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TIMEOUT", "-1"),
        ("TIMEOUT", "0"),
        ("TIMEOUT", "nan"),
        ("TIMEOUT", "inf"),
        ("TIMEOUT", "1e400"),
        ("TIMEOUT", "soon"),
        ("BASE_URL", "api.deepseek.com"),
        ("BASE_URL", "ftp://example.com"),
        ("BASE_URL", "http://"),
        ("BASE_URL", "http://127.0.0.1:99999"),
        ("RETRIES", "-1"),
        ("RETRIES", "two"),
    ],
)
def test_bad_endpoint_settings_are_refused_at_start_up(name: str, value: str) -> None:
    env = {"CACHEROUTER_ROUTER_BASE_URL": "http://127.0.0.1:8000/v1", "CACHEROUTER_ROUTER_MODEL": "m"}
    with pytest.raises(ConfigError, match=f"CACHEROUTER_ROUTER_{name}"):
        EndpointConfig.from_env("CACHEROUTER_ROUTER", {**env, f"CACHEROUTER_ROUTER_{name}": value})
    good = EndpointConfig.from_env("CACHEROUTER_ROUTER", {**env, "CACHEROUTER_ROUTER_RETRIES": "0"})
    assert (good.timeout, good.retries, good.env_prefix) == (120.0, 0, "CACHEROUTER_ROUTER")
    assert EndpointConfig.from_env("CACHEROUTER_ROUTER", env).retries == 2


# 2. The timeout bounds the whole request


@pytest.mark.parametrize(
    "action",
    [drip(http_answer(OK_BODY)), drip(http_answer(OK_BODY), start=len(http_answer(OK_BODY)) - len(OK_BODY))],
    ids=["headers", "body"],
)
def test_the_timeout_bounds_the_whole_request_not_each_read(provider: Provider, action: Action) -> None:
    provider.script(action)  # a byte every 50 ms for 2 s: no read waits 0.5 s, the whole takes four times that
    start = time.monotonic()
    with pytest.raises(ModelError, match=r"timed out: .* within 0.5 s; raise CACHEROUTER_MAIN_TIMEOUT"):
        ask(provider.model(timeout=0.5))
    assert time.monotonic() - start < 1.5


def test_a_slow_answer_says_it_timed_out_and_names_the_setting(provider: Provider) -> None:
    provider.script(slow(5, answer("late")))
    env = {"CACHEROUTER_ROUTER_BASE_URL": provider.url, "CACHEROUTER_ROUTER_MODEL": "m"}
    model = OpenAICompatibleModel(
        EndpointConfig.from_env("CACHEROUTER_ROUTER", {**env, "CACHEROUTER_ROUTER_TIMEOUT": "0.3"})
    )
    with pytest.raises(ModelError, match=r"within 0.3 s; raise CACHEROUTER_ROUTER_TIMEOUT") as caught:
        ask(model)
    assert "network" not in str(caught.value)


# 3. The history replays valid JSON: the provider's own text, or {} for arguments that were not an object


def test_history_replays_valid_arguments_byte_for_byte(provider: Provider) -> None:
    first = answer(None, tool_calls=[call("INTERNAL_ROUTER", '{"task": 1,  "hint" : "x"}')])
    reply, second = round_trip(provider, first)
    assert reply.tool_calls[0].arguments == {"task": 1, "hint": "x"}
    assert b'"arguments":"{\\"task\\": 1,  \\"hint\\" : \\"x\\"}"' in provider.server.raw_bodies[-1]
    assert second["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"task": 1,  "hint" : "x"}'


# 4. Tool-call ids are unique when the provider leaves them out


def test_missing_tool_call_ids_are_unique_across_rounds(provider: Provider) -> None:
    provider.script(
        answer(None, tool_calls=[call("a", "{}", id=None), call("b", "{}", id="")]),
        answer(None, tool_calls=[call("a", "{}", id=None), call("a", "{}", id="dup"), call("b", "{}", id="dup")]),
    )
    model = provider.model()
    ids = [c.id for reply in (ask(model), ask(model)) for c in reply.tool_calls]
    assert ids[3] == "dup"
    assert len(set(ids)) == 5
    assert all(i.startswith("call_") and len(i) == 29 for i in ids[:3] + ids[4:])


# 5. Retries


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
def test_transient_statuses_are_retried(provider: Provider, status: int) -> None:
    provider.script(send(status, b'{"error":"busy"}', {"Retry-After": "0"}), answer("recovered"))
    model = OpenAICompatibleModel(EndpointConfig.from_env("CACHEROUTER_MAIN", _env(provider)))
    assert ask(model).content == "recovered"
    assert len(provider.bodies) == 2


def test_a_dropped_connection_is_retried_after_a_backoff(provider: Provider) -> None:
    provider.script(hang_up(), hang_up(), answer("recovered"))
    waits: list[float] = []
    assert ask(provider.model(retry_backoff=0.01, sleep=waits.append)).content == "recovered"
    assert len(waits) == 2
    assert 0.005 <= waits[0] <= 0.015  # backoff with jitter, doubling
    assert 0.01 <= waits[1] <= 0.03


def test_retry_after_is_honoured_up_to_a_cap(provider: Provider) -> None:
    provider.script(
        send(429, b"slow down", {"Retry-After": "7"}), send(503, b"", {"Retry-After": "120"}), answer("done")
    )
    waits: list[float] = []
    assert ask(provider.model(timeout=60, sleep=waits.append)).content == "done"
    assert waits == [7, 30]


def test_retries_end_at_the_limit_and_never_pass_the_deadline(provider: Provider) -> None:
    provider.script(*[send(503, b"overloaded")] * 3)
    waits: list[float] = []
    with pytest.raises(ModelError, match="HTTP 503: overloaded; gave up after 3 attempts"):
        ask(provider.model(retries=2, retry_backoff=0.001, sleep=waits.append))
    assert len(provider.bodies) == 3
    provider.script(send(503, b"overloaded", {"Retry-After": "5"}))
    with pytest.raises(ModelError, match="would pass the 1 s limit"):
        ask(provider.model(timeout=1, sleep=waits.append))
    assert len(provider.bodies) == 4
    assert len(waits) == 2  # none for the last: the server's wait did not fit


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_client_errors_are_not_retried(provider: Provider, status: int) -> None:
    provider.script(send(status, b"no"), answer("never asked"))
    with pytest.raises(ModelError, match=f"HTTP {status}: no"):
        ask(provider.model(sleep=lambda seconds: None))
    assert len(provider.bodies) == 1


def test_a_refused_connection_is_retried_then_reported() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before use: nothing listens there
    waits: list[float] = []
    config = EndpointConfig(base_url=f"http://127.0.0.1:{port}", model="m", timeout=2, retry_backoff=0.001)
    with pytest.raises(ModelError, match="cannot reach .*gave up after 3 attempts"):
        ask(OpenAICompatibleModel(config, sleep=waits.append))
    assert len(waits) == 2


def _env(provider: Provider) -> dict[str, str]:
    return {"CACHEROUTER_MAIN_BASE_URL": provider.url, "CACHEROUTER_MAIN_MODEL": "m"}


# 6. DeepSeek thinking mode: reasoning_content goes back with tool calls


def test_reasoning_content_is_replayed_with_tool_calls_when_the_provider_sent_it(provider: Provider) -> None:
    first = answer("", reasoning_content="Use the calculator.", tool_calls=[call("calculator", '{"e":"6*7"}')])
    reply, second = round_trip(provider, first)
    assert reply.reasoning == "Use the calculator."
    assert second["messages"][1]["reasoning_content"] == "Use the calculator."
    # an empty one too: DeepSeek still wants the field
    _, second = round_trip(provider, answer("", reasoning_content="", tool_calls=[call("c", "{}")]))
    assert second["messages"][1]["reasoning_content"] == ""
    # never on a final answer, and never for a provider that did not send it
    provider.script(answer("42", reasoning_content="6*7 is 42"), answer(None, tool_calls=[call("c", "{}")]))
    model = provider.model()
    assert ask(model).assistant_message() == {"role": "assistant", "content": "42"}
    assert "reasoning_content" not in ask(model).assistant_message()


# 8. Content parts and inline reasoning


def test_content_parts_are_joined_as_text(provider: Provider) -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "image_url", "image_url": {"url": "x"}}]
    provider.script(answer([*parts, {"type": "text", "text": "world"}]))
    assert ask(provider.model()).content == "Hello world"


def test_a_leading_think_block_is_reasoning_not_the_answer(provider: Provider) -> None:
    inline = "<think>\nSix times seven.\n</think>\n\n"
    provider.script(answer(inline + "It is 42."))
    reply = ask(provider.model())
    assert (reply.content, reply.reasoning) == ("It is 42.", "Six times seven.")
    assert reply.assistant_message() == {"role": "assistant", "content": "It is 42."}
    # inside a tool loop the model's bytes go back as they came, for templates that keep in-turn reasoning
    tool_reply, second = round_trip(provider, answer(inline + "Calling.", tool_calls=[call("c", "{}")]))
    assert tool_reply.content == "Calling."
    assert second["messages"][1]["content"] == inline + "Calling."
    assert "reasoning_content" not in second["messages"][1]


# 7. Usage: Anthropic through a chat-completions gateway, and figures that contradict each other


def test_anthropic_usage_through_a_chat_completions_gateway() -> None:
    litellm = {
        "prompt_tokens": 1000,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 900},
        "cache_creation_input_tokens": 50,
    }
    usage = parse_usage(litellm)
    assert (usage.provider, usage.prompt_tokens, usage.cached_tokens, usage.cache_write_tokens) == (
        "anthropic",
        1000,
        900,
        50,
    )
    assert usage.completion_tokens == 5
    plain = parse_usage({"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 900}}, "anthropic")
    assert (plain.prompt_tokens, plain.cached_tokens, plain.miss_tokens) == (1000, 900, 100)


@pytest.mark.parametrize(
    ("usage", "dialect"),
    [
        ({"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 900}}, "openai"),
        ({"prompt_tokens": -5, "prompt_tokens_details": {"cached_tokens": 0}}, "openai"),
        ({"prompt_tokens": 100, "prompt_cache_hit_tokens": -64, "prompt_cache_miss_tokens": 164}, None),
        ({"input_tokens": -10, "cache_read_input_tokens": 50}, None),
        (
            {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 90}, "cache_creation_input_tokens": 50},
            None,
        ),
    ],
)
def test_usage_that_contradicts_itself_is_unknown_not_a_negative_cost(
    provider: Provider, usage: Any, dialect: str | None
) -> None:
    provider.script(answer("ok", usage=usage))
    ledger = Ledger()
    ask(RecordingModel(provider.model(), ledger, provider=dialect))
    (record,) = ledger.records
    assert record.cost is None
    assert ledger.summary().unknown_requests == 1


def test_deepseek_hits_follow_from_the_prompt_and_the_misses() -> None:
    usage = parse_usage({"prompt_tokens": 1000, "prompt_cache_miss_tokens": 1000})
    assert (usage.provider, usage.cached_tokens) == ("deepseek", 0)
