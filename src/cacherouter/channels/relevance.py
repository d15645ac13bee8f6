"""Ranking tools against a task: the paper's keyword hit ratio, BM25 with exact-name boosting, and dense embeddings.

Every scorer is a strategy object with one method, ``rank(query, tools) -> [(score, tool)]`` best first, so the
router's top-k stage takes any of them. The lexical scorers drop scores of zero: "return nothing rather than k
weak matches" lets the router say *retry* instead of calling an unrelated tool.

Dense relevance (:class:`DenseRelevance`) embeds the query and each tool's text with an :class:`Embedder` and ranks
by cosine similarity; tool vectors are computed once per tool text, so a registry is embedded once per version.
The default embedder is WordLlama's bundled 256-dimension model (optional extra ``router``; no network, no
torch). Pick a scorer by name with :func:`make_ranker` (``keyword``, ``bm25``, ``dense``); ``cacherouter eval
relevance`` compares them on a labelled query set (a reciprocal-rank fusion of BM25 and dense was measured there
too, and dropped: it ranked worse than dense alone, because BM25's matches on paraphrases are mostly noise).
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ConfigError
from ..tools.registry import RegisteredTool

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import ArrayLike, NDArray

_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset(
    "a an the of to in on for and or is are be it this that with from by at as me my i you please can could "
    "would what which how do does use using then and into its".split()
)


def terms(text: str) -> list[str]:
    """Lower-cased word terms, snake/kebab/camel names split, stop words dropped."""
    spaced = re.sub(r"([a-z])([A-Z])", r"\1 \2", text).replace("_", " ").replace("-", " ")
    return [t for t in _WORD.findall(spaced.lower()) if t not in _STOP]


def names_tool(query: str, name: str) -> bool:
    """Whether ``query`` names the tool as a word of its own ("weatherproof" does not name ``weather``)."""
    return re.search(rf"(?<![a-z0-9_]){re.escape(name.lower())}(?![a-z0-9_])", query.lower()) is not None


class Ranker(Protocol):
    name: str

    def rank(self, query: str, tools: Sequence[RegisteredTool]) -> list[tuple[float, RegisteredTool]]: ...


def _best_first(scored: list[tuple[float, RegisteredTool]]) -> list[tuple[float, RegisteredTool]]:
    return sorted(scored, key=lambda pair: (-pair[0], pair[1].name))


class KeywordHitRatio:
    """Fraction of the query's distinct terms that occur anywhere in the tool's metadata (the paper's score)."""

    name = "keyword"

    def rank(self, query: str, tools: Sequence[RegisteredTool]) -> list[tuple[float, RegisteredTool]]:
        wanted = set(terms(query))
        if not wanted:
            return []
        scored = []
        for tool in tools:
            have = set(terms(tool.search_text()))
            score = len(wanted & have) / len(wanted)
            if score > 0:
                scored.append((score, tool))
        return _best_first(scored)


@dataclass
class BM25:
    """Okapi BM25 over tool metadata, plus a boost when the query names the tool (or most of its name)."""

    k1: float = 1.2
    b: float = 0.75
    name_boost: float = 5.0
    name = "bm25"

    def rank(self, query: str, tools: Sequence[RegisteredTool]) -> list[tuple[float, RegisteredTool]]:
        q_terms = terms(query)
        if not q_terms or not tools:
            return []
        docs = [Counter(terms(tool.search_text())) for tool in tools]
        lengths = [sum(doc.values()) for doc in docs]
        avg = sum(lengths) / len(lengths) or 1.0
        df = Counter(term for doc in docs for term in doc)
        n = len(tools)
        scored = []
        for tool, doc, length in zip(tools, docs, lengths, strict=True):
            score = 0.0
            for term in set(q_terms):
                tf = doc.get(term, 0)
                if not tf:
                    continue
                idf = math.log(1 + (n - df[term] + 0.5) / (df[term] + 0.5))
                score += idf * tf * (self.k1 + 1) / (tf + self.k1 * (1 - self.b + self.b * length / avg))
            if names_tool(query, tool.name):
                score += self.name_boost  # exact tool name in the task: the strongest possible signal
            else:
                name_terms = set(terms(tool.name))
                if name_terms and len(name_terms & set(q_terms)) / len(name_terms) >= 0.5:
                    score += self.name_boost * len(name_terms & set(q_terms)) / len(name_terms) / 2
            if score > 0:
                scored.append((score, tool))
        return _best_first(scored)


class Embedder(Protocol):
    """A local text embedding model: one row per text. Rows need not be normalised."""

    name: str

    def embed(self, texts: Sequence[str]) -> ArrayLike: ...


def dense_text(tool: RegisteredTool) -> str:
    """What a tool is, in words: its name split into words, package, skill, description and SKILL.md text.

    Argument help is left out on purpose: it says how to call a tool, not what it is for, and in an averaged
    embedding generic words ("quantity", "unit system") shared by many tools only blur the ones that differ.
    """
    words = " ".join(terms(tool.name))
    return f"{words} ({tool.package}, {tool.skill}): {tool.description} {tool.skill_text}".strip()


class DenseRelevance:
    """Cosine similarity between the query's embedding and each tool's (see :func:`dense_text`).

    Tool vectors are cached by tool text: the first ranking over a registry embeds it, later ones only embed the
    query, and a reload re-embeds just the tools whose text changed (old versions' vectors are dropped once the
    cache outgrows the registry). Every tool whose cosine exceeds ``min_score`` is returned, so unlike the lexical
    scorers this one nearly always fills the top-k.
    """

    name = "dense"

    def __init__(self, embedder: Embedder, *, min_score: float = 0.0) -> None:
        self.embedder = embedder
        self.min_score = min_score
        self._vectors: dict[str, NDArray[np.float32]] = {}
        self._lock = threading.Lock()

    def rank(self, query: str, tools: Sequence[RegisteredTool]) -> list[tuple[float, RegisteredTool]]:
        if not query.strip() or not tools:
            return []
        matrix = self.tool_matrix(tools)
        scores = matrix @ self._unit_rows([query])[0]
        scored = []
        for score, tool in zip(scores, tools, strict=True):
            if names_tool(query, tool.name):
                scored.append((float(score) + 1.0, tool))  # named outright: above any cosine, as in BM25
            elif score > self.min_score:
                scored.append((float(score), tool))
        return _best_first(scored)

    def tool_matrix(self, tools: Sequence[RegisteredTool]) -> NDArray[np.float32]:
        """Unit vectors of ``tools``, one row each, embedding only texts not seen before."""
        import numpy as np

        texts = [dense_text(tool) for tool in tools]
        with self._lock:
            missing = sorted({t for t in texts if t not in self._vectors})
            if missing:
                if len(self._vectors) + len(missing) > max(4 * len(texts), 4096):
                    # many registry versions ago: keep only what this one uses, so memory stays bounded
                    self._vectors = {t: self._vectors[t] for t in texts if t in self._vectors}
                self._vectors.update(zip(missing, self._unit_rows(missing), strict=True))
            return np.stack([self._vectors[t] for t in texts])

    def _unit_rows(self, texts: Sequence[str]) -> NDArray[np.float32]:
        import numpy as np

        rows = np.asarray(self.embedder.embed(list(texts)), dtype=np.float32)
        if rows.ndim != 2 or rows.shape[0] != len(texts):
            raise ConfigError(
                f"embedder {self.embedder.name!r} returned an array of shape {rows.shape} for {len(texts)} texts; "
                "it must return one row per text"
            )
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        norms[norms == 0] = 1.0  # an all-zero row (no known token) stays zero instead of becoming NaN
        unit: NDArray[np.float32] = rows / norms
        return unit


class WordLlamaEmbedder:
    """WordLlama's bundled ``l2_supercat`` token embeddings, average-pooled: fast, CPU-only, offline.

    Needs the ``wordllama`` package (``pip install 'tvcache[router]'``). The weights and tokenizer ship inside the
    wheel; downloads are disabled, so loading never touches the network.
    """

    def __init__(self, *, dim: int = 256) -> None:
        self.name = f"wordllama-l2_supercat-{dim}"
        wordllama = _import_wordllama()
        # The wheel bundles the tokenizer under tokenizers/, but WordLlama looks for it under tokenizer/ and falls
        # back to a download. Pointing its cache directory at the package makes it find the bundled file.
        try:
            self._model = wordllama.WordLlama.load(
                dim=dim, cache_dir=Path(wordllama.__file__).parent, disable_download=True
            )
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"wordllama {getattr(wordllama, '__version__', '?')} could not load its bundled model at dim={dim} "
                f"({e}); the versions the 'router' extra allows ship dim=256: pip install 'tvcache[router]'"
            ) from e

    def embed(self, texts: Sequence[str]) -> ArrayLike:
        result: ArrayLike = self._model.embed(list(texts))
        return result


