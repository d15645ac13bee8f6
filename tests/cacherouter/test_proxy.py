"""``cacherouter proxy`` end to end: the real ``openai`` and ``anthropic`` SDK clients, pointed at the real proxy
(Starlette under uvicorn on 127.0.0.1), in front of a TEST DOUBLE of the LLM provider (``proxy_provider``: a local
HTTP server of ours that records every request byte for byte and answers from a script, usage fields included).

The 30-turn session changes the client's tool list as it goes (tools added, removed and changed) and mixes plain
answers, direct core calls, routed calls, retrieval searches the proxy answers itself, parallel calls and refused
calls, alternating streamed and non-streamed turns. Checked at every provider request: the tool segment (and the
system prompt) is byte-identical, and the messages of the previous request are a byte-identical prefix.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import openai
import pytest
from proxy_provider import ProviderDouble, Recorded, Reply

from cacherouter.channels.router import RouterConfig
from cacherouter.cli import main
from cacherouter.prompts import ROUTER_SYSTEM, ROUTER_TOOL
from cacherouter.proxy import ROUTED_PREFIX, Proxy, ProxyConfig, create_app, decode_routed_id, encode_routed_id
from tvcache.server.runner import AppThread

SECRET = "sk-test-SECRET-0123456789"
SYSTEM = "You are a careful assistant. Use tools when asked."
CORE = ("read_file", "echo")
TURNS = 30


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "description": description, "properties": properties}


def client_tools(turn: int) -> list[dict[str, Any]]:
    """The client's tools at a turn: translate joins at 5, stock leaves at 10, geocode joins at 12, weather gains
    a parameter at 15, echo (a core tool) leaves at 20. Order shuffles too: the client lists them newest first."""
    weather = {"city": {"type": "string"}}
    if turn >= 15:
        weather = {**weather, "units": {"type": "string", "enum": ["metric", "imperial"]}}
    tools = [
        _tool("read_file", "Read a file of the workspace.", {"path": {"type": "string"}}),
        _tool("weather", "Weather report for a city.", weather),
    ]
    if turn < 20:
        tools.append(_tool("echo", "Echo some text back.", {"text": {"type": "string"}}))
    if turn < 10:
        tools.append(_tool("stock", "Stock price for a ticker symbol.", {"symbol": {"type": "string"}}))
    if turn >= 5:
        tools.append(_tool("translate", "Translate text into another language.", {"text": {"type": "string"}}))
    if turn >= 12:
        tools.append(_tool("geocode", "Coordinates of a street address.", {"address": {"type": "string"}}))
    return list(reversed(tools)) if turn % 2 else tools


def route(tool: str, **arguments: Any) -> tuple[str, Any]:
    return (ROUTER_TOOL, {"tool": tool, "arguments": arguments})


# Each turn: the replies of its steps. "SEARCH" steps call INTERNAL_ROUTER with a task (answered by the proxy); a
# step given as a callable picks its call from the results it sees.
PLANS: dict[int, list[Any]] = {
    1: [[("read_file", {"path": "a.txt"})]],
    2: [[route("weather", city="Paris")]],
    3: [[(ROUTER_TOOL, {"task": "weather in Oslo"})], "PICK weather city=Oslo"],
    4: [[("read_file", {"path": "b.txt"}), route("weather", city="Rome"), route("stock", symbol="ACME")]],
    5: [[route("translate", text="hello")]],
    7: [[(ROUTER_TOOL, {"tool": "weather", "argumentz": {"city": "Bern"}})], [route("weather", city="Bern")]],
    8: [[route("stock", symbol="XYZ")]],
    9: [[("echo", {"text": "ping"})]],
    10: [[(ROUTER_TOOL, {"task": "translate hello to French"})], "PICK translate text=bonjour"],
    11: [[route("stock", symbol="GONE")]],  # stock left at 10: the proxy says so, the model answers
    12: [[route("geocode", address="1 Main St")]],
    13: [[route("geocode", address="2 Main St"), route("translate", text="two")]],
    15: [[route("weather", city="Lima", units="metric")]],
    16: [[(ROUTER_TOOL, {"task": "geocode the address 3 Main St"})], "PICK geocode address=3 Main St"],
    17: [[("read_file", {"path": "c.txt"})]],
    18: [[route("translate", text="eighteen")]],
    20: [[("echo", {"text": "still there?"})]],  # echo left at 20, though it stays in the view
    21: [[route("weather", city="Quito")]],
    22: [[("read_file", {"path": "d.txt"}), route("geocode", address="4 Main St")]],
    23: [[(ROUTER_TOOL, {"task": "weather forecast for Lagos"})], "PICK weather city=Lagos"],
    25: [[route("translate", text="twenty-five")]],
    26: [[(ROUTER_TOOL, {"tool": "weather", "task": "both"})], [route("weather", city="Nuuk")]],
    27: [[("read_file", {"path": "e.txt"})]],
    28: [[route("geocode", address="5 Main St")]],
}


@dataclass
class ScriptedModel:
    """The double's "model": follows PLANS by turn and step, read from the provider-facing history only."""

    routed: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)  # (router call id, tool, arguments)

    def __call__(self, api: str, body: dict[str, Any], number: int) -> Reply:
        turn, step, last_results = _position(api, body)
        plan = PLANS.get(turn, [])
        if step >= len(plan):
            return Reply(text=f"turn {turn} done: {' | '.join(last_results)}")
        spec = plan[step]
        if isinstance(spec, str):  # "PICK tool key=value": the tool the search listed first, if it is that one
            _, tool, pair = spec.split(" ", 2)
            found = json.loads(last_results[0])["candidates"]
            assert found[0]["name"] == tool, found
            key, value = pair.split("=", 1)
            spec = [route(tool, **{key: value})]
        for index, (name, arguments) in enumerate(spec):
            if name == ROUTER_TOOL and "tool" in arguments and set(arguments) == {"tool", "arguments"}:
                prefix = "call" if api == "openai" else "toolu"
                self.routed.append((f"{prefix}_{number}_{index}", arguments["tool"], arguments["arguments"]))
        return Reply(calls=list(spec))


