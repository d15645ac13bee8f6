"""The OpenAI-compatible chat-completions client: any endpoint (DeepSeek, OpenAI, vLLM, SGLang, llama.cpp...)
configured by environment variables (:meth:`EndpointConfig.from_env`).

Every failure becomes :class:`~cacherouter.errors.ModelError`: unreachable or misbehaving servers, answers that are
not the chat-completions shape, and the request's total deadline passing. 429 and 5xx answers and refused or
reset connections are retried with backoff (honouring ``Retry-After``) within that deadline.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import math
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ..canonical import canonical_json
from ..errors import ConfigError, ModelError
from .base import THINK_BLOCK, ChatRequest, ChatResponse, ChatToolCall
from .usage import normalize_provider

MAIN_PREFIX = "CACHEROUTER_MAIN"
ROUTER_PREFIX = "CACHEROUTER_ROUTER"
_N = TypeVar("_N", int, float)  # what a numeric setting holds
# Answers a later attempt may get right (rate limit, overload, gateway trouble). A 4xx other than 429 never is.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True, kw_only=True)
class EndpointConfig:
    """One OpenAI-compatible endpoint, from environment variables (see :meth:`from_env`)."""

    base_url: str
    model: str
    api_key: str = ""
    provider: str | None = None  # usage-field dialect, one of usage.PROVIDERS; None = detect from the response
    timeout: float = 120.0  # seconds for the whole request: connection, every read, retries and their waits
    retries: int = 2  # further attempts after a 429, 500, 502, 503, 504 or a refused or reset connection
    retry_backoff: float = 0.5  # seconds before the first retry; doubled for each further one, with jitter
    max_retry_wait: float = 30.0  # the longest Retry-After honoured
    env_prefix: str = MAIN_PREFIX  # where the settings came from: error messages name its variables

    @classmethod
    def from_env(cls, prefix: str, env: Mapping[str, str] | None = None) -> EndpointConfig:
        """Read ``{prefix}_BASE_URL``, ``_MODEL``, ``_API_KEY``, ``_PROVIDER``, ``_TIMEOUT`` and ``_RETRIES``.

        ``prefix`` is ``CACHEROUTER_MAIN`` or ``CACHEROUTER_ROUTER``. The router falls back to the main settings as
        a whole, and only when ``CACHEROUTER_ROUTER_BASE_URL`` is unset. Once it is set, only router variables are
        read: a missing ``CACHEROUTER_ROUTER_API_KEY`` means no key (local servers need none), because sending the
        main key to another host would leak it. ``_PROVIDER`` is checked against :data:`usage.PROVIDERS`. Every
        value is checked here, so a bad setting stops the program at start-up rather than at the first message.
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
        _check_base_url(base_url, f"{prefix}_BASE_URL")
        timeout = _seconds(get("TIMEOUT") or "120", f"{prefix}_TIMEOUT")
        retries = _count(get("RETRIES") or "2", f"{prefix}_RETRIES")
        try:
            provider = normalize_provider(get("PROVIDER"))
        except ConfigError as e:
            raise ConfigError(f"{prefix}_PROVIDER: {e}") from e
        return cls(
            base_url=base_url.rstrip("/"),
            model=model,
            api_key=get("API_KEY"),
            provider=provider,
            timeout=timeout,
            retries=retries,
            env_prefix=prefix,
        )


def _check_base_url(url: str, variable: str) -> None:
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # raises ValueError for a port that is not a number in range
    except ValueError as e:
        raise ConfigError(f"{variable} is not a valid URL: {url!r}") from e
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{variable} must be an http:// or https:// URL with a host, such as https://api.deepseek.com "
            f"or http://127.0.0.1:8000/v1; got {url!r}"
        )


def _seconds(text: str, variable: str) -> float:
    return _number(
        text, variable, float, lambda value: math.isfinite(value) and value > 0, "a finite number of seconds above 0"
    )


def _count(text: str, variable: str) -> int:
    return _number(text, variable, int, lambda value: value >= 0, "a whole number, 0 or more")


