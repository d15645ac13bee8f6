import pytest
from support import add_tool, make_repo, replies_since_query

from cacherouter.channels.agent import Agent, AgentConfig
from cacherouter.channels.conversation import ChatSession
from cacherouter.channels.mainview import MainView
from cacherouter.channels.relevance import BM25, KeywordHitRatio, evaluate_ranker
from cacherouter.channels.router import Router, RouterConfig, compress_task, filter_candidates
from cacherouter.errors import ModelError, SchemaError
from cacherouter.models.accounting import Ledger, RecordingModel
from cacherouter.models.base import ChatRequest, ChatResponse, ChatToolCall, ScriptedModel, SimulatedProvider
from cacherouter.models.prompt_cache import DeepSeekCacheModel, render_message
from cacherouter.prompts import DIRECT_ANSWER, NEED_TOOLS, PLACEHOLDER_TOOL, ROUTER_TOOL, UNCERTAIN
from cacherouter.tools.gateway import Gateway, GatewayConfig
from cacherouter.tools.registry import build_registry
from cacherouter.tools.skills import SkillParam, build_skill


def _rounds(request: ChatRequest) -> int:
    last_user = max(
        i
        for i, m in enumerate(request.messages)
        if m["role"] == "user" and not str(m["content"]).startswith(("[RE-PLAN]", "[FINAL]"))
    )
    return sum(1 for m in request.messages[last_user:] if m["role"] == "assistant")


def make_agent(tmp_path, main_respond, router_respond=None, **config):
    root = make_repo(tmp_path / "repo")
    gateway = Gateway(GatewayConfig(root=root))
    ledger = Ledger()
    cache = DeepSeekCacheModel()
    main = RecordingModel(SimulatedProvider(ScriptedModel(main_respond), cache), ledger)
    router_model = RecordingModel(
        SimulatedProvider(ScriptedModel(router_respond or (lambda r: ChatResponse())), cache), ledger
    )
    view = MainView.from_registry(gateway.registry, ("base",))
    router = Router(gateway, router_model, core_tools=frozenset(view.core_tools))
    agent = Agent(gateway=gateway, main_model=main, router=router, config=AgentConfig(**config))
    return agent, ChatSession(view=view), ledger, root


def test_triage_direct_answer_uses_one_request(tmp_path):
    agent, session, ledger, _ = make_agent(tmp_path, lambda r: ChatResponse(content=f"4. {DIRECT_ANSWER}"))
    answer = agent.ask(session, "2+2?")
    assert (answer.path, answer.text, answer.rounds) == ("direct", "4.", 0)
    assert [r.channel for r in ledger.records] == ["triage"]
    assert session.compact == session.full


def test_history_repeats_the_reply_bytes_so_the_next_request_hits_through_the_output(tmp_path):
    """DeepSeek persists the end of each output as a cache boundary; rewriting the reply in history (stripping
    the triage marker) would push the next request's miss back to the start of the reply."""
    answers = iter([f"Four, since two and two make four. {DIRECT_ANSWER}", f"Six. {DIRECT_ANSWER}"])
    agent, session, ledger, _ = make_agent(tmp_path, lambda r: ChatResponse(content=next(answers)))
    first = agent.ask(session, "2+2?")
    agent.ask(session, "3+3?")
    assert first.text == "Four, since two and two make four."  # the user sees the answer without the marker
    assert session.full[1]["content"] == f"Four, since two and two make four. {DIRECT_ANSWER}"
    second = ledger.records[1].usage
    assert second.prompt_tokens is not None
    assert second.cached_tokens is not None
    tokenizer = SimulatedProvider(ScriptedModel(lambda r: ChatResponse()), DeepSeekCacheModel()).tokenizer
    new_user = len(tokenizer.encode(render_message({"role": "user", "content": "3+3?"})))
    assert second.prompt_tokens - second.cached_tokens == new_user


