import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from cacherouter.errors import ConfigError
from cacherouter.evaluation.runner import EVAL_REPO, run_workload
from cacherouter.evaluation.suite import DIALOGUE, SUITE
from cacherouter.models.accounting import Ledger, RecordingModel
from cacherouter.models.base import ChatRequest
from cacherouter.models.endpoint import EndpointConfig, OpenAICompatibleModel, parse_completion
from cacherouter.models.prompt_cache import AnthropicCacheModel, DeepSeekCacheModel, OpenAICacheModel
from cacherouter.models.tokens import ApproximateTokenizer, default_tokenizer
from cacherouter.models.usage import parse_usage
from cacherouter.tools.gateway import Gateway, GatewayConfig


def test_usage_fields_per_provider_and_missing_is_unknown():
    ds = parse_usage({"prompt_tokens": 100, "prompt_cache_hit_tokens": 64, "prompt_cache_miss_tokens": 36})
    assert (ds.provider, ds.prompt_tokens, ds.cached_tokens) == ("deepseek", 100, 64)
    oa = parse_usage({"prompt_tokens": 2000, "prompt_tokens_details": {"cached_tokens": 1920}})
    assert (oa.provider, oa.cached_tokens, oa.miss_tokens) == ("openai", 1920, 80)
    an = parse_usage({"input_tokens": 10, "cache_read_input_tokens": 1000, "cache_creation_input_tokens": 50})
    assert (an.provider, an.prompt_tokens, an.cached_tokens, an.cache_write_tokens) == ("anthropic", 1060, 1000, 50)
    vllm = parse_usage({"prompt_tokens": 500, "completion_tokens": 3}, "vllm")
    assert vllm.cached_tokens is None
    assert vllm.miss_tokens is None
    ledger = Ledger()

    class Fixed:
        name = "fixed"

        def complete(self, request):
            return parse_completion({"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": 500}})

    RecordingModel(Fixed(), ledger, provider="vllm").complete(ChatRequest(messages=()))
    summary = ledger.summary()
    assert summary.unknown_requests == 1
    assert summary.hit_rate is None


def test_deepseek_rules_units_and_prefix_from_token_zero():
    cache = DeepSeekCacheModel()
    a = list(range(1, 201))
    assert cache.lookup(a).cached_tokens == 0
    assert cache.lookup(a).cached_tokens == 200  # whole earlier request is a persisted unit
    assert cache.lookup([*a[:150], 999]).cached_tokens == 128  # else 64-token units
    assert cache.lookup([0, *a]).cached_tokens == 0  # prefix must start at token 0
    assert DeepSeekCacheModel().lookup(list(range(30))).cached_tokens == 0


def test_openai_and_anthropic_minimums():
    openai = OpenAICacheModel()
    openai.lookup(list(range(1000)))
    assert openai.lookup(list(range(1000))).cached_tokens == 0  # below 1024 tokens nothing caches
    openai.lookup(list(range(1300)))
    assert openai.lookup([*range(1300), 5]).cached_tokens == 1280  # 128-token increments
    anthropic = AnthropicCacheModel()
    first = anthropic.lookup(list(range(1500)))
    assert first.cached_tokens == 0
    assert first.cache_write_tokens == 1500
    assert anthropic.lookup([*range(1500), 7]).cached_tokens == 1500


def test_tokenizers_are_offline_and_stable():
    tok = default_tokenizer()
    assert tok.name in ("deepseek-bpe", "approx-4char")
    ids = tok.encode("INTERNAL_ROUTER returns JSON")
    assert ids == tok.encode("INTERNAL_ROUTER returns JSON")
    assert 3 <= len(ids) <= 12
    approx = ApproximateTokenizer()
    assert 5 <= len(approx.encode("hello world, this is text")) <= 10  # BPE gives 6


def test_http_body_carries_the_canonical_tool_segment_verbatim():
    model = OpenAICompatibleModel(
        EndpointConfig.from_env(
            "CACHEROUTER_MAIN", {"CACHEROUTER_MAIN_BASE_URL": "http://127.0.0.1:9", "CACHEROUTER_MAIN_MODEL": "m"}
        )
    )
    tools_json = '[{"function":{"name":"b"},"type":"function"}]'
    body = model.request_body(
        ChatRequest(messages=({"role": "user", "content": "é"},), tools_json=tools_json, tool_choice="none")
    )
    assert tools_json.encode() in body
    assert json.loads(body)["tool_choice"] == "none"


