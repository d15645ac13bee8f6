"""Relevance scorers (keyword hit ratio, BM25, dense), the labelled long-tail query set and `eval relevance`."""

import hashlib
import json
import logging
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from support import add_tool, make_repo

from cacherouter.channels import relevance
from cacherouter.channels.relevance import (
    BM25,
    DenseRelevance,
    KeywordHitRatio,
    dense_text,
    make_ranker,
    names_tool,
    terms,
)
from cacherouter.channels.router import RouterConfig, filter_candidates
from cacherouter.cli import main
from cacherouter.errors import ConfigError
from cacherouter.evaluation.longtail import DOMAINS, generate_repository
from cacherouter.evaluation.retrieval import QUERIES_FILE, load_queries, unknown_labels
from cacherouter.evaluation.runner import EVAL_REPO
from cacherouter.tools.registry import Registry, build_registry

WORDLLAMA_MISSING = "wordllama is not installed (pip install 'tvcache[router]'); dense relevance cannot run"


class BagOfWords:
    """A tiny deterministic embedder for the protocol's contract: hashed term counts, as plain lists."""

    name = "bag-of-words"

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        rows = []
        for text in texts:
            row = [0.0] * 64
            for term in terms(text):
                row[int(hashlib.sha256(term.encode()).hexdigest(), 16) % 64] += 1.0
            rows.append(row)
        return rows


@pytest.fixture(scope="module")
def longtail(tmp_path_factory: pytest.TempPathFactory) -> Registry:
    return build_registry(generate_repository(EVAL_REPO, tmp_path_factory.mktemp("longtail") / "repo"))


def small_registry(tmp_path: Path) -> Registry:
    return build_registry(make_repo(tmp_path / "repo"))


def names(ranking) -> list[str]:
    return [tool.name for _, tool in ranking]


def test_terms_split_names_and_drop_stop_words() -> None:
    assert terms("Use the city_weather tool for parisWeather-now") == [
        "city",
        "weather",
        "tool",
        "paris",
        "weather",
        "now",
    ]


def test_lexical_scorers_rank_matches_first_and_drop_non_matches(tmp_path: Path) -> None:
    tools = list(small_registry(tmp_path))
    for ranker in (KeywordHitRatio(), BM25()):
        assert names(ranker.rank("weather report for Oslo", tools))[0] == "city_weather"
        assert ranker.rank("zebra", tools) == []  # nothing rather than weak matches
        assert ranker.rank("the of and", tools) == []  # only stop words
    # BM25's exact-name boost: naming the tool wins even against words matching another tool
    assert names(BM25().rank("stock_price, not the weather report for a city", tools))[0] == "stock_price"


def test_dense_ranks_by_cosine_and_embeds_each_tool_text_once(tmp_path: Path) -> None:
    tools = list(small_registry(tmp_path))
    embedder = BagOfWords()
    dense = DenseRelevance(embedder)
    ranking = dense.rank("weather report for a city", tools)
    assert names(ranking)[0] == "city_weather"
    assert [score for score, _ in ranking] == sorted((score for score, _ in ranking), reverse=True)
    assert all(0 < score <= 1.0001 for score, _ in ranking)
    assert len(embedder.calls) == 2  # the tools (once, batched), then the query
    assert sorted(embedder.calls[0]) == sorted(dense_text(t) for t in tools)

    dense.rank("stock price", tools)
    dense.rank("time", tools[:2])  # a subset (whitelist) of known tools needs no new embedding either
    assert [len(call) for call in embedder.calls[2:]] == [1, 1]

    # a reload that edits one tool: only its new text is embedded
    add_tool(tmp_path / "repo", "tail", "stocks", "stock_price", "Share quotes for a ticker symbol.")
    reloaded = list(build_registry(tmp_path / "repo"))
    assert names(dense.rank("share quotes", reloaded))[0] == "stock_price"
    assert [len(call) for call in embedder.calls[4:]] == [1, 1]


def test_dense_edge_cases(tmp_path: Path) -> None:
    tools = list(small_registry(tmp_path))
    assert DenseRelevance(BagOfWords()).rank("   ", tools) == []
    assert DenseRelevance(BagOfWords()).rank("weather", []) == []
    # min_score drops weak matches; a query sharing no term scores 0 with every tool and returns nothing
    assert DenseRelevance(BagOfWords()).rank("zebra", tools) == []
    assert len(DenseRelevance(BagOfWords(), min_score=0.99).rank("weather city", tools)) < len(tools)

    class Broken:
        name = "broken"

        def embed(self, texts: Sequence[str]) -> list[list[float]]:
            return [[1.0, 0.0]]  # one row whatever the number of texts

    with pytest.raises(ConfigError, match="one row per text"):
        DenseRelevance(Broken()).rank("weather", tools)