def _number(text: str, variable: str, convert: Callable[[str], _N], accept: Callable[[_N], bool], must: str) -> _N:
    """The setting ``variable`` (``text``) read by ``convert`` and ``accept``-ed, else "... must be ``must``"."""
    message = f"{variable} must be {must}, got {text!r}"
    try:
        value = convert(text)
    except ValueError as e:
        raise ConfigError(message) from e
    if not accept(value):
        raise ConfigError(message)
    return value


class OpenAICompatibleModel:
    """A chat-completions client for any OpenAI-compatible endpoint (DeepSeek, OpenAI, vLLM, llama.cpp...).

    ``config.timeout`` bounds the whole request -- connection, every read, retries and the waits between them --
    not each socket read, so a server trickling bytes cannot hold a turn longer. A 429, 500, 502, 503 or 504 and
    a refused or reset connection are retried ``config.retries`` times, after an exponential backoff with jitter
    or the server's ``Retry-After``; any other failure raises :class:`ModelError` at once. ``sleep`` is the
    function that waits between attempts (tests pass one that records instead).
    """

    def __init__(self, config: EndpointConfig, *, sleep: Callable[[float], None] = time.sleep) -> None:
        self.config = config
        self.name = config.model
        self._sleep = sleep

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
        body = self.request_body(request)
        deadline = time.monotonic() + self.config.timeout
        attempt = 1
        while True:
            try:
                answer = self._post(url, body, deadline)
            except _TransientError as e:
                self._wait_for_retry(e, attempt, deadline)
                attempt += 1
                continue
            return parse_completion(_decode_json(url, answer))

    def _wait_for_retry(self, error: _TransientError, attempt: int, deadline: float) -> None:
        """Sleep before the next attempt, or raise :class:`ModelError` when no attempt is left or time is out."""
        tried = f"; gave up after {attempt} attempts" if attempt > 1 else ""
        if attempt > self.config.retries:
            raise ModelError(f"{error}{tried}") from error
        if error.retry_after is not None:
            wait = min(error.retry_after, self.config.max_retry_wait)
        else:
            wait = self.config.retry_backoff * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)
        if time.monotonic() + wait >= deadline:
            raise ModelError(
                f"{error}{tried}; waiting {wait:g} s for another attempt would pass the {self.config.timeout:g} s "
                f"limit ({self.config.env_prefix}_TIMEOUT)"
            ) from error
        self._sleep(wait)

    def _post(self, url: str, body: bytes, deadline: float) -> bytes:
        """One attempt: the answer's body, or :class:`_TransientError` for what another attempt may cure."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise self._timed_out(url)
        headers = {"Content-Type": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        http_request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        watchdog = _Watchdog(remaining)
        opener = urllib.request.build_opener(_WatchedHTTPHandler(watchdog), _WatchedHTTPSHandler(watchdog))
        try:
            with opener.open(http_request, timeout=remaining) as reply:
                answer: bytes = reply.read()
        except urllib.error.HTTPError as e:
            raise self._status_error(url, e, watchdog) from e
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise self._transport_error(url, e, watchdog) from e
        finally:
            watchdog.cancel()
        if watchdog.fired:  # a body read until the connection closed ends quietly when the watchdog closes it
            raise self._timed_out(url)
        return answer

    def _status_error(self, url: str, error: urllib.error.HTTPError, watchdog: _Watchdog) -> ModelError:
        try:
            detail = error.read().decode("utf-8", errors="replace")[:500]
        except (OSError, http.client.HTTPException):
            detail = ""
        if watchdog.fired:
            return self._timed_out(url)
        message = f"{url} answered HTTP {error.code}: {detail}"
        if error.code in RETRY_STATUSES:
            return _TransientError(message, retry_after=_retry_after(error.headers.get("Retry-After")))
        if error.code in (401, 403):
            message += f"; check {self.config.env_prefix}_API_KEY"
        return ModelError(message)

    def _transport_error(self, url: str, error: Exception, watchdog: _Watchdog) -> ModelError:
        reason = error.reason if isinstance(error, urllib.error.URLError) else error
        if watchdog.fired or isinstance(reason, TimeoutError):
            return self._timed_out(url)
        where = f"check {self.config.env_prefix}_BASE_URL and the network"
        if isinstance(reason, ConnectionError):  # refused, reset, closed before answering: worth another attempt
            return _TransientError(f"cannot reach {url}: {reason}; {where}")
        if isinstance(reason, http.client.IncompleteRead):
            return ModelError(
                f"{url} cut its answer short ({len(reason.partial)} bytes received, {reason.expected} missing)"
            )
        if isinstance(reason, http.client.HTTPException):
            return ModelError(
                f"{url} did not answer HTTP ({type(reason).__name__}: {str(reason)[:100]!r}); "
                f"is {self.config.env_prefix}_BASE_URL the address of a chat-completions API?"
            )
        if isinstance(reason, ValueError):
            return ModelError(f"cannot send the request to {url}: {reason}")
        return ModelError(f"cannot reach {url}: {reason}; {where}")

    def _timed_out(self, url: str) -> ModelError:
        return ModelError(
            f"timed out: {url} did not answer within {self.config.timeout:g} s; raise "
            f"{self.config.env_prefix}_TIMEOUT if the model needs longer"
        )


class _TransientError(ModelError):
    """A failure another attempt may cure; ``retry_after`` is the server's requested wait in seconds, if any."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def _retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header, given as seconds or as an HTTP date; None if absent or unreadable."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return max(0.0, seconds) if math.isfinite(seconds) else None