def _position(api: str, body: dict[str, Any]) -> tuple[int, int, list[str]]:
    """(turn, replies since the turn's user message, the texts of the results at the end of the history)."""
    messages = body["messages"]
    start = max(i for i, m in enumerate(messages) if m["role"] == "user" and _user_text(m).startswith("TURN "))
    turn = int(_user_text(messages[start]).split()[1].rstrip(":"))
    step = sum(1 for m in messages[start:] if m["role"] == "assistant")
    results: list[str] = []
    if api == "openai":
        for m in reversed(messages):
            if m["role"] != "tool":
                break
            results.insert(0, m["content"])
    elif messages[-1]["role"] == "user" and isinstance(messages[-1]["content"], list):
        results = [b["content"] for b in messages[-1]["content"] if b.get("type") == "tool_result"]
    return turn, step, results


def _user_text(message: dict[str, Any]) -> str:
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content if b.get("type") == "text")


def run_tool(name: str, arguments: dict[str, Any]) -> str:
    return f"{name} -> {json.dumps(arguments, sort_keys=True)}"


# -- raw byte segments of a recorded body ----------------------------------------------------------------------


def member(raw: bytes, name: str) -> bytes:
    """The raw bytes of a top-level member's value (the body is compact JSON, as the proxy writes it)."""
    text = raw.decode("utf-8")
    decoder = json.JSONDecoder()
    key = json.dumps(name) + ":"
    depth, i, in_string = 0, 0, False
    while i < len(text):  # find the key at depth 1
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            if depth == 1 and text.startswith(key, i):
                _, end = decoder.raw_decode(text, i + len(key))
                return text[i + len(key) : end].encode("utf-8")
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        i += 1
    raise KeyError(name)