def test_parallel_calls_router_placeholder_and_unmatched_calls(tmp_path):
    def main(request):
        if request.channel == "triage":
            return ChatResponse(content=f"needs tools {NEED_TOOLS}")
        if _rounds(request) == 0:
            return ChatResponse(
                tool_calls=(
                    ChatToolCall(id="a", name="echo_text", arguments={"text": "x"}),
                    ChatToolCall(id="b", name=ROUTER_TOOL, arguments={"task": "weather report for a city"}),
                    ChatToolCall(id="c", name=PLACEHOLDER_TOOL, arguments={"intent_summary": "x"}),
                    ChatToolCall(id="d", name="no_such_tool", arguments={}),
                )
            )
        return ChatResponse(content="all done")

    def router(request):
        assert "echo_text" not in request.tools_json  # yellowlist keeps core tools out of the router
        return ChatResponse(tool_calls=(ChatToolCall(id="r", name="city_weather", arguments={"text": "Paris"}),))

    agent, session, ledger, _ = make_agent(tmp_path, main, router)
    answer = agent.ask(session, "do things")
    assert answer.path == "tools"
    assert answer.router_calls == 1
    tool_messages = [m for m in session.full if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_messages] == ["a", "b", "c", "d"]
    assert "city_weather:Paris" in tool_messages[1]["content"]
    assert "cannot be called" in tool_messages[2]["content"]
    assert "no tool" in tool_messages[3]["content"]
    assert [c.ok for c in answer.calls] == [True, True, False, False]
    assert {r.channel for r in ledger.records} == {"triage", "main", "router"}


def test_errors_penalty_deep_thinking_and_honest_fallback(tmp_path):
    def main(request):
        if request.channel == "triage":
            return ChatResponse(content=NEED_TOOLS)
        if request.channel == "fallback":
            return ChatResponse(content="The city is unknown.")
        return ChatResponse(
            tool_calls=(ChatToolCall(id=f"c{_rounds(request)}", name="echo_text", arguments={"text": "no such file"}),)
        )

    agent, session, _, _ = make_agent(tmp_path, main, round_limit=4, extended_round_limit=6)
    answer = agent.ask(session, "impossible")
    assert answer.path == "fallback"
    assert answer.text.startswith(UNCERTAIN)
    assert answer.errors == answer.rounds == 3  # implicit errors: each round costs two of the 6-round budget
    assert answer.deep_thinking
    assert any(str(m["content"]).startswith("[RE-PLAN]") for m in session.full)
    assert session.full[-1]["content"] == "The city is unknown."  # history keeps the model's bytes


def test_slow_execution_triggers_deep_thinking(tmp_path):
    ticks = iter(range(0, 1000, 100))

    def main(request):
        if request.channel == "triage":
            return ChatResponse(content=NEED_TOOLS)
        if _rounds(request) < 2:
            return ChatResponse(tool_calls=(ChatToolCall(id="x", name="show_time", arguments={}),))
        return ChatResponse(content="ok")

    agent, session, _, _ = make_agent(tmp_path, main)
    agent.clock = lambda: float(next(ticks))
    answer = agent.ask(session, "slow")
    assert answer.deep_thinking == ("more than 60s spent",)


def test_session_persisted_and_resumed_with_the_same_view(tmp_path):
    agent, session, _, root = make_agent(
        tmp_path, lambda r: ChatResponse(content="hi"), sessions_dir=tmp_path / "sessions"
    )
    agent.ask(session, "hello")
    add_tool(root, "base", "new", "new_core_tool")  # the core package grows: a new view would differ
    agent.gateway.poll()
    loaded = ChatSession.load(tmp_path / "sessions", session.id)
    assert loaded.view.tools_json == session.view.tools_json
    assert loaded.full == session.full
    assert MainView.from_registry(agent.gateway.registry, ("base",)).tools_json != loaded.view.tools_json


def test_tool_segment_is_byte_identical_across_reloads_skills_and_restarts(tmp_path):
    def main(request):
        if request.channel == "triage":
            return ChatResponse(content=NEED_TOOLS)
        if _rounds(request) == 0:
            return ChatResponse(tool_calls=(ChatToolCall(id="r", name=ROUTER_TOOL, arguments={"task": "stock price"}),))
        return ChatResponse(content="done")

    agent, session, ledger, root = make_agent(
        tmp_path, main, lambda r: ChatResponse(tool_calls=(ChatToolCall(id="s", name="stock_price", arguments={}),))
    )
    agent.ask(session, "q1")
    add_tool(root, "tail", "more", "more_tool")  # hot reload
    (root / "tail" / "weather" / "city_weather.py").write_text("import argparse\nbroken(\n")  # broken script
    agent.gateway.poll()
    agent.ask(session, "q2")
    build_skill(
        root,
        name="say_hi",
        description="Say hi.",
        params=[SkillParam(name="who", default="x")],
        body="print('hi', args.who)",
        check_arguments={"who": "y"},
    )  # bootstrapped skill
    agent.gateway.close()
    agent.gateway = Gateway(GatewayConfig(root=root))  # gateway restart
    agent.router.gateway = agent.gateway
    agent.ask(session, "q3")
    assert "say_hi" in agent.gateway.registry.tools
    main_digests = {r.tools_digest for r in ledger.records if r.channel in ("triage", "main", "fallback")}
    assert len(main_digests) == 1
    assert len([r for r in ledger.records if r.channel != "router"]) == 9


