"""The proxy's accounting: every provider response's usage, per session and in total, for ``/stats`` and ``/metrics``.

Usage is read with :func:`cacherouter.models.usage.parse_usage` (both APIs' fields: OpenAI's
``prompt_tokens_details.cached_tokens``, DeepSeek's ``prompt_cache_hit_tokens``, Anthropic's
``cache_read_input_tokens`` / ``cache_creation_input_tokens`` / ``input_tokens``) and priced with
:mod:`cacherouter.models.accounting` (relative input cost: one uncached input token = 1; unknown when the
provider's prices are unknown, e.g. a self-hosted vLLM). Sessions are kept in a bounded LRU; the totals count every
request ever seen, evicted sessions included.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..models.accounting import RequestRecord, pricing_for
from ..models.usage import parse_usage


@dataclass
class SessionStats:
    """Running sums (never a list of records: a long-running proxy must not grow with every request).

    The figures follow :meth:`cacherouter.models.accounting.Ledger.summary`: only requests whose provider reported its
    cached tokens count towards the token sums; one request at an unknown price makes the cost unknown.
    """

    requests: int = 0
    unknown_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    cost: float = 0.0
    unpriced: int = 0
    routed_calls: int = 0
    proxy_answered_calls: int = 0
    hidden_rounds: int = 0

    def add(self, record: RequestRecord) -> None:
        self.requests += 1
        usage = record.usage
        if usage.prompt_tokens is None or usage.cached_tokens is None:
            self.unknown_requests += 1
            return
        self.prompt_tokens += usage.prompt_tokens
        self.cached_tokens += usage.cached_tokens
        self.cache_write_tokens += usage.cache_write_tokens or 0
        cost = record.cost
        if cost is None:
            self.unpriced += 1
        else:
            self.cost += cost


def summary_json(stats: SessionStats) -> dict[str, Any]:
    known = stats.requests - stats.unknown_requests
    cost = stats.cost if known and not stats.unpriced else None
    return {
        "requests": stats.requests,
        "prompt_tokens": stats.prompt_tokens,
        "cached_tokens": stats.cached_tokens,
        "uncached_tokens": stats.prompt_tokens - stats.cached_tokens - stats.cache_write_tokens,
        "cache_write_tokens": stats.cache_write_tokens,
        "unknown_requests": stats.unknown_requests,
        "hit_rate": stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else None,
        "input_cost": cost,
        # What Ledger's per-pricing sum comes to when every request is priced: cost over prompt tokens.
        "cost_ratio": cost / stats.prompt_tokens if cost is not None and stats.prompt_tokens else None,
        "routed_calls": stats.routed_calls,
        "proxy_answered_calls": stats.proxy_answered_calls,
        "hidden_rounds": stats.hidden_rounds,
    }


class ProxyStats:
    """Thread-safe usage books: one :class:`SessionStats` per session (bounded) and one for everything."""

    def __init__(self, *, provider: str | None = None, max_sessions: int = 1024) -> None:
        self.provider = provider
        self.max_sessions = max_sessions
        self.total = SessionStats()
        self._sessions: OrderedDict[str, SessionStats] = OrderedDict()
        self._lock = threading.Lock()

    def _session_locked(self, session: str) -> SessionStats:
        stats = self._sessions.get(session)
        if stats is None:
            stats = self._sessions[session] = SessionStats()
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session)
        return stats

    def record(self, session: str, usage: dict[str, Any] | None, *, channel: str, tools_digest: str) -> None:
        parsed = parse_usage(usage, self.provider)
        record = RequestRecord(
            channel=channel, usage=parsed, tools_digest=tools_digest, pricing=pricing_for(self.provider, parsed)
        )
        with self._lock:
            self._session_locked(session).add(record)
            self.total.add(record)

    def count(self, session: str, *, routed: int = 0, answered: int = 0, hidden_rounds: int = 0) -> None:
        with self._lock:
            for stats in (self._sessions.get(session), self.total):
                if stats is not None:
                    stats.routed_calls += routed
                    stats.proxy_answered_calls += answered
                    stats.hidden_rounds += hidden_rounds

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {
                "provider": self.provider,
                "cost_unit": "one uncached input token at the provider's price",
                "total": summary_json(self.total),
                "sessions": {name: summary_json(stats) for name, stats in self._sessions.items()},
            }

    def prometheus(self) -> str:
        """The figures in the Prometheus text exposition format (version 0.0.4)."""
        data = self.to_json()
        metrics = (
            ("requests", "requests", "counter", "provider requests made (router sub-calls included)"),
            ("prompt_tokens", "prompt_tokens", "counter", "input tokens the provider reported"),
            ("cached_tokens", "cached_tokens", "counter", "input tokens read from the provider's cache"),
            ("cache_write_tokens", "cache_write_tokens", "counter", "input tokens written to the cache"),
            ("uncached_tokens", "uncached_tokens", "counter", "input tokens neither read nor written"),
            ("unknown_requests", "unknown_usage_requests", "counter", "requests whose cached tokens are unknown"),
            ("input_cost", "input_cost", "counter", "relative input cost (uncached-token units)"),
            ("routed_calls", "routed_calls", "counter", "INTERNAL_ROUTER calls handed to the client as its tool"),
            ("proxy_answered_calls", "proxy_answered_calls", "counter", "calls the proxy answered itself"),
            ("hidden_rounds", "hidden_rounds", "counter", "provider rounds the client never saw"),
        )
        lines: list[str] = []
        for key, name, kind, help_text in metrics:
            metric = f"cacherouter_proxy_{name}_total"
            lines.append(f"# HELP {metric} {help_text}")
            lines.append(f"# TYPE {metric} {kind}")
            value = data["total"][key]
            if value is not None:
                lines.append(f"{metric} {_number(value)}")
            for session, figures in data["sessions"].items():
                if figures[key] is not None:
                    lines.append(f'{metric}{{session="{session}"}} {_number(figures[key])}')
        lines.append("# HELP cacherouter_proxy_hit_rate cached / prompt tokens over the requests that reported both")
        lines.append("# TYPE cacherouter_proxy_hit_rate gauge")
        if data["total"]["hit_rate"] is not None:
            lines.append(f"cacherouter_proxy_hit_rate {_number(data['total']['hit_rate'])}")
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))