def raw_elements(array: bytes) -> list[bytes]:
    text = array.decode("utf-8")
    decoder = json.JSONDecoder()
    out, i = [], 1
    while text[i] != "]":
        _, end = decoder.raw_decode(text, i)
        out.append(text[i:end].encode("utf-8"))
        i = end + 1 if text[end] == "," else end
    return out


def assert_prefix_stable(requests: list[Recorded], *, api: str) -> None:
    tools = {member(r.raw, "tools") for r in requests}
    assert len(tools) == 1, "the provider-facing tool segment changed"
    if api == "anthropic":
        assert len({member(r.raw, "system") for r in requests}) == 1
    for before, after in itertools.pairwise(requests):
        old, new = raw_elements(member(before.raw, "messages")), raw_elements(member(after.raw, "messages"))
        assert len(new) > len(old)
        for index, (a, b) in enumerate(zip(old, new, strict=False)):
            assert a == b, f"message {index} changed between provider requests:\n{a!r}\n{b!r}"


# -- fixtures ---------------------------------------------------------------------------------------------------


@pytest.fixture
def model() -> ScriptedModel:
    return ScriptedModel()


@pytest.fixture
def provider(model: ScriptedModel) -> Iterator[ProviderDouble]:
    with ProviderDouble(model) as double:
        yield double


def serve(provider: ProviderDouble, api: str, **options: Any) -> AppThread:
    config = ProxyConfig(upstream=provider.url + "/v1", api=api, router=RouterConfig(ranker="bm25"), **options)
    return AppThread(create_app(Proxy(config)))


# -- the 30-turn session ----------------------------------------------------------------------------------------