def _unanswered(messages):
    """Tool-call ids with no tool message answering them: an OpenAI-compatible API refuses such a history."""
    pending = set()
    for message in messages:
        pending |= {call["id"] for call in message.get("tool_calls") or ()}
        if message["role"] == "tool":
            pending.discard(message["tool_call_id"])
    return pending


def test_triage_is_direct_only_on_the_marker_without_tool_calls(tmp_path):
    """Providers such as llama.cpp may ignore tool_choice="none"; a reply without DIRECT_ANSWER is not an answer."""
    triage_replies = iter(
        [
            ChatResponse(tool_calls=(ChatToolCall(id="t1", name="echo_text", arguments={"text": "x"}),)),
            ChatResponse(content="Let me look that up for you."),  # no marker at all
            ChatResponse(content=f"Maybe. {DIRECT_ANSWER} {NEED_TOOLS}"),
            ChatResponse(
                content=f"4. {DIRECT_ANSWER}", tool_calls=(ChatToolCall(id="t2", name="show_time", arguments={}),)
            ),
        ]
    )

    def main(request):
        if request.channel == "triage":
            return next(triage_replies)
        return ChatResponse(content="from the loop")

    agent, session, ledger, _ = make_agent(tmp_path, main)
    for query in ("echo x", "weather in Paris now", "hmm", "2+2?"):
        answer = agent.ask(session, query)
        assert (answer.path, answer.text) == ("tools", "from the loop")
    assert [r.channel for r in ledger.records] == ["triage", "main"] * 4
    assert _unanswered(session.full) == set()
    assert not any(m.get("tool_calls") for m in session.full)  # the discarded triage replies are not stored


def test_unanswered_tool_calls_get_placeholder_results_when_stored_and_loaded(tmp_path):
    def main(request):
        if request.channel == "triage":
            return ChatResponse(content=NEED_TOOLS)
        if request.channel == "fallback":  # tool calls where none can run
            return ChatResponse(content="", tool_calls=(ChatToolCall(id="f1", name="echo_text", arguments={}),))
        return ChatResponse(tool_calls=(ChatToolCall(id=f"c{_rounds(request)}", name="show_time", arguments={}),))

    agent, session, _, _ = make_agent(tmp_path, main, round_limit=1, extended_round_limit=2)
    answer = agent.ask(session, "impossible")
    assert answer.path == "fallback"
    assert _unanswered(session.full) == set()
    fallback = next(i for i, m in enumerate(session.full) if any(c["id"] == "f1" for c in m.get("tool_calls") or ()))
    assert session.full[fallback] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "f1", "type": "function", "function": {"name": "echo_text", "arguments": "{}"}}],
    }  # the model's reply, byte for byte
    placeholder = session.full[fallback + 1]
    assert (placeholder["role"], placeholder["tool_call_id"]) == ("tool", "f1")
    assert '"status":"error"' in placeholder["content"]

    # A session saved before this rule: the dangling call is answered on load, nothing else changes.
    old = ChatSession(view=session.view)
    call = {"id": "x1", "type": "function", "function": {"name": "echo_text", "arguments": "{}"}}
    old.full = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "user", "content": "next"},
    ]
    old.save(tmp_path / "old")
    loaded = ChatSession.load(tmp_path / "old", old.id)
    assert [m["role"] for m in loaded.full] == ["user", "assistant", "tool", "user"]
    assert loaded.full[1] == old.full[1]
    assert _unanswered(loaded.full) == set()


def test_a_model_failure_after_tools_ran_keeps_the_partial_turn(tmp_path):
    """A 503 in round 2: the tool of round 1 already ran (side effects), so the stored session and the model's
    next request must say so, with every tool call answered."""

    def main(request):
        if request.channel == "triage":
            return ChatResponse(content=NEED_TOOLS)
        if replies_since_query(request.messages) == 0:
            return ChatResponse(tool_calls=(ChatToolCall(id="w1", name="echo_text", arguments={"text": "written"}),))
        raise ModelError("http://provider/chat/completions answered HTTP 503: overloaded")

    sessions = tmp_path / "sessions"
    agent, session, _, _ = make_agent(tmp_path, main, sessions_dir=sessions)
    with pytest.raises(ModelError, match="503"):
        agent.ask(session, "write it")
    loaded = ChatSession.load(sessions, session.id)
    assert [m["role"] for m in loaded.full] == ["user", "assistant", "tool", "assistant"]
    assert "echo_text:written" in loaded.full[2]["content"]
    note = loaded.full[3]["content"]
    assert note.startswith("[TURN ABORTED]")
    assert "503" in note
    assert _unanswered(loaded.full) == set()
    assert [m["role"] for m in loaded.compact] == ["user", "assistant"]  # triage learns the tool ran, too
    assert "echo_text" in loaded.compact[1]["content"]
    assert loaded.turns == [{"query": "write it", "answer": note, "path": "aborted"}]

    # The resumed session's next requests carry the note (triage) and the tool result with it (the loop).
    agent.main.inner.inner._respond = lambda r: ChatResponse(content=NEED_TOOLS if r.channel == "triage" else "Yes.")
    agent.ask(loaded, "did the write happen?")
    triage, loop = (request.messages for request in agent.main.inner.inner.requests[-2:])
    assert triage[2]["content"] == note
    assert list(loop[1:5]) == loaded.full[:4]