def test_make_ranker_names_the_choices_and_the_missing_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_ranker("bm25"), BM25)
    assert isinstance(make_ranker("keyword"), KeywordHitRatio)
    with pytest.raises(ConfigError, match="choose one of auto, keyword, bm25, dense"):
        make_ranker("tfidf")
    monkeypatch.setattr(relevance, "_SHARED_DENSE", [])  # no model loaded yet in this process
    monkeypatch.setitem(sys.modules, "wordllama", None)  # what an environment without the package sees
    with pytest.raises(ConfigError, match=r"pip install 'tvcache\[router\]'"):
        make_ranker("dense")
    assert isinstance(make_ranker("auto"), BM25)  # the router's default falls back


def test_the_name_boost_needs_the_name_as_a_word() -> None:
    assert names_tool("show the weather in Paris", "weather")
    assert names_tool("run city_weather for Oslo", "city_weather")
    assert not names_tool("rank jackets by how weatherproof they are", "weather")
    assert not names_tool("run city_weather_v2", "city_weather")


def test_query_set_parses_and_every_label_is_a_registered_tool(longtail: Registry) -> None:
    queries = load_queries()
    assert len(queries) >= 150
    assert unknown_labels(queries, longtail) == []
    paraphrased = [q for q in queries if not q.names_tool]
    naming = [q for q in queries if q.names_tool]
    assert len(naming) < len(paraphrased) / 3  # a minority name their tool
    assert all(q.tool in q.query for q in naming)
    assert not any(q.tool in q.query for q in paraphrased)
    labelled_packages = {longtail.tools[q.tool].package for q in queries}
    assert set(DOMAINS) <= labelled_packages  # spread over every generated package


def test_query_set_errors_say_where(tmp_path: Path, longtail: Registry) -> None:
    path = tmp_path / "queries.jsonl"
    path.write_text('{"id": "a", "query": "weather in Oslo", "tool": "weather", "names_tool": false}\n{"id": "b"}\n')
    with pytest.raises(ConfigError, match=r"queries\.jsonl:2: not a labelled query"):
        load_queries(path)
    path.write_text('{"id": "a", "query": "q", "tool": "no_such_tool", "also": ["weather"], "names_tool": false}\n')
    assert unknown_labels(load_queries(path), longtail) == ["a: no_such_tool"]


def test_dense_on_the_bundled_wordllama_model_offline(longtail: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wordllama", reason=WORDLLAMA_MISSING)
    from cacherouter.channels.relevance import WordLlamaEmbedder

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"loading the model tried the network: {args[:2]}")

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with monkeypatch.context() as patched:
        patched.setattr(socket, "getaddrinfo", no_network)
        patched.setattr(socket.socket, "connect", no_network)
        embedder = WordLlamaEmbedder()
    assert (root.handlers, root.level) == (handlers, level)  # importing wordllama left logging alone

    tools = list(longtail)
    dense = DenseRelevance(embedder)
    ranking = names(dense.rank("How high will the water be at high water in Brest tomorrow?", tools))
    assert "tide_estimate" in ranking[:5]
    # the router takes the dense scorer by name, through its usual four-stage filter
    candidates = filter_candidates(
        "How many skeins of wool do I need to knit a sweater?",
        tools,
        config=RouterConfig(ranker="dense"),
        core_tools=frozenset({"calculator", "weather"}),
    )
    assert 0 < len(candidates) <= 5
    assert "yarn_estimate" in [t.name for t in candidates]


def test_eval_relevance_prints_the_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], longtail: Registry
) -> None:
    lines = QUERIES_FILE.read_text().splitlines()
    subset = tmp_path / "subset.jsonl"
    subset.write_text("\n".join(lines[::9]) + "\n")  # every 9th query: both kinds, many packages, quick
    out = tmp_path / "relevance.json"
    code = main(["eval", "relevance", "--queries", str(subset), "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "R@5" in printed
    data = json.loads(out.read_text())
    assert data["tools"] == len(longtail)
    assert data["queries"] == len(lines[::9])
    assert 0 < data["names_tool"] < data["queries"]
    by_name = {s["ranker"]: s for s in data["scorers"]}
    expected = {"keyword", "bm25"} | (set() if "dense" in data["skipped"] else {"dense"})
    assert set(by_name) == expected
    for scorer in by_name.values():
        assert set(scorer["splits"]) == {"all", "paraphrased", "names_tool"}
        for split in scorer["splits"].values():
            assert 0 <= split["recall_at_1"] <= split["recall_at_k"] <= 1
            assert split["mean_latency_ms"] >= 0
        assert f"{scorer['ranker']:<8} all" in printed
    assert by_name["bm25"]["splits"]["names_tool"]["recall_at_k"] > 0  # sanity, not a target


def test_eval_relevance_rejects_labels_that_are_not_tools(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x1", "query": "hello", "tool": "no_such_tool", "names_tool": false}\n')
    assert main(["eval", "relevance", "--queries", str(bad), "--rankers", "bm25"]) == 2
    assert "x1: no_such_tool" in capsys.readouterr().err