def openai_session(base_url: str) -> list[tuple[str, dict[str, Any]]]:
    """The agent: a plain loop on the openai SDK, executing its own tools. Returns every call it executed."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=SECRET, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    executed = []
    for turn in range(TURNS):
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t["description"],
                    "parameters": {"type": "object", "properties": t["properties"]},
                },
            }
            for t in client_tools(turn)
        ]
        names = {t["function"]["name"] for t in tools}
        messages.append({"role": "user", "content": f"TURN {turn}: please help"})
        for _ in range(6):
            stream = turn % 2 == 1
            message = _openai_reply(client, messages, tools, stream=stream)
            messages.append(message)
            if not message.get("tool_calls"):
                assert message["content"].startswith(f"turn {turn} done")
                break
            for call in message["tool_calls"]:
                name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
                assert name in names, f"the client got a call of {name}, which it does not offer"
                executed.append((name, arguments))
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": run_tool(name, arguments)})
        else:
            pytest.fail(f"turn {turn} did not end")
    return executed


def _openai_reply(client: openai.OpenAI, messages: list[Any], tools: list[Any], *, stream: bool) -> dict[str, Any]:
    if not stream:
        reply = client.chat.completions.create(model="double-1", messages=messages, tools=tools)
        message = reply.choices[0].message
        out: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in message.tool_calls
            ]
        return out
    content, calls = [], {}
    for chunk in client.chat.completions.create(model="double-1", messages=messages, tools=tools, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                content.append(choice.delta.content)
            for part in choice.delta.tool_calls or ():
                slot = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] = part.id or slot["id"]
                slot["name"] += (part.function and part.function.name) or ""
                slot["arguments"] += (part.function and part.function.arguments) or ""
    out = {"role": "assistant", "content": "".join(content)}
    if calls:
        out["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(calls.items())
        ]
    return out


def anthropic_session(base_url: str) -> list[tuple[str, dict[str, Any]]]:
    client = anthropic.Anthropic(base_url=base_url, api_key=SECRET, max_retries=0)
    messages: list[dict[str, Any]] = []
    executed = []
    for turn in range(TURNS):
        tools = [
            {
                "name": t["name"],
                "description": t["description"],
                "input_schema": {"type": "object", "properties": t["properties"]},
            }
            for t in client_tools(turn)
        ]
        names = {t["name"] for t in tools}
        messages.append({"role": "user", "content": f"TURN {turn}: please help"})
        for _ in range(6):
            kwargs: dict[str, Any] = {
                "model": "double-1",
                "max_tokens": 256,
                "system": SYSTEM,
                "messages": messages,
                "tools": tools,
            }
            if turn % 2:
                with client.messages.stream(**kwargs) as stream:
                    reply = stream.get_final_message()
            else:
                reply = client.messages.create(**kwargs)
            blocks = [b.model_dump(exclude_none=True) for b in reply.content]
            messages.append({"role": "assistant", "content": blocks})
            uses = [b for b in blocks if b["type"] == "tool_use"]
            if not uses:
                assert blocks[0]["text"].startswith(f"turn {turn} done")
                break
            results = []
            for use in uses:
                assert use["name"] in names, f"the client got a call of {use['name']}, which it does not offer"
                executed.append((use["name"], use["input"]))
                results.append(
                    {"type": "tool_result", "tool_use_id": use["id"], "content": run_tool(use["name"], use["input"])}
                )
            messages.append({"role": "user", "content": results})
        else:
            pytest.fail(f"turn {turn} did not end")
    return executed


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_thirty_turns_keep_the_provider_prefix(
    api: str, provider: ProviderDouble, model: ScriptedModel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with serve(provider, api, core=CORE) as proxy:
        executed = (openai_session if api == "openai" else anthropic_session)(proxy.url)
        stats = httpx.get(proxy.url + "/stats", timeout=10).json()
        metrics = httpx.get(proxy.url + "/metrics", timeout=10).text
    requests = provider.chat_requests()
    assert len(requests) >= 55
    assert_prefix_stable(requests, api=api)

    # The provider sees the core view and INTERNAL_ROUTER only, never a routed id or a long-tail tool.
    names = [(t.get("function") or t)["name"] for t in requests[0].body["tools"]]
    assert names == sorted([*CORE, ROUTER_TOOL])
    assert all(ROUTED_PREFIX.encode() not in r.raw for r in requests)

    # Every routed call reached the client as that tool with the router's arguments, in order.
    refused = ("stock", {"symbol": "GONE"})  # asked for after the client dropped stock: never reaches it
    delivered = [(i, t, a) for i, t, a in model.routed if (t, a) != refused]
    routed_at_client = [(n, a) for n, a in executed if n not in CORE]
    assert routed_at_client == [(tool, arguments) for _, tool, arguments in delivered]
    assert len(delivered) >= 20

    # Results map back: the provider saw each of its INTERNAL_ROUTER calls answered by that tool's result.
    last = requests[-1].body["messages"]
    answers = _results_by_id(api, last)
    for call_id, tool, arguments in delivered:
        assert answers[call_id] == run_tool(tool, arguments)
    calls = _router_calls(api, last)
    for call_id, _, _ in delivered:
        assert calls[call_id]["tool"]  # the provider's own INTERNAL_ROUTER call, with its own arguments

    # The proxy answered the searches and refusals itself, and the model saw why.
    texts = " ".join(answers.values())
    assert "no tool 'stock' is available" in texts  # stock left at turn 10
    assert "echo is no longer available" in texts  # echo left at turn 20, still in the view
    assert "unknown argument(s) ['argumentz']" in texts
    assert "give either 'task'" in texts

    # Accounting: every provider request, its cached tokens as the provider reported them.
    total = stats["total"]
    assert total["requests"] == len(requests)
    expected_cached = _reported_cached(provider, requests)
    assert total["cached_tokens"] == expected_cached
    assert total["routed_calls"] == len(delivered)
    assert total["hit_rate"] is not None
    assert total["hit_rate"] > 0.5
    if api == "anthropic":
        assert total["input_cost"] is not None  # Anthropic's own usage fields name the provider and its prices
    assert f"cacherouter_proxy_cached_tokens_total {expected_cached}" in metrics

    # The client's key reached the provider, and nothing else ever held it.
    assert all(r.headers.get("authorization") == f"Bearer {SECRET}" for r in requests)  # both SDKs send a Bearer
    if api == "anthropic":
        assert all(r.headers.get("anthropic-version") for r in requests)
    assert SECRET not in caplog.text
    assert SECRET not in json.dumps(stats)
    assert SECRET not in metrics


def _reported_cached(provider: ProviderDouble, requests: list[Recorded]) -> int:
    """What the double reported: recomputed from the recorded bodies, in order."""
    total = 0
    for index, request in enumerate(requests):
        best = 0
        for earlier in requests[:index]:
            common = 0
            for a, b in zip(earlier.raw, request.raw, strict=False):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        total += (best // 64) * 64 // 4
    return total


def _results_by_id(api: str, messages: list[dict[str, Any]]) -> dict[str, str]:
    if api == "openai":
        return {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
    return {
        b["tool_use_id"]: b["content"]
        for m in messages
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    }


def _router_calls(api: str, messages: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for m in messages:
        if m["role"] != "assistant":
            continue
        if api == "openai":
            for c in m.get("tool_calls") or ():
                if c["function"]["name"] == ROUTER_TOOL:
                    out[c["id"]] = json.loads(c["function"]["arguments"])
        else:
            for b in m["content"]:
                if b.get("type") == "tool_use" and b["name"] == ROUTER_TOOL:
                    out[b["id"]] = b["input"]
    return out


# -- smaller contracts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_without_tools_passes_byte_for_byte(stream: bool) -> None:
    answer = (
        b'{"id":"x",  "choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}], '
        b'"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":0}}}'
    )
    if stream:
        answer = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'
    with ProviderDouble(lambda api, body, n: Reply(raw_bodies=answer)) as double, serve(double, "openai") as proxy:
        raw = (
            '{ "model" : "m",\n "messages": [{"role":"user","content":"caf\\u00e9 \u00e9 1.50"}], '
            '"x_unknown": [1.0, 1e2]' + (', "stream": true' if stream else "") + "}"
        ).encode()
        reply = httpx.post(proxy.url + "/v1/chat/completions", content=raw, headers={"Authorization": "Bearer k"})
    assert double.requests[0].raw == raw
    assert reply.content == answer


def test_tool_choice_naming_a_long_tail_tool_forces_the_router(provider: ProviderDouble) -> None:
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]
    with serve(provider, "openai", core=("a",)) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        client.chat.completions.create(
            model="m",
            messages=[
                {"role": "user", "content": "TURN 0: x"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "and"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                },
            ],
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "b"}},
            parallel_tool_calls=False,
            extra_body={"x_vendor": {"keep": [3, 2, 1]}},
        )
    body = provider.requests[0].body
    assert body["tool_choice"] == {"type": "function", "function": {"name": ROUTER_TOOL}}
    assert body["parallel_tool_calls"] is False
    assert body["x_vendor"] == {"keep": [3, 2, 1]}
    assert body["messages"][1]["content"][1]["image_url"]["url"] == "data:image/png;base64,AAAA"
    assert [t["function"]["name"] for t in body["tools"]] == [ROUTER_TOOL, "a"]


def test_the_first_requests_tools_are_the_view_without_core(provider: ProviderDouble, model: ScriptedModel) -> None:
    """No --core: the session's first request's tools stay the view; a tool added later is reached by routing."""
    PLANS_BACKUP = dict(PLANS)
    try:
        PLANS.clear()
        PLANS[1] = [[route("late", q="x")]]
        with serve(provider, "openai") as proxy:
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
            first = [{"type": "function", "function": {"name": "early", "parameters": {"type": "object"}}}]
            later = [*first, {"type": "function", "function": {"name": "late", "parameters": {"type": "object"}}}]
            messages: list[Any] = [{"role": "user", "content": "TURN 0: hi"}]
            reply = client.chat.completions.create(model="m", messages=messages, tools=first)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "TURN 1: go"},
            ]
            reply = client.chat.completions.create(model="m", messages=messages, tools=later)
    finally:
        PLANS.clear()
        PLANS.update(PLANS_BACKUP)
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "late"
    assert json.loads(call.function.arguments) == {"q": "x"}
    assert decode_routed_id(call.id) == (model.routed[0][0], json.dumps(route("late", q="x")[1], separators=(",", ":")))
    assert member(provider.requests[0].raw, "tools") == member(provider.requests[1].raw, "tools")


def test_a_restarted_proxy_rewrites_the_same_history_the_same_way(provider: ProviderDouble) -> None:
    """Routed calls are rewritten from their ids alone: a second proxy process sends the provider the same bytes."""
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in ("read_file", "weather")
    ]
    history: list[Any] = [{"role": "user", "content": "TURN 2: go"}]
    with serve(provider, "openai", core=("read_file",)) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        call = client.chat.completions.create(model="m", messages=history, tools=tools).choices[0].message.tool_calls[0]
    assert call.function.name == "weather"
    history += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "weather", "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    bodies = []
    for _ in range(2):  # two proxies, one after the other: nothing is shared but the request
        with serve(provider, "openai", core=("read_file",)) as proxy:
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
            client.chat.completions.create(model="m", messages=history, tools=tools)
        bodies.append(provider.requests[-1].raw)
    assert bodies[0] == bodies[1]
    restored = json.loads(bodies[0])["messages"]
    assert restored[1]["tool_calls"][0]["function"]["name"] == ROUTER_TOOL
    assert restored[1]["tool_calls"][0]["id"] == "call_0_0"
    assert restored[2] == {"role": "tool", "tool_call_id": "call_0_0", "content": "sunny"}


def test_models_are_passed_through_and_errors_keep_their_status(provider: ProviderDouble) -> None:
    with serve(provider, "openai") as proxy:
        models = httpx.get(proxy.url + "/v1/models", headers={"Authorization": "Bearer k"}, timeout=10)
        wrong = httpx.post(proxy.url + "/v1/messages", json={}, timeout=10)
        page = httpx.get(proxy.url + "/", timeout=10)
    assert models.json()["data"][0]["id"] == "double-1"
    assert provider.requests[0].headers["authorization"] == "Bearer k"
    assert wrong.status_code == 404
    assert "openai API" in wrong.json()["error"]["message"]
    assert "cacherouter proxy" in page.text


def test_routed_ids_round_trip() -> None:
    for provider_id, arguments in [("call_1", '{"tool":"x","arguments":{}}'), ("toolu_\u00e9", ""), ("", "{" * 300)]:
        routed = encode_routed_id(provider_id, arguments)
        assert routed.startswith(ROUTED_PREFIX)
        assert routed.replace("_", "").replace("-", "").isalnum()
        assert decode_routed_id(routed) == (provider_id, arguments)
    assert decode_routed_id("call_abc") is None
    assert decode_routed_id(ROUTED_PREFIX + "not-base64!") is None


def test_cli_help_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["proxy", "--help"])
    assert done.value.code == 0
    assert "--upstream" in capsys.readouterr().out
    for argv in (
        ["proxy"],
        ["proxy", "--upstream", "http://x", "--port", "70000"],
        ["proxy", "--upstream", "http://x", "--api", "grpc"],
    ):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2
    assert main(["proxy", "--upstream", "ftp://example.com"]) == 2
    assert "must be an http:// or https:// URL" in capsys.readouterr().err


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_router_model_picks_and_fills_the_tool(api: str) -> None:
    """--router-model: INTERNAL_ROUTER {"task"} becomes a sub-call on the same upstream, with the long-tail
    candidates as its tools; the tool it calls reaches the client, and the sub-call is booked as "router"."""

    def script(api: str, body: dict[str, Any], number: int) -> Reply:
        system = body["messages"][0]["content"] if api == "openai" else body.get("system")
        if system == ROUTER_SYSTEM:
            offered = [(t.get("function") or t)["name"] for t in body["tools"]]
            assert "weather" in offered
            assert "read_file" not in offered  # a core tool: the main model calls it itself
            return Reply(calls=[("weather", {"city": "Paris"})])
        if number == 0:
            return Reply(calls=[(ROUTER_TOOL, {"task": "weather report for Paris"})])
        return Reply(text="sunny, thanks")

    tools = client_tools(0)
    with ProviderDouble(script) as double, serve(double, api, core=CORE, router_model="router-1") as proxy:
        if api == "openai":
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=SECRET, max_retries=0)
            reply = client.chat.completions.create(
                model="main-1",
                messages=[{"role": "user", "content": "TURN 0: weather?"}],
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": t["name"],
                            "description": t["description"],
                            "parameters": {"type": "object", "properties": t["properties"]},
                        },
                    }
                    for t in tools
                ],
            )
            call = reply.choices[0].message.tool_calls[0]
            got = (call.function.name, json.loads(call.function.arguments))
        else:
            aclient = anthropic.Anthropic(base_url=proxy.url, api_key=SECRET, max_retries=0)
            answer = aclient.messages.create(
                model="main-1",
                max_tokens=100,
                messages=[{"role": "user", "content": "TURN 0: weather?"}],
                tools=[
                    {
                        "name": t["name"],
                        "description": t["description"],
                        "input_schema": {"type": "object", "properties": t["properties"]},
                    }
                    for t in tools
                ],
            )
            use = next(b for b in answer.content if b.type == "tool_use")
            got = (use.name, use.input)
        stats = httpx.get(proxy.url + "/stats", timeout=10).json()
    assert got == ("weather", {"city": "Paris"})
    sub = double.requests[1]
    assert sub.body["model"] == "router-1"
    assert sub.headers["authorization"] == f"Bearer {SECRET}"
    assert stats["total"]["requests"] == 2
    assert stats["total"]["routed_calls"] == 1


def test_provider_errors_come_back_with_their_status() -> None:
    refusal = b'{"error":{"message":"slow down","type":"rate_limit"}}'
    with (
        ProviderDouble(lambda api, body, n: Reply(raw_bodies=refusal, status=429)) as double,
        serve(double, "openai") as proxy,
    ):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": client_tools(0)}
        body["tools"] = [{"type": "function", "function": {"name": "a", "parameters": {}}}]
        reply = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=10)
        unreachable = Proxy(ProxyConfig(upstream="http://127.0.0.1:9/v1", router=RouterConfig(ranker="bm25")))
        with AppThread(create_app(unreachable)) as dead:
            down = httpx.post(dead.url + "/v1/chat/completions", json=body, timeout=10)
    assert reply.status_code == 429
    assert reply.content == refusal
    assert down.status_code == 502
    assert "cannot reach the provider" in down.json()["error"]["message"]


def test_sessions_are_named_by_header_or_by_the_conversations_head(provider: ProviderDouble) -> None:
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}]
    with serve(provider, "openai") as proxy:
        for session, text in (("alpha", "TURN 0: one"), ("beta", "TURN 0: one"), (None, "TURN 0: two")):
            headers = {"x-cacherouter-session": session} if session else {}
            body = {"model": "m", "messages": [{"role": "user", "content": text}], "tools": tools}
            assert httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=headers, timeout=10).is_success
        sessions = httpx.get(proxy.url + "/stats", timeout=10).json()["sessions"]
    assert set(sessions) - {"alpha", "beta"} == {next(s for s in sessions if s.startswith("s-"))}
    assert all(figures["requests"] == 1 for figures in sessions.values())


def test_anthropic_tool_choice_system_and_unknown_fields_pass(provider: ProviderDouble) -> None:
    tools = [{"name": n, "input_schema": {"type": "object"}} for n in ("read_file", "weather")]
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    with serve(provider, "anthropic", core=("read_file",)) as proxy:
        client = anthropic.Anthropic(base_url=proxy.url, api_key="k", max_retries=0)
        client.messages.create(
            model="m",
            max_tokens=10,
            system=system,
            messages=[{"role": "user", "content": "TURN 0: hi"}],
            tools=tools,
            tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
            extra_body={"x_vendor": 1},
        )
    body = provider.requests[0].body
    assert body["tool_choice"] == {"type": "tool", "name": ROUTER_TOOL, "disable_parallel_tool_use": True}
    assert body["system"] == system
    assert body["x_vendor"] == 1
    assert [t["name"] for t in body["tools"]] == [ROUTER_TOOL, "read_file"]


def test_the_command_serves_the_proxy(provider: ProviderDouble) -> None:
    """``cacherouter proxy`` as a user runs it: its own process, on a free port, in front of the double."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "cacherouter.cli",
        "proxy",
        "--upstream",
        provider.url + "/v1",
        "--port",
        str(port),
    ]
    process = subprocess.Popen([*command, "--ranker", "bm25"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/stats", timeout=1)
                break
            except httpx.TransportError:
                assert process.poll() is None, process.stderr.read() if process.stderr else ""
                assert time.monotonic() < deadline, "the proxy did not start within 30 s"
                time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=SECRET, max_retries=0)
        tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}]
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "TURN 0: hi"}], tools=tools
        )
        assert reply.choices[0].message.content == "turn 0 done: "
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    assert "cacherouter proxy (openai API" in stderr
    assert SECRET not in stderr


