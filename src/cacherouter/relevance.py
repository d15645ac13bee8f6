"""Ranking tools against a task: the paper's keyword hit ratio, and BM25 with exact-name boosting.

Both are strategy objects with one method, ``rank(query, tools) -> [(score, tool)]`` best first, so the router's
top-k stage takes either. Scores of zero are dropped: "return nothing rather than k weak matches" lets the
router say *retry* instead of calling an unrelated tool.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .registry import ToolSpec

_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset(
    "a an the of to in on for and or is are be it this that with from by at as me my i you please can could "
    "would what which how do does use using then and into its".split()
)


def terms(text: str) -> list[str]:
    """Lower-cased word terms, snake/kebab/camel names split, stop words dropped."""
    spaced = re.sub(r"([a-z])([A-Z])", r"\1 \2", text).replace("_", " ").replace("-", " ")
    return [t for t in _WORD.findall(spaced.lower()) if t not in _STOP]


class Ranker(Protocol):
    name: str

    def rank(self, query: str, tools: Sequence[ToolSpec]) -> list[tuple[float, ToolSpec]]: ...


class KeywordHitRatio:
    """Fraction of the query's distinct terms that occur anywhere in the tool's metadata (the paper's score)."""

    name = "keyword"

    def rank(self, query: str, tools: Sequence[ToolSpec]) -> list[tuple[float, ToolSpec]]:
        wanted = set(terms(query))
        if not wanted:
            return []
        scored = []
        for tool in tools:
            have = set(terms(tool.search_text()))
            score = len(wanted & have) / len(wanted)
            if score > 0:
                scored.append((score, tool))
        return sorted(scored, key=lambda pair: (-pair[0], pair[1].name))


@dataclass
class BM25:
    """Okapi BM25 over tool metadata, plus a boost when the query names the tool (or most of its name)."""

    k1: float = 1.2
    b: float = 0.75
    name_boost: float = 5.0
    name = "bm25"

    def rank(self, query: str, tools: Sequence[ToolSpec]) -> list[tuple[float, ToolSpec]]:
        q_terms = terms(query)
        if not q_terms or not tools:
            return []
        docs = [Counter(terms(tool.search_text())) for tool in tools]
        lengths = [sum(doc.values()) for doc in docs]
        avg = sum(lengths) / len(lengths) or 1.0
        df = Counter(term for doc in docs for term in doc)
        n = len(tools)
        lowered = query.lower()
        scored = []
        for tool, doc, length in zip(tools, docs, lengths, strict=True):
            score = 0.0
            for term in set(q_terms):
                tf = doc.get(term, 0)
                if not tf:
                    continue
                idf = math.log(1 + (n - df[term] + 0.5) / (df[term] + 0.5))
                score += idf * tf * (self.k1 + 1) / (tf + self.k1 * (1 - self.b + self.b * length / avg))
            if tool.name.lower() in lowered:
                score += self.name_boost  # exact tool name in the task: the strongest possible signal
            else:
                name_terms = set(terms(tool.name))
                if name_terms and len(name_terms & set(q_terms)) / len(name_terms) >= 0.5:
                    score += self.name_boost * len(name_terms & set(q_terms)) / len(name_terms) / 2
            if score > 0:
                scored.append((score, tool))
        return sorted(scored, key=lambda pair: (-pair[0], pair[1].name))


def make_ranker(name: str) -> Ranker:
    if name == "keyword":
        return KeywordHitRatio()
    if name == "bm25":
        return BM25()
    raise ValueError(f"unknown ranker {name!r}; choose 'keyword' or 'bm25'")


@dataclass(frozen=True, kw_only=True)
class RetrievalScore:
    ranker: str
    queries: int
    hit_at_1: float
    recall_at_k: float
    mrr: float
    k: int


def evaluate_ranker(
    ranker: Ranker, labelled: Sequence[tuple[str, str]], tools: Sequence[ToolSpec], *, k: int = 5
) -> RetrievalScore:
    """Score ``ranker`` on (query, expected tool name) pairs: hit@1, recall@k and mean reciprocal rank."""
    hits1 = hitsk = 0
    rr = 0.0
    for query, expected in labelled:
        names = [tool.name for _, tool in ranker.rank(query, tools)]
        if names[:1] == [expected]:
            hits1 += 1
        if expected in names[:k]:
            hitsk += 1
        if expected in names:
            rr += 1 / (names.index(expected) + 1)
    count = len(labelled) or 1
    return RetrievalScore(
        ranker=ranker.name,
        queries=len(labelled),
        hit_at_1=hits1 / count,
        recall_at_k=hitsk / count,
        mrr=rr / count,
        k=k,
    )
