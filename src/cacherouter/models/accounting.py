"""Per-request accounting: usage as reported, and the token-level cache hit rate and cost it implies.

Hit rate = sum(cached) / sum(prompt) over the requests whose provider reported cached tokens; requests with
unknown cached tokens are counted separately and never silently treated as misses.

Cost is *relative*: input tokens priced in units of one uncached input token, with each provider's own discount
(:data:`PRICING`: DeepSeek hits 1/30, OpenAI hits 0.5, Anthropic reads 0.1 and writes 1.25). No dollar prices are
assumed. Where the provider is not known, the cost is unknown (None), never a guess. Cost ratio = input cost
against what it would have cost with no cache.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field

from .base import ChatModel, ChatRequest, ChatResponse
from .prompt_cache import Pricing, cache_model
from .usage import Usage, normalize_provider, parse_usage

# One source of truth for the discounts: the offline cache models of the same providers.
PRICING: dict[str, Pricing] = {name: cache_model(name).pricing for name in ("deepseek", "openai", "anthropic")}
# Usage fields only these providers send, so they identify the provider even when none is configured.
_SELF_NAMING = ("deepseek", "anthropic")


def pricing_for(provider: str | None, usage: Usage) -> Pricing | None:
    """The relative prices of the provider that served ``usage``, or None when they are not known.

    A configured ``provider`` is trusted. Without one, only DeepSeek's and Anthropic's own usage fields name the
    provider: OpenAI-style fields are also sent by vLLM, SGLang and llama.cpp, whose prices we cannot know.
    """
    name = normalize_provider(provider) if provider else (usage.provider if usage.provider in _SELF_NAMING else None)
    return PRICING.get(name) if name else None


def request_cost(usage: Usage, pricing: Pricing | None) -> float | None:
    """Input cost of one request in uncached-token units; None if the price or the cached tokens are unknown."""
    if pricing is None or usage.prompt_tokens is None or usage.cached_tokens is None:
        return None
    written = usage.cache_write_tokens or 0  # Anthropic bills cache writes above the base price
    rest = usage.prompt_tokens - usage.cached_tokens - written
    return usage.cached_tokens * pricing.hit + written * pricing.write + rest * pricing.miss


@dataclass(frozen=True, kw_only=True)
class RequestRecord:
    channel: str
    usage: Usage
    tools_digest: str
    pricing: Pricing | None = None  # the serving provider's relative prices; None = unknown

    @property
    def cost(self) -> float | None:
        """Relative input cost (see module docstring); None = unknown."""
        return request_cost(self.usage, self.pricing)


@dataclass(frozen=True, kw_only=True)
class Summary:
    requests: int
    prompt_tokens: int
    cached_tokens: int
    unknown_requests: int
    hit_rate: float | None
    cost_ratio: float | None
    cache_write_tokens: int = 0
    cost: float | None = None  # relative input cost of the requests with known cached tokens; None = unknown


@dataclass
class Ledger:
    records: list[RequestRecord] = field(default_factory=list)

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
        costs = [r.cost for r in known]
        # One request at an unknown price makes the total unknown: a partial sum would look like a saving.
        priced = bool(known) and None not in costs
        return Summary(
            requests=len(chosen),
            prompt_tokens=prompt,
            cached_tokens=cached,
            unknown_requests=len(chosen) - len(known),
            hit_rate=cached / prompt if prompt else None,
            cost_ratio=_cost_ratio(known, prompt) if priced and prompt else None,
            cache_write_tokens=sum(r.usage.cache_write_tokens or 0 for r in known),
            cost=sum(c for c in costs if c is not None) if priced else None,
        )


def _cost_ratio(records: list[RequestRecord], prompt: int) -> float:
    """Sum over each pricing of its prompt share times ``(1-h-w)*miss + h*hit + w*write`` (h, w: hit and write
    rates). Written in rates so that one pricing gives exactly the figure ``(1-h) + h*hit`` reported so far."""
    groups: dict[Pricing, list[RequestRecord]] = {}
    for record in records:
        if record.pricing is not None:
            groups.setdefault(record.pricing, []).append(record)
    ratio = 0.0
    for pricing, group in groups.items():
        share = sum(r.usage.prompt_tokens or 0 for r in group)
        if share:
            hit = sum(r.usage.cached_tokens or 0 for r in group) / share
            write = sum(r.usage.cache_write_tokens or 0 for r in group) / share
            rates = (1 - hit - write) * pricing.miss + hit * pricing.hit + write * pricing.write
            ratio += share / prompt * rates
    return ratio


class RecordingModel:
    """Wraps a model and books every request's usage and relative cost into a :class:`Ledger`."""

    def __init__(self, inner: ChatModel, ledger: Ledger, *, provider: str | None = None) -> None:
        self.inner = inner
        self.ledger = ledger
        self.provider = normalize_provider(provider)  # an unknown name fails here, before any request
        self.name = inner.name

    def complete(self, request: ChatRequest) -> ChatResponse:
        response = self.inner.complete(request)
        digest = hashlib.sha256(request.tools_json.encode("utf-8")).hexdigest()
        usage = parse_usage(response.usage, self.provider)
        pricing = pricing_for(self.provider, usage)
        self.ledger.add(RequestRecord(channel=request.channel, usage=usage, tools_digest=digest, pricing=pricing))
        return response