def test_cacherouter_meets_the_bar_and_keeps_one_main_tool_segment():
    suite = run_workload("cacherouter", "suite", SUITE)
    dialogue = run_workload("cacherouter", "dialogue", DIALOGUE)
    assert suite.main_tool_segments == dialogue.main_tool_segments == 1
    assert suite.summary.hit_rate is not None
    assert suite.summary.hit_rate >= 0.9
    assert dialogue.summary.hit_rate is not None
    assert dialogue.summary.hit_rate >= 0.95
    assert suite.paths == {"tools": 44, "direct": 9, "fallback": 2}
    dynamic = run_workload("dynamic", "suite", SUITE)
    assert dynamic.main_tool_segments > 1
    assert dynamic.summary.hit_rate < suite.summary.hit_rate


def test_eval_command_writes_json(tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "cacherouter.cli", "eval", "--workloads", "dialogue", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "SCRIPTED" in proc.stdout
    data = json.loads(out.read_text())
    assert {r["architecture"] for r in data["runs"]} == {"cacherouter", "all-tools", "dynamic"}
    assert data["models"].startswith("scripted")
    for run in data["runs"]:  # the breakdown accounts for every miss token, no more
        assert sum(run["miss_tokens_by_source"].values()) == run["prompt_tokens"] - run["cached_tokens"]
    assert "Where the miss tokens go" in proc.stdout


def _cacherouter(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "cacherouter.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("command", [("eval", "--workloads", "dialogue"), ("eval", "relevance", "--rankers", "bm25")])
@pytest.mark.parametrize("where", ["a directory", "a missing directory"])
def test_eval_refuses_an_unwritable_json_path_before_the_run(tmp_path, command, where):
    path = tmp_path if where == "a directory" else tmp_path / "missing" / "figures.json"
    proc = _cacherouter(*command, "--json", str(path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"cacherouter: --json {path}: ")
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""  # refused before the run, not after it


@pytest.mark.parametrize("command", [("eval", "--workloads", "dialogue"), ("eval", "relevance", "--rankers", "bm25")])
def test_eval_reports_a_failed_json_write_in_one_line(command):
    proc = _cacherouter(*command, "--json", "/dev/full")  # passes the checks, then the write fails (ENOSPC)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "cacherouter: --json /dev/full: cannot write the figures (No space left on device)\n"
    assert proc.stdout  # the figures were printed all the same


def test_eval_relevance_refuses_options_of_the_full_evaluation(tmp_path):
    out = tmp_path / "figures.json"
    proc = _cacherouter("eval", "--workloads", "suite", "--json", str(out), "relevance")
    assert proc.returncode == 2
    assert proc.stderr.startswith("cacherouter: --json and --workloads given before 'relevance' would be ignored")
    assert "cacherouter eval relevance --json PATH" in proc.stderr
    assert proc.stdout == ""
    assert not out.exists()


@pytest.mark.parametrize("top_k", ["0", "-3"])
def test_eval_relevance_needs_a_top_k_of_at_least_one(top_k):
    proc = _cacherouter("eval", "relevance", "--rankers", "bm25", "--top-k", top_k)
    assert proc.returncode == 2
    assert f"argument --top-k: must be at least 1, got {top_k}" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("option", ["--poll-interval", "--tool-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_serve_mcp_needs_positive_seconds(tmp_path, option, value):
    proc = _cacherouter("serve-mcp", "--repo", str(tmp_path), option, value, timeout=30)
    assert proc.returncode == 2
    assert f"argument {option}: must be a finite number of seconds more than 0, got {value}" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("value", ["0", "-2"])
def test_serve_mcp_needs_at_least_one_concurrent_call(tmp_path, value):
    proc = _cacherouter("serve-mcp", "--repo", str(tmp_path), "--max-concurrent-calls", value, timeout=30)
    assert proc.returncode == 2
    assert f"argument --max-concurrent-calls: must be at least 1, got {value}" in proc.stderr


@pytest.mark.parametrize("command", [("tools", "schema"), ("eval", "relevance", "--queries")])
def test_ctrl_c_ends_a_command_with_one_line_and_code_130(tmp_path, command):
    fifo = tmp_path / "input"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cacherouter.cli", *command, str(fifo)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as in a terminal, whatever pytest does
    )
    with open(fifo, "w"):  # returns once the command has opened its input: it is running, blocked on a read
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr == "cacherouter: interrupted\n"
    assert stdout == ""


def test_the_suite_writes_its_files_in_the_run_directory_not_in_tmp(tmp_path):
    run = tmp_path / "run"  # what the runner makes: a temporary directory holding the repository copy
    root = run / "repo"
    shutil.copytree(EVAL_REPO, root, ignore=shutil.ignore_patterns("__pycache__"))
    gateway = Gateway(GatewayConfig(root=root))
    actions = [a for q in SUITE for r in q.rounds for a in r if a.tool == "write_file" or "file" in a.arguments]
    assert len(actions) == 5
    outcomes = []
    for action in actions:
        result = gateway.call(action.tool, action.arguments)
        outcomes.append((result.ok, result.to_json().get("error")))
        # what reaches the request bytes never names the run directory, whose name is random
        assert str(run) not in json.dumps(result.to_json())
    assert outcomes == [
        (False, "error: permission denied: writes are restricted to /tmp (/root/beijing.txt)"),
        (True, None),
        (True, None),
        (True, None),
        (False, "usage: cr-calc.py EXPRESSION"),  # run without an expression, as the plan does
    ]
    assert sorted(p.name for p in run.iterdir()) == ["cr-beijing.txt", "cr-calc.py", "cr-faculty.txt", "repo"]
    assert (run / "cr-beijing.txt").read_text() == "Beijing 31.5 C"


def _recorded(usage, provider=None):
    class Fixed:
        name = "fixed"

        def complete(self, request):
            return parse_completion({"choices": [{"message": {"content": "x"}}], "usage": usage})

    ledger = Ledger()
    RecordingModel(Fixed(), ledger, provider=provider).complete(ChatRequest(messages=()))
    return ledger


def test_request_cost_is_relative_and_priced_per_provider():
    deepseek = {"prompt_tokens": 100, "prompt_cache_hit_tokens": 60, "prompt_cache_miss_tokens": 40}
    assert _recorded(deepseek).records[0].cost == pytest.approx(40 + 60 / 30)
    openai = {"prompt_tokens": 2000, "prompt_tokens_details": {"cached_tokens": 1920}}
    assert _recorded(openai, "openai").records[0].cost == pytest.approx(80 + 1920 * 0.5)
    anthropic = {"input_tokens": 10, "cache_read_input_tokens": 1000, "cache_creation_input_tokens": 50}
    ledger = _recorded(anthropic)
    assert ledger.records[0].cost == pytest.approx(10 + 1000 * 0.1 + 50 * 1.25)  # writes cost 1.25x
    summary = ledger.summary()
    assert summary.cache_write_tokens == 50
    assert summary.cost_ratio == pytest.approx((10 + 100 + 62.5) / 1060)
    # OpenAI-style fields also come from vLLM, SGLang, llama.cpp: without a configured provider, the price is unknown.
    assert _recorded(openai).records[0].cost is None
    assert _recorded(openai, "vllm").records[0].cost is None
    assert _recorded(openai).summary().cost_ratio is None


def test_provider_names_are_case_insensitive_and_unknown_ones_are_refused():
    usage = {"prompt_tokens": 100, "prompt_cache_hit_tokens": 64, "prompt_cache_miss_tokens": 36}
    assert parse_usage(usage, "DeepSeek").cached_tokens == 64
    with pytest.raises(ConfigError, match="unknown provider 'deepseek-chat'; choose one of anthropic, deepseek"):
        parse_usage(usage, "deepseek-chat")
    env = {"CACHEROUTER_MAIN_BASE_URL": "http://127.0.0.1:9", "CACHEROUTER_MAIN_MODEL": "m"}
    assert EndpointConfig.from_env("CACHEROUTER_MAIN", {**env, "CACHEROUTER_MAIN_PROVIDER": "DeepSeek"}).provider == (
        "deepseek"
    )
    with pytest.raises(ConfigError, match="CACHEROUTER_MAIN_PROVIDER: unknown provider 'deepseek-chat'"):
        EndpointConfig.from_env("CACHEROUTER_MAIN", {**env, "CACHEROUTER_MAIN_PROVIDER": "deepseek-chat"})


def test_router_endpoint_falls_back_to_the_main_settings_only_as_a_whole():
    main = {
        "CACHEROUTER_MAIN_BASE_URL": "https://api.deepseek.com",
        "CACHEROUTER_MAIN_MODEL": "deepseek-chat",
        "CACHEROUTER_MAIN_API_KEY": "main-secret",
        "CACHEROUTER_MAIN_PROVIDER": "deepseek",
    }
    fallback = EndpointConfig.from_env("CACHEROUTER_ROUTER", main)
    assert (fallback.base_url, fallback.api_key, fallback.provider) == (
        "https://api.deepseek.com",
        "main-secret",
        "deepseek",
    )
    own = {**main, "CACHEROUTER_ROUTER_BASE_URL": "http://127.0.0.1:8080/v1", "CACHEROUTER_ROUTER_MODEL": "small"}
    router = EndpointConfig.from_env("CACHEROUTER_ROUTER", own)
    assert (router.base_url, router.model, router.api_key, router.provider) == (
        "http://127.0.0.1:8080/v1",
        "small",
        "",  # the main key never goes to the router's host
        None,
    )
    with pytest.raises(ConfigError, match="CACHEROUTER_ROUTER_MODEL"):
        EndpointConfig.from_env("CACHEROUTER_ROUTER", {**main, "CACHEROUTER_ROUTER_BASE_URL": "http://127.0.0.1:1"})
