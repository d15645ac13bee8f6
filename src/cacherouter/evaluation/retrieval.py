"""Relevance scorers compared on a labelled query set over the long-tail registry (``cacherouter eval relevance``).

The query set (``data/longtail_queries.jsonl``) holds requests written as users ask them, each labelled with the
tool that serves it (and, rarely, acceptable alternatives). Most are paraphrases that avoid the tools' own words;
a minority name the tool, as real users sometimes do, and are marked so the two kinds are reported apart.

For each scorer it measures recall@1, recall@k (does the right tool survive the router's top-k stage), mean
reciprocal rank, the mean time of one ranking, and how often the router's whole four-stage filter (blacklist,
whitelist, top-k, yellowlist with top-1 fallback, default settings) hands the sub-model a candidate set holding
the right tool. Timings are measured, never asserted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..channels.relevance import RANKERS, SCORERS, Ranker
from ..channels.router import RouterConfig, filter_candidates
from ..errors import ConfigError
from ..tools.registry import RegisteredTool, Registry

QUERIES_FILE = Path(__file__).resolve().parent / "data" / "longtail_queries.jsonl"
SPLITS = ("all", "paraphrased", "names_tool")
_WARMUP_QUERY = "warm up the scorer before timing it"


@dataclass(frozen=True, kw_only=True)
class LabelledQuery:
    id: str
    query: str
    tool: str
    also: tuple[str, ...] = ()  # other tools that serve the request as well
    names_tool: bool = False  # the request names its tool (otherwise it is a paraphrase)

    @property
    def accepted(self) -> frozenset[str]:
        return frozenset((self.tool, *self.also))


def load_queries(path: Path = QUERIES_FILE) -> tuple[LabelledQuery, ...]:
    """Read a JSONL query set: one object per line with ``id``, ``query``, ``tool``, ``names_tool`` [, ``also``]."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read the query set {path}: {e}") from e
    queries: list[LabelledQuery] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            query = LabelledQuery(
                id=str(row["id"]),
                query=_text(row["query"]),
                tool=_text(row["tool"]),
                also=tuple(_text(name) for name in row.get("also", ())),
                names_tool=bool(row["names_tool"]),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"{path}:{number}: not a labelled query ({e!r}); each line must be a JSON object with "
                '"id", "query", "tool" and "names_tool" (and optionally "also", a list of tool names)'
            ) from e
        queries.append(query)
    ids = [q.id for q in queries]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{path}: query ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    return tuple(queries)


