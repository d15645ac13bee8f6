"""Chat models: one request/response shape, an OpenAI-compatible HTTP client, and scripted models.

The tool segment travels as canonical JSON text (``ChatRequest.tools_json``) and is spliced into the HTTP body
verbatim, so the bytes the provider receives are exactly the bytes the invariance test checks.

Scripted models answer from a Python function instead of a network; :class:`SimulatedProvider` wraps any model
and attaches the ``usage`` object a provider would have returned, computed by the offline cache model. Numbers
produced this way are labelled "scripted" wherever they are printed.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from .cachemodel import PrefixCacheModel, render_message, tokenize_request
from .canonical import canonical_json
from .errors import ConfigError, ModelError
from .tokens import Tokenizer, default_tokenizer
from .usage import normalize_provider

Message = dict[str, Any]
MAIN_PREFIX = "CACHEROUTER_MAIN"
ROUTER_PREFIX = "CACHEROUTER_ROUTER"


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]
    raw_arguments: str = ""  # what the model sent, when it was not a JSON object

    def to_message(self) -> dict[str, Any]:
        args = self.raw_arguments or canonical_json(self.arguments)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": args}}


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    messages: tuple[Message, ...]
    tools_json: str = ""  # canonical JSON array of tool definitions, "" for none
    tool_choice: str | None = None  # "auto", "none", "required" or None (provider default)
    max_tokens: int | None = None
    channel: str = "main"  # "triage", "main", "router", "fallback": for accounting only


@dataclass(frozen=True, kw_only=True)
class ChatResponse:
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Mapping[str, Any] = field(default_factory=dict)
    model: str = ""
    # Why the provider stopped: "stop", "tool_calls", "length" (cut off), "content_filter"; None if not said.
    finish_reason: str | None = None

    def assistant_message(self) -> Message:
        message: Message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.to_message() for call in self.tool_calls]
        return message


class ChatModel(Protocol):
    name: str

    def complete(self, request: ChatRequest) -> ChatResponse: ...


class ScriptedModel:
    """A model whose answers come from ``respond(request)``: for tests and the offline evaluation."""

    def __init__(self, respond: Callable[[ChatRequest], ChatResponse], *, name: str = "scripted") -> None:
        self._respond = respond
        self.name = name
        self.requests: list[ChatRequest] = []

    def complete(self, request: ChatRequest) -> ChatResponse:
        self.requests.append(request)
        return replace(self._respond(request), model=self.name)


class SimulatedProvider:
    """Wraps a model and fills in ``usage`` from an offline cache model, as the named provider would."""

    def __init__(self, inner: ChatModel, cache: PrefixCacheModel, *, tokenizer: Tokenizer | None = None) -> None:
        self.inner = inner
        self.cache = cache
        self.tokenizer = tokenizer or default_tokenizer()
        self.name = f"{inner.name}@simulated-{cache.provider}"

    def complete(self, request: ChatRequest) -> ChatResponse:
        tokens = tokenize_request(self.tokenizer, request.tools_json, request.messages)
        outcome = self.cache.lookup(tokens)
        response = self.inner.complete(request)
        reply = self.tokenizer.encode(render_message(response.assistant_message()))
        self.cache.store_output([*tokens, *reply])
        return replace(response, usage=self.cache.usage_fields(outcome, len(reply)))


@dataclass(frozen=True, kw_only=True)
class EndpointConfig:
    """One OpenAI-compatible endpoint, from environment variables (see :meth:`from_env`)."""

    base_url: str
    model: str
    api_key: str = ""
    provider: str | None = None  # usage-field dialect, one of usage.PROVIDERS; None = detect from the response
    timeout: float = 120.0

    @classmethod
    def from_env(cls, prefix: str, env: Mapping[str, str] | None = None) -> EndpointConfig:
        """Read ``{prefix}_BASE_URL``, ``_MODEL``, ``_API_KEY``, ``_PROVIDER`` and ``_TIMEOUT``.

        ``prefix`` is ``CACHEROUTER_MAIN`` or ``CACHEROUTER_ROUTER``. The router falls back to the main settings as
        a whole, and only when ``CACHEROUTER_ROUTER_BASE_URL`` is unset. Once it is set, only router variables are
        read: a missing ``CACHEROUTER_ROUTER_API_KEY`` means no key (local servers need none), because sending the
        main key to another host would leak it. ``_PROVIDER`` is checked against :data:`usage.PROVIDERS`.
        """
        env = os.environ if env is None else env
        if prefix != MAIN_PREFIX and not env.get(f"{prefix}_BASE_URL"):
            prefix = MAIN_PREFIX

        def get(name: str) -> str:
            return env.get(f"{prefix}_{name}") or ""

        base_url, model = get("BASE_URL"), get("MODEL")
        if not base_url or not model:
            raise ConfigError(
                f"set {prefix}_BASE_URL and {prefix}_MODEL (e.g. https://api.deepseek.com and deepseek-chat), "
                f"and {prefix}_API_KEY if the endpoint needs one"
            )
        timeout_text = get("TIMEOUT") or "120"
        try:
            timeout = float(timeout_text)
        except ValueError as e:
            raise ConfigError(f"{prefix}_TIMEOUT must be a number of seconds, got {timeout_text!r}") from e
        try:
            provider = normalize_provider(get("PROVIDER"))
        except ConfigError as e:
            raise ConfigError(f"{prefix}_PROVIDER: {e}") from e
        return cls(
            base_url=base_url.rstrip("/"), model=model, api_key=get("API_KEY"), provider=provider, timeout=timeout
        )


class OpenAICompatibleModel:
    """A chat-completions client for any OpenAI-compatible endpoint (DeepSeek, OpenAI, vLLM, llama.cpp...)."""

    def __init__(self, config: EndpointConfig) -> None:
        self.config = config
        self.name = config.model

    def request_body(self, request: ChatRequest) -> bytes:
        """The exact HTTP body: the canonical tool segment is spliced in as-is, never re-serialised."""
        payload: dict[str, Any] = {"model": self.config.model, "messages": list(request.messages)}
        if request.max_tokens is not None:
            payload["max_tokens"] = request.max_tokens
        if request.tools_json:
            if request.tool_choice is not None:
                payload["tool_choice"] = request.tool_choice
            head = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
            return (head[:-1] + ',"tools":' + request.tools_json + "}").encode("utf-8")
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    def complete(self, request: ChatRequest) -> ChatResponse:
        url = f"{self.config.base_url}/chat/completions"
        headers = {"Content-Type": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        http_request = urllib.request.Request(url, data=self.request_body(request), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(http_request, timeout=self.config.timeout) as reply:
                data = json.loads(reply.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", errors="replace")[:500]
            raise ModelError(f"{url} answered HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise ModelError(f"cannot reach {url}: {e}; check CACHEROUTER_*_BASE_URL and the network") from e
        except json.JSONDecodeError as e:
            raise ModelError(f"{url} did not answer JSON: {e}") from e
        return parse_completion(data)


def parse_completion(data: Mapping[str, Any]) -> ChatResponse:
    """Turn a chat-completions JSON answer into a :class:`ChatResponse`."""
    try:
        message = data["choices"][0]["message"]
    except (KeyError, IndexError, TypeError) as e:
        raise ModelError(f"answer has no choices[0].message: {str(data)[:300]}") from e
    calls: list[ToolCall] = []
    for index, raw in enumerate(message.get("tool_calls") or []):
        function = raw.get("function") or {}
        text = function.get("arguments") or "{}"
        try:
            arguments = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError:
            arguments = None
        if isinstance(arguments, dict):
            calls.append(
                ToolCall(
                    id=str(raw.get("id") or f"call_{index}"), name=str(function.get("name", "")), arguments=arguments
                )
            )
        else:
            calls.append(
                ToolCall(
                    id=str(raw.get("id") or f"call_{index}"),
                    name=str(function.get("name", "")),
                    arguments={},
                    raw_arguments=str(text),
                )
            )
    return ChatResponse(
        content=str(message.get("content") or ""),
        tool_calls=tuple(calls),
        usage=dict(data.get("usage") or {}),
        model=str(data.get("model", "")),
        finish_reason=_finish_reason(data),
    )


def _finish_reason(data: Mapping[str, Any]) -> str | None:
    reason = data["choices"][0].get("finish_reason")
    return reason if isinstance(reason, str) and reason else None
