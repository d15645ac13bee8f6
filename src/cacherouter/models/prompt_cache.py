"""An offline model of provider prompt caches, so request architectures can be measured without a network.

A request is rendered into segments in the order providers put them at the head of the prompt — the tool
segment, then each message — and each segment is tokenized on its own (chat templates separate messages with
special tokens, so a message's tokens do not depend on its neighbours). The cache then decides how many leading
tokens hit, following each provider's documented rules (see ``../shared/research/cacherouter.md`` section 3):

* **DeepSeek** — prefix from token 0; storage in 64-token units (content shorter than a unit is not cached);
  complete units are also persisted at the end of each request's input and at the end of the model's output.
  A request hits the longest persisted unit that is entirely a prefix of it.
* **OpenAI** — prompts of at least 1024 tokens; hits in 128-token increments from token 0.
* **Anthropic** — automatic breakpoint at the end of each request (and of the output); a later request reads the
  longest earlier breakpoint that is a prefix of it; at least 1024 tokens; the rest is written (billed 1.25x).

Hashing: prefix hashes are a polynomial rolling hash mod 2**61-1 over token ids, so any prefix length is an O(1)
lookup after one O(n) pass; collisions are negligible at these sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..canonical import canonical_json
from ..errors import ConfigError
from .tokens import Tokenizer

_MOD = (1 << 61) - 1
_BASE = 1_000_003


def render_segments(tools_json: str, messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The text segments of a chat request, in prompt order."""
    segments = [f"<tools>{tools_json}</tools>"] if tools_json else []
    for message in messages:
        segments.append(render_message(message))
    return segments


def render_message(message: Mapping[str, Any]) -> str:
    role = str(message.get("role", "user"))
    content = message.get("content") or ""
    text = content if isinstance(content, str) else canonical_json(content)
    calls = message.get("tool_calls")
    if calls:
        text += "<calls>" + canonical_json(list(calls))
    if role == "tool":
        text = f"[{message.get('tool_call_id', '')}]{text}"
    return f"<|{role}|>{text}"


def tokenize_request(tokenizer: Tokenizer, tools_json: str, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    ids: list[int] = []
    for segment in render_segments(tools_json, messages):
        ids.extend(tokenizer.encode(segment))
    return ids


def prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """hashes[i] identifies tokens[:i]."""
    out = [0] * (len(tokens) + 1)
    h = 0
    for i, tok in enumerate(tokens):
        h = (h * _BASE + tok + 1) % _MOD
        out[i + 1] = h
    return out


@dataclass(frozen=True, kw_only=True)
class CacheOutcome:
    prompt_tokens: int
    cached_tokens: int
    cache_write_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class Pricing:
    """Input price per token, relative to an uncached input token."""

    hit: float
    miss: float = 1.0
    write: float = 1.0


class PrefixCacheModel:
    """Prefix cache with block-granular storage and whole-request boundary units (see module docstring)."""

    provider = "generic"

    def __init__(self, *, block: int, minimum: int, boundary_units: bool, pricing: Pricing) -> None:
        self.block = block
        self.minimum = minimum
        self.boundary_units = boundary_units
        self.pricing = pricing
        self._blocks: set[tuple[int, int]] = set()  # (length, hash) of stored block-aligned prefixes
        self._units: dict[int, set[int]] = {}  # length -> hashes of stored whole-request prefixes

    def lookup(self, tokens: Sequence[int]) -> CacheOutcome:
        """Account one request: how many leading tokens hit; then store what this request leaves behind."""
        hashes = prefix_hashes(tokens)
        n = len(tokens)
        hit = 0
        length = self.block
        while length <= n and (length, hashes[length]) in self._blocks:
            hit = length
            length += self.block
        for unit_len, unit_hashes in self._units.items():
            if hit < unit_len <= n and hashes[unit_len] in unit_hashes:
                hit = unit_len
        if hit < self.minimum:
            hit = 0
        self._store(hashes, n)
        write = n - hit if n >= self.minimum and self.boundary_units else 0
        return CacheOutcome(prompt_tokens=n, cached_tokens=hit, cache_write_tokens=write)

    def store_output(self, tokens: Sequence[int]) -> None:
        """Persist the prefix that ends where the model's output ends (request + rendered reply)."""
        self._store(prefix_hashes(tokens), len(tokens))

    def _store(self, hashes: list[int], n: int) -> None:
        if n < self.minimum:
            return
        for length in range(self.block, n + 1, self.block):
            self._blocks.add((length, hashes[length]))
        if self.boundary_units:
            self._units.setdefault(n, set()).add(hashes[n])

    def cost(self, outcome: CacheOutcome) -> float:
        miss = outcome.prompt_tokens - outcome.cached_tokens
        return outcome.cached_tokens * self.pricing.hit + miss * self.pricing.miss

    def usage_fields(self, outcome: CacheOutcome, completion_tokens: int) -> dict[str, Any]:
        """The ``usage`` object this provider would have returned, in its own field names."""
        return {
            "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
        }


class DeepSeekCacheModel(PrefixCacheModel):
    provider = "deepseek"

    def __init__(self, *, hit_ratio: float = 1 / 30) -> None:
        # Hit tokens cost about 1/30 of miss tokens under the pricing the CacheRouter paper uses.
        super().__init__(block=64, minimum=64, boundary_units=True, pricing=Pricing(hit=hit_ratio))

    def usage_fields(self, outcome: CacheOutcome, completion_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": completion_tokens,
            "prompt_cache_hit_tokens": outcome.cached_tokens,
            "prompt_cache_miss_tokens": outcome.prompt_tokens - outcome.cached_tokens,
        }


class OpenAICacheModel(PrefixCacheModel):
    provider = "openai"

    def __init__(self, *, hit_ratio: float = 0.5) -> None:
        super().__init__(block=128, minimum=1024, boundary_units=False, pricing=Pricing(hit=hit_ratio))


class AnthropicCacheModel(PrefixCacheModel):
    provider = "anthropic"

    def __init__(self, *, minimum: int = 1024) -> None:
        # Reads cost 0.1x, writes 1.25x (5-minute TTL). Only whole-request breakpoints are stored.
        super().__init__(block=1 << 30, minimum=minimum, boundary_units=True, pricing=Pricing(hit=0.1, write=1.25))

    def cost(self, outcome: CacheOutcome) -> float:
        rest = outcome.prompt_tokens - outcome.cached_tokens - outcome.cache_write_tokens
        return (
            outcome.cached_tokens * self.pricing.hit
            + outcome.cache_write_tokens * self.pricing.write
            + rest * self.pricing.miss
        )

    def usage_fields(self, outcome: CacheOutcome, completion_tokens: int) -> dict[str, Any]:
        rest = outcome.prompt_tokens - outcome.cached_tokens - outcome.cache_write_tokens
        return {
            "input_tokens": rest,
            "cache_read_input_tokens": outcome.cached_tokens,
            "cache_creation_input_tokens": outcome.cache_write_tokens,
            "output_tokens": completion_tokens,
        }


def cache_model(provider: str) -> PrefixCacheModel:
    models: dict[str, Callable[[], PrefixCacheModel]] = {
        "deepseek": DeepSeekCacheModel,
        "openai": OpenAICacheModel,
        "anthropic": AnthropicCacheModel,
    }
    if provider not in models:
        raise ConfigError(f"unknown provider {provider!r}; choose one of {sorted(models)}")
    return models[provider]()