class _Watchdog:
    """Shuts a request's connections down at its deadline, so that no read outlives it.

    A socket timeout bounds each read on its own: a server sending a byte at a time, in the headers or in the
    body, would hold the request for as long as it likes. Shutting the socket down ends whichever read is waiting.
    """

    def __init__(self, seconds: float) -> None:
        self.fired = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            fired = self.fired
        if fired:
            _shut_down(sock)

    def cancel(self) -> None:
        self._timer.cancel()

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut_down(sock)


def _shut_down(sock: socket.socket) -> None:
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's method, also under a TLS socket
    except OSError:
        pass  # already closed: nothing left to stop


class _WatchedHTTPConnection(http.client.HTTPConnection):
    """A connection whose socket the watchdog can shut down once connected."""

    def __init__(self, host: str, *, watchdog: _Watchdog | None = None, **kwargs: Any) -> None:
        super().__init__(host, **kwargs)
        self._watchdog = watchdog

    def connect(self) -> None:
        super().connect()  # HTTPSConnection.connect wraps the socket in TLS here, before the watch
        if self._watchdog is not None:
            self._watchdog.watch(self.sock)


class _WatchedHTTPSConnection(_WatchedHTTPConnection, http.client.HTTPSConnection):
    pass


class _Watched:
    """urllib's handlers (so proxies from the environment still apply) on connections the watchdog can stop."""

    def __init__(self, watchdog: _Watchdog) -> None:
        super().__init__()
        self._watchdog = watchdog


class _WatchedHTTPHandler(_Watched, urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_WatchedHTTPConnection, req, watchdog=self._watchdog)


class _WatchedHTTPSHandler(_Watched, urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_WatchedHTTPSConnection, req, watchdog=self._watchdog)


def _decode_json(url: str, answer: bytes) -> Any:
    try:
        text = answer.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelError(f"{url} answered bytes that are not UTF-8 text: {answer[:60]!r}") from e
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ModelError(f"{url} did not answer JSON ({e}): {text[:200]!r}") from e