def test_running_sums_match_the_ledger() -> None:
    """/stats keeps sums, not records; its figures are the Ledger's over the same requests."""
    from cacherouter.models.accounting import Ledger, RequestRecord, pricing_for
    from cacherouter.models.usage import parse_usage
    from cacherouter.proxy.stats import ProxyStats

    usages: list[dict[str, Any] | None] = [
        {"input_tokens": 10, "cache_read_input_tokens": 900, "cache_creation_input_tokens": 90, "output_tokens": 3},
        {"input_tokens": 50, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 950},
        None,  # a provider that said nothing: unknown, not zero
        {"input_tokens": 5, "cache_read_input_tokens": 995},
    ]
    stats = ProxyStats()
    ledger = Ledger()
    for usage in usages:
        stats.record("s", usage, channel="main", tools_digest="")
        parsed = parse_usage(usage)
        ledger.add(RequestRecord(channel="main", usage=parsed, tools_digest="", pricing=pricing_for(None, parsed)))
    summary = ledger.summary()
    total = stats.to_json()["total"]
    assert total == stats.to_json()["sessions"]["s"]
    assert (total["requests"], total["prompt_tokens"], total["cached_tokens"]) == (4, 3000, 1895)
    assert total["unknown_requests"] == summary.unknown_requests == 1
    assert total["cache_write_tokens"] == summary.cache_write_tokens
    assert total["input_cost"] == pytest.approx(summary.cost)
    assert total["cost_ratio"] == pytest.approx(summary.cost_ratio)
    assert total["hit_rate"] == pytest.approx(summary.hit_rate)


def test_eval_via_proxy_keeps_one_tool_segment_and_undercuts_all_tools(capsys: pytest.CaptureFixture[str]) -> None:
    """``cacherouter eval --via-proxy``: the dialogue through the real proxy and a stand-in provider costs less than
    sending all tools (the library's all-tools baseline), with one tool segment at the provider."""
    assert main(["eval", "--workloads", "dialogue", "--architectures", "cacherouter", "all-tools", "--via-proxy"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("Through the proxy") :]
    row = next(line for line in table.splitlines() if line.startswith("dialogue"))
    requests, _, _, _, proxy_cost, library_cost, segments = row.split()[1:]
    all_tools = next(line for line in out.splitlines() if line.startswith("dialogue") and "all-tools" in line)
    all_tools_cost = float(all_tools.split()[-2])
    assert int(segments) == 1
    assert float(proxy_cost.replace(",", "")) < all_tools_cost
    assert float(library_cost.replace(",", "")) > 0
    assert int(requests) > 30