def _text(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


def unknown_labels(queries: Sequence[LabelledQuery], registry: Registry) -> list[str]:
    """Label names that are not registered tools, as ``id: name`` (empty when every label is real)."""
    return [f"{q.id}: {name}" for q in queries for name in sorted(q.accepted) if registry.get(name) is None]


@dataclass(frozen=True, kw_only=True)
class _Outcome:
    names_tool: bool
    rank: int | None  # 1-based position of the first accepted tool in the ranking, None if not ranked
    in_candidates: bool
    candidates: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class SplitScore:
    queries: int
    recall_at_1: float
    recall_at_k: float
    mrr: float
    router_recall: float  # the right tool is among the candidates the router sub-model is given
    mean_candidates: float
    mean_latency_ms: float  # one ranking over the registry


@dataclass(frozen=True, kw_only=True)
class ScorerReport:
    ranker: str
    setup_ms: float  # building the scorer and its first ranking (model load, registry embedding) in this process
    splits: Mapping[str, SplitScore]


@dataclass(frozen=True, kw_only=True)
class RelevanceComparison:
    k: int
    tools: int
    queries: int
    paraphrased: int
    scorers: tuple[ScorerReport, ...]
    skipped: Mapping[str, str]  # scorer -> why it could not run

    def to_json(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "tools": self.tools,
            "queries": self.queries,
            "paraphrased": self.paraphrased,
            "names_tool": self.queries - self.paraphrased,
            "scorers": [
                {
                    "ranker": s.ranker,
                    "setup_ms": s.setup_ms,
                    "splits": {name: asdict(split) for name, split in s.splits.items()},
                }
                for s in self.scorers
            ],
            "skipped": dict(self.skipped),
        }


def compare_relevance(
    queries: Sequence[LabelledQuery],
    registry: Registry,
    *,
    core_tools: frozenset[str],
    rankers: Mapping[str, Callable[[], Ranker]] | None = None,
    k: int = RouterConfig().top_k,
    clock: Callable[[], float] = time.perf_counter,
) -> RelevanceComparison:
    """Run every scorer over ``queries``. A scorer whose factory raises :class:`ConfigError` is skipped, with why."""
    unknown = unknown_labels(queries, registry)
    if unknown:
        raise ConfigError(f"labels name tools that are not registered: {', '.join(unknown)}")
    tools = list(registry)
    config = RouterConfig(top_k=k)
    reports: list[ScorerReport] = []
    skipped: dict[str, str] = {}
    if rankers is None:
        rankers = {name: RANKERS[name] for name in SCORERS}
    for name, factory in rankers.items():
        start = clock()
        try:
            ranker = factory()
        except ConfigError as e:
            skipped[name] = str(e)
            continue
        ranker.rank(_WARMUP_QUERY, tools)
        setup_ms = (clock() - start) * 1000
        outcomes = [_score_one(q, ranker, tools, config=config, core_tools=core_tools, clock=clock) for q in queries]
        reports.append(ScorerReport(ranker=name, setup_ms=setup_ms, splits=_splits(outcomes, k)))
    paraphrased = sum(1 for q in queries if not q.names_tool)
    return RelevanceComparison(
        k=k, tools=len(tools), queries=len(queries), paraphrased=paraphrased, scorers=tuple(reports), skipped=skipped
    )


def _score_one(
    query: LabelledQuery,
    ranker: Ranker,
    tools: Sequence[RegisteredTool],
    *,
    config: RouterConfig,
    core_tools: frozenset[str],
    clock: Callable[[], float],
) -> _Outcome:
    start = clock()
    ranked = [tool.name for _, tool in ranker.rank(query.query, tools)]
    seconds = clock() - start
    rank = next((i for i, name in enumerate(ranked, 1) if name in query.accepted), None)
    candidates = filter_candidates(query.query, tools, config=config, core_tools=core_tools, ranker=ranker)
    return _Outcome(
        names_tool=query.names_tool,
        rank=rank,
        in_candidates=any(t.name in query.accepted for t in candidates),
        candidates=len(candidates),
        seconds=seconds,
    )


def _splits(outcomes: Sequence[_Outcome], k: int) -> dict[str, SplitScore]:
    groups = {
        "all": list(outcomes),
        "paraphrased": [o for o in outcomes if not o.names_tool],
        "names_tool": [o for o in outcomes if o.names_tool],
    }
    return {name: _aggregate(group, k) for name, group in groups.items()}


def _aggregate(outcomes: Sequence[_Outcome], k: int) -> SplitScore:
    n = len(outcomes)

    def mean(values: Sequence[float]) -> float:
        return sum(values) / n if n else 0.0

    return SplitScore(
        queries=n,
        recall_at_1=mean([o.rank == 1 for o in outcomes]),
        recall_at_k=mean([o.rank is not None and o.rank <= k for o in outcomes]),
        mrr=mean([1 / o.rank if o.rank else 0.0 for o in outcomes]),
        router_recall=mean([o.in_candidates for o in outcomes]),
        mean_candidates=mean([o.candidates for o in outcomes]),
        mean_latency_ms=mean([o.seconds * 1000 for o in outcomes]),
    )


def format_comparison(comparison: RelevanceComparison) -> list[str]:
    """The comparison as a plain-text table, one line per scorer and split."""
    c = comparison
    lines = [
        f"Relevance on the long-tail registry ({c.tools} tools): {c.queries} labelled queries "
        f"({c.paraphrased} paraphrased, {c.queries - c.paraphrased} naming the tool); top-k = {c.k}.",
        f"router = the right tool is among the candidates the four-stage filter hands the sub-model (default "
        f"settings); cand = candidates handed over; ms = one ranking of all {c.tools} tools.",
        f"{'scorer':<8} {'split':<11} {'n':>4} {'R@1':>6} {f'R@{c.k}':>6} {'MRR':>6} {'router':>6} {'cand':>5} "
        f"{'ms':>7} {'setup ms':>9}",
    ]
    for s in c.scorers:
        for name in SPLITS:
            x = s.splits[name]
            setup = f"{s.setup_ms:9.0f}" if name == "all" else ""
            lines.append(
                f"{s.ranker:<8} {name:<11} {x.queries:>4} {x.recall_at_1:6.3f} {x.recall_at_k:6.3f} {x.mrr:6.3f} "
                f"{x.router_recall:6.3f} {x.mean_candidates:5.2f} {x.mean_latency_ms:7.2f} {setup}".rstrip()
            )
    for name, reason in c.skipped.items():
        lines.append(f"{name}: skipped: {reason}")
    return lines