def parse_completion(data: Any) -> ChatResponse:
    """Turn a chat-completions JSON answer into a :class:`ChatResponse`; raise :class:`ModelError` if malformed."""
    if not isinstance(data, Mapping):
        raise ModelError(f"the answer is not a JSON object: {_excerpt(data)}")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        if "error" in data:
            raise ModelError(f"the provider answered an error: {_excerpt(data['error'])}")
        raise ModelError(f"the answer has no choices: {_excerpt(data)}")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, Mapping) else None
    if not isinstance(message, Mapping):
        raise ModelError(f"the answer's choices[0].message is not an object: {_excerpt(choice)}")
    content, think_block = _split_think(_content_text(message.get("content")))
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ModelError(f"the answer's reasoning_content is not text: {_excerpt(reasoning)}")
    usage = data.get("usage")
    if usage is not None and not isinstance(usage, Mapping):
        raise ModelError(f"the answer's usage is not an object: {_excerpt(usage)}")
    model, reason = data.get("model"), choice.get("finish_reason")
    return ChatResponse(
        content=content,
        tool_calls=_tool_calls(message.get("tool_calls")),
        usage=dict(usage or {}),
        model=model if isinstance(model, str) else "",
        finish_reason=reason if isinstance(reason, str) and reason else None,
        reasoning_content=reasoning,
        think_block=think_block,
    )


def _excerpt(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)[:300]


def _content_text(content: Any) -> str:
    """The message content as text: a list of content parts is joined (parts without text, such as images, add
    nothing)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in ("text", "refusal"):
                text = part.get(str(part["type"]))
                texts.append(text if isinstance(text, str) else "")
        return "".join(texts)
    raise ModelError(f"the answer's message content is neither text nor a list of parts: {_excerpt(content)}")


def _split_think(text: str) -> tuple[str, str]:
    """``(content, think_block)``: a leading, closed ``<think>`` block is not part of the answer. An unclosed one
    is left in place: where the reasoning would end is unknown, and showing it beats showing nothing."""
    match = THINK_BLOCK.match(text)
    if match is None:
        return text, ""
    return text[match.end() :], text[: match.end()]


def _tool_calls(raw_calls: Any) -> tuple[ChatToolCall, ...]:
    if raw_calls is None:
        return ()
    if not isinstance(raw_calls, list):
        raise ModelError(f"the answer's tool_calls is not a list: {_excerpt(raw_calls)}")
    calls: list[ChatToolCall] = []
    seen: set[str] = set()
    for index, raw in enumerate(raw_calls):
        function = raw.get("function") if isinstance(raw, Mapping) else None
        if not isinstance(function, Mapping):
            raise ModelError(f"the answer's tool_calls[{index}] is not a function call: {_excerpt(raw)}")
        name = function.get("name") or ""
        if not isinstance(name, str):
            raise ModelError(f"the answer's tool_calls[{index}] has a name that is not text: {_excerpt(name)}")
        call_id = raw.get("id")
        if not isinstance(call_id, str) or not call_id or call_id in seen:
            # Results are paired with calls by id, across the whole history: "call_0" in every round would not do.
            call_id = f"call_{uuid.uuid4().hex[:24]}"
        seen.add(call_id)
        calls.append(_tool_call(call_id, name, function.get("arguments")))
    return tuple(calls)


def _tool_call(call_id: str, name: str, value: Any) -> ChatToolCall:
    """A call whose arguments are a JSON object, or one that keeps what the model sent for the agent's error."""
    if value is None or value == "":
        return ChatToolCall(id=call_id, name=name, arguments={})
    if isinstance(value, str):
        try:
            parsed = json.loads(value, parse_constant=_reject_constant, parse_float=_finite_float)
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, dict):
            return ChatToolCall(id=call_id, name=name, arguments=parsed, arguments_json=value)
        return ChatToolCall(id=call_id, name=name, arguments={}, raw_arguments=value)
    if isinstance(value, Mapping):  # some servers send the object itself instead of its JSON text
        try:
            canonical_json(value)  # rejects NaN and infinities, which could not be sent back
        except ValueError:
            pass
        else:
            return ChatToolCall(id=call_id, name=name, arguments=dict(value))
    return ChatToolCall(id=call_id, name=name, arguments={}, raw_arguments=json.dumps(value, ensure_ascii=False))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value
