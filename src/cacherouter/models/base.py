"""Chat models: one request/response shape, and scripted models (the HTTP client is :mod:`cacherouter.models.endpoint`).

The tool segment travels as canonical JSON text (``ChatRequest.tools_json``) and is spliced into the HTTP body
verbatim, so the bytes the provider receives are exactly the bytes the invariance test checks. The model's own
replies go back into later requests as it produced them (:meth:`ChatResponse.assistant_message`): a provider
persists its output as a cache boundary, so the next request hits through a reply only if it repeats its bytes.

Scripted models answer from a Python function instead of a network; :class:`SimulatedProvider` wraps any model
and attaches the ``usage`` object a provider would have returned, computed by the offline cache model. Numbers
produced this way are labelled "scripted" wherever they are printed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..canonical import canonical_json
from .prompt_cache import PrefixCacheModel, render_message, tokenize_request
from .tokens import Tokenizer, default_tokenizer

Message = dict[str, Any]
# A leading reasoning block that some servers (llama-server, vLLM without a reasoning parser) leave in the content.
THINK_BLOCK = re.compile(r"\s*<think>(.*?)</think>\s*", re.DOTALL)


@dataclass(frozen=True, kw_only=True)
class ChatToolCall:
    """One tool call. ``arguments`` is always an object; the other two fields decide what the history replays.

    ``raw_arguments`` is set only when the model sent arguments that are not a JSON object: the agent quotes it in
    the error result, and the history replays ``"{}"``, because strict servers (vLLM, SGLang, llama-server) answer
    HTTP 400 to any later request whose history holds invalid arguments. ``arguments_json`` is the provider's own
    text of valid object arguments, replayed byte for byte: re-serialising it would change the model's output
    tokens and lose the cache hit through the reply. Calls built in Python leave both empty (canonical JSON).
    """

    id: str
    name: str
    arguments: dict[str, Any]
    raw_arguments: str = ""
    arguments_json: str = ""

    def to_message(self) -> dict[str, Any]:
        text = "{}" if self.raw_arguments else (self.arguments_json or canonical_json(self.arguments))
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": text}}


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    messages: tuple[Message, ...]
    tools_json: str = ""  # canonical JSON array of tool definitions, "" for none
    tool_choice: str | None = None  # "auto", "none", "required" or None (provider default)
    max_tokens: int | None = None
    channel: str = "main"  # "triage", "main", "router", "fallback": for accounting only


@dataclass(frozen=True, kw_only=True)
class ChatResponse:
    content: str = ""  # the answer text; a leading <think> block is moved to ``think_block``
    tool_calls: tuple[ChatToolCall, ...] = ()
    usage: Mapping[str, Any] = field(default_factory=dict)
    model: str = ""
    # Why the provider stopped: "stop", "tool_calls", "length" (cut off), "content_filter"; None if not said.
    finish_reason: str | None = None
    # The provider's ``reasoning_content`` field (DeepSeek thinking mode, reasoning parsers); None when absent.
    reasoning_content: str | None = None
    # A leading "<think>...</think>" block the server left inline in the content, exactly as sent; "" if none.
    think_block: str = ""

    @property
    def reasoning(self) -> str:
        """The model's reasoning, wherever the server put it: for logs, never part of the answer."""
        if self.reasoning_content is not None:
            return self.reasoning_content
        match = THINK_BLOCK.match(self.think_block)
        return match.group(1).strip() if match else ""

    def assistant_message(self) -> Message:
        """The reply as later requests replay it.

        A reply with tool calls goes back with its reasoning, as the server sent it. DeepSeek's thinking mode
        answers HTTP 400 unless every later request carries the ``reasoning_content`` of each assistant message
        that called tools (api-docs.deepseek.com/guides/thinking_mode); the field is sent only when the provider
        sent it, so other providers see no new field, and the older ``deepseek-reasoner``, which rejects it in
        input, never called tools. An inline think block goes back inline: chat templates that keep reasoning
        inside a tool loop (Qwen3) then render the tokens the model produced, and the cache hits through the
        reply. A reply without tool calls goes back without reasoning: templates drop the reasoning of finished
        turns anyway, and the turn's short summary is read from this message.
        """
        if not self.tool_calls:
            return {"role": "assistant", "content": self.content}
        message: Message = {"role": "assistant", "content": self.think_block + self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
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