def test_a_model_failure_before_any_tool_ran_stores_nothing(tmp_path):
    def main(request):
        if request.channel == "triage":
            return ChatResponse(content=NEED_TOOLS)
        raise ModelError("answered HTTP 503")

    agent, session, _, _ = make_agent(tmp_path, main, sessions_dir=tmp_path / "sessions")
    with pytest.raises(ModelError):
        agent.ask(session, "q")
    assert (session.full, session.compact, session.turns) == ([], [], [])
    assert not (tmp_path / "sessions").exists()


def test_router_never_runs_a_tool_whose_arguments_are_not_a_json_object(tmp_path):
    router_calls = iter(
        [
            ChatToolCall(id="r1", name="city_weather", arguments={}, raw_arguments='{"text": "Paris", "x": tru'),
            ChatToolCall(id="r2", name="city_weather", arguments={}, raw_arguments='"Paris"'),
        ]
    )
    agent, _, _, _ = make_agent(
        tmp_path, lambda r: ChatResponse(), lambda r: ChatResponse(tool_calls=(next(router_calls),))
    )
    for _ in range(2):
        outcome = agent.router.route("weather report for a city")
        assert outcome.status == "retry"
        assert outcome.tool is None
        assert "stdout" not in outcome.payload  # the tool never ran
        assert "not a JSON object" in outcome.payload["reason"]


def _main_with_replies(*loop_replies):
    """Triage needs tools; the loop answers with ``loop_replies`` in order, then ``final`` on the fallback."""
    replies = iter(loop_replies)

    def main(request):
        if request.channel == "triage":
            return ChatResponse(content=NEED_TOOLS)
        if request.channel == "fallback":
            return ChatResponse(content="Nothing certain.")
        return next(replies)

    return main


def test_a_cut_off_or_empty_reply_is_not_an_answer(tmp_path):
    cut = ChatResponse(content="The capital of France is Pa", finish_reason="length")
    agent, session, _, _ = make_agent(tmp_path, _main_with_replies(cut, ChatResponse(content="Paris.")))
    answer = agent.ask(session, "capital of France?")
    assert (answer.path, answer.text, answer.rounds) == ("tools", "Paris.", 2)
    sent = agent.main.inner.inner.requests[-1].messages
    assert sent[-2] == {"role": "assistant", "content": "The capital of France is Pa"}  # the model's own bytes
    assert sent[-1]["role"] == "user"
    assert sent[-1]["content"].startswith("[INCOMPLETE]")
    assert "cut off" in sent[-1]["content"]

    unanswered = (
        ChatResponse(content="", finish_reason="content_filter"),
        ChatResponse(content="", finish_reason="stop"),
        ChatResponse(content=NEED_TOOLS),  # only a marker: nothing to show the user
    )
    for case, reply in enumerate(unanswered):
        agent, session, _, _ = make_agent(
            tmp_path / str(case), _main_with_replies(reply, ChatResponse(content="Done."))
        )
        answer = agent.ask(session, "q")
        assert (answer.path, answer.text) == ("tools", "Done.")
        assert _unanswered(session.full) == set()
        assert all(m.get("content") or m.get("tool_calls") for m in session.full if m["role"] == "assistant")


def test_a_model_that_never_answers_ends_in_the_honest_fallback(tmp_path):
    cut = ChatResponse(content="Well, first of all", finish_reason="length")
    agent, session, _, _ = make_agent(tmp_path, _main_with_replies(*[cut] * 10), round_limit=2, extended_round_limit=4)
    answer = agent.ask(session, "q")
    assert answer.path == "fallback"
    assert answer.text == f"{UNCERTAIN} Nothing certain."
    assert answer.rounds == 2  # each unanswered round costs two of the budget


