"""Reading prompt-cache usage from each provider's response, without guessing.

A provider that does not report cached tokens has *unknown* cached tokens (None), never zero: vLLM and SGLang
only emit ``prompt_tokens_details`` when started with a flag, and treating absence as 0 would report a 0% hit
rate for a server that may be caching everything.

Provider names are case-insensitive. An unknown name is an error (:func:`normalize_provider`), never silently read
as generic fields: a typo such as ``deepseek-chat`` (a model name) would otherwise hide DeepSeek's cache figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ConfigError

# Usage-field dialects. vllm and sglang read the OpenAI-style fields; they are named so that a self-hosted server
# is not mistaken for OpenAI when pricing requests (see accounting.pricing_for).
PROVIDERS = ("anthropic", "deepseek", "openai", "sglang", "vllm")


@dataclass(frozen=True, kw_only=True)
class Usage:
    """Normalised usage of one request. None means the provider did not say."""

    provider: str
    prompt_tokens: int | None
    cached_tokens: int | None
    cache_write_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def miss_tokens(self) -> int | None:
        if self.prompt_tokens is None or self.cached_tokens is None:
            return None
        return self.prompt_tokens - self.cached_tokens


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def normalize_provider(provider: str | None) -> str | None:
    """``provider`` in canonical (lower) case; None or "" stay None (detect). Raises :class:`ConfigError`."""
    if not provider or not provider.strip():
        return None
    name = provider.strip().lower()
    if name not in PROVIDERS:
        raise ConfigError(
            f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}, "
            "or leave it unset to detect the usage fields from each response"
        )
    return name


def parse_usage(usage: Mapping[str, Any] | None, provider: str | None = None) -> Usage:
    """Normalise a ``usage`` object. ``provider`` is one of :data:`PROVIDERS` (any case), or None to detect.

    Figures that contradict each other (negative counts, more cached tokens than the prompt holds) are reported as
    unknown: a gateway's bug must not turn into negative costs or hit rates above 100%.
    """
    usage = usage or {}
    kind = normalize_provider(provider) or detect_provider(usage)
    if kind == "anthropic":
        parsed = _anthropic(usage)
    elif kind == "deepseek":
        prompt = _int(usage.get("prompt_tokens"))
        hit = _int(usage.get("prompt_cache_hit_tokens"))
        miss = _int(usage.get("prompt_cache_miss_tokens"))
        if prompt is None and hit is not None and miss is not None:
            prompt = hit + miss
        if hit is None and prompt is not None and miss is not None:
            hit = prompt - miss  # arithmetic, not a guess; a miss above the prompt is caught as inconsistent
        parsed = Usage(
            provider=kind,
            prompt_tokens=prompt,
            cached_tokens=hit,
            completion_tokens=_int(usage.get("completion_tokens")),
        )
    else:
        prompt = _int(usage.get("prompt_tokens"))
        if prompt is None:
            prompt = _int(usage.get("input_tokens"))
        parsed = Usage(
            provider=kind,
            prompt_tokens=prompt,
            cached_tokens=_details(usage, "cached_tokens"),
            completion_tokens=_int(usage.get("completion_tokens")),
        )
    return _consistent(parsed)


def _anthropic(usage: Mapping[str, Any]) -> Usage:
    read = _int(usage.get("cache_read_input_tokens"))
    write = _int(usage.get("cache_creation_input_tokens"))
    uncached = _int(usage.get("input_tokens"))
    completion = _int(usage.get("output_tokens"))
    if uncached is not None:
        # Anthropic's input_tokens is only the uncached remainder; the prompt is the sum of the three.
        prompt: int | None = uncached + (read or 0) + (write or 0)
    else:
        # Claude behind a chat-completions gateway (LiteLLM and the like): OpenAI's fields, where prompt_tokens
        # counts the whole prompt, cached and written tokens included, and cached_tokens is a part of it.
        prompt = _int(usage.get("prompt_tokens"))
        read = read if read is not None else _details(usage, "cached_tokens")
        write = write if write is not None else _details(usage, "cache_creation_tokens")
        completion = completion if completion is not None else _int(usage.get("completion_tokens"))
    return Usage(
        provider="anthropic",
        prompt_tokens=prompt,
        cached_tokens=read,
        cache_write_tokens=write,
        completion_tokens=completion,
    )


def _details(usage: Mapping[str, Any], name: str) -> int | None:
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return _int(details.get(name)) if isinstance(details, Mapping) else None


def _consistent(usage: Usage) -> Usage:
    """``usage`` with the figures that cannot all be true made unknown: negative counts, or more cached and
    written tokens than the prompt holds."""
    counts = (usage.prompt_tokens, usage.cached_tokens, usage.cache_write_tokens)
    stored = (usage.cached_tokens or 0) + (usage.cache_write_tokens or 0)
    if any(count is not None and count < 0 for count in counts) or (
        usage.prompt_tokens is not None and stored > usage.prompt_tokens
    ):
        usage = replace(usage, prompt_tokens=None, cached_tokens=None, cache_write_tokens=None)
    if usage.completion_tokens is not None and usage.completion_tokens < 0:
        usage = replace(usage, completion_tokens=None)
    return usage


def detect_provider(usage: Mapping[str, Any]) -> str:
    if "prompt_cache_hit_tokens" in usage or "prompt_cache_miss_tokens" in usage:
        return "deepseek"
    if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:
        return "anthropic"
    return "openai"