def _import_wordllama() -> Any:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import wordllama  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError as e:
        raise ConfigError(
            "dense relevance needs the 'wordllama' package, which is not installed: pip install 'tvcache[router]'"
        ) from e
    finally:
        # wordllama calls logging.basicConfig(level=INFO) when imported; a library must not configure logging
        root.handlers[:] = handlers
        root.setLevel(level)
    return wordllama


_SHARED_DENSE: list[DenseRelevance] = []
_SHARED_DENSE_LOCK = threading.Lock()


def shared_dense() -> DenseRelevance:
    """One process-wide dense ranker on the default embedder, so the model loads and a registry embeds once
    (under a lock: routers built at the same time must not load the model twice)."""
    with _SHARED_DENSE_LOCK:
        if not _SHARED_DENSE:
            _SHARED_DENSE.append(DenseRelevance(WordLlamaEmbedder()))
        return _SHARED_DENSE[0]


def best_available() -> Ranker:
    """Dense relevance when its model is installed (it finds paraphrased tasks BM25 cannot), else BM25."""
    try:
        return shared_dense()
    except ConfigError:
        return BM25()


RANKERS: dict[str, Callable[[], Ranker]] = {
    "auto": best_available,
    "keyword": KeywordHitRatio,
    "bm25": BM25,
    "dense": shared_dense,
}
"""Ranker factories by name. ``dense`` needs the ``router`` extra (wordllama); ``auto`` (the router's default)
is ``dense`` when that is installed, else ``bm25``."""
SCORERS = ("keyword", "bm25", "dense")
"""The distinct scorers (``auto`` is one of them), as compared by ``cacherouter eval relevance``."""


def make_ranker(name: str) -> Ranker:
    factory = RANKERS.get(name)
    if factory is None:
        raise ConfigError(f"unknown ranker {name!r}; choose one of {', '.join(RANKERS)}")
    return factory()


@dataclass(frozen=True, kw_only=True)
class RetrievalScore:
    ranker: str
    queries: int
    hit_at_1: float
    recall_at_k: float
    mrr: float
    k: int


def evaluate_ranker(
    ranker: Ranker, labelled: Sequence[tuple[str, str]], tools: Sequence[RegisteredTool], *, k: int = 5
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