def test_triage_that_was_cut_off_goes_to_the_tool_loop(tmp_path):
    triage = iter(
        [
            ChatResponse(content=f"4 {DIRECT_ANSWER} and furthermore the", finish_reason="length"),
            ChatResponse(content=DIRECT_ANSWER),  # the marker and nothing else: no answer
            ChatResponse(content=f"Flagged. {DIRECT_ANSWER}", finish_reason="content_filter"),
        ]
    )

    def main(request):
        if request.channel == "triage":
            return next(triage)
        return ChatResponse(content="from the loop")

    agent, session, ledger, _ = make_agent(tmp_path, main)
    for query in ("a", "b", "c"):
        assert agent.ask(session, query).path == "tools"
    assert [r.channel for r in ledger.records] == ["triage", "main"] * 3


def test_the_last_triage_marker_decides(tmp_path):
    triage = iter(
        [
            ChatResponse(content=f"<think>Do I need {NEED_TOOLS}? No, it is arithmetic.</think> 4 {DIRECT_ANSWER}"),
            ChatResponse(content=f"<think>Could I say {DIRECT_ANSWER}? No, live data.</think> {NEED_TOOLS}"),
        ]
    )

    def main(request):
        if request.channel == "triage":
            return next(triage)
        return ChatResponse(content="from the loop")

    agent, session, _, _ = make_agent(tmp_path, main)
    assert agent.ask(session, "2+2?").path == "direct"
    assert agent.ask(session, "weather now?").path == "tools"


def test_skill_builder_refuses_taken_and_reserved_names_and_takes_any_description(tmp_path):
    root = make_repo(tmp_path / "repo")
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    for name, reason in (("echo_text", "already taken by base/echo/echo_text.py"), ("internal_router", "reserved")):
        with pytest.raises(SchemaError, match=reason):
            build_skill(root, name=name, description="d", params=[], body="print(1)", check_arguments={})
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before  # nothing written

    description = 'Say "hi" \\ and """ quotes'
    build_skill(root, name="say_quoted", description=description, params=[], body="print(1)", check_arguments={})
    registry = build_registry(root)
    assert registry.tools["say_quoted"].description == description
    assert registry.problems == ()


def test_router_filter_stages():
    registry = build_registry(make_repo_path())
    tools = list(registry)
    core = frozenset({"echo_text", "show_time"})
    config = RouterConfig(top_k=5, ranker="bm25")  # a lexical scorer, so exactly one tool matches "back" below
    assert filter_candidates("weather for a city", tools, config=config, core_tools=core)[0].name == "city_weather"
    black = RouterConfig(blacklist=frozenset({"city_weather"}))
    assert "city_weather" not in [
        t.name for t in filter_candidates("weather city", tools, config=black, core_tools=core)
    ]
    white = RouterConfig(whitelist=frozenset({"stock_price"}))
    assert [t.name for t in filter_candidates("stock price weather", tools, config=white, core_tools=core)] == [
        "stock_price"
    ]
    # only a core tool matches: the yellowlist keeps the top-1 rather than leave nothing
    assert [t.name for t in filter_candidates("back", tools, config=config, core_tools=core)] == ["echo_text"]
    assert len(filter_candidates("x", tools, config=RouterConfig(filtering=False), core_tools=core)) == len(tools)


def test_compress_task_is_bounded():
    summary = compress_task("convert the file " * 10, [f"context line {i} " * 20 for i in range(20)])
    assert len(summary) <= 800
    assert summary.startswith("convert the file")
    assert len(compress_task("x" * 5000)) == 800


def make_repo_path():
    import tempfile
    from pathlib import Path

    return make_repo(Path(tempfile.mkdtemp()) / "repo")


LABELLED = [
    ("what's the weather like in Paris", "city_weather"),
    ("stock_price for AAPL", "stock_price"),
    ("repeat this text back to me", "echo_text"),
    ("current time please", "show_time"),
    ("how much is one share of tesla (ticker TSLA)", "stock_price"),
    ("city_weather Oslo", "city_weather"),
]


def test_bm25_with_name_boost_is_at_least_as_good_as_keyword_ratio():
    tools = list(build_registry(make_repo_path()))
    keyword = evaluate_ranker(KeywordHitRatio(), LABELLED, tools)
    bm25 = evaluate_ranker(BM25(), LABELLED, tools)
    assert bm25.hit_at_1 >= keyword.hit_at_1
    assert bm25.mrr >= keyword.mrr
    assert bm25.hit_at_1 >= 4 / 6
