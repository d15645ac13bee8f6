"""Per-request accounting: usage as reported, and the token-level cache hit rate and cost it implies.

Hit rate = sum(cached) / sum(prompt) over the requests whose provider reported cached tokens; requests with
unknown cached tokens are counted separately and never silently treated as misses. Cost ratio = what the input
cost against what it would have cost with no cache (``(1-h) + h * hit_price``, hit_price = 1/30 for DeepSeek).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field

from .models import ChatModel, ChatRequest, ChatResponse
from .usage import Usage, parse_usage

DEEPSEEK_HIT_PRICE = 1 / 30


@dataclass(frozen=True, kw_only=True)
class RequestRecord:
    channel: str
    usage: Usage
    tools_digest: str


@dataclass(frozen=True, kw_only=True)
class Summary:
    requests: int
    prompt_tokens: int
    cached_tokens: int
    unknown_requests: int
    hit_rate: float | None
    cost_ratio: float | None


@dataclass
class Ledger:
    records: list[RequestRecord] = field(default_factory=list)
    hit_price: float = DEEPSEEK_HIT_PRICE

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, record: RequestRecord) -> None:
        with self._lock:
            self.records.append(record)

    def summary(self, channels: tuple[str, ...] | None = None) -> Summary:
        chosen = [r for r in self.records if channels is None or r.channel in channels]
        known = [r for r in chosen if r.usage.cached_tokens is not None and r.usage.prompt_tokens is not None]
        prompt = sum(r.usage.prompt_tokens or 0 for r in known)
        cached = sum(r.usage.cached_tokens or 0 for r in known)
        hit = cached / prompt if prompt else None
        return Summary(
            requests=len(chosen),
            prompt_tokens=prompt,
            cached_tokens=cached,
            unknown_requests=len(chosen) - len(known),
            hit_rate=hit,
            cost_ratio=None if hit is None else (1 - hit) + hit * self.hit_price,
        )


class RecordingModel:
    """Wraps a model and books every request's usage into a :class:`Ledger`."""

    def __init__(self, inner: ChatModel, ledger: Ledger, *, provider: str | None = None) -> None:
        self.inner = inner
        self.ledger = ledger
        self.provider = provider
        self.name = inner.name

    def complete(self, request: ChatRequest) -> ChatResponse:
        response = self.inner.complete(request)
        digest = hashlib.sha256(request.tools_json.encode("utf-8")).hexdigest()
        self.ledger.add(
            RequestRecord(
                channel=request.channel, usage=parse_usage(response.usage, self.provider), tools_digest=digest
            )
        )
        return response
